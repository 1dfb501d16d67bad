"""The bitrate controller: what the receiver reports -> Opus bitrate, in-band FEC, expected loss.

One controller per outgoing audio stream. Every input carries its own time (monotonic
seconds), so the law is a pure function of the report sequence and is tested on recorded
sequences. The control law:

Loss (RTCP receiver reports; transport-cc windows where the peer sends them):
- FEC: a report with loss turns in-band FEC on when the newest FEC_WINDOW_PACKETS (200)
  packets lost at least ``fec_on_loss``, and sets the expected loss to the smoothed loss (at
  least ``fec_min_expected_loss_pct``: libopus only narrows the band to fit FEC above 5%);
  FEC goes off after ``fec_off_after_s`` without loss. Hysteresis by time, so a path with
  sporadic loss does not flap.
Bitrate decisions use loss smoothed per packet (so a receiver report of ~50 packets and two
transport-cc windows of ~25 weigh the same), in three estimates: fast (the newest 50 packets
weigh half: about the last 2 s), slow (a fifth: ~5 s) and long-run (3%: ~30 s).
- fast > ``loss_decrease`` and either the long-run one is too (a steady lossy path) or the
  fast one is 1.2 x ``loss_decrease`` above the long-run one (a jump: 10% after a clean
  path is cut by the second or third 50-packet report, as their sampled loss comes out: a
  lower threshold would also cut a steady 4% path whenever two reports read high):
  bitrate x (1 - fast / 2) (GCC's loss rule), at most once per ``decrease_interval_s``,
  not below ``fec_min_bitrate``: random loss is not cured by a lower rate, FEC cures it,
  and below that floor libopus has no bits left for FEC. The fast estimate alone is above
  5% a quarter of the time on a 4% path.
- otherwise, unless both fast and slow are <= ``loss_increase``: hold. A steady 3-4% path
  settles near the ceiling, it does not oscillate (nearer 5% the long-run estimate crosses
  more often: such a path drifts down).
- fast and slow <= ``loss_increase``: climb by ``increase_per_s`` (compounded over the time
  since the last update) to the ceiling, but not within ``increase_hold_s`` of a decrease.

Congestion (queueing, not random loss), where the floor is ``min_bitrate``:
- transport-cc: queueing delay above ``queuing_delay_overuse_ms`` and growing faster than
  ``queuing_delay_trend_ms_per_s`` means the path is over-used: bitrate x
  ``congestion_backoff`` (and at most that fraction of the rate the receiver actually got);
  queueing above ``queuing_delay_hold_ms`` holds climbing (while the report saying so is
  under CONGESTION_FRESH_S old).
- RTT above ``rtt_spike_factor`` x its baseline (the minimum of the last minute) and at least
  ``rtt_spike_min_s`` above it: same backoff, and no climbing while it lasts (as above).
- REMB (where a peer sends one): an upper bound for as long as it is fresh (10 s).

The ceiling is ``OpusSettings.bitrate`` lowered by the browser's ``maxaveragebitrate``; a
clean path starts and stays there. FEC is never used when the receiver did not offer
``useinbandfec=1`` (RFC 7587: it could not decode it).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from agent.config import AdaptationSettings

REMB_FRESH_S = 10.0
# A round-trip spike or queueing holds climbing only while the reports saying so are this
# recent: a peer that stops sending one kind of feedback (transport-cc dropped in a
# renegotiation, say) must not hold the bitrate down for the rest of the call. Chromium's
# audio receiver reports come every ~2.5-7 s, transport-cc every ~100 ms.
CONGESTION_FRESH_S = 10.0
RTT_BASELINE_WINDOW_S = 60.0
# FEC is decided on the loss of at least this many packets (the newest reports covering
# them; fewer at the start count as this many): one lost packet was 4% of a 25-packet
# transport-cc window and 0.4% of a Chromium 250-packet receiver report, so a path losing
# one packet in 400 had FEC on for good with one kind of feedback and off with the other
# (found by review). 200 packets: 4 s of audio; a 1% path loses 2 in it on average.
FEC_WINDOW_PACKETS = 200
# Loss is smoothed per packet, not per report: an RTCP receiver report covers ~50 packets
# (aiortc's: ~1 s; Chromium's: ~5 s, ~250), a transport-cc window ~25. Per REPORT_PACKETS
# packets the newest loss weighs this much in each estimate, so both kinds of feedback give
# the same estimates on the same path.
REPORT_PACKETS = 50
LOSS_SMOOTHING = 0.5  # the fast estimate: about the last 100 packets (2 s)
SLOW_LOSS_SMOOTHING = 0.2  # the slow one: about the last 250 (5 s)
LONG_LOSS_SMOOTHING = 0.03  # the long-run one: about the last 1,700 (33 s)
# A fast estimate this many loss_decrease's above the long-run one is a jump, not noise.
LOSS_JUMP = 1.2
EXPECTED_LOSS_STEP = 3  # percentage points
MIN_STEP = 0.08  # smallest relative bitrate change passed to the encoder
MAX_CLIMB_STEP_S = 5.0


@dataclass(frozen=True)
class EncoderTarget:
    bitrate: int
    fec: bool
    expected_loss_pct: int
    # The receiver's maxplaybackrate (None: any): fixed for a call, carried by a room
    # subscriber's wish so that a shared encoder codes no wider than its listeners play.
    max_playback_rate: int | None = None


@dataclass(frozen=True)
class LossReport:
    """Loss over the interval since the previous report, and what else the report said."""

    time: float
    fraction_lost: float | None  # 0..1; None: the report says nothing new about loss
    rtt_s: float | None = None
    jitter_s: float | None = None
    source: str = "rr"  # "rr" (RTCP receiver report) or "twcc" (transport-cc window)
    packets: int | None = None  # how many packets the fraction is of; None: REPORT_PACKETS


@dataclass(frozen=True)
class DelayReport:
    """A transport-cc summary: queueing on the path and what the receiver got."""

    time: float
    queuing_delay_ms: float
    delay_trend_ms_per_s: float
    receive_rate_bps: float | None = None


class BitrateController:
    def __init__(
        self,
        settings: AdaptationSettings,
        ceiling: int,
        *,
        fec_allowed: bool = True,
        now: float = 0.0,
    ) -> None:
        # A receiver's maxaveragebitrate below our floors wins: the floors come down to it
        # (libopus itself goes no lower than 6 kbps).
        self.ceiling = max(6_000, ceiling)
        settings = replace(
            settings,
            min_bitrate=min(settings.min_bitrate, self.ceiling),
            fec_min_bitrate=min(settings.fec_min_bitrate, self.ceiling),
        )
        self.settings = settings
        self.fec_allowed = fec_allowed
        self._bitrate = float(self.ceiling)
        self._applied = self._bitrate  # what the encoder was last told
        self._fec = False
        self._expected_loss_pct = 0
        self._last_update = now
        self._last_decrease = -math.inf
        self._last_loss_time = -math.inf
        # (packets, lost) of the newest reports covering FEC_WINDOW_PACKETS, and their sums.
        self._fec_window: deque[tuple[int, float]] = deque()
        self._fec_packets = 0
        self._fec_lost = 0.0
        self._remb: tuple[float, int] | None = None  # (time, bitrate)
        self._rtt_samples: deque[tuple[float, float]] = deque(maxlen=256)
        # When the newest report of each kind said "congested" (None: it did not).
        self._rtt_elevated_at: float | None = None
        self._queueing_elevated_at: float | None = None
        # What the reports said, for stats.
        self.loss: float | None = None  # smoothed fraction lost (fast)
        self._slow_loss = 0.0
        self._long_loss = 0.0
        self.last_loss: float | None = None
        self.rtt_s: float | None = None
        self.jitter_s: float | None = None
        self.queuing_delay_ms: float | None = None
        self.reports = 0
        self.last_reason = "start"

    # --- what the encoder should do -------------------------------------------------------
    @property
    def target(self) -> EncoderTarget:
        bitrate = self._bitrate
        remb = self._remb_cap()
        if remb is not None:
            bitrate = min(bitrate, max(self.settings.min_bitrate, remb))
        # Climbing reaches the encoder in steps of at least MIN_STEP (or to a bound): the
        # estimate creeps with every clean report, the encoder need not. Decreases apply
        # at once: they answer loss or congestion.
        applied = self._applied
        bounds = (self.ceiling, self.settings.fec_min_bitrate, self.settings.min_bitrate)
        at_bound = bitrate in bounds
        if bitrate < applied or bitrate - applied >= MIN_STEP * applied or at_bound:
            self._applied = bitrate
        return EncoderTarget(
            bitrate=round(self._applied),
            fec=self._fec,
            expected_loss_pct=self._expected_loss_pct if self._fec else 0,
        )

    # --- inputs --------------------------------------------------------------------------
    def on_loss_report(self, report: LossReport) -> EncoderTarget:
        s = self.settings
        now = report.time
        self.reports += 1
        if report.jitter_s is not None:
            self.jitter_s = report.jitter_s
        if report.rtt_s is not None and report.rtt_s >= 0:
            self._on_rtt(now, report.rtt_s)
        if report.fraction_lost is None:
            return self.tick(now)
        loss = min(1.0, max(0.0, report.fraction_lost))
        self.last_loss = loss
        # Smoothed from a clean start: one lossy 50-packet report counts half in the fast one.
        packets = report.packets if report.packets and report.packets > 0 else REPORT_PACKETS
        self.loss = _smooth(self.loss or 0.0, loss, LOSS_SMOOTHING, packets)
        self._slow_loss = _smooth(self._slow_loss, loss, SLOW_LOSS_SMOOTHING, packets)
        self._long_loss = _smooth(self._long_loss, loss, LONG_LOSS_SMOOTHING, packets)

        # FEC and the loss libopus should expect.
        window = self._fec_window
        window.append((packets, loss * packets))
        self._fec_packets += packets
        self._fec_lost += loss * packets
        while len(window) > 1 and self._fec_packets - window[0][0] >= FEC_WINDOW_PACKETS:
            old_packets, old_lost = window.popleft()
            self._fec_packets -= old_packets
            self._fec_lost -= old_lost
        window_loss = self._fec_lost / max(self._fec_packets, FEC_WINDOW_PACKETS)
        if loss > 0 and window_loss >= s.fec_on_loss - 1e-9:
            self._last_loss_time = now
            if self.fec_allowed:
                self._fec = True
        elif self._fec and now - self._last_loss_time >= s.fec_off_after_s:
            self._fec = False
            self._expected_loss_pct = 0
            self.last_reason = "fec off: no loss"
        if self._fec:
            sustained = self._slow_loss
            if self._expected_loss_pct == 0:
                sustained = max(sustained, loss)
            percent = min(100, max(s.fec_min_expected_loss_pct, math.ceil(100 * sustained - 1e-9)))
            # Follow the sustained loss in steps of a quarter (at least EXPECTED_LOSS_STEP
            # points): libopus sizes FEC by it, and tracking every report's noise would only
            # churn the encoder. When FEC has just come on, the newest report counts in full.
            current = self._expected_loss_pct
            if current == 0 or abs(percent - current) >= max(EXPECTED_LOSS_STEP, current // 4):
                self._expected_loss_pct = percent

        # Bitrate, on smoothed loss: 50 packets' fraction is noisy (a 4% path reads 0-12%),
        # and so is the fast estimate (a 4% path has it above 5% a quarter of the time):
        # cutting whenever it crosses 5% sank a 4% path to the floor. See _lossy.
        if self._lossy():
            self._decrease(now, self._bitrate * (1 - self.loss / 2), s.fec_min_bitrate, "loss")
        elif self._clean() and not self._congested(now):
            self._increase(now)
        else:
            self._last_update = now
        return self.target

    def on_delay_report(self, report: DelayReport) -> EncoderTarget:
        s = self.settings
        self.queuing_delay_ms = report.queuing_delay_ms
        elevated = report.queuing_delay_ms > s.queuing_delay_hold_ms
        self._queueing_elevated_at = report.time if elevated else None
        growing = report.delay_trend_ms_per_s > s.queuing_delay_trend_ms_per_s
        if report.queuing_delay_ms > s.queuing_delay_overuse_ms and growing:
            proposal = self._bitrate * s.congestion_backoff
            # As GCC: at most that fraction of what arrived, whatever we were sending. A
            # queue growing while the agent is silent (~14 kbps) says the path carries less
            # than that: its speech would only fill the queue faster. (Skipping the bound
            # for a stream sending under its target, tried once, left a room subscriber on
            # a shared encoder and a REMB-capped stream congesting: reviewed.)
            if report.receive_rate_bps:
                proposal = min(proposal, report.receive_rate_bps * s.congestion_backoff)
            self._decrease(report.time, proposal, s.min_bitrate, "queueing delay")
        elif not self._congested(report.time) and self.loss is not None and self._clean():
            self._increase(report.time)
        return self.target

    def on_remb(self, time: float, bitrate: int) -> EncoderTarget:
        self._remb = (time, int(bitrate))
        return self.target

    def tick(self, now: float) -> EncoderTarget:
        """Time passing without reports: FEC hysteresis and REMB expiry still apply."""
        if self._fec and now - self._last_loss_time >= self.settings.fec_off_after_s:
            self._fec = False
            self._expected_loss_pct = 0
            self.last_reason = "fec off: no loss"
        if self._remb is not None and now - self._remb[0] > REMB_FRESH_S:
            self._remb = None
        return self.target

    @property
    def remb(self) -> int | None:
        return self._remb[1] if self._remb is not None else None

    # --- the law's parts -----------------------------------------------------------------
    def _on_rtt(self, now: float, rtt: float) -> None:
        s = self.settings
        self.rtt_s = rtt
        samples = self._rtt_samples
        while samples and now - samples[0][0] > RTT_BASELINE_WINDOW_S:
            samples.popleft()
        baseline = min((value for _, value in samples), default=rtt)
        samples.append((now, rtt))
        spike = rtt > max(baseline * s.rtt_spike_factor, baseline + s.rtt_spike_min_s)
        self._rtt_elevated_at = now if spike else None
        if spike:
            self._decrease(
                now, self._bitrate * s.congestion_backoff, s.min_bitrate, "round-trip time"
            )

    def _lossy(self) -> bool:
        """Loss that lowers the bitrate: the fast estimate above loss_decrease, and either the
        long-run one too (a steady lossy path: 6% reaches the floor in 1-2 minutes, 4% holds),
        or the fast one LOSS_JUMP x loss_decrease above the long-run one (a jump: 10% after
        a clean path is cut by the second or third report)."""
        limit = self.settings.loss_decrease
        fast = self.loss or 0.0
        long = self._long_loss
        return fast > limit and (long > limit or fast - long >= LOSS_JUMP * limit)

    def _clean(self) -> bool:
        limit = self.settings.loss_increase
        return (self.loss or 0.0) <= limit and self._slow_loss <= limit

    def _congested(self, now: float) -> bool:
        return any(
            at is not None and now - at <= CONGESTION_FRESH_S
            for at in (self._rtt_elevated_at, self._queueing_elevated_at)
        )

    def _decrease(self, now: float, proposal: float, floor: int, reason: str) -> None:
        self._last_update = now
        if now - self._last_decrease < self.settings.decrease_interval_s:
            return
        new = max(float(min(floor, self._bitrate)), min(self._bitrate, proposal))
        if new < self._bitrate:
            self._bitrate = new
            self._last_decrease = now
            self.last_reason = reason

    def _increase(self, now: float) -> None:
        s = self.settings
        # Capped: after a long quiet spell (a call on hold) one report must not compound a
        # huge exponent (it would overflow), nor jump further than a few seconds' climb.
        # From the hold's end at the earliest: a report 5 s after a decrease (Chromium's
        # receiver reports) climbed through the 2 s hold too, 2.0x instead of 1.5x (found by
        # review).
        climb_from = max(self._last_update, self._last_decrease + s.increase_hold_s)
        elapsed = min(MAX_CLIMB_STEP_S, max(0.0, now - climb_from))
        self._last_update = now
        if now - self._last_decrease < s.increase_hold_s or self._bitrate >= self.ceiling:
            return
        self._bitrate = min(float(self.ceiling), self._bitrate * (1 + s.increase_per_s) ** elapsed)
        self.last_reason = "clean path"

    def _remb_cap(self) -> int | None:
        return self._remb[1] if self._remb is not None else None


def _smooth(estimate: float, loss: float, per_report: float, packets: int) -> float:
    """``estimate`` moved towards ``loss`` measured over ``packets`` packets: by
    ``per_report`` for REPORT_PACKETS, compounded, so two 25-packet reports move it as
    one 50-packet report does."""
    weight: float = 1 - (1 - per_report) ** (packets / REPORT_PACKETS)
    return weight * loss + (1 - weight) * estimate
