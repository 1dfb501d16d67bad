"""The speech plane on Ray Serve: a local Ray instance (CPU), the tiny ChatTTS checkpoint, the
real deployment and the real server, driven through WebRTC. No mocks.

Ray's start-up is slow on a busy 2-core machine (~30 s: a local instance, the Serve
controller, one replica importing torch and loading the model), so one engine serves the
whole module, on one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio

from agent.config import Config, RaySettings
from agent.engine import EngineError, EngineLoadError, UnknownVoice, VoiceOptions, speaks
from agent.engines import create_engine
from agent.raytts.deployment import fingerprint
from agent.raytts.engine import RayServeEngine
from agent.raytts.pacing import Pacer
from signaling.cli import build_parser, config_from_args
from tests.conftest import serve
from tests.doubles import ToneEngine
from tests.rtc_client import RtcClient

pytest_plugins = ["tests.conftest_chattts"]

REPO = Path(__file__).resolve().parent.parent

# The Ray tests share the module's engine and so its event loop. The first one also pays for
# Ray's start-up (~30 s here, more on a loaded machine): a larger timeout than the default.
on_module_loop = pytest.mark.asyncio(loop_scope="module")
ray_timeout = pytest.mark.timeout(360)

LEAD_S = 1.0
TOKEN_S = 512 / 24_000
# Long enough that generation is still running when the tests look (tiny model: its speech
# length follows the text, ~0.4 s per word).
LONG_TEXT = " ".join(["one two three four five six seven eight nine ten"] * 6)


def ray_config(model_dir: Path, *extra: str) -> Config:
    args = [
        "serve",
        "--tts",
        "ray",
        "--model-dir",
        str(model_dir),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--ray-cpus",
        "2",
        "--tts-lead",
        str(LEAD_S),
        *extra,
    ]
    config = config_from_args(build_parser({}).parse_args(args), {})
    return dataclasses.replace(
        config, host="127.0.0.1", port=0, ray=dataclasses.replace(config.ray, health_interval_s=0.5)
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def ray_engine(tiny_model_dir: Path) -> AsyncIterator[tuple[RayServeEngine, Config]]:
    config = ray_config(tiny_model_dir)
    engine = create_engine(config)
    assert isinstance(engine, RayServeEngine)
    assert not engine.ready
    await engine.start()
    try:
        yield engine, config
    finally:
        await engine.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def replica_stats(engine: RayServeEngine) -> dict[str, Any]:
    stats: dict[str, Any] = await engine.handle.stats.remote()
    return stats


# -- no Ray needed -------------------------------------------------------------------------


def test_pacer_holds_a_stream_within_lead_of_real_time() -> None:
    now = [100.0]
    pacer = Pacer(24_000, lead_s=2.0, clock=lambda: now[0])
    assert pacer.sent(24_000) == 0.0  # 1 s sent at t=0: within the lead
    assert pacer.sent(24_000) == 0.0  # 2 s
    assert pacer.sent(12_000) == pytest.approx(0.5)  # 2.5 s sent, 0 s played: wait 0.5 s
    now[0] += 0.5
    assert pacer.sent(0) == 0.0
    now[0] += 10.0  # a slow producer never waits
    assert pacer.sent(24_000) == 0.0


def test_both_chattts_engines_say_what_their_reading_makes_words_of() -> None:
    """In process or on Ray, the pipeline asks the engine (through the circuit breaker) what
    it would say: ChatTTS's reading, not "any letter or digit" (no engine started)."""
    from agent.breaker import CircuitBreaker
    from agent.chattts.engine import ChatTTSEngine
    from agent.config import BreakerSettings, ChatTTSSettings

    engines = [ChatTTSEngine(ChatTTSSettings()), RayServeEngine(RaySettings(), ChatTTSSettings())]
    for engine in engines:
        wrapped = CircuitBreaker(engine, BreakerSettings())  # type: ignore[arg-type]
        assert [speaks(wrapped, t) for t in ("Привет", "\U0001f44d", "℃", "/", "hi")] == [
            False,
            False,
            True,
            True,
            True,
        ], engine
    assert speaks(CircuitBreaker(ToneEngine(), BreakerSettings()), "Привет")  # no reading


class _FailingResponse:
    """A DeploymentResponseGenerator whose replica failed with ``error``, as Ray delivers it."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def __aiter__(self) -> _FailingResponse:
        return self

    async def __anext__(self) -> bytes:
        await asyncio.sleep(0)
        raise self._error

    def cancel(self) -> None:
        pass


class _FailingHandle:
    def __init__(self, errors: list[BaseException]) -> None:
        self._errors = errors
        self.synthesize = self

    def options(self, **_: Any) -> _FailingHandle:
        return self

    def remote(self, *_: Any) -> _FailingResponse:
        return _FailingResponse(self._errors.pop(0))


def _replica_crash_errors(streams: int) -> list[BaseException]:
    """What each stream of a replica gets when its ChatTTS worker crashes: its own pickled
    copy of the one EngineError the crash ended the batch with, in a RayTaskError."""
    import pickle

    from ray.exceptions import RayTaskError

    crash = EngineError("ChatTTS worker crashed: CUDA out of memory", incident="crash 1")
    return [
        RayTaskError(
            "ServeReplica:voice-agent-tts:ChatTTS.handle_request_streaming",
            "Traceback (most recent call last): ...",
            pickle.loads(pickle.dumps(crash)),
        ).as_instanceof_cause()
        for _ in range(streams)
    ]


def _replica_death_errors(streams: int) -> list[BaseException]:
    from ray.exceptions import ActorDiedError

    errors = [ActorDiedError() for _ in range(streams)]
    for error in errors:
        error.actor_id = "a1b2"  # as Ray sets it from the dead actor's context
    return errors


@pytest.mark.parametrize("errors", [_replica_crash_errors, _replica_death_errors])
async def test_one_fault_failing_a_replicas_streams_is_one_breaker_failure(
    errors: Any,
) -> None:
    """A replica's crashed worker or the replica's death fails every stream it served: five
    sessions speaking opened the breaker (default 5 in 30 s), and speech failed on every
    replica for the cool-down (found by review). Each stream's error crosses from the
    replica on its own: the incident is a string, equal on every copy."""
    from agent.breaker import CircuitBreaker
    from agent.config import BreakerSettings

    engine = RayServeEngine(RaySettings(), Config().chattts)
    engine._handle = _FailingHandle(errors(5))  # type: ignore[assignment]
    engine._warm = True
    breaker = CircuitBreaker(engine, BreakerSettings(failures=5))

    async def speak() -> None:
        async for _ in breaker.synthesize("hello there", VoiceOptions()):
            pass

    failed = await asyncio.gather(*(speak() for _ in range(5)), return_exceptions=True)
    assert all(isinstance(f, EngineError) and "replica failed" in str(f) for f in failed)
    assert breaker.state == "closed" and len(breaker._failures) == 1


def test_tts_flag_selects_the_plane() -> None:
    parse = build_parser({}).parse_args
    local = config_from_args(parse(["serve"]), {})
    assert local.tts == "local" and local.ray == RaySettings()
    remote = config_from_args(
        parse(
            [
                "serve",
                "--tts",
                "ray://10.0.0.5:6379",
                "--tts-replicas",
                "2",
                "--tts-max-replicas",
                "6",
                "--tts-gpus-per-replica",
                "0.5",
            ]
        ),
        {},
    )
    assert remote.tts == "ray"
    assert remote.ray.address == "ray://10.0.0.5:6379"
    assert (remote.ray.replicas, remote.ray.max_replicas) == (2, 6)
    assert remote.ray.gpus_per_replica == 0.5
    assert remote.ray.max_streams == RaySettings().max_streams
    env = {"VOICE_AGENT_TTS": "ray", "VOICE_AGENT_TTS_LEAD": "1.5"}
    from_env = config_from_args(build_parser(env).parse_args(["serve"]), env)
    assert (from_env.tts, from_env.ray.address, from_env.ray.lead_s) == ("ray", None, 1.5)
    env = {"VOICE_AGENT_TTS": "ray", "VOICE_AGENT_TTS_MAX_STREAMS": "64"}
    assert config_from_args(build_parser(env).parse_args(["serve"]), env).ray.max_streams == 64
    streams = ["serve", "--tts", "ray", "--tts-max-streams", "12"]
    assert config_from_args(parse(streams), {}).ray.max_streams == 12
    # Below the engine's batch (8), rows would sit idle while streams queue in Serve.
    for bad in ("0", "7"):
        with pytest.raises(ValueError, match=r"max[ -]streams"):
            config_from_args(parse(["serve", "--tts", "ray", "--tts-max-streams", bad]), {})
    for bad in ("ray:/x", "gpu", "ray://"):
        with pytest.raises(ValueError, match="--tts"):
            config_from_args(parse(["serve", "--tts", bad]), {})


@pytest.mark.parametrize("target", [0.0, -1.0, float("nan"), float("inf")])
def test_an_autoscaling_target_serve_would_refuse_is_refused_at_start(target: float) -> None:
    """Ray Serve refused ``target_ongoing_requests`` 0 (pydantic: must be > 0) only when the
    engine deployed, with the server already up."""
    with pytest.raises(ValueError, match="--tts-target-streams"):
        RaySettings(max_replicas=4, target_streams=target)


async def test_media_servers_of_other_sizes_agree_on_the_shared_apps_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's share of the cores (threads=(cores-1)//N, meant for a model in its own
    process) went into the replicas' settings with --tts ray, so into the app's
    fingerprint: media servers with other --workers or core counts each found the running
    app "with other settings" and deployed over it, losing the other's streams."""
    import signaling.workers as workers
    from agent.raytts.deployment import fingerprint

    spawned: list[Config] = []

    class Process:
        pid = 0

        def __init__(self, target: Any, args: tuple[Any, ...], **kwargs: Any) -> None:
            spawned.append(args[0])

        def start(self) -> None:
            pass

    monkeypatch.setattr(workers, "cores", lambda: 16)
    ray = RaySettings(address="ray://auto")
    pool = workers.WorkerPool(Config(tts="ray", ray=ray, workers=4), ToneEngine, tmp_path)  # type: ignore[arg-type]
    monkeypatch.setattr(pool._context, "Process", Process)
    pool._spawn(pool.workers[0])
    assert pool.workers[0].http is not None
    await pool.workers[0].http.close()
    one = Config(tts="ray", ray=ray, workers=1)  # another media server, one process
    assert fingerprint(spawned[0].ray, spawned[0].chattts) == fingerprint(one.ray, one.chattts)


def test_a_replica_a_local_instance_can_never_place_is_refused() -> None:
    """--ray-cpus 1 with --tts-cpus-per-replica 2 (or a GPU per replica on a machine with
    none): Serve waited for the replica without end, saying nothing, /readyz not_ready."""
    from agent.raytts.engine import unplaceable_replica

    cpus = RaySettings(local_cpus=1, cpus_per_replica=2)
    assert "need 2 CPU" in str(unplaceable_replica({"CPU": 1.0}, cpus))
    gpus = RaySettings(gpus_per_replica=1)
    assert "need 1 GPU" in str(unplaceable_replica({"CPU": 16.0}, gpus))
    assert unplaceable_replica({"CPU": 2.0}, RaySettings(cpus_per_replica=2)) is None
    # Every replica asked for (autoscaling's minimum), not one.
    assert "need 4 CPU" in str(unplaceable_replica({"CPU": 2.0}, RaySettings(replicas=4)))
    halves = RaySettings(replicas=3, gpus_per_replica=0.5)
    assert "need 1.5 GPU" in str(unplaceable_replica({"CPU": 8.0, "GPU": 1.0}, halves))


async def test_a_deploying_app_that_disappears_fails_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """serve.run's own wait failed for an app that no longer exists; the wait that replaced
    it polled for ever for one deleted mid-deploy (Serve shut down by the process owning a
    shared local instance): start() never ended, and no engine_failed."""
    import types

    import ray

    import agent.raytts.engine as ray_engine_module

    gone = types.SimpleNamespace(applications={})
    monkeypatch.setattr(ray, "serve", types.SimpleNamespace(status=lambda: gone), raising=False)
    monkeypatch.setattr(ray_engine_module, "DEPLOY_POLL_S", 0.01)
    monkeypatch.setattr(ray_engine_module, "DEPLOY_APPEAR_S", 0.1)
    engine = RayServeEngine(RaySettings(), Config().chattts)
    with pytest.raises(EngineLoadError, match="deleted"):
        async with asyncio.timeout(3):
            await engine._until_running()


# -- a Serve that another media process deployed (fakes: no Ray needed) --------------


class _Info:
    def __init__(self, value: dict[str, Any], slow: list[int]) -> None:
        self._value = value
        self._slow = slow

    def result(self, timeout_s: float | None = None) -> dict[str, Any]:
        if self._slow and self._slow[0] > 0:
            # The replica is busy (every slot held by a playing stream): this call waits in
            # Serve's queue past the caller's timeout, as DeploymentResponse.result says.
            self._slow[0] -= 1
            raise TimeoutError("Timed out resolving to ObjectRef.")
        return self._value

    def __await__(self) -> Any:
        async def value() -> dict[str, Any]:
            return self._value

        return value().__await__()


class _Speech:
    def __aiter__(self) -> _Speech:
        self._left = 3
        return self

    async def __anext__(self) -> bytes:
        await asyncio.sleep(0)
        if self._left == 0:
            raise StopAsyncIteration
        self._left -= 1
        return np.zeros(480, dtype=np.float32).tobytes()

    def cancel(self) -> None:
        pass


class _Handle:
    def __init__(self, info: dict[str, Any], slow: list[int]) -> None:
        self.info = types.SimpleNamespace(remote=lambda: _Info(info, slow))
        self.synthesize = types.SimpleNamespace(remote=lambda *a: _Speech())

    def options(self, **_: Any) -> _Handle:
        return self


class _FakeServe:
    """What the engine reads of ``ray.serve``: an app of our very settings, already deployed
    by another media process, that is DEPLOYING for ``deploying`` status reads, then RUNNING."""

    def __init__(self, info: dict[str, Any], deploying: int, slow: int) -> None:
        self.deploys = 0
        self._reads = 0
        self._deploying = deploying
        self._slow = [slow]
        self._handle = _Handle(info, self._slow)

    def start(self, **_: Any) -> None:
        pass

    def status(self) -> Any:
        self._reads += 1
        state = "DEPLOYING" if self._reads <= self._deploying else "RUNNING"
        app = types.SimpleNamespace(status=state, message="")
        return types.SimpleNamespace(applications={"voice-agent-tts": app})

    def get_app_handle(self, name: str) -> _Handle:
        return self._handle

    # deploying (again)
    def deployment(self, **_: Any) -> Any:
        return lambda cls: types.SimpleNamespace(bind=lambda *a: "app")

    def RunTarget(self, *a: Any, **k: Any) -> Any:  # Serve's name
        return "target"

    def run_many(self, targets: list[Any], **_: Any) -> list[_Handle]:
        self.deploys += 1
        return [self._handle]


@pytest.mark.parametrize(
    ("deploying", "slow", "recorded", "deploys"),
    [
        (3, 0, "ours", 0),
        (0, 1, "ours", 0),
        (0, 0, "other", 1),
        (0, 0, None, 0),  # deployed by an older version, which recorded nothing: asked
    ],
    ids=["app-still-deploying", "replica-busy", "other-settings", "nothing-recorded"],
)
async def test_a_media_process_joining_does_not_redeploy_the_shared_app(
    monkeypatch: pytest.MonkeyPatch,
    deploying: int,
    slow: int,
    recorded: str | None,
    deploys: int,
) -> None:
    """README: the others find the app with the same settings and only attach: deploying an
    unchanged app again makes Serve replace its replicas, which would cut every other media
    process's streams. Bug: the settings were asked of a replica, so an app still DEPLOYING
    (`--workers N --tts ray://auto` starts every worker at once) or a busy replica (every
    --tts-max-streams slot playing: `info` waited in Serve's queue past 30 s) was deployed
    again over itself (found by review). They are read from the cluster's store now."""
    import ray

    import agent.raytts.engine as ray_engine_module

    settings, chattts = RaySettings(address="ray://auto"), Config().chattts
    ours = fingerprint(settings, chattts)
    info = {"sample_rate": 24_000, "pid": 1, "fingerprint": ours}
    fake = _FakeServe(info, deploying=deploying, slow=slow)
    monkeypatch.setattr(ray, "serve", fake, raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # joined the cluster already
    monkeypatch.setattr(ray_engine_module, "DEPLOY_POLL_S", 0.01)
    store = {"ours": ours, "other": "0" * 64, None: None}[recorded]
    written: list[str] = []
    monkeypatch.setattr(ray_engine_module, "_deployed_fingerprint", lambda name: store)
    monkeypatch.setattr(ray_engine_module, "_record_fingerprint", lambda n, v: written.append(v))
    engine = RayServeEngine(settings, chattts)
    try:
        async with asyncio.timeout(20):
            await engine.start()
    finally:
        await engine.close()
    assert engine.sample_rate == 24_000
    assert fake.deploys == deploys
    assert written == [ours] * deploys  # a deploy records what it deployed, before it runs


async def test_close_does_not_wait_on_a_driver_stuck_in_ray(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shutdown cancels start() and calls close(), whose disconnect queued on the one driver
    thread behind a call stuck in Ray (serve.run waiting for a replica that could not be
    placed): the process did not exit on SIGTERM."""
    import threading

    import agent.raytts.engine as ray_engine_module

    monkeypatch.setattr(ray_engine_module, "DISCONNECT_TIMEOUT_S", 0.5)
    engine = RayServeEngine(RaySettings(), Config().chattts)
    release = threading.Event()

    def stuck() -> Any:
        engine._inited_ray = True
        release.wait(30)
        raise RuntimeError("released")

    monkeypatch.setattr(engine, "_connect_and_deploy", stuck)
    monkeypatch.setattr(engine, "_disconnect", lambda: None)
    start = asyncio.get_running_loop().create_task(engine.start())
    await asyncio.sleep(0.2)
    start.cancel()
    try:
        async with asyncio.timeout(3):
            await engine.close()
    finally:
        release.set()


def test_serve_options_come_from_the_settings() -> None:
    from agent.config import ChatTTSSettings
    from agent.raytts.deployment import deployment_options

    fixed = deployment_options(RaySettings(replicas=3, gpus_per_replica=0.25))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.25}
    # Open (playing) streams, not the compute batch: well above it by default.
    assert fixed["max_ongoing_requests"] == RaySettings().max_streams
    assert RaySettings().max_streams >= 4 * ChatTTSSettings().max_batch
    assert deployment_options(RaySettings(max_streams=50))["max_ongoing_requests"] == 50
    scaled = deployment_options(RaySettings(replicas=1, max_replicas=4))
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 4.0,
    }


# -- on a local Ray instance ---------------------------------------------------------------


@on_module_loop
@ray_timeout
async def test_a_stalled_listener_does_not_let_the_replica_run_ahead(
    ray_engine: tuple[RayServeEngine, Config],
) -> None:
    engine, config = ray_engine
    max_buffered_s = config.chattts.max_buffered_s
    before = await replica_stats(engine)
    stream = engine.synthesize(LONG_TEXT, VoiceOptions())
    try:
        first = await anext(stream)
        t0 = time.monotonic()
        seen: list[tuple[float, float, float, int]] = []
        while (elapsed := time.monotonic() - t0) < 4.0:  # the listener reads nothing
            await asyncio.sleep(0.25)
            s = await replica_stats(engine)
            generated = (s["row_steps"] - before["row_steps"]) * TOKEN_S
            sent = (s["sent_samples"] - before["sent_samples"]) / 24_000
            seen.append((elapsed, generated, sent, s["rows"]))
        assert s["active"] == 1 and s["paced_s"] > before["paced_s"]
        # The listener reads again: the stream carries on to its end.
        rest = [c async for c in stream]
    finally:
        await stream.aclose()
    end = await replica_stats(engine)
    assert end["completed"] == before["completed"] + 1 and end["active"] == 0
    total_s = (end["sent_samples"] - before["sent_samples"]) / 24_000
    chunk_s = max(len(c) for c in [first, *rest]) / 24_000  # chunks grow; the largest bounds
    for elapsed, generated, sent, _rows in seen:
        # Sent over Ray: at most the lead ahead of real time (plus the chunk that crossed it);
        # generated: at most the engine's parked buffer (plus a chunk) beyond that.
        assert sent <= elapsed + LEAD_S + chunk_s + 0.3, (seen, chunk_s)
        assert generated <= sent + max_buffered_s + chunk_s + 0.3, (seen, chunk_s)
    # ... while without pacing it would all have been generated by now (the tiny model makes
    # audio many times faster than real time).
    assert seen[-1][1] < total_s - 2.0, (seen, total_s)


@on_module_loop
@ray_timeout
async def test_playing_streams_do_not_hold_every_replica_slot(
    ray_engine: tuple[RayServeEngine, Config],
) -> None:
    """A replica request lasts as long as its audio *plays* (the replica paces itself to
    lead_s ahead of real time), not as long as it generates. Serve's per-replica limit was
    max_batch, so with max_batch utterances playing the next session's utterance waited in
    Serve's queue until one of them had finished playing (14 s with a batch of 2, 18.5 s
    here), while the engine would have started it as soon as it had a row. The limit now
    bounds open streams: the new request enters the replica at once.

    Its first audio is not timed against a fixed bound: how soon the engine gives it a row
    depends on how far ahead of real time the playing streams generate (parked streams lend
    theirs), 0.3 s on an idle machine, seconds on a loaded one. It must come while all the
    others still play, though: before, it came only once one of them had ended."""
    engine, config = ray_engine
    playing_n = config.chattts.max_batch  # as many as the old limit let a replica take
    heard = [asyncio.Event() for _ in range(playing_n)]  # set at each one's first chunk

    async def listener(first: asyncio.Event) -> None:  # plays in real time, as media does
        async for chunk in engine.synthesize(LONG_TEXT, VoiceOptions()):
            first.set()
            await asyncio.sleep(len(chunk) / 24_000)

    playing = [asyncio.create_task(listener(first)) for first in heard]
    tasks: list[asyncio.Task[Any]] = [*playing]
    newer = engine.synthesize("hello there", VoiceOptions())
    try:
        await asyncio.wait_for(asyncio.gather(*(first.wait() for first in heard)), 60)
        # They have played a while: generation ran ahead and parked (on a fast enough CPU).
        await asyncio.sleep(2.0)
        t0 = time.monotonic()
        first_audio = asyncio.create_task(anext(newer))
        tasks.append(first_audio)
        # Serve counts a stats() call against the same per-replica limit: with every slot
        # held by a playing stream, it too waits for one of them to end.
        deadline = t0 + 5.0
        while True:
            try:
                stats = await asyncio.wait_for(replica_stats(engine), deadline - time.monotonic())
            except TimeoutError:
                pytest.fail(f"the replica took no request while {playing_n} streams played")
            if stats["active"] == playing_n + 1:  # the new stream is on the replica
                break
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.05)
        assert len(await asyncio.wait_for(first_audio, 60)) > 0
        waited = time.monotonic() - t0
        assert not any(t.done() for t in playing), "the new stream waited for one to end"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await newer.aclose()  # after its anext() task: a running generator cannot close
    # The cancellations reach the replica before the next test counts its streams.
    deadline = time.monotonic() + 30
    while (await replica_stats(engine))["active"] > 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    print(f"new stream's first audio with {playing_n} playing: {waited:.2f} s")


@on_module_loop
@ray_timeout
async def test_a_voice_the_replica_refuses_is_the_clients_error_not_a_fault(
    ray_engine: tuple[RayServeEngine, Config],
) -> None:
    """The replica's refusal of a voice came back as a plain EngineError ("the speech replica
    failed"), which the circuit breaker counts: one client's bad voice could open it."""
    engine, _config = ray_engine
    with pytest.raises(UnknownVoice) as refused:
        async for _ in engine.synthesize("hello there", VoiceOptions(voice="not-a-voice")):
            pass
    # The refusal's own words reach the client: Ray's str() of it was its whole traceback,
    # with the replica's pid, IP and file paths.
    assert "Traceback" not in str(refused.value) and "not-a-voice" in str(refused.value)
    assert type(refused.value) is UnknownVoice
    chunks = [c async for c in engine.synthesize("hello there", VoiceOptions())]
    assert sum(len(c) for c in chunks) > 0


@on_module_loop
@ray_timeout
async def test_a_config_voice_the_replicas_would_refuse_is_refused_at_config(
    ray_engine: tuple[RayServeEngine, Config],
) -> None:
    """README: a ``config`` voice the engine has no speaker for gets ``unknown_voice`` and
    the voice in use is kept. Bug: the Ray engine had no check_voice, so the session took
    the voice and every utterance after failed with it (found by review)."""
    from agent.breaker import CircuitBreaker
    from agent.config import BreakerSettings
    from agent.engine import RequestError, check_voice

    engine, _config = ray_engine
    breaker = CircuitBreaker(engine, BreakerSettings())
    for bad in (
        VoiceOptions(voice="not-a-voice"),
        VoiceOptions(voice="seed:x"),
        VoiceOptions(voice="\u4e00\u4e01\u3d01"),  # a speaker string of the wrong width
        VoiceOptions(speed=12),
    ):
        with pytest.raises(RequestError):
            check_voice(breaker, bad)  # type: ignore[arg-type]
    check_voice(breaker, VoiceOptions(voice="seed:7", speed=3))  # type: ignore[arg-type]


@on_module_loop
@ray_timeout
async def test_a_continuation_travels_to_the_replica(
    ray_engine: tuple[RayServeEngine, Config],
) -> None:
    """The next sentence of an utterance already playing is marked as such on its request:
    the replica takes the flag (its engine's scheduler starts it ahead of newer streams)."""
    engine, _config = ray_engine
    chunks = [c async for c in engine.synthesize("hello there", VoiceOptions(), continuation=True)]
    assert sum(len(c) for c in chunks) > 0


@on_module_loop
@ray_timeout
async def test_a_dead_replica_fails_its_streams_and_serve_restarts_it(
    ray_engine: tuple[RayServeEngine, Config],
) -> None:
    from agent.breaker import CircuitBreaker
    from agent.config import BreakerSettings

    engine, _config = ray_engine
    before = await replica_stats(engine)
    # Two sessions' streams on the replica: its one death is one failure for the breaker.
    breaker = CircuitBreaker(engine, BreakerSettings(failures=2))
    streams = [breaker.synthesize(LONG_TEXT, VoiceOptions()) for _ in range(2)]
    try:
        for stream in streams:
            assert len(await anext(stream)) > 0
        os.kill(before["pid"], signal.SIGKILL)  # the replica's process dies mid-stream
        for stream in streams:
            with pytest.raises(EngineError, match="speech replica failed") as failed:
                async for _ in stream:
                    pass
            assert "\n" not in str(failed.value) and "Traceback" not in str(failed.value)
        assert breaker.state == "closed", breaker.unavailable
    finally:
        for stream in streams:
            await stream.aclose()
    # Serve notices, readiness drops, a new replica is started and readiness comes back.
    deadline = time.monotonic() + 90
    saw_not_ready = False
    while not (saw_not_ready and engine.ready):
        saw_not_ready = saw_not_ready or not engine.ready
        assert time.monotonic() < deadline, (engine.ready, engine.failure)
        await asyncio.sleep(0.2)
    after = await replica_stats(engine)
    assert after["pid"] != before["pid"]
    chunks = [c async for c in engine.synthesize("hello there", VoiceOptions())]
    assert sum(len(c) for c in chunks) > 0


@on_module_loop
@ray_timeout
async def test_another_media_process_joins_the_cluster_and_shares_the_replica(
    ray_engine: tuple[RayServeEngine, Config], tiny_model_dir: Path
) -> None:
    """`voice-agent serve --tts ray://GCS` in a subprocess, as a second media process: it
    joins the running cluster, finds the app deployed with the same settings and attaches
    (no redeploy: the replica keeps its process), and speaks through it over WebRTC."""
    import ray

    engine, _config = ray_engine
    before = await replica_stats(engine)
    gcs = ray.get_runtime_context().gcs_address
    port = free_port()
    args = [
        *("--host", "127.0.0.1", "--port", str(port), "--model-dir", str(tiny_model_dir)),
        *("--device", "cpu", "--threads", "1", "--tts-lead", str(LEAD_S), "--tts", f"ray://{gcs}"),
    ]
    # A local instance started by ray.init() uses token authentication; a process joining it
    # must ask for it (Ray's own setting).
    env = {**os.environ, "VOICE_AGENT_LOG_LEVEL": "WARNING", "RAY_AUTH_MODE": "token"}
    proc = subprocess.Popen([sys.executable, "-m", "signaling", "serve", *args], cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, "server exited"
                assert time.monotonic() < deadline, "server not ready"
                with contextlib.suppress(aiohttp.ClientConnectionError):
                    async with http.get(url + "/readyz") as resp:
                        if resp.status == 200:
                            assert (await resp.json())["engine"] == "chattts-ray"
                            break
                await asyncio.sleep(0.1)
            client = RtcClient(url, http)
            await client.connect()
            try:
                client.send({"type": "say", "text": "hello there", "id": "h"})
                ended = await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=30)
            finally:
                await client.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert ended["interrupted"] is False
    assert not any(e["type"] == "error" for e in client.events)
    after = await replica_stats(engine)
    assert after["pid"] == before["pid"]  # attached, not redeployed
    assert after["completed"] >= before["completed"] + 2  # its warm-up and its utterance


# Last: the server closes the engine when it shuts down (as in the product).
@on_module_loop
@ray_timeout
async def test_speech_through_ray_serve_over_webrtc_and_cancelling_one_of_two(
    ray_engine: tuple[RayServeEngine, Config],
) -> None:
    engine, config = ray_engine
    assert engine.ready and engine.failure is None and engine.sample_rate == 24_000
    before = await replica_stats(engine)
    async with serve(config, engine) as server, aiohttp.ClientSession() as http:  # type: ignore[arg-type]
        async with http.get(server.url + "/readyz") as resp:
            assert resp.status == 200 and (await resp.json())["engine"] == "chattts-ray"
        a, b = RtcClient(server.url, http), RtcClient(server.url, http)
        await asyncio.gather(a.connect(), b.connect())
        try:
            start_b = len(b.audio.frames)
            a.send({"type": "say", "text": LONG_TEXT, "id": "a"})
            b.send({"type": "say", "text": "one two three four five six seven", "id": "b"})
            await a.wait_event(lambda e: e["type"] == "speech.started", timeout=30)
            await b.wait_event(lambda e: e["type"] == "speech.started", timeout=30)
            both = await replica_stats(engine)
            assert both["active"] == 2  # two streams on the replica
            a.send({"type": "interrupt"})
            t0 = time.monotonic()
            ended_a = await a.wait_event(lambda e: e["type"] == "speech.ended", timeout=10)
            # The cancellation reaches the replica: its generator is cancelled, the ChatTTS
            # stream's row leaves the batch at the worker's next step, the other goes on.
            while True:
                after = await replica_stats(engine)
                if after["cancelled"] > before["cancelled"] and after["rows"] <= 1:
                    break
                assert time.monotonic() - t0 < 3.0, after
                await asyncio.sleep(0.05)
            cancel_s = time.monotonic() - t0
            assert after["cancelled"] == before["cancelled"] + 1 and after["active"] <= 1
            ended_b = await b.wait_event(lambda e: e["type"] == "speech.ended", timeout=60)
            await asyncio.sleep(0.3)
            audio_b = np.concatenate(b.audio.frames[start_b:])
        finally:
            await asyncio.gather(a.close(), b.close())
        end = await replica_stats(engine)  # before the server's shutdown closes the engine
    assert ended_a["interrupted"] is True
    assert ended_b["interrupted"] is False
    assert not any(e["type"] == "error" for e in a.events + b.events)
    assert end["completed"] >= before["completed"] + 1 and end["failed"] == before["failed"]
    assert end["active"] == 0
    # b's speech arrived whole: a random-weight model babbles about as long as the text.
    frame_rms = np.sqrt((audio_b[: len(audio_b) // 960 * 960].reshape(-1, 960) ** 2).mean(1))
    voiced_s = float((frame_rms > 1e-3).sum()) * 0.02
    assert 1.0 < voiced_s < 8.0, voiced_s
    print(f"interrupt -> replica cancelled in {cancel_s * 1000:.0f} ms")
