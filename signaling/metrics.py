"""Prometheus metrics for one app: its own CollectorRegistry (several apps can share a process).

Two kinds of figures:
- events, recorded as they happen: offers by outcome, first-audio latency;
- live state, read when /metrics is scraped by a custom collector (no background task):
  sessions, engine state, queue depths, and packet/underrun counters (the sum over open
  sessions plus what closed sessions had reached, so the counters never go down).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.engine import TTSEngine
from agent.governor import ComplexityGovernor
from agent.room import Room, RoomMember
from agent.speech import SpeechPipeline
from signaling.errors import HTTP_CODES, ApiError, Handler
from signaling.sessions import Peer

# Seconds from an utterance's synthesis start to its first packet; ChatTTS on a GPU is
# ~0.1-0.5 s, on a CPU seconds.
FIRST_AUDIO_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
# Per-session figures other parts of the server may report in AgentSession.stats(); each
# one present and numeric is summarised across open sessions.
SESSION_STATS = ("bitrate", "loss", "rtt_ms", "jitter_ms", "expected_loss_pct", "queuing_delay_ms")
# Counters that live in each session (track and playout buffer).
_COUNTERS = {
    "packets": ("voice_agent_packets_sent", "RTP audio packets sent"),
    "speech_packets": ("voice_agent_speech_packets_sent", "RTP packets that carried speech"),
    "underruns": (
        "voice_agent_underruns",
        "20 ms ticks with no speech ready while an utterance was being generated",
    ),
    "late_packets": (
        "voice_agent_late_packets",
        "times the event loop was late and the audio clock moved forward (no burst)",
    ),
}


def _peer_counters(peer: Peer) -> dict[str, int]:
    session = peer.session
    track = session.track.stats
    # A room's agent is shared by its participants: its underruns are not each one's (the
    # room's own are counted once, by _room_counters).
    shared = isinstance(session, RoomMember)
    return {
        "packets": track.packets,
        "speech_packets": track.speech_packets,
        "underruns": 0 if shared else session.pipeline.buffer.underruns,
        "late_packets": track.late_rephases,
    }


def _room_counters(room: Room) -> dict[str, int]:
    """A room's agent's counters, once per room: its playout buffer's underruns, and its
    track's late ticks (the agent's track is the one paced by the clock; a participant's
    fan-out track only forwards its packets). Left out, no room ever counted in either."""
    return {
        "underruns": room.pipeline.buffer.underruns,
        "late_packets": room.agent_track.stats.late_rephases,
    }


class Metrics:
    def __init__(self, engine: TTSEngine, max_sessions: int) -> None:
        self.registry = CollectorRegistry()
        self.offers = offers_counter(self.registry)
        self.resumes = resumes_counter(self.registry)
        self.first_audio = Histogram(
            "voice_agent_first_audio_seconds",
            "Time from an utterance's synthesis start to its first audio packet sent "
            "(engine latency plus framing and pacing; queueing excluded)",
            buckets=FIRST_AUDIO_BUCKETS,
            registry=self.registry,
        )
        self._engine = engine
        self._max_sessions = max_sessions
        self._peers: Callable[[], Iterable[Peer]] = tuple
        self._rooms: Callable[[], Iterable[Room]] = tuple
        self._governor: ComplexityGovernor | None = None
        self._retired: Tally[str] = Tally()
        self._load_errors: Sequence[str] = ()
        self.registry.register(_LiveCollector(self))

    def watch(
        self,
        peers: Callable[[], Iterable[Peer]],
        governor: ComplexityGovernor | None = None,
        rooms: Callable[[], Iterable[Room]] = tuple,
        load_errors: Sequence[str] = (),
    ) -> None:
        """Where the live sessions, rooms (and the encoders' complexity) are read from at
        scrape time; ``load_errors``: the engine's failure to load, once it failed."""
        self._peers = peers
        self._governor = governor
        self._rooms = rooms
        self._load_errors = load_errors

    def retire(self, peer: Peer) -> None:
        """A session is leaving: keep its counts so the totals never go down."""
        self._retired.update(_peer_counters(peer))

    def retire_room(self, room: Room) -> None:
        """A room is closing: keep its agent's counts. Rooms are read from the room
        registry, not through their participants: guessed from the participant leaving, a
        room whose last registered one left while another was still joining lost its
        counts from the totals (a counter going down), for good if that join failed."""
        self._retired.update(_room_counters(room))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def offer_outcome_middleware(self, kinds: dict[Handler, str], resume_header: str) -> Any:
        """Counts each new-session request's outcome, whichever layer refused it."""
        return offer_outcome_middleware(
            self.offers, self.resumes, kinds, resume_header=resume_header
        )


# Set on a POST /offer or /whep request once it is known to resume a session.
RESUMING = web.RequestKey("resuming", bool)


def offers_counter(registry: CollectorRegistry) -> Counter:
    """``voice_agent_offers_total{kind, outcome}``: a worker's and the front's, one family."""
    return Counter(
        "voice_agent_offers",
        "New-session requests (POST /offer, POST /whep) by outcome: answered or "
        "rejected_<error code>",
        ["kind", "outcome"],
        registry=registry,
    )


def resumes_counter(registry: CollectorRegistry) -> Counter:
    """``voice_agent_resumes_total{kind, outcome}``: a session's resumes, kept out of the
    offers (a flaky network's reconnects are not new sessions)."""
    return Counter(
        "voice_agent_resumes",
        "Resumes of a session on a new connection (POST /offer with 'resume', POST /whep "
        "with X-Session-Token) by outcome: answered or rejected_<error code>",
        ["kind", "outcome"],
        registry=registry,
    )


def offer_outcome_middleware(
    offers: Counter,
    resumes: Counter,
    kinds: dict[Handler, str],
    *,
    resume_header: str,
    count_answers: bool = True,
) -> Any:
    """Counts each new-session request's outcome in ``offers``, and each resume's in
    ``resumes``, whichever layer refused it: a WHEP request with ``resume_header`` is a
    resume from the start (auth, which runs inside this, refuses some); an /offer one once
    its handler has read ``resume`` in its body and marked it RESUMING. The front counts
    only what it refuses itself (``count_answers=False``): an answer it passes on was
    counted by the worker that gave it."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        kind = kinds.get(request.match_info.handler)
        if kind is None:
            return await handler(request)
        if kind == "whep" and resume_header in request.headers:
            request[RESUMING] = True
        outcome: str | None = "rejected_internal"
        try:
            response = await handler(request)
            if not count_answers:
                outcome = None
            elif response.status < 400:
                outcome = "answered"
            else:
                outcome = f"rejected_{response.status}"
            return response
        except ApiError as exc:
            outcome = f"rejected_{exc.code}"
            raise
        except web.HTTPException as exc:
            outcome = f"rejected_{HTTP_CODES.get(exc.status, 'http_error')}"
            raise
        finally:
            if outcome is not None:
                counter = resumes if request.get(RESUMING, False) else offers
                counter.labels(kind, outcome).inc()

    return middleware


class _LiveCollector:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics
        peers = list(metrics._peers())
        engine = metrics._engine

        active = GaugeMetricFamily(
            "voice_agent_sessions_active", "Open sessions by kind", labels=["kind"]
        )
        by_kind = Tally(peer.kind for peer in peers)
        for kind in ("offer", "whep"):
            active.add_metric([kind], by_kind[kind])
        yield active
        yield GaugeMetricFamily(
            "voice_agent_sessions_max", "Most concurrent sessions admitted", metrics._max_sessions
        )
        yield GaugeMetricFamily(
            "voice_agent_rooms_active",
            "Open voice rooms (a room closes with its last participant)",
            len({peer.room for peer in peers if peer.room is not None}),
        )
        yield GaugeMetricFamily(
            "voice_agent_engine_ready", "1 once the speech model is loaded", int(engine.ready)
        )
        yield GaugeMetricFamily(
            "voice_agent_engine_failed",
            "1 if the speech engine failed to load or failed after it started",
            int(engine.failure is not None or bool(metrics._load_errors)),
        )
        yield GaugeMetricFamily(
            "voice_agent_queued_utterances",
            "Utterances waiting behind the one being spoken, all sessions",
            sum(pipeline.queued for pipeline in _pipelines(peers)),
        )
        yield GaugeMetricFamily(
            "voice_agent_playout_buffered_seconds",
            "Generated audio waiting to be sent, all sessions",
            sum(pipeline.buffer.buffered_seconds for pipeline in _pipelines(peers)),
        )

        totals = Tally(metrics._retired)
        for peer in peers:
            totals.update(_peer_counters(peer))
        for room in metrics._rooms():
            totals.update(_room_counters(room))
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, totals[key])

        yield from _session_stats(peers)
        if metrics._governor is not None:
            yield from _governor_metrics(metrics._governor)
        yield GaugeMetricFamily(
            "voice_agent_sessions_detached",
            "Sessions whose peer was lost, waiting for a resume within the grace period",
            sum(1 for peer in peers if peer.life.detached_at is not None),
        )
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # rendered outside the event loop (never by the server)
            tasks = 0
        yield GaugeMetricFamily(
            "voice_agent_asyncio_tasks",
            "asyncio tasks alive in the server's event loop (back to its baseline once the "
            "sessions are gone: a leak check, see bench/soak.py)",
            tasks,
        )


def _governor_metrics(governor: ComplexityGovernor) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "voice_agent_opus_complexity",
        "libopus complexity of this process's encoders now (lowered while the CPU cannot keep "
        "up: agent/governor.py)",
        governor.complexity,
    )
    yield GaugeMetricFamily(
        "voice_agent_opus_band_cap_hertz",
        "The coded band the CPU governor caps this process's encoders at, as a playback rate: "
        "16000 wide-band (8 kHz of audio), 12000 medium-band (6 kHz); 0 while the band is full",
        governor.rung.band_cap_hz or 0,
    )
    steps = CounterMetricFamily(
        "voice_agent_opus_complexity_steps",
        "Times the encoders' complexity was stepped down (CPU overload) or back up",
        labels=["direction"],
    )
    steps.add_metric(["down"], governor.policy.steps_down)
    steps.add_metric(["up"], governor.policy.steps_up)
    yield steps
    if not governor.enabled:
        return  # a fixed complexity: nothing measures the load
    yield GaugeMetricFamily(
        "voice_agent_loop_load",
        "Share of the last half second the event-loop thread spent on the CPU, as the "
        "complexity governor saw it",
        governor.load,
    )


def _pipelines(peers: list[Peer]) -> list[SpeechPipeline]:
    """Each speech pipeline once: a room's participants share theirs."""
    return list({id(p.session.pipeline): p.session.pipeline for p in peers}.values())


def _session_stats(peers: list[Peer]) -> Iterator[Metric]:
    """Mean, min and max over open sessions of each numeric figure in session.stats()."""
    values: dict[str, list[float]] = {}
    for peer in peers:
        stats = peer.session.stats()
        for key in SESSION_STATS:
            value = stats.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    family = GaugeMetricFamily(
        "voice_agent_session_stat",
        "Per-session network figures (Opus bitrate in bit/s, smoothed loss fraction, rtt_ms, "
        "jitter_ms, expected_loss_pct (0 = FEC off), queuing_delay_ms) over open sessions",
        labels=["stat", "agg"],
    )
    for key, series in values.items():
        family.add_metric([key, "mean"], sum(series) / len(series))
        family.add_metric([key, "min"], min(series))
        family.add_metric([key, "max"], max(series))
    yield family
