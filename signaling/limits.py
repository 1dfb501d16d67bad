"""The server's rate limiters: new sessions and speech requests, per client address."""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterator
from contextlib import contextmanager

from agent.config import LimitSettings
from agent.ratelimit import RateLimiter
from signaling.errors import ApiError

# An IPv6 client is its /64: one host (SLAAC, privacy extensions) or one home network has a
# whole /64 to pick addresses from, so one bucket per address would hold nobody back.
IPV6_CLIENT_PREFIX = 64


def client_key(address: str | None) -> str:
    """The bucket key of a client address: an IPv4 address as it is (also one an IPv6
    socket shows mapped, ``::ffff:a.b.c.d``), an IPv6 address by its /64 prefix. Anything
    else (no address: a Unix socket) as it is; those without one share a bucket."""
    if not address:
        return ""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv4Address):
        return address
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    host_bits = 128 - IPV6_CLIENT_PREFIX
    # Through the integer: that drops a scope (fe80::1%eth0), which IPv6Network refuses.
    prefix = ipaddress.IPv6Address(int(ip) >> host_bits << host_bits)
    return f"{prefix}/{IPV6_CLIENT_PREFIX}"


class Limits:
    def __init__(self, settings: LimitSettings) -> None:
        self.offers = RateLimiter(
            settings.offer_rate, settings.offer_burst, max_keys=settings.max_clients
        )
        self.speech = RateLimiter(
            settings.speech_rate, settings.speech_burst, max_keys=settings.max_clients
        )

    def check_offer(self, client: str | None) -> None:
        _check(self.offers, client, "too many new sessions from this address")

    @contextmanager
    def offer(self, client: str | None) -> Iterator[None]:
        """An offer's place in the rate (429 when there is none), given back if the offer
        is then refused 401 or 403: one the token does not allow (another room's, or a
        session that is not the token's) is not a new session and must not use up the
        client's offers, however late it is found out (the room is in the body)."""
        self.check_offer(client)
        try:
            yield
        except ApiError as refusal:
            if refusal.status in (401, 403):
                self.give_back_offer(client)
            raise

    def give_back_offer(self, client: str | None) -> None:
        self.offers.give_back(client_key(client))

    def check_speech(self, client: str | None) -> None:
        _check(self.speech, client, "too many speech requests from this address")

    def admit_speech(self, client: str | None) -> float:
        """A data-channel speech request's token: 0.0 if admitted, else seconds to wait."""
        return self.speech.take(client_key(client))


def _check(limiter: RateLimiter, client: str | None, message: str) -> None:
    # A client without an address (a Unix socket) shares one bucket: still limited.
    wait = limiter.take(client_key(client))
    if wait > 0:
        retry = max(1, math.ceil(wait))
        raise ApiError(
            429, "rate_limited", f"{message}; retry in {retry} s", {"Retry-After": str(retry)}
        )
