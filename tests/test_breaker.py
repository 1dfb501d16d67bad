"""Engine faults through the real server: an exception mid-utterance ends that utterance with
an error and the session goes on; repeated failures open the circuit breaker (fail fast with
tts_unavailable, /readyz unready, new sessions refused), and a probe closes it again."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from agent.breaker import CircuitBreaker, EngineStalled
from agent.config import BreakerSettings, Config, SpeechSettings
from agent.engine import PCM, EngineUnavailable, RequestError, VoiceOptions
from agent.speech import SpeechPipeline
from tests.conftest import LiveServer
from tests.doubles import FailingEngine, ToneEngine
from tests.rtc_client import RtcClient

pytestmark = pytest.mark.timeout(60)

BREAKER = BreakerSettings(failures=3, window_s=10, cooldown_s=1.0, stall_s=1.0)


@pytest.fixture
def tone_engine() -> ToneEngine:
    return FailingEngine()


@pytest.fixture
def server_config() -> Config:
    return Config(host="127.0.0.1", port=0, breaker=BREAKER)


@contextlib.asynccontextmanager
async def connected(
    live_server: LiveServer,
) -> AsyncIterator[tuple[FailingEngine, aiohttp.ClientSession, RtcClient]]:
    """The server's failing engine, and a client connected to it (closed at the end)."""
    engine = live_server.engine
    assert isinstance(engine, FailingEngine)
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        try:
            yield engine, http, client
        finally:
            await client.close()


async def say(client: RtcClient, utt_id: str) -> list[dict[str, Any]]:
    """Say something; the events of that utterance once it ended."""
    client.send({"type": "say", "text": "one two three four", "id": utt_id})
    await client.wait_event(lambda e: e["type"] == "speech.ended" and e.get("id") == utt_id)
    return [e for e in client.events if e.get("id") == utt_id]


async def readyz(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url + "/readyz") as resp:
        return resp.status, await resp.json()


async def test_an_engine_failure_mid_utterance_ends_it_and_the_session_goes_on(
    live_server: LiveServer,
) -> None:
    async with connected(live_server) as (engine, _http, client):
        engine.mode = "midway"
        events = await say(client, "broken")
        engine.mode = "ok"
        after = await say(client, "fine")
    kinds = [e["type"] for e in events]
    # The audio made before the failure is played (the error is sent when it happens,
    # speech.started when the first frame is heard).
    assert "speech.started" in kinds and kinds.index("error") < kinds.index("speech.ended")
    error = next(e for e in events if e["type"] == "error")
    assert error["code"] == "tts_failed" and "mid-utterance" in error["message"]
    assert events[-1] == {"type": "speech.ended", "id": "broken", "interrupted": True}
    assert [e["type"] for e in after if e["type"] != "speech.segment"] == [
        "speech.started",
        "speech.ended",
    ]
    assert after[-1]["interrupted"] is False


async def test_a_hung_engine_fails_the_utterance_and_the_session_goes_on(
    live_server: LiveServer,
) -> None:
    """An engine stream that stops giving audio (a wedged GPU, a lost replica) kept its
    session silent for good, every later utterance queued behind it, and never counted as a
    failure (found by review). After ``stall_s`` without audio it fails like an exception."""
    async with connected(live_server) as (engine, _http, client):
        engine.mode = "hang"
        events = await say(client, "stuck")
        engine.mode = "ok"
        after = await say(client, "fine")
    error = next(e for e in events if e["type"] == "error")
    assert error["code"] == "tts_failed" and "no audio for 1 s" in error["message"], error
    assert "speech.started" in [e["type"] for e in events]  # what came before it plays
    assert events[-1] == {"type": "speech.ended", "id": "stuck", "interrupted": True}
    assert engine.hung == 1  # the engine's stream was cancelled, not left waiting
    assert after[-1] == {"type": "speech.ended", "id": "fine", "interrupted": False}


async def test_repeated_failures_open_the_breaker_and_a_probe_closes_it(
    live_server: LiveServer,
) -> None:
    async with connected(live_server) as (engine, http, client):
        engine.mode = "start"
        for n in range(BREAKER.failures):
            events = await say(client, f"f{n}")
            assert [e["code"] for e in events if e["type"] == "error"] == ["tts_failed"]
        assert engine.failures == BREAKER.failures
        # Open: new speech fails fast without touching the engine.
        started = time.monotonic()
        events = await say(client, "fast")
        assert time.monotonic() - started < 0.5
        assert engine.failures == BREAKER.failures
        error = next(e for e in events if e["type"] == "error")
        assert error["code"] == "tts_unavailable" and "worker crashed" in error["message"]
        assert events[-1]["interrupted"] is True
        status, body = await readyz(http, live_server.url)
        assert status == 503 and body["error"]["code"] == "tts_unavailable"
        # Like every tts_unavailable (README), /readyz's says when the next probe runs.
        async with http.get(live_server.url + "/readyz") as resp:
            assert int(resp.headers["Retry-After"]) >= 1
        offer = {"type": "offer", "sdp": client.pc.localDescription.sdp}
        async with http.post(live_server.url + "/offer", json=offer) as resp:
            assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1
            assert (await resp.json())["error"]["code"] == "tts_unavailable"
        say_url = f"{live_server.url}/sessions/{client.session_id}/say"
        async with http.post(say_url, json={"text": "hello"}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "tts_unavailable"

        # The probe after the cool-down fails too: still open.
        await asyncio.sleep(BREAKER.cooldown_s + 0.3)
        assert engine.failures == BREAKER.failures + 1
        assert (await readyz(http, live_server.url))[0] == 503

        # The engine recovers: the next probe closes the breaker, speech works again.
        engine.mode = "ok"
        deadline = time.monotonic() + BREAKER.cooldown_s + 2
        while (await readyz(http, live_server.url))[0] != 200:
            assert time.monotonic() < deadline, "the breaker never closed"
            await asyncio.sleep(0.1)
        events = await say(client, "back")
        assert not [e for e in events if e["type"] == "error"]
        assert events[-1] == {"type": "speech.ended", "id": "back", "interrupted": False}


async def test_one_clients_unusable_voice_is_its_error_not_an_engine_failure(
    live_server: LiveServer,
) -> None:
    """One client's bad voice took speech down for every session: the breaker counted the
    engine's "unknown voice" as an engine failure, so a few utterances in a typo'd voice opened
    it (tts_unavailable for everyone, /readyz unready). Now an engine that can tell refuses
    the voice at ``config`` (unknown_voice, the voice in use kept); a refusal found only when
    speaking is that utterance's unknown_voice; neither counts as a failure."""
    async with connected(live_server) as (engine, http, client):
        client.send({"type": "config", "voice": "my-favourite-voice"})
        error = await client.wait_event(lambda e: e["type"] == "error")
        assert error["code"] == "unknown_voice" and "my-favourite-voice" in error["message"]
        events = await say(client, "kept")
        assert not [e for e in events if e["type"] == "error"]
        engine.mode = "refuse"
        for n in range(BREAKER.failures + 1):
            events = await say(client, f"r{n}")
            assert [e["code"] for e in events if e["type"] == "error"] == ["unknown_voice"]
        assert (await readyz(http, live_server.url))[0] == 200
        engine.mode = "ok"
        events = await say(client, "fine")
        assert not [e for e in events if e["type"] == "error"]
        assert events[-1] == {"type": "speech.ended", "id": "fine", "interrupted": False}


async def test_interrupts_are_not_failures(live_server: LiveServer) -> None:
    async with connected(live_server) as (_engine, http, client):
        for n in range(BREAKER.failures + 1):
            client.send({"type": "say", "text": " ".join(["w"] * 20), "id": f"i{n}"})
            await client.wait_event(lambda e, i=n: e == {"type": "speech.started", "id": f"i{i}"})
            client.send({"type": "interrupt"})
            await client.wait_event(
                lambda e, i=n: e.get("id") == f"i{i}" and e["type"] == "speech.ended"
            )
        assert (await readyz(http, live_server.url))[0] == 200


def test_the_breaker_reports_the_rate_its_engine_learned_at_start() -> None:
    """A Ray engine learns its rate from the replica at start, after the breaker wrapped it:
    the speech path must resample from (and encode at) that rate, not the one at wrapping."""
    engine = ToneEngine(sample_rate=24_000)
    breaker = CircuitBreaker(engine, BREAKER)
    engine.sample_rate = 16_000  # what agent/raytts/engine.py does in start()
    assert breaker.sample_rate == 16_000
    assert SpeechPipeline(breaker, SpeechSettings(), lambda event: None).rate == 16_000


async def test_the_breaker_passes_continuation_through() -> None:
    """The pipeline says which segments continue speech already playing; in the product it
    says it to the breaker, which must not drop it on the way to the engine."""
    seen: list[bool] = []

    class Recording(ToneEngine):
        async def synthesize(
            self, text: str, voice: VoiceOptions, *, continuation: bool = False
        ) -> AsyncGenerator[PCM, None]:
            seen.append(continuation)
            async for chunk in super().synthesize(text, voice, continuation=continuation):
                yield chunk

    breaker = CircuitBreaker(Recording(), BREAKER)
    for continuation in (False, True):
        async for _chunk in breaker.synthesize("hi", VoiceOptions(), continuation=continuation):
            pass
    assert seen == [False, True]


# --- the breaker alone: a scripted engine and a clock the test moves ------------------------
class ScriptedEngine(ToneEngine):
    """Each utterance does what ``outcomes`` says next: "ok" speaks, "fail" raises after the
    first chunk, "refuse" raises a RequestError, "silent" yields nothing."""

    def __init__(self, *outcomes: str) -> None:
        super().__init__(seconds_per_word=0.02)
        self.outcomes = list(outcomes)

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        outcome = self.outcomes.pop(0) if self.outcomes else "ok"
        if outcome == "refuse":
            raise RequestError("no such voice")
        if outcome == "silent":
            return
        async for chunk in super().synthesize(text, voice, continuation=continuation):
            yield chunk
            if outcome == "fail":
                raise RuntimeError("the engine crashed")


async def _speak(breaker: CircuitBreaker) -> str:
    try:
        async for _chunk in breaker.synthesize("one two", VoiceOptions()):
            pass
    except EngineUnavailable:
        return "unavailable"
    except RequestError:
        return "refused"
    except RuntimeError:
        return "failed"
    return "ok"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def test_failures_open_the_breaker_only_when_in_a_row_and_within_the_window() -> None:
    clock = Clock()
    settings = BreakerSettings(failures=3, window_s=10, cooldown_s=100)
    breaker = CircuitBreaker(ScriptedEngine(*["fail"] * 5), settings, clock)
    try:
        for _ in range(3):  # three failures, but 6 s apart: never three within 10 s
            assert await _speak(breaker) == "failed"
            clock.now += 6
        assert breaker.state == "closed"
        assert await _speak(breaker) == "failed"  # now the last three are within 10 s ...
        assert await _speak(breaker) == "failed"
        assert breaker.state == "open" and breaker.opened == 1  # ... at exactly `failures`
        assert await _speak(breaker) == "unavailable"
    finally:
        await breaker.close()


async def test_a_success_or_a_refused_request_between_failures() -> None:
    """A success ends the run of failures; a RequestError (one client's bad voice) neither
    counts nor ends it."""
    settings = BreakerSettings(failures=2, window_s=10, cooldown_s=100)
    breaker = CircuitBreaker(ScriptedEngine("fail", "ok", "fail", "refuse"), settings, Clock())
    try:
        assert [await _speak(breaker) for _ in range(4)] == ["failed", "ok", "failed", "refused"]
        assert breaker.state == "closed"
        assert await _speak(breaker) == "ok"
    finally:
        await breaker.close()
    breaker = CircuitBreaker(ScriptedEngine("fail", "refuse", "fail"), settings, Clock())
    try:
        assert [await _speak(breaker) for _ in range(3)] == ["failed", "refused", "failed"]
        assert breaker.state == "open"
    finally:
        await breaker.close()


async def test_a_probe_must_produce_audio_and_its_success_starts_a_fresh_count() -> None:
    settings = BreakerSettings(failures=2, window_s=10, cooldown_s=0.05)
    engine = ScriptedEngine("fail", "fail", "silent", "ok", "fail")
    breaker = CircuitBreaker(engine, settings, Clock())
    try:
        assert [await _speak(breaker) for _ in range(2)] == ["failed", "failed"]
        assert breaker.state == "open"
        async with asyncio.timeout(5):
            while breaker.last_error != "the probe produced no audio":
                await asyncio.sleep(0.005)
        assert breaker.state == "open"  # the first probe spoke nothing: still open
        async with asyncio.timeout(5):
            while breaker.state != "closed":  # the second probe speaks
                await asyncio.sleep(0.01)
        assert await _speak(breaker) == "failed"  # one failure after closing is one, not three
        assert breaker.state == "closed"
    finally:
        await breaker.close()


async def test_stalls_count_as_failures_but_a_slow_listener_is_not_a_stall() -> None:
    settings = BreakerSettings(failures=2, window_s=10, cooldown_s=100, stall_s=0.1)
    engine = FailingEngine(seconds_per_word=0.02)
    engine.mode, engine.good_chunks = "hang", 0
    breaker = CircuitBreaker(engine, settings, Clock())
    try:
        for _ in range(2):
            with pytest.raises(EngineStalled, match=r"no audio for 0\.1 s"):
                async for _chunk in breaker.synthesize("one two", VoiceOptions()):
                    pass
        assert breaker.state == "open" and engine.hung == 2
    finally:
        await breaker.close()
    # Back-pressure: a listener whose buffer is full reads the next chunk late. Only the
    # engine's own time counts.
    breaker = CircuitBreaker(ToneEngine(seconds_per_word=0.05), settings, Clock())
    try:
        chunks = 0
        async for _chunk in breaker.synthesize("one two three", VoiceOptions()):
            chunks += 1
            await asyncio.sleep(0.25)
        assert chunks > 1 and breaker.state == "closed" and not breaker._failures
    finally:
        await breaker.close()


async def test_utterances_failing_after_the_breaker_opened_do_not_reopen_it() -> None:
    """Utterances already running when the breaker opened may fail afterwards: the breaker
    is open already, its cool-down is not restarted (nor another probe scheduled)."""
    clock = Clock()
    settings = BreakerSettings(failures=2, window_s=10, cooldown_s=100)
    breaker = CircuitBreaker(ScriptedEngine(*["fail"] * 3), settings, clock)
    try:
        running = breaker.synthesize("one two", VoiceOptions())
        await running.__anext__()  # started while the breaker was closed
        assert [await _speak(breaker) for _ in range(2)] == ["failed", "failed"]
        retry = breaker.retry_after_s
        clock.now += 5  # within the window: three failures in a row now
        with pytest.raises(RuntimeError):
            await running.__anext__()
        assert breaker.opened == 1 and breaker.retry_after_s == pytest.approx(retry - 5)
    finally:
        await breaker.close()


class OneAtATimeEngine:
    """A healthy engine with room for one stream at a time (a full batch): each stream
    yields a chunk every 50 ms for ``stream_s``; the others wait for their turn."""

    name = "busy"
    sample_rate = 24_000
    ready = True
    failure = None

    def __init__(self, stream_s: float) -> None:
        self.stream_s = stream_s
        self._turn = asyncio.Semaphore(1)
        self.chunks = 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        async with self._turn:
            for _ in range(round(self.stream_s / 0.05)):
                await asyncio.sleep(0.05)
                self.chunks += 1
                yield np.zeros(1200, dtype=np.float32)


async def test_a_busy_engine_that_keeps_producing_audio_does_not_open_the_breaker() -> None:
    """The stall timer ran per stream from its request, a place in the engine's batch
    included. An engine that is merely saturated (full-size ChatTTS on CPU with a full
    batch, Ray Serve queueing while a replica starts) produces audio all along, yet the
    streams queued behind the batch each "stalled": ``failures`` of them in a row opened
    the breaker, and the whole process refused speech (found by review)."""
    settings = BreakerSettings(failures=2, window_s=30, cooldown_s=100, stall_s=0.3)
    engine = OneAtATimeEngine(stream_s=1.0)
    breaker = CircuitBreaker(engine, settings, time.monotonic)

    async def speak(text: str) -> str:
        try:
            async for _chunk in breaker.synthesize(text, VoiceOptions()):
                pass
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__
        return "ok"

    try:
        outcomes = await asyncio.gather(*(speak(f"utterance {i}") for i in range(3)))
        state = breaker.state
    finally:
        await breaker.close()
    assert engine.chunks >= 20  # the engine was producing audio the whole time
    assert state == "closed", (
        f"a healthy engine busy with another stream opened the breaker: {outcomes}"
    )


async def test_a_stream_ending_as_its_reader_is_cancelled_leaves_no_unretrieved_error() -> None:
    """The wait for the next chunk runs in a task of its own (the stall timer); when the
    engine's stream ended (StopAsyncIteration) in the same loop turn as the reader was
    cancelled (an interrupt), the task's exception was never retrieved and asyncio logged
    "Task exception was never retrieved" as an ERROR (found by tests/test_fuzz.py in CI)."""
    loop = asyncio.get_running_loop()
    lost: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: lost.append(context))
    try:
        release = asyncio.Event()

        async def ends_on_release() -> AsyncGenerator[PCM, None]:
            await release.wait()
            return
            yield  # an async generator

        breaker = CircuitBreaker(ToneEngine(), BreakerSettings(stall_s=5.0))
        chunks = ends_on_release()
        reader = asyncio.ensure_future(breaker._next_chunk(chunks))
        await asyncio.sleep(0.01)  # the reader waits on the step task
        release.set()  # the step task ends with StopAsyncIteration next ...
        reader.cancel()  # ... in the same turn as the reader is cancelled
        with pytest.raises(asyncio.CancelledError):
            await reader
        await chunks.aclose()
        del reader
        import gc

        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert not lost, [c.get("message") for c in lost]
