"""The session a log line belongs to, carried in a context variable.

The server sets it while handling a request for a session and before creating the session's
peer connection; asyncio tasks copy the context they are created in, so the session's
speech worker and aiortc's tasks for its connection log with its id too, with no id passed
around. ``SessionIdFilter`` puts it on every record as ``session_id`` ("-" when none).
"""

from __future__ import annotations

import logging
from contextvars import Context, ContextVar

SESSION_ID: ContextVar[str | None] = ContextVar("session_id", default=None)


def session_context(session_id: str) -> Context:
    """A fresh context whose log lines name ``session_id`` (and nothing else of the
    caller's), for work about a session started from elsewhere (the watchdog, the drain)."""
    context = Context()
    context.run(SESSION_ID.set, session_id)
    return context


class SessionIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "session_id"):
            record.session_id = SESSION_ID.get() or "-"
        return True
