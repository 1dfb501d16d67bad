"""Per-session speech pipeline: queued utterances -> engine -> encoder-rate frames -> playout.

One worker task speaks utterances in order. Each utterance is a stream of text segments
(all known at once for ``say``, arriving over time for ``text.delta``); each segment is
synthesized, resampled, cut into 20 ms frames and put into the bounded playout buffer, whose
``put`` blocks when generation is too far ahead. Events are fired by marks on frames, i.e.
when the listener gets the audio, not when it was generated.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Container
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from agent.audio import Framer, Int16Frame, StreamResampler
from agent.config import SpeechSettings
from agent.engine import (
    EngineUnavailable,
    RequestError,
    TTSEngine,
    VoiceOptions,
    check_voice,
    speaks,
)
from agent.opus_rates import FRAMES_PER_SECOND, frame_samples, input_rate_for
from agent.playout import PlayoutBuffer
from agent.protocol import MAX_ID_CHARS
from agent.text.segment import Segmenter, split_text

log = logging.getLogger(__name__)

Event = dict[str, Any]
EventSink = Callable[[Event], None]

MAX_SEGMENT_CHARS = 200
# Who writes a text stream: a session's client unless the caller names another writer (a
# brain reply, a room participant). Only the stream's writer may continue or end it, so a
# stray ``text.end`` or id-less delta cannot cut or join someone else's utterance.
CLIENT = "client"
MAX_REFUSED_STREAMS = 16  # refused stream ids remembered per writer (agent/speech.py)
# Why a writer's stream is refused, in its stream_refused message.
REFUSED_STREAM = "its first error says why"
ENGINE_FAILED_STREAM = "the speech engine failed on it: its error comes with its end"
# What a writer whose stream end_stalled_stream ended is told (error ``stream_timeout``).
STREAM_TIMEOUT_MESSAGE = (
    "the text stream had no delta for too long: ended as if its text.end came (what it sent "
    "is spoken); its later deltas are refused until its text.end"
)


def discard_event(event: Event) -> None:
    """The sink of a closed pipeline or conversation: its session is gone."""


class SpeechError(Exception):
    """A request the pipeline refuses; ``code`` goes to the client as the error code."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id  # the utterance it is about, for a message with no id


@dataclass
class Utterance:
    id: str
    # Segments to speak, None marks the end. Bounded by the text-length cap, not by size.
    segments: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    chars: int = 0
    pieces: int = 0  # segments queued to speak: a stream of none had nothing to say
    silent: bool = False  # refused at its end (nothing to say): it ends with no event
    started: bool = False
    ended: bool = False
    first_chunk_at: float | None = None  # time.monotonic() the engine's first chunk arrived
    # time.monotonic() its first segment went to the engine: queueing and a client's slow
    # text stream are not the server's latency, so first-audio time is measured from here.
    synth_started_at: float | None = None
    # The voice when the utterance was accepted: a later `config` applies to later ones.
    voice: VoiceOptions = field(default_factory=VoiceOptions)
    # The engine's failure on it (tts_failed...), sent with its end: events go out when the
    # listener hears them, and before its start the client may not even know its id.
    failure: Event | None = None


@dataclass
class SpeechStats:
    utterances: int = 0
    interrupted: int = 0
    engine_errors: int = 0
    # Seconds from the engine's first chunk to its first frame being sent (most recent).
    first_audio_latencies: deque[float] = field(default_factory=lambda: deque(maxlen=256))


class SpeechPipeline:
    def __init__(
        self,
        engine: TTSEngine,
        settings: SpeechSettings,
        emit: EventSink,
        voice: VoiceOptions | None = None,
        on_first_audio: Callable[[float], None] | None = None,
        rate: int | None = None,
    ) -> None:
        self.engine = engine
        self._on_first_audio = on_first_audio
        self.settings = settings
        self.voice = voice or VoiceOptions()
        # The frames' rate, which is the encoder's input rate: None picks the engine's own
        # when libopus encodes from it (ChatTTS's 24 kHz: no resampling, a cheaper encode),
        # else the next rate up. An engine whose rate changes later is resampled to this.
        # The buffer carries it to the track, whose encoder checks that libopus takes it.
        self.buffer = PlayoutBuffer(
            max(1, int(settings.max_buffer_ahead_s * FRAMES_PER_SECOND)),
            input_rate_for(engine.sample_rate) if rate is None else rate,
        )
        self.stats = SpeechStats()
        self._emit = emit
        self._queue: deque[Utterance] = deque()
        # Utterances taken by the worker whose end has not been played yet (at most a few:
        # the one generating and those whose last frames are still buffered).
        self._active: list[Utterance] = []
        # When the last utterance ended, or playout resumed (monotonic): the next one's first
        # audio is measured from then at the earliest, as the time before it was spent queued
        # behind that one's buffered audio (up to max_buffer_ahead_s), or waiting for a
        # client's resume with playout paused, not in the engine.
        self._last_ended_at = -math.inf
        self._stream: Utterance | None = None  # the open text.delta utterance
        self._stream_owner = CLIENT  # ... and who writes it
        self._stream_fed_at = 0.0  # ... and when its last delta came (monotonic)
        self._segmenter: Segmenter | None = None
        self._stream_ended = asyncio.Event()  # set when an open stream ends (stream_free)
        # Each writer's interrupted stream (writer -> its id), whose further deltas are
        # dropped until its end: several writers can each have one (a client, a reply, room
        # participants). One entry per writer at most; its end or next stream removes it.
        self._discarding: dict[str, str] = {}
        # Each writer's refused streams (writer -> their ids, in order; "" while id-less
        # deltas continue one), whose further deltas are refused (stream_refused) until the
        # writer's text.end, rather than opening a stream from the middle of a sentence.
        # At most MAX_REFUSED_STREAMS ids per writer.
        self._refused: dict[str, dict[str, str]] = {}
        self._wakeup = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        # The context the worker first started in (a session's, or a room's empty one): a
        # worker restarted by interrupt() runs in it again, not in the interrupter's, whose
        # session id its log lines would otherwise carry for good.
        self._worker_context: contextvars.Context | None = None
        self._closed = False

    @property
    def rate(self) -> int:
        """The frames' rate (the encoder's input rate), kept by the buffer."""
        return self.buffer.sample_rate

    @property
    def frame_samples(self) -> int:
        return frame_samples(self.buffer.sample_rate)

    # --- requests ------------------------------------------------------------------------
    def start(self) -> None:
        if self._worker is None and not self._closed:
            if self._worker_context is None:
                self._worker_context = contextvars.copy_context()
            self._worker = asyncio.get_running_loop().create_task(
                self._run(), context=self._worker_context.copy()
            )

    def configure(self, fields: dict[str, Any]) -> None:
        """Apply a ``config`` message's voice fields. A voice the engine can already tell it
        cannot speak is refused now (``unknown_voice``), the current one kept, rather than
        failing every utterance after."""
        voice = dataclasses.replace(self.voice, **fields)
        try:
            check_voice(self.engine, voice)
        except RequestError as exc:
            raise SpeechError(exc.code, str(exc)) from None
        self.voice = voice

    def say(self, text: str, utterance_id: str | None = None) -> str:
        text = self._check_text(text)
        segments = self._spoken(split_text(text, MAX_SEGMENT_CHARS))
        if not segments:  # only dashes, quotes, emoji...: nothing the engine would speak
            raise SpeechError("empty_text", "'text' has nothing to speak")
        utt = self._enqueue(utterance_id)
        utt.chars = len(text)
        for segment in segments:
            utt.segments.put_nowait(segment)
        utt.pieces = len(segments)
        utt.segments.put_nowait(None)
        return utt.id

    def text_delta(
        self, delta: str, utterance_id: str | None = None, owner: str = CLIENT
    ) -> str | None:
        """Add streamed text from ``owner``; returns the utterance id (None if the stream
        was interrupted)."""
        if not isinstance(delta, str):
            raise SpeechError("bad_message", "'delta' must be a string")
        interrupted = self._discarding.get(owner)
        if interrupted is not None:
            if utterance_id is None or utterance_id == interrupted:
                return None  # the rest of an interrupted answer: not spoken, by design
            del self._discarding[owner]
        refused = self._refused.get(owner)
        if refused is not None:
            if self._continues_refused(refused, utterance_id, owner):
                why = refused.get(utterance_id or "", REFUSED_STREAM)
                raise SpeechError(
                    "stream_refused",
                    f"this text stream was refused ({why}): end it with text.end, then send "
                    "it again from its start",
                )
            if self._stream is None:
                # A new stream (a new id): id-less deltas continue it from now on, not the
                # refused ones, whose own ids stay refused.
                refused.pop("", None)
        if self._stream is not None and (
            self._stream_owner != owner or utterance_id not in (None, self._stream.id)
        ):
            raise SpeechError("stream_open", f"text stream {self._stream.id!r} is still open")
        # Checked before a stream is opened: a refused delta leaves nothing behind.
        so_far = self._stream.chars if self._stream is not None else 0
        if so_far + len(delta) > self.settings.max_text_chars:
            raise SpeechError(
                "text_too_long",
                f"a text stream is limited to {self.settings.max_text_chars} characters",
            )
        if self._stream is None:
            self._stream = self._enqueue(utterance_id)
            self._stream_owner = owner
            self._segmenter = Segmenter(max_chars=MAX_SEGMENT_CHARS)
        utt, segmenter = self._stream, self._segmenter
        assert segmenter is not None
        self._stream_fed_at = time.monotonic()
        utt.chars += len(delta)
        for segment in self._spoken(segmenter.push(delta)):
            utt.segments.put_nowait(segment)
            utt.pieces += 1
        return utt.id

    def refuse_rest(self, utterance_id: str | None, owner: str = CLIENT) -> None:
        """A delta of ``owner``'s was refused (rate_limited, queue_full, stream_open,
        text_too_long, a malformed one...): the rest of its stream is refused too
        (``stream_refused``) up to its ``text.end``. Otherwise its next delta opened the
        stream, and "Do not | press the red button!" was spoken from the middle of the
        sentence. What an open stream had taken before the refusal is spoken."""
        stream = self._stream
        if stream is not None and self._stream_owner == owner:
            if utterance_id not in (None, stream.id):
                # A second stream of its own while one is open: that one goes on (its
                # id-less deltas included), this one is refused up to a text.end.
                self._refuse(owner, utterance_id)
                return
            self._end_stream()
            self._refuse(owner, stream.id, "")
        else:
            # "": id-less deltas continue the refused stream (ids are never empty).
            self._refuse(owner, utterance_id or "", "")

    def _refuse(self, owner: str, *ids: str, why: str = REFUSED_STREAM) -> None:
        refused = self._refused.setdefault(owner, {})
        for utterance_id in ids:
            refused.pop(utterance_id, None)
            refused[utterance_id] = why  # the newest last
        while len(refused) > MAX_REFUSED_STREAMS:  # a writer refused again and again
            del refused[next(iter(refused))]

    def _continues_refused(
        self, refused: dict[str, str], utterance_id: str | None, owner: str
    ) -> bool:
        """Is a delta with this id the rest of one of ``owner``'s refused streams? One of
        their ids; or no id while id-less deltas continue one and the writer has no stream
        of its own open (an open one takes id-less deltas)."""
        if utterance_id is not None:
            return utterance_id in refused
        own_open = self._stream is not None and self._stream_owner == owner
        return "" in refused and not own_open

    def end_stalled_stream(self, now: float, writers: Container[str]) -> tuple[str, str] | None:
        """End the open stream of one of ``writers`` that had no delta for
        ``stream_idle_timeout_s``, as its text.end would (what it sent is spoken); its
        later deltas are refused (``stream_refused``) up to its own text.end. Returns its
        writer and its id, to be told (``stream_timeout``); None if nothing was ended."""
        stream, owner = self._stream, self._stream_owner
        timeout = self.settings.stream_idle_timeout_s
        if stream is None or owner not in writers or timeout <= 0:
            return None
        if now - self._stream_fed_at < timeout:
            return None
        self._end_stream()
        self._refuse(owner, stream.id, "")
        return owner, stream.id

    def opens_stream(self, utterance_id: str | None, owner: str = CLIENT) -> bool:
        """Would a text delta with this id from ``owner`` start a new utterance (rather than
        continue one, be dropped, or be refused)?"""
        if self._stream is not None:
            return False
        interrupted, refused = self._discarding.get(owner), self._refused.get(owner)
        if interrupted is not None and utterance_id in (None, interrupted):
            return False
        return refused is None or not self._continues_refused(refused, utterance_id, owner)

    async def stream_free(self, owner: str) -> None:
        """Return once ``owner`` may open a text stream: no other writer's is open. A brain's
        reply waits so for a client's or a room participant's stream to end, as a ``say``
        queues behind it, rather than failing with ``stream_open``."""
        while self._stream is not None and self._stream_owner != owner:
            self._stream_ended.clear()
            await self._stream_ended.wait()

    def text_end(self, owner: str = CLIENT) -> str | None:
        """End ``owner``'s text stream (or forget its interrupted or refused one)."""
        if self._stream is None or self._stream_owner != owner:
            interrupted = self._discarding.pop(owner, None)
            if self._refused.pop(owner, None) or interrupted is not None:
                return None
            raise SpeechError("no_stream", "text.end without a text.delta stream")
        utt = self._end_stream()
        if utt.silent:
            # Only dashes, emoji, a script the engine cannot read: refused to its writer
            # alone, as a say of it is, and no speech event of it goes anywhere (in a room,
            # one member's empty stream was an alert on every page).
            raise SpeechError("empty_text", "the text stream had nothing to speak", utt.id)
        return utt.id

    def _end_stream(self) -> Utterance:
        """End the open stream: what its segmenter holds is queued, then its end. One with
        nothing to speak (and no failure of its own) is made silent."""
        utt, segmenter = self._stream, self._segmenter
        assert utt is not None and segmenter is not None
        for segment in self._spoken(segmenter.flush()):
            utt.segments.put_nowait(segment)
            utt.pieces += 1
        utt.silent = utt.pieces == 0 and utt.failure is None
        utt.segments.put_nowait(None)
        self._stream = None
        self._segmenter = None
        self._stream_ended.set()
        return utt

    def forget_writer(self, owner: str) -> None:
        """``owner`` is gone for good (a room participant who left): what its open stream
        had is spoken, as its text.end would, and nothing of it is kept (its refused and
        interrupted streams' ids would stay for the room's life: ids are never reused)."""
        if self._stream is not None and self._stream_owner == owner:
            self._end_stream()
        self._refused.pop(owner, None)
        self._discarding.pop(owner, None)

    def interrupt(self) -> list[str]:
        """Stop speaking now: silence from the next frame, queue and generation dropped."""
        self.buffer.clear()  # first: the very next tick is silent
        dropped = [u for u in self._active if not u.ended] + list(self._queue)
        self._active.clear()
        self._queue.clear()
        if self._stream is not None:
            self._discarding[self._stream_owner] = self._stream.id
            self._stream = None
            self._segmenter = None
            self._stream_ended.set()
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None
        self.buffer.producing = False
        self.start()
        for utt in dropped:
            self.stats.interrupted += 1
            self._end(utt, interrupted=True)
        return [u.id for u in dropped]

    def discard(self) -> None:
        """Close a pipeline that was never started: nothing runs, so nothing to wait for."""
        if self._worker is not None:
            raise RuntimeError("a started pipeline is closed with close()")
        self._closed = True
        self.buffer.clear()
        self._emit = discard_event  # the reference cycle with its owner, as in close()

    async def close(self) -> None:
        self._closed = True
        self.buffer.clear()
        for utt in self._active:  # failures held for an end that will not come now
            if utt.failure is not None:
                failure, utt.failure = utt.failure, None
                self._emit(failure)
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            with suppress(asyncio.CancelledError):
                await worker
        # The sink is usually a bound method of the session that owns this pipeline: holding
        # it past close keeps session and pipeline in a reference cycle, which only a full
        # garbage collection frees, with the session's peer connection (signaling/release.py).
        self._emit = discard_event

    @property
    def queued(self) -> int:
        """Utterances waiting behind the one being spoken."""
        return len(self._queue)

    @property
    def busy(self) -> bool:
        """Speaking, or with anything to speak: an open text stream counts, however long
        its writer has been quiet (a barge-in cuts it, a shutdown lets it finish)."""
        return bool(self._active) or bool(self._queue)

    @property
    def sounding(self) -> bool:
        """Audio being made or played: what keeps a session in use. An open text stream
        whose writer went quiet is not (its writer's messages are, when they come), nor
        are utterances queued behind it: a stream never ended must not hold the session
        past its idle timeout."""
        return self.buffer.producing or len(self.buffer) > 0

    @property
    def audible(self) -> str | None:
        """The id of the utterance being heard now (its speech.started sent, its end not)."""
        return next((u.id for u in self._active if u.started and not u.ended), None)

    def speakable(self, text: str) -> bool:
        """Whether the engine would make a sound of ``text`` (agent/engine.py ``speaks``)."""
        return speaks(self.engine, text)

    def spoken_text(self, text: str) -> str:
        """``text`` as it would be spoken: its pieces the engine would say, joined."""
        return " ".join(self._spoken(split_text(text, MAX_SEGMENT_CHARS)))

    # --- helpers -------------------------------------------------------------------------
    def _spoken(self, pieces: list[str]) -> list[str]:
        """The pieces the engine would make a sound of. The rest (a line of dashes, an
        emoji, a script it cannot read) would be captioned over silence: dropped."""
        return [piece for piece in pieces if self.speakable(piece)]

    def _check_text(self, text: object) -> str:
        if not isinstance(text, str):
            raise SpeechError("bad_message", "'text' must be a string")
        if not text.strip():
            raise SpeechError("empty_text", "'text' is empty")
        if len(text) > self.settings.max_text_chars:
            raise SpeechError(
                "text_too_long", f"'text' is limited to {self.settings.max_text_chars} characters"
            )
        return text

    def _enqueue(self, utterance_id: str | None) -> Utterance:
        if utterance_id is not None and (
            not isinstance(utterance_id, str) or not 0 < len(utterance_id) <= MAX_ID_CHARS
        ):
            raise SpeechError(
                "bad_message", f"'id' must be a string of 1-{MAX_ID_CHARS} characters"
            )
        if self._closed:
            raise SpeechError("closed", "the session is closed")
        if len(self._queue) >= self.settings.max_queued_utterances:
            raise SpeechError(
                "queue_full",
                f"{self.settings.max_queued_utterances} utterances are already waiting",
            )
        utt = Utterance(id=utterance_id or uuid.uuid4().hex[:12], voice=self.voice)
        self._queue.append(utt)
        self._wakeup.set()
        return utt

    def playout_resumed(self) -> None:
        """A resumed session's new connection plays what waited meanwhile: that wait was the
        client's, not the engine's (first-audio latency is measured from now at most)."""
        self._last_ended_at = time.monotonic()

    def _end(self, utt: Utterance, *, interrupted: bool) -> None:
        if utt.ended:
            return
        utt.ended = True
        self._last_ended_at = time.monotonic()
        if utt in self._active:
            self._active.remove(utt)
        if utt.silent:
            return
        if utt.failure is not None:  # also when interrupted before its end was heard
            self._emit(utt.failure)
        self._emit({"type": "speech.ended", "id": utt.id, "interrupted": interrupted})

    # --- the worker ----------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            while not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            utt = self._queue.popleft()
            self._active.append(utt)
            self.stats.utterances += 1
            try:
                failed = await self._speak(utt)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("speech worker failed on utterance %s", utt.id)
                self._record_failure(utt, exc)
                failed = True
            finally:
                # Unless interrupt() replaced this worker: a cancellation an engine is slow to
                # finish ended here after the new worker began making audio, which then
                # counted as nothing made (not sounding: idle; no underruns).
                if self._worker in (None, asyncio.current_task()):
                    self.buffer.producing = False
            if self._worker is not asyncio.current_task():
                return  # replaced by interrupt() meanwhile: the new worker owns the buffer
            if failed and self._stream is utt:
                # Nothing reads its segments any more: its writer's further deltas are
                # refused (stream_refused; its tts_failed comes with its end), not taken
                # and never spoken, and the stream no longer holds other writers back.
                owner = self._stream_owner
                self._end_stream()
                self._refuse(owner, utt.id, "", why=ENGINE_FAILED_STREAM)
            self.buffer.at_playout_end(partial(self._end, utt, interrupted=failed))

    async def _speak(self, utt: Utterance) -> bool:
        """Generate ``utt`` into the buffer; True if the engine failed part-way."""
        resampler = StreamResampler(self.engine.sample_rate, self.rate)
        framer = Framer(self.frame_samples)
        engine_samples = 0
        # (index of the frame that carries it, mark): a caption fires with the frame holding
        # its segment's first sample, not with the first frame produced after the segment
        # began (that one is mostly the previous segment's tail, held by the framer).
        pending_marks: list[tuple[int, Callable[[], None]]] = [(0, partial(self._on_started, utt))]
        frames_out = 0
        self.buffer.producing = True

        async def put(frames: list[Int16Frame]) -> None:
            nonlocal frames_out
            for pcm in frames:
                due: tuple[Callable[[], None], ...] = ()
                if pending_marks:  # most frames carry no mark: skip two list rebuilds
                    due = tuple(mark for at, mark in pending_marks if at <= frames_out)
                    if due:
                        pending_marks[:] = [(a, m) for a, m in pending_marks if a > frames_out]
                frames_out += 1
                await self.buffer.put(pcm, due)

        # Where the framer last started afresh: a caption's frame is counted from there.
        frame_base = sample_base = 0
        while True:
            if utt.segments.empty():
                # Waiting on the stream's writer (a client still typing, an LLM thinking),
                # not on the engine: the silence meanwhile is no underrun, and nothing is
                # being made (sounding).
                self.buffer.producing = False
                if engine_samples > sample_base:
                    # The sentence made so far plays to its end now: its last partial frame
                    # and the resampler's tail (10-33 ms) waited for the writer's next text
                    # and played glued to it (found by review). Segments are separate engine
                    # calls, so starting the filter afresh joins nothing that was joined.
                    await put(framer.push(resampler.flush()) + framer.flush())
                    resampler = StreamResampler(self.engine.sample_rate, self.rate)
                    frame_base, sample_base = frames_out, engine_samples
            segment = await utt.segments.get()
            if segment is None:
                break
            self.buffer.producing = True
            if utt.synth_started_at is None:
                utt.synth_started_at = time.monotonic()
            # The segment's place on the utterance's audio timeline, counted in engine samples
            # (the resampler's filter delay would skew a count of output samples).
            # (Each flush for a writer's pause padded the timeline to a whole frame.)
            start_ms = round(
                frame_base * 1000 // FRAMES_PER_SECOND
                + (engine_samples - sample_base) * 1000 / self.engine.sample_rate
            )
            frame_index = frame_base + (
                (engine_samples - sample_base) * FRAMES_PER_SECOND // self.engine.sample_rate
            )
            caption = {
                "type": "speech.segment",
                "id": utt.id,
                "text": segment,
                "start_ms": start_ms,
            }
            caption_mark = (frame_index, partial(self._emit, caption))
            pending_marks.append(caption_mark)
            segment_start = engine_samples
            # Once this utterance has audio, a later segment continues speech the listener
            # is hearing: the engine must not queue it behind other sessions' new streams.
            # (Not merely "not the first segment": after segments that made no sound nothing
            # plays yet, and this one waits its turn like any new utterance.)
            continuation = engine_samples > 0
            try:
                speech = self.engine.synthesize(segment, utt.voice, continuation=continuation)
                async with aclosing(speech) as chunks:
                    async for chunk in chunks:
                        if utt.first_chunk_at is None:
                            utt.first_chunk_at = time.monotonic()
                        engine_samples += len(chunk)
                        await put(framer.push(resampler.process(chunk)))
                        # A fast engine (a cache, a GPU far ahead) never suspends, and
                        # put() only does when the buffer is full: without this one
                        # session could fill 3 s of buffer in one go while every other
                        # session's packets wait (measured: 200 ms gaps with 10 at once).
                        await asyncio.sleep(0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # an engine whose aclose() failed while we were being cancelled
                if isinstance(exc, RequestError):  # the client's voice or options
                    log.info("engine refused utterance %s: %s", utt.id, exc)
                else:
                    log.warning("engine failed on utterance %s: %s", utt.id, exc, exc_info=True)
                self._record_failure(utt, exc)
                if engine_samples == segment_start:
                    # Not a sample of this segment was made: its caption would announce
                    # text nobody hears (and a reply's history would record it as said).
                    pending_marks.remove(caption_mark)
                await put(framer.push(resampler.flush()) + framer.flush())
                self._fire_now(pending_marks)
                return True
        await put(framer.push(resampler.flush()) + framer.flush())
        self._fire_now(pending_marks)
        return False

    def _record_failure(self, utt: Utterance, exc: Exception) -> None:
        self.stats.engine_errors += 1
        if isinstance(exc, RequestError):  # e.g. unknown_voice: the client has to change it
            code, message = exc.code, str(exc)
        elif isinstance(exc, EngineUnavailable):
            # An open circuit breaker: the engine was not even tried (agent/breaker.py).
            code, message = "tts_unavailable", f"speech engine unavailable: {exc}"
        else:
            code, message = "tts_failed", f"speech engine failed: {exc}"
        utt.failure = {"type": "error", "code": code, "message": message, "id": utt.id}

    def _fire_now(self, marks: list[tuple[int, Callable[[], None]]]) -> None:
        """Marks that never got a frame (no audio produced) fire in playout order."""
        for _, mark in marks:
            self.buffer.at_playout_end(mark)
        marks.clear()

    def _on_started(self, utt: Utterance) -> None:
        if utt.started or utt.ended or utt.pieces == 0:
            return
        utt.started = True
        # An utterance with no audio (the engine failed, or the open breaker refused, before
        # its first chunk) still starts, so that its error names an id the client has seen
        # (tests/test_datachannel_contract.py), but it is no first audio: the histogram got a
        # ~1 ms sample for each, near-instant speech all through an outage (found by review).
        if utt.first_chunk_at is not None:
            now, queued_until = time.monotonic(), self._last_ended_at
            self.stats.first_audio_latencies.append(now - max(utt.first_chunk_at, queued_until))
            if utt.synth_started_at is not None and self._on_first_audio is not None:
                try:
                    self._on_first_audio(now - max(utt.synth_started_at, queued_until))
                except Exception:  # a measurement must never stop speech
                    log.exception("first-audio observer failed")
        self._emit({"type": "speech.started", "id": utt.id})
