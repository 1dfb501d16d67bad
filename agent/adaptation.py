"""One session's network adaptation: receiver capabilities + controller + feedback tap.

Owns the parts that turn what the browser offered and what it reports into encoder
settings on the session's track, and the figures the ``stats`` event and ``/sessions`` show.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiortc import RTCRtpSender

from agent.bitrate import BitrateController
from agent.config import AdaptationSettings
from agent.feedback import Applier, FeedbackTap
from agent.opus_rates import MIN_BITRATE as OPUS_MIN_BITRATE
from agent.track import OpusPacketTrack


@dataclass(frozen=True)
class ReceiverOpus:
    """What the receiver's offer allows (RFC 7587 fmtp) and which feedback it sends."""

    fec: bool = False  # useinbandfec=1: it decodes in-band FEC
    max_bitrate: int | None = None  # maxaveragebitrate
    max_playback_rate: int | None = None  # maxplaybackrate (Hz)
    transport_cc: bool = False


def receiver_ceiling(bitrate: int, receiver: ReceiverOpus) -> int:
    """The configured bitrate lowered by the receiver's maxaveragebitrate, but no lower
    than libopus goes: a receiver asking 4 kbps got a stats ``ceiling`` of 4000 beside a
    bitrate of 6000, and the raw value passed to encoders that clamp it (found by review)."""
    if receiver.max_bitrate is not None:
        bitrate = min(bitrate, receiver.max_bitrate)
    return max(OPUS_MIN_BITRATE, bitrate)


class NetworkAdaptation:
    def __init__(
        self,
        track: OpusPacketTrack,
        settings: AdaptationSettings,
        receiver: ReceiverOpus,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.track = track
        self.settings = settings
        self.receiver = receiver
        self.ceiling = receiver_ceiling(track.encoder.bitrate, receiver)
        self.controller = BitrateController(
            settings, self.ceiling, fec_allowed=receiver.fec, now=clock()
        )
        self.applier = Applier(
            track.set_bitrate,
            track.set_fec,
            track.set_expected_loss,
            # aiortc stops the track (closing its encoder) when the peer connection goes;
            # the session lives on for a resume, its stats loop still ticking this.
            live=lambda: track.readyState == "live",
        )
        self.tap: FeedbackTap | None = None
        self._clock = clock

    def attach(self, sender: RTCRtpSender) -> None:
        """Apply what the receiver allows and start following its feedback on this sender
        (before it sends). Until then the track keeps the configured settings."""
        track = self.track
        if self.receiver.max_playback_rate is not None:
            track.encoder.set_max_playback_rate(self.receiver.max_playback_rate)
        if not self.settings.enabled:
            # Fixed settings, within what the receiver allows.
            track.set_bitrate(self.ceiling)
            track.set_fec(track.encoder.fec and self.receiver.fec)
            return
        stats = self.track.stats
        # From the count so far: a resumed session's track carries the call's stats over,
        # and its first packet was recorded as every byte sent since the call began (found
        # by review; aiortc's send path only, the lean one passes each packet's own size).
        last = [stats.bytes]

        def packet_size() -> int:
            # The packet being serialised is the one the track returned last.
            size = stats.bytes - last[0]
            last[0] = stats.bytes
            return size

        self.tap = FeedbackTap(
            sender, self.controller, self.applier, packet_size=packet_size, clock=self._clock
        )
        self.tap.install(transport_cc=self.receiver.transport_cc)

    def tick(self) -> None:
        if self.tap is not None:
            self.tap.tick()

    def stats(self) -> dict[str, Any]:
        encoder = self.track.encoder
        controller = self.controller
        tap = self.tap
        return {
            "bitrate": encoder.bitrate,
            "fec": encoder.fec,
            "expected_loss_pct": encoder.expected_loss_pct,
            "adaptive": tap is not None,
            "ceiling": self.ceiling,
            "loss": _round(controller.loss, 4),
            "last_loss": _round(controller.last_loss, 4),
            "rtt_ms": _round(controller.rtt_s * 1000 if controller.rtt_s is not None else None, 1),
            "jitter_ms": _round(
                controller.jitter_s * 1000 if controller.jitter_s is not None else None, 1
            ),
            "queuing_delay_ms": _round(controller.queuing_delay_ms, 1),
            "remb": controller.remb,
            "transport_cc": bool(tap and tap.transport_cc and tap.transport_feedbacks),
            "receiver_reports": tap.receiver_reports if tap else 0,
            "transport_feedbacks": tap.transport_feedbacks if tap else 0,
            # Not parsed: more packets reported than a receiver reports (a peer's flood).
            "transport_feedbacks_dropped": tap.feedbacks_over_budget if tap else 0,
            "encoder_changes": self.applier.changes,
            "reason": controller.last_reason,
        }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
