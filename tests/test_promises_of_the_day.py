"""Tests written by hand mutation testing of one day's changes (agent/fanout.py, agent/llm.py,
agent/chattts/speakers.py, agent/chattts/scheduler.py, agent/raytts/engine.py,
signaling/release.py, signaling/front.py, signaling/workers.py): each fails with a mutation
that the suite let survive, or, where it says "Bug", failed on the code as it was."""

from __future__ import annotations

import asyncio
import logging
import lzma
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pybase16384 as b14
import pytest
from aiohttp import web

from agent.config import ChatTTSSettings, Config, RaySettings
from agent.engine import UnknownVoice, VoiceOptions
from agent.fanout import FanoutSource, FanoutTrack
from signaling.app import STATUS_PATH, runner_options
from signaling.front import _prepared, build_front_app
from signaling.release import close_peer_connection
from signaling.workers import WorkerPool
from tests.test_release import connected_pair, rtcp_task_never_exits

pytest_plugins = ["tests.conftest_chattts"]


# --- agent/fanout.py -------------------------------------------------------------------------
async def test_a_sender_waiting_on_an_empty_queue_gets_every_packet_of_a_burst() -> None:
    """Once aiortc's sender has started pulling (its connection is up), the queue keeps every
    packet: only a subscriber not pulled yet keeps just the newest. A sender that asked for a
    packet and waits has started pulling: a burst (a microphone's jitter buffer releasing
    frames) published before it wakes must not lose its first packets."""
    source = FanoutSource("agent", lambda target: None)
    track = FanoutTrack(10)
    source.subscribe(track)
    first = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0)  # the sender waits on the empty queue
    source.publish(b"one")
    source.publish(b"two")
    assert bytes(await first) == b"one"
    assert bytes(await asyncio.wait_for(track.recv(), 1)) == b"two"
    assert track.dropped == 0


# --- agent/chattts/speakers.py, agent/raytts/engine.py ---------------------------------------
def _speaker(values: np.ndarray) -> str:
    from agent.chattts.voices import SPEAKER_FILTERS

    packed = lzma.compress(
        values.astype(np.float16).tobytes(), format=lzma.FORMAT_RAW, filters=SPEAKER_FILTERS
    )
    return str(b14.encode_to_string(packed))


@pytest.mark.parametrize("extra", [1, 3])
def test_a_speaker_string_with_more_values_than_the_model_takes_is_refused(extra: int) -> None:
    """README: a ``config`` voice that is no usable ChatTTS speaker string is
    ``unknown_voice``. A string of another model's width (more values) must not be cut to
    this model's width and spoken with a garbage voice."""
    from agent.chattts.speakers import check_voice_without_model

    dim = 768
    rng = np.random.default_rng(3)
    check_voice_without_model(VoiceOptions(voice=_speaker(rng.standard_normal(dim))), "seed:2", dim)
    wider = VoiceOptions(voice=_speaker(rng.standard_normal(dim + extra)))
    with pytest.raises(UnknownVoice, match="more than"):
        check_voice_without_model(wider, "seed:2", dim)


def test_before_a_replica_said_its_width_a_speaker_string_is_not_refused() -> None:
    """RayServeEngine.check_voice: "a speaker string is read once a replica said its width".
    Before (or attached to an app that does not say it), a client's speaker string must not
    be refused outright."""
    from agent.raytts.engine import RayServeEngine

    engine = RayServeEngine(RaySettings(address="ray://auto"), Config().chattts)
    good = VoiceOptions(voice=_speaker(np.random.default_rng(1).standard_normal(768)))
    engine.check_voice(good)  # no replica asked yet: nothing known, nothing refused
    with pytest.raises(UnknownVoice):
        engine.check_voice(VoiceOptions(voice="seed:x"))


class _FakeKV:
    """ray.experimental.internal_kv's store: values by (key, namespace)."""

    def __init__(self) -> None:
        self.values: dict[tuple[bytes, str | None], bytes] = {}

    def put(self, key: bytes, value: bytes, overwrite: bool = True, namespace: Any = None) -> int:
        self.values[(key, namespace)] = value
        return 1

    def get(self, key: bytes, namespace: Any = None) -> bytes | None:
        return self.values.get((key, namespace))


async def test_a_second_media_process_attaches_to_an_app_still_deploying_through_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fingerprint a deploy records in the cluster's store is the one the next media
    process reads (same key, same namespace, decoded), and it is recorded before the deploy:
    a second media process starting while the app is DEPLOYING attaches instead of deploying
    it again over itself (which cut every stream on it). The existing test replaces both
    store functions, so neither the round trip nor the order was checked."""
    import ray
    from ray.experimental import internal_kv

    import agent.raytts.engine as ray_engine_module
    from agent.raytts.deployment import fingerprint
    from agent.raytts.engine import RayServeEngine

    kv = _FakeKV()
    monkeypatch.setattr(internal_kv, "_internal_kv_put", kv.put)
    monkeypatch.setattr(internal_kv, "_internal_kv_get", kv.get)
    settings, chattts = RaySettings(address="ray://auto"), Config().chattts
    ours = fingerprint(settings, chattts)
    recorded_at_deploy: list[str | None] = []

    def handle() -> Any:  # attaching or deploying: nothing is asked of it here
        return types.SimpleNamespace(name="speech app")

    class Serve:
        deploys = 0
        state: str | None = None

        def start(self, **_: Any) -> None:
            pass

        def status(self) -> Any:
            apps = {}
            if self.state is not None:
                apps["voice-agent-tts"] = types.SimpleNamespace(status=self.state, message="")
            return types.SimpleNamespace(applications=apps)

        def get_app_handle(self, name: str) -> Any:
            return handle()

        def deployment(self, **_: Any) -> Any:
            return lambda cls: types.SimpleNamespace(bind=lambda *a: "app")

        def RunTarget(self, *a: Any, **k: Any) -> Any:
            return "target"

        def run_many(self, targets: list[Any], **_: Any) -> list[Any]:
            recorded_at_deploy.append(ray_engine_module._deployed_fingerprint("voice-agent-tts"))
            self.deploys += 1
            self.state = "DEPLOYING"  # and so it stays while the second process starts
            return [handle()]

    fake = Serve()
    monkeypatch.setattr(ray, "serve", fake, raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    first = RayServeEngine(settings, chattts)
    second = RayServeEngine(settings, chattts)
    try:
        assert first._connect_and_deploy() is not None
        assert fake.deploys == 1 and recorded_at_deploy == [ours]
        assert second._connect_and_deploy() is not None
        assert fake.deploys == 1, "the second media process deployed the app again"
    finally:
        await first.close()
        await second.close()


# --- agent/chattts/scheduler.py --------------------------------------------------------------
def test_could_not_start_stream_names_the_session(
    tiny_settings: ChatTTSSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README "Logs": every line names its session. "ChatTTS could not start stream N" is
    written by the engine's worker thread, which has no session context."""
    from agent.chattts.engine import ChatTTSEngine
    from agent.chattts.gpt import BatchedGPT
    from agent.engine import EngineError
    from agent.logcontext import SESSION_ID, SessionIdFilter

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("this text cannot start")

    engine = ChatTTSEngine(tiny_settings)
    seen: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Collect()
    handler.addFilter(SessionIdFilter())
    scheduler_log = logging.getLogger("agent.chattts.scheduler")
    scheduler_log.addHandler(handler)

    async def speak() -> None:
        await engine.start()  # its warm-up speaks: refused only after it
        monkeypatch.setattr(BatchedGPT, "make_row", refuse)
        try:
            SESSION_ID.set("session-under-review")
            with pytest.raises(EngineError):
                async for _ in engine.synthesize("hello there", VoiceOptions()):
                    pass
        finally:
            await engine.close()

    try:
        asyncio.run(speak())
    finally:
        scheduler_log.removeHandler(handler)
    failed = [r for r in seen if "could not start stream" in r.getMessage()]
    assert failed, [r.getMessage() for r in seen]
    assert failed[0].session_id == "session-under-review", f"logged as [{failed[0].session_id}]"


# --- signaling/release.py --------------------------------------------------------------------
async def _hangs() -> None:
    await asyncio.Event().wait()


async def _fails() -> None:
    raise RuntimeError("already half-stopped")


async def test_a_close_given_up_finishes_past_a_step_that_fails_and_one_that_hangs() -> None:
    """The close finished by hand: "each step bounded", and "one more hang or a transport
    already half-stopped must not stop the others". A sender whose stop raises and an SCTP
    transport whose stop hangs: the ICE transport is still stopped, and the close returns
    (the session's close and the drain at shutdown wait on it)."""
    offerer, answerer = await connected_pair()
    transceiver = answerer.getTransceivers()[0]
    await rtcp_task_never_exits(transceiver.receiver)
    transceiver.sender.stop = _fails  # type: ignore[method-assign]
    assert answerer.sctp is not None
    answerer.sctp.stop = _hangs  # type: ignore[method-assign]
    ice = transceiver.receiver.transport.transport
    try:
        async with asyncio.timeout(8):
            await close_peer_connection(answerer, timeout_s=0.3)
        await asyncio.sleep(0.1)
        state = (ice.state, len(ice._connection._protocols))
    finally:
        await offerer.close()
        await ice.stop()
    assert state == ("closed", 0), f"after the close was given up: ICE {state[0]}, {state[1]}"


async def test_a_close_given_up_leaves_the_connection_state_closed() -> None:
    """GET /sessions/{id} (README: ``connection``, the peer connection's state) of a session
    kept for a resume whose close was given up says "closed", as its sockets are: the
    states follow the ICE transport's, stopped by hand, before the listeners are removed."""
    offerer, answerer = await connected_pair()
    transceiver = answerer.getTransceivers()[0]
    await rtcp_task_never_exits(transceiver.receiver)
    ice = transceiver.receiver.transport.transport
    try:
        await close_peer_connection(answerer, timeout_s=0.3)
        state = answerer.connectionState
    finally:
        await offerer.close()
        await ice.stop()
    assert state == "closed", state


# --- signaling/front.py, signaling/workers.py ------------------------------------------------
class _Alive:
    pid = 1
    killed = False

    def is_alive(self) -> bool:
        return True

    def kill(self) -> None:
        self.killed = True


class _FrontAndWorker:
    """A front over one fake worker whose /metrics answers after ``delay`` s, numbered."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.scraped = 0
        self.worker_runner: web.AppRunner | None = None
        self.front_runner: web.AppRunner | None = None

    async def __aenter__(self) -> _FrontAndWorker:
        async def status(request: web.Request) -> web.Response:
            return web.json_response(
                {"ready": True, "sessions": 0, "listening_ready": True, "refusal": None}
            )

        async def metrics(request: web.Request) -> web.Response:
            self.scraped += 1
            n = self.scraped
            await asyncio.sleep(self.delay)
            return web.Response(
                text=f"# TYPE review_scrape gauge\nreview_scrape {n}\n", content_type="text/plain"
            )

        app = web.Application()
        app.router.add_get(STATUS_PATH, status)
        app.router.add_get("/metrics", metrics)
        config = Config(host="127.0.0.1", port=0, workers=1)
        self.pool = WorkerPool(
            config,
            lambda _config: None,  # type: ignore[arg-type, return-value]
            Path(tempfile.mkdtemp(prefix="rvw")),
        )
        self.worker = self.pool.workers[0]
        self.worker_runner = web.AppRunner(app)
        await self.worker_runner.setup()
        await web.UnixSite(self.worker_runner, self.worker.socket_path).start()
        self.worker.process = _Alive()  # type: ignore[assignment]
        self.worker.open_clients()
        self.front_runner = web.AppRunner(build_front_app(config, self.pool), **runner_options())
        await self.front_runner.setup()
        site = web.TCPSite(self.front_runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.worker.close_clients()
        if self.front_runner is not None:
            await self.front_runner.cleanup()
        if self.worker_runner is not None:
            await self.worker_runner.cleanup()


def _scrape_value(text: str) -> int:
    for line in text.splitlines():
        if line.startswith("review_scrape{"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError(text)


async def test_a_later_metrics_request_gets_a_fresh_scrape() -> None:
    """Concurrent /metrics requests share one scrape; a request after it ended gets a new
    one, not the earlier text for ever."""
    async with _FrontAndWorker(delay=0.0) as h, aiohttp.ClientSession() as http:
        values = []
        for _ in range(3):
            async with http.get(h.url + "/metrics") as resp:
                assert resp.status == 200
                values.append(_scrape_value(await resp.text()))
        assert values == [1, 2, 3]


async def test_scrapes_under_way_do_not_hold_the_status_polls_connections() -> None:
    """Status polls and /metrics scrapes on connections apart: a slow scrape holds none of
    the status polls' connections, and a poll meanwhile answers at once."""
    async with _FrontAndWorker(delay=3.0) as h, aiohttp.ClientSession() as http:

        async def scrape() -> int:
            async with http.get(h.url + "/metrics") as resp:
                await resp.read()
                return resp.status

        pending = asyncio.ensure_future(scrape())
        await asyncio.sleep(0.3)
        assert h.scraped == 1
        assert h.worker.control is not None
        held = len(h.worker.control.connector._acquired)  # type: ignore[union-attr]
        started = time.monotonic()
        await h.pool._poll(h.worker)
        took = time.monotonic() - started
        assert await pending == 200
    assert held == 0, f"the scrape held {held} of the status polls' connections"
    assert took < 1.0, f"the status poll waited {took:.1f} s behind the scrape"


async def test_metrics_requests_with_made_up_tokens_share_one_scrape() -> None:
    """Bug: "concurrent /metrics requests share one scrape per worker" held only for requests
    with the same Authorization header. With no --metrics-token (the default: /metrics is
    public) the front forwarded whatever header a request carried and the worker ignored it:
    a burst of requests each with a made-up header was one scrape per request again, each
    rendered on the worker's loop, which also paces its media (found by review)."""
    async with (
        _FrontAndWorker(delay=0.5) as h,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
    ):

        async def scrape(k: int) -> int:
            headers = {"Authorization": f"Bearer made-up-{k}"}
            async with http.get(h.url + "/metrics", headers=headers) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*(scrape(k) for k in range(12)))
        assert statuses == [200] * 12
        assert h.scraped <= 2, f"{h.scraped} scrapes for 12 concurrent requests"


async def test_closing_a_workers_clients_closes_its_scrape_session() -> None:
    """close_clients runs at each worker restart: the scrape session made by open_clients
    must be closed with the others (an unclosed session per restart, its connections to the
    dead worker's socket kept)."""
    pool = WorkerPool(
        Config(workers=1),
        lambda _config: None,  # type: ignore[arg-type, return-value]
        Path(tempfile.mkdtemp(prefix="rvw")),
    )
    worker = pool.workers[0]
    worker.open_clients()
    sessions = [worker.http, worker.control, worker.scrape]
    assert all(s is not None for s in sessions)
    await worker.close_clients()
    assert all(s is not None and s.closed for s in sessions)


async def test_a_failing_preparation_fails_the_front_as_serve_did() -> None:
    """_prepared: an exception from ``prepare`` other than the model's load error (which the
    download itself logs) is "raised on the loop, as serve() raised it": the workers must not
    start as if the download had succeeded."""

    def prepare() -> None:
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        await asyncio.wait_for(_prepared(prepare, asyncio.Event()), 5)
