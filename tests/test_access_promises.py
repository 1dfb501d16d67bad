"""Promises of the HTTP surface (README on access tokens, limits, CORS, request validation,
error bodies, and the inbound SSRC guard) that no other test held the code to: found by hand
mutation testing of signaling/auth.py, limits.py, cors.py, routes.py, resume.py, errors.py,
ssrcguard.py and agent/ratelimit.py. Each test fails with one plausible change to them."""

from __future__ import annotations

import time
import zlib

import aiohttp
import jwt
import pytest

from agent.config import Config, RoomSettings, SecuritySettings
from signaling.auth import mint_token
from tests.conftest import LiveServer, serve
from tests.doubles import ToneEngine
from tests.rtc_client import RtcClient

SECRET = "m" * 32
ORIGIN = "https://app.example"


async def _error(resp: aiohttp.ClientResponse) -> dict[str, str]:
    assert resp.content_type == "application/json", await resp.text()
    error: dict[str, str] = (await resp.json())["error"]
    return error


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --- signaling/auth.py --------------------------------------------------------------------


@pytest.mark.parametrize(
    "server_config", [Config(host="127.0.0.1", security=SecuritySettings(auth_secret=SECRET))]
)
async def test_a_token_that_expired_seconds_ago_is_refused(live_server: LiveServer) -> None:
    """README: a token past its ``exp`` is 401 ``unauthorized`` ("expired"). The suite only
    tried one a minute old: a verification with a minute's leeway passed it."""
    expired = jwt.encode({"exp": int(time.time()) - 3}, SECRET, algorithm="HS256")
    async with (
        aiohttp.ClientSession() as http,
        http.get(live_server.url + "/ice-servers", headers=_bearer(expired)) as resp,
    ):
        assert resp.status == 401, await resp.text()
        error = await _error(resp)
        assert error["code"] == "unauthorized" and "expired" in error["message"]


async def test_without_authentication_every_participant_is_a_host() -> None:
    """README, Who may instruct the agent: with ``--room-instruct hosts`` only hosts may,
    "without authentication everyone is a host". Anonymous requests taken as speakers
    left a hosts-only room with nobody who could instruct its agent."""
    config = Config(host="127.0.0.1", port=0, rooms=RoomSettings(instruct="hosts"))
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        member = RtcClient(server.url, http)
        try:
            await member.connect(room="open")
            async with http.post(
                f"{server.url}/sessions/{member.session_id}/say", json={"text": "hello all"}
            ) as resp:
                assert resp.status == 202, await resp.text()
            async with http.get(f"{server.url}/sessions/{member.session_id}") as resp:
                assert (await resp.json())["role"] == "host"
        finally:
            await member.close()


@pytest.mark.parametrize(
    "server_config", [Config(host="127.0.0.1", security=SecuritySettings(auth_secret=SECRET))]
)
async def test_a_room_token_cannot_resume_a_session_outside_its_room(
    live_server: LiveServer,
) -> None:
    """README: a token with a ``room`` claim is valid for that room only; controlling a
    session in another room is 403. A resume takes a session over: one made without a
    room (a 1:1 session) is not the room token's to take, even with its session token."""
    async with aiohttp.ClientSession() as http:
        owner = RtcClient(live_server.url, http, token=mint_token(SECRET, ttl_s=60))
        other = RtcClient(live_server.url, http, token=mint_token(SECRET, ttl_s=60, room="blue"))
        try:
            await owner.connect()
            assert owner.session_token is not None
            await other.connect(resume=owner.session_token, allow_refusal=True)
            assert other.refusal is not None, "a room-bound token took over a 1:1 session"
            status, body, _ = other.refusal
            assert (status, body["error"]["code"]) == (403, "forbidden"), body
        finally:
            await other.close()
            await owner.close()


async def test_a_hosts_token_does_not_make_a_guests_session_instruct() -> None:
    """signaling/routes.py post_say: in a hosts-only room both the session's participant
    and the caller must be hosts. A host's token posting to a guest's session would speak
    for the guest, whom the room does not let instruct its agent."""
    config = Config(
        host="127.0.0.1",
        port=0,
        rooms=RoomSettings(instruct="hosts"),
        security=SecuritySettings(auth_secret=SECRET),
    )
    host_token = mint_token(SECRET, ttl_s=60, role="host")
    async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
        guest = RtcClient(server.url, http, token=mint_token(SECRET, ttl_s=60, role="speaker"))
        try:
            await guest.connect(room="hosted")
            async with http.post(
                f"{server.url}/sessions/{guest.session_id}/say",
                json={"text": "spoken for the guest"},
                headers=_bearer(host_token),
            ) as resp:
                assert resp.status == 403, await resp.text()
                assert (await _error(resp))["code"] == "forbidden"
        finally:
            await guest.close()


# --- signaling/routes.py: request validation ----------------------------------------------


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("", "bad_name"),
        ("n" * 65, "bad_name"),
        (42, "bad_name"),
        (["Ada"], "bad_name"),
        ("n" * 64, "no_audio"),  # 64 characters is a name: the SDP is what is wrong
        ("Ada", "no_audio"),
    ],
)
async def test_a_display_name_must_be_1_to_64_characters(
    live_server: LiveServer, name: object, code: str
) -> None:
    """README, Joining: an optional ``"name"``, a display name of 1-64 characters, else
    400 ``bad_name``. No test sent a bad one."""
    body = {"type": "offer", "sdp": "v=0", "room": "r", "name": name}
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/offer", json=body) as resp,
    ):
        assert resp.status == 400, await resp.text()
        assert (await _error(resp))["code"] == code


# --- signaling/errors.py ------------------------------------------------------------------


async def test_a_body_over_the_size_limit_is_413_too_large(live_server: LiveServer) -> None:
    """README: ``too_large`` (413, a body over 256 KiB). The suite checked only the
    status, so the code could have been the generic ``http_error``."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            live_server.url + "/offer",
            data=b"x" * (300 * 1024),
            headers={"Content-Type": "application/json"},
        ) as resp,
    ):
        assert resp.status == 413
        assert (await _error(resp))["code"] == "too_large"


async def test_the_connection_closes_after_a_body_not_in_its_encoding(
    live_server: LiveServer,
) -> None:
    """README: "the connection closes after any answer to a body not in its encoding"."""
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/offer", data=b"not gzip" * 8, headers=headers) as resp,
    ):
        assert resp.status == 400
        assert (await _error(resp))["code"] == "bad_body"
        assert resp.headers.get("Connection", "").lower() == "close", dict(resp.headers)
    # A body that is in its encoding keeps the connection (nothing to close it for).
    body = zlib.compress(b'{"type": "offer", "sdp": "v=0"}')
    headers = {"Content-Type": "application/json", "Content-Encoding": "deflate"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/offer", data=body, headers=headers) as resp,
    ):
        assert resp.status == 400 and (await _error(resp))["code"] == "no_audio"
        assert resp.headers.get("Connection", "").lower() != "close"


# --- signaling/cors.py --------------------------------------------------------------------


@pytest.mark.parametrize(
    "server_config",
    [Config(host="127.0.0.1", security=SecuritySettings(cors_origins=(ORIGIN,)))],
)
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
async def test_a_preflight_allows_every_method_the_api_takes(
    live_server: LiveServer, method: str
) -> None:
    """README, CORS: a listed origin may call the API. A cross-origin WHEP player hangs up
    with DELETE (and reads a session with GET): a preflight whose
    Access-Control-Allow-Methods left one out made the browser refuse that request."""
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": method}
    async with (
        aiohttp.ClientSession() as http,
        http.options(live_server.url + "/sessions/abc", headers=headers) as resp,
    ):
        assert resp.status == 204
        allowed = [m.strip() for m in resp.headers["Access-Control-Allow-Methods"].split(",")]
        assert method in allowed, allowed


# --- signaling/ssrcguard.py ---------------------------------------------------------------


def test_a_known_source_is_still_routed_once_the_ssrc_limit_is_reached() -> None:
    """The guard drops packets of *new* SSRCs past MAX_INBOUND_SSRCS; a client that
    restarted its sender up to the limit must still be heard under the SSRCs it has."""
    from aiortc.rtcdtlstransport import RtpRouter
    from aiortc.rtp import RtpPacket

    from signaling.ssrcguard import MAX_INBOUND_SSRCS, _GuardedRouter

    router = RtpRouter()
    receiver = object()
    router.register_receiver(receiver, ssrcs=[], payload_types=[111])  # type: ignore[arg-type]
    router.__class__ = _GuardedRouter
    ssrcs = [1000 + i for i in range(MAX_INBOUND_SSRCS)]
    for ssrc in ssrcs:
        assert router.route_rtp(RtpPacket(payload_type=111, ssrc=ssrc)) is receiver
    assert router.route_rtp(RtpPacket(payload_type=111, ssrc=99)) is None  # a new one: dropped
    for ssrc in ssrcs:  # the ones it knows: still routed
        assert router.route_rtp(RtpPacket(payload_type=111, ssrc=ssrc)) is receiver
