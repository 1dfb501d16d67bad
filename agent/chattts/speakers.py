"""What can be checked of a voice without the model, torch or a device: ``seed:N``, the shape
of a ChatTTS speaker string, and the sampling options' ranges.

The replica-side ``VoiceBank`` (agent/chattts/voices.py) builds on these; a media process that
speaks through Ray (agent/raytts/engine.py), which imports neither torch nor ChatTTS, checks a
client's ``config`` voice with them, as the in-process engine does, instead of accepting it and
failing every utterance after (found by review).
"""

from __future__ import annotations

import lzma
import re

import numpy as np
import numpy.typing as npt
import pybase16384 as b14

from agent.engine import RequestError, UnknownVoice, VoiceOptions

DEFAULT_SPEED = 5
MIN_DICT_SIZE = 4096  # liblzma's smallest dictionary
# What base16384 writes: 14 bits per character in U+4E00-U+8DFF, then at most one tail
# marker U+3D00-U+3D06 (how many bytes the last characters carry). pybase16384's C decoder
# trusts whatever follows a "=" as that count: "\u3d7f" made it write 127 bytes into a
# 39-byte buffer, and one client's config message killed the server with SIGSEGV (found by
# review). Nothing else reaches the decoder.
_SPEAKER_STRING = re.compile("[\u4e00-\u8dff]+[\u3d00-\u3d06]?")


def parse_seed(voice: str) -> int | None:
    if not voice.startswith("seed:"):
        return None
    try:
        return int(voice[5:])
    except ValueError as e:
        raise UnknownVoice(f"bad voice {voice[:40]!r}: expected seed:<integer>") from e


def speaker_values(voice: str, dim: int) -> npt.NDArray[np.float16]:
    """The ``dim`` values of a ChatTTS speaker string (what ``Speaker._decode`` reads), or
    ``UnknownVoice``. Decompresses no more than ``dim`` values need: a crafted string of a few
    kB must not expand to megabytes, on the event loop or the worker."""
    if not _SPEAKER_STRING.fullmatch(voice):
        raise UnknownVoice(f"unknown voice {voice[:40]!r}: not seed:N nor a ChatTTS speaker")
    try:
        packed = b14.decode_from_string(voice)
        wanted = 2 * dim + 2
        # The window only has to reach back over what is decoded: a match in the first
        # ``wanted`` bytes refers to no byte before them. The encoder's own dictionary
        # (64 MiB at preset 9) was allocated for every speaker string (found by review).
        filters = [{"id": lzma.FILTER_LZMA2, "dict_size": max(MIN_DICT_SIZE, wanted)}]
        raw = lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=filters).decompress(
            packed, max_length=wanted
        )
        arr = np.frombuffer(raw, dtype=np.float16).copy()
    except Exception as e:  # lzma / base16384 errors: not a speaker string
        raise UnknownVoice(f"unknown voice {voice[:40]!r}: not seed:N nor a ChatTTS speaker") from e
    if arr.shape != (dim,):
        got = f"more than {dim}" if arr.size > dim else str(arr.size)
        raise UnknownVoice(f"speaker string has {got} values, model needs {dim}")
    return arr


def check_sampling(opts: VoiceOptions) -> int:
    """The speed of ``opts`` (its default if unset), or ``RequestError`` for options out of
    range."""
    speed = DEFAULT_SPEED if opts.speed is None else opts.speed
    if not 0 <= speed <= 9:
        raise RequestError(f"speed must be 0..9, got {speed}")
    temperature = 1.0 if opts.temperature is None else float(opts.temperature)
    top_p = 1.0 if opts.top_p is None else float(opts.top_p)
    top_k = 1 if opts.top_k is None else int(opts.top_k)
    if temperature <= 0 or not 0 < top_p <= 1 or top_k < 1:
        raise RequestError("temperature must be > 0, top_p in (0, 1], top_k >= 1")
    return speed


def check_voice_without_model(opts: VoiceOptions, default_voice: str, dim: int | None) -> None:
    """Raise ``RequestError`` where the model's ``VoiceBank.check`` surely would: the same
    checks but the speaker's float16 scaling (done only where the model is), approximated
    here by finite, non-zero values. ``dim`` unknown (None): the speaker string is not read."""
    check_sampling(opts)
    voice = opts.voice or default_voice
    if voice == "none" or parse_seed(voice) is not None or dim is None:
        return
    values = speaker_values(voice, dim)
    if not np.isfinite(values).all() or not values.any():
        raise UnknownVoice("the speaker string holds NaN, infinite or zero values")
