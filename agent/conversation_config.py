"""Settings of the conversational side: listening (VAD, turns, barge-in) and the services
(speech-to-text, LLM) a turn goes through. Part of the one frozen ``Config``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_HEADER_VALUE = re.compile(r"[\x20-\x7e\t]*")  # what an API key in a header may hold
VAD_WINDOW_SAMPLES = 512  # silero-vad's window at 16 kHz: 32 ms
VAD_SAMPLE_RATE = 16_000
VAD_WINDOW_MS = VAD_WINDOW_SAMPLES * 1000 // VAD_SAMPLE_RATE


@dataclass(frozen=True)
class ListenSettings:
    """How the agent listens to the client's microphone."""

    # Run voice-activity detection on inbound audio at all (off: the microphone is ignored).
    enabled: bool = True
    # silero-vad speech probability at or above which a 32 ms window is speech ...
    vad_threshold: float = 0.5
    # ... and below which it is silence (between the two: keeps the current state).
    vad_neg_threshold: float = 0.35
    # Speech must last this long before it counts as the user talking (onset, barge-in):
    # shorter blips are ignored. Rounded up to whole 32 ms windows (at least one). One window
    # is already ~60 ms of speech: silero's probability only rises over its first 2-3
    # windows (measured on the espeak clip); each extra window adds 32 ms to every barge-in
    # (bench/bargein.py: p50 152 ms at 64, 127 ms at 32; no false onset on music at either).
    min_speech_ms: int = 32
    # The user's turn ends after this much silence; the utterance then goes to STT.
    end_of_turn_silence_ms: int = 600
    # Audio kept from before the detected onset (the VAD needs a window or two to react).
    preroll_ms: int = 320
    # A turn is cut (and transcribed) at this length.
    max_turn_s: float = 30.0
    # Speech onset while the agent speaks interrupts it; a session can turn this off.
    barge_in: bool = True
    # Threads running silero-vad for all sessions (its inference never runs on the loop).
    vad_threads: int = 1
    # How many later packets may arrive while a missing microphone packet is still awaited
    # (agent/receive_buffer.py). Nothing plays the microphone on the server: 0 releases
    # every packet as it arrives and counts a reordered one as lost; W > 0 tolerates W
    # packets of reordering at up to W frames (W x 20 ms) of added delay.
    receive_reorder_wait: int = 0
    # 32 ms windows waiting for the VAD per session; beyond it the oldest are dropped.
    max_pending_windows: int = 64

    def __post_init__(self) -> None:
        # Each names its flag (signaling/conversation_flags.py), as agent/config.py does: a
        # bad value in an env file must say which one (found by review).
        if not 0.0 < self.vad_threshold < 1.0:
            raise ValueError("the VAD threshold (--vad-threshold) must be above 0 and below 1")
        if not 0.0 < self.vad_neg_threshold <= self.vad_threshold:
            raise ValueError(
                "the VAD silence threshold (--vad-neg-threshold) must be above 0 and at most "
                f"the VAD threshold (--vad-threshold, {self.vad_threshold:g})"
            )
        if self.min_speech_ms < 0:
            raise ValueError("the minimum speech (--min-speech-ms) must be 0 ms or more")
        if self.end_of_turn_silence_ms < VAD_WINDOW_MS:
            raise ValueError(
                f"the end-of-turn silence (--end-of-turn-ms) must be {VAD_WINDOW_MS} ms or more"
            )
        if not 0 <= self.receive_reorder_wait <= 14:
            raise ValueError("receive_reorder_wait must be 0-14")
        if self.vad_threads < 1:
            raise ValueError("the VAD threads (--vad-threads) must be 1 or more")
        if self.max_pending_windows < 1:
            raise ValueError("max_pending_windows must be 1 or more")
        if not 0 < self.max_turn_s < math.inf:  # also refuses nan
            raise ValueError("the longest turn (--max-turn-s) must be a positive number of seconds")


@dataclass(frozen=True)
class ServiceSettings:
    """OpenAI-compatible speech-to-text and chat-completions services.

    Base URLs include the API version, like OpenAI SDKs' ``base_url``: with
    ``http://host:8000/v1`` requests go to ``http://host:8000/v1/audio/transcriptions`` and
    ``http://host:8000/v1/chat/completions``.
    """

    stt_base_url: str | None = None  # None: turns are detected but cannot be transcribed
    stt_model: str = "whisper-1"
    stt_language: str | None = None  # ISO-639-1 hint; None lets the service detect it
    stt_api_key: str | None = field(default=None, repr=False)
    stt_timeout_s: float = 15.0
    llm_base_url: str | None = None  # None: the echo brain speaks the user's words back
    llm_model: str = "gpt-4o-mini"
    llm_api_key: str | None = field(default=None, repr=False)
    system_prompt: str = (
        "You are a friendly voice assistant. Answer in short spoken sentences, without "
        "lists, markdown or emoji."
    )
    # No first token within this long, or no further token within it: the reply fails.
    llm_timeout_s: float = 20.0
    llm_max_tokens: int = 400
    # Messages of history kept (user and assistant), oldest dropped first.
    max_history_messages: int = 40

    def __post_init__(self) -> None:
        # Not "<= 0": a timeout of nan compares false with everything, and fails at once.
        if not 0 < self.stt_timeout_s < math.inf:
            raise ValueError("the STT timeout (--stt-timeout) must be a positive number of seconds")
        if not 0 < self.llm_timeout_s < math.inf:
            raise ValueError("the LLM timeout (--llm-timeout) must be a positive number of seconds")
        if self.llm_max_tokens < 1 or self.max_history_messages < 2:
            raise ValueError("llm_max_tokens must be >= 1 and max_history_messages >= 2")
        # A key no header can carry (a secret file's line end read into a Config built in
        # code; the environment's value is stripped) failed every request as "internal",
        # or as the service's "invalid JSON", with nothing naming the key (found by review).
        for flag, key in (("--stt-api-key", self.stt_api_key), ("--llm-api-key", self.llm_api_key)):
            if key is not None and not _HEADER_VALUE.fullmatch(key):
                raise ValueError(
                    f"the API key ({flag}) has characters an HTTP header cannot carry "
                    "(a line end, a control character, or non-ASCII)"
                )
