"""Shared machinery of the benches: a bench server, a light recording client, the glue.

Three processes per measurement, all on one machine (they share CLOCK_MONOTONIC, so
``time.monotonic()`` values compare across them):

- the orchestrator (``bench/streams.py`` / ``bench/latency.py``) starts the two others, samples
  the server's CPU time and RSS with psutil, and prints the tables;
- a server (``python bench/_common.py server ...``): the real app from ``build_app`` with a
  bench engine (``tests.doubles.ToneEngine`` paced by ``chunk_delay_s``), a driver that keeps
  every session speaking (continuously, intermittently, or utterance by utterance after
  silence for latency), and one of three outgoing tracks:
    ``ours``      the product's ``OpusPacketTrack`` (pre-encoded 20 ms Opus packets)
                  on its lean send path (agent/direct.py),
    ``ours-aiortc`` the same track through aiortc's RTP sender task,
    ``norephase`` ``ours`` with ``rephase_on_onset=False``,
    ``default``   aiortc's default path: a track that pops the same ``PlayoutBuffer`` and
                  returns s16 48 kHz ``AudioFrame`` s paced like ``AudioStreamTrack``, so
                  aiortc encodes them itself (its Opus encoder, in its executor);
- a client (``python bench/_common.py client ...``): N aiortc peer connections in one
  process. aiortc negotiates and runs ICE, DTLS and RTCP; RTP is taken off the peers' UDP
  sockets by ``SocketPoller`` (kernel arrival timestamps, the receiver's statistics kept so
  its receiver reports stay true) and decrypted and decoded with libopus only after the
  measurement, so the load generator stays light (``--receive aiortc``: aiortc's whole
  receive path with a recorder in place of ``RTCRtpReceiver._handle_rtp_packet``).

Everything here is bench code: it patches aiortc and the agent *inside the bench's own
processes* only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fractions
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from agent.opus_rates import INPUT_RATES  # noqa: E402

SAMPLE_RATE = 48_000
FRAME = 960
INPUT_RATE_CHOICES = ("auto", *(str(rate) for rate in INPUT_RATES))  # OpusSettings.input_rate
SILENCE_RMS = 0.01  # decoded per-packet RMS below this is silence (the tone is at 0.35)
SIGNALS = ("tone", "speech")  # what the bench engine speaks (--signal)


# ==========================================================================================
# Server side
# ==========================================================================================


def _install_server_patches(variant: str) -> None:
    """Swap the session's track class and hook onset/send timestamps (server process only)."""
    from aiortc.rtcrtpsender import RTCRtpSender

    import agent.session as session_mod
    from agent.track import OpusPacketTrack

    if variant == "default":
        session_mod.OpusPacketTrack = DefaultPathTrack  # type: ignore[misc,assignment]
    elif variant == "norephase":

        class NoRephaseTrack(OpusPacketTrack):
            def __init__(self, source: Any, opus: Any = None, **kw: Any) -> None:
                super().__init__(source, opus, rephase_on_onset=False, **kw)

        session_mod.OpusPacketTrack = NoRephaseTrack  # type: ignore[misc]
    elif variant not in ("ours", "ours-aiortc"):
        raise SystemExit(f"unknown variant {variant!r}")

    # speech.started is emitted by the mark of an utterance's first frame, inside the
    # track's recv(): remember which utterance that frame belongs to.
    orig_send_event = session_mod.AgentSession.send_event

    def send_event(self: Any, event: dict[str, Any]) -> None:
        if event.get("type") == "speech.started":
            track = self.track
            now = time.monotonic()
            track.bench_onset = event["id"]
            track.bench_started_at[event["id"]] = now
            track.bench_buffered_at[event["id"]] = self.pipeline.buffer.last_arrival
            if getattr(track, "direct", False):
                # The lean path runs the frame's marks right after its packet left.
                track.bench_sent_at[event["id"]] = now
                track.bench_onset = None
        orig_send_event(self, event)

    session_mod.AgentSession.send_event = send_event  # type: ignore[method-assign]

    # The moment the sender has the encoded payload of that frame in hand; what follows
    # (RTP header, SRTP protect, sendto) is synchronous, tens of microseconds.
    orig_next = RTCRtpSender._next_encoded_frame

    async def _next_encoded_frame(self: Any, codec: Any) -> Any:
        enc = await orig_next(self, codec)
        track = self.track
        onset = getattr(track, "bench_onset", None)
        if onset is not None and enc is not None:
            track.bench_sent_at[onset] = time.monotonic()
            track.bench_onset = None
        return enc

    RTCRtpSender._next_encoded_frame = _next_encoded_frame  # type: ignore[method-assign]

    # Every track gets the bench attributes.
    for cls in (OpusPacketTrack, DefaultPathTrack):
        cls.bench_onset = None  # type: ignore[attr-defined]
    orig_init = OpusPacketTrack.__init__

    def init(self: Any, *a: Any, **kw: Any) -> None:
        orig_init(self, *a, **kw)
        self.bench_started_at = {}
        self.bench_sent_at = {}
        self.bench_buffered_at = {}

    OpusPacketTrack.__init__ = init  # type: ignore[method-assign]


def _make_default_track_class() -> type:
    from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
    from av import AudioFrame

    from agent.opus import OpusEncoder
    from agent.track import TrackStats

    time_base = fractions.Fraction(1, SAMPLE_RATE)
    zero = np.zeros((1, FRAME), dtype=np.int16)

    class _DefaultPathTrack(MediaStreamTrack):
        """aiortc's default path fed by the product pipeline: s16 mono 48 kHz AudioFrames.

        Paced exactly like ``aiortc.mediastreams.AudioStreamTrack.recv`` (wall clock from
        the first recv, ``asyncio.sleep`` until start + pts/rate); the sender then encodes
        each frame with aiortc's Opus encoder in the loop's default executor.
        """

        kind = "audio"

        def __init__(self, source: Any, opus: Any = None, **_: Any) -> None:
            super().__init__()
            self._source = source
            self._start: float | None = None
            self._pts = 0
            self.stats = TrackStats()
            # aiortc encodes this path itself (fixed 96 kbps): the session's network
            # adaptation gets an encoder to read and setters that change nothing here.
            self.encoder = OpusEncoder()
            self.bench_onset: str | None = None
            self.bench_started_at: dict[str, float] = {}
            self.bench_buffered_at: dict[str, float] = {}
            self.bench_sent_at: dict[str, float] = {}

        def set_bitrate(self, bits_per_second: int) -> None:
            pass

        def set_fec(self, enabled: bool) -> None:
            pass

        def set_expected_loss(self, percent: int) -> None:
            pass

        async def recv(self) -> AudioFrame:  # type: ignore[override]
            if self.readyState != "live":
                raise MediaStreamError
            if self._start is None:
                self._start = time.time()
                self._pts = 0
            else:
                self._pts += FRAME
                wait = self._start + self._pts / SAMPLE_RATE - time.time()
                await asyncio.sleep(wait)
            if self.readyState != "live":
                raise MediaStreamError
            frame = self._source.pop()
            pcm = zero if frame is None else frame.pcm.reshape(1, -1)
            out = AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
            out.sample_rate = SAMPLE_RATE
            out.pts = self._pts
            out.time_base = time_base
            self.stats.packets += 1
            if frame is None:
                self.stats.silence_packets += 1
            else:
                self.stats.speech_packets += 1
                for mark in frame.marks:
                    mark()
            return out

    return _DefaultPathTrack


DefaultPathTrack: Any = None  # set in serve()


SPEECH_CLIP = ROOT / "tests" / "data" / "speech.wav"
SPEECH_CLIP_RATE = 24_000  # ChatTTS's rate: the speech path runs as it does with ChatTTS
SPEECH_CLIP_PEAK = 0.5  # the tone's amplitude


def speech_clip() -> Any:
    """``tests/data/speech.wav`` (espeak-ng, 3.5 s) at 24 kHz, float32, peak 0.5."""
    import wave

    import soxr

    with wave.open(str(SPEECH_CLIP)) as clip:
        if clip.getnchannels() != 1 or clip.getsampwidth() != 2:
            raise ValueError(f"{SPEECH_CLIP}: expected mono 16-bit PCM")
        rate = clip.getframerate()
        pcm = np.frombuffer(clip.readframes(clip.getnframes()), dtype="<i2")
    audio = soxr.resample(pcm.astype(np.float32) / 32768, rate, SPEECH_CLIP_RATE)
    return (audio * (SPEECH_CLIP_PEAK / float(np.abs(audio).max()))).astype(np.float32)


def _bench_engine(opts: argparse.Namespace) -> Any:
    """The bench engine for ``--signal``: a 900 Hz-ish tone, or recorded speech looped."""
    from tests.doubles import ClipEngine, ToneEngine

    pacing = {
        "chunk_ms": opts.chunk_ms,
        "chunk_delay_s": opts.chunk_delay,
        "seconds_per_word": opts.seconds_per_word,
    }
    if opts.signal == "speech":
        return _bench_engine_class(ClipEngine)(
            clip=speech_clip(), sample_rate=SPEECH_CLIP_RATE, **pacing
        )
    return _bench_engine_class(ToneEngine)(**pacing)


def _bench_engine_class(base: type) -> type:
    class BenchEngine(base):  # type: ignore[valid-type,misc]
        """An engine that records when the first chunk of each text leaves it.

        The first word of a latency utterance is its unique token; ``first_chunk_at[token]``
        is ``time.monotonic()`` just before that chunk is yielded to the pipeline.
        """

        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.first_chunk_at: dict[str, float] = {}

        async def synthesize(
            self, text: str, voice: Any, *, continuation: bool = False
        ) -> AsyncIterator[Any]:
            token = text.split()[0] if text.split() else ""
            first = token.startswith("tok")
            gen = super().synthesize(text, voice, continuation=continuation)
            try:
                async for chunk in gen:
                    if first:
                        self.first_chunk_at[token] = time.monotonic()
                        first = False
                    yield chunk
            finally:
                await gen.aclose()

    return BenchEngine


async def _wait_until_sending(track: Any, packets: int = 10) -> None:
    while track.stats.packets < packets:
        await asyncio.sleep(0.05)


async def _wait_idle(pipeline: Any) -> None:
    while pipeline.busy:
        await asyncio.sleep(0.01)


def _words(seconds: float, seconds_per_word: float) -> str:
    return " ".join(["la"] * max(1, round(seconds / seconds_per_word)))


async def _drive(peer: Any, index: int, opts: argparse.Namespace, state: dict[str, Any]) -> None:
    session = peer.session
    pipeline = session.pipeline
    rng = random.Random(opts.seed * 100_003 + index)
    await _wait_until_sending(session.track)
    spw = opts.seconds_per_word
    if opts.mode == "continuous":
        # Always one utterance queued behind the one speaking: generation never stops.
        said = 0
        text = _words(opts.talk_s, spw)
        while True:
            while said - pipeline.stats.utterances < 1:
                pipeline.say(text)
                said += 1
            await asyncio.sleep(0.2)
    elif opts.mode == "intermittent":
        period = opts.talk_s + opts.silence_s
        await asyncio.sleep(rng.uniform(0, period))
        while True:
            pipeline.say(_words(opts.talk_s * rng.uniform(0.75, 1.25), spw))
            await asyncio.sleep(0.05)
            await _wait_idle(pipeline)
            await asyncio.sleep(opts.silence_s * rng.uniform(0.75, 1.25))
    elif opts.mode == "latency":
        await asyncio.sleep(rng.uniform(0.2, 1.0))
        for k in range(opts.utterances):
            await asyncio.sleep(rng.uniform(opts.gap_min, opts.gap_max))
            token = f"tok{index}x{k}"
            text = token + " " + _words(rng.uniform(0.6, 1.2), spw)
            pipeline.say(text, token)
            await asyncio.sleep(0.05)
            await _wait_idle(pipeline)
        state["done"].add(session.id)
    else:
        raise SystemExit(f"unknown mode {opts.mode!r}")


def _server_options(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench server")
    p.add_argument(
        "--variant", default="ours", choices=("ours", "ours-aiortc", "norephase", "default")
    )
    p.add_argument(
        "--mode", default="continuous", choices=("continuous", "intermittent", "latency")
    )
    p.add_argument("--complexity", type=int, default=9)
    p.add_argument("--complexity-floor", type=int, default=None, help="default: the product's")
    p.add_argument("--full-band-under-load", action="store_true")
    p.add_argument("--encode-threads", type=int, default=0)
    p.add_argument("--input-rate", choices=INPUT_RATE_CHOICES, default="auto")
    p.add_argument("--bitrate", type=int, default=32_000)
    p.add_argument("--signal", choices=SIGNALS, default="tone")
    p.add_argument("--chunk-ms", type=int, default=100)
    p.add_argument("--chunk-delay", type=float, default=0.05)
    p.add_argument("--seconds-per-word", type=float, default=0.25)
    p.add_argument("--talk-s", type=float, default=30.0)
    p.add_argument("--silence-s", type=float, default=2.0)
    p.add_argument("--utterances", type=int, default=20)
    p.add_argument("--gap-min", type=float, default=0.3)
    p.add_argument("--gap-max", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=1, help="media processes (signaling/workers.py)")
    p.add_argument(
        "--no-listen",
        action="store_true",
        help="load no voice activity model (the product's --no-listen): for the harness's own "
        "tests, which do not measure; a measurement keeps the product's default",
    )
    return p.parse_args(argv)


def _bench_config(opts: argparse.Namespace) -> Any:
    from agent.config import Config, LimitSettings, OpusSettings
    from agent.conversation_config import ListenSettings

    # One client process opens every session from one address: the per-address limits
    # and the session cap of a public server are not what is measured here.
    unlimited = 1_000_000
    return Config(
        host="127.0.0.1",
        port=0,
        log_level="WARNING",
        workers=opts.workers,
        listen=ListenSettings(enabled=not opts.no_listen),
        limits=LimitSettings(
            offer_rate=unlimited,
            offer_burst=unlimited,
            speech_rate=unlimited,
            speech_burst=unlimited,
            max_sessions=unlimited,
        ),
        opus=OpusSettings(
            bitrate=opts.bitrate,
            complexity=opts.complexity,
            complexity_floor=(
                OpusSettings().complexity_floor
                if opts.complexity_floor is None
                else opts.complexity_floor
            ),
            band_cap_under_load=not opts.full_band_under_load,
            encode_threads=opts.encode_threads,
            # ours: the product's lean send path; ours-aiortc: the same track through
            # aiortc's RTP sender task; default: aiortc's whole default path.
            direct_send=opts.variant in ("ours", "norephase"),
            input_rate=_input_rate(opts),
        ),
    )


def _input_rate(opts: argparse.Namespace) -> int | None:
    if opts.variant == "default":
        # aiortc's default path is fed 48 kHz frames, as it always was: a rate change there
        # would move the baseline that every ratio in bench/README divides by.
        return SAMPLE_RATE
    return None if opts.input_rate == "auto" else int(opts.input_rate)


def bench_app(opts: argparse.Namespace, config: Any) -> Any:
    """The product app with the bench engine, the session drivers and ``/bench/stats``.

    Module level so that ``--workers`` can build it in each spawned worker process.
    """
    import logging

    logging.basicConfig(level=logging.WARNING)
    global DefaultPathTrack
    DefaultPathTrack = _make_default_track_class()
    _install_server_patches(opts.variant)

    from aiohttp import web

    from signaling.app import build_app
    from signaling.keys import SESSIONS

    engine = _bench_engine(opts)
    app = build_app(config, engine)
    state: dict[str, Any] = {"done": set(), "drivers": {}}

    async def watcher(app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            index = (config.worker_index or 0) * 100_000  # distinct seeds across workers
            while True:
                for peer in app[SESSIONS].peers():
                    if peer.session.id not in state["drivers"]:
                        state["drivers"][peer.session.id] = asyncio.create_task(
                            _drive(peer, index, opts, state)
                        )
                        index += 1
                await asyncio.sleep(0.05)

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    async def stats(request: web.Request) -> web.Response:
        sessions = {}
        for peer in app[SESSIONS].peers():
            s = peer.session
            t = s.track.stats
            sessions[s.id] = {
                "packets": t.packets,
                "speech_packets": t.speech_packets,
                "encode_calls": getattr(t, "encode_calls", 0),
                "early_rephases": getattr(t, "early_rephases", 0),
                "late_rephases": getattr(t, "late_rephases", 0),
                "underruns": s.pipeline.buffer.underruns,
                # RTCP receiver reports heard from the client (liveness, bitrate control).
                "receiver_reports": s.network.stats()["receiver_reports"],
                "utterances": s.pipeline.stats.utterances,
                "started_at": s.track.bench_started_at,
                "sent_at": s.track.bench_sent_at,
                "buffered_at": s.track.bench_buffered_at,
                "done": s.id in state["done"],
            }
        governor = app[SESSIONS].governor
        return web.json_response(
            {
                "sessions": sessions,
                "first_chunk_at": engine.first_chunk_at,
                "pid": os.getpid(),
                # The encoders' complexity (and band cap) now, and how often the CPU
                # governor moved it.
                "complexity": governor.complexity,
                "band_cap_hz": governor.rung.band_cap_hz,
                "rung": str(governor.rung),
                "complexity_steps_down": governor.policy.steps_down,
                "complexity_steps_up": governor.policy.steps_up,
            }
        )

    app.cleanup_ctx.append(watcher)
    app.router.add_get("/bench/stats", stats)
    return app


def _front_with_bench_stats(config: Any, pool: Any) -> Any:
    """The product's front for ``--workers``, plus ``/bench/stats`` merged over workers."""
    from aiohttp import web

    from signaling.front import build_front_app

    front = build_front_app(config, pool)

    async def stats(request: web.Request) -> web.Response:
        merged: dict[str, Any] = {"sessions": {}, "first_chunk_at": {}, "pids": []}
        parts = []
        for worker in pool.workers:
            async with worker.http.get("http://worker/bench/stats") as resp:
                part = await resp.json()
            merged["sessions"].update(part["sessions"])
            merged["first_chunk_at"].update(part["first_chunk_at"])
            merged["pids"].append(part["pid"])
            parts.append(part)
        # Each worker governs its own encoders: the cheapest rung, steps summed.
        cheapest = min(parts, key=lambda p: (p["complexity"], p["band_cap_hz"] or 48_000))
        for key in ("complexity", "band_cap_hz", "rung"):
            merged[key] = cheapest.get(key)
        for key in ("complexity_steps_down", "complexity_steps_up"):
            merged[key] = sum(p[key] for p in parts)
        return web.json_response(merged)

    front.router.add_get("/bench/stats", stats)
    return front


def serve(argv: Sequence[str]) -> None:
    opts = _server_options(argv)
    config = _bench_config(opts)

    from aiohttp import web

    if opts.workers > 1:
        import functools
        import tempfile

        from signaling.workers import WorkerPool

        sockets = tempfile.mkdtemp(prefix="bench-workers-")
        pool = WorkerPool(config, functools.partial(bench_app, opts), Path(sockets))
        app = _front_with_bench_stats(config, pool)
        ready = pool_ready(pool)
    else:
        app = bench_app(opts, config)
        ready = app_ready(app)

    async def main() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        if opts.workers > 1:
            await pool.start()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        await ready()
        print(f"READY {port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        # Exit when the orchestrator closes our stdin.
        loop.run_in_executor(None, _wait_stdin_eof, loop, stop)
        await stop.wait()
        if opts.workers > 1:
            for worker in pool.workers:
                if worker.process is not None:
                    worker.process.kill()
        os._exit(0)  # tearing down hundreds of peers is not what we measure

    asyncio.run(main())


def app_ready(app: Any) -> Any:
    """Ready when the product's /readyz would say so: the engine loaded and the voice
    activity model too. The app loads the latter at startup (a torch import: ~500 MiB and
    seconds of CPU, stalling the loop); a bench that started measuring before it settled
    would charge that memory to its peers and those stalls to its first utterances."""
    from signaling.keys import ENGINE, SESSIONS

    engine = app[ENGINE]
    sessions = app[SESSIONS]

    async def ready() -> None:
        while not (engine.ready and sessions.listening_ready):
            await asyncio.sleep(0.01)

    return ready


def pool_ready(pool: Any) -> Any:
    """Every worker ready, its voice activity model loaded too (see app_ready)."""

    async def ready() -> None:
        while not all(w.ready and w.status.get("listening_ready", True) for w in pool.workers):
            await asyncio.sleep(0.05)

    return ready


def _wait_stdin_eof(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    sys.stdin.read()
    loop.call_soon_threadsafe(stop.set)


# ==========================================================================================
# Client side
# ==========================================================================================


@dataclass
class Recording:
    session_id: str = ""
    arrivals: list[float] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    # Fast receive path: SRTP datagrams as they arrived, decrypted after the window.
    raw: list[tuple[float, bytes]] = field(default_factory=list)
    dtls: Any = None  # the peer's RTCDtlsTransport (its SRTP session decrypts ``raw``)
    undecryptable: int = 0

    @property
    def received(self) -> int:
        return len(self.arrivals) + len(self.raw)

    def attach(self, pc: Any, poller: SocketPoller) -> None:
        """Record this peer's RTP straight off its ICE sockets from now on (fast receive)."""
        self.dtls = pc.getTransceivers()[0].receiver.transport
        poller.add(self, pc)

    def decrypt(self) -> None:
        """Turn the raw datagrams into arrivals / sequence numbers / payloads."""
        import pylibsrtp
        from aiortc.rtp import RtpPacket

        raw, self.raw = self.raw, []
        srtp = self.dtls._rx_srtp if self.dtls is not None else None
        for arrival, datagram in raw:
            try:
                packet = RtpPacket.parse(srtp.unprotect(datagram))
            except (pylibsrtp.Error, ValueError):  # did not authenticate / not RTP after all
                self.undecryptable += 1
                continue
            self.arrivals.append(arrival)
            self.seqs.append(packet.sequence_number)
            self.payloads.append(packet.payload)


class SocketPoller:
    """The fast receive path: every peer's ICE sockets drained on a 10 ms timer.

    asyncio's reader on each of a peer's UDP sockets is replaced by this poller, which
    drains them all with ``recvmsg`` every ``interval_s`` and reads the kernel's arrival
    time of each datagram (``SO_TIMESTAMPNS``): arrival times say when a packet reached this
    host whatever the load generator was doing, and the generator wakes 100 times a second
    instead of once per packet. RTP datagrams are stored as they are (``Recording.raw``) and
    the receiver's statistics are updated from the clear RTP header, so its receiver reports
    stay true (loss reaches the server's liveness check and bitrate controller; their jitter
    and the RTT the server computes include up to the 10 ms poll, well under the controller's
    100 ms RTT-spike margin); STUN, DTLS and RTCP go to aioice as before, up to 10 ms later.
    Decryption waits until the window is over (``Recording.decrypt``). Measured at N=20
    continuous (``/proc/PID/task/*/schedstat``): 4.8% of a core against 5.9% with aiortc's
    receive path (most of what remains is the kernel's receive work). What matters more is
    that the arrival times no longer depend on this process being scheduled, so it can run
    niced (``--nice``) and leave the cores to the server, as remote clients would.
    """

    def __init__(self, interval_s: float = 0.01) -> None:
        import socket
        import struct

        self.interval_s = interval_s
        self._entries: list[tuple[socket.socket, Any, Recording, dict[int, Any]]] = []
        # SO_TIMESTAMPNS stamps with CLOCK_REALTIME; the benches compare monotonic times.
        self._realtime_minus_monotonic = time.time() - time.monotonic()
        self._timespec = struct.Struct("@qq")
        self._seq_ts = struct.Struct("!HI")
        self._ssrc = struct.Struct("!I")
        self._cmsg_space = socket.CMSG_SPACE(self._timespec.size)
        # Python 3.11 does not export it; 35 on Linux (asm-generic/socket.h, 64-bit time).
        self._so_timestampns = getattr(socket, "SO_TIMESTAMPNS", 35)
        self._task: asyncio.Task[None] | None = None

    def add(self, rec: Recording, pc: Any) -> None:
        import socket

        loop = asyncio.get_running_loop()
        streams = pc.getTransceivers()[0].receiver._RTCRtpReceiver__remote_streams
        for protocol in rec.dtls.transport._connection._protocols:
            sock = protocol.transport._sock
            sock.setsockopt(socket.SOL_SOCKET, self._so_timestampns, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            # The public remove_reader refuses a descriptor that a transport owns; the
            # transport stays (aioice sends through it), only its reading moves here.
            loop._remove_reader(sock.fileno())  # type: ignore[attr-defined]
            self._entries.append((sock, protocol, rec, streams))
        if self._task is None:
            self._task = loop.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            for entry in self._entries:
                self._drain(*entry)

    def _drain(self, sock: Any, protocol: Any, rec: Recording, streams: dict[int, Any]) -> None:
        from aiortc.rtcrtpreceiver import StreamStatistics

        while True:
            try:
                data, ancillary, _, addr = sock.recvmsg(2048, self._cmsg_space)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # closed
                return
            # RTP: version 2 (first byte 128-191), not RTCP (packet types 192-223).
            if len(data) < 12 or not 127 < data[0] < 192 or 191 < data[1] < 224:
                protocol.datagram_received(data, addr)
                continue
            if not _RECORDING[0]:
                continue
            arrival = time.monotonic()
            for _level, kind, value in ancillary:
                if kind == self._so_timestampns:
                    sec, nsec = self._timespec.unpack(value)
                    arrival = sec + nsec * 1e-9 - self._realtime_minus_monotonic
            rec.raw.append((arrival, data))
            (ssrc,) = self._ssrc.unpack_from(data, 8)
            stats = streams.get(ssrc)
            if stats is None:
                stats = streams[ssrc] = StreamStatistics(SAMPLE_RATE)
            stats.add(_SeqStamp(*self._seq_ts.unpack_from(data, 2)))


_RECORDING = [True]


class _SeqStamp:
    """What aiortc's ``StreamStatistics.add`` reads from a packet."""

    __slots__ = ("sequence_number", "timestamp")

    def __init__(self, sequence_number: int, timestamp: int) -> None:
        self.sequence_number = sequence_number
        self.timestamp = timestamp


def _install_client_patches() -> None:
    """Record RTP instead of playing it: peers that did not ``Recording.attach`` (the
    ``aiortc`` receive path) have aiortc receive, decrypt and parse every packet, and the
    recorder replaces ``RTCRtpReceiver._handle_rtp_packet`` (no jitter buffer, no decoding).
    """
    from aiortc.rtcrtpreceiver import RTCRtpReceiver

    async def record(self: Any, packet: Any, arrival_time_ms: int) -> None:
        if not _RECORDING[0]:
            return
        rec = self.bench_recording
        rec.arrivals.append(time.monotonic())
        rec.seqs.append(packet.sequence_number)
        rec.payloads.append(packet.payload)

    RTCRtpReceiver._handle_rtp_packet = record  # type: ignore[method-assign]


def _packet_rms(decoder: Any, payload: bytes | None) -> float:
    """Decode one packet (None = lost: concealment); its RMS in [0, 1], or -1 if undecodable."""
    from agent.opus import OpusError

    try:
        pcm = decoder.decode(payload) if payload else decoder.conceal()
    except OpusError:
        return -1.0
    if not pcm.size:
        return -1.0
    x = pcm.astype(np.float32) / 32768.0
    return float(np.sqrt(np.mean(x * x)))


def _unwrap(seqs: list[int]) -> np.ndarray:
    s = np.asarray(seqs, dtype=np.int64)
    if not len(s):
        return s
    d = np.diff(s)
    d = (d + 32768) % 65536 - 32768
    return np.concatenate(([s[0]], s[0] + np.cumsum(d)))


def analyse_recording(rec: Recording, t0: float, t1: float) -> dict[str, Any]:
    """Window stats and decoded onsets of one stream (decoding happens here, after the run)."""
    if rec.raw:
        rec.decrypt()
    arr = np.asarray(rec.arrivals, dtype=np.float64)
    seq = _unwrap(rec.seqs)
    win = (arr >= t0) & (arr < t1)
    a = arr[win]
    gaps = np.diff(a) if len(a) > 1 else np.zeros(0)
    # Decode everything in sequence order (lost packets concealed), flag non-silent packets.
    order = np.argsort(seq, kind="stable")
    from agent.opus import OpusDecoder

    dec = OpusDecoder()
    rms = np.zeros(len(seq), dtype=np.float32)
    prev = None
    last_i = 0
    decode_errors = 0
    for i in order:
        if prev is not None and seq[i] == prev:
            rms[i] = rms[last_i]  # duplicate
            continue
        if prev is not None:
            for _ in range(max(0, int(seq[i] - prev - 1))):
                _packet_rms(dec, None)
        r = _packet_rms(dec, rec.payloads[i])
        if r < 0:
            decode_errors += 1
        rms[i] = r
        prev, last_i = seq[i], i
    dec.close()
    speech = rms > SILENCE_RMS
    # Onsets: a speech packet whose predecessor (in sequence) was silent for >= 3 packets.
    onsets: list[float] = []
    quiet = 3
    for i in order:
        if speech[i]:
            if quiet >= 3:
                onsets.append(float(arr[i]))
            quiet = 0
        else:
            quiet += 1
    wseq = seq[win]
    expected = int(wseq.max() - wseq.min()) + 1 if len(wseq) else 0
    return {
        "session_id": rec.session_id,
        "packets": int(win.sum()),
        "lost": max(0, expected - len(np.unique(wseq))),
        "gaps_total": len(gaps),
        "gaps_over_40ms": int((gaps > 0.040).sum()),
        "max_gap_ms": float(gaps.max() * 1000) if len(gaps) else 0.0,
        "speech_share": float(speech[win].mean()) if win.any() else 0.0,
        "decode_errors": decode_errors,
        "undecryptable": rec.undecryptable,
        "bytes": int(sum(len(rec.payloads[i]) for i in np.flatnonzero(win))),
        "onsets": onsets,
    }


async def _client_main(opts: argparse.Namespace) -> None:
    import aiohttp
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

    _install_client_patches()
    poller = SocketPoller()
    pcs: list[Any] = []
    recs: list[Recording] = []
    t_start = time.monotonic()

    async def connect(http: aiohttp.ClientSession) -> None:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        transceiver = pc.addTransceiver("audio", direction="recvonly")
        rec = Recording()
        transceiver.receiver.bench_recording = rec
        await pc.setLocalDescription(await pc.createOffer())
        body = {"sdp": pc.localDescription.sdp, "type": "offer"}
        async with http.post(opts.url + "/offer", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"offer failed: {resp.status} {await resp.text()}")
            data = await resp.json()
        rec.session_id = data["session_id"]
        await pc.setRemoteDescription(RTCSessionDescription(sdp=data["sdp"], type="answer"))
        if opts.receive == "fast":
            rec.attach(pc, poller)
        pcs.append(pc)
        recs.append(rec)

    async with aiohttp.ClientSession() as http:
        for i in range(0, opts.n, opts.batch):
            await asyncio.gather(*(connect(http) for _ in range(min(opts.batch, opts.n - i))))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(r.received < 5 for r in recs):
        await asyncio.sleep(0.05)
    flowing = sum(r.received >= 5 for r in recs)
    print(f"CONNECTED {flowing} {time.monotonic() - t_start:.2f}", flush=True)

    loop = asyncio.get_running_loop()
    line = await loop.run_in_executor(None, sys.stdin.readline)
    parts = line.split()
    if not parts or parts[0] != "STOP":
        os._exit(1)
    t0, t1, out = float(parts[1]), float(parts[2]), parts[3]
    # Stop receiving before the (CPU-heavy) decoding so it cannot disturb the window.
    _RECORDING[0] = False
    results = [analyse_recording(r, t0, t1) for r in recs]
    with open(out, "w") as f:  # noqa: ASYNC230 - the measurement is over
        json.dump({"streams": results}, f)
    print("DONE", flush=True)
    os._exit(0)


def client(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(prog="bench client")
    p.add_argument("--url", required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument(
        "--receive",
        choices=("fast", "aiortc"),
        default="fast",
        help="fast: record RTP at the socket, decrypt afterwards; aiortc: its full receive path",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=10,
        help="with --receive fast: lower the load generator's priority by this much (arrival "
        "times come from the kernel, so its own scheduling does not skew them; a real "
        "deployment's clients are on other machines)",
    )
    opts = p.parse_args(argv)
    import logging

    if opts.receive == "fast" and opts.nice > 0:
        os.nice(opts.nice)
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(_client_main(opts))


# ==========================================================================================
# Orchestrator helpers
# ==========================================================================================


def add_run_arguments(
    p: argparse.ArgumentParser, *, max_wait: float, retries: int, quick_help: str
) -> None:
    """The options both orchestrators share (engine pacing, pinning, retries, output)."""
    p.add_argument(
        "--chunk-delay",
        type=float,
        default=0.05,
        help="engine pacing: seconds between 100 ms chunks (0.05 = 2x real time)",
    )
    p.add_argument("--pin", action="store_true", help="server on CPU 0, clients on CPU 1")
    p.add_argument(
        "--encode-threads",
        type=int,
        default=0,
        help="OpusSettings(encode_threads=...): 0 inline on the loop, -1 one per core but one",
    )
    p.add_argument(
        "--input-rate",
        choices=INPUT_RATE_CHOICES,
        default="auto",
        help="OpusSettings(input_rate=...) for our tracks (auto: the engine's 24 kHz); "
        "aiortc's default path is always fed 48 kHz frames",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--max-wait",
        type=float,
        default=max_wait,
        help="a run whose server event-loop thread waited for a CPU more than this %% of the "
        "run while other processes were busy is retried (the machine is shared); the least "
        "disturbed try is reported",
    )
    p.add_argument("--retries", type=int, default=retries)
    p.add_argument(
        "--client-receive",
        choices=("fast", "aiortc"),
        default="fast",
        help="how the load generator receives: fast = RTP recorded at the socket and "
        "decrypted after the window (a few us per packet); aiortc = its whole receive path",
    )
    p.add_argument(
        "--complexity-floor",
        type=int,
        default=None,
        help="OpusSettings(complexity_floor=...): the CPU governor's floor (default: the "
        "product's; equal to --complexity: fixed)",
    )
    p.add_argument(
        "--full-band-under-load",
        action="store_true",
        help="OpusSettings(band_cap_under_load=False): the governor steps complexity alone",
    )
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--json", type=Path, help="also write the raw results here")


def governor_args(args: argparse.Namespace) -> list[str]:
    """The bench server's CPU-governor options, where the run set them."""
    floor = args.complexity_floor
    full_band = ["--full-band-under-load"] if args.full_band_under_load else []
    return ([] if floor is None else ["--complexity-floor", str(floor)]) + full_band


def governor_figures(after: dict[str, Any], before: dict[str, Any] | None = None) -> dict[str, Any]:
    """The CPU governor from ``/bench/stats``: the encoders' complexity at the end, and its
    steps down and up since ``before`` (or since the server started)."""
    before = before or {}
    return {
        "complexity": after.get("complexity"),
        "band_cap_hz": after.get("band_cap_hz"),
        "rung": after.get("rung"),
        **{
            key: after.get(key, 0) - before.get(key, 0)
            for key in ("complexity_steps_down", "complexity_steps_up")
        },
    }


def complexity_cell(r: dict[str, Any]) -> str:
    """A table cell: the governor's rung at the end (the complexity; ``wb``/``mb``: the band
    capped at wide-/medium-band), with its steps, e.g. ``wb2 (-4/+1)``; ``-`` for aiortc's
    default path (no governed encoders)."""
    if r["variant"] == "default" or r.get("complexity") is None:
        return "-"
    down, up = r.get("complexity_steps_down", 0), r.get("complexity_steps_up", 0)
    rung = r.get("rung") or str(r["complexity"])
    return rung + (f" (-{down}/+{up})" if down or up else "")


def _pin(pid: int, cpus: list[int] | None) -> None:
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, cpus)


def _spawn(role_args: list[str], log: Any, cpus: list[int] | None) -> subprocess.Popen[str]:
    """This script in another process (``server`` or ``client`` role), pinned if asked."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__)), *role_args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    _pin(proc.pid, cpus)
    return proc


def disturbed(result: dict[str, Any], max_wait: float, *, retry_left: bool = True) -> bool:
    """Whether other jobs on the machine disturbed a run enough to try it again (and say so,
    and whether it will be)."""
    # Other processes here, or other guests of the host (steal), took CPU the server wanted.
    outside = result["others_cpu_pct"] + result.get("steal_pct", 0.0)
    if result["server_wait_pct"] <= max_wait or outside <= 10:
        return False
    verdict = "trying again" if retry_left else "no tries left: keeping the least disturbed"
    print(
        f"    the server's loop waited {result['server_wait_pct']:.1f}% of the run for a CPU "
        f"while other processes or guests used {outside:.0f}% (> {max_wait:g}%): "
        f"disturbed, {verdict}",
        flush=True,
    )
    return True


class Server:
    def __init__(self, args: list[str], log: Path, cpus: list[int] | None = None) -> None:
        import psutil

        self.log = log.open("w")
        self.proc = _spawn(["server", *args], self.log, cpus)
        self.ps = psutil.Process(self.proc.pid)  # before anything can fail: stop() needs it
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("READY"):
            self.stop()
            raise RuntimeError(f"server did not start: {line!r}; see {log}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def _tree(self) -> list[Any]:
        """The server and, with ``--workers``, its worker processes."""
        return [self.ps, *self.ps.children(recursive=True)]

    def cpu(self) -> float:
        total = 0.0
        for proc in self._tree():
            t = proc.cpu_times()
            total += t.user + t.system
        return total

    def rss(self) -> int:
        return sum(int(proc.memory_info().rss) for proc in self._tree())

    def runqueue_wait(self) -> float:
        """Seconds the event-loop threads (one per media process) were runnable but waiting
        for a CPU, summed."""
        procs = self._tree()
        workers = procs[1:] or procs  # with workers, the front's loop carries no media
        return sum(runqueue_wait(proc.pid) for proc in workers)

    def threads(self) -> int:
        return sum(int(proc.num_threads()) for proc in self._tree())

    def stats(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(self.url + "/bench/stats", timeout=30) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        """Kill the server and its workers, and wait until they are gone.

        Killing only the front would leave its workers to their parent-death signal, which
        is SIGTERM: each would drain its sessions for up to the drain deadline (20 s), still
        sending, while the next run measures (seen as "others" CPU and failed runs)."""
        import psutil

        procs = []
        with contextlib.suppress(psutil.Error):
            procs = self._tree()
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(procs, timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


class Client:
    def __init__(
        self,
        url: str,
        n: int,
        log: Path,
        cpus: list[int] | None = None,
        receive: str = "fast",
    ) -> None:
        self.log = log.open("w")
        args = ["client", "--url", url, "--n", str(n), "--receive", receive]
        self.proc = _spawn(args, self.log, cpus)
        import psutil

        self.ps = psutil.Process(self.proc.pid)
        self.cpu0 = 0.0
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("CONNECTED"):
            self.stop()
            raise RuntimeError(f"client failed: {line!r}; see {log}")
        self.flowing = int(line.split()[1])
        self.connect_s = float(line.split()[2])

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def finish(self, t0: float, t1: float, out: Path, timeout: float = 300) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(f"STOP {t0!r} {t1!r} {out}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line.startswith("DONE"):
            raise RuntimeError(f"client failed at the end: {line!r}")
        self.proc.wait(timeout)
        return json.loads(out.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def runqueue_wait(pid: int) -> float:
    """Seconds thread ``pid`` (a process's main thread) spent runnable, waiting for a CPU."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


@contextlib.contextmanager
def full_size_model(model_dir: Path | None) -> Iterator[Path]:
    """A full-size random-weight ChatTTS checkpoint: ``model_dir`` (built there if it holds
    none) or a temporary one, removed afterwards (~1.1 GB, a few minutes to build)."""
    from agent.chattts.tiny import build_tiny_model, read_manifest

    with tempfile.TemporaryDirectory(prefix="chattts-full-") as tmp:
        path = model_dir or Path(tmp) / "full"
        if read_manifest(path) is None:
            t0 = time.perf_counter()
            build_tiny_model(path, size="full", seed=0)
            print(f"built full-size random model in {time.perf_counter() - t0:.1f} s: {path}")
        yield path


def system_busy() -> float:
    """CPU seconds all processes of the machine have used (all cores together), not counting
    time the hypervisor gave to other guests (steal, see ``system_steal``)."""
    import psutil

    t = psutil.cpu_times()
    steal = getattr(t, "steal", 0.0)
    # A VM's vCPU time is in user/nice and again in guest/guest_nice (Linux /proc/stat, as
    # psutil's own cpu_percent counts it): once only, or "others CPU%" read too high on a
    # machine hosting VMs, and undisturbed runs were retried (found by review).
    guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0) - steal - guest)


def system_steal() -> float:
    """CPU seconds this VM's CPUs were ready to run but the hypervisor ran someone else."""
    import psutil

    return float(getattr(psutil.cpu_times(), "steal", 0.0))


_SPIN = (
    "import time\nn = 0\nend = time.monotonic() + {s}\n"
    "while time.monotonic() < end:\n    for _ in range(10000):\n        n += 1\nprint(n)"
)


def parallel_speedup(processes: int, seconds: float = 3.0) -> float:
    """How much more work ``processes`` pure-Python CPU loops do together than one alone.

    The machine's own ceiling for a ``--workers`` scaling figure: on a VM the CPUs may share
    a physical core or the host's time with other guests, so two processes need not do twice
    the work of one even with nothing else running.
    """

    def spin(count: int) -> int:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _SPIN.format(s=seconds)], stdout=subprocess.PIPE, text=True
            )
            for _ in range(count)
        ]
        return sum(int(proc.communicate()[0]) for proc in procs)

    one = spin(1)
    return spin(processes) / one if one else float("nan")


def pct(values: Sequence[float], q: float) -> float:
    return (
        float(np.percentile(np.asarray(values, dtype=np.float64), q))
        if len(values)
        else float("nan")
    )


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        lines.append(
            "  ".join(
                c.rjust(w) if j else c.ljust(w)
                for j, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}"
    return str(v)


def main(argv: Sequence[str]) -> None:
    if not argv or argv[0] not in ("server", "client"):
        raise SystemExit("usage: _common.py server|client ...")
    (serve if argv[0] == "server" else client)(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
