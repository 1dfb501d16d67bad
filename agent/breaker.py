"""A circuit breaker around the speech engine.

Closed (normal): every utterance goes to the engine. ``failures`` engine failures in a row,
all within ``window_s``, open it: from then on new speech fails at once with
``EngineUnavailable`` (clients get ``tts_unavailable``) instead of waiting on an engine that
keeps failing, and ``unavailable`` says why (``/readyz`` turns unready, new sessions are
refused). After ``cooldown_s`` one probe utterance (``probe_text``) runs on the engine
(half-open); if it produces audio the breaker closes, otherwise it stays open for another
cool-down. The probe runs on its own, so readiness comes back without waiting for traffic.

An utterance whose engine stream gives no audio for ``stall_s`` while the engine gives no
stream any (a hung engine, not a busy one) fails with ``EngineStalled``, a failure like any
other: without it a wedged engine kept its sessions silent for good and never opened the
breaker.

Failures that share an ``EngineError.incident`` (a crashed worker ends every stream of its
batch) count once.

Cancellation (an interrupt, a hang-up) is neither a failure nor a success, and nor is a
``RequestError`` (a voice or option the engine refuses): that is one client's mistake, and
must not take speech down for every session.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

from agent.config import BreakerSettings
from agent.engine import (
    PCM,
    EngineError,
    EngineUnavailable,
    RequestError,
    TTSEngine,
    VoiceOptions,
    check_voice,
    speaks,
)

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0  # an engine that hangs on the probe counts as failed


class EngineStalled(EngineError):
    """The engine gave no audio for ``BreakerSettings.stall_s``: hung. Clients get
    ``tts_failed``; it counts towards opening the breaker."""


class CircuitBreaker:
    """A TTSEngine that wraps another one (see the module docstring)."""

    def __init__(
        self,
        engine: TTSEngine,
        settings: BreakerSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = engine
        self.name = engine.name
        self.settings = settings
        self._clock = clock
        self.state = "closed"  # closed | open | half_open
        self._failures: deque[float] = deque()  # times of the current run of failures
        self._incident: str | None = None  # the fault the last failure counted came from
        self._incident_at = -math.inf  # when that failure was counted
        self._opened_at = 0.0
        self.last_error: str | None = None
        self.opened = 0  # times the breaker opened (figures)
        self._timer: asyncio.TimerHandle | None = None
        self._probe: asyncio.Task[None] | None = None
        # When any stream last got audio from the engine (event-loop time): a stream is
        # stalled only when the whole engine has been silent (see _next_chunk).
        self._audio_at = -math.inf

    # --- TTSEngine -------------------------------------------------------------------------
    @property
    def sample_rate(self) -> int:
        # Read through, not copied: an engine can learn its rate at start (agent/raytts).
        return self.inner.sample_rate

    @property
    def ready(self) -> bool:
        return self.inner.ready

    @property
    def failure(self) -> str | None:
        return self.inner.failure

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        await self.inner.close()

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        reason = self.unavailable
        if reason is not None:
            raise EngineUnavailable(reason)
        try:
            speech = self.inner.synthesize(text, voice, continuation=continuation)
            async with aclosing(speech) as chunks:
                while True:
                    # Only the engine's own time is timed: between chunks the listener's
                    # back-pressure may hold us (a full buffer) for as long as it likes.
                    try:
                        chunk = await self._next_chunk(chunks)
                    except StopAsyncIteration:
                        break
                    self._audio_at = asyncio.get_running_loop().time()
                    yield chunk
        except (asyncio.CancelledError, GeneratorExit, RequestError):
            raise
        except Exception as exc:
            self._failed(exc)
            raise
        self._succeeded()

    async def _next_chunk(self, chunks: AsyncGenerator[PCM, None]) -> PCM:
        """The stream's next chunk; ``EngineStalled`` once it has waited ``stall_s`` while
        the engine gave no stream any audio. A stream queued behind a full batch of others
        that are speaking waits its turn: the engine is busy, not hung (timing each stream
        alone turned an overload into stalls in a row, an open breaker and an outage;
        found by review)."""
        stall_s = self.settings.stall_s
        if not stall_s:
            return await anext(chunks)
        loop = asyncio.get_running_loop()
        step = asyncio.ensure_future(anext(chunks))
        try:
            while True:
                done, _ = await asyncio.wait({step}, timeout=stall_s)
                if done:
                    return step.result()
                if loop.time() - self._audio_at >= stall_s:
                    raise EngineStalled(f"the speech engine produced no audio for {stall_s:g} s")
        finally:
            if not step.done():
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await step
            elif not step.cancelled():
                # Ended in the turn this wait was cancelled (an interrupt as the stream ran
                # out): its StopAsyncIteration, or error, is nobody's now. Unretrieved, asyncio
                # logged "Task exception was never retrieved" as an ERROR (found by fuzzing).
                step.exception()

    def check_voice(self, voice: VoiceOptions) -> None:
        check_voice(self.inner, voice)  # the engine's own check, if it has one

    def speakable(self, text: str) -> bool:
        return speaks(self.inner, text)  # the engine's own reading, if it says

    # --- state -----------------------------------------------------------------------------
    @property
    def unavailable(self) -> str | None:
        """Why new speech fails fast (None while the breaker is closed)."""
        if self.state == "closed":
            return None
        return (
            f"the speech engine failed {self.settings.failures} times in a row "
            f"(last: {self.last_error}); retrying in {self.retry_after_s:.0f} s"
        )

    @property
    def retry_after_s(self) -> float:
        """Seconds until the next probe (0 while one runs or the breaker is closed)."""
        if self.state != "open":
            return 0.0
        return max(0.0, self._opened_at + self.settings.cooldown_s - self._clock())

    def _failed(self, exc: Exception) -> None:
        now = self._clock()
        self.last_error = str(exc)[:200] or type(exc).__name__
        incident = getattr(exc, "incident", None)
        if (
            incident is not None
            and incident == self._incident
            and now - self._incident_at <= self.settings.window_s
        ):
            # Another stream the same fault ended: one crashed worker failing a batch of five
            # opened the breaker, an outage of cooldown_s where the worker's restart takes 2 s.
            # Within the window only: a fault whose errors go on is a failure again.
            return
        self._incident, self._incident_at = incident, now
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.settings.window_s:
            self._failures.popleft()
        if self.state == "closed" and len(self._failures) >= self.settings.failures:
            self._open("opened")

    def _succeeded(self) -> None:
        self._failures.clear()

    def _open(self, what: str) -> None:
        self.state = "open"
        self._opened_at = self._clock()
        self.opened += 1
        log.warning(
            "speech engine circuit breaker %s (%s); probing in %.1f s",
            what,
            self.last_error,
            self.settings.cooldown_s,
        )
        loop = asyncio.get_running_loop()
        # Opened by some session's failing utterance, in its context: the probe is no one
        # session's, so its lines must not carry that session's id.
        self._timer = loop.call_later(
            self.settings.cooldown_s, self._start_probe, context=contextvars.Context()
        )

    def _start_probe(self) -> None:
        self._timer = None
        self.state = "half_open"
        self._probe = asyncio.get_running_loop().create_task(self._run_probe())

    async def _run_probe(self) -> None:
        try:
            audio = 0
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                gen = self.inner.synthesize(self.settings.probe_text, VoiceOptions())
                async with aclosing(gen) as chunks:
                    async for chunk in chunks:
                        audio += len(chunk)
            if not audio:
                raise RuntimeError("the probe produced no audio")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure keeps the breaker open
            self.last_error = str(exc)[:200] or type(exc).__name__
            self._open("stays open: the probe failed")
            return
        self.state = "closed"
        self._failures.clear()
        log.info("speech engine circuit breaker closed: the probe succeeded")
