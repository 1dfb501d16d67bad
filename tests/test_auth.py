"""Bearer-token authentication, rooms and roles, through the real server and a real peer."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from aiohttp import web

from agent.config import Config, SecuritySettings
from agent.conversation_config import ListenSettings
from signaling.app import build_app
from signaling.auth import mint_token
from signaling.cli import main
from signaling.workers import WorkerPool
from tests.conftest import LiveServer, raw_http, raw_status
from tests.doubles import ToneEngine
from tests.rtc_client import RtcClient

SECRET = "test-secret-that-is-long-enough-0123456789"
OFFER = "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n"


@pytest.fixture
def server_config() -> Config:
    return Config(host="127.0.0.1", security=SecuritySettings(auth_secret=SECRET))


def token(**claims: Any) -> str:
    payload = {"exp": int(time.time()) + 600, **claims}
    return jwt.encode(payload, SECRET, algorithm="HS256")


def bearer(value: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {value}"}


async def _error(resp: aiohttp.ClientResponse) -> dict[str, str]:
    assert resp.content_type == "application/json"
    error: dict[str, str] = (await resp.json())["error"]
    assert set(error) == {"code", "message"}
    return error


# Every signaling request; each is refused before it does anything.
PROTECTED = [
    ("POST", "/offer", {"json": {"type": "offer", "sdp": OFFER}}),
    ("POST", "/whep", {"data": OFFER, "headers": {"Content-Type": "application/sdp"}}),
    ("DELETE", "/whep/abc", {}),
    ("GET", "/sessions/abc", {}),
    ("DELETE", "/sessions/abc", {}),
    ("POST", "/sessions/abc/say", {"json": {"text": "hi"}}),
    ("GET", "/ice-servers", {}),  # it hands out TURN credentials
]


@pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")  # the HS512 case
@pytest.mark.parametrize(("method", "path", "kwargs"), PROTECTED)
async def test_every_signaling_request_needs_a_valid_token(
    live_server: LiveServer, method: str, path: str, kwargs: dict[str, Any]
) -> None:
    now = int(time.time())
    cases = [
        ({}, "required"),
        (bearer(""), "required"),
        (bearer(token(exp=now - 60)), "expired"),
        (bearer(jwt.encode({"exp": now + 600}, "x" * 40, algorithm="HS256")), "invalid"),
        (bearer(jwt.encode({"room": "a"}, SECRET, algorithm="HS256")), "no 'exp'"),
        (bearer("not.a.jwt"), "invalid"),
        (bearer(token(role="admin")), "role"),
        (bearer(token(room=5)), "room"),
        # The right secret, the wrong algorithm: refused, never "none" or RS/HS confusion.
        (bearer(jwt.encode({"exp": now + 600}, SECRET, algorithm="HS512")), "invalid"),
    ]
    async with aiohttp.ClientSession() as http:
        for auth, words in cases:
            extra = dict(kwargs)
            extra["headers"] = {**kwargs.get("headers", {}), **auth}
            async with http.request(method, live_server.url + path, **extra) as resp:
                assert resp.status == 401, (auth, await resp.text())
                assert resp.headers["WWW-Authenticate"] == "Bearer"
                error = await _error(resp)
                assert error["code"] == "unauthorized"
                assert words in error["message"], (words, error)
        # A valid token gets past authentication to the route's own answer.
        extra = dict(kwargs)
        extra["headers"] = {**kwargs.get("headers", {}), **bearer(token())}
        async with http.request(method, live_server.url + path, **extra) as resp:
            assert resp.status not in (401, 403), await resp.text()


async def test_probes_client_and_metrics_stay_open(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        for path in ("/healthz", "/readyz", "/", "/app.js", "/static/style.css", "/metrics"):
            async with http.get(live_server.url + path) as resp:
                assert resp.status == 200, path


@pytest.mark.parametrize("token_in", ["header", "query", "body"])
async def test_a_session_is_created_and_controlled_with_a_token(
    live_server: LiveServer, token_in: str
) -> None:
    good = token()
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http, token=good)
        await client.connect(token_in=token_in)
        url = f"{live_server.url}/sessions/{client.session_id}"
        try:
            # The data channel needs no token of its own: the offer was authenticated.
            client.send({"type": "say", "text": "over the channel", "id": "dc"})
            await client.wait_event(lambda e: e["type"] == "speech.ended" and e["id"] == "dc")
            # Controlling the session needs a token too.
            async with http.post(url + "/say", json={"text": "no token"}) as resp:
                assert resp.status == 401
            async with http.get(url) as resp:
                assert resp.status == 401
            async with http.delete(url) as resp:
                assert resp.status == 401
            async with http.post(url + "/say", params={"token": good}, json={"text": "q"}) as resp:
                assert resp.status == 202
            async with http.post(url + "/say", json={"text": "body", "token": good}) as resp:
                assert resp.status == 202
            async with http.get(url, headers=bearer(good)) as resp:
                assert resp.status == 200
                assert (await resp.json())["role"] == "speaker"
            # The scheme is case-insensitive (RFC 7235).
            async with http.get(url, headers={"Authorization": f"bearer {good}"}) as resp:
                assert resp.status == 200
            # A token bound to a room controls no session outside it: not a 1:1 one either.
            for method, path, body in [
                ("GET", "", None),
                ("POST", "/say", {"text": "hi"}),
                ("DELETE", "", None),
            ]:
                async with http.request(
                    method, url + path, json=body, headers=bearer(token(room="a"))
                ) as resp:
                    assert resp.status == 403, method + path
            async with http.delete(url, headers=bearer(good)) as resp:
                assert resp.status == 204
        finally:
            await client.close()
        # Only routes that exist are checked: an unknown path is 404, a wrong method 405.
        async with http.get(live_server.url + "/nope") as resp:
            assert resp.status == 404
        async with http.put(live_server.url + "/offer") as resp:
            assert resp.status == 405


async def test_a_body_that_is_not_json_is_unauthorized_not_a_crash(live_server: LiveServer) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            live_server.url + "/offer",
            data=b'{"token": "x", oops',
            headers={"Content-Type": "application/json"},
        ) as resp,
    ):
        assert resp.status == 401
        assert (await _error(resp))["code"] == "unauthorized"


@pytest.mark.parametrize("path", ["/offer", "/sessions/abc/say"])
async def test_a_body_that_does_not_decompress_is_a_400_not_a_crash(
    live_server: LiveServer, path: str
) -> None:
    """Without a token in the header or the query, the body is read for one: a body not in
    its Content-Encoding raised from that read, a 500 before the route was reached."""
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + path, data=b'{"token": "x"}', headers=headers) as resp,
    ):
        assert resp.status == 400, await resp.text()
        assert (await _error(resp))["code"] == "bad_body"


async def test_tokens_that_are_not_utf8_are_invalid_not_a_crash(live_server: LiveServer) -> None:
    """PyJWT encodes a token as UTF-8 first: a lone surrogate (JSON's "\\ud800", a query's
    %ED%A0%80, a header's raw 0xff byte) raised UnicodeEncodeError, a 500."""
    async with aiohttp.ClientSession() as http:
        async with http.post(
            live_server.url + "/offer",
            data=b'{"type": "offer", "sdp": "v=0", "token": "\\ud800"}',
            headers={"Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 401, await resp.text()
            assert "invalid" in (await _error(resp))["message"]
        async with http.get(live_server.url + "/sessions/x?token=%ED%A0%80") as resp:
            assert resp.status == 401, await resp.text()
            assert "invalid" in (await _error(resp))["message"]
    reply = await raw_http(
        live_server.url,
        b"GET /sessions/x HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a.b.\xff\r\n"
        b"Connection: close\r\n\r\n",
    )
    assert raw_status(reply) == 401, reply
    assert b'"unauthorized"' in reply


async def test_a_room_token_is_valid_for_its_room_only(live_server: LiveServer) -> None:
    room_a = token(room="a")
    async with aiohttp.ClientSession() as http:
        # A room claim the API would refuse as a requested room ('' or over 64 characters)
        # was taken as it was: every holder joined a room no request may name. Such a
        # token is invalid.
        for bad_room in ("", "r" * 65, 5, "r\nx"):
            async with http.post(
                live_server.url + "/offer",
                json={"type": "offer", "sdp": OFFER},
                headers=bearer(token(room=bad_room)),
            ) as resp:
                assert resp.status == 401, bad_room
                error = await _error(resp)
                assert error["code"] == "unauthorized" and "'room'" in error["message"]
        async with http.post(
            live_server.url + "/offer",
            json={"type": "offer", "sdp": OFFER, "room": "b"},
            headers=bearer(room_a),
        ) as resp:
            assert resp.status == 403
            error = await _error(resp)
            assert error["code"] == "forbidden" and "room" in error["message"]
        async with http.post(
            live_server.url + "/whep",
            params={"room": "b"},
            data=OFFER,
            headers={**bearer(room_a), "Content-Type": "application/sdp"},
        ) as resp:
            assert resp.status == 403

        # No room asked for: the session joins the token's room.
        client = RtcClient(live_server.url, http, token=room_a)
        await client.connect()
        url = f"{live_server.url}/sessions/{client.session_id}"
        try:
            async with http.get(url, headers=bearer(room_a)) as resp:
                assert (await resp.json())["room"] == "a"
            room_b = token(room="b")
            for method, path, body in [
                ("GET", "", None),
                ("POST", "/say", {"text": "hi"}),
                ("DELETE", "", None),
            ]:
                async with http.request(
                    method, url + path, json=body, headers=bearer(room_b)
                ) as resp:
                    assert resp.status == 403, method + path
                    assert (await _error(resp))["code"] == "forbidden"
            # A token without a room is valid in every room.
            async with http.get(url, headers=bearer(token())) as resp:
                assert resp.status == 200
        finally:
            await client.close()


async def test_a_listener_token_may_only_receive(live_server: LiveServer) -> None:
    listener = token(role="listener")
    async with aiohttp.ClientSession() as http:
        async with http.post(
            live_server.url + "/offer",
            json={"type": "offer", "sdp": OFFER},
            headers=bearer(listener),
        ) as resp:
            assert resp.status == 403
            assert (await _error(resp))["code"] == "forbidden"

        client = RtcClient(live_server.url, http, token=listener)
        await client.connect(whep=True)
        url = f"{live_server.url}/sessions/{client.session_id}"
        try:
            async with http.get(url, headers=bearer(listener)) as resp:
                assert (await resp.json())["role"] == "listener"
            async with http.post(url + "/say", json={"text": "hi"}, headers=bearer(listener)) as r:
                assert r.status == 403
            # A host (or speaker) token makes the listener's session speak.
            async with http.post(
                url + "/say", json={"text": "hi"}, headers=bearer(token(role="host"))
            ) as resp:
                assert resp.status == 202
            async with http.delete(
                f"{live_server.url}{client.location}", headers=bearer(listener)
            ) as resp:
                assert resp.status == 204
        finally:
            await client.close()


async def test_the_token_command_mints_a_token_the_server_accepts(
    live_server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"VOICE_AGENT_AUTH_SECRET": SECRET}
    assert main(["token", "--room", "r1", "--role", "listener", "--ttl", "60"], env) == 0
    minted = capsys.readouterr().out.strip()
    claims = jwt.decode(minted, SECRET, algorithms=["HS256"])
    assert claims["room"] == "r1" and claims["role"] == "listener"
    assert 0 < claims["exp"] - time.time() <= 60
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http, token=minted)
        await client.connect(whep=True, room="r1")
        await client.close()


def test_the_token_command_needs_a_secret(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["token", "--room", "r"], {})
    assert exit_info.value.code == 2
    assert "AUTH_SECRET" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["token"], {"VOICE_AGENT_AUTH_SECRET": "too short"})
    with pytest.raises(SystemExit):
        main(["token", "--ttl", "0"], {"VOICE_AGENT_AUTH_SECRET": SECRET})


@pytest.mark.parametrize("room", ["", "r" * 65, "r\n2026-01-01 FORGED", "r\u2028x"])
def test_the_token_command_refuses_a_room_the_api_refuses(
    room: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``voice-agent token --room ""`` (e.g. ``--room "$ROOM"`` with ROOM unset) minted a
    token for a room no request may name; now a usage error naming the flag."""
    with pytest.raises(SystemExit) as exit_info:
        main(["token", "--room", room], {"VOICE_AGENT_AUTH_SECRET": SECRET})
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "--room" in captured.err and captured.out == ""
    with pytest.raises(ValueError, match="room"):
        mint_token(SECRET, ttl_s=5, room=room)


def test_the_secret_is_never_shown() -> None:
    config = Config(security=SecuritySettings(auth_secret=SECRET, metrics_token="m" * 20))
    assert SECRET not in repr(config) and "m" * 20 not in repr(config)
    with pytest.raises(ValueError, match="32 bytes"):
        SecuritySettings(auth_secret="short")
    assert mint_token(SECRET, ttl_s=5).count(".") == 2


async def test_tokens_never_reach_the_logs(
    live_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret_token = token(room="logs")
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http, token=secret_token)
        await client.connect(token_in="query")
        url = f"{live_server.url}/sessions/{client.session_id}"
        try:
            async with http.post(url + "/say", json={"text": "a b", "token": secret_token}) as r:
                assert r.status == 202
            async with http.get(url, params={"token": secret_token}) as resp:
                assert resp.status == 200
            async with http.get(url, headers=bearer(secret_token + "x")) as resp:
                assert resp.status == 401
            async with http.delete(url, headers=bearer(secret_token)) as resp:
                assert resp.status == 204
        finally:
            await client.close()
    assert any(r.name == "aiohttp.access" for r in caplog.records), "no access log to check"
    assert any(client.session_id in r.getMessage() for r in caplog.records)
    signature = secret_token.rsplit(".", 1)[1]
    for record in caplog.records:
        text = record.getMessage() + repr(record.__dict__)
        assert signature not in text and SECRET not in text, record


async def test_a_token_in_a_body_in_another_charset_is_read(live_server: LiveServer) -> None:
    """The handler reads a JSON body in the charset its Content-Type names (a Latin-1 name
    "Zoë"); the token in it was read as UTF-8 bytes, no JSON: 401 "a token is required"
    for a request the handler would have taken (one process and the --workers front)."""
    fields = {"type": "offer", "sdp": OFFER, "name": "Zo\u00eb", "token": token()}
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            live_server.url + "/offer",
            data=json.dumps(fields, ensure_ascii=False).encode("latin-1"),
            headers={"Content-Type": "application/json; charset=iso-8859-1"},
        ) as resp,
    ):
        assert resp.status == 400, await resp.text()  # past the token: the SDP's turn
        assert (await _error(resp))["code"] == "no_opus"


async def test_the_front_finds_a_worker_ready_with_auth_on(tmp_path: Path) -> None:
    """``serve --auth-secret`` with workers (the default: one per core): the front polls each
    worker's status over its private socket with no client's token. The worker's auth
    refused the poll (401), the front read "not ready" for good, and nothing was served:
    /readyz 503 and every offer 503 not_ready. Here a real worker app and the pool's poll."""
    config = Config(
        host="127.0.0.1",
        port=0,
        workers=1,
        listen=ListenSettings(enabled=False),
        security=SecuritySettings(auth_secret=SECRET),
    )
    pool = WorkerPool(config, lambda _config: None, tmp_path)  # type: ignore[arg-type, return-value]
    worker = pool.workers[0]
    runner = web.AppRunner(build_app(replace(config, worker_index=0), ToneEngine()))
    await runner.setup()
    try:
        await web.UnixSite(runner, worker.socket_path).start()
        worker.open_clients()
        async with asyncio.timeout(10):
            while not worker.ready:
                await pool._poll(worker)
                await asyncio.sleep(0.05)
        assert worker.status["index"] == 0 and worker.answered_at > 0
    finally:
        await worker.close_clients()
        await runner.cleanup()


@pytest.mark.parametrize("front", [False, True])
async def test_a_resume_refused_by_auth_is_counted_as_a_resume(
    live_server: LiveServer, front: bool
) -> None:
    """A WHEP resume (X-Session-Token) that auth refuses was counted, in one process, among
    the new-session offers (offers_total{whep, rejected_unauthorized}): auth runs before the
    handler that marked it a resume. Through the front (--workers) it was a resume. Both
    count it as one now."""
    from tests.test_metrics import scrape, value
    from tests.test_worker_routing import front_and_worker

    headers = {"Content-Type": "application/sdp", "X-Session-Token": "t" * 43}
    headers |= bearer("expired.or.wrong")

    async def refused_resume(url: str, http: aiohttp.ClientSession) -> None:
        async with http.post(url + "/whep", data=OFFER, headers=headers) as resp:
            assert resp.status == 401, await resp.text()

    async with aiohttp.ClientSession() as http:
        if front:
            async with front_and_worker(live_server.config) as url:
                await refused_resume(url, http)
                samples = await scrape(http, url, headers=bearer(token()))
        else:
            await refused_resume(live_server.url, http)
            samples = await scrape(http, live_server.url)
    labels = {"kind": "whep", "outcome": "rejected_unauthorized"}
    if front:
        labels["worker"] = "front"
    assert value(samples, "voice_agent_resumes_total", **labels) == 1
    assert value(samples, "voice_agent_offers_total", **labels) == 0


async def test_a_token_whose_room_claim_is_null_is_invalid_not_valid_for_every_room(
    live_server: LiveServer,
) -> None:
    """README: "`room`: the token is valid for that room only (a room name ...; a token
    with any other `room` is invalid, 401)". A backend that mints {"room": null} (its room
    variable unset) hands out a token that is valid for EVERY room: auth.verify_token reads
    payload.get("room") and None means "any room" (fail-open; found by review). A null
    `role` is refused 401, a null `room` is not."""
    unbound = {"Authorization": f"Bearer {token(room=None)}"}
    async with aiohttp.ClientSession() as http:
        async with http.get(live_server.url + "/ice-servers", headers=unbound) as resp:
            assert resp.status == 401, (resp.status, await resp.text())
        # ... and what it opens: an offer for any room gets past auth (400 bad_sdp here,
        # never the 401/403 a room-bound or invalid token gets).
        async with http.post(
            live_server.url + "/offer",
            json={**{"type": "offer", "sdp": "v=0"}, "room": "someone-elses"},
            headers=unbound,
        ) as resp:
            assert resp.status in (401, 403), (resp.status, await resp.text())


async def test_a_token_in_a_json_body_sent_as_text_plain_is_read(live_server: LiveServer) -> None:
    """The handlers read a body as JSON whatever its Content-Type (fetch() with a string
    body sends text/plain;charset=UTF-8, and without --auth-secret that offer is answered),
    but auth.request_token looks for the body's `token` only under application/json: with
    the token in the body, as README says a browser may put it, the same request is a 401
    "a token is required" (found by review)."""
    body = json.dumps({**{"type": "offer", "sdp": "v=0"}, "token": token()})
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            live_server.url + "/offer",
            data=body,
            headers={"Content-Type": "text/plain;charset=UTF-8"},
        ) as resp,
    ):
        text = await resp.text()
        assert resp.status != 401, text
        assert resp.status == 400 and json.loads(text)["error"]["code"] == "no_audio", text


async def test_a_token_minted_on_a_host_whose_clock_is_a_little_ahead_is_accepted(
    live_server: LiveServer,
) -> None:
    """`voice-agent token` (or any JWT library) stamps `iat`; PyJWT refuses a token whose
    iat is later than now with no leeway, and verify_token reports it as "invalid (bad
    signature or format)". A token minted on another host whose clock runs 2 s ahead is
    refused for its first 2 s, i.e. always when a page fetches a token and uses it at
    once (found by review)."""
    now = int(time.time())
    skewed = {"Authorization": f"Bearer {token(iat=now + 2)}"}
    async with (
        aiohttp.ClientSession() as http,
        http.get(live_server.url + "/ice-servers", headers=skewed) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def test_a_listener_token_cannot_resume_a_speaker_s_whep_session(
    live_server: LiveServer,
) -> None:
    """A session keeps the role it was made with, resume or not: a speaker's WHEP session
    listens to its microphone. A listener token resuming it got that session (and its
    microphone heard by the agent) although it "may only receive" (found by review). A
    speaker's token resumes it; a listener's own session resumes with a listener token."""
    sdp = OFFER + "a=mid:0\r\na=sendrecv\r\na=rtpmap:111 opus/48000/2\r\n"
    async with aiohttp.ClientSession() as http:
        speaker = RtcClient(live_server.url, http, token=token(role="speaker"))
        await speaker.connect(whep=True)
        listener = RtcClient(live_server.url, http, token=token(role="listener"))
        await listener.connect(whep=True)
        try:
            for session_token, role, expected in (
                (speaker.session_token, "listener", 403),
                (listener.session_token, "listener", None),
                (speaker.session_token, "speaker", None),
            ):
                assert session_token is not None
                headers = {
                    "Content-Type": "application/sdp",
                    "X-Session-Token": session_token,
                    **bearer(token(role=role)),
                }
                async with http.post(live_server.url + "/whep", data=sdp, headers=headers) as resp:
                    if expected is None:
                        # Past the role check, to the offer itself: refused only for this
                        # offer's missing ICE credentials (400 bad_sdp), never 403.
                        assert resp.status == 400, await resp.text()
                        assert (await _error(resp))["code"] == "bad_sdp"
                    else:
                        assert resp.status == expected, await resp.text()
                        assert (await _error(resp))["code"] == "forbidden"
        finally:
            await speaker.close()
            await listener.close()
