"""The text-to-speech engine interface every engine (ChatTTS, test doubles, remote) implements.

An engine turns one piece of text into a stream of PCM chunks at its own sample rate. The
speech pipeline resamples, frames and paces them; the engine only has to be fast enough and
to stop promptly when asked.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
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
    """An engine failed to produce speech for a piece of text (reported, session goes on)."""


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

    def synthesize(self, text: str, voice: VoiceOptions) -> AsyncGenerator[PCM, None]:
        """Stream speech for ``text``."""
        ...


class EngineUnavailable(EngineError):
    """The engine is not tried at all: it failed repeatedly and the circuit breaker is open
    (agent/breaker.py). Reported to clients as ``tts_unavailable``."""
