"""``voice-agent serve`` flags of the conversation: listening, barge-in, STT and LLM.

Each flag can also come from the environment as ``VOICE_AGENT_<FLAG>`` (dashes become
underscores; read by the ``serve`` parser, signaling/envflags.py). API keys are best given in
the environment: flags show in the process list.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from agent.conversation_config import ListenSettings, ServiceSettings
from signaling.envflags import number

_LISTEN = ListenSettings()
_SERVICES = ServiceSettings()

# flag, type, default, help, (settings class, field)
_FLAGS: list[tuple[str, Callable[[str], Any], Any, str, str]] = [
    ("vad-threshold", number, _LISTEN.vad_threshold, "speech probability for speech", "listen"),
    ("vad-neg-threshold", number, _LISTEN.vad_neg_threshold, "below it: silence", "listen"),
    ("min-speech-ms", int, _LISTEN.min_speech_ms, "speech this long is the user talking", "listen"),
    ("end-of-turn-ms", int, _LISTEN.end_of_turn_silence_ms, "silence ending a turn", "listen"),
    ("max-turn-s", number, _LISTEN.max_turn_s, "a turn is cut at this length", "listen"),
    ("vad-threads", int, _LISTEN.vad_threads, "threads running silero-vad", "listen"),
    ("stt-url", str, None, "OpenAI-compatible STT base URL, e.g. http://host:8000/v1", "services"),
    ("stt-model", str, _SERVICES.stt_model, "transcription model name", "services"),
    ("stt-language", str, None, "language hint (ISO-639-1), default: detect", "services"),
    ("stt-api-key", str, None, "STT bearer key (prefer the environment)", "services"),
    ("stt-timeout", number, _SERVICES.stt_timeout_s, "seconds for a transcription", "services"),
    ("llm-url", str, None, "OpenAI-compatible LLM base URL; none: echo brain", "services"),
    ("llm-model", str, _SERVICES.llm_model, "chat model name", "services"),
    ("llm-api-key", str, None, "LLM bearer key (prefer the environment)", "services"),
    ("llm-timeout", number, _SERVICES.llm_timeout_s, "max seconds between tokens", "services"),
    ("system-prompt", str, _SERVICES.system_prompt, "the LLM's system prompt", "services"),
]

_FIELDS = {
    "vad_threshold": "vad_threshold",
    "vad_neg_threshold": "vad_neg_threshold",
    "min_speech_ms": "min_speech_ms",
    "end_of_turn_ms": "end_of_turn_silence_ms",
    "max_turn_s": "max_turn_s",
    "vad_threads": "vad_threads",
    "stt_url": "stt_base_url",
    "stt_model": "stt_model",
    "stt_language": "stt_language",
    "stt_api_key": "stt_api_key",
    "stt_timeout": "stt_timeout_s",
    "llm_url": "llm_base_url",
    "llm_model": "llm_model",
    "llm_api_key": "llm_api_key",
    "llm_timeout": "llm_timeout_s",
    "system_prompt": "system_prompt",
}


def add_conversation_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("conversation (microphone, barge-in, STT, LLM)")
    for flag, kind, default, text, _ in _FLAGS:
        shown = "" if "key" in flag or default is None else f" (default {default!r})"
        group.add_argument("--" + flag, type=kind, default=default, help=text + shown)
    group.add_argument(
        "--no-listen",
        action="store_true",
        help="ignore client microphones (no VAD, turns or barge-in)",
    )
    group.add_argument(
        "--no-barge-in",
        action="store_true",
        help="the user's speech does not interrupt the agent (sessions may turn it on)",
    )


def conversation_settings(args: argparse.Namespace) -> tuple[ListenSettings, ServiceSettings]:
    listen: dict[str, Any] = {"enabled": not args.no_listen, "barge_in": not args.no_barge_in}
    services: dict[str, Any] = {}
    for flag, _kind, _default, _text, target in _FLAGS:
        attr = flag.replace("-", "_")
        value = getattr(args, attr)
        (listen if target == "listen" else services)[_FIELDS[attr]] = value
    return ListenSettings(**listen), ServiceSettings(**services)
