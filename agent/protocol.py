"""The data-channel wire contract: parse and validate client messages (DESIGN.md, version 1)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class ProtocolError(Exception):
    """A message refused as malformed. ``request_id``: the id it carried, when that much of
    it was valid, so the client can tell which of its requests the error answers;
    ``message_type``: its type, when known (a malformed ``text.delta`` refuses its stream)."""

    def __init__(
        self,
        code: str,
        message: str,
        request_id: str | None = None,
        message_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.message_type = message_type


@dataclass(frozen=True)
class Say:
    text: str
    id: str | None


@dataclass(frozen=True)
class TextDelta:
    delta: str
    id: str | None


@dataclass(frozen=True)
class TextEnd:
    pass


@dataclass(frozen=True)
class Interrupt:
    pass


@dataclass(frozen=True)
class Chat:
    text: str
    id: str | None = None  # the client's: an error refusing this chat carries it


@dataclass(frozen=True)
class ConfigUpdate:
    """Only the fields the client sent (others keep their value)."""

    fields: dict[str, Any]


Message = Say | TextDelta | TextEnd | Interrupt | Chat | ConfigUpdate

_CONFIG_FIELDS: dict[str, tuple[type, float, float]] = {
    # name: (type, min, max)
    "speed": (int, 0, 9),
    "temperature": (float, 0.01, 2.0),
    "top_p": (float, 0.01, 1.0),
    "top_k": (int, 1, 100),
}
MAX_VOICE_CHARS = 4096  # ChatTTS speaker strings are ~1.4 kB
MAX_ID_CHARS = 64  # utterance ids chosen by clients
# An oversize message is still read for its type and id, up to this many times the limit:
# a refused text.delta must refuse the rest of its stream, or the stream goes on with a
# hole in its middle. Past it, reading would be the cost the limit is there to avoid.
OVERSIZE_READ_FACTOR = 16


def parse_message(raw: str | bytes, max_bytes: int) -> Message:
    size = len(raw.encode("utf-8") if isinstance(raw, str) else raw)
    if size > max_bytes:
        kind, request_id = (
            _type_and_id(raw) if size <= max_bytes * OVERSIZE_READ_FACTOR else (None, None)
        )
        raise ProtocolError(
            "too_large", f"message of {size} bytes exceeds {max_bytes}", request_id, kind
        )
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ProtocolError("bad_json", "message is not valid JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_message", "message must be a JSON object")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("bad_message", "message needs a string 'type'")
    match kind:
        case "say":
            request_id = _optional_id(obj)
            return Say(_string(obj, "text", request_id), request_id)
        case "text.delta":
            try:
                request_id = _optional_id(obj)
            except ProtocolError as exc:
                exc.message_type = kind
                raise
            return TextDelta(_string(obj, "delta", request_id, kind), request_id)
        case "text.end":
            return TextEnd()
        case "interrupt":
            return Interrupt()
        case "chat":
            request_id = _optional_id(obj)
            return Chat(_string(obj, "text", request_id), request_id)
        case "config":
            return ConfigUpdate(_config_fields(obj))
    raise ProtocolError("unknown_type", f"unknown message type {kind[:40]!r}")


def _type_and_id(raw: str | bytes) -> tuple[str | None, str | None]:
    """The type and valid id of a message refused as too large, where it has them."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, None
    if not isinstance(obj, dict):
        return None, None
    kind = obj.get("type") if isinstance(obj.get("type"), str) else None
    try:
        return kind, _optional_id(obj)
    except ProtocolError:
        return kind, None


def _string(
    obj: dict[str, Any], key: str, request_id: str | None, message_type: str | None = None
) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise ProtocolError("bad_message", f"'{key}' must be a string", request_id, message_type)
    return value


def answered_id(message: Message | None, exc: Exception) -> str | None:
    """The id an error refusing a message carries: the message's own, or, for one refused
    as malformed, the valid id it came with."""
    return getattr(message, "id", None) or getattr(exc, "request_id", None)


def _optional_id(obj: dict[str, Any]) -> str | None:
    value = obj.get("id")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise ProtocolError("bad_message", f"'id' must be a string of 1-{MAX_ID_CHARS} characters")
    return value


def _config_fields(obj: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if "voice" in obj:
        voice = obj["voice"]
        if voice is not None and (not isinstance(voice, str) or len(voice) > MAX_VOICE_CHARS):
            raise ProtocolError("bad_config", "'voice' must be a string (or null for the default)")
        if isinstance(voice, str) and voice.startswith("seed:"):
            digits = voice[5:]
            # ASCII digits only: str.isdigit() also accepts "²" and "①", which int() refuses.
            if not re.fullmatch(r"[0-9]+", digits) or int(digits) >= 2**63:
                raise ProtocolError("bad_config", "'voice' seed:N needs an integer 0 <= N < 2^63")
        fields["voice"] = voice
    if "barge_in" in obj:
        if not isinstance(obj["barge_in"], bool):
            raise ProtocolError("bad_config", "'barge_in' must be true or false")
        fields["barge_in"] = obj["barge_in"]
    for name, (kind, low, high) in _CONFIG_FIELDS.items():
        if name not in obj:
            continue
        value = obj[name]
        if value is None:
            fields[name] = None
            continue
        ok_type = isinstance(value, int | float) and not isinstance(value, bool)
        # Range first: an integer too large for a float (JSON allows 400 digits) is out
        # of range, not an OverflowError from float() or isfinite().
        if not ok_type or not low <= value <= high or not math.isfinite(value):
            raise ProtocolError("bad_config", f"'{name}' must be a number in [{low}, {high}]")
        if kind is int and not float(value).is_integer():
            raise ProtocolError("bad_config", f"'{name}' must be an integer in [{low}, {high}]")
        fields[name] = kind(value)
    unknown = set(obj) - {"type", "voice", "barge_in", *_CONFIG_FIELDS}
    if unknown:
        raise ProtocolError("bad_config", f"unknown config fields: {sorted(unknown)[:5]}")
    return fields


def listen_on_channel(
    channel: Any, on_open: Callable[[], None], on_message: Callable[[str | bytes], None]
) -> None:
    """Wire a data channel to its session: ``on_open`` when it opens (at once if it is
    open already: events raised meanwhile are waiting), ``on_message`` for each message."""
    channel.on("open", on_open)
    channel.on("message", on_message)
    if channel.readyState == "open":
        on_open()
