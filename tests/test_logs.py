"""Log lines name their session; --log-json writes one JSON object per line."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from agent.config import Config
from signaling.logs import configure_logging, log_handler
from tests.conftest import LiveServer
from tests.rtc_client import RtcClient


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The server's JSON log handler on the root logger, writing into a string."""
    stream = io.StringIO()
    handler = log_handler(json_lines=True)
    handler.setStream(stream)  # type: ignore[attr-defined]
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


async def test_json_lines_carry_the_session_id(
    live_server: LiveServer, json_log: io.StringIO
) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        sid = client.session_id
        client.send({"type": "say", "text": "hello there", "id": "x"})
        await client.wait_event(lambda e: e["type"] == "speech.ended")
        async with http.delete(f"{live_server.url}/sessions/{sid}?token=abc") as resp:
            assert resp.status == 204
        await client.close()
    records = lines(json_log)
    assert records and all(
        {"time", "level", "logger", "session_id", "message"} <= set(r) for r in records
    )
    mine = [r for r in records if r["session_id"] == sid]
    messages = [r["message"] for r in mine]
    assert any("created" in m for m in messages) and any("closed" in m for m in messages)
    # Lines from the session's own tasks (aiortc, aioice) inherit the id too.
    assert {r["logger"].split(".")[0] for r in mine} - {"signaling", "aiohttp"}, messages
    # The access log line for the DELETE names the session, has fields, and no query string.
    access = [r for r in mine if r["logger"] == "aiohttp.access"]
    assert access and access[-1]["method"] == "DELETE" and access[-1]["status"] == 204
    assert "token" not in json.dumps(access)
    # Other sessions' ids never leak onto lines without a session.
    assert all(r["session_id"] in (None, sid) for r in records)


def test_configure_logging_switches_the_root_handler() -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging(Config(log_json=True, log_level="WARNING"))
        assert len(root.handlers) == 1 and root.level == logging.WARNING
        record = logging.LogRecord("x", logging.WARNING, __file__, 1, "a %s", ("b",), None)
        assert root.handlers[0].filter(record)
        entry = json.loads(root.handlers[0].format(record))
        assert entry["message"] == "a b" and entry["session_id"] is None
        configure_logging(Config())
        text = root.handlers[0].format(record)
        assert text.endswith("x [-]: a b")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
