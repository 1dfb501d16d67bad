"""``ChatTTSEngine``: the TTSEngine behind ``voice-agent serve``, ChatTTS streamed at low latency.

Load once (``start``), then every ``synthesize`` call becomes a stream of the shared
``Scheduler``: first audio after ``first_chunk_tokens`` generated tokens, seamless chunks,
continuous batching across sessions, per-stream cancellation and backpressure.

A generation stops at ``max_new_tokens`` (2048 tokens, 43.7 s) wherever its text is, so text
whose speech might not fit is spoken as several generations, one after the other: segments
are at most 200 raw characters, but spelled out, numbers are several times longer
("$1,234,567.89" is eighteen words). The caller still sees one stream for its text.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import re
import threading
import time
from collections.abc import AsyncGenerator, Callable

from agent.chattts.decode import StreamParams, auto_growth
from agent.chattts.loader import LoadedModel, load_chat
from agent.chattts.scheduler import SAMPLE_RATE, Scheduler
from agent.chattts.voices import VoiceBank
from agent.config import ChatTTSSettings
from agent.engine import PCM, EngineError, UnreadableText, VoiceOptions
from agent.text.normalize import normalize_for_tts, reads_aloud
from agent.threads import job_settling

log = logging.getLogger(__name__)

# A worker thread that crashed is restarted after RESTART_DELAY_S, unless it crashed more
# than MAX_RESTARTS times within RESTART_WINDOW_S (a broken device: the engine stays failed,
# /readyz says so, and the process is the thing to restart).
RESTART_DELAY_S = 2.0
MAX_RESTARTS = 3
RESTART_WINDOW_S = 300.0
# Estimated audio tokens (21.3 ms each) per character of normalized text, on the slow side of
# ChatTTS's speech: ~12 Latin characters (two words) or ~3.6 Chinese characters a second.
_TOKENS_PER_CHAR = 4
_TOKENS_PER_CJK_CHAR = 13
_CJK = re.compile(r"[\u4e00-\u9fff，。、]")
# Share of max_new_tokens a generation is planned to need: voices and speeds differ from the
# estimate by up to about 2x, and a cut-off generation loses the rest of its text.
_PLANNED_SHARE = 0.5
_STOPS = ".。"
_PAUSES = ",，、"


def speech_tokens(spoken: str) -> int:
    """Estimated audio tokens for normalized text (``normalize_for_tts``'s output)."""
    cjk = len(_CJK.findall(spoken))
    return _TOKENS_PER_CJK_CHAR * cjk + _TOKENS_PER_CHAR * (len(spoken) - cjk)


def split_spoken(spoken: str, max_tokens: int) -> list[str]:
    """Cut normalized text into pieces of at most ``max_tokens`` estimated audio tokens.

    Cuts after the last sentence stop that fits, else after the last pause, else at the last
    gap between words (or next to a Chinese character), else inside a word as a last resort.
    In normalized text every "." is a stop and every "," a pause: numbers are words by then.
    """
    pieces: list[str] = []
    spoken = spoken.strip()
    while speech_tokens(spoken) > max_tokens:
        fits = 0  # spoken[:fits] is the longest head within max_tokens (at least one char)
        spent = 0
        for ch in spoken:
            spent += _TOKENS_PER_CJK_CHAR if _CJK.match(ch) else _TOKENS_PER_CHAR
            if spent > max_tokens:
                break
            fits += 1
        fits = max(fits, 1)
        cut = 1 + max(spoken.rfind(c, 0, fits) for c in _STOPS)
        if not cut:
            cut = 1 + max(spoken.rfind(c, 0, fits) for c in _PAUSES)
        if not cut:
            cut = next((i for i in range(fits, 0, -1) if _word_gap(spoken[i - 1], spoken[i])), fits)
        pieces.append(spoken[:cut].strip())
        spoken = spoken[cut:].strip()
    if spoken:
        pieces.append(spoken)
    return pieces


def _word_gap(before: str, after: str) -> bool:
    return after == " " or _CJK.match(before) is not None or _CJK.match(after) is not None


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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._crashes: collections.deque[float] = collections.deque()  # worker crash times
        self._restart: asyncio.TimerHandle | None = None
        # Set while a crashed worker's restart is planned: speech asked for meanwhile waits
        # the RESTART_DELAY_S for it instead of failing (what the crash ended still fails).
        self._restarted: asyncio.Event | None = None

    @property
    def ready(self) -> bool:
        # Not while a restart is pending: the crashed worker's thread reports the crash
        # before it exits, and until it had, the engine read as ready (a CI flake).
        return (
            self._ready
            and self._restarted is None
            and self.scheduler is not None
            and self.scheduler.alive
        )

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
                self._loop = asyncio.get_running_loop()
                self.scheduler = self._new_scheduler(self.model)
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

    def _new_scheduler(self, model: LoadedModel) -> Scheduler:
        scheduler = Scheduler(
            model.chat,
            self.params,
            max_batch=self.settings.max_batch,
            max_buffered_s=self.settings.max_buffered_s,
            default_voice=self.settings.default_voice,
            max_new_tokens=self.settings.max_new_tokens,
            on_crash=self._crashed_in_worker,
        )
        scheduler.start()
        return scheduler

    def _crashed_in_worker(self) -> None:
        """The worker thread died (a bug, a device error, CUDA running out of memory for one
        batch): restart it on the loop, unless it keeps dying."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nothing to restart
                loop.call_soon_threadsafe(self._plan_restart)

    def _plan_restart(self) -> None:
        if self.scheduler is None or self._loop is None or not self._ready:
            return  # closed meanwhile, or died in the warm-up: start() failed with it
        now = time.monotonic()
        crashes = self._crashes
        crashes.append(now)
        while crashes and now - crashes[0] > RESTART_WINDOW_S:
            crashes.popleft()
        if len(crashes) > MAX_RESTARTS:
            self.scheduler.crash_incident = None  # see Scheduler.crash_incident
            log.error(
                "ChatTTS worker crashed %d times in %g s: not restarted (the engine stays "
                "failed; restart the process)",
                len(crashes),
                RESTART_WINDOW_S,
            )
            return
        log.warning("ChatTTS worker crashed: restarting it in %g s", RESTART_DELAY_S)
        self._restart = self._loop.call_later(RESTART_DELAY_S, self._restart_worker)
        self._restarted = asyncio.Event()

    def _restart_worker(self) -> None:
        self._restart = None
        try:
            if self.model is None or self.scheduler is None or self.scheduler.alive:
                return  # closed meanwhile
            stats = self.scheduler.stats  # counters read as totals (metrics, replica stats)
            self.scheduler = self._new_scheduler(self.model)  # self.params: warm-up's growth
            self.scheduler.stats = stats
            log.warning("ChatTTS worker restarted")
        finally:
            if self.scheduler is not None and not self.scheduler.alive:
                self.scheduler.crash_incident = None  # not restarted: see crash_incident
            self._release_waiters()

    def _release_waiters(self) -> None:
        if self._restarted is not None:
            self._restarted.set()
            self._restarted = None

    async def close(self) -> None:
        self._ready = False
        if self._restart is not None:
            self._restart.cancel()
            self._restart = None
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
            self.scheduler = None
        self.model = None
        self._voices = None
        self._release_waiters()  # they find the engine closed

    def speakable(self, text: str) -> bool:
        """Whether the reading (``normalize_for_tts``, which this engine runs on every
        segment) leaves any words of ``text``: ChatTTS says nothing of the rest."""
        return reads_aloud(text)

    @property
    def speaker_dim(self) -> int | None:
        """How many values a speaker string holds (None before ``start``)."""
        return self._voices.speaker_dim if self._voices is not None else None

    def check_voice(self, voice: VoiceOptions) -> None:
        """Raise ``RequestError`` (``UnknownVoice``) if ``voice`` cannot be spoken: cheap,
        for the event loop. Before ``start`` nothing is known, so nothing is refused."""
        if self._voices is not None:
            self._voices.check(voice)

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        if not self._ready:
            raise EngineError("ChatTTS engine is not started")
        # Closing this generator does not close one it iterates: aclosing does.
        async with contextlib.aclosing(self._stream(text, voice, continuation)) as inner:
            async for chunk in inner:
                yield chunk

    async def _stream(
        self, text: str, voice: VoiceOptions, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        if self.scheduler is None:
            raise EngineError("ChatTTS engine is not started")
        # Refused here rather than by the worker, which reports every error as a plain
        # EngineError: the circuit breaker must tell a client's bad voice from a fault.
        self.check_voice(voice)
        # Normalizing to measure is text work (~1 ms, ~10 ms for a 200-digit run): off the
        # loop, which paces every session's packets.
        try:
            pieces = await asyncio.to_thread(self._generations, text)
        except Exception as exc:
            log.exception("could not read a text of %d characters", len(text))
            raise UnreadableText(f"the text could not be read ({type(exc).__name__})") from exc
        for index, piece in enumerate(pieces):
            if self._restarted is not None:
                await self._restarted.wait()  # set by the restart or by close
            if self.scheduler is None:
                raise EngineError("ChatTTS engine is closed")
            # A later piece of this text, or the next sentence of an utterance the caller
            # says is playing, continues speech already heard: it starts at once, not
            # behind streams that have not begun (the listener would hear a gap).
            stream = self.scheduler.submit(piece, voice, continuation=continuation or index > 0)
            try:
                while (chunk := await stream.get()) is not None:
                    yield chunk
            finally:
                # Normal end, aclose() or task cancellation: only this stream's row is dropped.
                stream.cancel()

    def _generations(self, text: str) -> list[str]:
        """The texts to generate one after the other to speak all of ``text``: its
        normalized form, in pieces whose speech fits well within max_new_tokens.

        Normalized here, once: normalizing is not idempotent ("Prof!" reads "Prof.", which
        read again is "Professor"), so the scheduler takes the pieces as they are.
        """
        budget = int(self.settings.max_new_tokens * _PLANNED_SHARE)
        spoken = normalize_for_tts(text)
        if speech_tokens(spoken) <= budget:
            return [spoken]
        pieces = split_spoken(spoken, budget)
        log.debug("text of %d characters spoken as %d generations", len(text), len(pieces))
        return pieces


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
