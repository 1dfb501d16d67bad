"""The CPU governor of Opus complexity (agent/governor.py): its ladder, its control law, and
that a saturated event loop really moves every encoder of the process down and back up."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import os
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from agent.config import Config, OpusSettings, RoomSettings
from agent.governor import (
    MEDIUM_BAND_HZ,
    WIDE_BAND_HZ,
    ComplexityGovernor,
    ComplexityPolicy,
    GovernorTuning,
    Rung,
    ladder,
)
from agent.opus import OpusEncoder
from agent.playout import PlayoutBuffer
from agent.room import Room, SpeakerFeed
from agent.session import AgentSession
from agent.track import OpusPacketTrack
from signaling.errors import ApiError
from signaling.rooms import RoomRegistry
from signaling.sessions import SessionRegistry
from tests.doubles import ToneEngine

TUNING = GovernorTuning(
    probe_s=0.05,
    window_probes=4,
    down_interval_s=0.2,
    up_hold_s=0.5,
    max_up_hold_s=4.0,
    calm_reset_s=3.0,
)
# For tests that feed a fake CPU clock: real timer lateness on a loaded CI machine must not
# add steps of its own.
LOAD_ONLY = dataclasses.replace(TUNING, high_late_s=10.0, low_late_s=5.0)


def wb(complexity: int) -> Rung:
    return Rung(complexity, WIDE_BAND_HZ)


def mb(complexity: int) -> Rung:
    return Rung(complexity, MEDIUM_BAND_HZ)


def full(*complexities: int) -> tuple[Rung, ...]:
    return tuple(Rung(c) for c in complexities)


def test_the_ladder_spans_floor_to_ceiling_through_the_measured_rungs() -> None:
    # Full band down to 6, then wide-band (cheaper than full band at any complexity) down to
    # 2, then medium-band (at 1 or 0: cheaper than wide-band there, and it scored better).
    assert ladder(9, 0) == (mb(0), wb(2), wb(6), *full(6, 7, 9))
    assert ladder(10, 0) == (mb(0), wb(2), wb(6), *full(6, 7, 9, 10))
    assert ladder(5, 0) == (mb(0), wb(2), wb(5), *full(5))
    assert ladder(9, 1) == (mb(1), wb(2), wb(6), *full(6, 7, 9))
    assert ladder(9, 2) == (wb(2), wb(6), *full(6, 7, 9))  # a floor of 2 keeps 8 kHz of audio
    assert ladder(1, 0) == (mb(0), mb(1), *full(1))
    assert ladder(9, 4) == (wb(4), wb(6), *full(6, 7, 9))
    assert ladder(9, 6) == (wb(6), *full(6, 7, 9))
    assert ladder(9, 7) == full(7, 9)  # a floor above 6 protects quality: the band stays
    assert ladder(9, 9) == full(9)  # fixed: not even the band moves
    # Complexity alone (--full-band-under-load).
    assert ladder(9, 0, cap_band=False) == full(0, 2, 6, 7, 9)
    assert ladder(9, 4, cap_band=False) == full(4, 6, 7, 9)
    assert str(wb(2)) == "wb2" and str(mb(0)) == "mb0" and str(Rung(7)) == "7"
    for ceiling, floor in ((3, 4), (11, 0), (9, -1)):
        with pytest.raises(ValueError):
            ladder(ceiling, floor)
    with pytest.raises(ValueError):
        OpusSettings(complexity=5, complexity_floor=6)


def test_overload_steps_down_one_rung_per_interval_to_the_floor() -> None:
    policy = ComplexityPolicy(9, 0, TUNING, cap_band=False)
    assert policy.decide(0.0, 0.95, 0.0) == Rung(7)
    assert policy.decide(0.1, 0.95, 0.0) is None  # the last step has not shown its effect yet
    assert policy.decide(0.25, 0.95, 0.0) == Rung(6)
    assert policy.decide(0.5, 0.5, 0.030) == Rung(2)  # late timers alone are overload too
    assert policy.decide(0.75, 0.95, 0.0) == Rung(0)
    assert policy.decide(1.0, 0.95, 0.0) is None  # the floor
    assert (policy.complexity, policy.steps_down, policy.steps_up) == (0, 4, 0)


def test_under_load_the_band_narrows_before_complexity_goes_below_6() -> None:
    policy = ComplexityPolicy(9, 0, TUNING)
    down = [policy.decide(i * 0.25, 0.95, 0.0) for i in range(7)]
    assert [r for r in down if r is not None] == [Rung(7), Rung(6), wb(6), wb(2), mb(0)]
    assert policy.rung == mb(0) and policy.complexity == 0
    up = [policy.decide(2.0 + i * 0.2, 0.1, 0.0) for i in range(20)]
    assert [r for r in up if r is not None] == [wb(2), wb(6), Rung(6), Rung(7), Rung(9)]


def test_calm_climbs_a_rung_per_hold_and_busy_but_coping_stays_put() -> None:
    policy = ComplexityPolicy(9, 0, TUNING, cap_band=False)  # windows of 0.2 s, hold 0.5 s
    for t in (0.0, 0.25, 0.5, 0.75):
        policy.decide(t, 0.95, 0.0)
    assert policy.complexity == 0
    assert policy.decide(1.0, 0.1, 0.0) is None  # calm, but not for a hold yet
    assert policy.decide(1.3, 0.1, 0.0) == Rung(2)
    assert policy.decide(1.5, 0.1, 0.0) is None  # each climb waits a hold too
    assert policy.decide(1.85, 0.1, 0.0) == Rung(6)
    # Between the thresholds (busy, on time): neither direction.
    for t in (2.2, 3.0, 4.0):
        assert policy.decide(t, 0.7, 0.004) is None
    assert policy.decide(4.1, 0.1, 0.010) is None  # idle CPU but timers still late: no climb
    # Calm must last a whole hold: one calm window after a busy spell is not enough.
    assert policy.decide(4.3, 0.1, 0.0) is None
    assert policy.decide(4.5, 0.1, 0.0) is None
    assert policy.decide(4.6, 0.1, 0.0) == Rung(7)  # calm since 4.1 (its window began at 4.1)
    assert policy.decide(5.1, 0.1, 0.0) == Rung(9)
    assert policy.decide(9.0, 0.0, 0.0) is None  # the ceiling
    assert policy.steps_up == 4


def test_a_climb_that_is_undone_doubles_the_hold_until_a_calm_spell_resets_it() -> None:
    policy = ComplexityPolicy(9, 0, TUNING, cap_band=False)
    policy.decide(0.0, 0.95, 0.0)  # 7
    assert policy.decide(0.2, 0.1, 0.0) is None  # calm since 0.0
    assert policy.decide(0.5, 0.1, 0.0) == Rung(9)
    assert policy.decide(0.7, 0.95, 0.0) == Rung(7)  # the climb did not hold
    assert policy.up_hold_s == pytest.approx(1.0)
    # The descent that follows does not double it again at every rung.
    assert policy.decide(1.2, 0.95, 0.0) == Rung(6)
    assert policy.decide(1.7, 0.95, 0.0) == Rung(2)
    assert policy.up_hold_s == pytest.approx(1.0)
    assert policy.decide(2.0, 0.1, 0.0) is None  # calm since 1.8: 0.2 s < 1.0 s hold
    t = 2.85
    assert policy.decide(t, 0.1, 0.0) == Rung(6)
    holds = []
    for _ in range(4):  # flapping: each undone climb doubles the hold, up to the max
        t += 0.25
        assert policy.decide(t, 0.95, 0.0) == Rung(2)
        holds.append(policy.up_hold_s)
        assert policy.decide(t + 0.2, 0.1, 0.0) is None  # calm from here on
        assert policy.decide(t + policy.up_hold_s - 0.05, 0.1, 0.0) is None
        t += policy.up_hold_s + 0.01
        assert policy.decide(t, 0.1, 0.0) == Rung(6)
    assert holds == [2.0, 4.0, 4.0, 4.0]
    # A climb that holds for calm_reset_s: the history is forgotten.
    assert policy.decide(t + TUNING.calm_reset_s - 0.1, 0.7, 0.0) is None
    assert policy.up_hold_s == 4.0
    assert policy.decide(t + TUNING.calm_reset_s + 0.1, 0.7, 0.0) is None
    assert policy.up_hold_s == TUNING.up_hold_s


class FakeCpu:
    """A thread_time that reports ``busy`` of the wall time as CPU."""

    def __init__(self) -> None:
        self.busy = 0.0
        self._cpu = 0.0
        self._wall = time.monotonic()

    def __call__(self) -> float:
        now = time.monotonic()
        self._cpu += (now - self._wall) * self.busy
        self._wall = now
        return self._cpu


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_every_registered_encoder_follows_the_load_down_and_back_up() -> None:
    cpu = FakeCpu()
    governor = ComplexityGovernor(9, 0, LOAD_ONLY, thread_time=cpu)
    encoders = [OpusEncoder(complexity=9) for _ in range(3)]
    for encoder in encoders:
        governor.register(encoder)
    try:
        cpu.busy = 0.97
        await wait_for(lambda: governor.rung == mb(0))
        assert governor.load > TUNING.high_load
        assert [(e.complexity, e.band_cap) for e in encoders] == [(0, MEDIUM_BAND_HZ)] * 3
        late = OpusEncoder(complexity=9)  # a session that starts now starts at the floor
        governor.register(late)
        assert (late.complexity, late.band_cap) == (0, MEDIUM_BAND_HZ)
        encoders[0].close()  # a session that ended meanwhile drops out quietly
        cpu.busy = 0.05
        await wait_for(lambda: governor.rung == Rung(9))
        climbed = (encoders[1], encoders[2], late)
        assert [(e.complexity, e.band_cap) for e in climbed] == [(9, None)] * 3
        assert governor.encoders == 3
        assert governor.policy.steps_down == 5 and governor.policy.steps_up == 5
    finally:
        governor.close()


async def test_other_threads_cpu_is_not_the_loops_load() -> None:
    """An in-process model (ChatTTS on a CPU) busy on another core is not overload: only
    the loop thread's own CPU counts (and lateness, if it took the loop's core)."""
    governor = ComplexityGovernor(9, 0, LOAD_ONLY)
    encoder = OpusEncoder(complexity=9)
    governor.register(encoder)
    stop = threading.Event()

    def infer() -> None:  # hashing big buffers runs without the GIL, like torch's kernels
        block = bytes(8 << 20)
        while not stop.is_set():
            hashlib.sha256(block).digest()

    # As many as the cores (up to 4): the process as a whole is then CPU-bound.
    workers = [threading.Thread(target=infer) for _ in range(min(4, os.cpu_count() or 1))]
    for worker in workers:
        worker.start()
    try:
        windows = governor.policy.steps_down + governor.policy.steps_up
        await asyncio.sleep(TUNING.probe_s * TUNING.window_probes * 4)
        assert governor.load < TUNING.low_load
        assert encoder.complexity == 9
        assert governor.policy.steps_down + governor.policy.steps_up == windows
    finally:
        stop.set()
        for worker in workers:
            worker.join()
        governor.close()


async def test_late_timers_alone_step_down() -> None:
    """A loop whose callbacks block without using the CPU (or whose core another process
    took) runs every packet late: the probe's lateness is the signal then."""
    governor = ComplexityGovernor(9, 0, TUNING)
    encoder = OpusEncoder(complexity=9)
    governor.register(encoder)
    loop = asyncio.get_running_loop()
    stalling = True

    def stall() -> None:
        time.sleep(0.03)  # off the CPU: the load stays low
        if stalling:
            loop.call_soon(stall)

    loop.call_soon(stall)
    try:
        await wait_for(lambda: encoder.complexity < 9)
        assert governor.late_s >= TUNING.high_late_s
    finally:
        stalling = False
        governor.close()


async def test_a_really_saturated_loop_is_measured_and_relieved() -> None:
    """The real signals: jobs due on a fixed 10 ms grid, each needing 9.5 ms of CPU, as
    packet timers are (60 speaking sessions at complexity 9 load a 2-core machine's loop like
    this). With a core to itself the loop is 95% busy; on a shared core it falls behind and
    every timer runs later and later. Either way the encoders step down, and back up after."""
    governor = ComplexityGovernor(9, 0, TUNING)
    encoder = OpusEncoder(complexity=9)
    governor.register(encoder)
    loop = asyncio.get_running_loop()
    period, cost = 0.010, 0.0095
    due = loop.time()
    burning = True

    def job() -> None:
        nonlocal due
        end = time.thread_time() + cost
        while time.thread_time() < end:
            pass
        due += period
        if burning:
            loop.call_at(due, job)

    loop.call_soon(job)
    try:
        await wait_for(lambda: encoder.complexity <= 6)
        assert governor.load > TUNING.high_load or governor.late_s >= TUNING.high_late_s
    finally:
        burning = False
    await wait_for(lambda: encoder.complexity == 9, timeout=20.0)
    governor.close()


async def test_a_fixed_complexity_is_never_touched_and_close_stops_the_probe() -> None:
    fixed = ComplexityGovernor(9, 9, TUNING)
    encoder = OpusEncoder(complexity=9)
    fixed.register(encoder)
    assert not fixed.enabled and fixed.encoders == 0 and fixed._timer is None
    governor = ComplexityGovernor(9, 0, TUNING)
    governor.register(OpusEncoder(complexity=9))
    assert governor._timer is not None
    governor.close()
    assert governor._timer is None
    governor.register(OpusEncoder(complexity=9))  # after close: governed, but no probe again
    assert governor._timer is None


async def test_sessions_register_every_track_they_make_with_the_governor() -> None:
    governor = ComplexityGovernor(9, 0, TUNING)
    governor.policy.decide(0.0, 1.0, 0.0)  # the process is overloaded: 7
    session = AgentSession("s", ToneEngine(), Config(), governor=governor)
    try:
        assert session.track.encoder.complexity == 7
        assert session.stats()["complexity"] == 7
        first = session.track
        session.renew_track()  # a resumed connection's new track is governed too
        assert session.track is not first and session.track.encoder.complexity == 7
        assert governor.encoders == 1  # the old track's encoder closed and left
        assert session.stats()["band_cap_hz"] is None
        for t in (1.0, 2.0):
            governor.policy.decide(t, 1.0, 0.0)  # 6, then wide-band 6
        session.renew_track()
        assert session.track.encoder.band_cap == WIDE_BAND_HZ
        assert session.stats()["band_cap_hz"] == WIDE_BAND_HZ
    finally:
        await session.close()
        governor.close()
    # Without a governor (unit tests, tools) a track keeps its configured complexity.
    assert OpusPacketTrack(PlayoutBuffer(5), OpusSettings(complexity=5)).encoder.complexity == 5


async def test_a_rooms_agent_and_its_speakers_encoders_are_governed() -> None:
    governor = ComplexityGovernor(9, 0, TUNING)
    governor.policy.decide(0.0, 1.0, 0.0)  # 7
    room = Room("r", ToneEngine(), Config(), governor=governor)
    try:
        assert room.agent_track.encoder.complexity == 7
        member = SimpleNamespace(participant_id="p1")
        feed = SpeakerFeed(room, member, mic=None)  # type: ignore[arg-type]
        assert feed.encoder.complexity == 7
        assert governor.encoders == 2
        feed.encoder.close()
    finally:
        await room.close()
        governor.close()


async def test_a_refused_first_join_releases_the_room_it_made_at_once() -> None:
    """A room made for a first join it refuses (no speaker slot for a microphone) is never
    registered: its agent's encoder is closed, ungoverned and freed without the cyclic
    garbage collector (the room and its pipeline refer to each other)."""
    governor = ComplexityGovernor(9, 0, TUNING)
    config = Config(rooms=RoomSettings(max_speakers=0))
    registry = RoomRegistry(config, ToneEngine(), governor=governor)
    gc.collect()
    gc.disable()
    try:
        for index in range(5):
            with pytest.raises(ApiError) as refused:
                registry.join(
                    "r",
                    f"s{index}",
                    speaking=True,
                    host=False,
                    display_name=None,
                    hooks=None,
                    expects_channel=True,
                )
            assert refused.value.code == "speakers_full"
        del refused  # its traceback holds the last join's frame, and that the room
        assert len(registry) == 0
        assert governor.encoders == 0  # none left open
        assert len(governor._encoders) == 0  # and none left alive
    finally:
        gc.enable()
        governor.close()
    # A listener still makes the room, which then runs as usual.
    member = registry.join(
        "r", "s5", speaking=False, host=False, display_name=None, hooks=None, expects_channel=True
    )
    assert len(registry) == 1 and governor.encoders == 1
    await member.room.close()


async def test_the_session_registry_shares_one_governor_with_its_rooms() -> None:
    registry = SessionRegistry(Config(), ToneEngine())
    try:
        assert registry.rooms.governor is registry.governor
        assert registry.governor.enabled  # the default floor (0) is below the default 9
        assert registry.governor.policy.rungs == ladder(9, 0)  # the band is capped under load
    finally:
        await registry.close_all()
    assert registry.governor._timer is None
    full_band = Config(opus=OpusSettings(band_cap_under_load=False))  # --full-band-under-load
    registry = SessionRegistry(full_band, ToneEngine())
    try:
        assert registry.governor.policy.rungs == full(0, 2, 6, 7, 9)
    finally:
        await registry.close_all()


def test_one_stalled_probe_in_a_window_is_not_overload() -> None:
    """The window's lateness is its second-latest probe: one stall (a DTLS handshake, a
    garbage collection) does not step the encoders down; two do."""
    governor = ComplexityGovernor(9, 0, TUNING)
    before = governor.rung
    for late, expected in (([0.0, 0.0, 0.0, 0.5], before), ([0.0, 0.0, 0.5, 0.5], None)):
        governor._window_late = list(late)
        governor._window_busy, governor._window_wall = 0.01, 0.2
        governor._decide(10.0)
        if expected is not None:
            assert governor.rung == expected and governor.late_s == 0.0
    assert governor.rung != before and governor.late_s == 0.5
