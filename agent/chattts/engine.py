"""``ChatTTSEngine``: the TTSEngine behind ``voice-agent serve``, ChatTTS streamed at low latency.

Load once (``start``), then every ``synthesize`` call becomes a stream of the shared
``Scheduler``: first audio after ``first_chunk_tokens`` generated tokens, seamless chunks,
continuous batching across sessions, per-stream cancellation and backpressure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncGenerator, Callable

from agent.chattts.decode import StreamParams, auto_growth
from agent.chattts.loader import LoadedModel, load_chat
from agent.chattts.scheduler import SAMPLE_RATE, Scheduler
from agent.chattts.voices import VoiceBank
from agent.config import ChatTTSSettings
from agent.engine import PCM, EngineError, VoiceOptions
from agent.text.normalize import normalize_for_tts
from agent.threads import job_settling

log = logging.getLogger(__name__)


class ChatTTSEngine:
    name = "chattts"
    sample_rate = SAMPLE_RATE

    def __init__(self, settings: ChatTTSSettings) -> None:
        self.settings = settings
        self.params = StreamParams(
            first_chunk_tokens=settings.first_chunk_tokens,
            chunk_tokens=settings.chunk_tokens,
            left_context=settings.decode_left_context,
            lookahead=settings.decode_lookahead,
            crossfade=settings.crossfade_samples,
            growth=settings.chunk_growth or 0.0,
            max_chunk_tokens=settings.max_chunk_tokens,
        )
        self.model: LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        # check_voice's, on the event loop (the worker has its own).
        self._voices: VoiceBank | None = None
        self._ready = False
        self._start_lock = asyncio.Lock()

    @property
    def ready(self) -> bool:
        return self._ready and self.scheduler is not None and self.scheduler.alive

    @property
    def failure(self) -> str | None:
        return self.scheduler.crash if self.scheduler is not None else None

    async def start(self) -> None:
        """Load (in a thread), start the worker, run one warm-up utterance; idempotent."""
        async with self._start_lock:
            if self._ready:
                return
            if self.model is None:
                self.model = await _in_daemon_thread(load_chat, self.settings)
                self._voices = VoiceBank(
                    self.model.chat, self.settings.default_voice, self.settings.max_new_tokens
                )
            if self.scheduler is None:
                self.scheduler = Scheduler(
                    self.model.chat,
                    self.params,
                    max_batch=self.settings.max_batch,
                    max_buffered_s=self.settings.max_buffered_s,
                    default_voice=self.settings.default_voice,
                    max_new_tokens=self.settings.max_new_tokens,
                    prepare_text=normalize_for_tts,
                )
                self.scheduler.start()
            samples = 0
            async for chunk in self._stream(self.settings.warmup_text, VoiceOptions()):
                samples += len(chunk)
            rtf = self.scheduler.measured_rtf()
            growth = self.settings.chunk_growth
            if growth is None and rtf is not None:
                growth = auto_growth(rtf)
                self.params = dataclasses.replace(self.params, growth=growth)
                self.scheduler.params = self.params  # read by the worker for new streams only
            log.info(
                "ChatTTS warm-up: %.2f s of audio, generation RTF %s, chunk growth %s",
                samples / self.sample_rate,
                "n/a" if rtf is None else f"{rtf:.2f}",
                self.params.growth,
            )
            self._ready = True

    async def close(self) -> None:
        self._ready = False
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
            self.scheduler = None
        self.model = None
        self._voices = None

    def check_voice(self, voice: VoiceOptions) -> None:
        """Raise ``RequestError`` (``UnknownVoice``) if ``voice`` cannot be spoken: cheap,
        for the event loop. Before ``start`` nothing is known, so nothing is refused."""
        if self._voices is not None:
            self._voices.check(voice)

    async def synthesize(self, text: str, voice: VoiceOptions) -> AsyncGenerator[PCM, None]:
        if not self._ready:
            raise EngineError("ChatTTS engine is not started")
        # Closing this generator does not close one it iterates: aclosing does.
        async with contextlib.aclosing(self._stream(text, voice)) as inner:
            async for chunk in inner:
                yield chunk

    async def _stream(self, text: str, voice: VoiceOptions) -> AsyncGenerator[PCM, None]:
        if self.scheduler is None:
            raise EngineError("ChatTTS engine is not started")
        # Refused here rather than by the worker, which reports every error as a plain
        # EngineError: the circuit breaker must tell a client's bad voice from a fault.
        self.check_voice(voice)
        stream = self.scheduler.submit(text, voice)
        try:
            while (chunk := await stream.get()) is not None:
                yield chunk
        finally:
            # Normal end, aclose() or task cancellation: only this stream's row is dropped.
            stream.cancel()


async def _in_daemon_thread(
    fn: Callable[[ChatTTSSettings], LoadedModel], arg: ChatTTSSettings
) -> LoadedModel:
    """Run a blocking load in a daemon thread.

    Not ``asyncio.to_thread``: the default executor is joined at shutdown, so Ctrl-C during
    the first 1 GB download would wait for the download to finish.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[LoadedModel] = loop.create_future()
    job = job_settling(loop, future, lambda: fn(arg))
    threading.Thread(target=job, name="chattts-load", daemon=True).start()
    return await future
