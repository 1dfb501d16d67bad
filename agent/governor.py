"""One Opus setting for the whole process: made cheaper while the CPU cannot keep up, then restored.

Why: libopus is most of a speaking session's CPU (55-58% of the server's, bench/README), and
its cost falls steeply with complexity and with the coded band. A process with more speaking
sessions than its core can encode at complexity 9 falls behind for all of them at once:
every packet late, gaps, every browser stretching its jitter buffer. Stepping down instead
costs everyone a little quality, and only while the load lasts (WebRTC's CPU overuse
detector does the same with video resolution).

The rungs (one run of bench/opus_cost.py, 2026-11-30 07:45 UTC, libopus 1.6, 32 kbps speech;
cost relative to complexity 9 in that run, PESQ-WB, which hears 0-8 kHz only): full band at 9
(1.0, 3.99), 7 (0.90, 3.99), 6 (0.87, 3.91); then the band capped at wide-band (8 kHz of
audio: libopus codes SILK alone, no CELT layer for 8-12 kHz) at 6 (0.70, 4.25) and 2 (0.49,
3.57); then medium-band (6 kHz of audio) at 0 (0.22, 3.88). Full band at 2 or 0 would cost
0.64 or 0.43 for 3.02 or 2.97: dearer than wide-band at the same complexity and worse below
8 kHz, so under load the band goes first (the speech loses its top octave, "HD voice"
instead of super-wide-band) and the coding precision after.

At the bottom, medium-band at 0 replaces wide-band at 0 (0.30, 3.40): cheaper, and it scored
better (a clip with more sibilants agreed: 4.00 vs 3.80, for 0.25 vs 0.28; bench/README).
PESQ-WB prefers medium-band at 2 over wide-band at 2 as well (3.95 vs 3.57, for less); wide-
band 2 stays on the ladder as a judgement, not a measurement: it keeps 6-8 kHz (sibilants),
which PESQ-WB barely hears, and only the last rung gives that up. Medium-band at 1 costs
about what 0 does (a floor of 1 ends there). SILK narrows from wide- to medium-band through
a low-pass transition: the last rung's saving arrives about 3 s after the step (widening
back takes a quarter of a second). ``cap_band=False`` keeps the full band and steps
complexity alone: 9, 7, 6, 2, 0.

How: a timer on the event loop wakes every ``probe_s`` and notes
- load: the loop thread's CPU time over the wall time since the last probe. The loop is one
  thread: near 100% its callbacks queue and run late. Other threads do not count: an
  in-process ChatTTS on the CPU keeps one core free for the loop on purpose, and encode
  worker threads that fall behind hand their frames back to the loop (agent/track.py),
  which then shows the load;
- lateness: how late the probe itself fired, which is how late a packet's timer fires too.
  It sees what the load does not: other processes or threads taking the loop's core.

Every ``window_probes`` probes ``ComplexityPolicy`` decides: one rung down the ladder when
the loop was saturated or late, one rung up once it has been calm for a hold, a hold that
doubles each time a climb had to be undone (no flapping), and every registered encoder
follows.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from agent.opus import OpusEncoder, OpusError

log = logging.getLogger(__name__)

# The complexities worth stopping at (bench/opus_cost.py, libopus 1.6, 32 kbps speech; the
# module docstring has one run's figures): 7 codes as well as 9 for less; 6 is cheaper again;
# 3-5 cost about what 6 does and sound worse, so the next step is 2; 0 is a third cheaper
# still at about the same quality as 2.
RUNGS = (10, 9, 7, 6, 2, 0)
# With the band cap: full band no lower than this, then wide-band from it down ...
LOWEST_FULL_BAND = 6
# ... and medium-band at complexities up to this one.
HIGHEST_MEDIUM_BAND = 1
# The band caps, as playback rates (OpusEncoder.set_band_cap).
WIDE_BAND_HZ = 16_000  # 8 kHz of audio
MEDIUM_BAND_HZ = 12_000  # 6 kHz of audio
_BAND_NAMES: dict[int | None, str] = {None: "", WIDE_BAND_HZ: "wb", MEDIUM_BAND_HZ: "mb"}


@dataclass(frozen=True)
class Rung:
    complexity: int
    band_cap_hz: int | None = None  # the coded band capped (WIDE_BAND_HZ...); None: full band

    def __str__(self) -> str:
        return f"{_BAND_NAMES[self.band_cap_hz]}{self.complexity}"


def _capped_band(complexity: int) -> int:
    return MEDIUM_BAND_HZ if complexity <= HIGHEST_MEDIUM_BAND else WIDE_BAND_HZ


def _between(floor: int, ceiling: int) -> list[int]:
    return sorted({floor, ceiling, *(r for r in RUNGS if floor < r < ceiling)})


def ladder(ceiling: int, floor: int, cap_band: bool = True) -> tuple[Rung, ...]:
    """The rungs the governor may use, cheapest first, from ``floor`` to ``ceiling``: full band
    down to complexity 6 (or the floor), then, with ``cap_band`` and a floor of 6 or less, a
    capped band from there down to the floor: wide-band, medium-band at complexity 1 or 0;
    one rung (nothing to govern) when ``floor == ceiling``."""
    if not 0 <= floor <= ceiling <= 10:
        raise ValueError(f"need 0 <= floor <= ceiling <= 10, got floor {floor}, ceiling {ceiling}")
    # A floor above 6 is an operator protecting quality: the band stays full then too.
    if floor == ceiling or not cap_band or floor > LOWEST_FULL_BAND:
        return tuple(Rung(c) for c in _between(floor, ceiling))
    lowest_full = max(floor, min(LOWEST_FULL_BAND, ceiling))
    return tuple(
        [Rung(c, _capped_band(c)) for c in _between(floor, lowest_full)]
        + [Rung(c) for c in _between(lowest_full, ceiling)]
    )


@dataclass(frozen=True)
class GovernorTuning:
    """The control law's constants (module docstring); tests shorten the times."""

    probe_s: float = 0.1
    window_probes: int = 5  # two decisions a second
    high_load: float = 0.85  # loop busier than this: overloaded
    low_load: float = 0.55  # ... calmer than this (and not late): room to climb
    high_late_s: float = 0.020  # a window's probes this late: overloaded
    low_late_s: float = 0.008
    # A new complexity applies from the next frame: half a second shows its effect, and a
    # sudden overload reaches the floor from 9 in 2.5 s (5 steps down the default ladder).
    down_interval_s: float = 0.5
    up_hold_s: float = 5.0  # calm this long (and as long since the last change) to climb a rung
    max_up_hold_s: float = 60.0  # a climb that keeps being undone waits up to this long
    calm_reset_s: float = 60.0  # a climb that held this long: back to the short hold

    def __post_init__(self) -> None:
        if self.probe_s <= 0 or self.window_probes < 1:
            raise ValueError("probe_s must be positive and window_probes at least 1")
        if not 0 < self.low_load < self.high_load or not 0 <= self.low_late_s < self.high_late_s:
            raise ValueError("low thresholds must be below high ones")


# Decisions come at multiples of probe_s: an interval that is exactly due must not be missed
# to floating-point rounding.
_SLACK_S = 1e-3


class ComplexityPolicy:
    """The decision alone (no clocks, no loop): fed one window's load and lateness at a time."""

    def __init__(
        self, ceiling: int, floor: int, tuning: GovernorTuning, cap_band: bool = True
    ) -> None:
        self.rungs = ladder(ceiling, floor, cap_band)
        self.tuning = tuning
        self._window_s = tuning.probe_s * tuning.window_probes
        self._index = len(self.rungs) - 1
        self._last_down = -math.inf
        self._last_up = -math.inf
        self._calm_since: float | None = None  # start of the current run of calm windows
        self._hold = tuning.up_hold_s
        self.steps_down = 0
        self.steps_up = 0

    @property
    def rung(self) -> Rung:
        return self.rungs[self._index]

    @property
    def complexity(self) -> int:
        return self.rung.complexity

    @property
    def up_hold_s(self) -> float:
        return self._hold

    def decide(self, now: float, load: float, late_s: float) -> Rung | None:
        """The new rung if this window changes it, else None."""
        t = self.tuning
        calm = load <= t.low_load and late_s <= t.low_late_s
        if not calm:
            self._calm_since = None
        elif self._calm_since is None:
            self._calm_since = now - self._window_s  # the window just measured was calm
        if load >= t.high_load or late_s >= t.high_late_s:
            if self._index == 0 or now - self._last_down < t.down_interval_s - _SLACK_S:
                return None
            if self._last_up > self._last_down and now - self._last_up < self._hold:
                # The last climb did not hold: wait longer before trying it again (once per
                # undone climb, not once per rung of the descent that follows).
                self._hold = min(self._hold * 2, t.max_up_hold_s)
            self._index -= 1
            self._last_down = now
            self.steps_down += 1
            return self.rung
        if self._last_up > self._last_down and now - self._last_up >= t.calm_reset_s:
            self._hold = t.up_hold_s  # the last climb held: forget the flapping
        if calm and self._index < len(self.rungs) - 1:
            assert self._calm_since is not None
            if now - max(self._calm_since, self._last_down, self._last_up) < self._hold - _SLACK_S:
                return None
            self._index += 1
            self._last_up = now
            self.steps_up += 1
            return self.rung
        return None


class ComplexityGovernor:
    """Holds every encoder of the process at the policy's rung (complexity and band cap); one
    per process.

    ``register`` an encoder when it is created (sessions, room speakers); closed encoders
    drop out by themselves. The probe timer starts with the first encoder registered on a
    running loop and runs until ``close``; with a one-rung ladder (``floor == ceiling``)
    there is nothing to govern and it never starts.
    """

    def __init__(
        self,
        ceiling: int,
        floor: int,
        tuning: GovernorTuning | None = None,
        *,
        cap_band: bool = True,
        thread_time: Callable[[], float] = time.thread_time,
    ) -> None:
        self.tuning = tuning or GovernorTuning()
        self.policy = ComplexityPolicy(ceiling, floor, self.tuning, cap_band)
        self._encoders: weakref.WeakSet[OpusEncoder] = weakref.WeakSet()
        self._thread_time = thread_time  # called on the loop thread: its CPU clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._last: tuple[float, float] = (0.0, 0.0)  # wall, loop thread's CPU
        self._window_busy = 0.0
        self._window_wall = 0.0
        self._window_late: list[float] = []
        self.load = 0.0  # the last window's figures, for logs and /metrics
        self.late_s = 0.0
        self._closed = False

    @property
    def complexity(self) -> int:
        return self.policy.complexity

    @property
    def rung(self) -> Rung:
        return self.policy.rung

    @property
    def enabled(self) -> bool:
        return len(self.policy.rungs) > 1

    @property
    def encoders(self) -> int:
        """Open encoders governed now."""
        return sum(1 for encoder in self._encoders if not encoder.closed)

    def register(self, encoder: OpusEncoder) -> None:
        """Govern ``encoder`` from now on, starting at the current rung."""
        if not self.enabled:
            return
        _set_rung(encoder, self.rung)
        self._encoders.add(encoder)
        self._start()

    def _start(self) -> None:
        if self._closed:
            return
        if self._timer is not None and self._loop is not None and not self._loop.is_closed():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # built outside a loop (tests): the next registration on one starts it
        self._loop = loop
        self._window_busy = self._window_wall = 0.0
        self._window_late.clear()
        self._last = (loop.time(), self._thread_time())
        self._schedule(loop.time() + self.tuning.probe_s)

    def _schedule(self, when: float) -> None:
        assert self._loop is not None
        self._due = when
        # An empty context: call_at copies the caller's, and the first schedule happens in
        # the first session's offer; each probe re-schedules from its own, so every governor
        # line would name that session for the life of the process.
        self._timer = self._loop.call_at(when, self._probe, context=contextvars.Context())

    def _probe(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        thread = self._thread_time()
        wall0, thread0 = self._last
        self._last = (now, thread)
        self._window_busy += thread - thread0
        self._window_wall += now - wall0
        self._window_late.append(max(0.0, now - self._due))
        self._schedule(now + self.tuning.probe_s)
        if len(self._window_late) >= self.tuning.window_probes:
            self._decide(now)

    def _decide(self, now: float) -> None:
        late = sorted(self._window_late)
        # The second-latest probe: one stall (a DTLS handshake, a collection) is not overload.
        self.late_s = late[-2] if len(late) > 1 else late[-1]
        self.load = self._window_busy / self._window_wall if self._window_wall > 0 else 0.0
        self._window_busy = self._window_wall = 0.0
        self._window_late.clear()
        before = self.rung
        after = self.policy.decide(now, self.load, self.late_s)
        if after is None:
            return
        self._apply(after)
        log.info(
            "loop load %.0f%%, timers %.0f ms late: Opus complexity %s -> %s for %d encoders "
            "(wb/mb: band capped at wide-/medium-band; next climb after %.0f s of calm)",
            self.load * 100,
            self.late_s * 1000,
            before,
            after,
            self.encoders,
            self.policy.up_hold_s,
        )

    def _apply(self, rung: Rung) -> None:
        for encoder in list(self._encoders):
            try:
                _set_rung(encoder, rung)
            except OpusError:  # closed meanwhile (its session ended)
                self._encoders.discard(encoder)

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop = None


def _set_rung(encoder: OpusEncoder, rung: Rung) -> None:
    if encoder.complexity != rung.complexity:
        encoder.set_complexity(rung.complexity)
    if encoder.band_cap != rung.band_cap_hz:
        encoder.set_band_cap(rung.band_cap_hz)
