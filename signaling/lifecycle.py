"""Session lifecycle rules: connect timeout, lost peers, resume grace, idle sessions.

One watchdog task per registry looks at every session about once a second (no task per
session) and decides with ``verdict``, a pure function of a session's ``Liveness`` and the
clock, so the rules are plain to read and cheap to run:

- a peer connection that is not connected ``connect_timeout_s`` after its offer was answered
  is *lost*;
- a connected peer from which nothing arrived (RTCP, or a data-channel message) for
  ``rtcp_timeout_s`` is *lost*: aioice's consent freshness alone needs ~30 s to notice a
  client that vanished, and does not notice one whose path still passes STUN but nothing else;
- a lost peer's session is *detached* (its peer connection closed, its speech kept and its
  playout paused) and waits ``resume_grace_s`` for the client to come back with its session
  token; then it is closed;
- a session with no client request and no speech (the agent's, or the user's voice activity) for
  ``idle_timeout_s`` is closed.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiortc import RTCRtpSender

from agent.config import LifecycleSettings


class Verdict(enum.Enum):
    KEEP = "keep"
    LOST = "lost"  # the peer is gone: detach the session (or close it without a grace)
    EXPIRED = "expired"  # detached for longer than the grace: close
    IDLE = "idle"  # nothing happened for idle_timeout_s: close


@dataclass
class Liveness:
    """What the watchdog knows about one session's current peer connection (monotonic s)."""

    created_at: float = field(default_factory=time.monotonic)  # reset when answered
    connected_at: float | None = None
    last_inbound: float = 0.0  # last RTCP packet or data-channel message from the peer
    last_activity: float = field(default_factory=time.monotonic)  # request or speech
    detached_at: float | None = None  # when the peer was lost (None: not detached)
    lost_reason: str | None = None

    def connected(self) -> None:
        now = time.monotonic()
        if self.connected_at is None:
            self.connected_at = now
        self.last_inbound = max(self.last_inbound, now)

    def heard(self) -> None:
        """Something arrived from the peer: it is still there."""
        self.last_inbound = time.monotonic()

    def active(self) -> None:
        """A client request or speech: the session is in use."""
        self.last_activity = time.monotonic()

    def active_since(self, when: float) -> None:
        """In use at ``when`` (monotonic), if that is later than what was known."""
        self.last_activity = max(self.last_activity, when)


def grace_over(life: Liveness, settings: LifecycleSettings, now: float) -> bool:
    """A detached session whose client did not come back within --resume-grace."""
    return life.detached_at is not None and now - life.detached_at >= settings.resume_grace_s


def verdict(life: Liveness, connected: bool, settings: LifecycleSettings, now: float) -> Verdict:
    if life.detached_at is not None:
        return Verdict.EXPIRED if grace_over(life, settings, now) else Verdict.KEEP
    if settings.idle_timeout_s and now - life.last_activity >= settings.idle_timeout_s:
        return Verdict.IDLE
    if life.connected_at is None or not connected:
        # Never connected yet (or reconnecting): the connect timer runs from the answer.
        if settings.connect_timeout_s and now - life.created_at >= settings.connect_timeout_s:
            life.lost_reason = "connect_timeout"
            return Verdict.LOST
        return Verdict.KEEP
    if settings.rtcp_timeout_s and now - life.last_inbound >= settings.rtcp_timeout_s:
        life.lost_reason = "no_rtcp"
        return Verdict.LOST
    return Verdict.KEEP


def check_interval(settings: LifecycleSettings) -> float:
    """How often the watchdog looks: 1 s, or a quarter of the shortest timer if shorter."""
    timers = [
        t
        for t in (
            settings.connect_timeout_s,
            settings.rtcp_timeout_s,
            settings.resume_grace_s,
            settings.idle_timeout_s,
        )
        if t > 0
    ]
    return max(0.02, min([1.0, *(t / 4 for t in timers)]))


def tap_rtcp(sender: RTCRtpSender, on_rtcp: Callable[[], None]) -> None:
    """Call ``on_rtcp`` for every RTCP packet the peer sends about our stream.

    aiortc routes a receiver report to the sender whose SSRC it reports on and calls the
    sender's ``_handle_rtcp_packet``; the instance attribute is wrapped (like the feedback
    tap of agent/feedback.py, which may wrap it too: each calls the one it found).
    """
    original: Callable[[Any], Awaitable[None]] = sender._handle_rtcp_packet

    async def handle_rtcp_packet(packet: Any) -> None:
        on_rtcp()
        await original(packet)

    sender._handle_rtcp_packet = handle_rtcp_packet  # type: ignore[method-assign]
