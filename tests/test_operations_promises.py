"""Promises of README "Scaling out", "Metrics" and "Lifecycle" (shutdown, freeing a closed
session) that no other test held the code to: found by hand mutation testing of
signaling/workers.py, front.py, metrics.py, shutdown.py and release.py. Each test fails with
one plausible change to that code and passes on the code as it is."""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiortc import RTCPeerConnection
from prometheus_client.parser import text_string_to_metric_families

from agent.config import (
    Config,
    LifecycleSettings,
    LimitSettings,
    OpusSettings,
    SecuritySettings,
)
from agent.conversation_config import ListenSettings
from signaling.app import STATUS_PATH
from signaling.auth import mint_token
from signaling.front import _serve_front, workers_refusal
from signaling.keys import DRAIN, SESSIONS
from signaling.metrics import Metrics
from signaling.release import close_peer_connection
from signaling.shutdown import Drain, drain
from signaling.workers import Worker, WorkerPool
from tests.conftest import LiveServer
from tests.rtc_client import RtcClient, opus_fmtp_rewriter
from tests.test_release import collector_off, speak_and_end, watch_session
from tests.test_shutdown import an_offer
from tests.test_worker_routing import _Exited, _Running, front_and_worker

pytestmark = pytest.mark.timeout(60)

NO_LISTEN = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))


class _Process:
    """A worker process stand-in that records the signals the pool sends it."""

    pid = 1
    exitcode: int | None = None

    def __init__(self, stops_on_sigterm: bool = True) -> None:
        self.signals: list[str] = []
        self.running = True
        self.stops_on_sigterm = stops_on_sigterm

    def is_alive(self) -> bool:
        return self.running

    def terminate(self) -> None:
        self.signals.append("TERM")
        if self.stops_on_sigterm:
            self.running = False

    def kill(self) -> None:
        self.signals.append("KILL")
        self.running = False

    def join(self, timeout: float | None = None) -> None:
        if self.running:
            time.sleep(min(timeout or 0.05, 0.05))


# --- workers.py --------------------------------------------------------------------------------
async def test_a_worker_that_keeps_dying_is_restarted_with_a_growing_back_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: a worker that dies is started again at once, with a back-off if it keeps
    dying; one that lived a while before dying starts the back-off over."""
    import signaling.workers as workers

    pool = WorkerPool(Config(workers=1), lambda c: None, tmp_path)  # type: ignore[arg-type,return-value]
    worker = pool.workers[0]
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(workers, "asyncio", NS(sleep=sleep))

    def spawn(w: Worker) -> None:  # as _spawn records it, without a process
        w.started_at = time.monotonic()
        w.process = _Exited()  # type: ignore[assignment]

    monkeypatch.setattr(pool, "_spawn", spawn)
    spawn(worker)
    for _ in range(6):  # six quick deaths in a row
        await pool._restart(worker)
    assert waits == [1.0, 2.0, 5.0, 10.0, 10.0]  # the first one at once
    waits.clear()
    worker.started_at -= 100  # the restarted worker lived 100 s, then died
    await pool._restart(worker)
    await pool._restart(worker)  # ... and then died at once
    assert waits == [1.0]
    assert worker.restarts == 8


@contextlib.asynccontextmanager
async def stub_workers(
    *apps: web.Application, config: Config | None = None
) -> AsyncIterator[tuple[str, WorkerPool]]:
    """The front on a localhost port, routing to ``apps`` (stub workers, in this loop)."""
    pools: list[WorkerPool] = []
    config = config or Config(host="127.0.0.1", port=0)
    async with front_and_worker(config, pools=pools, stubs=apps, process=_Process) as url:
        yield url, pools[0]


def status_app(answer: dict[str, Any]) -> web.Application:
    """A worker whose status says ``answer`` (``{"broken": True}``: no JSON at all)."""

    async def status(request: web.Request) -> web.Response:
        if answer.get("broken"):
            return web.Response(text="<html>", content_type="text/html")
        return web.json_response(answer)

    app = web.Application()
    app.router.add_get(STATUS_PATH, status)
    return app


async def test_a_worker_that_stops_answering_its_status_takes_no_new_sessions() -> None:
    """A ready worker whose status poll fails (stuck, restarting) is ready no longer: new
    sessions must not be routed to it, nor /readyz count it."""
    answer: dict[str, Any] = {"ready": True, "sessions": 0}
    async with stub_workers(status_app(answer)) as (url, pool), aiohttp.ClientSession() as http:
        worker = pool.workers[0]
        await pool._poll(worker)
        assert worker.ready
        answer["broken"] = True
        await pool._poll(worker)
        assert pool.for_new_session(None) is None
        async with http.get(url + "/readyz") as resp:
            assert resp.status == 503, await resp.text()


async def test_a_worker_that_answers_unready_is_not_taken_for_a_wedged_one() -> None:
    """A worker that was ready and now answers its status saying it takes no sessions (its
    breaker opened, it is draining) is answering: one poll that fails later must not find it
    silent since it was last ready, and kill it with its live sessions."""
    answer: dict[str, Any] = {"ready": True, "sessions": 1}
    async with stub_workers(status_app(answer)) as (_url, pool):
        pool.wedged_s = 0.5
        worker = pool.workers[0]
        await pool._poll(worker)
        answer["ready"] = False  # e.g. its circuit breaker opened
        for _ in range(8):  # answering, unready, for 0.8 s
            await asyncio.sleep(0.1)
            await pool._poll(worker)
        answer["broken"] = True  # one poll fails
        await pool._poll(worker)
        assert worker.process is not None
        assert worker.process.signals == []  # type: ignore[attr-defined]


async def test_new_sessions_follow_the_load_each_worker_reports() -> None:
    """README: other new sessions go to the least-loaded worker, "sessions counted by a
    once-a-second status poll plus the offers routed since": a worker whose sessions ended
    is the least loaded again at its next poll."""
    loads: list[dict[str, Any]] = [{"ready": True, "sessions": 3}, {"ready": True, "sessions": 1}]
    async with stub_workers(status_app(loads[0]), status_app(loads[1])) as (_url, pool):
        for worker in pool.workers:
            await pool._poll(worker)
        first = pool.for_new_session(None)
        loads[0]["sessions"], loads[1]["sessions"] = 0, 4  # worker 0's sessions hung up
        for worker in pool.workers:
            await pool._poll(worker)
        second = pool.for_new_session(None)
    assert (first, second) == (pool.workers[1], pool.workers[0])


def test_an_id_naming_the_worker_past_the_last_names_none(tmp_path: Path) -> None:
    """``w3-...`` with workers 0-2: 404 unknown_session, not an IndexError (a 500)."""
    pool = WorkerPool(Config(workers=3), lambda c: None, tmp_path)  # type: ignore[arg-type,return-value]
    assert pool.for_session("w3-" + "a" * 32) is None


async def test_closing_the_pool_sigterms_every_worker_then_kills_a_stuck_one(
    tmp_path: Path,
) -> None:
    """Shutdown: each worker gets SIGTERM (it drains its speech and exits 0); one still
    running at the deadline is killed, so the front's exit is bounded."""
    pool = WorkerPool(Config(workers=2), lambda c: None, tmp_path)  # type: ignore[arg-type,return-value]
    draining, stuck = _Process(), _Process(stops_on_sigterm=False)
    pool.workers[0].process = draining  # type: ignore[assignment]
    pool.workers[1].process = stuck  # type: ignore[assignment]
    async with asyncio.timeout(10):
        await pool.close(timeout_s=0.3)
    assert (draining.signals, stuck.signals) == (["TERM"], ["TERM", "KILL"])


async def test_a_respawned_worker_starts_from_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted worker is a new process still loading: not ready, no refusal from its
    predecessor passed on, its predecessor's sessions unknown (404), and not taken for a
    wedged one however long ago its predecessor last answered."""
    pool = WorkerPool(Config(workers=1), lambda c: None, tmp_path)  # type: ignore[arg-type,return-value]
    process = _Process()
    monkeypatch.setattr(pool._context, "Process", lambda **kwargs: NS(start=lambda: None, pid=2))
    worker = pool.workers[0]
    worker.ready = True
    worker.sessions = 5
    worker.status = {"ready": False, "refusal": {"code": "engine_failed", "message": "old"}}
    worker.answered_at = time.monotonic() - 100
    pool._spawn(worker)
    try:
        worker.process = process  # type: ignore[assignment]
        assert pool.for_new_session(None) is None
        assert workers_refusal(pool.workers) is None  # not_ready while it loads
        assert not worker.answered_at  # its sessions: 404 unknown_session
        pool.wedged_s = 30.0
        pool._kill_if_wedged(worker)
        assert process.signals == []
    finally:
        await worker.close_clients()


@pytest.mark.parametrize(("threads", "each"), [(0, 0), (-1, 4), (2, 2)])
async def test_each_worker_gets_its_share_of_encode_threads_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int, each: int
) -> None:
    """README --encode-threads: 0 is none (on the loop), -1 one per core but one, with
    --workers each worker's share; a number is that number."""
    import signaling.workers as workers

    spawned: list[Config] = []

    def process(**kwargs: Any) -> Any:
        spawned.append(kwargs["args"][0])
        return NS(start=lambda: None, pid=2)

    monkeypatch.setattr(workers, "cores", lambda: 9)
    config = Config(workers=2, opus=OpusSettings(encode_threads=threads))
    pool = WorkerPool(config, lambda c: None, tmp_path)  # type: ignore[arg-type,return-value]
    monkeypatch.setattr(pool._context, "Process", process)
    pool._spawn(pool.workers[0])
    await pool.workers[0].close_clients()
    assert spawned[0].opus.encode_threads == each


# --- front.py ----------------------------------------------------------------------------------
async def test_a_burst_of_offers_spreads_over_the_workers() -> None:
    """README: new sessions go to the least-loaded worker, counted by the last status poll
    plus the offers routed since: two offers within one poll interval land on two workers."""
    offer = await an_offer()
    async with (
        front_and_worker(NO_LISTEN, workers=2) as url,
        aiohttp.ClientSession() as http,
    ):
        landed = []
        for _ in range(2):
            async with http.post(url + "/offer", json={"type": "offer", "sdp": offer}) as resp:
                assert resp.status == 200, await resp.text()
                landed.append((await resp.json())["session_id"][:3])
    assert sorted(landed) == ["w0-", "w1-"], landed


async def test_a_whep_post_that_is_no_sdp_uses_up_no_offer() -> None:
    """As in one process, a WHEP post that is not application/sdp gets the worker's 415
    and does not count against the client's offer rate."""
    config = replace(NO_LISTEN, limits=LimitSettings(offer_rate=0.01, offer_burst=1))
    async with front_and_worker(config) as url, aiohttp.ClientSession() as http:
        got = []
        for _ in range(2):
            headers = {"Content-Type": "text/plain"}
            async with http.post(url + "/whep", data="v=0", headers=headers) as resp:
                got.append((resp.status, (await resp.json())["error"]["code"]))
        async with http.post(url + "/offer", json={"type": "offer", "sdp": "v=0"}) as resp:
            got.append((resp.status, (await resp.json())["error"]["code"]))
    assert got == [(415, "unsupported_media_type")] * 2 + [(400, "no_audio")], got


async def test_a_whep_resume_during_the_front_s_drain_is_refused_and_counted_as_one() -> None:
    """README, Shutdown: resumes get 503 shutting_down while draining, WHEP resumes
    (X-Session-Token) as much as /offer's; and voice_agent_resumes_total, not
    voice_agent_offers_total, counts them (the front's own refusals with worker="front")."""
    pools: list[WorkerPool] = []
    apps: list[web.Application] = []
    offer = await an_offer()
    async with (
        front_and_worker(NO_LISTEN, workers=2, pools=pools, apps=apps) as url,
        aiohttp.ClientSession() as http,
    ):
        for app in apps:
            app[DRAIN].draining = True
        pools[0].workers[0].process = _Exited()  # type: ignore[assignment]  # drained, gone
        headers = {"Content-Type": "application/sdp", "X-Session-Token": "w0-" + "b" * 43}
        async with http.post(url + "/whep", data=offer, headers=headers) as resp:
            got = (resp.status, (await resp.json())["error"]["code"])
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
    assert got == (503, "shutting_down"), got
    counted = {
        (s.name, s.labels.get("kind"), s.labels.get("outcome"))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("worker") == "front" and s.value and s.name.endswith("_total")
    }
    assert counted == {("voice_agent_resumes_total", "whep", "rejected_shutting_down")}, counted


def _refusing(code: str, retry_after: int | None = None) -> Worker:
    worker = Worker(0, "/nowhere")
    worker.process = _Running()  # type: ignore[assignment]
    refusal: dict[str, Any] = {"code": code, "message": code}
    if retry_after is not None:
        refusal["headers"] = {"Retry-After": str(retry_after)}
    worker.status = {"ready": False, "refusal": refusal}
    return worker


def test_the_soonest_retry_after_of_the_workers_open_breakers_is_passed_on() -> None:
    refusal = workers_refusal([_refusing("tts_unavailable", 30), _refusing("tts_unavailable", 5)])
    assert refusal is not None and refusal.code == "tts_unavailable"
    assert refusal.headers["Retry-After"] == "5"


def test_a_dead_worker_s_last_refusal_is_not_passed_on() -> None:
    """A worker that died (restarting: it may load this time) gives no reason: not_ready."""
    dead = _refusing("engine_failed")
    dead.process = _Exited()  # type: ignore[assignment]
    assert workers_refusal([dead, _refusing("engine_failed")]) is None


def echo_app() -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"forwarded_for": request.headers.getall("X-Forwarded-For", [])})

    app = web.Application()
    app.router.add_route("*", "/sessions/{id}", echo)
    return app


async def test_the_worker_is_told_the_client_s_address_and_no_forged_one() -> None:
    """The workers' per-client speech rate, logs and mDNS candidates use the address the
    front puts in X-Forwarded-For: it must be the client's, replacing any the client sent
    (a forged one would let a client pick its own rate bucket)."""
    async with stub_workers(echo_app()) as (url, _pool), aiohttp.ClientSession() as http:
        seen = []
        for headers in ({}, {"X-Forwarded-For": "203.0.113.9"}):
            async with http.get(url + "/sessions/w0-abc", headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                seen.append((await resp.json())["forwarded_for"])
    assert seen == [["127.0.0.1"], ["127.0.0.1"]], seen


async def test_the_metrics_count_the_workers_restarts() -> None:
    """README: /metrics has voice_agent_worker_restarts_total."""
    pools: list[WorkerPool] = []
    async with (
        front_and_worker(NO_LISTEN, workers=2, pools=pools) as url,
        aiohttp.ClientSession() as http,
    ):
        pools[0].workers[0].restarts = 2
        pools[0].workers[1].restarts = 1
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
    assert "voice_agent_worker_restarts_total 3.0" in text.splitlines()


async def test_a_whep_offer_whose_token_names_a_room_goes_to_the_room_s_worker() -> None:
    """A room's participants all land in the worker that holds it: a WHEP listener whose
    token carries the room (no ?room=) too, or it joins a copy of the room elsewhere."""
    secret = "s" * 32
    config = replace(NO_LISTEN, security=SecuritySettings(auth_secret=secret))
    pools: list[WorkerPool] = []
    offer = await an_offer()
    async with (
        front_and_worker(config, workers=2, pools=pools) as url,
        aiohttp.ClientSession() as http,
    ):
        room = next(r for r in ("a", "b", "c", "d") if pools[0].for_room(r).index == 1)
        token = mint_token(secret, ttl_s=60, room=room, role="listener")
        headers = {"Content-Type": "application/sdp", "Authorization": f"Bearer {token}"}
        async with http.post(url + "/whep", data=offer, headers=headers) as resp:
            assert resp.status == 201, await resp.text()
            assert resp.headers["Location"].startswith("/whep/w1-"), resp.headers["Location"]


def dying_app(calls: list[str]) -> web.Application:
    """A worker that dies while answering an offer (its connection drops mid-request)."""

    async def offer(request: web.Request) -> web.Response:
        calls.append("offer")
        await request.read()
        assert request.transport is not None
        request.transport.abort()
        await asyncio.sleep(1)
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/offer", offer)
    return app


def answering_app(calls: list[str]) -> web.Application:
    async def offer(request: web.Request) -> web.Response:
        calls.append("offer")
        return web.json_response({"type": "answer", "session_id": "w1-abc"})

    app = web.Application()
    app.router.add_post("/offer", offer)
    return app


async def test_an_offer_its_worker_died_while_answering_is_worker_unavailable() -> None:
    """README, Scaling out: a request the worker died while answering gets 503
    worker_unavailable; only an offer that reached no worker (its connect failed) goes to the
    next one. The worker may have acted on it (a session, a room seat), so it is not sent
    again elsewhere."""
    first: list[str] = []
    second: list[str] = []
    async with (
        stub_workers(dying_app(first), answering_app(second)) as (url, _pool),
        aiohttp.ClientSession() as http,
        http.post(url + "/offer", json={"type": "offer", "sdp": "v=0"}) as resp,
    ):
        got = (resp.status, (await resp.json()).get("error", {}).get("code"))
    assert got == (503, "worker_unavailable"), got
    assert (first, second) == (["offer"], [])


# --- metrics.py --------------------------------------------------------------------------------
def _peer(pipeline: Any, *, room: str | None = None, detached: bool = False, **stats: float) -> Any:
    track = NS(stats=NS(packets=0, speech_packets=0, late_rephases=0))
    session = NS(track=track, pipeline=pipeline, stats=lambda: dict(stats))
    return NS(
        kind="offer", room=room, session=session, life=NS(detached_at=1.0 if detached else None)
    )


def _pipeline(queued: int, buffered_s: float) -> Any:
    return NS(queued=queued, buffer=NS(buffered_seconds=buffered_s, underruns=0))


@pytest.fixture
def live_metrics() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Two participants of room "r" (sharing its agent's pipeline) and a detached session."""
    shared = _pipeline(2, 1.5)
    peers = [
        _peer(shared, room="r", rtt_ms=100.0),
        _peer(shared, room="r", rtt_ms=float("nan")),  # not measured yet
        _peer(_pipeline(1, 0.5), detached=True, rtt_ms=50.0),
    ]
    metrics = Metrics(NS(ready=True, failure=None), 10)
    metrics.watch(lambda: peers)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def test_a_room_s_shared_queue_and_buffer_count_once(live_metrics: dict[Any, float]) -> None:
    assert live_metrics[("voice_agent_queued_utterances", ())] == 3
    assert live_metrics[("voice_agent_playout_buffered_seconds", ())] == 2.0


def test_rooms_and_detached_sessions_are_counted(live_metrics: dict[Any, float]) -> None:
    assert live_metrics[("voice_agent_rooms_active", ())] == 1
    assert live_metrics[("voice_agent_sessions_detached", ())] == 1


def test_a_figure_not_measured_yet_leaves_the_session_stats_alone(
    live_metrics: dict[Any, float],
) -> None:
    stat = {k[1]: v for k, v in live_metrics.items() if k[0] == "voice_agent_session_stat"}
    assert stat[(("agg", "mean"), ("stat", "rtt_ms"))] == 75.0
    assert stat[(("agg", "max"), ("stat", "rtt_ms"))] == 100.0


# --- shutdown.py -------------------------------------------------------------------------------
class _Registry:
    def __init__(self, *peers: Any) -> None:
        self._peers = list(peers)
        self.closed_at: float | None = None

    def peers(self) -> list[Any]:
        return list(self._peers)

    def __len__(self) -> int:
        return len(self._peers)

    async def close_all(self) -> None:
        self.closed_at = time.monotonic()


def _drain_peer(*, in_flight: bool, detached: bool = False, resuming: bool = False) -> Any:
    session = NS(conversation=NS(in_flight=in_flight), channel=None)
    return NS(life=NS(detached_at=1.0 if detached else None), resuming=resuming, session=session)


async def test_the_drain_waits_for_a_detached_session_whose_resume_is_being_answered() -> None:
    """README, Shutdown: a detached session is not waited for, but "one whose resume was
    already being answered is" (its client may be back in a moment to hear the speech)."""
    peer = _drain_peer(in_flight=True, detached=True, resuming=True)
    asyncio.get_running_loop().call_later(
        0.3, setattr, peer.session.conversation, "in_flight", False
    )
    registry = _Registry(peer)
    started = time.monotonic()
    finished = await drain(registry, Drain(), 3.0)  # type: ignore[arg-type]
    assert registry.closed_at is not None
    assert finished and registry.closed_at - started >= 0.25


async def test_the_drain_lets_the_last_events_leave_before_closing() -> None:
    """README, Shutdown: "the last events get up to 1 s to leave, then every peer is
    closed": speech.ended still buffered on a data channel is sent before the close."""
    peer = _drain_peer(in_flight=False)
    peer.session.channel = NS(bufferedAmount=120)
    asyncio.get_running_loop().call_later(0.1, setattr, peer.session.channel, "bufferedAmount", 0)
    registry = _Registry(peer)
    started = time.monotonic()
    await drain(registry, Drain(), 3.0)  # type: ignore[arg-type]
    assert registry.closed_at is not None
    # Waited for the events, and no longer than they took (the whole 1 s is the cap).
    assert 0.08 <= registry.closed_at - started < 0.9


# --- release.py --------------------------------------------------------------------------------
@pytest.fixture
def server_config() -> Config:
    life = LifecycleSettings(
        connect_timeout_s=5, rtcp_timeout_s=2.0, resume_grace_s=0.5, idle_timeout_s=0
    )
    return Config(host="127.0.0.1", port=0, lifecycle=life)


def _with_ice_connections(registry: Any) -> dict[str, Any]:
    watched = watch_session(registry)
    (peer,) = registry.peers()
    for index, transceiver in enumerate(peer.pc.getTransceivers()):
        connection = transceiver.sender.transport.transport._connection
        watched[f"aioice connection {index}"] = weakref.ref(connection)
    return watched


async def test_a_closed_session_s_ice_connection_is_freed_without_the_cyclic_collector(
    live_server: LiveServer,
) -> None:
    """release.py: aioice's Connection.close() leaves its check list, whose pairs' STUN
    protocols hold the connection: a cycle of its own that no watched object of
    tests/test_release.py is part of, so emptying it went untested."""
    registry = live_server.app[SESSIONS]
    async with aiohttp.ClientSession() as http:
        with collector_off():
            client = RtcClient(live_server.url, http)
            await client.connect()
            watched = _with_ice_connections(registry)
            await speak_and_end(client, registry, watched)


async def test_a_transport_cc_session_is_freed_without_the_cyclic_collector(
    live_server: LiveServer,
) -> None:
    """With transport-cc negotiated (every browser offers it) the feedback tap also wraps
    the DTLS transport's RTCP handler: the wrapper must be dropped on close too."""
    registry = live_server.app[SESSIONS]
    rewrite = opus_fmtp_rewriter("minptime=10;useinbandfec=1", transport_cc=True)
    async with aiohttp.ClientSession() as http:
        with collector_off():
            client = RtcClient(live_server.url, http)
            await client.connect(rewrite_offer=rewrite)
            (peer,) = registry.peers()
            tapped = [
                "_handle_rtcp_data" in vars(t.sender.transport) for t in peer.pc.getTransceivers()
            ]
            assert any(tapped), "transport-cc was not negotiated"
            del peer
            watched = watch_session(registry)
            await speak_and_end(client, registry, watched)


async def test_a_close_that_hangs_still_breaks_the_cycles() -> None:
    """A close given up after its deadline still has its taps dropped, or that session's
    peer connection (DTLS, SRTP, encoder) waits for a full collection."""
    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="sendonly")
    sender = pc.getTransceivers()[0].sender

    async def tap(packets: Any) -> None:
        pass

    sender._send_rtcp = tap  # type: ignore[method-assign]  # as the feedback tap wraps it

    async def hangs() -> None:
        await asyncio.Event().wait()

    pc.close = hangs  # type: ignore[method-assign]
    async with asyncio.timeout(5):
        await close_peer_connection(pc, timeout_s=0.1)
    assert "_send_rtcp" not in vars(sender)
    await RTCPeerConnection.close(pc)


async def test_a_front_whose_worker_fails_to_spawn_stops_the_ones_it_started(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The second of two workers failing to spawn (EAGAIN from fork, say) fails the
    front's start with that error, after stopping the first (SIGTERM: it drains and exits)
    and closing its HTTP clients. Before, the front exited with the first still running
    and its clients unclosed (found by review)."""
    config = Config(host="127.0.0.1", port=0, workers=2)
    pool = WorkerPool(config, lambda *_: web.Application(), tmp_path)
    terminated: list[int] = []

    class Started:
        def __init__(self, index: int) -> None:
            self.index, self.running, self.pid = index, True, 1

        def is_alive(self) -> bool:
            return self.running

        def terminate(self) -> None:
            terminated.append(self.index)
            self.running = False

        def join(self, timeout: float | None = None) -> None:
            pass

        def kill(self) -> None:
            pytest.fail("a worker that stopped on SIGTERM was killed")

    def spawn(worker: Worker) -> None:
        if worker.index == 1:
            raise OSError(11, "Resource temporarily unavailable")
        worker.process = Started(worker.index)  # type: ignore[assignment]
        worker.open_clients()

    monkeypatch.setattr(pool, "_spawn", spawn)
    with pytest.raises(OSError, match="temporarily unavailable"):
        await _serve_front(config, pool)
    assert terminated == [0]
    assert pool.workers[0].http is None and pool.workers[0].control is None
    assert pool.workers[0].scrape is None
