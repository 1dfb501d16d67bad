"""Token-bucket rate limits per key (a client address), bounded in memory.

Each key has a bucket of ``burst`` tokens refilled at ``rate`` per second; a request takes
one token or is refused with the time until one is there. Buckets are kept in least
recently used order. A bucket that has refilled to ``burst`` is the same as no bucket, so
such idle buckets are dropped on every access (from the least recent end);
beyond ``max_keys`` the least recently used bucket is dropped even if not full, which
forgets that client's debt rather than letting many addresses grow the table.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < rate < math.inf or burst < 1 or max_keys < 1:  # nan: never runs dry
            raise ValueError("rate must be positive, burst and max_keys at least 1")
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> float:
        """Take one token for ``key``: 0.0 if allowed, else seconds until one is available."""
        now = self._clock()
        self._evict_idle(now)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(float(self.burst), now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            self._refill(bucket, now)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate

    def give_back(self, key: str) -> None:
        """Return the token a request took, when it turned out not to count (refused for
        its credentials): never beyond ``burst``."""
        bucket = self._buckets.get(key)
        if bucket is not None:
            self._refill(bucket, self._clock())
            bucket.tokens = min(float(self.burst), bucket.tokens + 1.0)

    def _refill(self, bucket: _Bucket, now: float) -> None:
        elapsed = max(0.0, now - bucket.updated)
        bucket.tokens = min(float(self.burst), bucket.tokens + elapsed * self.rate)
        bucket.updated = now

    def _evict_idle(self, now: float) -> None:
        # Only the least recently used end is checked (amortised O(1) per request): a full
        # bucket behind a fuller-than-it-looks one waits a little; max_keys bounds it anyway.
        while self._buckets:
            key, bucket = next(iter(self._buckets.items()))
            if bucket.tokens + (now - bucket.updated) * self.rate < self.burst:
                return
            del self._buckets[key]
