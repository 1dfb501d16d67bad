"""Log lines name their session; --log-json writes one JSON object per line."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
import signal
import sys
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from agent.config import BreakerSettings, Config, LifecycleSettings, RoomSettings
from agent.conversation_config import ListenSettings
from signaling.app import build_app, runner_options
from signaling.keys import BREAKER, DRAIN, SESSIONS
from signaling.logs import TextFormatter, configure_logging, log_handler
from signaling.shutdown import drain, log_listening
from signaling.shutdown import serve as serve_until_signal
from tests.conftest import LiveServer, raw_http, serve
from tests.doubles import FailingEngine, ToneEngine
from tests.rtc_client import RtcClient
from tests.test_shutdown import an_offer
from tests.test_worker_routing import front_and_worker


@contextlib.contextmanager
def captured_log(json_lines: bool, level: int) -> Iterator[io.StringIO]:
    """The server's log handler (JSON lines or the default text) on the root logger,
    writing into a string."""
    stream = io.StringIO()
    handler = log_handler(json_lines=json_lines)
    handler.setStream(stream)  # type: ignore[attr-defined]
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(level)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    with captured_log(json_lines=True, level=logging.DEBUG) as stream:
        yield stream


@pytest.fixture
def text_log() -> Iterator[io.StringIO]:
    """The default format, without --log-json."""
    with captured_log(json_lines=False, level=logging.INFO) as stream:
        yield stream


# What a client would have the log say on a line of its own.
FORGED = "2026-01-01 00:00:00,000 CRITICAL signaling.app [-]: FORGED"


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


async def test_a_refused_offer_s_access_line_names_no_session(json_log: io.StringIO) -> None:
    """The id a refused offer would have had (room full, here) was left on its request's
    context: its access-log line named a session that no client was ever told of."""
    config = Config(host="127.0.0.1", port=0, rooms=RoomSettings(max_participants=1))
    async with serve(config, ToneEngine()) as live, aiohttp.ClientSession() as http:
        statuses = []
        for _ in range(2):
            offer = {"type": "offer", "sdp": await an_offer(), "room": "r"}
            async with http.post(live.url + "/offer", json=offer) as resp:
                statuses.append(resp.status)
                if resp.status == 200:
                    sid = (await resp.json())["session_id"]
    assert statuses == [200, 409]
    access = [r for r in lines(json_log) if r["logger"] == "aiohttp.access"]
    assert [(r["status"], r["session_id"]) for r in access] == [(200, sid), (409, None)]


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


async def offer(http: aiohttp.ClientSession, url: str, **fields: str) -> str:
    """A new session (never connected): its id."""
    body = {"type": "offer", "sdp": await an_offer(), **fields}
    async with http.post(url + "/offer", json=body) as resp:
        assert resp.status == 200, await resp.text()
        session_id: str = (await resp.json())["session_id"]
        return session_id


async def test_the_watchdogs_lines_name_the_session_they_are_about(
    json_log: io.StringIO,
) -> None:
    """The session watchdog was started in the first session's context, and it and the
    closes it started kept that id: the lines saying another session idled out and closed
    carried the first session's id."""
    config = Config(
        host="127.0.0.1",
        port=0,
        listen=ListenSettings(enabled=False),
        lifecycle=LifecycleSettings(idle_timeout_s=0.6),
    )
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        first = await offer(http, server.url)
        second = await offer(http, server.url)
        async with asyncio.timeout(10):
            while len(server.app[SESSIONS]):
                await asyncio.sleep(0.05)
    for sid in (first, second):
        about = [r for r in lines(json_log) if sid in r["message"]]
        messages = [r["message"] for r in about]
        assert any("idle" in m for m in messages) and any("closed" in m for m in messages)
        assert all(r["session_id"] == sid for r in about), about


def unheard_config(breaker: BreakerSettings) -> Config:
    """A server that listens to no microphone, with ``breaker``: for a FailingEngine."""
    return Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False), breaker=breaker)


async def test_a_rooms_and_the_breakers_own_lines_name_no_session(
    json_log: io.StringIO,
) -> None:
    """A room's tasks (its agent's speech) were started in its first participant's context
    and the breaker's probe in that of the session whose failure opened it: their lines
    carried that session's id for good. They belong to no session."""
    config = unheard_config(BreakerSettings(failures=2, window_s=30, cooldown_s=0.2))
    engine = FailingEngine()
    async with serve(config, engine) as server, aiohttp.ClientSession() as http:
        await offer(http, server.url, room="r")  # the first participant starts the room
        second = await offer(http, server.url, room="r")
        alone = await offer(http, server.url)
        engine.mode = "start"
        for sid in (second, alone):  # the room's agent fails once, then alone's session
            async with http.post(f"{server.url}/sessions/{sid}/say", json={"text": "hi"}) as r:
                assert r.status == 202, await r.text()
            async with asyncio.timeout(10):
                while engine.failures < (1 if sid == second else 2):
                    await asyncio.sleep(0.02)
        breaker = server.app[BREAKER]
        async with asyncio.timeout(5):  # the failure reaches the breaker a step after the engine
            while breaker.state == "closed":
                await asyncio.sleep(0.01)
        engine.mode = "ok"
        async with asyncio.timeout(10):  # the probe closes it
            while breaker.state != "closed":
                await asyncio.sleep(0.02)
    records = lines(json_log)
    failed = [r for r in records if "engine failed on utterance" in r["message"]]
    assert [r["session_id"] for r in failed] == [None, alone]  # the room's, then alone's
    probe = [r for r in records if "the probe succeeded" in r["message"]]
    assert probe and all(r["session_id"] is None for r in probe), probe


async def test_the_fronts_access_lines_name_the_session(json_log: io.StringIO) -> None:
    """With --workers N the access log is the front's (workers write none), and the front
    never named the session: every access line had session_id null. Now a request for a
    session names it (an unknown one does not), and so does an offer once answered."""
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    async with front_and_worker(config) as url, aiohttp.ClientSession() as http:
        sid = await offer(http, url)
        async with http.post(f"{url}/sessions/{sid}/say", json={"text": "hi"}) as resp:
            assert resp.status == 202
        async with http.delete(f"{url}/sessions/{sid}") as resp:
            assert resp.status == 204
        async with http.get(f"{url}/sessions/w0-{'0' * 32}") as resp:
            assert resp.status == 404
        headers = {"Content-Type": "application/sdp"}
        async with http.post(url + "/whep", data=await an_offer(), headers=headers) as resp:
            assert resp.status == 201
            whep = resp.headers["Location"].removeprefix("/whep/")
        async with http.delete(f"{url}/whep/{whep}") as resp:
            assert resp.status == 204
    access = [
        (r["method"], r["path"], r["session_id"])
        for r in lines(json_log)
        if r["logger"] == "aiohttp.access"
    ]
    assert access == [
        ("POST", "/offer", sid),
        ("POST", f"/sessions/{sid}/say", sid),
        ("DELETE", f"/sessions/{sid}", sid),
        ("GET", f"/sessions/w0-{'0' * 32}", None),
        ("POST", "/whep", whep),
        ("DELETE", f"/whep/{whep}", whep),
    ]


async def test_the_cpu_governors_lines_name_no_session(
    json_log: io.StringIO,
) -> None:
    """The governor is the whole process's: its probe timer was first scheduled (call_at
    copies the context) while the first session's offer was answered, and each probe
    re-schedules the next from that copy, so every "Opus complexity a -> b" line names the
    first session of the process, for good, long after it closed (seen in the chaos run:
    all 22 governor lines named the warm-up session, closed minutes before)."""
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        first = await offer(http, server.url)  # registers the first encoder: timer starts
        async with http.delete(f"{server.url}/sessions/{first}") as resp:
            assert resp.status == 204
        governor = server.app[SESSIONS].governor
        lowest = governor.policy.rungs[0]
        decide = governor.policy.decide
        # Overload, once: the next window's decision steps every encoder down.
        governor.policy.decide = lambda now, load, late: lowest  # type: ignore[method-assign]
        await offer(http, server.url)  # a second session, so there is an encoder to step
        async with asyncio.timeout(5):
            while not any("Opus complexity" in r["message"] for r in lines(json_log)):
                await asyncio.sleep(0.05)
        governor.policy.decide = decide  # type: ignore[method-assign]
    steps = [r for r in lines(json_log) if "Opus complexity" in r["message"]]
    assert all(r["session_id"] is None for r in steps), [first] + [
        (r["session_id"], r["message"][:60]) for r in steps
    ]


async def test_a_rooms_speech_worker_names_no_session_after_a_participants_interrupt(
    json_log: io.StringIO,
) -> None:
    """The room's agent belongs to no session (Room.start runs its tasks in an empty
    context, README "Logs"). But ``SpeechPipeline.interrupt`` replaces the speech worker with
    ``create_task`` in the context of whoever interrupted: after one participant's
    ``interrupt`` the room agent's worker, and every line it writes (engine failures
    included), names that participant, for good, even after it left."""
    config = unheard_config(BreakerSettings(failures=100, window_s=30, cooldown_s=1))
    engine = FailingEngine()
    async with serve(config, engine) as server, aiohttp.ClientSession() as http:
        other = await offer(http, server.url, room="r")  # the room exists before the client
        client = RtcClient(server.url, http)
        await client.connect(room="r")  # data channel open
        interrupter = client.session_id
        room = server.app[SESSIONS].rooms.get("r")
        assert room is not None
        before = room.pipeline._worker
        client.send({"type": "interrupt"})
        async with asyncio.timeout(5):
            while room.pipeline._worker is before:
                await asyncio.sleep(0.02)
        # The interrupter leaves; the room (and its agent) lives on with the other one.
        async with http.delete(f"{server.url}/sessions/{interrupter}") as resp:
            assert resp.status == 204
        await client.close()
        engine.mode = "start"
        async with http.post(f"{server.url}/sessions/{other}/say", json={"text": "hi"}) as r:
            assert r.status == 202, await r.text()
        async with asyncio.timeout(10):
            while engine.failures < 1:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
    failed = [r for r in lines(json_log) if "engine failed on utterance" in r["message"]]
    assert failed
    assert [r["session_id"] for r in failed] == [None], (interrupter, failed[0]["session_id"])


async def test_the_drains_closing_lines_name_their_session(
    json_log: io.StringIO,
) -> None:
    """README "Logs": every line names its session. On SIGTERM the drain's
    ``close_all`` closes every session from the shutdown's own context (no session id):
    each "session <id> closed" line of a shutdown says ``[-]`` (seen in the chaos run's
    SIGTERM: 7 of them), unlike the same line from a DELETE or the watchdog."""
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        sid = await offer(http, server.url)
        await drain(server.app[SESSIONS], server.app[DRAIN], 1.0)
    closed = [r for r in lines(json_log) if r["message"].startswith(f"session {sid} closed")]
    assert closed
    assert [r["session_id"] for r in closed] == [sid]


async def test_a_request_path_cannot_forge_a_log_line(text_log: io.StringIO) -> None:
    """The access log writes the decoded path: ``/x%0A<a log line>`` wrote that line as a
    line of its own. The text format escapes control characters now: ``/x\\n2026-...``."""
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    async with serve(config, ToneEngine()) as server:
        host = server.url.removeprefix("http://").encode()
        path = b"/x%0A" + FORGED.replace(" ", "%20").encode()
        request = b"GET " + path + b" HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"
        await raw_http(server.url, request)
        async with asyncio.timeout(5):  # the access line is written after the reply
            while "GET /x" not in text_log.getvalue():
                await asyncio.sleep(0.01)
    logged = text_log.getvalue().splitlines()
    assert not any(line.startswith(FORGED) for line in logged), logged
    assert any(f'"GET /x\\n{FORGED}" 404' in line for line in logged), logged


def test_the_text_format_writes_one_line_whatever_the_values_hold() -> None:
    """Any value a message quotes (a room name, a path, a header), wherever it came from:
    CR, LF, the other C0 and C1 controls and Unicode's line separators are escaped, and a
    traceback's lines are indented (an exception's message may quote a client too)."""
    formatter = TextFormatter()
    value = "r\n" + FORGED + "\r\x1b[2K\x85\u2028\x7f\té"
    record = logging.LogRecord(
        "signaling.rooms", logging.INFO, __file__, 1, "room %s", (value,), None
    )
    record.session_id = "-"
    (line,) = formatter.format(record).splitlines()
    assert line.endswith(r"[-]: room r\n" + FORGED + r"\r\x1b[2K\x85\u2028\x7f\té")
    try:
        raise ValueError("bad room\n" + FORGED)
    except ValueError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "oops", (), sys.exc_info())
    failed.session_id = "-"
    first, *traceback = formatter.format(failed).splitlines()
    assert first.endswith("[-]: oops") and traceback[-1] == "    " + FORGED
    assert traceback[0] == "    Traceback (most recent call last):"
    assert all(line.startswith("    ") for line in traceback)
    # The indented traceback is not cached on the record for the other handlers.
    assert failed.exc_text is None


async def test_the_server_logs_the_address_it_bound(caplog: pytest.LogCaptureFixture) -> None:
    """With --port 0 (any free port) the only line naming the address was logged before
    binding, and said port 0: the user could not tell where the server was. It is logged
    once bound now, with the port the socket got."""
    caplog.set_level(logging.INFO, logger="signaling.shutdown")
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    app = build_app(config, ToneEngine())
    running = asyncio.create_task(
        serve_until_signal(app, config, app[SESSIONS], app[DRAIN], **runner_options())
    )
    said: list[logging.LogRecord] = []
    try:
        async with asyncio.timeout(30):
            while not (said := [r for r in caplog.records if "serving" in r.getMessage()]):
                assert not running.done(), running.result()
                await asyncio.sleep(0.01)
        found = re.search(r"http://127\.0\.0\.1:(\d+) \(1 media process\)", said[0].getMessage())
        assert found and int(found.group(1)) != 0, said[0].getMessage()
        url = f"http://127.0.0.1:{found.group(1)}/healthz"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            assert resp.status == 200
    finally:
        if said:  # its SIGTERM handler is in place (set before the line): the real stop
            signal.raise_signal(signal.SIGTERM)
        else:
            running.cancel()
        async with asyncio.timeout(30):
            await asyncio.gather(running, return_exceptions=True)


def test_every_bound_address_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """A host name may bind several addresses (localhost: 127.0.0.1 and ::1, each with a
    port of its own under --port 0); a wildcard address is this machine's localhost."""
    caplog.set_level(logging.INFO, logger="signaling.shutdown")
    log_listening([("127.0.0.1", 40001), ("::1", 40002, 0, 0)], Config(workers=3))
    log_listening([("0.0.0.0", 8080), ("::", 8080, 0, 0)], Config())
    assert [r.getMessage() for r in caplog.records] == [
        "serving the browser client on http://127.0.0.1:40001, http://[::1]:40002 "
        "(3 media processes)",
        "serving the browser client on http://localhost:8080 (1 media process)",
    ]


def test_a_json_log_line_cannot_be_split_by_a_client() -> None:
    """json.dumps with ensure_ascii=False leaves U+2028, NEL and the other C1 controls raw:
    a path holding them broke a JSON line for any reader splitting with str.splitlines.
    Escaped, the message still reads back as the client sent it."""
    sent = "/x\u2028forged\x85line\x9b"
    record = logging.LogRecord("aiohttp.access", logging.INFO, __file__, 1, "GET %s", (sent,), None)
    line = log_handler(json_lines=True).format(record)
    assert len(line.splitlines()) == 1, line
    assert json.loads(line)["message"] == "GET " + sent


async def test_a_request_aiohttp_cannot_parse_is_one_info_line_quoting_nothing(
    text_log: io.StringIO,
) -> None:
    """aiohttp logged a request line over 8190 bytes as an ERROR with a traceback quoting
    the line: any client could fill the log with errors, and a ``?token=`` in the line was
    written out (found by review). It is one INFO line naming the client and the error."""
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    async with serve(config, ToneEngine()) as server:
        target = b"/sessions/x?token=SECRETTOKEN&pad=" + b"a" * 9000
        await raw_http(server.url, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(5):
            while "could not parse" not in text_log.getvalue():
                await asyncio.sleep(0.01)
    logged = text_log.getvalue()
    assert "SECRETTOKEN" not in logged and "Traceback" not in logged, logged
    assert " ERROR " not in logged, logged
    assert "could not parse from 127.0.0.1: LineTooLong (400)" in logged, logged


class RTCSctpTransport:
    """Named as aiortc's: its background send task's coroutine is what asyncio names."""

    async def _transmit(self) -> None:
        raise ConnectionError("Cannot send data, not connected")


class SomethingElse:
    async def _transmit(self) -> None:
        raise ConnectionError("Cannot send data, not connected")


async def _unretrieved(coro: Any) -> None:
    """A task that fails and is never awaited: asyncio reports it when it is collected."""
    task = asyncio.get_running_loop().create_task(coro)
    await asyncio.sleep(0.01)
    assert task.done()
    del task
    import gc

    gc.collect()


async def test_a_send_to_a_vanished_peer_is_no_error(text_log: io.StringIO) -> None:
    """aiortc's SCTP retransmission task raises ConnectionError once the peer's ICE is gone,
    and nothing retrieves it: asyncio logged an ERROR and a traceback each time a client
    vanished mid-call (bench/vanish.py). It is one DEBUG line now; the same error from
    anything else is still an error."""
    await _unretrieved(RTCSctpTransport()._transmit())
    assert text_log.getvalue() == ""  # DEBUG, below the log's INFO
    await _unretrieved(SomethingElse()._transmit())
    assert "ERROR asyncio" in text_log.getvalue() and "Traceback" in text_log.getvalue()
