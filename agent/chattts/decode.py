"""Streaming decode of GPT hidden states: sliding windows, settled audio only, cross-fades.

ChatTTS's decoder (a ConvNeXt stack) and Vocos are non-causal convolutions: the audio of a token
depends on a few tokens on both sides. ChatTTS's own streaming re-decodes the whole utterance
for every chunk (quadratic work) and slices at the generation frontier, where the audio is still
going to change (clicks). Here each chunk decodes only a window

    [emitted - left_context, frontier)

and emits audio up to ``frontier - lookahead`` tokens, i.e. the part that (nearly) no longer
changes when more tokens arrive. The last ``crossfade`` samples of every chunk are held back
and blended with the next window's version of the same samples, so any residual difference is
faded instead of stepped. Work per chunk is ``chunk + left_context + lookahead`` tokens: linear
in the utterance length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from agent.engine import PCM

SAMPLES_PER_TOKEN = 512  # 2 mel frames of hop 256 at 24 kHz per audio token

DecodeFn = Callable[[torch.Tensor], np.ndarray]
"""(n, hidden) decoder input -> mono float32 audio for those n tokens (512 n - 256 samples)."""


@dataclass(frozen=True)
class StreamParams:
    first_chunk_tokens: int = 24
    chunk_tokens: int = 24
    # Tokens of already-emitted context decoded again at the left edge of every window.
    left_context: int = 4
    # Tokens at the frontier whose audio is decoded but not emitted yet (still changes).
    lookahead: int = 4
    # Samples blended between consecutive windows.
    crossfade: int = 512
    # Later chunks grow with the audio already emitted: chunk = clamp(growth * emitted tokens,
    # chunk_tokens, max_chunk_tokens). Fewer, larger decode calls (each call re-reads the
    # decoder's and Vocos' weights, which dominates small windows on CPU). The schedule depends
    # on token counts only, never on timing, so a seeded request always gives the same audio.
    # See ``auto_growth`` for which devices can afford it.
    growth: float = 1.0
    max_chunk_tokens: int = 192

    def __post_init__(self) -> None:
        if self.first_chunk_tokens <= self.lookahead + self.crossfade // SAMPLES_PER_TOKEN:
            raise ValueError("first_chunk_tokens must exceed lookahead plus the cross-fade")
        if not 1 <= self.chunk_tokens <= self.max_chunk_tokens:
            raise ValueError("need 1 <= chunk_tokens <= max_chunk_tokens")


def auto_growth(rtf: float) -> float:
    """Chunk growth for a device generating at ``rtf`` (seconds of compute per second of audio).

    Growing chunks (growth g) never starves a real-time listener while rtf <= 1 / (1 + g):
    - rtf < 0.45 (e.g. a 4090, RTF ~0.3): g = 1, the listener stays ahead anyway;
    - 0.45 <= rtf < 1 (near real time, e.g. a T4): g = 0, small chunks as early as possible;
    - rtf >= 1 (CPU): the listener hears gaps whatever we do, so spend the least compute: g = 1.
    """
    if rtf < 0.45 or rtf >= 1.0:
        return 1.0
    return 0.0


class StreamingDecoder:
    """Turns a growing list of per-token hidden states into settled audio chunks."""

    def __init__(self, decode: DecodeFn, params: StreamParams) -> None:
        self._decode = decode
        self.p = params
        self._emitted = 0  # absolute samples handed out
        self._tail: np.ndarray = np.zeros(0, dtype=np.float32)  # held back, starts at _emitted
        self._fade_in = _ramp(params.crossfade)
        self.decoded_tokens = 0  # decode work: tokens pushed through decoder + vocos
        self.decode_calls = 0
        self.chunks = 0

    @property
    def emitted_samples(self) -> int:
        return self._emitted

    def due(self, n_tokens: int) -> bool:
        """Whether ``n_tokens`` generated tokens warrant decoding a chunk now."""
        if self.chunks == 0:
            return n_tokens >= self.p.first_chunk_tokens
        covered = (self._emitted + len(self._tail)) // SAMPLES_PER_TOKEN
        grown = int(self.p.growth * self._emitted / SAMPLES_PER_TOKEN)
        size = min(self.p.max_chunk_tokens, max(self.p.chunk_tokens, grown))
        return n_tokens - self.p.lookahead >= covered + size

    def push(self, hiddens: Sequence[torch.Tensor], final: bool) -> PCM:
        """Decode a window over ``hiddens`` (all tokens so far) and return the settled audio.

        ``final`` means generation has ended: everything left is emitted.
        """
        start = self.window_start(len(hiddens))
        if start is None:
            return self.accept(len(hiddens), 0, np.zeros(0, np.float32), final)
        audio = self._decode(torch.stack(list(hiddens[start:])))
        return self.accept(len(hiddens), start, audio, final)

    def window_start(self, n_tokens: int) -> int | None:
        """First token of the next window over ``n_tokens`` tokens (None: nothing to decode).

        With ``accept`` this lets a caller decode several streams' windows in one batch."""
        if n_tokens == 0:
            return None
        return max(0, self._emitted // SAMPLES_PER_TOKEN - self.p.left_context)

    def accept(self, n_tokens: int, start: int, audio: np.ndarray, final: bool) -> PCM:
        """Take the decoded window ``[start, n_tokens)`` and return the audio now settled."""
        if n_tokens == 0:
            out, self._tail = self._tail, np.zeros(0, dtype=np.float32)
            self._emitted += len(out)
            return out
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        self.decoded_tokens += n_tokens - start
        self.decode_calls += 1
        base = start * SAMPLES_PER_TOKEN
        end = (
            base + len(audio)
            if final
            else min(base + len(audio), (n_tokens - self.p.lookahead) * SAMPLES_PER_TOKEN)
        )
        if end <= self._emitted:
            return np.zeros(0, dtype=np.float32)
        new = audio[self._emitted - base : end - base].copy()
        x = min(len(self._tail), len(new))
        if x:
            fade = self._fade_in[:x] if x == self.p.crossfade else _ramp(x)
            new[:x] = self._tail[:x] * (1.0 - fade) + new[:x] * fade
        self.chunks += 1
        if final:
            self._tail = np.zeros(0, dtype=np.float32)
            self._emitted += len(new)
            return new
        hold = min(self.p.crossfade, len(new))
        out, self._tail = new[: len(new) - hold], new[len(new) - hold :]
        self._emitted += len(out)
        return out


def _ramp(n: int) -> np.ndarray:
    return (0.5 - 0.5 * np.cos(np.linspace(0.0, np.pi, n))).astype(np.float32)


def chat_decode_batch(chat: Any, windows: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Decode equal-length windows of several streams in one call (one read of the weights).

    Only equal lengths: ``_decode_to_wavs`` right-pads shorter windows with zero hidden states,
    which would change their audio near the edge."""
    assert len({int(w.shape[0]) for w in windows}) == 1
    wavs = chat._decode_to_wavs([w.to(chat.device) for w in windows], True)
    return [np.asarray(w, dtype=np.float32) for w in wavs]


def chat_decode_fn(chat: Any) -> DecodeFn:
    """A ``DecodeFn`` over a loaded Chat: ChatTTS's own ``_decode_to_wavs`` (decoder + Vocos)."""

    def decode(window: torch.Tensor) -> np.ndarray:
        wavs = chat._decode_to_wavs([window.to(chat.device)], True)
        return np.asarray(wavs[0], dtype=np.float32)

    return decode
