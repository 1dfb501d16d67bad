"""Rate limits per client address and admission control, through the real server.

The refill rates here are tiny (one token per 1000 s), so no bucket refills during a test:
what is refused does not depend on timing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import aiohttp
import pytest

from agent.config import Config, LimitSettings, SecuritySettings
from agent.ratelimit import RateLimiter
from signaling.auth import mint_token
from signaling.keys import SESSIONS
from tests.conftest import LiveServer
from tests.rtc_client import RtcClient

SLOW = 0.001  # tokens per second: 1000 s until the next one
BAD_OFFER = {"type": "offer", "sdp": "hello"}  # refused (400) after the rate check


async def _error(resp: aiohttp.ClientResponse) -> dict[str, str]:
    assert resp.content_type == "application/json"
    error: dict[str, str] = (await resp.json())["error"]
    return error


def limited_config(**limits: Any) -> Config:
    settings = {"offer_rate": SLOW, "speech_rate": SLOW, **limits}
    return Config(host="127.0.0.1", limits=LimitSettings(**settings))


class TestOfferRate:
    @pytest.fixture
    def server_config(self) -> Config:
        return limited_config(offer_burst=3)

    async def test_offers_beyond_the_burst_get_429_with_retry_after(
        self, live_server: LiveServer
    ) -> None:
        async with aiohttp.ClientSession() as http:
            # Refused offers count too: the limit is on attempts, not on sessions.
            for _ in range(2):
                async with http.post(live_server.url + "/offer", json=BAD_OFFER) as resp:
                    assert resp.status == 400
            client = RtcClient(live_server.url, http)
            await client.connect(whep=True)  # WHEP takes from the same bucket
            try:
                async with http.post(live_server.url + "/offer", json=BAD_OFFER) as resp:
                    assert resp.status == 429
                    assert resp.headers["Retry-After"] == "1000"  # ceil(1 / 0.001 per s)
                    error = await _error(resp)
                    assert error["code"] == "rate_limited" and "1000 s" in error["message"]
                async with http.post(
                    live_server.url + "/whep",
                    data="v=0",
                    headers={"Content-Type": "application/sdp"},
                ) as resp:
                    assert resp.status == 429
                    assert (await _error(resp))["code"] == "rate_limited"
                # Other requests, and the open session, are not limited.
                async with http.get(live_server.url + "/healthz") as resp:
                    assert resp.status == 200
                async with http.post(
                    f"{live_server.url}/sessions/{client.session_id}/say", json={"text": "hi"}
                ) as resp:
                    assert resp.status == 202
            finally:
                await client.close()


class TestOfferRateWithTokens:
    SECRET = "s" * 32

    @pytest.fixture
    def server_config(self) -> Config:
        config = limited_config(offer_burst=2)
        return dataclasses.replace(config, security=SecuritySettings(auth_secret=self.SECRET))

    async def test_an_offer_for_another_room_than_the_tokens_uses_up_no_offer(
        self, live_server: LiveServer
    ) -> None:
        """The rate was taken before the body named the room: a token bound to room "blue"
        asking for "red" got 403, and used up an offer all the same (found by review; README
        promises that an offer refused 401 or 403 uses up none). The place is given back."""
        blue = {"Authorization": f"Bearer {mint_token(self.SECRET, ttl_s=60, room='blue')}"}
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(
                    live_server.url + "/offer", json={**BAD_OFFER, "room": "red"}, headers=blue
                ) as resp:
                    assert (resp.status, (await _error(resp))["code"]) == (403, "forbidden")
                async with http.post(
                    live_server.url + "/whep?room=red",
                    data="v=0",
                    headers={**blue, "Content-Type": "application/sdp"},
                ) as resp:
                    assert (resp.status, (await _error(resp))["code"]) == (403, "forbidden")
            codes = []
            for _ in range(3):  # the whole burst is still there: two, then 429
                async with http.post(live_server.url + "/offer", json=BAD_OFFER, headers=blue) as r:
                    codes.append((r.status, (await _error(r))["code"]))
        assert codes == [(400, "bad_sdp")] * 2 + [(429, "rate_limited")], codes


def test_a_token_given_back_never_fills_a_bucket_beyond_its_burst() -> None:
    clock = FakeClock()
    limiter = RateLimiter(SLOW, 2, clock=clock)
    limiter.give_back("a")  # no bucket yet: nothing to give back, nothing made
    assert len(limiter) == 0
    assert limiter.take("a") == 0.0
    limiter.give_back("a")
    limiter.give_back("a")  # one more than was taken: still two at most
    assert limiter.take("a") == 0.0 and limiter.take("a") == 0.0
    assert limiter.take("a") > 0


class TestSpeechRate:
    @pytest.fixture
    def server_config(self) -> Config:
        return limited_config(speech_burst=4)

    async def test_speech_requests_share_one_limit_and_the_session_lives_on(
        self, live_server: LiveServer
    ) -> None:
        async with aiohttp.ClientSession() as http:
            client = RtcClient(live_server.url, http)
            await client.connect()
            say_url = f"{live_server.url}/sessions/{client.session_id}/say"
            try:
                # A text stream costs one request, however many deltas it has (1 of 4).
                client.send({"type": "text.delta", "delta": "Hello", "id": "s"})
                for _ in range(10):
                    client.send({"type": "text.delta", "delta": " word", "id": "s"})
                client.send({"type": "text.end"})
                client.send({"type": "say", "text": "one", "id": "a"})  # 2
                # Messages that start no speech are not limited: this error marks "handled"
                # (the channel and HTTP are not ordered with each other).
                marker = {"type": "config", "speed": -1}
                client.send(marker)
                await client.wait_event(lambda e: e.get("code") == "bad_config")
                async with http.post(say_url, json={"text": "two", "id": "h"}) as resp:  # 3
                    assert resp.status == 202
                client.send({"type": "chat", "text": "three"})  # 4
                # The bucket is empty now.
                client.send({"type": "say", "text": "four", "id": "b"})
                client.send({"type": "text.delta", "delta": "five", "id": "c"})
                client.send({"type": "chat", "text": "six"})
                client.send(marker)
                await client.wait_event(
                    lambda e: len([x for x in client.events if x.get("code") == "bad_config"]) == 2
                )
                async with http.post(say_url, json={"text": "seven"}) as resp:
                    assert resp.status == 429
                    assert int(resp.headers["Retry-After"]) >= 1
                    assert (await _error(resp))["code"] == "rate_limited"
                limited = [e for e in client.events if e.get("code") == "rate_limited"]
                assert [e.get("id") for e in limited] == ["b", "c", None], limited
                assert all("retry in" in e["message"] for e in limited)
                # Everything admitted is spoken to its end.
                await client.wait_event(
                    lambda e: len([x for x in client.events if x["type"] == "speech.ended"]) == 4,
                    timeout=20,
                )
                ended = [e for e in client.events if e["type"] == "speech.ended"]
                assert {"s", "a", "h"} <= {e["id"] for e in ended}
                assert not any(e["interrupted"] for e in ended)
            finally:
                await client.close()


class TestAdmission:
    @pytest.fixture
    def server_config(self) -> Config:
        return Config(host="127.0.0.1", limits=LimitSettings(max_sessions=1))

    async def test_a_full_server_refuses_offers_before_any_peer_connection(
        self, live_server: LiveServer, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import signaling.sessions

        created: list[object] = []
        real = signaling.sessions.RTCPeerConnection

        def counting(*args: Any, **kwargs: Any) -> Any:
            pc = real(*args, **kwargs)
            created.append(pc)
            return pc

        monkeypatch.setattr(signaling.sessions, "RTCPeerConnection", counting)
        async with aiohttp.ClientSession() as http:
            first = RtcClient(live_server.url, http)
            await first.connect()
            assert len(created) == 1
            try:
                async with http.post(live_server.url + "/offer", json=BAD_OFFER) as resp:
                    assert resp.status == 503
                    assert resp.headers["Retry-After"].isdigit()
                    error = await _error(resp)
                    assert error["code"] == "server_full" and "1 sessions" in error["message"]
                async with http.post(
                    live_server.url + "/whep",
                    data="v=0",
                    headers={"Content-Type": "application/sdp"},
                ) as resp:
                    assert resp.status == 503
                    assert (await _error(resp))["code"] == "server_full"
                assert len(created) == 1
            finally:
                async with http.delete(f"{live_server.url}/sessions/{first.session_id}") as r:
                    assert r.status == 204
                await first.close()
            # A closed session frees its place.
            again = RtcClient(live_server.url, http)
            await again.connect(whep=True)
            await again.close()

    async def test_offers_being_answered_count_against_the_maximum(
        self, live_server: LiveServer
    ) -> None:
        """Two offers at once for one free place: one is answered, one is refused."""
        async with aiohttp.ClientSession() as http:
            clients = [RtcClient(live_server.url, http) for _ in range(2)]
            results = await asyncio.gather(
                *(c.connect(whep=True) for c in clients), return_exceptions=True
            )
            try:
                refused = [r for r in results if isinstance(r, AssertionError)]
                assert len(refused) == 1 and "server_full" in str(refused[0]), results
                assert len(live_server.app[SESSIONS]) == 1
            finally:
                for client in clients:
                    await client.close()


# The limiter's bookkeeping, on a clock the test moves (no sleeping).
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_refills_at_its_rate() -> None:
    clock = FakeClock()
    limiter = RateLimiter(2.0, 3, clock=clock)
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a") == pytest.approx(0.5)
    assert limiter.take("b") == 0.0  # another client has its own bucket
    clock.now = 0.5
    assert limiter.take("a") == 0.0
    assert limiter.take("a") == pytest.approx(0.5)


def test_idle_buckets_are_dropped_and_the_table_is_capped() -> None:
    clock = FakeClock()
    limiter = RateLimiter(1.0, 2, max_keys=3, clock=clock)
    for key in ("a", "b", "c"):
        limiter.take(key)
        limiter.take(key)  # empty now
    assert len(limiter) == 3 and limiter.take("a") > 0
    limiter.take("d")  # over the cap: the least recently used ("b") goes
    assert len(limiter) == 3
    assert limiter.take("b") == 0.0  # "b" was forgotten: a fresh, full bucket
    assert limiter.take("a") > 0  # "a" was used recently: still remembered, still empty
    clock.now = 100.0  # every bucket has refilled: they all go on the next request
    limiter.take("e")
    assert len(limiter) == 1


def test_the_wait_shrinks_as_the_bucket_refills() -> None:
    """The wait returned is until one whole token is there, counting what has refilled."""
    clock = FakeClock()
    limiter = RateLimiter(1.0, 1, clock=clock)
    assert limiter.take("a") == 0.0
    clock.now = 0.75
    assert limiter.take("a") == pytest.approx(0.25)


def test_a_bucket_never_holds_more_than_its_burst() -> None:
    """However long a client was away, it gets ``burst`` requests at once, not more (its
    bucket may outlive the idle drop behind a less refilled one)."""
    clock = FakeClock()
    limiter = RateLimiter(1.0, 2, clock=clock)
    limiter.take("x")
    limiter.take("x")  # empty: it stays at the least recent end, not yet full
    limiter.take("a")  # one token left
    clock.now = 1.9  # "a" would hold 2.9 without the cap; "x" holds 1.9: nothing dropped
    assert [limiter.take("a") for _ in range(2)] == [0.0, 0.0]
    assert limiter.take("a") == pytest.approx(1.0)


def test_a_bucket_refilled_exactly_to_its_burst_is_dropped() -> None:
    clock = FakeClock()
    limiter = RateLimiter(1.0, 2, clock=clock)
    limiter.take("a")
    clock.now = 1.0  # exactly full again
    limiter.take("b")
    assert len(limiter) == 1


def test_retry_after_rounds_the_wait_up_to_whole_seconds() -> None:
    """A 429's Retry-After is the wait rounded up (at least 1 s): retrying after it works."""
    from signaling.errors import ApiError
    from signaling.limits import Limits

    limits = Limits(LimitSettings(offer_rate=0.4, offer_burst=1))
    limits.check_offer("198.51.100.7")
    with pytest.raises(ApiError) as refused:
        limits.check_offer("198.51.100.7")  # next token in 2.5 s
    assert refused.value.status == 429
    assert refused.value.headers == {"Retry-After": "3"}


def test_a_wait_under_a_second_is_still_refused() -> None:
    from signaling.errors import ApiError
    from signaling.limits import Limits

    limits = Limits(LimitSettings(speech_rate=4.0, speech_burst=1))
    limits.check_speech(None)
    with pytest.raises(ApiError) as refused:
        limits.check_speech(None)  # next token in 0.25 s
    assert refused.value.headers == {"Retry-After": "1"}


def test_an_ipv6_client_is_limited_by_its_64_prefix() -> None:
    """An IPv6 client holds a whole /64 (SLAAC, privacy addresses): keyed by its full
    address, every request from a fresh address in it got a fresh burst, so the limits
    held nobody back, and a few thousand addresses pushed every other client's bucket out
    of the table. The /64 is the client; IPv4 addresses stay one client each."""
    from signaling.errors import ApiError
    from signaling.limits import Limits

    limits = Limits(LimitSettings(offer_rate=SLOW, offer_burst=2, speech_rate=SLOW, speech_burst=2))
    limits.check_offer("2001:db8:1:2::1")
    limits.check_offer("2001:db8:1:2:abcd:ef01:2345:6789")
    with pytest.raises(ApiError) as refused:
        limits.check_offer("2001:db8:1:2::3")
    assert refused.value.code == "rate_limited"
    limits.check_offer("2001:db8:1:3::1")  # another /64: another client
    limits.check_offer("fe80::1%eth0")  # a scoped address does not break the key
    for address in ("198.51.100.1", "198.51.100.2", "::ffff:198.51.100.3"):
        limits.check_offer(address)  # IPv4 (mapped too): each address its own bucket
        limits.check_offer(address)
    # Speech requests over the data channel (a session's hook) count the same way.
    assert limits.admit_speech("2001:db8:9:9::1") == 0.0
    limits.check_speech("2001:db8:9:9::2")
    assert limits.admit_speech("2001:db8:9:9::3") > 0


def test_a_rate_of_nan_is_refused_not_unlimited() -> None:
    """A nan rate passed "rates must be positive" (every comparison with nan is false), and
    a nan bucket never runs dry: the limit was silently off."""
    for bad in (math.nan, math.inf, 0.0):
        with pytest.raises(ValueError):
            LimitSettings(offer_rate=bad)
        with pytest.raises(ValueError):
            LimitSettings(speech_rate=bad)
        with pytest.raises(ValueError):
            RateLimiter(bad, 2)
