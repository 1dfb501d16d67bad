"""Network adaptation promises (README "Network adaptation") that hand mutation testing found
unguarded: each test here fails with one plausible change to agent/ and passes without it."""

from __future__ import annotations

from types import SimpleNamespace

from agent.adaptation import NetworkAdaptation, ReceiverOpus, receiver_ceiling
from agent.bitrate import BitrateController, EncoderTarget, LossReport
from agent.config import AdaptationSettings, OpusSettings
from agent.feedback import Applier, FeedbackTap, _now_us
from agent.playout import PlayoutBuffer
from agent.track import OpusPacketTrack
from agent.twcc import (
    FeedbackEstimator,
    SendHistory,
    TransportFeedback,
    build_transport_feedback,
    iter_transport_feedback,
    parse_transport_feedback,
)
from tests.doubles import RtcpSender

SETTINGS = AdaptationSettings()
CEILING = 32_000
SSRC = 0x1234


def _run(controller: BitrateController, losses: list[float], start: float) -> list[EncoderTarget]:
    """One 50-packet receiver report a second from ``start`` + 1; the targets after each."""
    return [
        controller.on_loss_report(LossReport(start + 1 + k, loss, rtt_s=0.05))
        for k, loss in enumerate(losses)
    ]


def test_fec_goes_off_ten_seconds_after_the_last_loss_not_after_the_window_forgets_it() -> None:
    """README: "FEC goes off after 10 s without loss". The clean reports that follow a loss
    episode still have the lost packets in the 200-packet FEC window for ~4 s; counting them
    as loss (a report of 0% refreshing "last loss") kept FEC on for ~13 s instead."""
    controller = BitrateController(SETTINGS, CEILING)
    _run(controller, [0.10] * 3, start=0.0)  # reports at t=1, 2, 3: the last loss at t=3
    assert controller.target.fec
    recovery = _run(controller, [0.0] * 12, start=3.0)  # t=4 ... 15
    times = [4.0 + k for k in range(12)]
    fec = dict(zip(times, (t.fec for t in recovery), strict=True))
    off_at = 3.0 + SETTINGS.fec_off_after_s
    assert all(fec[t] for t in times if t < off_at), fec
    assert not any(fec[t] for t in times if t >= off_at), fec


def test_fec_that_comes_back_counts_the_newest_report_in_full_again() -> None:
    """When FEC comes on, the newest report's loss counts in full in the loss libopus is told
    to expect (bitrate.py). A second loss episode, after FEC went off on a clean report, must
    start the same way as the first: a stale expected loss left from the first episode made
    it follow the slow estimate instead (6% told for a 10% report)."""
    controller = BitrateController(SETTINGS, CEILING)
    _run(controller, [0.25] * 3, start=0.0)
    assert controller.target.fec and controller.target.expected_loss_pct > 10
    recovery = _run(controller, [0.0] * 11, start=3.0)  # t=4 ... 14: off at t=13, on a report
    assert not recovery[-1].fec and recovery[-1].expected_loss_pct == 0
    again = controller.on_loss_report(LossReport(15.0, 0.10, rtt_s=0.05))
    fresh = BitrateController(SETTINGS, CEILING).on_loss_report(LossReport(1.0, 0.10, rtt_s=0.05))
    assert again.fec and fresh.fec
    assert again.expected_loss_pct == fresh.expected_loss_pct == 10


def test_a_maxaveragebitrate_above_the_configured_bitrate_does_not_raise_it() -> None:
    """README: "`maxaveragebitrate` lowers the ceiling": a receiver allowing 128 kbps gets the
    configured --bitrate, not 128 kbps."""
    assert receiver_ceiling(32_000, ReceiverOpus(max_bitrate=128_000)) == 32_000
    track = OpusPacketTrack(PlayoutBuffer(100, 48_000), OpusSettings(bitrate=32_000))
    try:
        network = NetworkAdaptation(track, SETTINGS, ReceiverOpus(max_bitrate=128_000))
        network.attach(RtcpSender(SSRC))  # type: ignore[arg-type]
        # A clean path starts and stays at --bitrate.
        network.applier(network.controller.on_loss_report(LossReport(1e9, 0.0, rtt_s=0.05)))
        assert network.ceiling == 32_000
        assert track.encoder.bitrate == 32_000
    finally:
        track.stop()


def test_what_the_receiver_allows_applies_from_the_first_packet_with_adaptation_on() -> None:
    """RFC 7587: no FEC for a receiver that did not offer useinbandfec=1, and its
    maxaveragebitrate as the ceiling. With adaptation on these must hold as soon as the tap is
    attached (before the first packet), not only from the first report or stats tick ~1 s
    later: the encoder kept the configured 32 kbps and FEC until then."""
    track = OpusPacketTrack(PlayoutBuffer(100, 48_000), OpusSettings(bitrate=32_000, fec=True))
    try:
        assert track.encoder.fec and track.encoder.bitrate == 32_000
        network = NetworkAdaptation(track, SETTINGS, ReceiverOpus(fec=False, max_bitrate=16_000))
        network.attach(RtcpSender(SSRC))  # type: ignore[arg-type]
        assert network.tap is not None
        assert track.encoder.bitrate == 16_000
        assert track.encoder.fec is False
    finally:
        track.stop()


class _Clock:
    def __init__(self, now: float = 10.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_transport_cc_over_use_backs_off_to_what_arrived_through_the_tap() -> None:
    """README: queueing backs off x0.85 "and to at most 0.85 of the rate that arrived, as
    GCC". The controller's rule is tested alone; this is the tap's part: the receive rate it
    measures from transport-cc must reach the controller. A queue growing while ~7 kbps
    arrive (tiny packets) is cut to the congestion floor at once, not to 0.85 x 32 kbps."""
    clock = _Clock()
    controller = BitrateController(SETTINGS, CEILING)
    sender = SimpleNamespace(_ssrc=SSRC)
    applied: list[int] = []
    tap = FeedbackTap(
        sender,  # type: ignore[arg-type]
        controller,
        Applier(applied.append, lambda _: None, lambda _: None),
        clock=clock,
    )
    start = _now_us()
    seq = 0
    for round_ in range(20):
        base = seq
        arrivals: list[int | None] = []
        for _ in range(5):
            send = start + seq * 20_000
            tap._history.record(seq, send, 20)  # 20 bytes every 20 ms
            arrivals.append(send + 10_000 + seq * 3_000)  # the queue grows 3 ms a packet
            seq += 1
        ref = (arrivals[0] or 0) // 64_000 * 64_000
        clock.now += 0.1
        tap._on_rtcp_data(build_transport_feedback(base, ref, round_, arrivals, media_ssrc=SSRC))
        if controller.last_reason == "queueing delay":
            break
    assert controller.last_reason == "queueing delay"
    assert controller.target.bitrate == SETTINGS.min_bitrate


def test_a_sequence_number_reused_after_the_transport_wraps_is_a_new_packet() -> None:
    """A room speaker slot that went quiet while the transport's other streams took 65,536
    numbers sends again under 16-bit numbers it used before: their feedback is about new
    packets (told apart by send time), not repeats of the old ones to be ignored."""
    history = SendHistory()
    estimator = FeedbackEstimator()
    t0 = 1_000_000_000
    for n in range(5):
        history.record(n, t0 + n * 20_000, 80)
    arrivals: list[int | None] = [t0 + n * 20_000 + 30_000 for n in range(5)]
    first = _parse(build_transport_feedback(0, t0 // 64_000 * 64_000, 0, arrivals))
    summary = estimator.on_feedback(first, history, t0 + 200_000)
    assert summary is not None and summary.packets == 5 and summary.lost == 0
    later = t0 + 30_000_000
    for n in range(1 << 16, (1 << 16) + 5):
        history.record(n, later + (n - (1 << 16)) * 20_000, 80)
    lost = _parse(build_transport_feedback(0, later // 64_000 * 64_000, 1, [None] * 5))
    summary = estimator.on_feedback(lost, history, later + 200_000)
    assert summary is not None and (summary.packets, summary.lost) == (5, 5)


def _parse(packet: bytes) -> TransportFeedback:
    ((_, _, fci),) = list(iter_transport_feedback(packet))
    return parse_transport_feedback(fci)
