"""The control law on recorded report sequences (no network: every input carries its time)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable
from types import SimpleNamespace

import pytest
from aiortc.rtp import RtcpReceiverInfo, RtcpRrPacket

from agent.bitrate import (
    CONGESTION_FRESH_S,
    BitrateController,
    DelayReport,
    EncoderTarget,
    LossReport,
)
from agent.config import AdaptationSettings
from agent.feedback import Applier, FeedbackTap

SETTINGS = AdaptationSettings()
CEILING = 32_000


def run(
    controller: BitrateController, losses: Iterable[float], start: float = 0.0, every: float = 1.0
) -> list[EncoderTarget]:
    """Feed one receiver report per ``every`` seconds; returns the target after each."""
    targets = []
    now = start
    for loss in losses:
        now += every
        targets.append(controller.on_loss_report(LossReport(now, loss, rtt_s=0.05)))
    return targets


def changes(targets: list[EncoderTarget]) -> int:
    return sum(1 for a, b in itertools.pairwise(targets) if a != b)


def noisy(rate: float, n: int, packets: int = 50, seed: int = 1) -> list[float]:
    """Per-report loss fractions of a Bernoulli(rate) path, ``packets`` packets per report."""
    rng = random.Random(seed)
    return [sum(rng.random() < rate for _ in range(packets)) / packets for _ in range(n)]


# What a path's feedback looks like as the tap (agent/feedback.py) sees it, 50 packets/s each
# lost with probability ``rate`` from ``loss_from`` on: returns (time, encoder bitrate) after
# each report. RTCP receiver reports as aiortc sends them (one per second, the fraction in
# 1/256ths); transport-cc as Chromium does (a feedback every 62.5 ms, judged in windows).
Feed = Callable[[float, float, int, float], list[tuple[float, int]]]


def _tap(clock: Callable[[], float] = lambda: 0.0) -> tuple[FeedbackTap, list[int]]:
    controller = BitrateController(SETTINGS, CEILING)
    applied: list[int] = []
    sender = SimpleNamespace(_ssrc=1)
    apply = Applier(applied.append, bool, int)
    tap = FeedbackTap(sender, controller, apply, clock=clock)  # type: ignore[arg-type]
    tap._apply(controller.target)
    return tap, applied


def receiver_reports(
    rate: float, seconds: float, seed: int, loss_from: float = 0.0
) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    clock = [0.0]
    tap, applied = _tap(lambda: clock[0])
    bitrates = []
    highest = 0
    while (now := clock[0] + 1.0) <= seconds:
        clock[0] = now
        lost = sum(rng.random() < rate for _ in range(50)) if now > loss_from else 0
        highest += 50
        info = RtcpReceiverInfo(
            ssrc=1,
            fraction_lost=lost * 256 // 50,
            packets_lost=0,
            highest_sequence=highest,
            jitter=0,
            lsr=0,
            dlsr=0,
        )
        tap._on_rtcp_packet(RtcpRrPacket(ssrc=99, reports=[info]))
        bitrates.append((now, applied[-1]))
    return bitrates


def transport_cc(
    rate: float, seconds: float, seed: int, loss_from: float = 0.0
) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    tap, applied = _tap()
    bitrates = []
    now = 0.0
    while now < seconds:
        now += 0.0625
        packets = 3 if round(now / 0.0625) % 8 else 4  # 50 per second
        lost = sum(rng.random() < rate for _ in range(packets)) if now > loss_from else 0
        tap._count_twcc_loss(now, packets, lost)
        bitrates.append((now, applied[-1]))
    return bitrates


@pytest.mark.parametrize("feed", [receiver_reports, transport_cc])
@pytest.mark.parametrize("rate", [0.03, 0.04])
def test_steady_loss_in_the_hold_band_holds_whichever_feedback_reports_it(
    feed: Feed, rate: float
) -> None:
    """Between loss_increase and loss_decrease the rate holds: per-report smoothing let a
    transport-cc window's noise (0-12% on a 3% path) cut it again and again, and cutting
    whenever the fast estimate crossed 5% sank a 4% path to the FEC floor either way."""
    for seed in range(5):
        reports = feed(rate, 120.0, seed, 0.0)
        tail = [bitrate for time, bitrate in reports if time > 30.0]  # the last 90 s
        moves = sum(1 for a, b in itertools.pairwise(tail) if a != b)
        assert min(tail) >= 0.75 * CEILING and moves <= 8, (seed, min(tail), moves)


@pytest.mark.parametrize("feed", [receiver_reports, transport_cc])
def test_a_jump_to_ten_percent_loss_is_still_cut_promptly(feed: Feed) -> None:
    for seed in range(5):
        reports = feed(0.10, 60.0, seed, 20.0)
        first_cut = next(time for time, bitrate in reports if bitrate < CEILING)
        at_floor = next(time for time, bitrate in reports if bitrate == SETTINGS.fec_min_bitrate)
        assert 20.0 < first_cut <= 23.5, (seed, first_cut)
        assert at_floor <= 50.0, (seed, at_floor)


def test_loss_is_smoothed_per_packet_not_per_report() -> None:
    """Two 25-packet reports move the estimates as one 50-packet report of the same loss,
    and a 250-packet one (Chromium's 5 s receiver report) as five."""
    one = BitrateController(SETTINGS, CEILING)
    one.on_loss_report(LossReport(1.0, 0.04, packets=50))
    two = BitrateController(SETTINGS, CEILING)
    two.on_loss_report(LossReport(0.5, 0.04, packets=25))
    two.on_loss_report(LossReport(1.0, 0.04, packets=25))
    assert one.loss == pytest.approx(two.loss) and one.loss == pytest.approx(0.02)
    five = BitrateController(SETTINGS, CEILING)
    five.on_loss_report(LossReport(5.0, 0.04, packets=250))
    assert five.loss == pytest.approx(0.04 * (1 - 0.5**5))


def test_clean_path_stays_at_the_ceiling_with_no_fec() -> None:
    controller = BitrateController(SETTINGS, CEILING)
    targets = run(controller, [0.0] * 60)
    assert all(t == EncoderTarget(CEILING, False, 0) for t in targets)


def test_ten_percent_loss_turns_fec_on_at_once_and_lowers_bitrate_by_the_second_report() -> None:
    controller = BitrateController(SETTINGS, CEILING)
    run(controller, [0.0] * 5)
    first = controller.on_loss_report(LossReport(6.0, 0.10))
    assert first.fec and first.expected_loss_pct >= 10
    second = controller.on_loss_report(LossReport(7.0, 0.10))
    assert second.bitrate < CEILING
    later = run(controller, [0.10] * 20, start=7.0)
    assert later[-1].bitrate == SETTINGS.fec_min_bitrate  # settles at the FEC floor
    assert all(t.fec for t in later)


def test_five_percent_loss_holds_the_rate_and_protects_with_fec() -> None:
    controller = BitrateController(SETTINGS, CEILING)
    targets = run(controller, [0.05] * 30)
    assert all(t.bitrate == CEILING for t in targets)
    assert all(t.fec for t in targets)
    # libopus only makes room for FEC when told more than 5%.
    assert all(t.expected_loss_pct >= SETTINGS.fec_min_expected_loss_pct for t in targets)


def test_twenty_percent_loss_drops_fast_and_expects_twenty_percent() -> None:
    controller = BitrateController(SETTINGS, CEILING)
    targets = run(controller, [0.20] * 10)
    assert targets[0].bitrate == int(CEILING * 0.95)  # smoothed: half of 20% at first
    assert targets[0].fec and targets[0].expected_loss_pct == 20
    assert targets[5].bitrate == SETTINGS.fec_min_bitrate
    assert 15 <= targets[-1].expected_loss_pct <= 20  # the sustained loss, from below


def test_loss_that_ends_climbs_back_in_steps_and_fec_goes_off_later() -> None:
    controller = BitrateController(SETTINGS, CEILING)
    run(controller, [0.10] * 12)
    assert controller.target.bitrate == SETTINGS.fec_min_bitrate
    recovery = run(controller, [0.0] * 15, start=12.0)
    rates = [t.bitrate for t in recovery]
    assert rates[0] == SETTINGS.fec_min_bitrate  # held right after the last decrease
    assert rates == sorted(rates)  # steps up, never down
    assert len(set(rates)) >= 3  # in steps, not one jump
    assert rates[-1] == CEILING
    # FEC stays on through the hold-off, then goes off.
    fec = [t.fec for t in recovery]
    assert fec[: int(SETTINGS.fec_off_after_s) - 1] == [True] * (int(SETTINGS.fec_off_after_s) - 1)
    assert fec[-1] is False and recovery[-1].expected_loss_pct == 0


def test_the_climb_back_is_per_second_however_often_reports_come() -> None:
    """README: "it climbs back 15% per second". Compounded per report instead, transport-cc
    feedback (~16 reports a second) would climb many times faster than receiver reports
    (one a second): from the floor to the ceiling (x1.6, ~3.4 s at 15%/s) in under one."""
    climbs = {}
    for every in (0.25, 1.0):
        controller = BitrateController(SETTINGS, CEILING)
        run(controller, [0.10] * 12)
        assert controller.target.bitrate == SETTINGS.fec_min_bitrate
        now, risen, top = 12.0, None, None
        while top is None and now < 40:
            now += every  # 50 packets a second, each report its share
            report = LossReport(now, 0.0, rtt_s=0.05, packets=round(50 * every))
            bitrate = controller.on_loss_report(report).bitrate
            if risen is None and bitrate > SETTINGS.fec_min_bitrate:
                risen = now - every  # it left the floor after the report before
            if bitrate == CEILING:
                top = now
        assert risen is not None and top is not None
        climbs[every] = top - risen
    assert all(2.5 <= seconds <= 4.5 for seconds in climbs.values()), climbs


def test_steady_noisy_loss_does_not_oscillate() -> None:
    for rate in (0.03, 0.10, 0.20):
        controller = BitrateController(SETTINGS, CEILING)
        targets = run(controller, noisy(rate, 120))
        tail = targets[30:]
        bitrates = [t.bitrate for t in tail]
        if rate >= 0.10:
            # Clearly lossy: settled at the FEC floor, only the expected loss moves, rarely.
            assert set(bitrates) == {SETTINGS.fec_min_bitrate}, rate
            assert changes(tail) <= 8, (rate, tail)
        else:
            # Inside the hold band the noise (reports of 0-8%) makes it wander a little near
            # the top; no sawtooth to the floor and back.
            assert changes(tail) <= 18, bitrates
            assert min(bitrates) >= 0.7 * CEILING, bitrates
        assert all(t.fec for t in tail), rate


def test_rtt_spike_backs_off_and_holds_until_it_passes() -> None:
    controller = BitrateController(SETTINGS, CEILING)
    now = 0.0
    for _ in range(10):
        now += 1
        controller.on_loss_report(LossReport(now, 0.0, rtt_s=0.05))
    spiked = controller.on_loss_report(LossReport(now + 1, 0.0, rtt_s=0.4))
    assert spiked.bitrate == int(CEILING * SETTINGS.congestion_backoff)
    assert not spiked.fec  # queueing is not loss: no FEC
    held = controller.on_loss_report(LossReport(now + 2, 0.0, rtt_s=0.4))
    assert held.bitrate <= spiked.bitrate
    calm = run(controller, [0.0] * 10, start=now + 2)
    assert calm[-1].bitrate == CEILING


def test_queueing_delay_from_transport_cc_backs_off_to_what_arrived() -> None:
    controller = BitrateController(SETTINGS, CEILING)
    controller.on_loss_report(LossReport(1.0, 0.0))
    target = controller.on_delay_report(DelayReport(1.1, 120.0, 50.0, receive_rate_bps=20_000))
    assert target.bitrate == int(20_000 * SETTINGS.congestion_backoff)
    # Rate-limited: a burst of feedback does not slam the rate to the floor.
    again = controller.on_delay_report(DelayReport(1.15, 130.0, 50.0, receive_rate_bps=16_000))
    assert again.bitrate == target.bitrate
    # Queueing that drains lets it climb again after the hold.
    for step in range(1, 40):
        controller.on_delay_report(DelayReport(1.1 + step * 0.1, 2.0, -1.0))
    assert controller.target.bitrate > target.bitrate


def test_remb_caps_while_fresh() -> None:
    controller = BitrateController(SETTINGS, CEILING)
    assert controller.on_remb(1.0, 18_000).bitrate == 18_000
    assert controller.tick(5.0).bitrate == 18_000
    assert controller.tick(12.0).bitrate == CEILING


def test_no_fec_when_the_receiver_cannot_decode_it() -> None:
    controller = BitrateController(SETTINGS, CEILING, fec_allowed=False)
    targets = run(controller, [0.10] * 5)
    assert not any(t.fec for t in targets)
    assert targets[-1].bitrate < CEILING


def test_ceiling_and_floors_hold() -> None:
    controller = BitrateController(SETTINGS, 24_000)
    targets = run(controller, [0.5] * 20 + [0.0] * 40)
    assert all(SETTINGS.fec_min_bitrate <= t.bitrate <= 24_000 for t in targets)
    congested = BitrateController(SETTINGS, CEILING)
    now = 0.0
    for _ in range(50):
        now += 0.5
        congested.on_delay_report(DelayReport(now, 200.0, 10.0, receive_rate_bps=1_000))
    assert congested.target.bitrate == SETTINGS.min_bitrate


def test_receiver_ceiling_below_the_floors_wins() -> None:
    """maxaveragebitrate=8000: the target never exceeds it, whatever the floors say."""
    controller = BitrateController(SETTINGS, 8_000)
    targets = run(controller, [0.2] * 5 + [0.0] * 10)
    assert all(t.bitrate <= 8_000 for t in targets)
    assert controller.target.bitrate == 8_000


def test_a_report_after_hours_of_silence_does_not_overflow() -> None:
    controller = BitrateController(SETTINGS, CEILING)
    controller.on_loss_report(LossReport(1.0, 0.0))
    controller.on_delay_report(DelayReport(1.1, 120.0, 50.0, receive_rate_bps=20_000))
    controller.on_delay_report(DelayReport(1.2, 1.0, -1.0))
    target = controller.on_loss_report(LossReport(6_000.0, 0.0))  # 100 minutes later
    assert target.bitrate <= CEILING


def test_a_report_without_loss_figures_updates_rtt_only() -> None:
    controller = BitrateController(SETTINGS, CEILING)
    run(controller, [0.1] * 3)
    before = controller.last_loss
    controller.on_loss_report(LossReport(10.0, None, rtt_s=0.07, jitter_s=0.002))
    assert controller.last_loss == before
    assert controller.rtt_s == 0.07 and controller.jitter_s == 0.002


def test_a_receiver_ceiling_below_what_libopus_can_do_is_raised_to_6_kbps() -> None:
    """libopus goes no lower than 6 kbps: a maxaveragebitrate under it gives a 6 kbps target."""
    assert BitrateController(SETTINGS, 4_000).target.bitrate == 6_000


def test_a_remb_below_the_congestion_floor_caps_at_the_floor() -> None:
    """REMB is a congestion signal: it caps the rate no lower than ``min_bitrate``."""
    controller = BitrateController(SETTINGS, CEILING)
    assert controller.on_remb(1.0, 5_000).bitrate == SETTINGS.min_bitrate


def test_a_climb_reaches_the_encoder_in_steps_of_at_least_min_step() -> None:
    """The estimate creeps up with every clean report; the encoder is told only when it has
    moved by MIN_STEP (8%) or reached a bound, so a recovery is a few changes, not dozens."""
    controller = BitrateController(SETTINGS, CEILING)
    run(controller, [0.10] * 12)
    rates = [t.bitrate for t in run(controller, [0.0] * 30, start=12.0, every=0.25)]
    steps = [(a, b) for a, b in itertools.pairwise(rates) if a != b]
    assert steps and rates[-1] == CEILING
    assert all(b >= a * 1.08 - 1 or b == CEILING for a, b in steps), steps


def test_loss_of_exactly_fec_on_loss_turns_fec_on() -> None:
    """FEC comes on with loss >= fec_on_loss (1%) over the newest 200 packets, the
    threshold included; one lost packet among the first 100 is 0.5% of that."""
    controller = BitrateController(SETTINGS, CEILING)
    assert not controller.on_loss_report(LossReport(1.0, SETTINGS.fec_on_loss, packets=100)).fec
    assert controller.on_loss_report(LossReport(2.0, SETTINGS.fec_on_loss, packets=100)).fec
    controller = BitrateController(SETTINGS, CEILING)
    assert controller.on_loss_report(LossReport(1.0, SETTINGS.fec_on_loss, packets=200)).fec


def test_a_negative_rtt_is_ignored_and_does_not_poison_the_baseline() -> None:
    """A confused peer's negative RTT is no sample: a normal RTT after it is no spike."""
    controller = BitrateController(SETTINGS, CEILING)
    controller.on_loss_report(LossReport(1.0, 0.0, rtt_s=-1.0))
    assert controller.rtt_s is None
    target = controller.on_loss_report(LossReport(2.0, 0.0, rtt_s=0.05))
    assert target.bitrate == CEILING and controller.last_reason == "start"


def test_queueing_between_hold_and_overuse_holds_the_climb() -> None:
    """transport-cc queueing above queuing_delay_hold_ms (not yet over-use) holds climbing,
    whatever clean loss reports say meanwhile."""
    controller = BitrateController(SETTINGS, CEILING)
    controller.on_loss_report(LossReport(1.0, 0.0))
    backed_off = controller.on_delay_report(DelayReport(1.1, 120.0, 50.0)).bitrate
    assert backed_off < CEILING
    now = 1.1
    for _ in range(20):  # long past increase_hold_s
        now += 0.5
        controller.on_delay_report(DelayReport(now, 40.0, 0.0))
        controller.on_loss_report(LossReport(now, 0.0))
    assert controller.target.bitrate == backed_off


@pytest.mark.parametrize("kind", ["queueing", "rtt"])
def test_a_congestion_signal_that_stops_coming_stops_holding_the_climb(kind: str) -> None:
    """A spike whose kind of feedback then stops (transport-cc dropped, receiver reports
    without an RTT) holds climbing only CONGESTION_FRESH_S: clean loss reports then raise
    the bitrate again."""
    controller = BitrateController(SETTINGS, CEILING)
    for second in range(1, 11):
        controller.on_loss_report(LossReport(float(second), 0.0, rtt_s=0.05))
    if kind == "queueing":
        backed_off = controller.on_delay_report(DelayReport(10.5, 120.0, 50.0)).bitrate
    else:
        backed_off = controller.on_loss_report(LossReport(10.5, 0.0, rtt_s=0.4)).bitrate
    assert backed_off < CEILING
    now = 10.5
    while now < 10.5 + CONGESTION_FRESH_S:  # still fresh: held
        now += 1
        controller.on_loss_report(LossReport(now, 0.0))
    assert controller.target.bitrate == backed_off
    for _ in range(10):
        now += 1
        controller.on_loss_report(LossReport(now, 0.0))
    assert controller.target.bitrate == CEILING


def test_queueing_that_drains_is_not_over_use() -> None:
    """High queueing with a falling delay trend is draining: no back-off."""
    controller = BitrateController(SETTINGS, CEILING)
    controller.on_loss_report(LossReport(1.0, 0.0))
    assert controller.on_delay_report(DelayReport(1.1, 120.0, -50.0)).bitrate == CEILING


def test_fec_goes_off_by_the_clock_when_no_reports_come() -> None:
    """tick(): with no reports at all, FEC still goes off fec_off_after_s after the last loss."""
    controller = BitrateController(SETTINGS, CEILING)
    assert controller.on_loss_report(LossReport(1.0, 0.10)).fec
    assert controller.tick(1.0 + SETTINGS.fec_off_after_s - 1).fec
    off = controller.tick(1.0 + SETTINGS.fec_off_after_s)
    assert not off.fec and off.expected_loss_pct == 0


def test_the_rtt_baseline_is_relearned_after_a_minute_on_a_slower_path() -> None:
    """The baseline is the minimum of the last minute: a route change to a steadily longer
    RTT backs off at first, then is the new normal and the rate climbs back."""
    controller = BitrateController(SETTINGS, CEILING)
    now = 0.0
    for _ in range(10):
        now += 1
        controller.on_loss_report(LossReport(now, 0.0, rtt_s=0.05))
    for _ in range(90):
        now += 1
        controller.on_loss_report(LossReport(now, 0.0, rtt_s=0.3))
    assert controller.target.bitrate == CEILING


def test_the_rtt_baseline_is_the_minimum_not_the_jittery_top() -> None:
    """With RTTs jittering between 100 and 150 ms, 280 ms is a spike against the 100 ms
    baseline (above 2 x 100 ms and 100 ms + 100 ms)."""
    controller = BitrateController(SETTINGS, CEILING)
    now = 0.0
    for i in range(10):
        now += 1
        controller.on_loss_report(LossReport(now, 0.0, rtt_s=0.10 if i % 2 else 0.15))
    spiked = controller.on_loss_report(LossReport(now + 1, 0.0, rtt_s=0.28))
    assert spiked.bitrate < CEILING and controller.last_reason == "round-trip time"


def test_an_rtt_that_doubles_by_less_than_the_minimum_rise_is_no_spike() -> None:
    """A spike must be both rtt_spike_factor x the baseline and rtt_spike_min_s above it:
    50 -> 120 ms more than doubles but is only 70 ms up, a short path's noise."""
    controller = BitrateController(SETTINGS, CEILING)
    now = 0.0
    for _ in range(10):
        now += 1
        controller.on_loss_report(LossReport(now, 0.0, rtt_s=0.05))
    assert controller.on_loss_report(LossReport(now + 1, 0.0, rtt_s=0.12)).bitrate == CEILING


def test_after_loss_the_climb_waits_for_the_slow_estimate_too() -> None:
    """Climbing needs both the fast and the slow loss estimate at or below loss_increase:
    after a 10% spell the fast one is clean within 3 reports, the slow one takes ~7."""
    controller = BitrateController(SETTINGS, CEILING)
    run(controller, [0.10] * 12)
    recovery = run(controller, [0.0] * 5, start=12.0)
    assert all(t.bitrate == SETTINGS.fec_min_bitrate for t in recovery)


def test_no_climb_within_the_hold_after_a_decrease() -> None:
    """After a decrease the rate holds for increase_hold_s, however clean the path reads."""
    controller = BitrateController(SETTINGS, CEILING)
    controller.on_loss_report(LossReport(1.0, 0.0))
    backed_off = controller.on_delay_report(DelayReport(1.1, 120.0, 50.0)).bitrate
    now = 1.1
    while now < 1.1 + SETTINGS.increase_hold_s - 0.15:
        now += 0.1
        assert controller.on_delay_report(DelayReport(now, 2.0, -1.0)).bitrate == backed_off
    for _ in range(10):
        now += 0.1
        controller.on_delay_report(DelayReport(now, 2.0, -1.0))
    assert controller.target.bitrate > backed_off
