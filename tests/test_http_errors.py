"""Every error path of the HTTP API answers a JSON error body with a 4xx code."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
from aiortc import RTCPeerConnection

from agent.config import Config, RoomSettings
from tests.conftest import LiveServer, serve
from tests.doubles import ToneEngine

AUDIO_OFFER_HEAD = "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n"


async def _error(resp: aiohttp.ClientResponse) -> dict[str, str]:
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body["error"]) == {"code", "message"}
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        (b"{not json", 400, "bad_json"),
        (b"[1, 2]", 400, "bad_json"),
        (b'{"type": "answer", "sdp": "v=0"}', 400, "not_an_offer"),
        (b'{"type": "offer"}', 400, "bad_sdp"),
        (b'{"type": "offer", "sdp": 42}', 400, "bad_sdp"),
        (b'{"type": "offer", "sdp": "hello"}', 400, "bad_sdp"),
        (
            b'{"type": "offer", "sdp": "v=0\\r\\nm=video 9 UDP/TLS/RTP/SAVPF 96\\r\\n"}',
            400,
            "no_audio",
        ),
        (
            b'{"type": "offer", "sdp": "v=0\\r\\nm=audio 9 UDP/TLS/RTP/SAVPF 111\\r\\n'
            b'a=sendonly\\r\\n"}',
            400,
            "no_audio",
        ),
        (b'{"type": "offer", "sdp": "v=0\\r\\nm=audio 9 RTP/AVP 0\\r\\n"}', 400, "no_opus"),
        (  # opus, but no ICE credentials or DTLS fingerprint: aiortc cannot use it
            b'{"type": "offer", "sdp": "v=0\\r\\nm=audio 9 UDP/TLS/RTP/SAVPF 111\\r\\n'
            b'a=rtpmap:111 opus/48000/2\\r\\n"}',
            400,
            "bad_sdp",
        ),
        (b'{"type": "offer", "sdp": "v=0", "room": 7}', 400, "bad_room"),
        # A newline in a room name would let it pose as a log line of its own.
        (b'{"type": "offer", "sdp": "v=0", "room": "r\\n2026-01-01 FORGED"}', 400, "bad_room"),
        (b'{"type": "offer", "sdp": "v=0", "room": "r\\u0085"}', 400, "bad_room"),
        (
            b'{"type": "offer", "sdp": "v=0\\r\\nm=audio 9 UDP/TLS/RTP/SAVPF 0\\r\\n'
            b'a=rtpmap:0 PCMU/8000\\r\\n"}',
            400,
            "no_opus",
        ),
        (b"[" * 100_000, 400, "bad_json"),
    ],
)
async def test_offer_errors(
    live_server: LiveServer, payload: bytes, status: int, code: str
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            live_server.url + "/offer", data=payload, headers={"Content-Type": "application/json"}
        ) as resp,
    ):
        assert resp.status == status
        assert (await _error(resp))["code"] == code


@pytest.mark.parametrize("path", ["/offer", "/whep"])
async def test_an_offer_without_a_dtls_fingerprint_is_refused(
    live_server: LiveServer, path: str
) -> None:
    """Found by the fuzz suite: an offer whose ICE works but that has no a=fingerprint was
    answered 200, and aiortc's DTLS start asserted once ICE connected, in a task nobody
    awaited (a call that could never carry audio, and an unhandled error in the log)."""
    pc = RTCPeerConnection()
    try:
        pc.addTransceiver("audio", direction="recvonly")
        pc.createDataChannel("agent")
        await pc.setLocalDescription(await pc.createOffer())
        sdp = "".join(
            line
            for line in pc.localDescription.sdp.splitlines(keepends=True)
            if not line.startswith("a=fingerprint:")
        )
    finally:
        await pc.close()
    async with aiohttp.ClientSession() as http:
        if path == "/offer":
            request = http.post(live_server.url + path, json={"type": "offer", "sdp": sdp})
        else:
            headers = {"Content-Type": "application/sdp"}
            request = http.post(live_server.url + path, data=sdp, headers=headers)
        async with request as resp:
            assert resp.status == 400, await resp.text()
            error = await _error(resp)
    assert error["code"] == "bad_sdp" and "fingerprint" in error["message"], error


async def _sections_offer(audio_sections: int) -> str:
    pc = RTCPeerConnection()
    try:
        for _ in range(audio_sections):
            pc.addTransceiver("audio", direction="recvonly")
        pc.createDataChannel("agent")
        await pc.setLocalDescription(await pc.createOffer())
        return str(pc.localDescription.sdp)
    finally:
        await pc.close()


async def _join_room(url: str, sdp: str) -> tuple[int, dict[str, Any]]:
    body = {"type": "offer", "sdp": sdp, "room": "r"}
    async with aiohttp.ClientSession() as http, http.post(url + "/offer", json=body) as resp:
        answer = await resp.json()
        if resp.status == 200:
            async with http.delete(url + f"/sessions/{answer['session_id']}"):
                pass
        return resp.status, answer


async def test_an_offer_with_more_sections_than_a_call_uses_is_refused(
    live_server: LiveServer,
) -> None:
    """aiortc's parse and answer cost the event loop ~0.2 ms a media section: 80 sections,
    which fit in the 64 KiB limit, held every session's audio for 15 ms. An offer may have
    the agent's audio, a room's speaker slots (--room-max-speakers, 4) and the data channel,
    plus a few a client adds; more is refused. A room page's offer (1 + 4 + 1) passes."""

    async def offer(audio_sections: int) -> tuple[int, dict[str, Any]]:
        return await _join_room(live_server.url, await _sections_offer(audio_sections))

    status, answer = await offer(30)
    assert status == 400, answer
    assert (
        answer["error"]["code"] == "bad_sdp" and "31 media sections" in answer["error"]["message"]
    )
    status, answer = await offer(1 + 4)  # the room page's offer
    assert status == 200, answer
    # The edge (README: "more than 16 media sections"): 16 pass, 17 do not.
    status, answer = await offer(15)
    assert status == 200, answer
    status, answer = await offer(16)
    assert status == 400 and "17 media sections" in answer["error"]["message"], answer


@pytest.mark.parametrize("max_speakers", [0, 1])
async def test_the_room_pages_offer_joins_a_room_with_few_speaker_slots(
    max_speakers: int,
) -> None:
    """The room page offers 4 slots whatever the server's setting (found by review: a cap
    of --room-max-speakers + 4 refused its every join with 0 or 1); the extra slots are
    answered unused."""
    config = Config(host="127.0.0.1", port=0, rooms=RoomSettings(max_speakers=max_speakers))
    async with serve(config, ToneEngine()) as server:
        status, answer = await _join_room(server.url, await _sections_offer(1 + 4))
    assert status == 200, answer


NUL_CHARSET_JSON = "application/json; charset*=utf-8''utf%008"


@pytest.mark.parametrize(
    ("path", "content_type", "status", "code"),
    [
        # No such codec, or one that is not a text encoding: bytes.decode raises LookupError.
        ("/offer", "application/json; charset=no-such-codec", 415, "unsupported_media_type"),
        ("/offer", "application/json; charset=base64", 415, "unsupported_media_type"),
        ("/offer", "application/json; charset=undefined", 400, "bad_json"),  # decodes nothing
        ("/whep", "application/sdp; charset=no-such-codec", 415, "unsupported_media_type"),
        ("/whep", "application/sdp; charset=hex", 415, "unsupported_media_type"),
        ("/whep", "application/sdp; charset=undefined", 400, "bad_sdp"),
        # RFC 2231: aiohttp decodes this charset to "utf\x00", and codecs raise ValueError
        # on a NUL: it was 500 internal on WHEP, 400 bad_json on /offer.
        ("/offer", NUL_CHARSET_JSON, 415, "unsupported_media_type"),
        ("/whep", "application/sdp; charset*=utf-8''utf%008", 415, "unsupported_media_type"),
    ],
)
async def test_a_charset_python_cannot_decode_is_a_4xx(
    live_server: LiveServer, path: str, content_type: str, status: int, code: str
) -> None:
    body = b'{"type": "offer", "sdp": "v=0"}' if path == "/offer" else b"v=0\r\n"
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + path, data=body, headers={"Content-Type": content_type}) as r,
    ):
        assert r.status == status, await r.text()
        assert (await _error(r))["code"] == code


@pytest.mark.parametrize(
    ("path", "content_type"), [("/offer", "application/json"), ("/whep", "application/sdp")]
)
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_that_does_not_decompress_is_a_400(
    live_server: LiveServer, path: str, content_type: str, encoding: str
) -> None:
    """aiohttp decompresses a body by its Content-Encoding as it is read; bytes that are
    not in that encoding raised RequestPayloadError from the read: a 500 ``internal`` and
    an error traceback in the log for what the client sent."""
    headers = {"Content-Type": content_type, "Content-Encoding": encoding}
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + path, data=b"not compressed", headers=headers) as resp,
    ):
        assert resp.status == 400, await resp.text()
        assert (await _error(resp))["code"] == "bad_body"


@pytest.mark.parametrize(
    ("path", "status"), [("/sessions/nope/say", 404), ("/no/such/route", 404), ("/offer", 400)]
)
async def test_an_undecodable_body_leaves_no_error_in_the_log(
    live_server: LiveServer, path: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A body not in its Content-Encoding, refused before it was read (an unknown session,
    no such route) or read and refused (bad_body): aiohttp read the rest after the answer,
    to keep the connection, and the decoding error escaped its server loop as an ERROR
    "Unhandled exception" with a traceback, which any client could repeat at will (found by
    review). The connection now closes after the answer, and nothing is logged as an error."""
    caplog.set_level(logging.INFO)
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + path, data=b"not gzip" * 8, headers=headers) as resp,
    ):
        assert resp.status == status, await resp.text()
        assert (await _error(resp))["code"] in ("unknown_session", "not_found", "bad_body")
    await asyncio.sleep(0.3)  # aiohttp's read of the rest came after the answer
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


@pytest.mark.parametrize(
    ("path", "content_type"), [("/offer", "application/json"), ("/whep", "application/sdp")]
)
async def test_a_client_that_leaves_mid_body_is_no_server_error(
    live_server: LiveServer, path: str, content_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The read of a body whose client disconnected raised ConnectionResetError: logged as
    an unhandled error with its traceback, answered 500 (counted as an internal error)."""
    caplog.set_level(logging.INFO)
    host, port = live_server.url.removeprefix("http://").rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
        "Content-Length: 100\r\n\r\nv=0".encode()
    )
    await writer.drain()
    await asyncio.sleep(0.2)  # the handler is waiting for the rest of the body
    writer.close()

    def answered() -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "path", None) == path]

    async with asyncio.timeout(10):
        while not answered():
            await asyncio.sleep(0.02)
    assert [r.status for r in answered()] == [400]  # type: ignore[attr-defined]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_oversize_sdp_is_refused(live_server: LiveServer) -> None:
    sdp = AUDIO_OFFER_HEAD + "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\n" + "a=x\r\n" * 20_000
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/offer", json={"type": "offer", "sdp": sdp}) as resp,
    ):
        assert resp.status == 413
        await _error(resp)


async def test_whep_errors(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            live_server.url + "/whep", data="v=0", headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 415
            assert (await _error(resp))["code"] == "unsupported_media_type"
        async with http.post(
            live_server.url + "/whep",
            data="v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\n",
            headers={"Content-Type": "application/sdp"},
        ) as resp:
            assert resp.status == 400
            assert (await _error(resp))["code"] == "no_audio"
        async with http.post(
            live_server.url + "/whep?room=" + "r" * 65,
            data="v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111 opus/48000/2\r\n",
            headers={"Content-Type": "application/sdp"},
        ) as resp:
            assert resp.status == 400
            assert (await _error(resp))["code"] == "bad_room"
        async with http.delete(live_server.url + "/whep/nope") as resp:
            assert resp.status == 404
            assert (await _error(resp))["code"] == "unknown_session"


async def test_unknown_sessions(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.delete(live_server.url + "/sessions/abc") as resp:
            assert resp.status == 404
            assert (await _error(resp))["code"] == "unknown_session"
        async with http.post(live_server.url + "/sessions/abc/say", json={"text": "hi"}) as resp:
            assert resp.status == 404
            assert (await _error(resp))["code"] == "unknown_session"
        async with http.get(live_server.url + "/no/such/route") as resp:
            assert resp.status == 404
            assert (await _error(resp))["code"] == "not_found"
        async with http.get(live_server.url + "/offer") as resp:
            assert resp.status == 405
            assert (await _error(resp))["code"] == "method_not_allowed"


async def test_say_errors_on_a_live_session(live_server: LiveServer) -> None:
    from tests.rtc_client import RtcClient

    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        url = f"{live_server.url}/sessions/{client.session_id}/say"
        try:
            for body, code in [
                (b"nope", "bad_json"),
                (b'{"text": 5}', "bad_message"),
                (b'{"text": "   "}', "empty_text"),
                (('{"text": "' + "a" * 6000 + '"}').encode(), "text_too_long"),
                (b'{"text": "hi", "id": 12}', "bad_message"),
            ]:
                async with http.post(
                    url, data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    assert resp.status == 400, body
                    assert (await _error(resp))["code"] == code
            # An unusable charset is 415 here too, as on /offer and WHEP (one helper reads
            # every text body); the NUL one was 400 bad_json.
            for content_type in ("application/json; charset=no-such-codec", NUL_CHARSET_JSON):
                async with http.post(
                    url, data=b'{"text": "hi"}', headers={"Content-Type": content_type}
                ) as resp:
                    assert resp.status == 415, content_type
                    assert (await _error(resp))["code"] == "unsupported_media_type"
            async with http.post(url, json={"text": "still works"}) as resp:
                assert resp.status == 202
            async with http.delete(f"{live_server.url}/sessions/{client.session_id}") as resp:
                assert resp.status == 204
            async with http.post(url, json={"text": "gone"}) as resp:
                assert resp.status == 404
        finally:
            await client.close()


async def test_health_and_readiness(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(live_server.url + "/healthz") as resp:
            assert resp.status == 200
            assert (await resp.json())["status"] == "ok"
        async with http.get(live_server.url + "/readyz") as resp:
            assert resp.status == 200
            assert (await resp.json())["ready"] is True
        async with http.get(live_server.url + "/") as resp:
            assert resp.status == 200
            assert "text/html" in resp.content_type


async def test_not_ready_engine_refuses_offers(live_server: LiveServer) -> None:
    await live_server.engine.close()  # the double reports not ready, like a loading model
    async with aiohttp.ClientSession() as http:
        async with http.get(live_server.url + "/readyz") as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "not_ready"
            # As the offer's (README): a balancer may wait that long (missing, found by review).
            assert resp.headers["Retry-After"] == "5"
        sdp = AUDIO_OFFER_HEAD + "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111 opus/48000/2\r\n"
        async with http.post(
            live_server.url + "/offer", json={"type": "offer", "sdp": sdp}
        ) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"]
            assert (await _error(resp))["code"] == "not_ready"


async def test_ice_servers_for_the_browser(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http, http.get(live_server.url + "/ice-servers") as resp:
        assert resp.status == 200
        assert await resp.json() == {"iceServers": [], "roomSlots": 4}


async def test_an_offer_aiortc_cannot_answer_is_a_400_not_a_500(live_server: LiveServer) -> None:
    """Found by tests/test_fuzz.py: a BUNDLE offer whose audio section lost its a=mid makes
    aiortc fail to answer, and then fail again inside close(); the client gets the first."""
    from aiortc import RTCConfiguration, RTCPeerConnection

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    pc.createDataChannel("agent")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = "\r\n".join(line for line in pc.localDescription.sdp.split("\r\n") if line != "a=mid:0")
    await pc.close()
    body = {"type": "offer", "sdp": sdp}
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/offer", json=body) as r,
    ):
        assert r.status == 400, await r.text()
        assert (await r.json())["error"]["code"] == "bad_sdp"


TWCC_URI = "http://www.ietf.org/id/draft-holmer-rmcat-transport-wide-cc-extensions-01"


def _many_candidates(sdp: str, count: int) -> str:
    """The offer with exactly ``count`` host candidates (in place of its own)."""
    sdp = "".join(line for line in sdp.splitlines(True) if not line.startswith("a=candidate:"))
    lines = "".join(
        f"a=candidate:{i} 1 udp {2_000_000_000 - i} 127.0.{i >> 8}.{i & 255} {40_000 + i} "
        "typ host\r\n"
        for i in range(1, count + 1)
    )
    at = sdp.index("a=mid:")
    return sdp[:at] + lines + sdp[at:]


def _with_line(sdp: str, line: str) -> str:
    return sdp.replace("a=mid:0\r\n", f"a=mid:0\r\n{line}\r\n", 1)


@pytest.mark.parametrize(
    ("rewrite", "words"),
    [
        # ~1000 candidates fit in 64 KiB; aioice adds them quadratically on the event loop.
        (lambda sdp: _many_candidates(sdp, 65), "65 ICE candidates to add"),
        (
            lambda sdp: _with_line(sdp, "\r\n".join(f"a=ssrc:{i} cname:x" for i in range(256))),
            "at most 256",
        ),
        # Answered, then aiortc failed to pack the id into the first packet: never a sound.
        (lambda sdp: _with_line(sdp, f"a=extmap:300 {TWCC_URI}"), "'300' is not 1-255"),
        (lambda sdp: _with_line(sdp, f"a=extmap:0 {TWCC_URI}"), "'0' is not 1-255"),
        (lambda sdp: sdp.replace("a=mid:0", "a=mid:" + "m" * 256), "a=mid is limited"),
        # JSON may carry a lone surrogate; the answer echoing the mid could not be sent.
        (lambda sdp: sdp.replace("a=mid:0", "a=mid:\ud800"), "lone surrogates"),
    ],
    ids=["candidates", "ssrc-lines", "extmap-300", "extmap-0", "long-mid", "surrogate"],
)
async def test_an_offer_built_to_hurt_the_server_is_refused(
    live_server: LiveServer, rewrite: Any, words: str
) -> None:
    sdp = rewrite(await _sections_offer(1))
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/offer", json={"type": "offer", "sdp": sdp}) as resp,
    ):
        assert resp.status == 400, await resp.text()
        error = await _error(resp)
    assert error["code"] == "bad_sdp" and words in error["message"], error


async def test_the_most_candidates_a_browser_could_send_are_answered(
    live_server: LiveServer,
) -> None:
    """The limit leaves room: 64 candidates (and an extension id of 255) are answered."""
    sdp = _with_line(_many_candidates(await _sections_offer(1), 64), f"a=extmap:255 {TWCC_URI}")
    await _answered_then_deleted(live_server.url, sdp)


async def _answered_then_deleted(url: str, sdp: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/offer", json={"type": "offer", "sdp": sdp}) as r:
            assert r.status == 200, await r.text()
            session_id = (await r.json())["session_id"]
        async with http.delete(f"{url}/sessions/{session_id}") as r:
            assert r.status == 204


async def _same_candidates_in_every_section(
    audio_sections: int, count: int, *, bundle: bool
) -> str:
    """An offer whose every section lists the same ``count`` host candidates."""
    candidates = "".join(
        f"a=candidate:{i} 1 udp {2_000_000_000 - i} 127.0.0.1 {40_000 + i} typ host\r\n"
        for i in range(count)
    )
    dropped = ("a=candidate:",) if bundle else ("a=candidate:", "a=group:BUNDLE")
    lines = (await _sections_offer(audio_sections)).splitlines(True)
    lines = [line for line in lines if not line.startswith(dropped)]
    return "".join(line + candidates if line.startswith("a=mid:") else line for line in lines)


async def test_a_room_offer_repeating_its_candidates_in_every_section_is_answered(
    live_server: LiveServer,
) -> None:
    """Chromium lists the shared transport's candidates again in each section: a room page
    with many slots was refused for its sections times its candidates (e.g. 72 of 64)."""
    sdp = await _same_candidates_in_every_section(15, 5, bundle=True)  # + the data channel
    assert sdp.count("a=candidate:") == 80
    await _answered_then_deleted(live_server.url, sdp)


async def test_candidates_repeated_in_sections_without_bundle_count_each_time(
    live_server: LiveServer,
) -> None:
    """Without BUNDLE each section gets a transport of its own, which adds that section's
    candidates: the same 30 addresses in 3 sections are 90 to add, past the limit."""
    sdp = await _same_candidates_in_every_section(2, 30, bundle=False)  # + the data channel
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/offer", json={"type": "offer", "sdp": sdp}) as resp,
    ):
        assert resp.status == 400, await resp.text()
        error = await _error(resp)
    assert error["code"] == "bad_sdp" and "90 ICE candidates to add" in error["message"]


async def test_a_whep_body_that_decodes_to_a_lone_surrogate_is_a_400_and_leaves_no_session(
    live_server: LiveServer,
) -> None:
    """UTF-7 is a text codec Python knows: the body decoded to a lone surrogate in the mid,
    which the answer echoed and could not encode: a 500 after the session was registered
    (holding a place until the connect timeout)."""
    from signaling.keys import SESSIONS

    sdp = (await _sections_offer(1)).replace("a=mid:0", "a=mid:\ud800")
    headers = {"Content-Type": "application/sdp; charset=utf-7"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/whep", data=sdp.encode("utf-7"), headers=headers) as resp,
    ):
        assert resp.status == 400, await resp.text()
        assert (await _error(resp))["code"] == "bad_sdp"
    assert len(live_server.app[SESSIONS]) == 0
