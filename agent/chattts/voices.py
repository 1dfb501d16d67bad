"""Voice choice: the default voice, seeded voices (``seed:1234``) and raw ChatTTS speaker strings.

A ChatTTS voice is a speaker embedding (a vector of the GPT's width) put in place of the
``[spk_emb]`` token. ``seed:N`` draws it the way ``Chat.sample_random_speaker`` does
(``mean + std * randn``) but from a private generator seeded with N, never torch's global RNG
(shared by every thread). The sampling seed of an utterance is derived from the voice too, so a
given (text, voice, options) always produces the same audio.
"""

from __future__ import annotations

import hashlib
import lzma
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from agent.chattts.gpt import Sampling
from agent.chattts.speakers import check_sampling, parse_seed, speaker_values
from agent.engine import UnknownVoice, VoiceOptions

# How ChatTTS compresses a speaker string (ChatTTS.model.speaker.Speaker._encode).
SPEAKER_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]


@dataclass(frozen=True)
class ResolvedVoice:
    spk_emb: torch.Tensor | None
    prompt: str  # ChatTTS code prompt, e.g. "[speed_5]"
    sampling: Sampling
    seed: int


def decode_speaker(voice: str, dim: int) -> npt.NDArray[np.float16]:
    """The embedding of a ChatTTS speaker string, or ``UnknownVoice`` (also for one that the
    model's scaling would make NaN)."""
    arr = speaker_values(voice, dim)
    # ChatTTS scales the embedding to unit length in float16 (Speaker.apply): NaN or infinite
    # values, or a vector too short for float16 (zeros), come out NaN, and every sampling step
    # of the utterance then fails: the string is corrupt, not the engine.
    if not torch.isfinite(F.normalize(torch.from_numpy(arr), p=2.0, dim=0, eps=1e-12)).all():
        raise UnknownVoice("the speaker string holds NaN, infinite or zero values")
    return arr


class VoiceBank:
    """Resolves ``VoiceOptions`` against one loaded Chat. Used by the worker thread only."""

    def __init__(self, chat: Any, default_voice: str, max_new_tokens: int) -> None:
        self._chat = chat
        self._default = default_voice
        self._max_new_tokens = max_new_tokens
        self._dim = int(chat.config.gpt.hidden_size)

    @property
    def speaker_dim(self) -> int:
        """How many values a speaker string of this model holds."""
        return self._dim

    def speaker_for_seed(self, seed: int) -> torch.Tensor:
        # Drawn afresh each time (one small randn): a cache keyed by client-chosen seeds
        # would grow without bound.
        spk = self._chat.speaker
        gen = torch.Generator().manual_seed(seed)
        noise = torch.randn(self._dim, generator=gen).to(spk.std.device, spk.std.dtype)
        return noise.mul_(spk.std).add_(spk.mean)

    def speaker_string(self, seed: int) -> str:
        """The ChatTTS speaker string of ``seed:N`` (portable to any ChatTTS install)."""
        return str(self._chat.speaker._encode(self.speaker_for_seed(seed)))

    def check(self, opts: VoiceOptions) -> None:
        """Raise ``RequestError`` where ``resolve`` would. Cheap and without the model or
        the device, so the event loop can call it while the worker speaks."""
        voice = opts.voice or self._default
        if voice != "none" and parse_seed(voice) is None:
            decode_speaker(voice, self._dim)
        self._options(opts)

    def resolve(self, opts: VoiceOptions) -> ResolvedVoice:
        voice = opts.voice or self._default
        seed = parse_seed(voice)
        spk_emb: torch.Tensor | None
        if voice == "none":
            # ChatTTS without a speaker ([empty_spk]): the voice varies with the sampling seed.
            spk_emb, seed = None, 0
        elif seed is not None:
            spk_emb = self.speaker_for_seed(seed)
        else:
            spk_emb = torch.from_numpy(decode_speaker(voice, self._dim))
            seed = int.from_bytes(hashlib.sha256(voice.encode()).digest()[:4], "little")
        prompt, sampling = self._options(opts)
        return ResolvedVoice(spk_emb=spk_emb, prompt=prompt, sampling=sampling, seed=seed)

    def _options(self, opts: VoiceOptions) -> tuple[str, Sampling]:
        """The code prompt and sampling of ``opts``, or ``RequestError``."""
        speed = check_sampling(opts)  # the ranges, as a media process checks them
        defaults = Sampling()
        sampling = Sampling(
            temperature=defaults.temperature
            if opts.temperature is None
            else float(opts.temperature),
            top_p=defaults.top_p if opts.top_p is None else float(opts.top_p),
            top_k=defaults.top_k if opts.top_k is None else int(opts.top_k),
            repetition_penalty=defaults.repetition_penalty,
            max_new_tokens=self._max_new_tokens,
        )
        return f"[speed_{speed}]", sampling
