"""Tests for agent.twcc: transport-wide congestion control feedback."""

from __future__ import annotations

import itertools
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.twcc import (
    MAX_FEEDBACKS_PER_COMPOUND,
    MAX_RATE_PACKETS,
    MAX_REPORTED_PACKETS,
    FeedbackEstimator,
    FeedbackSummary,
    SendHistory,
    TransportFeedback,
    build_transport_feedback,
    iter_transport_feedback,
    parse_transport_feedback,
)

# ---------------------------------------------------------------- hand-made bytes

# Built bit by bit, not with our serialiser:
#   base seq 65534 (wraps), status count 5, reference time 1 (64 ms), feedback count 7
#   chunk 0x2002 = 0 01 0000000000010: run-length, "small delta" x2 (seqs 65534, 65535)
#   chunk 0xC900 = 1 1 00 10 01 00 00 00 00: two-bit vector: lost, large, small, 4 unused
#   deltas: 0x04 (+1 ms), 0xFF (+63.75 ms), 0xFFF8 (-2 ms, large), 0x00 (+0)
#   17 FCI bytes + 3 padding bytes (00 00 03, P bit set) -> 32 bytes, length field 7
HAND_PACKET = bytes.fromhex(
    "af cd 00 07"  # V=2 P=1 FMT=15, PT=205, length 7
    "00 00 00 2a"  # sender SSRC 42
    "12 34 56 78"  # media SSRC
    "ff fe 00 05 00 00 01 07"
    "20 02 c9 00"
    "04 ff ff f8 00"
    "00 00 03"
)
HAND_ARRIVALS = [(65534, 65_000), (65535, 128_750), (0, None), (1, 126_750), (2, 126_750)]

# Negative reference time (0xFFFFFF = -1 -> -64 ms) and a one-bit vector:
#   chunk 0xA800 = 1 0 1 0 1 00000000000: received, lost, received
#   deltas 0x08 (+2 ms), 0x01 (+0.25 ms); 12 bytes, no padding needed
HAND_FCI_ONE_BIT = bytes.fromhex("00 0a 00 03 ff ff ff 00 a8 00 08 01")


def test_hand_written_packet_parses() -> None:
    [(sender, media, fci)] = list(iter_transport_feedback(HAND_PACKET))
    assert (sender, media) == (42, 0x12345678)
    feedback = parse_transport_feedback(fci)
    assert feedback.base_seq == 65534
    assert feedback.reference_time_us == 64_000
    assert feedback.feedback_count == 7
    assert feedback.packets == HAND_ARRIVALS


def test_hand_written_one_bit_vector_and_negative_reference() -> None:
    feedback = parse_transport_feedback(HAND_FCI_ONE_BIT)
    assert feedback.reference_time_us == -64_000
    assert feedback.feedback_count == 0
    assert feedback.packets == [(10, -62_000), (11, None), (12, -61_750)]


def test_builder_matches_hand_written_bytes() -> None:
    arrivals = [arrival for _, arrival in HAND_ARRIVALS]
    built = build_transport_feedback(65534, 64_000, 7, arrivals, 42, 0x12345678)
    # The builder picks its own chunks, so compare meaning, and bytes where chunking agrees.
    [(_, _, fci)] = list(iter_transport_feedback(built))
    assert parse_transport_feedback(fci).packets == HAND_ARRIVALS
    one_bit = build_transport_feedback(10, -64_000, 0, [-62_000, None, -61_750], 1, 0)
    assert one_bit[12:] == HAND_FCI_ONE_BIT


# ---------------------------------------------------------------- round trips


def _round_trip(base: int, reference_us: int, count: int, arrivals: list[int | None]) -> None:
    packet = build_transport_feedback(base, reference_us, count, arrivals, 7, 9)
    assert len(packet) % 4 == 0
    [(sender, media, fci)] = list(iter_transport_feedback(packet))
    assert (sender, media) == (7, 9)
    feedback = parse_transport_feedback(fci)
    assert (feedback.base_seq, feedback.reference_time_us) == (base, reference_us)
    assert feedback.feedback_count == count
    expected = [((base + i) & 0xFFFF, arrival) for i, arrival in enumerate(arrivals)]
    assert feedback.packets == expected


_KIND = st.sampled_from(["lost", "small", "large", "negative"])


@settings(max_examples=300, deadline=None)
@given(
    base=st.integers(0, 0xFFFF),
    reference=st.integers(-(1 << 23), (1 << 23) - 1),
    count=st.integers(0, 255),
    runs=st.lists(st.tuples(_KIND, st.integers(1, 40), st.integers(0, 255)), max_size=20),
)
def test_round_trip_property(
    base: int, reference: int, count: int, runs: list[tuple[str, int, int]]
) -> None:
    reference_us = reference * 64_000
    clock = reference_us
    arrivals: list[int | None] = []
    for kind, length, ticks in runs:
        for _ in range(length):
            if kind == "lost":
                arrivals.append(None)
                continue
            step = {"small": ticks, "large": 256 + ticks * 100, "negative": -1 - ticks * 100}
            clock += step[kind] * 250
            arrivals.append(clock)
    _round_trip(base, reference_us, count, arrivals)


def _chunk_kinds(packet: bytes) -> set[str]:
    feedback = parse_transport_feedback(packet[12:])
    chunks, kinds = 0, set()
    pos, covered = 20, 0
    while covered < len(feedback.packets):
        (chunk,) = struct.unpack_from("!H", packet, pos)
        pos, chunks = pos + 2, chunks + 1
        if not chunk & 0x8000:
            kinds.add("run")
            covered += chunk & 0x1FFF
        else:
            kinds.add("two-bit" if chunk & 0x4000 else "one-bit")
            covered += 7 if chunk & 0x4000 else 14
    return kinds


def test_builder_chooses_each_chunk_kind() -> None:
    assert _chunk_kinds(build_transport_feedback(0, 0, 0, [1000 * i for i in range(30)])) == {"run"}
    mixed: list[int | None] = [None if i % 3 == 0 else 1000 * i for i in range(28)]
    assert _chunk_kinds(build_transport_feedback(0, 0, 0, mixed)) == {"one-bit"}
    mixed[5] = 1_000_000  # a large delta forces two-bit symbols
    assert "two-bit" in _chunk_kinds(build_transport_feedback(0, 0, 0, mixed))


def test_long_runs_and_wrap() -> None:
    arrivals: list[int | None] = [None] * 1000 + [5000, 6000]
    _round_trip(65530, 0, 1, arrivals)
    _round_trip(65530, 128_000, 2, [128_000 + 1000 * i for i in range(10)])


def test_builder_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="64 ms"):
        build_transport_feedback(0, 1000, 0, [2000])
    with pytest.raises(ValueError, match="16 bits"):
        build_transport_feedback(0, 0, 0, [10_000_000])


# ---------------------------------------------------------------- compound walking


def _rr() -> bytes:
    return struct.pack("!BBHI", 0x81, 201, 7, 0x1111) + struct.pack("!IIIIII", 2, 0, 3, 4, 5, 6)


def _sdes() -> bytes:
    body = struct.pack("!I", 0x1111) + bytes([1, 4]) + b"abcd" + bytes(2)  # CNAME, end, pad
    return struct.pack("!BBH", 0x81, 202, len(body) // 4) + body


def _nack() -> bytes:  # PT=205 FMT=1: same PT, must be skipped
    return struct.pack("!BBHIIHH", 0x81, 205, 3, 1, 2, 100, 0)


def test_iter_compound_with_rr_sdes_and_two_feedbacks() -> None:
    first = build_transport_feedback(100, 0, 1, [1000, None, 3000], 5, 6)
    second = build_transport_feedback(103, 64_000, 2, [70_000], 5, 6)
    compound = _rr() + _sdes() + first + _nack() + second
    found = list(iter_transport_feedback(compound))
    assert [(s, m) for s, m, _ in found] == [(5, 6), (5, 6)]
    assert parse_transport_feedback(found[0][2]).packets == [(100, 1000), (101, None), (102, 3000)]
    assert parse_transport_feedback(found[1][2]).packets == [(103, 70_000)]


def test_truncated_or_garbled_compound_yields_what_precedes() -> None:
    first = build_transport_feedback(1, 0, 1, [1000])
    second = build_transport_feedback(2, 0, 2, [2000, 3000])
    compound = _rr() + first + second
    for cut in range(len(compound) - len(second), len(compound)):
        assert len(list(iter_transport_feedback(compound[:cut]))) == 1
    garbled = _rr() + first + bytes([0x0F]) + second[1:]  # version 0
    assert len(list(iter_transport_feedback(garbled))) == 1
    bad_padding = bytearray(first)
    bad_padding[0] |= 0x20
    bad_padding[-1] = 200
    assert list(iter_transport_feedback(_rr() + bytes(bad_padding) + second)) == []
    assert list(iter_transport_feedback(b"")) == []


# ---------------------------------------------------------------- malformed FCI


@pytest.mark.parametrize(
    ("fci", "message"),
    [
        (bytes.fromhex("0000 0001 0000"), "at least 8"),
        (bytes.fromhex("0000 0014 00000000 a800"), "exceeds"),  # 20 > 14 in chunks
        (bytes.fromhex("0000 0003 00000000 a800 08"), "delta missing"),
        (bytes.fromhex("0000 0002 00000000 2002 01"), "delta missing"),
        (bytes.fromhex("0000 0001 00000000 f000"), "reserved"),  # two-bit 11
        (bytes.fromhex("0000 0002 00000000 6002"), "reserved"),  # run of 11
        (bytes.fromhex("0000 0001 00000000 e000 00"), "delta missing"),  # large: 2 bytes
    ],
)
def test_malformed_fci_raises(fci: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_transport_feedback(fci)


# ---------------------------------------------------------------- send history


def test_send_history_bounded_and_overwrites() -> None:
    history = SendHistory(capacity=8)
    for seq in range(20):
        history.record(seq, seq * 20_000, 80)
    assert len(history) == 8
    assert history.get(11) is None
    assert history.get(12) is not None
    assert history.get(19) == history.get(19 + 65536)
    assert history.get(100) is None
    history.record(65536 + 12, 999, 10)  # seq wraps onto 12: the new packet wins
    found = history.get(12)
    assert found is not None and found.send_time_us == 999
    big = SendHistory()
    for seq in range(200_000):
        big.record(seq, seq, 1)
    assert len(big) == 4096
    with pytest.raises(ValueError):
        SendHistory(capacity=0)


# ---------------------------------------------------------------- estimator

OFFSET_US = 5_000_000_000  # the receiver's clock is unrelated to ours


def _simulate(
    n: int,
    delay_us: object,
    lost: object = None,
    per_feedback: int = 5,
    size: object = 80,
    offset_us: int = OFFSET_US,
) -> list[FeedbackSummary]:
    """Send a packet every 20 ms; feed back every `per_feedback` packets through the wire."""
    history, estimator = SendHistory(), FeedbackEstimator()
    summaries: list[FeedbackSummary] = []
    assert callable(delay_us)
    for start in range(0, n, per_feedback):
        arrivals: list[int | None] = []
        for seq in range(start, start + per_feedback):
            history.record(seq, seq * 20_000, size(seq) if callable(size) else size)
            gone = callable(lost) and lost(seq)
            arrivals.append(None if gone else offset_us + seq * 20_000 + delay_us(seq))
        first = next((a for a in arrivals if a is not None), offset_us)
        packet = build_transport_feedback(start, first // 64_000 * 64_000, start, arrivals)
        [(_, _, fci)] = list(iter_transport_feedback(packet))
        now = (start + per_feedback) * 20_000 + 60_000
        summary = estimator.on_feedback(parse_transport_feedback(fci), history, now)
        assert summary is not None
        summaries.append(summary)
    return summaries


def test_clean_path() -> None:
    summaries = _simulate(200, lambda seq: 40_000 + (seq % 2) * 250)  # 0.25 ms jitter
    last = summaries[-1]
    assert last.loss_fraction == 0 and last.lost == 0 and last.packets == 5
    assert last.queuing_delay_ms is not None and last.queuing_delay_ms < 0.5
    assert last.delay_trend_ms_per_s is not None and abs(last.delay_trend_ms_per_s) < 1


def test_growing_delay() -> None:
    summaries = _simulate(100, lambda seq: 40_000 + seq * 2_000)  # +10 ms per 100 ms
    queuing = [s.queuing_delay_ms for s in summaries if s.queuing_delay_ms is not None]
    assert len(queuing) == len(summaries)
    assert all(b > a for a, b in itertools.pairwise(queuing))
    assert summaries[-1].delay_trend_ms_per_s == pytest.approx(100, rel=0.01)
    assert queuing[-1] == pytest.approx(194, abs=1)  # delay 238 ms mean - 40 ms min - ~4


def test_ten_percent_loss() -> None:
    summaries = _simulate(300, lambda seq: 30_000, lost=lambda seq: seq % 10 == 3)
    assert summaries[-1].loss_fraction == pytest.approx(0.1)
    assert sum(s.lost for s in summaries) == 30
    assert sum(s.packets for s in summaries) == 300


def test_receive_rate() -> None:
    summaries = _simulate(200, lambda seq: 30_000)  # 50 packets/s of 80 bytes
    assert summaries[-1].receive_rate_bps == pytest.approx(32_000, rel=0.02)
    assert _simulate(1, lambda seq: 0, per_feedback=1)[0].receive_rate_bps is None


def test_a_receive_clock_that_steps_back_starts_the_rate_afresh() -> None:
    """The receiver's clock stepping back 2 s: the arrivals kept from before stayed at the
    front of the window, the new ones piled up behind, and their bytes were divided by the
    old span (102-160 kbps read for 32; found by review). The window starts afresh."""
    summaries = _simulate(400, lambda seq: 30_000 if seq < 150 else 30_000 - 2_000_000)
    rates = [s.receive_rate_bps for s in summaries[40:]]  # from ~0.2 s after the step
    assert all(r == pytest.approx(32_000, rel=0.05) for r in rates if r is not None), rates
    assert sum(r is not None for r in rates) > len(rates) // 2


@pytest.mark.parametrize("wrap_units", [1 << 23, 1 << 24], ids=["signed", "unsigned"])
def test_the_reference_time_wrapping_does_not_freeze_the_estimates(wrap_units: int) -> None:
    # The receiver's clock crosses the 24-bit reference's wrap (read signed, 2^23 units
    # flips the sign; 2^24 is the full period) 2 s into the call; the packets double in
    # size at 3 s. Read naively, arrivals jump back ~18 min or ~12 days there: the rate
    # froze at its old value and the delay trend read about -3e9 ms/s.
    summaries = _simulate(
        300,
        lambda seq: 30_000,
        size=lambda seq: 100 if seq < 150 else 200,
        offset_us=wrap_units * 64_000 - 2_000_000,
    )
    for summary in summaries[1:]:
        assert summary.delay_trend_ms_per_s is not None
        assert abs(summary.delay_trend_ms_per_s) < 1
        assert summary.queuing_delay_ms is not None and summary.queuing_delay_ms < 1
    assert summaries[25].receive_rate_bps == pytest.approx(40_000, rel=0.02)
    assert summaries[-1].receive_rate_bps == pytest.approx(80_000, rel=0.02)


def test_a_reordered_older_feedback_is_unwrapped_backwards() -> None:
    history, estimator = SendHistory(), FeedbackEstimator()
    period_us = (1 << 24) * 64_000
    for seq in range(4):
        history.record(seq, seq * 20_000, 100)
    arrival = {seq: period_us - 34_000 + seq * 20_000 for seq in range(4)}  # 0-1 before
    # the wrap, 2-3 after it; the report of 2-3 comes first, the late one of 0-1 after it:
    # its arrivals are 40 ms earlier, not ~12 days later.
    for base, reference in ((2, period_us), (0, period_us - 64_000)):
        packet = build_transport_feedback(base, reference, base, [arrival[base], arrival[base + 1]])
        [(_, _, fci)] = list(iter_transport_feedback(packet))
        summary = estimator.on_feedback(parse_transport_feedback(fci), history, 100_000)
        assert summary is not None
        assert summary.queuing_delay_ms is not None and abs(summary.queuing_delay_ms) < 1
    assert summary.delay_trend_ms_per_s is not None
    assert abs(summary.delay_trend_ms_per_s) < 1  # one constant delay throughout


def test_duplicate_reports_not_double_counted() -> None:
    history, estimator = SendHistory(), FeedbackEstimator()
    for seq in range(20):
        history.record(seq, seq * 20_000, 80)
    arrivals: list[int | None] = [seq * 20_000 + 30_000 for seq in range(10)]
    late = [2, 5, 7]
    first = TransportFeedback(
        0, 0, 0, [(s, None if s in late else a) for s, a in enumerate(arrivals)]
    )
    one = estimator.on_feedback(first, history, 300_000)
    assert one is not None and (one.packets, one.lost) == (10, 3)
    assert one.loss_fraction == pytest.approx(0.3)
    # An exact repeat: nothing new, and nothing to estimate (None, as for unknown packets).
    assert estimator.on_feedback(first, history, 310_000) is None
    assert estimator._loss_fraction() == pytest.approx(0.3)
    # Chrome re-reports the late packets as received, plus ten new ones.
    repeat = [(s, arrivals[s]) for s in late] + [(s, s * 20_000 + 30_000) for s in range(10, 20)]
    two = estimator.on_feedback(TransportFeedback(0, 0, 1, repeat), history, 500_000)
    assert two is not None and (two.packets, two.lost, two.recovered) == (10, 0, 3)
    assert two.loss_fraction == 0
    # A received packet later reported lost stays received.
    three = estimator.on_feedback(TransportFeedback(0, 0, 2, [(4, None)]), history, 510_000)
    assert three is None and estimator._loss_fraction() == 0


def test_unknown_packets_give_none_and_state_is_bounded() -> None:
    history, estimator = SendHistory(capacity=16), FeedbackEstimator(max_tracked=64)
    assert estimator.on_feedback(TransportFeedback(0, 0, 0, [(1, 5)]), history, 0) is None
    for seq in range(10_000):
        history.record(seq, seq * 20_000, 80)
        feedback = TransportFeedback(seq, 0, 0, [(seq & 0xFFFF, seq * 20_000 + 30_000)])
        estimator.on_feedback(feedback, history, seq * 20_000)
    assert len(estimator._outcomes) <= 64
    assert len(estimator._minima) <= 1024
    assert len(estimator._rate) <= MAX_RATE_PACKETS


def test_a_feedback_claiming_too_many_packets_is_refused_before_expanding() -> None:
    """16 bytes of run-length chunks could claim 65535 statuses: refused at the header."""
    fci = struct.pack("!HHI", 0, 65535, 0) + struct.pack("!H", 0x1FFF) * 8
    with pytest.raises(ValueError, match="over"):
        parse_transport_feedback(fci)
    # Within the cap a full run still parses.
    ok = struct.pack("!HHI", 0, MAX_REPORTED_PACKETS, 0) + struct.pack("!H", MAX_REPORTED_PACKETS)
    assert len(parse_transport_feedback(ok).packets) == MAX_REPORTED_PACKETS


def test_only_so_many_feedbacks_per_compound_packet() -> None:
    one = build_transport_feedback(0, 0, 0, [1000])
    assert len(list(iter_transport_feedback(one * 50))) == MAX_FEEDBACKS_PER_COMPOUND


def test_a_shared_sequence_never_lets_an_old_entry_answer_after_the_wrap() -> None:
    # 20 streams share one transport's numbers: this stream records every 20th. Its 4096
    # entries would span 81,920 numbers, past the 16-bit wrap, so an entry from before the
    # wrap would answer for another stream's packet with the same number.
    history = SendHistory()
    for i in range(10_000):
        history.record(i * 20, i, 100)
    newest = (9_999 * 20) & 0xFFFF
    kept = [seq for seq in range(0x10000) if history.get(seq) is not None]
    assert kept and all((newest - seq) & 0xFFFF < 0x8000 for seq in kept)
    assert history.get(newest) is not None and history.get(newest).send_time_us == 9_999
    stale = (newest + 20) & 0xFFFF  # recorded ~65,500 numbers ago, not this stream's now
    assert history.get(stale) is None


def test_a_padding_bit_with_a_zero_padding_count_is_garbled() -> None:
    """RFC 3550: with the P bit set the last octet counts the padding, itself included, so
    0 is impossible: the sub-packet's length cannot be trusted and the walk ends."""
    first = build_transport_feedback(1, 0, 1, [1000])
    zero_padding = bytearray(first)
    zero_padding[0] |= 0x20
    zero_padding[-1] = 0
    assert list(iter_transport_feedback(bytes(zero_padding))) == []


def test_a_feedback_too_short_for_its_two_ssrcs_ends_the_walk_quietly() -> None:
    """An RTPFB FMT=15 packet of 8 bytes (header and sender SSRC only) is garbled: nothing
    is yielded and nothing is raised."""
    short = struct.pack("!BBHI", 0x80 | 15, 205, 1, 42)
    assert list(iter_transport_feedback(short)) == []


def test_the_minimum_delay_is_forgotten_after_its_window() -> None:
    """Queueing delay is measured against the minimum of the last 10 s: after a route change
    to a steadily longer path, the new delay becomes the baseline and queueing reads ~0 again
    (else the controller would hold or back off for the rest of the call)."""
    summaries = _simulate(800, lambda seq: 40_000 if seq < 200 else 90_000)
    assert summaries[45].queuing_delay_ms == pytest.approx(50, abs=1)  # just after the change
    assert summaries[-1].queuing_delay_ms is not None and summaries[-1].queuing_delay_ms < 1
