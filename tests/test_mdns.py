"""Offers whose host candidates are hidden behind unresolvable mDNS names still connect."""

from __future__ import annotations

import asyncio
import re
import uuid

import aiohttp

from signaling.sdp import MAX_CANDIDATES, _candidates_to_add, add_mdns_fallback, check_offer_sdp
from tests.conftest import LiveServer
from tests.rtc_client import RtcClient
from tests.test_fuzz import BASE_OFFER

CANDIDATE = "a=candidate:1 1 udp 2113937151 {addr} 54321 typ host generation 0"


def test_twins_use_the_http_peer_address() -> None:
    sdp = "v=0\r\n" + CANDIDATE.format(addr="abc-def.local") + "\r\n"
    out = add_mdns_fallback(sdp, "192.168.1.20", lambda: ["10.0.0.5"]).split("\r\n")
    assert out[1] == CANDIDATE.format(addr="abc-def.local")
    assert out[2] == "a=candidate:1m0 1 udp 2113937150 192.168.1.20 54321 typ host generation 0"
    assert out[-1] == ""


def test_a_local_browser_gets_twins_on_this_machines_addresses() -> None:
    sdp = "v=0\n" + CANDIDATE.format(addr="x.local") + "\n"
    lines = add_mdns_fallback(sdp, "127.0.0.1", lambda: ["10.0.0.5", "10.0.0.6"]).splitlines()
    assert [line.split()[4] for line in lines[1:]] == ["x.local", "10.0.0.5", "10.0.0.6"]


def test_twins_stay_within_the_offers_candidate_limit() -> None:
    """A legal offer's 64 mDNS candidates, on a server with 20 addresses, were given 1280
    twins: what the candidate limit keeps from aioice's quadratic adding. Twins count
    with the offer's own candidates (distinct addresses, as the limit counts them)."""

    def offer(count: int) -> str:
        return "v=0\r\n" + "".join(
            CANDIDATE.format(addr=f"h{i}.local").replace("54321", str(50_000 + i)) + "\r\n"
            for i in range(count)
        )

    def twins(sdp: str) -> list[str]:
        lines = add_mdns_fallback(sdp, "127.0.0.1", lambda: addresses).splitlines()
        return [line for line in lines if line.startswith("a=candidate:") and ".local" not in line]

    addresses = [f"10.0.0.{i}" for i in range(20)]
    assert twins(offer(MAX_CANDIDATES)) == []  # at the limit already: no room for one more
    made = twins(offer(MAX_CANDIDATES // 2))
    assert len(made) == MAX_CANDIDATES // 2  # the room left: the first candidate's 20, ...
    assert made[:20] == [
        f"a=candidate:1m{i} 1 udp {2113937150 - i} 10.0.0.{i} 50000 typ host generation 0"
        for i in range(20)
    ]


def test_a_candidate_repeated_in_every_section_gets_its_twin_in_each() -> None:
    """Browsers repeat the BUNDLE transport's candidates in each section: each copy gets
    the same twin, which is one address more, not one per section."""
    section = "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\n" + CANDIDATE.format(addr="x.local") + "\r\n"
    sdp = "v=0\r\n" + section * 20
    lines = add_mdns_fallback(sdp, "127.0.0.1", lambda: ["10.0.0.5"]).splitlines()
    assert sum(1 for line in lines if " 10.0.0.5 " in line) == 20


def test_plain_candidates_are_left_alone() -> None:
    sdp = "v=0\r\n" + CANDIDATE.format(addr="10.1.1.1") + "\r\n"
    assert add_mdns_fallback(sdp, "10.1.1.1", lambda: ["10.0.0.5"]) == sdp


def test_a_priority_that_is_not_ascii_digits_is_copied_not_parsed() -> None:
    """Superscript two passes str.isdigit() but not int(), and so do 5000 digits (Python's
    limit on digits): both were a 500. The twin keeps such a priority; aiortc refuses it."""
    for priority in ("\u00b2", "\u0663", "9" * 5000):
        candidate = f"a=candidate:1 1 udp {priority} x.local 54321 typ host"
        out = add_mdns_fallback(f"v=0\r\n{candidate}\r\n", "10.1.1.1", list).split("\r\n")
        assert out[2] == f"a=candidate:1m0 1 udp {priority} 10.1.1.1 54321 typ host"


async def test_an_offer_with_such_a_priority_is_a_400(live_server: LiveServer) -> None:
    sdp = (
        "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n"
        "a=rtpmap:111 opus/48000/2\r\na=candidate:1 1 udp \u00b2 abcd.local 5000 typ host\r\n"
    )
    async with (
        aiohttp.ClientSession() as http,
        http.post(live_server.url + "/offer", json={"type": "offer", "sdp": sdp}) as resp,
    ):
        assert resp.status == 400, await resp.text()
        assert (await resp.json())["error"]["code"] == "bad_sdp"


def hide_behind_mdns(sdp: str) -> str:
    """What Chrome and Firefox do: host addresses become random, unresolvable .local names."""
    return re.sub(
        r"(a=candidate:\S+ \d+ udp \d+ )(\S+)( \d+ typ host)",
        lambda m: f"{m[1]}{uuid.uuid4()}.local{m[3]}",
        sdp,
    )


async def test_mdns_only_offer_connects_and_hears_the_agent(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect(rewrite_offer=hide_behind_mdns)
        try:
            client.send({"type": "say", "text": "can you hear me", "id": "m"})
            await client.wait_event(lambda e: e["type"] == "speech.ended", timeout=15)
            await asyncio.sleep(0.2)
        finally:
            await client.close()
    assert client.pc.connectionState in ("connected", "closed")
    loud = [f for f in client.audio.frames if abs(f).max() > 0.2]
    assert len(loud) > 30  # ~0.75 s of the tone arrived


def test_opus_moves_to_the_front_of_the_audio_payloads() -> None:
    from signaling.sdp import opus_first

    sdp = (
        "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 0 8 111 9\r\na=rtpmap:0 PCMU/8000\r\n"
        "a=rtpmap:111 opus/48000/2\r\nm=video 9 UDP/TLS/RTP/SAVPF 96 111\r\n"
    )
    out = opus_first(sdp).split("\r\n")
    assert out[1] == "m=audio 9 UDP/TLS/RTP/SAVPF 111 0 8 9"
    assert out[2:4] == ["a=rtpmap:111 opus/48000/2", "a=rtpmap:0 PCMU/8000"]
    assert out[4] == "m=video 9 UDP/TLS/RTP/SAVPF 96 111"  # video untouched


def test_mdns_twins_of_an_unbundled_offer_stay_within_the_candidate_limit() -> None:
    """README: an offer with more than 64 ICE candidates to add is 400 (each section the
    BUNDLE group does not name adds its own). add_mdns_fallback says its twins count
    against that limit "as check_offer_sdp counts them", but it counts distinct addresses
    over the whole offer: in an offer without BUNDLE every section's copy of a twin is one
    more candidate for that section's own ICE transport. A legal offer (16 sections, the
    same 4 mDNS candidates in each: 64 to add) from a local reverse proxy, on a server
    with 20 addresses, was given 960 twins: 1024 candidates to add, 16 times the limit
    (found by review)."""
    head, rest = BASE_OFFER.replace("a=group:BUNDLE 0 1\r\n", "").split("m=audio", 1)
    audio = ("m=audio" + rest).split("m=application", 1)[0]
    audio = "".join(
        line + "\r\n" for line in audio.split("\r\n") if line and "candidate" not in line
    )
    mdns = "".join(
        f"a=candidate:{i} 1 udp 2113937151 host{i}.local {50000 + i} typ host\r\n" for i in range(4)
    )
    sections = [
        audio.replace("a=mid:0", f"a=mid:{n}").replace("a=ssrc:4176047882", f"a=ssrc:{n + 1}")
        + mdns
        for n in range(16)
    ]
    offer = check_offer_sdp(head + "".join(sections), max_sections=16)
    assert _candidates_to_add(offer.splitlines()) == MAX_CANDIDATES  # allowed as offered
    addresses = [f"10.0.0.{i}" for i in range(20)]
    with_twins = add_mdns_fallback(offer, "127.0.0.1", lambda: addresses)
    added = _candidates_to_add(with_twins.splitlines())
    assert added <= MAX_CANDIDATES, f"{added} candidates to add after the mDNS twins"
