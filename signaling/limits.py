"""The server's rate limiters: new sessions and speech requests, per client address."""

from __future__ import annotations

import math

from agent.config import LimitSettings
from agent.ratelimit import RateLimiter
from signaling.errors import ApiError


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

    def check_speech(self, client: str | None) -> None:
        _check(self.speech, client, "too many speech requests from this address")


def _check(limiter: RateLimiter, client: str | None, message: str) -> None:
    # A client without an address (a Unix socket) shares one bucket: still limited.
    wait = limiter.take(client or "")
    if wait > 0:
        retry = max(1, math.ceil(wait))
        raise ApiError(
            429, "rate_limited", f"{message}; retry in {retry} s", {"Retry-After": str(retry)}
        )
