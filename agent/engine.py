"""The text-to-speech engine interface every engine (ChatTTS, test doubles, remote) implements.

An engine turns one piece of text into a stream of PCM chunks at its own sample rate. The
speech pipeline resamples, frames and paces them; the engine only has to be fast enough and
to stop promptly when asked.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

PCM = npt.NDArray[np.float32]
"""Mono float32 samples in [-1, 1]."""


@dataclass(frozen=True)
class VoiceOptions:
    """Per-session voice choice and sampling knobs; None means the engine's default."""

    voice: str | None = None
    speed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


class EngineError(Exception):
    """An engine failed to produce speech for a piece of text (reported, session goes on).

    ``incident``: one key, equal on every error that one fault caused (a crashed worker ends
    every stream of its batch at once, and refuses new ones until it is restarted; a Ray
    replica that dies fails every stream it served): the circuit breaker counts them as one
    failure (agent/breaker.py). A string, so that copies pickled apart (each stream's error
    crosses from a replica on its own) still compare equal. None: its own incident.
    """

    def __init__(self, *args: object, incident: str | None = None) -> None:
        super().__init__(*args)
        self.incident = incident  # in __dict__: pickled with the error (agent/raytts)


class RequestError(EngineError):
    """The request itself cannot be spoken (options out of range, an unknown voice): the
    client's mistake, not an engine fault. Reported to that client alone as ``code``; the
    circuit breaker does not count it (agent/breaker.py)."""

    code = "bad_config"  # a class attribute: the exception still pickles like any other


class UnknownVoice(RequestError):
    """Not a voice this engine can speak in (not seed:N, a corrupt speaker string...)."""

    code = "unknown_voice"


class UnreadableText(RequestError):
    """The engine's text reading failed on this text (a bug there, logged with its
    traceback): this text cannot be spoken, but the engine is sound, so the breaker must not
    count it: one client repeating it would take speech down for everyone."""

    code = "tts_failed"


class EngineLoadError(Exception):
    """An engine could not load its model; the message tells the user what to do."""


@runtime_checkable
class TTSEngine(Protocol):
    """Contract for speech engines.

    - ``synthesize`` returns an async generator of mono float32 chunks at ``sample_rate``.
      Chunks may have any length; the first one should come as early as the engine can.
    - Cancellation: the consumer either calls ``aclose()`` on the iterator or cancels the
      task iterating it. Either must stop the engine's work for that stream promptly and
      leave every other stream untouched.
    - Heavy work (inference) runs off the event loop.
    - A request it cannot speak (an unknown voice, options out of range) raises
      ``RequestError``, not a bare ``EngineError``: the circuit breaker counts only faults.
      An engine that can tell without speaking also has ``check_voice`` (see ``check_voice``
      below); it is optional.
    - Text it would make no sound of (dashes, emoji, a script it cannot read) is never sent:
      an engine may say which with a method ``speakable(text)`` (see ``speaks`` below).
    - ``continuation=True`` says ``text`` continues an utterance whose earlier audio is
      already playing (its next sentence): the listener hears silence until this stream's
      first chunk, so an engine that queues streams should start it ahead of streams that
      have not begun speaking. An engine without a queue ignores it.
    """

    name: str

    @property
    def sample_rate(self) -> int:
        """The rate of ``synthesize``'s chunks (an engine may learn it at ``start``)."""
        ...

    @property
    def ready(self) -> bool:
        """True once the model is loaded and warmed up (drives /readyz)."""
        ...

    @property
    def failure(self) -> str | None:
        """Why an engine that had started can no longer speak (None while it can)."""
        ...

    async def start(self) -> None:
        """Load and warm up; called once by the server before it reports ready."""
        ...

    async def close(self) -> None:
        """Release the model and any worker threads."""
        ...

    def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        """Stream speech for ``text`` (``continuation``: see the class docstring)."""
        ...


class EngineUnavailable(EngineError):
    """The engine is not tried at all: it failed repeatedly and the circuit breaker is open
    (agent/breaker.py). Reported to clients as ``tts_unavailable``."""


# A letter or digit of any script: what an engine without its own ``speakable`` is taken to
# read. Punctuation, symbols and emoji alone make no speech.
_LETTER_OR_DIGIT = re.compile(r"[^\W_]")


def speaks(engine: TTSEngine, text: str) -> bool:
    """Whether ``engine`` would make a sound of ``text``. A piece it would not is dropped
    before it is sent (no caption over silence), and a ``say`` of nothing else is refused
    ``empty_text``.

    An engine may offer this as a method ``speakable(text)``: cheap (it runs on the event
    loop for every piece of text), refusing nothing it would speak, and decided character by
    character (text is speakable if a part of it is: a reply's start is checked a delta at a
    time). One without it reads any text with a letter or digit in it."""
    check: Callable[[str], bool] | None = getattr(engine, "speakable", None)
    if check is not None:
        return check(text)
    return _LETTER_OR_DIGIT.search(text) is not None


def check_voice(engine: TTSEngine, voice: VoiceOptions) -> None:
    """Raise ``RequestError`` if ``engine`` can tell now that it cannot speak in ``voice``,
    so a client hears it when it sets its voice rather than at every utterance after.

    An engine may offer this as a method ``check_voice(voice)``: cheap, as it runs on the event
    loop, and refusing nothing it would speak. One without it accepts every voice here.
    """
    check: Callable[[VoiceOptions], None] | None = getattr(engine, "check_voice", None)
    if check is not None:
        check(voice)
