"""What a hostile or careless peer may send, and what it must not achieve: a listener's
microphone heard, one malformed RTP packet ending a call, candidate lines that put errors in
the log or get past the candidate limit (each found by review)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import jwt
import pytest

from agent.config import Config, SecuritySettings
from agent.conversation_config import ListenSettings, ServiceSettings
from tests.clips import SPEECH_WAV, read_wav
from tests.conftest import LiveServer, serve
from tests.doubles import ToneEngine
from tests.mic import ClipMic
from tests.rtc_client import RtcClient
from tests.services import FakeLLM, FakeSTT

pytestmark = pytest.mark.timeout(120)

SECRET = "test-secret-that-is-long-enough-0123456789"


def token(**claims: Any) -> str:
    return jwt.encode({"exp": int(time.time()) + 600, **claims}, SECRET, algorithm="HS256")


def bearer(value: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {value}"}


@pytest.fixture
async def talking_auth_server() -> AsyncIterator[tuple[LiveServer, FakeSTT, FakeLLM]]:
    stt, llm = FakeSTT(), FakeLLM()
    async with stt, llm:
        config = Config(
            host="127.0.0.1",
            security=SecuritySettings(auth_secret=SECRET),
            listen=ListenSettings(end_of_turn_silence_ms=500),
            services=ServiceSettings(
                stt_base_url=stt.url,
                llm_base_url=llm.url,
                llm_model="test-model",
                llm_timeout_s=2.0,
                stt_timeout_s=2.0,
            ),
        )
        async with serve(config, ToneEngine()) as server:
            yield server, stt, llm


async def test_a_listener_token_cannot_talk_to_the_agent_through_a_whep_microphone(
    talking_auth_server: tuple[LiveServer, FakeSTT, FakeLLM],
) -> None:
    """README: a ``listener`` token "may only receive" (no /offer, no say: 403). A 1:1 WHEP
    post whose audio section is sendrecv was listened to all the same: the listener's voice
    was transcribed, the LLM asked, the reply spoken, and its voice barged in on what a host
    made the agent say. Now its section is answered sendonly and nothing listens."""
    server, stt, llm = talking_auth_server
    samples, rate = read_wav(SPEECH_WAV)
    async with aiohttp.ClientSession() as http:
        client = RtcClient(server.url, http, token=token(role="listener"))
        client.mic = ClipMic()
        await client.connect(whep=True)
        answer = client.pc.remoteDescription.sdp
        assert "a=sendonly" in answer and "a=sendrecv" not in answer, answer
        url = f"{server.url}/sessions/{client.session_id}"
        try:
            deadline = time.monotonic() + 30
            while True:  # let the microphone run a moment (the VAD warms up)
                async with http.get(url, headers=bearer(token(role="listener"))) as resp:
                    stats = await resp.json()
                assert stats["role"] == "listener"
                inbound = stats.get("inbound")
                if inbound is None and time.monotonic() > deadline - 29:
                    break  # nobody listens to it: what a listener should get
                if inbound and inbound.get("ready") and inbound.get("windows", 0) > 5:
                    break
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.1)
            client.mic.play(samples, rate)
            await asyncio.sleep(samples.size / rate + 4)
        finally:
            await client.close()
    assert not stt.uploads and not llm.requests, (
        f"a listener's microphone: {len(stt.uploads)} STT upload(s), "
        f"{len(llm.requests)} LLM request(s) for a reply"
    )


async def test_a_bundle_group_naming_one_section_does_not_lift_the_candidate_limit(
    live_server: LiveServer,
) -> None:
    """Candidates were counted by distinct address as soon as *any* ``a=group:BUNDLE`` line
    was present, but aiortc bundles only the sections the group names: the sections below
    keep transports of their own, each adding the same 50 candidates. With ``a=group:BUNDLE
    0`` the offer was answered and aiortc added 100 (limit 64)."""
    from tests.test_http_errors import _same_candidates_in_every_section

    sdp = await _same_candidates_in_every_section(1, 50, bundle=False)
    sdp = sdp.replace("t=0 0\r\n", "t=0 0\r\na=group:BUNDLE 0\r\n", 1)
    assert sdp.count("a=group:BUNDLE") == 1 and sdp.count("a=candidate:") == 100
    await _refused_adding_no_candidate(live_server, sdp)


async def test_one_rtp_packet_with_a_short_audio_level_extension_does_not_end_the_call(
    live_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """aiortc's RtpPacket.parse unpacks the ssrc-audio-level header extension with
    ``unpack("!B", value)``: a 2-byte value raised struct.error out of the DTLS transport's
    receive loop (it catches only ValueError), which ended, closing the peer connection with
    a traceback in the log: one packet ended a call (found by review; the REMB side of the
    same hole was closed earlier). signaling/ssrcguard.py drops such a packet now."""
    import re
    import struct

    from signaling.keys import SESSIONS

    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        client.mic = ClipMic()
        await client.connect()
        try:
            peer = live_server.app[SESSIONS].get(client.session_id)
            async with asyncio.timeout(10):
                while peer.pc.connectionState != "connected":
                    await asyncio.sleep(0.05)
            answer = client.pc.remoteDescription.sdp
            ext_id = int(
                re.search(
                    r"a=extmap:(\d+) urn:ietf:params:rtp-hdrext:ssrc-audio-level", answer
                ).group(1)
            )
            sender = client.pc.getTransceivers()[0].sender
            # V=2, X=1, PT 96 (whatever), seq, ts, ssrc; one-byte extension block 0xBEDE of one
            # word: element id/len=1 (2 bytes of value) + 1 padding byte.
            header = struct.pack(
                "!BBHLL", 0x90, 96, 1, 0, (sender._ssrc + 1) % 2**32
            )  # fresh SRTP state
            ext = struct.pack("!HH", 0xBEDE, 1) + bytes([(ext_id << 4) | 1, 0x10, 0x20, 0])
            await sender.transport._send_rtp(header + ext + b"\x00" * 20)
            await asyncio.sleep(1.0)
            state = peer.pc.connectionState
            transport = peer.pc.getTransceivers()[0].receiver.transport
            malformed = transport._rtp_header_extensions_map.malformed
        finally:
            await client.close()
    logged = [
        f"{r.levelname} {r.name}: {r.getMessage()[-60:]!r}"
        for r in caplog.records
        if r.levelno >= 30
    ]
    assert state == "connected", f"one RTP packet took the call to {state!r}; logged {logged}"
    assert malformed == 1  # dropped by the guard, counted
    assert any(line.startswith("WARNING signaling.ssrcguard") for line in logged), logged


async def test_a_candidate_port_out_of_range_is_refused_not_an_error_in_the_log(
    live_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A host candidate on UDP port 70000 was answered 200; once ICE started aioice's STUN
    check there raised OverflowError in ``sendto``, and asyncio logged ERROR "Fatal write
    error on datagram transport" (closing the session's ICE socket) plus "Exception in
    callback Transaction.__retry()", tracebacks included: any client could write errors
    into the log at will. Now a 400."""
    import logging

    from tests.test_fuzz import BASE_OFFER

    caplog.set_level(logging.WARNING)
    good = "192.0.2.2 43000 typ host"
    assert good in BASE_OFFER
    sdp = BASE_OFFER.replace(good, "192.0.2.2 70000 typ host", 1)
    async with aiohttp.ClientSession() as http:
        async with http.post(
            live_server.url + "/offer", json={"type": "offer", "sdp": sdp}
        ) as resp:
            status = resp.status
        await asyncio.sleep(2.0)  # aioice's first checks
    errors = [
        f"{r.name}: {r.getMessage().splitlines()[0]}"
        for r in caplog.records
        if r.levelno >= logging.ERROR
    ]
    assert status == 400 and not errors, f"answered {status}, then logged {errors}"


@pytest.mark.parametrize("separator", ["\u2028", "\x0c", "\r"])
async def test_lines_joined_as_aiortc_reads_them_still_get_opus_first(
    live_server: LiveServer, separator: str
) -> None:
    """aiortc splits SDP with str.splitlines (\\u2028, \\x0c, a lone \\r end a line), the
    rewrites that put Opus first split on \\r\\n: an offer listing PCMU first whose lines were
    joined so got past them, and was answered PCMU first, with Opus bytes sent under it
    (found by review)."""
    from tests.test_shutdown import an_offer

    sdp = (await an_offer()).replace(" 96 9 0 8\r\n", " 0 96 9 8\r\n", 1)
    pcmu = "a=rtpmap:0 PCMU/8000\r\n"
    assert " 0 96 9 8\r\n" in sdp and pcmu in sdp
    sdp = sdp.replace(pcmu, "").replace("a=rtpmap:96 opus", pcmu + "a=rtpmap:96 opus", 1)
    sdp = sdp.replace("\r\n", separator)
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/offer", json={"type": "offer", "sdp": sdp}) as resp,
    ):
        assert resp.status == 200, await resp.text()
        answer = (await resp.json())["sdp"]
    m_line = next(line for line in answer.splitlines() if line.startswith("m=audio"))
    first = m_line.split()[3]
    assert f"a=rtpmap:{first} opus/48000/2" in answer, (m_line, answer)


def _second_bundle_group(sdp: str) -> str:
    """aiortc bundles only the FIRST session-level BUNDLE group (rtcpeerconnection.py:
    ``next(x for x in description.group if x.semantic == "BUNDLE")``)."""
    return sdp.replace("t=0 0\r\n", "t=0 0\r\na=group:BUNDLE 0\r\na=group:BUNDLE 1 2\r\n", 1)


def _media_level_bundle_group(sdp: str) -> str:
    """A group line inside a media section: aiortc reads groups at session level only."""
    return sdp.replace("a=mid:0\r\n", "a=mid:0\r\na=group:BUNDLE 0 1 2\r\n", 1)


def _second_audio_as_video(sdp: str) -> str:
    """Sections audio (mid 0), video (mid 1), data (mid 2). aiortc's default bundle policy
    (BALANCED) gives each *kind* one transport whatever the offer says, so only sections of
    different kinds can add candidates again."""
    head, *sections = sdp.split("\r\nm=")
    lines = sections[1].split("\r\n")
    kept = [
        line
        for line in lines[1:]
        if not line.startswith(("a=rtpmap:", "a=fmtp:", "a=rtcp-fb:", "a=extmap:", "a=ssrc"))
    ]
    port = lines[0].split()[1]
    sections[1] = "\r\n".join(
        [f"video {port} UDP/TLS/RTP/SAVPF 97", "a=rtpmap:97 VP8/90000", *kept]
    )
    return "\r\nm=".join([head, *sections])


@pytest.mark.parametrize("rewrite", [_second_bundle_group, _media_level_bundle_group])
async def test_bundle_groups_aiortc_ignores_do_not_lift_the_candidate_limit(
    live_server: LiveServer, rewrite: Any
) -> None:
    """The mids of *every* ``a=group:BUNDLE`` line (any group, any level) were counted as
    one shared transport; aiortc bundles only the first session-level group. The video and
    data sections keep transports of their own and each added its 30 candidates: 90 added
    (limit 64) (found by review)."""
    from tests.test_http_errors import _same_candidates_in_every_section

    sdp = rewrite(
        _second_audio_as_video(await _same_candidates_in_every_section(2, 30, bundle=False))
    )
    assert sdp.count("a=candidate:") == 90 and "m=video" in sdp
    await _refused_adding_no_candidate(live_server, sdp)


async def _refused_adding_no_candidate(live_server: LiveServer, sdp: str) -> None:
    """The offer is refused (400) and aiortc was given none of its candidates."""
    from signaling.keys import SESSIONS
    from signaling.sdp import MAX_CANDIDATES

    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/offer", json={"type": "offer", "sdp": sdp}) as resp,
    ):
        text = await resp.text()
    added = sum(
        len(transport._connection.remote_candidates)
        for peer in live_server.app[SESSIONS].peers()
        for transport in peer.pc._RTCPeerConnection__iceTransports  # type: ignore[attr-defined]
    )
    assert resp.status == 400 and added == 0, (
        f"answered {resp.status}; aiortc added {added} remote candidates "
        f"(limit {MAX_CANDIDATES}): {text[:80]}"
    )
