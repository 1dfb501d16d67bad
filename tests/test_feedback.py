"""The RTCP tap: real aiortc RTCP packet objects and transport-cc bytes into the controller.

The end-to-end tests (test_adaptation_e2e, test_browser_loss) prove it with real peers; these
pin each input path on its own, with hand-made reports whose effect is known exactly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from aiortc.clock import current_ntp_time
from aiortc.rtp import (
    RTCP_PSFB_APP,
    HeaderExtensions,
    RtcpPsfbPacket,
    RtcpReceiverInfo,
    RtcpRrPacket,
    pack_remb_fci,
)

from agent.bitrate import BitrateController, EncoderTarget
from agent.config import AdaptationSettings
from agent.feedback import (
    SENT_REPORTS_KEPT,
    Applier,
    FeedbackTap,
    TransportSequence,
    TransportSequenceMap,
    _now_us,
)
from agent.twcc import build_transport_feedback
from tests.doubles import RtcpSender

SSRC = 0x1234
CEILING = 32_000


class Encoder:
    """Records what the applier sets (stands in for the track's setters)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def applier(self, live: Callable[[], bool] = lambda: True) -> Applier:
        return Applier(
            lambda v: self.calls.append(("bitrate", v)),
            lambda v: self.calls.append(("fec", v)),
            lambda v: self.calls.append(("loss", v)),
            live=live,
        )


def make_tap() -> tuple[FeedbackTap, BitrateController, Encoder]:
    controller = BitrateController(AdaptationSettings(), CEILING)
    encoder = Encoder()
    sender = SimpleNamespace(_ssrc=SSRC)
    tap = FeedbackTap(sender, controller, encoder.applier())  # type: ignore[arg-type]
    return tap, controller, encoder


def report(
    fraction_lost: int, lsr: int = 0, dlsr: int = 0, ssrc: int = SSRC, highest: int = 0
) -> RtcpRrPacket:
    info = RtcpReceiverInfo(
        ssrc=ssrc,
        fraction_lost=fraction_lost,
        packets_lost=0,
        highest_sequence=highest,
        jitter=480,
        lsr=lsr,
        dlsr=dlsr,
    )
    return RtcpRrPacket(ssrc=99, reports=[info])


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self, now: float = 10.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def installed_tap(clock: Clock) -> tuple[FeedbackTap, BitrateController, RtcpSender]:
    controller = BitrateController(AdaptationSettings(), CEILING)
    sender = RtcpSender(SSRC)
    tap = FeedbackTap(sender, controller, Encoder().applier(), clock=clock)  # type: ignore[arg-type]
    tap.install(transport_cc=False)
    return tap, controller, sender


def ntp_seconds_ago(seconds: float) -> int:
    return current_ntp_time() - int(seconds * (1 << 32))


async def test_receiver_report_loss_and_rtt_reach_the_controller() -> None:
    clock = Clock()
    tap, controller, sender = installed_tap(clock)
    lsr = await sender.send_sr(current_ntp_time())
    # Our SR left 80 ms ago; the receiver held it 30 ms: RTT 50 ms.
    clock.now += 0.080
    await sender._handle_rtcp_packet(report(fraction_lost=26, lsr=lsr, dlsr=int(0.030 * 65536)))
    assert tap.receiver_reports == 1
    assert controller.last_loss == 26 / 256
    assert controller.rtt_s is not None and abs(controller.rtt_s - 0.050) < 0.001
    assert controller.jitter_s == 0.01  # 480 ticks at 48 kHz
    assert controller.target.fec  # 10% loss: FEC on at once


async def test_rtt_from_a_report_naming_an_older_sender_report_uses_its_send_time() -> None:
    """The lean send path stamps SRs with an NTP time up to 0.5 s old (agent/direct.py). A
    receiver whose latest SR was lost names the one before: its RTT must still be the path's,
    not the NTP arithmetic's (0.4 s high here, a false spike that cut the bitrate x0.85)."""
    clock = Clock(10.0)
    _, controller, sender = installed_tap(clock)
    # Real NTP "now" is when the second report arrives (clock 11.3); SR 1 left at 10.0
    # stamped 0.4 s early, SR 2 at 11.0 stamped 0.2 s early and lost on the way.
    lsr1 = await sender.send_sr(ntp_seconds_ago(1.3 + 0.4))
    clock.now = 10.05  # answered at once: RTT 50 ms, the baseline
    await sender._handle_rtcp_packet(report(0, lsr=lsr1, dlsr=0))
    assert controller.rtt_s is not None and controller.rtt_s < 0.06
    clock.now = 11.0
    await sender.send_sr(ntp_seconds_ago(0.3 + 0.2))
    clock.now = 11.3  # SR 1 arrived at 10.025 and was held since: 1.25 s
    await sender._handle_rtcp_packet(report(0, lsr=lsr1, dlsr=int(1.25 * 65536)))
    assert controller.rtt_s is not None and abs(controller.rtt_s - 0.05) < 0.001
    assert controller.target.bitrate == CEILING, controller.last_reason


async def test_a_report_naming_an_unknown_sender_report_gives_no_rtt() -> None:
    clock = Clock()
    tap, controller, sender = installed_tap(clock)
    first = await sender.send_sr(ntp_seconds_ago(2.0))
    for k in range(SENT_REPORTS_KEPT):  # later SRs push the first one out
        clock.now += 1.0
        await sender.send_sr(ntp_seconds_ago(1.0 - k / 100))
    await sender._handle_rtcp_packet(report(0, lsr=first, dlsr=int(0.5 * 65536)))
    assert tap.receiver_reports == 1 and controller.rtt_s is None
    # Nor from an LSR that was never ours.
    await sender._handle_rtcp_packet(report(0, lsr=0x1234_5678, dlsr=0))
    assert controller.rtt_s is None


def test_receiver_report_loss_weighs_by_the_packets_it_covers() -> None:
    """Chromium reports every ~5 s: its fraction is of ~250 packets, five aiortc reports'
    worth, and moves the controller's estimate as much."""
    tap, controller, _ = make_tap()
    tap._on_rtcp_packet(report(0, highest=1_000))
    tap._on_rtcp_packet(report(26, highest=1_250))
    assert controller.loss == pytest.approx(26 / 256 * (1 - 0.5**5))


def test_reports_about_other_streams_are_ignored() -> None:
    tap, controller, _ = make_tap()
    tap._on_rtcp_packet(report(fraction_lost=128, ssrc=SSRC + 1))
    assert tap.receiver_reports == 0 and controller.last_loss is None


def test_remb_for_our_stream_caps_the_bitrate() -> None:
    tap, _, encoder = make_tap()
    remb = RtcpPsfbPacket(
        fmt=RTCP_PSFB_APP, ssrc=99, media_ssrc=0, fci=pack_remb_fci(18_000, [SSRC])
    )
    tap._on_rtcp_packet(remb)
    assert tap.remb_reports == 1
    assert ("bitrate", 18_000) in encoder.calls
    garbage = RtcpPsfbPacket(fmt=RTCP_PSFB_APP, ssrc=99, media_ssrc=0, fci=b"nope")
    tap._on_rtcp_packet(garbage)  # malformed: ignored, no exception
    assert tap.remb_reports == 1


def test_transport_sequence_numbers_are_stamped_and_recorded() -> None:
    tap, _, _ = make_tap()
    sizes = iter([80, 81, 82])
    stamp = TransportSequenceMap(tap._history, lambda: next(sizes))
    values = [HeaderExtensions() for _ in range(3)]
    for v in values:
        stamp.set(v)
    assert [v.transport_sequence_number for v in values] == [0, 1, 2]
    sent = tap._history.get(2)
    assert sent is not None and sent.size_bytes == 82


async def test_transport_feedback_with_growing_delay_backs_off_within_a_second() -> None:
    """Feedback bytes as Chrome sends them, one per 100 ms, saying queueing grows 10 ms per
    100 ms: the controller sees over-use and lowers the bitrate below the ceiling."""
    tap, controller, encoder = make_tap()
    start = _now_us()
    seq = 0
    for round_ in range(12):
        # Five packets sent 20 ms apart (recorded as the sender would), then their feedback.
        base = seq
        arrivals: list[int | None] = []
        for i in range(5):
            send = start + (round_ * 5 + i) * 20_000
            tap._history.record(seq, send, 80)
            arrivals.append(send + 20_000 + round_ * 10_000 + i * 2_000)
            seq += 1
        ref = (arrivals[0] or 0) // 64_000 * 64_000
        packet = build_transport_feedback(base, ref, round_, arrivals, media_ssrc=SSRC)
        tap._on_rtcp_data(packet)
        await asyncio.sleep(0)
    assert tap.transport_feedbacks == 12
    assert controller.queuing_delay_ms is not None and controller.queuing_delay_ms > 60
    assert controller.target.bitrate < CEILING
    assert controller.last_reason == "queueing delay"
    assert any(call[0] == "bitrate" and call[1] < CEILING for call in encoder.calls)


def test_transport_feedback_loss_is_judged_per_window() -> None:
    tap, controller, _ = make_tap()
    tap._clock = iter([0.0, 0.0] + [0.1 * k for k in range(1, 40)]).__next__
    seq = 0
    start = _now_us()
    for round_ in range(10):
        base = seq
        arrivals: list[int | None] = []
        for i in range(5):
            send = start + seq * 20_000
            tap._history.record(seq, send, 80)
            # Every fifth packet lost: 20%.
            arrivals.append(None if i == 2 else send + 20_000)
            seq += 1
        first = next(a for a in arrivals if a is not None)
        ref = first // 64_000 * 64_000
        tap._on_rtcp_data(build_transport_feedback(base, ref, round_, arrivals))
    assert controller.reports >= 1
    assert controller.last_loss is not None and abs(controller.last_loss - 0.2) < 0.05
    assert controller.target.fec


def test_applier_only_touches_what_changed() -> None:
    encoder = Encoder()
    apply = encoder.applier()
    apply(EncoderTarget(32_000, False, 0))
    assert len(encoder.calls) == 3  # first target: everything set once
    apply(EncoderTarget(32_000, False, 0))
    apply(EncoderTarget(32_000, True, 10))
    assert encoder.calls[3:] == [("fec", True), ("loss", 10)]
    assert apply.changes == 1


def test_applier_leaves_an_encoder_that_is_gone_alone() -> None:
    encoder = Encoder()
    live = [True]
    apply = encoder.applier(live=lambda: live[0])
    apply(EncoderTarget(32_000, False, 0))
    live[0] = False  # the track stopped: its encoder is closed
    apply(EncoderTarget(28_000, True, 10))
    assert encoder.calls == [("bitrate", 32_000), ("fec", False), ("loss", 0)]
    assert apply.changes == 0


async def test_junk_rtcp_through_the_installed_hooks_never_raises() -> None:
    """Exceptions escaping into aiortc's transport loop would close the connection."""
    tap, controller, sender = installed_tap(Clock())
    # A report block the tap cannot read (no loss fields): through the installed wrapper.
    broken = RtcpRrPacket(ssrc=1, reports=[SimpleNamespace(ssrc=SSRC)])  # type: ignore[list-item]
    await sender._handle_rtcp_packet(broken)
    assert tap.errors == 1
    # Junk bytes where transport feedback is expected: parsed, refused, counted, no raise.
    tap._guarded(tap._on_rtcp_data, b"\x8f\xcd\x00\x04" + b"\xff" * 16)
    assert controller.reports == 0


def test_a_remb_naming_other_streams_only_is_ignored() -> None:
    tap, controller, _ = make_tap()
    remb = RtcpPsfbPacket(
        fmt=RTCP_PSFB_APP, ssrc=99, media_ssrc=0, fci=pack_remb_fci(18_000, [SSRC + 1])
    )
    tap._on_rtcp_packet(remb)
    assert tap.remb_reports == 0 and controller.remb is None
    assert controller.target.bitrate == CEILING


def test_transport_sequence_numbers_wrap_at_16_bits() -> None:
    """The header extension holds 16 bits: after 65535 comes 0 (about 22 minutes of audio)."""
    sequence = TransportSequence()
    sequence._next = 0xFFFE
    assert [sequence.take() for _ in range(3)] == [0xFFFE, 0xFFFF, 0]


def test_receiver_report_loss_is_not_counted_again_once_transport_cc_reports_it() -> None:
    """Where transport-cc feedback flows it already reported the loss: a receiver report's
    summary of the same packets must not lower the bitrate a second time (its RTT and
    jitter still count)."""
    tap, controller, _ = make_tap()
    tap._twcc_since_rr = True  # a feedback about our packets came since the last report
    tap._on_rtcp_packet(report(fraction_lost=128))
    assert tap.receiver_reports == 1 and controller.last_loss is None
    assert controller.jitter_s == 0.01
    assert controller.target == EncoderTarget(CEILING, False, 0)


async def test_an_rtt_of_a_minute_or_more_is_dropped() -> None:
    """An RTT of 60 s or more comes from another SR or a confused peer, not the path."""
    clock = Clock(10.0)
    _, controller, sender = installed_tap(clock)
    lsr = await sender.send_sr(current_ntp_time())
    clock.now = 75.0
    await sender._handle_rtcp_packet(report(0, lsr=lsr, dlsr=0))
    assert controller.rtt_s is None
    assert controller.target.bitrate == CEILING


def test_transport_cc_loss_needs_enough_packets_in_its_window() -> None:
    """A window is judged once it spans TWCC_LOSS_WINDOW_S and holds TWCC_LOSS_MIN_PACKETS:
    a trickle of a few packets (one of them lost) is not yet a loss figure."""
    tap, controller, _ = make_tap()
    tap._count_twcc_loss(0.0, 3, 1)
    tap._count_twcc_loss(0.6, 2, 0)
    assert controller.reports == 0 and not controller.target.fec
    tap._count_twcc_loss(0.7, 5, 0)
    assert controller.reports == 1 and controller.last_loss == pytest.approx(0.1)


def test_each_transport_cc_loss_window_starts_afresh() -> None:
    """A judged window is reset: an old burst does not count in the next window's loss."""
    tap, controller, _ = make_tap()
    tap._count_twcc_loss(0.0, 10, 5)
    tap._count_twcc_loss(0.5, 10, 5)
    assert controller.last_loss == pytest.approx(0.5)
    tap._count_twcc_loss(0.8, 10, 0)
    tap._count_twcc_loss(1.0, 10, 0)
    assert controller.reports == 2 and controller.last_loss == 0.0


def test_a_packet_reported_lost_then_received_is_not_loss() -> None:
    """transport-cc may report a late packet lost and, in the next feedback, received: the
    recovery cancels the loss, so a path that only reorders reads clean."""
    clock = Clock(0.0)
    controller = BitrateController(AdaptationSettings(), CEILING)
    tap = FeedbackTap(
        SimpleNamespace(_ssrc=SSRC),  # type: ignore[arg-type]
        controller,
        Encoder().applier(),
        clock=clock,
    )
    start = _now_us()
    for round_ in range(12):
        clock.now = 0.1 * round_
        base = max(0, 5 * round_ - 3)  # from the packet the last feedback said was lost
        arrivals: list[int | None] = []
        for seq in range(base, 5 * round_ + 5):
            send = start + seq * 20_000
            if seq >= 5 * round_:
                tap._history.record(seq, send, 80)
            late = seq == 5 * round_ + 2  # reported lost now, received in the next feedback
            arrivals.append(None if late else send + 20_000)
        ref = start // 64_000 * 64_000
        tap._on_rtcp_data(build_transport_feedback(base, ref, round_, arrivals))
    assert controller.reports >= 2
    assert controller.last_loss == 0.0


def test_fixed_settings_still_obey_what_the_receiver_can_decode() -> None:
    """Adaptation off: the configured settings hold, within the receiver's offer: no in-band
    FEC for a receiver that did not offer useinbandfec=1, its maxaveragebitrate as the rate."""
    from agent.adaptation import NetworkAdaptation, ReceiverOpus
    from agent.config import OpusSettings
    from agent.playout import PlayoutBuffer
    from agent.track import OpusPacketTrack

    for receiver_fec in (False, True):
        track = OpusPacketTrack(PlayoutBuffer(100, 48_000), OpusSettings(fec=True))
        try:
            network = NetworkAdaptation(
                track,
                AdaptationSettings(enabled=False),
                ReceiverOpus(fec=receiver_fec, max_bitrate=24_000),
            )
            network.attach(None)  # type: ignore[arg-type]  # no feedback tap: no sender used
            assert track.encoder.fec is receiver_fec
            assert track.encoder.bitrate == 24_000 and network.tap is None
        finally:
            track.stop()


def test_receiver_report_loss_counts_again_once_transport_cc_feedback_stops() -> None:
    """Bug: one transport feedback, even one naming none of our packets, silenced every
    later receiver report's loss for the session: a peer whose transport-cc stopped (or
    never named our packets) lowered no bitrate and turned no FEC on, however lossy its
    path. Found by review. Only feedback about our packets since the last report does."""
    tap, controller, _ = make_tap()
    tap._clock = lambda: 1.0
    start = _now_us()
    for seq in range(5):
        tap._history.record(seq, start + seq * 20_000, 80)
    # Feedback about 5 other packets (another stream on the transport, or a confused peer).
    tap._on_rtcp_data(build_transport_feedback(100, 0, 0, [64_000] * 5))
    assert tap.transport_feedbacks == 1
    tap._on_rtcp_packet(report(fraction_lost=128))
    assert controller.last_loss == 0.5 and controller.target.fec
    # Feedback about ours, then a report: transport-cc told the loss, the report does not.
    tap._on_rtcp_data(build_transport_feedback(0, 0, 1, [64_000 + 20_000 * i for i in range(5)]))
    tap._on_rtcp_packet(report(fraction_lost=0))
    assert controller.last_loss == 0.5
    # The feedback stopped: the next report's loss counts again.
    tap._on_rtcp_packet(report(fraction_lost=0))
    assert controller.last_loss == 0.0


def test_a_flood_of_transport_feedback_is_not_parsed_past_a_receivers_rate() -> None:
    """A compound packet of 8 feedbacks each reporting 1024 packets (192 bytes) cost 3.4 ms
    of event-loop time to parse and match: ~300 such packets a second from one peer would
    stall every session of the process, and a room member's taps each parse them (found by
    review). A tap now parses at most TWCC_REPORTED_PER_S reported packets a second (after
    a burst); the flood is counted, and a receiver's own feedback still all gets through."""
    from agent.feedback import TWCC_REPORTED_BURST, TWCC_REPORTED_PER_S

    tap, _controller, _ = make_tap()
    clock = Clock(0.0)
    tap._clock = clock
    hostile = build_transport_feedback(0, 0, 0, [None] * 1024) * 8
    started = time.process_time()
    for i in range(100):  # one second of 100 such packets
        clock.now = i / 100
        tap._on_rtcp_data(hostile)
    spent = time.process_time() - started
    parsed = tap.transport_feedbacks * 1024
    assert parsed <= TWCC_REPORTED_BURST + TWCC_REPORTED_PER_S
    assert tap.feedbacks_over_budget == 800 - tap.transport_feedbacks
    assert spent < 0.1  # it was ~0.34 s: every one parsed

    # A receiver's feedback, a room member's five streams (250 packets a second) reported
    # every 100 ms, is never refused, even right after a flood used the budget up.
    refused = tap.feedbacks_over_budget
    clock.now = 0.99
    for round_ in range(50):
        clock.now += 0.1
        arrivals = [64_000 + 4_000 * i for i in range(25)]
        tap._on_rtcp_data(build_transport_feedback(25 * round_, 0, round_, arrivals))
    assert tap.feedbacks_over_budget == refused


def test_a_busy_transport_s_real_feedback_is_never_refused() -> None:
    """A room member's transport carries the agent and every slot it offered, and each of
    its taps reads every feedback of the transport: with --room-max-speakers 23 that is 24
    streams, 1200 packets a second reported. The budget was a fixed 1000 a second per tap:
    once its burst was spent, a sixth of a real receiver's feedback went unparsed (taken
    for a flood), for every stream of the member. What the transport sent is what a
    receiver may report: the budget grows with it."""
    streams = 24
    clock = Clock(0.0)
    sequence = TransportSequence()
    tap = FeedbackTap(
        SimpleNamespace(_ssrc=SSRC),  # type: ignore[arg-type]
        BitrateController(AdaptationSettings(), CEILING),
        Encoder().applier(),
        clock=clock,
        sequence=sequence,
    )
    base = 0
    for round_ in range(600):  # a minute: feedback every 100 ms, 5 packets per stream
        clock.now += 0.1
        count = 5 * streams
        for _ in range(count):
            sequence.take()  # the member's other streams (and this one) sent them
        arrivals = [64_000 + 800 * i for i in range(count)]
        tap._on_rtcp_data(build_transport_feedback(base, 0, round_ & 0xFF, arrivals))
        base = (base + count) & 0xFFFF
    assert tap.feedbacks_over_budget == 0
    assert tap.transport_feedbacks == 600


def test_an_idle_streams_old_packets_never_answer_for_anothers_after_the_wrap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bug: a room member's slot stream and agent stream share one transport's 16-bit
    numbers. A slot whose speaker stopped (or left) records nothing more, so its history kept
    its last packets; once the agent's stream had taken the ~65,000 numbers in between (22
    minutes alone, less with other slots), every feedback about the agent's packets matched
    the slot's stale ones. Their send times were a wrap old: a delay growing by 10 ms per
    packet, read as congestion, and the slot's controller backed off. Found by review."""
    send_clock = [0]  # µs: 2 streams of 50 packets a second, then the agent's alone

    def now_us() -> int:
        return send_clock[0]

    monkeypatch.setattr("agent.feedback._now_us", now_us)
    sequence = TransportSequence()
    taps = []
    for _ in range(2):
        controller = BitrateController(AdaptationSettings(), CEILING)
        tap = FeedbackTap(
            SimpleNamespace(_ssrc=SSRC),  # type: ignore[arg-type]
            controller,
            Encoder().applier(),
            clock=Clock(0.0),
            sequence=sequence,
        )
        taps.append((tap, TransportSequenceMap(tap._history, lambda: 80, sequence)))
    (slot, slot_stamp), (agent, agent_stamp) = taps
    for _ in range(2_000):  # both streams talk: 20 s
        for stamp in (slot_stamp, agent_stamp):
            stamp.stamp(80)
            send_clock[0] += 10_000
    numbers: list[int] = []
    while sequence.taken < 0x10000 + 500:  # the slot went quiet; the agent goes on
        numbers.append(agent_stamp.stamp(80))
        send_clock[0] += 20_000
    # The receiver's feedback about the agent's last 500 packets, 5 at a time, 100 ms apart:
    # every second one of those numbers was the slot's before the wrap.
    recent = numbers[-500:]
    for round_ in range(100):
        base = recent[5 * round_]
        arrivals: list[int | None] = []
        for seq in recent[5 * round_ : 5 * round_ + 5]:
            sent = agent._history.get(seq)
            assert sent is not None
            arrivals.append(sent.send_time_us + 30_000)
        ref = arrivals[0] // 64_000 * 64_000  # type: ignore[operator]
        packet = build_transport_feedback(base, ref, round_ & 0xFF, arrivals, media_ssrc=SSRC)
        for tap, _ in taps:
            tap._clock.now = 0.1 * round_  # type: ignore[attr-defined]
            tap._on_rtcp_data(packet)
    assert agent._twcc_since_rr and agent.controller.target.bitrate == CEILING
    assert not slot._twcc_since_rr, "the slot's tap took the agent's packets for its own"
    assert slot.controller.queuing_delay_ms is None
    assert slot.controller.target.bitrate == CEILING


def test_a_feedback_flood_within_budget_buys_no_estimator_work() -> None:
    """The budget charged a feedback by the packets it reports, but each one naming a known
    packet, even a repeat, recomputed the receive rate over every arrival kept (up to 4096):
    a peer that first reported ~80 s of our packets at one arrival time (its clock is its
    own to write), then sent 1-packet repeats, bought ~1 ms of event-loop time per unit of
    budget, 2.6 s for the burst (found by review). Arrivals kept are now bounded, repeats
    buy no estimate, and every feedback costs TWCC_FEEDBACK_COST besides its packets."""
    from agent.feedback import TWCC_FEEDBACK_COST, TWCC_REPORTED_BURST
    from agent.twcc import MAX_RATE_PACKETS

    clock = Clock(100.0)
    tap = FeedbackTap(
        SimpleNamespace(_ssrc=SSRC),  # type: ignore[arg-type]
        BitrateController(AdaptationSettings(), CEILING),
        Encoder().applier(),
        clock=clock,
    )
    stamp = TransportSequenceMap(tap._history, lambda: 80, tap._sequence)
    for _ in range(4096):  # ~82 s of audio sent
        stamp.stamp(80)
    arrival = 64_000 * 100
    for base in range(0, 4096, 1024):  # all of it reported at one arrival time
        clock.now += 2.0
        tap._on_rtcp_data(build_transport_feedback(base, arrival, base // 1024, [arrival] * 1024))
    estimator = tap._estimator
    assert tap.transport_feedbacks == 4
    assert len(estimator._rate) <= MAX_RATE_PACKETS

    estimates = 0
    rate = estimator._receive_rate_bps

    def counted() -> float | None:
        nonlocal estimates
        estimates += 1
        return rate()

    estimator._receive_rate_bps = counted  # type: ignore[method-assign]
    repeat = build_transport_feedback(4095, arrival, 9, [arrival]) * 8
    clock.now += 10.0  # a full budget
    started = time.process_time()
    for _ in range(256):  # 2048 one-packet repeats
        tap._on_rtcp_data(repeat)
    spent = time.process_time() - started
    parsed = tap.transport_feedbacks - 4
    # Each costs 1 + TWCC_FEEDBACK_COST: ~120 of the burst's 2048 units (it was 2048).
    assert parsed <= TWCC_REPORTED_BURST // (1 + TWCC_FEEDBACK_COST) + 1 <= 130
    assert estimates == 0  # repeats report nothing new
    assert spent < 0.5  # it was ~2.6 s
