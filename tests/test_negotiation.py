"""The browser's Opus parameters and transport-cc offer, honoured in the answer and the encoder."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import aiohttp
import pytest

from agent.session import AgentSession
from signaling.errors import ApiError
from signaling.keys import SESSIONS
from signaling.negotiation import TWCC_URI, read_opus_offer
from signaling.sdp import check_offer_sdp
from tests.conftest import LiveServer
from tests.mic import ClipMic
from tests.rtc_client import RtcClient, opus_fmtp_rewriter
from tests.test_fuzz import BASE_OFFER

# The audio section of a Chrome 156 offer (trimmed to what matters here).
CHROME_AUDIO = """v=0
o=- 1 2 IN IP4 127.0.0.1
s=-
t=0 0
m=audio 9 UDP/TLS/RTP/SAVPF 111 63 9 0 8
a=extmap:1 urn:ietf:params:rtp-hdrext:ssrc-audio-level
a=extmap:3 http://www.ietf.org/id/draft-holmer-rmcat-transport-wide-cc-extensions-01
a=extmap:4 urn:ietf:params:rtp-hdrext:sdes:mid
a=rtpmap:111 opus/48000/2
a=rtcp-fb:111 transport-cc
a=fmtp:111 minptime=10;useinbandfec=1;maxaveragebitrate=24000;stereo=1;maxplaybackrate=16000
a=rtpmap:63 red/48000/2
m=application 9 UDP/DTLS/SCTP webrtc-datachannel
"""


def test_reads_chrome_opus_parameters_and_transport_cc() -> None:
    offer = read_opus_offer(CHROME_AUDIO)
    assert offer.payload_type == 111
    assert offer.useinbandfec and offer.stereo
    assert offer.maxaveragebitrate == 24_000 and offer.maxplaybackrate == 16_000
    assert offer.minptime == 10
    assert offer.transport_cc_ext_id == 3 and offer.transport_cc


def test_absent_parameters_take_rfc7587_defaults() -> None:
    sdp = CHROME_AUDIO.replace(
        "a=fmtp:111 minptime=10;useinbandfec=1;maxaveragebitrate=24000;"
        "stereo=1;maxplaybackrate=16000\n",
        "",
    )
    sdp = sdp.replace("a=rtcp-fb:111 transport-cc\n", "")
    offer = read_opus_offer(sdp)
    assert not offer.useinbandfec  # absent = 0: the receiver would not decode FEC
    assert offer.maxaveragebitrate is None
    assert not offer.transport_cc  # the extension alone, without the feedback, is not enough


@pytest.mark.parametrize("fmtp", ["minptime=40", "maxptime=10"])
def test_packet_times_the_agent_cannot_send_are_refused(fmtp: str) -> None:
    sdp = CHROME_AUDIO.replace("minptime=10;", f"{fmtp};")
    with pytest.raises(ApiError) as caught:
        read_opus_offer(sdp)
    assert caught.value.status == 400 and caught.value.code == "unsupported_ptime"


def test_a_maxptime_attribute_under_20_ms_is_refused() -> None:
    """RFC 7587 section 7.1: maxptime goes in SDP as the ``a=maxptime`` attribute, not in
    the fmtp line (which is all that was read): an offer asking for packets of at most
    10 ms that way was answered, and sent 20 ms packets."""
    sdp = CHROME_AUDIO.replace("a=rtcp-fb:111", "a=maxptime:10\na=rtcp-fb:111")
    with pytest.raises(ApiError) as caught:
        read_opus_offer(sdp)
    assert caught.value.code == "unsupported_ptime" and "maxptime=10" in caught.value.message
    for allowed in ("a=maxptime:20", "a=maxptime:120", "a=maxptime:abc"):
        offer = read_opus_offer(CHROME_AUDIO.replace("a=rtcp-fb:111", f"{allowed}\na=rtcp-fb:111"))
        assert offer.maxptime in (20, 120, None)
    # Another section's attribute is not the agent's audio section's.
    other = CHROME_AUDIO.replace(
        "m=application", "m=audio 9 UDP/TLS/RTP/SAVPF 0\na=maxptime:10\nm=application"
    )
    assert read_opus_offer(other).maxptime is None


def _session(live_server: LiveServer, client: RtcClient) -> AgentSession:
    assert client.session_id is not None
    return live_server.app[SESSIONS].get(client.session_id).session


async def test_maxaveragebitrate_caps_the_encoder_and_fec_follows_useinbandfec(
    live_server: LiveServer,
) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        try:
            await client.connect(
                rewrite_offer=opus_fmtp_rewriter(
                    "useinbandfec=1;maxaveragebitrate=16000;maxplaybackrate=16000"
                )
            )
            session = _session(live_server, client)
            assert session.network.ceiling == 16_000
            assert session.track.encoder.bitrate == 16_000
            assert session.track.encoder.max_playback_rate == 16_000
            assert session.network.controller.fec_allowed
            answer = client.pc.remoteDescription.sdp
            assert "sprop-stereo=0" in answer and "stereo=0" in answer
            assert "transport-cc" not in answer  # not offered, not answered
            # Speech at the capped rate: 20 ms packets of at most ~16 kbps (40 bytes).
            client.send({"type": "say", "text": "one two three four five six", "id": "a"})
            await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=15)
            stats = session.stats()
            assert stats["speech_packets"] > 50
        finally:
            await client.close()


async def test_no_fec_for_a_receiver_that_did_not_offer_it(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        try:
            await client.connect()  # aiortc offers Opus with no fmtp: useinbandfec absent
            session = _session(live_server, client)
            assert not session.network.controller.fec_allowed
            assert session.track.encoder.bitrate == live_server.config.opus.bitrate
        finally:
            await client.close()


async def test_transport_cc_is_answered_when_offered(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        try:
            await client.connect(rewrite_offer=opus_fmtp_rewriter("useinbandfec=1", True))
            answer = client.pc.remoteDescription.sdp
            assert f"a=extmap:7 {TWCC_URI}" in answer
            assert re.search(r"a=rtcp-fb:\d+ transport-cc", answer)
            session = _session(live_server, client)
            assert session.network.tap is not None and session.network.tap.transport_cc
        finally:
            await client.close()


async def test_unsupported_ptime_is_a_json_400(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        try:
            client.pc.addTransceiver("audio", direction="recvonly")
            await client.pc.setLocalDescription(await client.pc.createOffer())
            sdp = opus_fmtp_rewriter("minptime=60")(client.pc.localDescription.sdp)
            async with http.post(
                live_server.url + "/offer", json={"type": "offer", "sdp": sdp}
            ) as resp:
                assert resp.status == 400
                body = await resp.json()
            assert body["error"]["code"] == "unsupported_ptime"
            assert len(live_server.app[SESSIONS]) == 0
        finally:
            await client.pc.close()


async def test_stats_event_about_once_a_second(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        try:
            await client.connect()
            first = await client.wait_event(lambda e: e["type"] == "stats", timeout=5)
            for key in ("bitrate", "fec", "expected_loss_pct", "loss", "rtt_ms", "packets"):
                assert key in first, first
            await client.wait_event(lambda e: e["type"] == "stats" and e is not first, 5)
            count = sum(1 for e in client.events if e["type"] == "stats")
            assert count >= 2
            # aiortc's client sends receiver reports every ~1 s: they reach the controller,
            # and once one answers our sender report they carry the round-trip time.
            report = await client.wait_event(
                lambda e: e["type"] == "stats" and e["rtt_ms"] is not None, timeout=10
            )
            assert report["receiver_reports"] > 0
            assert 0 <= report["rtt_ms"] < 1000
            assert report["bitrate"] == live_server.config.opus.bitrate  # clean: the top
        finally:
            await client.close()


@pytest.mark.parametrize("value", ["\u00b2", "9" * 5000, "-5", "12kbps"])
def test_malformed_numbers_are_ignored_not_a_crash(value: str) -> None:
    offer = read_opus_offer(
        CHROME_AUDIO.replace("maxaveragebitrate=24000", f"maxaveragebitrate={value}")
    )
    assert offer.maxaveragebitrate is None


def test_the_first_audio_section_is_the_one_read() -> None:
    """The agent's track goes on the first audio transceiver (aiortc's addTrack): its
    section's parameters are the receiver's, whatever a later section says."""
    later = "m=audio 9 UDP/TLS/RTP/SAVPF 111\na=recvonly\na=rtpmap:111 opus/48000/2\n"
    first = CHROME_AUDIO.replace("m=application", "a=sendonly\nm=application")
    assert read_opus_offer(first.replace("m=application", later + "m=application")).useinbandfec


def first_section(direction: str) -> Callable[[str], str]:
    """An offer rewriter: the first audio section's direction becomes ``direction``."""

    def rewrite(sdp: str) -> str:
        return sdp.replace("a=sendrecv", f"a={direction}", 1)

    return rewrite


@pytest.mark.parametrize("direction", ["sendonly", "inactive"])
async def test_an_offer_whose_first_audio_section_cannot_receive_is_refused(
    live_server: LiveServer, direction: str
) -> None:
    """The first audio section sends only, a later one (a room's slot) receives: it used to
    be answered 200 with the agent's track on the first (answered recvonly): silence."""
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        try:
            error = await client.connect(
                mic=ClipMic(), slots=1, rewrite_offer=first_section(direction), expect_status=400
            )
        finally:
            await client.close()
    assert error is not None and error["error"]["code"] == "no_audio"
    assert "first audio section" in error["error"]["message"]
    assert len(live_server.app[SESSIONS]) == 0


@pytest.mark.parametrize(
    ("second", "code"),
    [
        ("m=audio 0 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111 opus/48000/2\r\n", "no_audio"),
        ("m=audio 9 UDP/TLS/RTP/SAVPF 0\r\na=rtpmap:0 PCMU/8000\r\n", "no_opus"),
    ],
)
def test_the_first_audio_section_decides(second: str, code: str) -> None:
    """A rejected (port 0) or Opus-less first audio section is refused even when a later one
    would do: the agent's audio goes on the first."""
    good = "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111 opus/48000/2\r\n"
    with pytest.raises(ApiError) as refused:
        check_offer_sdp("v=0\r\n" + second + good, 8)
    assert (refused.value.status, refused.value.code) == (400, code)
    assert check_offer_sdp("v=0\r\n" + good + second, 8)  # a later one may be anything


# Media ids aiortc cannot bundle (found by tests/test_fuzz.py): a bundled section with no
# transport made setRemoteDescription raise, or, answered, its connect task died.
def _mid_variant(change: str) -> str:
    group, mid0, mid1 = "a=group:BUNDLE 0 1\r\n", "a=mid:0\r\n", "a=mid:1\r\n"
    return {
        "base": BASE_OFFER,
        "no_bundle": BASE_OFFER.replace(group, ""),
        "no_bundle_no_mids": BASE_OFFER.replace(group, "").replace(mid0, "").replace(mid1, ""),
        "bundle_reversed": BASE_OFFER.replace(group, "a=group:BUNDLE 1 0\r\n"),
        "bundle_partial": BASE_OFFER.replace(group, "a=group:BUNDLE 0\r\n"),
        "two_bundles": BASE_OFFER.replace(group, "a=group:BUNDLE 0\r\na=group:BUNDLE 1\r\n"),
        "same_mid_twice": BASE_OFFER.replace(mid1, mid0),
        "two_mids_in_a_section": BASE_OFFER.replace(mid0, mid0 + "a=mid:5\r\n"),
        "bundle_names_no_section": BASE_OFFER.replace(group, "a=group:BUNDLE 7\r\n"),
        "bundle_first_unknown": BASE_OFFER.replace(group, "a=group:BUNDLE 7 0 1\r\n"),
        "mid_not_in_bundle": BASE_OFFER.replace(mid0, "a=mid:x\r\n"),
    }[change]


@pytest.mark.parametrize(
    "change",
    ["base", "no_bundle", "no_bundle_no_mids", "bundle_reversed", "bundle_partial", "two_bundles"],
)
def test_offers_whose_mids_aiortc_can_bundle_pass(change: str) -> None:
    assert check_offer_sdp(_mid_variant(change), 8)


@pytest.mark.parametrize(
    "change",
    [
        "same_mid_twice",
        "two_mids_in_a_section",
        "bundle_names_no_section",
        "bundle_first_unknown",
        "mid_not_in_bundle",
    ],
)
def test_offers_whose_mids_aiortc_cannot_bundle_are_refused(change: str) -> None:
    with pytest.raises(ApiError) as refused:
        check_offer_sdp(_mid_variant(change), 8)
    assert (refused.value.status, refused.value.code) == (400, "bad_sdp")


@pytest.mark.parametrize("change", ["same_mid_twice", "bundle_names_no_section"])
async def test_an_offer_aiortc_would_answer_and_then_fail_is_a_400(
    live_server: LiveServer, change: str, caplog: pytest.LogCaptureFixture
) -> None:
    """These two were answered 200: the session's connect task then died in the background
    (asyncio logged "Task exception was never retrieved"), and it never connected."""
    offer = {"type": "offer", "sdp": _mid_variant(change)}
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/offer", json=offer) as response,
    ):
        assert response.status == 400
        assert (await response.json())["error"]["code"] == "bad_sdp"
    await asyncio.sleep(0.3)  # a connect task would have run and died by now
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert len(live_server.app[SESSIONS]) == 0


async def _post_offer(live_server: LiveServer, sdp: str) -> tuple[int, dict]:
    """The status and JSON body of an offer (its session, if any, closed at once)."""
    offer = {"type": "offer", "sdp": sdp}
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/offer", json=offer) as r,
    ):
        body = await r.json()
        if r.status == 200:
            async with http.delete(live_server.url + "/sessions/" + body["session_id"]):
                pass
        return r.status, body


async def test_an_offer_without_bundle_is_not_answered_with_a_bundle_group(
    live_server: LiveServer,
) -> None:
    """RFC 8843 section 7.3: an answerer must not add a BUNDLE group the offer does not
    have. aiortc's createAnswer bundles every section whatever the offer said, while the
    server itself gave each section its own transport (different ports in the answer):
    the answer claimed a bundle that the server did not do (found by review)."""
    offer = BASE_OFFER.replace("a=group:BUNDLE 0 1\r\n", "")
    status, body = await _post_offer(live_server, offer)
    assert status == 200, body
    answer = body["sdp"]
    ports = re.findall(r"^m=\S+ (\d+) ", answer, re.M)
    assert len(set(ports)) == 2  # not bundled: a transport (and port) per section
    assert "a=group:BUNDLE" not in answer, re.findall(r"^a=group:.*$", answer, re.M)


async def test_an_offer_bundling_only_its_audio_is_answered_with_that_group(
    live_server: LiveServer,
) -> None:
    """The same with a partial group: the offer bundles mid 0 alone (the data channel on a
    transport of its own); the answer must not put mid 1 in the group."""
    offer = BASE_OFFER.replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 0")
    status, body = await _post_offer(live_server, offer)
    assert status == 200, body
    groups = re.findall(r"^a=group:BUNDLE(.*)$", body["sdp"], re.M)
    assert [g.split() for g in groups] == [["0"]], groups


async def test_opus_left_out_of_the_m_line_is_not_offered(live_server: LiveServer) -> None:
    """An m-line lists the payload types the offerer takes; an a=rtpmap for one it does not
    list (SDP munged to drop Opus, leaving its rtpmap) is no offer of it. The offer's first
    audio section offers G722/PCMU/PCMA only: 400 no_opus (README), not a 200 whose answer
    sends Opus under payload type 96, which the client never offered."""
    offer = BASE_OFFER.replace("UDP/TLS/RTP/SAVPF 96 9 0 8", "UDP/TLS/RTP/SAVPF 9 0 8")
    status, body = await _post_offer(live_server, offer)
    assert status == 400 and body["error"]["code"] == "no_opus", (
        status,
        re.findall(r"^m=audio.*$", body.get("sdp", ""), re.M),
    )


async def test_without_bundle_the_call_connects(live_server: LiveServer) -> None:
    """End to end: an aiortc client whose offer reaches the server without a BUNDLE group.
    The answer's group makes the client bundle its data channel onto the audio transport,
    where the server (which did not bundle) did not listen for it: it never opened."""
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        try:
            await client.connect(
                rewrite_offer=lambda sdp: re.sub(r"a=group:BUNDLE[^\r\n]*\r\n", "", sdp)
            )
        finally:
            await client.close()


async def test_opus_on_a_low_dynamic_payload_type_keeps_it_in_the_answer(
    live_server: LiveServer,
) -> None:
    """With rtcp-mux, 35-63 are dynamic payload types too (RFC 5761 section 4; libwebrtc
    allocates there once 96-127 run out). aiortc keeps an offered payload type only in
    96-127: an offer with Opus on 63 gets an answer (and packets) with Opus on 96, a payload
    type the offer never listed, which the client cannot decode (JSEP 5.3.1: the answer
    uses the offer's payload types)."""
    offer = BASE_OFFER.replace("SAVPF 96 9 0 8", "SAVPF 63 9 0 8").replace(
        "a=rtpmap:96 opus", "a=rtpmap:63 opus"
    )
    status, body = await _post_offer(live_server, offer)
    assert status == 200, body
    mline = re.findall(r"^m=audio.*$", body["sdp"], re.M)[0].split()
    rtpmap = re.findall(r"^a=rtpmap:(\d+) opus/48000/2", body["sdp"], re.M)
    assert rtpmap == ["63"] and "96" not in mline[3:], (mline, rtpmap)


SESSION_LEVEL = "a=msid-semantic:WMS *\r\n"


async def test_a_session_level_inactive_first_audio_is_refused(live_server: LiveServer) -> None:
    """RFC 4566 section 6: a direction attribute at session level applies to every media
    section that states none. Such an offer's audio section is inactive: README says 400
    no_audio (it must accept audio from the agent); it was answered 200, sendrecv."""
    offer = BASE_OFFER.replace("a=recvonly\r\n", "").replace(
        SESSION_LEVEL, SESSION_LEVEL + "a=inactive\r\n"
    )
    status, body = await _post_offer(live_server, offer)
    assert status == 400 and body["error"]["code"] == "no_audio", (
        status,
        re.findall(r"^a=(?:sendrecv|sendonly|recvonly|inactive)\r?$", body.get("sdp", ""), re.M),
    )


async def test_a_session_level_recvonly_audio_is_answered_sendonly(
    live_server: LiveServer,
) -> None:
    """The same with ``a=recvonly`` at session level (a listen-only WHEP offer): the answer
    must be sendonly (RFC 3264 section 6.1), not sendrecv."""
    offer = BASE_OFFER.replace("a=recvonly\r\n", "").replace(
        SESSION_LEVEL, SESSION_LEVEL + "a=recvonly\r\n"
    )
    status, body = await _post_offer(live_server, offer)
    assert status == 200, body
    audio = body["sdp"].split("m=audio", 1)[1].split("m=application", 1)[0]
    directions = re.findall(r"^a=(sendrecv|sendonly|recvonly|inactive)\r?$", audio, re.M)
    assert directions == ["sendonly"], directions
