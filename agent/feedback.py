"""What the receiver reports about our audio, tapped out of aiortc into the bitrate controller.

aiortc parses RTCP receiver reports into stats and otherwise ignores them for audio; it has
no transport-wide congestion control at all (NOTES; upstream PR #1411 is open). There is no
public hook for either, so this module attaches to three aiortc internals of one peer
connection, all pinned by ``aiortc==1.16.0`` and covered by end-to-end tests:

- ``RTCRtpSender._handle_rtcp_packet`` (an instance attribute replaced by a wrapper that
  calls the original first): receiver reports (loss, jitter, RTT from LSR/DLSR) and REMB;
- ``RTCRtpSender._send_rtcp`` (wrapped the same way): when each of our sender reports left,
  by the LSR a receiver will echo, for the RTT;
- the sender's header-extension map (name-mangled ``__rtp_header_extensions_map``): replaced
  by a subclass that stamps every outgoing packet with the next transport-wide sequence
  number and records when it left, when transport-cc was negotiated;
- ``RTCDtlsTransport._handle_rtcp_data`` (wrapped): the raw RTCP, because aiortc parses
  transport feedback as a NACK and drops its body.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiortc import RTCRtpSender
from aiortc.rtp import (
    RTCP_PSFB_APP,
    HeaderExtensions,
    HeaderExtensionsMap,
    RtcpPsfbPacket,
    RtcpRrPacket,
    RtcpSrPacket,
    unpack_remb_fci,
)

from agent.bitrate import BitrateController, DelayReport, EncoderTarget, LossReport
from agent.twcc import (
    MAX_REPORTED_PACKETS,
    FeedbackEstimator,
    SendHistory,
    iter_transport_feedback,
    parse_transport_feedback,
    reported_packets,
)

log = logging.getLogger(__name__)

OPUS_CLOCK_RATE = 48_000
TWCC_LOSS_WINDOW_S = 0.5  # transport-cc loss is summed over this long before it is judged
TWCC_LOSS_MIN_PACKETS = 10
SENT_REPORTS_KEPT = 16  # SRs leave every 0.5-1.5 s: an RR naming an older one is stale
MAX_LOGGED_ERRORS = 5  # per session: a peer sending junk must not flood the log
# Packets reported by transport feedback that one tap parses per second, and its burst (see
# FeedbackTap._within_twcc_budget). A transport carries 50 audio packets a second per
# stream, 1 + the slots a room member offered (5 by default, more with a larger
# --room-max-speakers): on top of this rate, each packet the transport sent adds
# TWCC_REPORTED_PER_SENT to the budget, so a busy transport's own feedback always fits.
TWCC_REPORTED_PER_S = 1000
TWCC_REPORTED_BURST = 2 * MAX_REPORTED_PACKETS
TWCC_REPORTED_PER_SENT = 2
# What a feedback costs the budget besides its packets: its header, the loss and trend
# estimates (~10-30 us whatever it reports). Chromium sends ~16 a second: 256 units.
TWCC_FEEDBACK_COST = 16


class Applier:
    """Pushes a controller's target into the encoder, touching only what changed."""

    def __init__(
        self,
        set_bitrate: Callable[[int], None],
        set_fec: Callable[[bool], None],
        set_expected_loss: Callable[[int], None],
        *,
        live: Callable[[], bool] = lambda: True,
    ) -> None:
        self._set_bitrate = set_bitrate
        self._set_fec = set_fec
        self._set_expected_loss = set_expected_loss
        # False once the encoder is gone (its track stopped with its peer connection): the
        # tap still ticks, and may still hear a late report, until the session ends.
        self._live = live
        self.current: EncoderTarget | None = None
        self.changes = 0

    def __call__(self, target: EncoderTarget) -> None:
        current = self.current
        if current == target or not self._live():
            return
        if current is None or current.bitrate != target.bitrate:
            self._set_bitrate(target.bitrate)
        if current is None or current.fec != target.fec:
            self._set_fec(target.fec)
        if current is None or current.expected_loss_pct != target.expected_loss_pct:
            self._set_expected_loss(target.expected_loss_pct)
        if current is not None:
            self.changes += 1
        self.current = target


class TransportSequence:
    """The transport-wide sequence numbers of one transport. Every sender on it (a room
    participant's agent track and speaker slots share one bundled transport) takes the next
    one: a feedback names packets by this number, whichever stream they belonged to."""

    def __init__(self) -> None:
        self._next = 0
        self.taken = 0  # numbers handed out: packets sent on the transport (unwrapped)

    def take(self) -> int:
        seq = self._next
        self._next = (seq + 1) & 0xFFFF
        self.taken += 1
        return seq


class TransportSequenceMap(HeaderExtensionsMap):
    """aiortc's header-extension map that also stamps transport-wide sequence numbers."""

    def __init__(
        self,
        history: SendHistory,
        size_of_last: Callable[[], int],
        sequence: TransportSequence | None = None,
    ) -> None:
        super().__init__()
        self._history = history
        self._size_of_last = size_of_last
        self._sequence = sequence or TransportSequence()

    def set(self, values: HeaderExtensions) -> tuple[int, bytes]:
        # Called once per packet, as it is serialised to be sent: the send time is now.
        values.transport_sequence_number = self.stamp(self._size_of_last())
        return super().set(values)

    def stamp(self, size_bytes: int) -> int:
        """The next transport-wide sequence number, for a packet of ``size_bytes`` of
        payload leaving now (recorded for the feedback that will name it). The lean send
        path (agent/direct.py) writes it into its own header with this."""
        seq = self._sequence.take()
        # Only this sender's packets are recorded: a feedback's others (another stream on
        # the same transport) are not in its history, so its estimate is of its own stream.
        # Recorded by its unwrapped number, which tells it from the transport's later use
        # of the same 16 bits (SendHistory.get).
        self._history.record(self._sequence.taken - 1, _now_us(), size_bytes)
        return seq


class SentReports:
    """When each of the last few sender reports left, by the LSR a receiver echoes.

    The SR's NTP time is not when it left: aiortc stamps it with the time of the last RTP
    packet, and the lean send path (agent/direct.py) refreshes that only every 0.5 s. So LSR
    read as a time (RFC 3550's arithmetic) is early by up to 0.5 s, which reads as an RTT
    spike; the send time recorded here per LSR is exact for every recent SR, not only the
    latest (a receiver names an older one when the latest was lost or crossed its report).
    """

    def __init__(self, kept: int = SENT_REPORTS_KEPT) -> None:
        self._kept = kept
        self._sent: dict[int, float] = {}  # LSR -> send time; insertion order is send order

    def record(self, ntp_timestamp: int, sent_at: float) -> None:
        lsr = (ntp_timestamp >> 16) & 0xFFFFFFFF
        # Two SRs with one NTP time (no packet between them): the receiver most likely got
        # the later; if it got only the earlier, the RTT comes out negative and is dropped.
        self._sent.pop(lsr, None)
        self._sent[lsr] = sent_at
        while len(self._sent) > self._kept:
            del self._sent[next(iter(self._sent))]

    def sent_at(self, lsr: int) -> float | None:
        return self._sent.get(lsr)


class FeedbackTap:
    """Feeds one sender's receiver feedback into a controller and applies its target."""

    def __init__(
        self,
        sender: RTCRtpSender,
        controller: BitrateController,
        apply: Callable[[EncoderTarget], None],
        *,
        packet_size: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
        sequence: TransportSequence | None = None,
    ) -> None:
        self.sender = sender
        # Shared by every tap on one transport (None: this sender has its transport alone).
        self._sequence = sequence or TransportSequence()
        self.controller = controller
        self._apply = apply
        self._clock = clock
        self._packet_size = packet_size
        self.receiver_reports = 0
        self.transport_feedbacks = 0
        self.remb_reports = 0
        self.errors = 0
        self.transport_cc = False
        # Told how far the transport's numbers went, all its streams': this stream's packets
        # from before a wrap must not answer for another's (see SendHistory.get).
        shared = self._sequence
        self._history = SendHistory(transport_sent=lambda: shared.taken)
        self._estimator = FeedbackEstimator()
        self._sent_reports = SentReports()
        self._twcc_window: list[int] = [0, 0]  # packets, lost since the last loss report
        self._twcc_window_start: float | None = None
        self._rr_highest: int | None = None  # extended highest sequence of the last RR
        # Transport-cc feedback about our packets arrived since the last RR (see there).
        self._twcc_since_rr = False
        self.feedbacks_over_budget = 0  # transport feedbacks not parsed (see _within_twcc_budget)
        self._twcc_budget = float(TWCC_REPORTED_BURST)
        self._twcc_budget_at: float | None = None
        self._twcc_budget_sent = 0  # the transport's packets sent, at the last refill

    # --- installation --------------------------------------------------------------------
    def install(self, transport_cc: bool) -> None:
        """Hook the sender (and its transport, for transport-cc) before it starts sending."""
        original: Callable[[Any], Awaitable[None]] = self.sender._handle_rtcp_packet

        async def handle_rtcp_packet(packet: Any) -> None:
            await original(packet)
            self._guarded(self._on_rtcp_packet, packet)

        self.sender._handle_rtcp_packet = handle_rtcp_packet  # type: ignore[method-assign]
        original_send: Callable[[list[Any]], Awaitable[None]] = self.sender._send_rtcp

        async def send_rtcp(packets: list[Any]) -> None:
            self._guarded(self._on_rtcp_sent, packets)  # as aiortc notes its LSR: just before
            await original_send(packets)

        self.sender._send_rtcp = send_rtcp  # type: ignore[method-assign]
        if transport_cc:
            self.transport_cc = True
            # Replaced before RTCRtpSender.send() configures it with the negotiated ids.
            self.sender._RTCRtpSender__rtp_header_extensions_map = (  # type: ignore[attr-defined]
                TransportSequenceMap(self._history, self._packet_size, self._sequence)
            )
            transport = self.sender.transport
            original_data: Callable[[bytes], Awaitable[None]] = transport._handle_rtcp_data

            async def handle_rtcp_data(data: bytes) -> None:
                await original_data(data)
                self._guarded(self._on_rtcp_data, data)

            transport._handle_rtcp_data = handle_rtcp_data  # type: ignore[method-assign]
        self._apply(self.controller.target)

    def _guarded(self, handler: Callable[[Any], None], arg: Any) -> None:
        """An exception escaping into aiortc's transport loop would close the connection:
        a bad report (or a bug here) must cost at most that report."""
        try:
            handler(arg)
        except Exception:
            self.errors += 1
            if self.errors <= MAX_LOGGED_ERRORS:
                log.exception("ignoring RTCP feedback that could not be handled")

    def tick(self) -> None:
        """Time passing without feedback (FEC hold-off, REMB expiry); called about once a second."""
        self._apply(self.controller.tick(self._clock()))

    # --- RTCP ----------------------------------------------------------------------------
    def _on_rtcp_packet(self, packet: Any) -> None:
        try:
            if isinstance(packet, (RtcpRrPacket, RtcpSrPacket)):
                for report in packet.reports:
                    if report.ssrc == self.sender._ssrc:
                        self._on_receiver_report(report)
            elif isinstance(packet, RtcpPsfbPacket) and packet.fmt == RTCP_PSFB_APP:
                bitrate, ssrcs = unpack_remb_fci(packet.fci)
                if self.sender._ssrc in ssrcs:
                    self.remb_reports += 1
                    self._apply(self.controller.on_remb(self._clock(), bitrate))
        except ValueError as exc:  # a malformed report from the peer: ignore it, say so
            log.debug("ignoring malformed RTCP feedback: %s", exc)

    def _on_rtcp_sent(self, packets: list[Any]) -> None:
        for packet in packets:
            if isinstance(packet, RtcpSrPacket) and packet.ssrc == self.sender._ssrc:
                self._sent_reports.record(packet.sender_info.ntp_timestamp, self._clock())

    def _on_receiver_report(self, report: Any) -> None:
        self.receiver_reports += 1
        now = self._clock()
        # Where transport-cc feedback flows it already reported this loss, per packet and
        # sooner: counting the receiver report's summary of the same packets again would
        # make one loss episode lower the bitrate twice. Only where it flows, since the
        # last report and about our packets: a peer whose feedback stopped (or never named
        # a packet of ours) still has its loss heard, from its receiver reports.
        loss = None if self._twcc_since_rr else report.fraction_lost / 256
        self._twcc_since_rr = False
        # The fraction is of the packets expected since the previous report (RFC 3550 6.4.1):
        # the controller weighs it by that count.
        previous, self._rr_highest = self._rr_highest, report.highest_sequence
        expected = None if previous is None else report.highest_sequence - previous
        self._apply(
            self.controller.on_loss_report(
                LossReport(
                    time=now,
                    fraction_lost=loss,
                    rtt_s=self._rtt(report, now),
                    jitter_s=report.jitter / OPUS_CLOCK_RATE,
                    source="rr",
                    packets=expected if expected and 0 < expected < 1 << 16 else None,
                )
            )
        )

    def _rtt(self, report: Any, now: float) -> float | None:
        """RFC 3550 6.4.1: now - (when the named SR left) - DLSR, from the recorded send time.

        An LSR not recorded (older than the last few SRs, or not ours) gives no RTT: LSR read
        as a time is up to 0.5 s early (see SentReports), and a false spike backs off.
        """
        sent_at = self._sent_reports.sent_at(report.lsr) if report.lsr else None
        if sent_at is None:
            return None
        rtt = now - sent_at - report.dlsr / 65536
        return rtt if 0 <= rtt < 60 else None  # else from another SR or a confused peer

    def _on_rtcp_data(self, data: bytes) -> None:
        for _sender_ssrc, _media_ssrc, fci in iter_transport_feedback(data):
            # A feedback covers the whole transport; packets of other streams on it are not
            # in this tap's history and are skipped by the estimator.
            if not self._within_twcc_budget(reported_packets(fci) + TWCC_FEEDBACK_COST):
                self.feedbacks_over_budget += 1
                continue
            try:
                feedback = parse_transport_feedback(fci)
            except ValueError as exc:
                log.debug("ignoring malformed transport feedback: %s", exc)
                continue
            self.transport_feedbacks += 1
            now = self._clock()
            summary = self._estimator.on_feedback(feedback, self._history, _now_us())
            if summary is None:
                continue
            self._twcc_since_rr = True
            if summary.queuing_delay_ms is not None:
                self._apply(
                    self.controller.on_delay_report(
                        DelayReport(
                            now,
                            summary.queuing_delay_ms,
                            summary.delay_trend_ms_per_s or 0.0,
                            summary.receive_rate_bps,
                        )
                    )
                )
            self._count_twcc_loss(now, summary.packets, summary.lost - summary.recovered)

    def _within_twcc_budget(self, reported: int) -> bool:
        """Whether a feedback costing ``reported`` (its packets, plus TWCC_FEEDBACK_COST)
        may be parsed now.

        Parsing and matching costs ~0.4 us per packet reported, on the event loop: a peer
        sending compound packets of 8 feedbacks of 1024 packets each (192 bytes) cost 3.4
        ms of loop time per packet, so ~300 packets a second (58 KB/s) would stall every
        session of the process; in a room, each of a member's taps parses the same data. A
        real receiver reports each packet of the transport about once: TWCC_REPORTED_PER_S
        a second pass, plus TWCC_REPORTED_PER_SENT per packet the transport sent (a room
        member's transport carries a stream per slot: a fixed rate refused a busy one's
        real feedback), with a burst of TWCC_REPORTED_BURST.
        """
        now = self._clock()
        sent = self._sequence.taken
        if self._twcc_budget_at is not None:
            refill = (now - self._twcc_budget_at) * TWCC_REPORTED_PER_S
            refill = max(0.0, refill) + (sent - self._twcc_budget_sent) * TWCC_REPORTED_PER_SENT
            self._twcc_budget = min(TWCC_REPORTED_BURST, self._twcc_budget + refill)
        self._twcc_budget_at = now
        self._twcc_budget_sent = sent
        if reported > self._twcc_budget:
            return False
        self._twcc_budget -= reported
        return True

    def _count_twcc_loss(self, now: float, packets: int, lost: int) -> None:
        """Transport-cc loss, judged per window: one feedback covers only 2-5 audio packets."""
        if self._twcc_window_start is None:
            self._twcc_window_start = now
        self._twcc_window[0] += packets
        self._twcc_window[1] = max(0, self._twcc_window[1] + lost)
        total, lost_total = self._twcc_window
        if now - self._twcc_window_start >= TWCC_LOSS_WINDOW_S and total >= TWCC_LOSS_MIN_PACKETS:
            fraction = min(1.0, lost_total / total)
            self._apply(
                self.controller.on_loss_report(
                    LossReport(now, fraction, source="twcc", packets=total)
                )
            )
            self._twcc_window = [0, 0]
            self._twcc_window_start = now


def _now_us() -> int:
    return time.monotonic_ns() // 1000
