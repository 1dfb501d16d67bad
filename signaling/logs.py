"""Log setup: every line names its session; ``--log-json`` makes one JSON object per line.

Tokens must never reach a log. Browsers send them in the query string (and then in the
Referer of later requests), which aiohttp's default access log prints; the access logger
here writes the path without the query and no headers.

Nor may a client write log lines of its own: a request path (``%0A`` decodes to a newline),
a room name or any other value a message quotes could otherwise end the line and forge the
next. Both formats escape control characters (JSON lines as ``\\uXXXX``).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web import BaseRequest, StreamResponse

from agent.config import CONTROL_CHARS, Config
from agent.logcontext import SessionIdFilter

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(session_id)s]: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, session_id, message (+ exc_info)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "session_id": getattr(record, "session_id", None),
            "message": record.getMessage(),
        }
        if entry["session_id"] == "-":
            entry["session_id"] = None
        for key in ("remote", "method", "path", "status", "duration_s"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        line = json.dumps(entry, ensure_ascii=False, default=str)
        # json.dumps escapes only C0 controls: DEL, C1 (NEL among them) and U+2028/9 stay raw
        # with ensure_ascii=False, and a reader splitting with str.splitlines would see a
        # client's value break the line. \uXXXX is the same string to every JSON reader.
        return CONTROL_CHARS.sub(lambda match: f"\\u{ord(match.group()):04x}", line)


def escape_controls(text: str) -> str:
    """``\\n`` for a newline, ``\\x1b`` for ESC...: each control character as Python would
    write it in a string literal, visible and on the same line."""
    return CONTROL_CHARS.sub(lambda match: ascii(match.group())[1:-1], text)


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT, one line per record whatever its values hold; a traceback follows on
    lines of its own, each indented, so that none of them can pass for a record either
    (an exception's message may quote what a client sent)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        # logging.Formatter.format, but escaped; and without caching the traceback on the
        # record (record.exc_text), which every other handler would then print indented.
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        parts = [escape_controls(self.formatMessage(record))]
        if record.exc_info:
            parts.append(_indented(self.formatException(record.exc_info)))
        elif record.exc_text:
            parts.append(_indented(record.exc_text))
        if record.stack_info:
            parts.append(_indented(self.formatStack(record.stack_info)))
        return "\n".join(parts)


def _indented(text: str) -> str:
    return "\n".join("    " + escape_controls(line) for line in text.split("\n"))


class MalformedRequestFilter(logging.Filter):
    """aiohttp logs a request it cannot parse (a request line over 8190 bytes, a bad method
    or header) as an ERROR with a traceback whose message quotes the request line: a
    client could fill the log with errors at will, and put a ``?token=`` in it. Such a
    record is made one INFO line naming the client and the kind of error, no quote."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.name != "aiohttp.server" or not isinstance(exc, HttpProcessingError):
            return True
        if not 400 <= exc.code < 500:
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg = "refused a request it could not parse from %s: %s (%d)"
        client = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.args = (client, type(exc).__name__, exc.code)
        record.exc_info = record.exc_text = None
        return logging.getLogger().isEnabledFor(logging.INFO)


class VanishedPeerFilter(logging.Filter):
    """aiortc's background tasks that send to a peer (SCTP retransmission, the DTLS
    transport's writes) raise ConnectionError once its ICE connection is gone, and nothing
    retrieves it: asyncio logged an ERROR with a traceback each time a client vanished
    mid-call (seen in bench/vanish.py). That is a peer gone, which the session's liveness
    check handles: one DEBUG line."""

    _SENDERS = ("coro=<RTCSctpTransport.", "coro=<RTCDtlsTransport.")

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.name != "asyncio" or not isinstance(exc, ConnectionError):
            return True
        message = record.getMessage()
        if not any(sender in message for sender in self._SENDERS):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.msg, record.args = "a send to a vanished peer failed: %s", (exc,)
        record.exc_info = record.exc_text = None
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def log_handler(json_lines: bool) -> logging.Handler:
    handler = logging.StreamHandler()
    handler.addFilter(MalformedRequestFilter())
    handler.addFilter(VanishedPeerFilter())
    handler.addFilter(SessionIdFilter())
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    return handler


def configure_logging(config: Config) -> None:
    """The root logger: the configured level, one handler (text or JSON lines)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(log_handler(config.log_json))
    root.setLevel(config.log_level)
    if config.log_json:
        quiet_progress_bars()


def quiet_progress_bars() -> None:
    """No progress bars on stderr: with ``--log-json`` every line there must be a JSON
    object, and transformers draws "Loading weights ..." at every model load (local ones
    included), huggingface_hub a bar per file it downloads (the log says a download
    starts). Both libraries follow huggingface_hub's switch; transformers reads it when
    imported, so one imported already is told too."""
    import sys

    from huggingface_hub.utils.tqdm import disable_progress_bars

    disable_progress_bars()
    transformers_logging = sys.modules.get("transformers.utils.logging")
    if transformers_logging is not None:
        transformers_logging.disable_progress_bar()


class AccessLogger(AbstractAccessLogger):
    """Method, path without query string, status and duration: no token can leak here."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        self.logger.info(
            '%s "%s %s" %d %.3fs',
            request.remote,
            request.method,
            request.path,
            response.status,
            time,
            extra={
                "remote": request.remote,
                "method": request.method,
                "path": request.path,
                "status": response.status,
                "duration_s": round(time, 6),
            },
        )
