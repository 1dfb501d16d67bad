"""Many sessions, one model: a worker thread that owns the model and interleaves every stream.

- One thread does all inference, so the event loop never blocks and the model is never used
  from two threads at once (ChatTTS is not thread-safe).
- Continuous batching: every active stream is a row of one batched GPT step; a new stream
  joins at the next step (prefilled on its own), a finished or cancelled one leaves. Streams
  whose text arrives together therefore generate together, and every active stream gets
  exactly one token per step (fairness).
- Backpressure: each stream has a bounded hand-off buffer (seconds of audio not yet taken by
  its consumer). A stream over the limit is parked (its KV cache set aside, no compute; its
  slot goes to the next stream waiting) and resumes once its consumer has read it down to
  half, even if that makes the batch wider than ``max_batch`` for a while.
- Cancellation marks one stream; the worker drops its row at the next step boundary. Other
  streams are untouched (ChatTTS's ``interrupt()`` is never used: it stops everyone).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from agent.chattts.decode import (
    SAMPLES_PER_TOKEN,
    StreamingDecoder,
    StreamParams,
    chat_decode_batch,
)
from agent.chattts.gpt import BatchedGPT, Row
from agent.chattts.voices import VoiceBank
from agent.engine import PCM, EngineError, VoiceOptions
from agent.logcontext import SESSION_ID

log = logging.getLogger(__name__)

SAMPLE_RATE = 24_000


@dataclass
class StreamStats:
    submitted: float = field(default_factory=time.perf_counter)
    first_audio: float | None = None  # perf_counter when the first chunk was handed over
    first_audio_tokens: int | None = None  # tokens generated when the first chunk was decoded
    finished: float | None = None
    tokens: int = 0
    decoded_tokens: int = 0
    decode_seconds: float = 0.0
    chunks: int = 0
    samples: int = 0
    parked: int = 0  # times parked for backpressure


@dataclass
class SchedulerStats:
    """Where the worker's time goes (read by benches and metrics; written by the worker)."""

    steps: int = 0
    step_seconds: float = 0.0
    row_steps: int = 0  # sum of batch sizes over steps
    prefills: int = 0
    prefill_seconds: float = 0.0
    decodes: int = 0
    decode_seconds: float = 0.0


class Stream:
    """One utterance, shared by the worker thread (producer) and an event loop (consumer)."""

    def __init__(
        self,
        sid: int,
        text: str,
        voice: VoiceOptions,
        loop: asyncio.AbstractEventLoop,
        max_buffered: int,
        wake: threading.Condition,
    ) -> None:
        self.id = sid
        self.text = text
        self.voice = voice
        # Made on the session's event loop: its log lines from the worker thread name it.
        self.session_id = SESSION_ID.get()
        self.stats = StreamStats()
        self._loop = loop
        self._max_buffered = max_buffered  # samples
        self._wake = wake
        self._lock = threading.Lock()
        self._chunks: collections.deque[PCM] = collections.deque()
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._incident: str | None = None  # what else the same fault failed (EngineError)
        self._event = asyncio.Event()
        self._cancelled = threading.Event()
        # Worker-only state.
        self.row: Row | None = None
        self.decoder: StreamingDecoder | None = None
        self.parked = False
        self.continuation = False  # continues text already playing: admitted at once

    # -- consumer side (event loop) --------------------------------------------------------
    async def get(self) -> PCM | None:
        """Next chunk, or None at the end. Raises ``EngineError`` if synthesis failed."""
        while True:
            with self._lock:
                if self._chunks:
                    chunk = self._chunks.popleft()
                    was_full = self._buffered > self._max_buffered // 2
                    self._buffered -= len(chunk)
                    resume = was_full and self._buffered <= self._max_buffered // 2
                elif self._done:
                    if self._error is not None:
                        raise EngineError(
                            str(self._error), incident=self._incident
                        ) from self._error
                    return None
                else:
                    self._event.clear()
                    chunk = None
            if chunk is not None:
                if resume:
                    with self._wake:
                        self._wake.notify()
                return chunk
            await self._event.wait()

    def cancel(self) -> None:
        if not self._cancelled.is_set():
            self._cancelled.set()
            with self._wake:
                self._wake.notify()

    # -- producer side (worker thread) -----------------------------------------------------
    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def over_limit(self) -> bool:
        with self._lock:
            return self._buffered > self._max_buffered

    @property
    def may_resume(self) -> bool:
        with self._lock:
            return self._buffered <= self._max_buffered // 2

    def put(self, chunk: PCM) -> None:
        if len(chunk) == 0:
            return
        if self.stats.first_audio is None:
            self.stats.first_audio = time.perf_counter()
        self.stats.chunks += 1
        self.stats.samples += len(chunk)
        with self._lock:
            self._chunks.append(chunk)
            self._buffered += len(chunk)
        self._signal()

    def finish(self, error: BaseException | None = None, incident: str | None = None) -> None:
        self.stats.finished = time.perf_counter()
        with self._lock:
            self._done = True
            self._error = error
            self._incident = incident
        self._signal()

    def _signal(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:
            # The consumer's loop is closed: nobody will read this stream again.
            self._cancelled.set()


class Scheduler:
    """Owns the model on one worker thread; ``submit`` may be called from any event loop."""

    def __init__(
        self,
        chat: Any,
        params: StreamParams,
        *,
        max_batch: int = 8,
        max_buffered_s: float = 2.0,
        default_voice: str = "seed:2",
        max_new_tokens: int = 2048,
        on_crash: Callable[[], None] | None = None,
    ) -> None:
        self.chat = chat
        self._on_crash = on_crash  # called on the worker thread once it has crashed
        self.params = params
        self.max_batch = max_batch
        self.max_buffered = int(max_buffered_s * SAMPLE_RATE)
        self._gpt = BatchedGPT(chat)
        self._voices = VoiceBank(chat, default_voice, max_new_tokens)
        self._cond = threading.Condition()
        self.crash: str | None = None  # why the worker stopped, if it crashed
        # One key for every error the crash causes (EngineError.incident): the streams it
        # ended and the ones refused while a restart is pending. The engine sets it to None
        # when it gives up restarting: refusals from then on are failures of their own, or
        # the breaker, counting one failure for good, would never open on a dead engine.
        self.crash_incident: str | None = f"ChatTTS worker crash {uuid.uuid4().hex}"
        self._inbox: collections.deque[Stream] = collections.deque()
        self._stop = False
        self._ids = itertools.count(1)
        self._streams: list[Stream] = []  # admitted: active or parked (worker only)
        self._thread: threading.Thread | None = None
        self.stats = SchedulerStats()

    @property
    def steps(self) -> int:
        return self.stats.steps

    def measured_rtf(self) -> float | None:
        """Seconds of batched-step compute per second of audio for one row, so far."""
        if self.stats.row_steps == 0:
            return None
        tokens_per_s = SAMPLE_RATE / SAMPLES_PER_TOKEN
        return self.stats.step_seconds / self.stats.steps * tokens_per_s

    @property
    def gpt(self) -> BatchedGPT:
        return self._gpt

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="chattts-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, text: str, voice: VoiceOptions, continuation: bool = False) -> Stream:
        """Queue an utterance; must be called from the event loop that will consume it.

        ``continuation``: the next generation of an utterance already playing (its next
        sentence, or a long segment's next piece, agent/chattts/engine.py). It starts at the
        next step, ahead of streams waiting and even with the batch full, as a parked stream
        resumes: speech already heard must not stall behind streams that have not started.
        The batch widens past ``max_batch`` only by such streams, at most one per utterance
        playing; new utterances still wait for a slot."""
        if self.crash is not None:
            raise EngineError(self.crash, incident=self.crash_incident)
        if not self.alive:
            raise EngineError("ChatTTS worker is not running")
        stream = Stream(
            next(self._ids), text, voice, asyncio.get_running_loop(), self.max_buffered, self._cond
        )
        stream.continuation = continuation
        with self._cond:
            if self._stop:
                raise EngineError("engine is closed")
            if self.crash is not None:
                raise EngineError(self.crash, incident=self.crash_incident)
            self._inbox.append(stream)
            self._cond.notify()
        return stream

    # -- worker ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._tick():
                pass
        except BaseException as e:  # a bug or a device error: fail every stream, loudly
            log.exception("ChatTTS worker crashed")
            with self._cond:  # under the lock: no stream can slip in unfinished
                self.crash = f"ChatTTS worker crashed: {e!r}"
                for s in [*self._streams, *self._inbox]:
                    s.finish(e, self.crash_incident)
                self._inbox.clear()
            if self._on_crash is not None:
                self._on_crash()
            # Not raised on: logged above, and threading's hook would only print it again.

    def _runnable(self) -> bool:
        return (
            bool(self._gpt.rows)
            or any(s.cancelled or (s.parked and s.may_resume) for s in self._streams)
            or (bool(self._inbox) and self._room())
            or any(s.continuation for s in self._inbox)
            or any(s.cancelled for s in self._inbox)
        )

    def _room(self) -> bool:
        return sum(1 for s in self._streams if not s.parked) < self.max_batch

    def _tick(self) -> bool:
        with self._cond:
            while not self._stop and not self._runnable():
                self._cond.wait(timeout=1.0)
            if self._stop:
                closed = f"ChatTTS closed {uuid.uuid4().hex}"  # one incident: every stream ends
                for s in [*self._streams, *self._inbox]:
                    s.finish(EngineError("engine closed"), closed)
                return False
            # Cancelled before they started (e.g. interrupted while waiting): end them now,
            # they must not pile up behind a full batch.
            for s in [s for s in self._inbox if s.cancelled]:
                self._inbox.remove(s)
                s.finish()
            # Parked streams that may resume keep their slots: a sentence already playing
            # must not stall behind streams that have not started.
            taken = sum(not s.parked or s.may_resume for s in self._streams)
            admitted = [s for s in self._inbox if s.continuation]
            for s in admitted:
                self._inbox.remove(s)
            taken += len(admitted)
            while self._inbox and taken < self.max_batch:
                admitted.append(self._inbox.popleft())
                taken += 1
        for s in admitted:
            self._admit(s)
        self._housekeeping()
        if self._gpt.rows:
            t0 = time.perf_counter()
            self.stats.row_steps += len(self._gpt.rows)
            self._gpt.step()  # rows that ended are marked finished and left the batch
            self.stats.step_seconds += time.perf_counter() - t0
            self.stats.steps += 1
        due: list[tuple[Stream, bool]] = []
        for s in self._streams:
            if s.row is None or s.parked or s.decoder is None:
                continue
            s.stats.tokens = s.row.n_tokens
            if s.row.finished or s.decoder.due(s.row.n_tokens):
                due.append((s, s.row.finished))
        self._emit(due)
        for s, final in due:
            if final:
                self._retire(s)
        return True

    def _admit(self, s: Stream) -> None:
        if s.cancelled:
            s.finish()
            return
        try:
            voice = self._voices.resolve(s.voice)
            text = self.chat.normalizer(s.text, True, True, None).strip()
            if not text:  # nothing speakable (ChatTTS drops what it cannot read)
                s.finish()
                return
            s.row = self._gpt.make_row(
                text,
                prompt=voice.prompt,
                spk_emb=voice.spk_emb,
                sampling=voice.sampling,
                seed=voice.seed,
            )
            s.row.session_id = s.session_id
            s.decoder = StreamingDecoder(partial(_decode_one, self.chat), self.params)
            t0 = time.perf_counter()
            self._gpt.add(s.row)  # prefill; the row may already be finished (end token first)
            self.stats.prefill_seconds += time.perf_counter() - t0
            self.stats.prefills += 1
        except EngineError as e:
            s.finish(e)
            return
        except Exception as e:  # this text alone cannot start (e.g. too long): fail it alone
            log.exception(
                "ChatTTS could not start stream %d", s.id, extra={"session_id": s.session_id or "-"}
            )
            s.row = None
            s.finish(EngineError(f"synthesis failed: {e}"))
            return
        self._streams.append(s)

    def _housekeeping(self) -> None:
        for s in list(self._streams):
            if s.row is None:
                continue
            if s.cancelled:
                self._gpt.remove(s.row)
                self._retire(s)
                s.finish()
            elif s.parked and s.may_resume:
                # Even when streams admitted meanwhile filled the batch: this one is already
                # playing and its listener is running out. The batch then exceeds max_batch
                # until someone parks or ends (its KV cache was kept all along, so memory
                # does not grow; only the step widens).
                s.parked = False
                self._gpt.add(s.row)
            elif not s.parked and not s.row.finished and s.over_limit:
                s.parked = True
                s.stats.parked += 1
                self._gpt.park(s.row)

    def _emit(self, due: list[tuple[Stream, bool]]) -> None:
        """Decode the due streams' windows, equal lengths together, and hand the audio over."""
        groups: dict[int, list[tuple[Stream, bool, int]]] = {}
        for s, final in due:
            assert s.row is not None and s.decoder is not None
            start = s.decoder.window_start(s.row.n_tokens)
            if start is None:  # ended without tokens: only the held-back tail is left
                self._hand_over(s, s.decoder.accept(0, 0, np.zeros(0, np.float32), final), 0.0)
                continue
            groups.setdefault(s.row.n_tokens - start, []).append((s, final, start))
        for members in groups.values():
            windows = []
            for s, _final, start in members:
                assert s.row is not None
                windows.append(torch.stack(s.row.hiddens[start:]))
            t0 = time.perf_counter()
            wavs = chat_decode_batch(self.chat, windows)
            spent = time.perf_counter() - t0
            self.stats.decode_seconds += spent
            self.stats.decodes += 1
            for (s, final, start), wav in zip(members, wavs, strict=True):
                assert s.row is not None and s.decoder is not None
                chunk = s.decoder.accept(s.row.n_tokens, start, wav, final)
                self._hand_over(s, chunk, spent / len(members))

    def _hand_over(self, s: Stream, chunk: PCM, decode_seconds: float) -> None:
        assert s.row is not None and s.decoder is not None
        s.stats.decode_seconds += decode_seconds
        s.stats.decoded_tokens = s.decoder.decoded_tokens
        if s.stats.first_audio_tokens is None and len(chunk):
            s.stats.first_audio_tokens = s.row.n_tokens
        s.put(np.ascontiguousarray(chunk, dtype=np.float32))

    def _retire(self, s: Stream) -> None:
        if s in self._streams:
            self._streams.remove(s)
        if s.row is not None:
            if not s.cancelled:
                s.finish()
            s.row.hiddens.clear()
            s.row.tokens.clear()
            s.row.parked_kv = None


def _decode_one(chat: Any, window: torch.Tensor) -> np.ndarray:
    return chat_decode_batch(chat, [window])[0]
