"""Transport-wide congestion control (TWCC) feedback: find, parse, build and summarise it.

Chrome answers the transport-wide sequence number header extension
(draft-holmer-rmcat-transport-wide-cc-extensions-01) with RTCP RTPFB (PT=205) FMT=15 packets.
aiortc 1.16 mistakes them for generic NACKs and drops the FCI, so this module works on the raw,
already decrypted compound RTCP bytes. It is pure Python on purpose: no aiortc, no clocks of its
own (callers pass times in µs), so it can be tested byte by byte.
"""

from __future__ import annotations

import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice

RTPFB = 205
TWCC_FMT = 15
_TICK_US = 250  # receive deltas count 250 µs ticks
_REF_UNIT_US = 64_000  # the reference time counts 64 ms units
# The 24-bit reference wraps every 2^24 x 64 ms (~12.4 days of the receiver's clock; libwebrtc
# writes it modulo that), so a long-running receiver crosses a wrap at some point in a call.
REFERENCE_WRAP_US = (1 << 24) * _REF_UNIT_US
_MAX_RUN = 0x1FFF  # 13-bit run length of a run-length chunk
# Most packets one feedback may report. Chrome reports ~100 ms of packets per feedback (a
# handful for audio); 16 bytes of run-length chunks could claim 65535 and cost tens of ms to
# expand and look up: a peer must not be able to stall the event loop with a small packet.
MAX_REPORTED_PACKETS = 1024
# Arrivals kept for the receive rate: its 0.5 s window holds ~25 of an audio stream's
# packets (a tap records its own stream's); a peer claiming more at once keeps only these.
MAX_RATE_PACKETS = 512
# Transport feedbacks handled per compound RTCP packet (the rest are ignored).
MAX_FEEDBACKS_PER_COMPOUND = 8
# Packet status symbols (draft section 3.1.1).
NOT_RECEIVED, SMALL_DELTA, LARGE_DELTA, _RESERVED = 0, 1, 2, 3


def iter_transport_feedback(compound: bytes) -> Iterator[tuple[int, int, bytes]]:
    """Yield (sender_ssrc, media_ssrc, fci) for each transport feedback in a compound packet.

    Other RTCP packets are skipped. A truncated or garbled sub-packet ends the walk quietly:
    its length field cannot be trusted, so nothing after it can be located.
    """
    offset = 0
    found = 0
    while offset + 4 <= len(compound) and found < MAX_FEEDBACKS_PER_COMPOUND:
        first, packet_type, words = struct.unpack_from("!BBH", compound, offset)
        end = offset + (words + 1) * 4  # length is in 32-bit words minus one
        if first >> 6 != 2 or end > len(compound):
            return
        body_end = end
        if first & 0x20:  # padding bit: the last octet counts the padding octets
            padding = compound[end - 1]
            if padding == 0 or padding > end - offset - 4:
                return
            body_end -= padding
        if packet_type == RTPFB and first & 0x1F == TWCC_FMT:
            if body_end - offset < 12:  # header + sender SSRC + media SSRC
                return
            sender, media = struct.unpack_from("!II", compound, offset + 4)
            found += 1
            yield sender, media, bytes(compound[offset + 12 : body_end])
        offset = end


@dataclass(frozen=True)
class TransportFeedback:
    """One parsed feedback; arrival times are on the receiver's clock, in µs."""

    base_seq: int
    reference_time_us: int
    feedback_count: int
    packets: list[tuple[int, int | None]]  # (seq mod 2^16, arrival µs or None if lost)


def _decode_chunk(chunk: int) -> list[int]:
    if not chunk & 0x8000:  # run-length chunk: 2-bit symbol, 13-bit run
        return [(chunk >> 13) & 0x3] * (chunk & _MAX_RUN)
    if not chunk & 0x4000:  # status vector, 14 one-bit symbols
        return [(chunk >> (13 - i)) & 0x1 for i in range(14)]
    return [(chunk >> (12 - 2 * i)) & 0x3 for i in range(7)]  # 7 two-bit symbols


def _read_statuses(fci: bytes, count: int) -> tuple[list[int], int]:
    """Decode `count` status symbols from the chunks after the 8-byte FCI header."""
    statuses: list[int] = []
    pos = 8
    while len(statuses) < count:
        if pos + 2 > len(fci):
            raise ValueError(
                f"packet status count {count} exceeds the {len(statuses)} statuses in the chunks"
            )
        statuses.extend(_decode_chunk(struct.unpack_from("!H", fci, pos)[0]))
        pos += 2
    del statuses[count:]  # the last vector chunk may carry unused trailing symbols
    if _RESERVED in statuses:
        raise ValueError("reserved packet status symbol (0b11) in transport feedback")
    return statuses, pos


def reported_packets(fci: bytes) -> int:
    """How many packets a feedback FCI says it reports (its packet status count), read
    without parsing it: what parsing it would cost. 0 for an FCI too short to say."""
    if len(fci) < 4:
        return 0
    count: int = struct.unpack_from("!H", fci, 2)[0]
    return count


def parse_transport_feedback(fci: bytes) -> TransportFeedback:
    """Parse a transport feedback FCI (what follows the two SSRCs). Raises ValueError."""
    if len(fci) < 8:
        raise ValueError(f"transport feedback FCI is {len(fci)} bytes, needs at least 8")
    base_seq, count, ref_and_count = struct.unpack_from("!HHI", fci)
    if count > MAX_REPORTED_PACKETS:
        raise ValueError(f"packet status count {count} is over {MAX_REPORTED_PACKETS}")
    reference = ref_and_count >> 8
    if reference & 0x800000:  # 24-bit signed
        reference -= 1 << 24
    statuses, pos = _read_statuses(fci, count)
    clock_us = reference * _REF_UNIT_US  # each delta is relative to the previous arrival
    packets: list[tuple[int, int | None]] = []
    for i, status in enumerate(statuses):
        arrival: int | None = None
        if status != NOT_RECEIVED:
            size = 1 if status == SMALL_DELTA else 2
            if pos + size > len(fci):
                raise ValueError(f"receive delta missing for packet {i} of {count}")
            delta = fci[pos] if size == 1 else struct.unpack_from("!h", fci, pos)[0]
            pos += size
            clock_us += delta * _TICK_US
            arrival = clock_us
        packets.append(((base_seq + i) & 0xFFFF, arrival))
    # Bytes after the deltas are zero padding to 32 bits: ignored, as libwebrtc does.
    return TransportFeedback(base_seq, reference * _REF_UNIT_US, ref_and_count & 0xFF, packets)


def _encode_deltas(reference_time_us: int, arrivals: list[int | None]) -> tuple[list[int], bytes]:
    statuses: list[int] = []
    out = bytearray()
    previous = reference_time_us
    for arrival in arrivals:
        if arrival is None:
            statuses.append(NOT_RECEIVED)
            continue
        # Round against the previously *encoded* time so quantisation error never accumulates.
        ticks = (arrival - previous + _TICK_US // 2) // _TICK_US
        previous += ticks * _TICK_US
        if 0 <= ticks <= 0xFF:
            statuses.append(SMALL_DELTA)
            out.append(ticks)
        elif -0x8000 <= ticks <= 0x7FFF:
            statuses.append(LARGE_DELTA)
            out += struct.pack("!h", ticks)
        else:
            raise ValueError(f"receive delta of {ticks * _TICK_US} µs does not fit in 16 bits")
    return statuses, bytes(out)


def _vector_chunk(symbols: list[int], bits: int) -> int:
    chunk = 0x8000 | (0x4000 if bits == 2 else 0)
    for k, symbol in enumerate(symbols):
        chunk |= symbol << (14 - bits * (k + 1))
    return chunk


def _encode_chunks(statuses: list[int]) -> list[int]:
    """Run-length for runs of 14+ (or a uniform tail), else the densest vector that fits."""
    chunks: list[int] = []
    i = 0
    while i < len(statuses):
        run = 1
        while i + run < len(statuses) and statuses[i + run] == statuses[i] and run < _MAX_RUN:
            run += 1
        if run >= 14 or i + run == len(statuses):
            chunks.append((statuses[i] << 13) | run)
            i += run
        elif LARGE_DELTA in statuses[i : i + 14]:
            chunks.append(_vector_chunk(statuses[i : i + 7], 2))
            i += 7
        else:
            chunks.append(_vector_chunk(statuses[i : i + 14], 1))
            i += 14
    return chunks


def build_transport_feedback(
    base_seq: int,
    reference_time_us: int,
    feedback_count: int,
    arrivals: list[int | None],
    sender_ssrc: int = 1,
    media_ssrc: int = 0,
) -> bytes:
    """Serialise a complete RTCP transport feedback packet; arrivals are µs, None = lost.

    reference_time_us must be a multiple of 64 ms, written modulo 2^24 units as libwebrtc
    does (its parsed value is then off by whole wrap periods); arrivals are rounded to 250 µs.
    """
    reference, remainder = divmod(reference_time_us, _REF_UNIT_US)
    if remainder:
        raise ValueError(f"reference time {reference_time_us} µs is not a multiple of 64 ms")
    if len(arrivals) > 0xFFFF:
        raise ValueError(f"{len(arrivals)} packets do not fit one feedback (max 65535)")
    statuses, deltas = _encode_deltas(reference_time_us, arrivals)
    fci = struct.pack(
        "!HHI",
        base_seq & 0xFFFF,
        len(arrivals),
        (reference & 0xFFFFFF) << 8 | feedback_count & 0xFF,
    )
    fci += b"".join(struct.pack("!H", chunk) for chunk in _encode_chunks(statuses)) + deltas
    padding = -len(fci) % 4
    if padding:  # RTCP padding: zeros, then the count, with the P bit set
        fci += bytes(padding - 1) + bytes([padding])
    first = 0x80 | (0x20 if padding else 0) | TWCC_FMT
    header = struct.pack("!BBHII", first, RTPFB, (12 + len(fci)) // 4 - 1, sender_ssrc, media_ssrc)
    return header + fci


@dataclass(frozen=True)
class SentPacket:
    seq: int
    send_time_us: int
    size_bytes: int


class SendHistory:
    """The last `capacity` packets sent, by 16-bit transport sequence number.

    ``record`` takes the unwrapped number (the transport's count of numbers handed out
    before it). ``transport_sent``, where several streams share the transport's numbers,
    says how many the transport has handed out so far, to all of them: a feedback's 16-bit
    number then means the latest packet that carried it, which may be another stream's
    although an entry here carries the same 16 bits from an earlier wrap.
    """

    def __init__(
        self, capacity: int = 4096, transport_sent: Callable[[], int] | None = None
    ) -> None:
        if not 1 <= capacity <= 0x10000:
            raise ValueError(f"capacity must be 1..65536, got {capacity}")
        self._capacity = capacity
        self._transport_sent = transport_sent
        self._newest = -1  # the newest number recorded here (unwrapped)
        # seq -> (packet, its unwrapped number), oldest first
        self._packets: OrderedDict[int, tuple[SentPacket, int]] = OrderedDict()

    def record(self, number: int, send_time_us: int, size_bytes: int) -> None:
        seq = number & 0xFFFF
        self._packets.pop(seq, None)  # a wrapped-around seq replaces the stale packet
        self._packets[seq] = (SentPacket(seq, send_time_us, size_bytes), number)
        self._newest = max(self._newest, number)
        if len(self._packets) > self._capacity:
            self._packets.popitem(last=False)
        # Several streams on one transport share the numbers (agent/feedback.py), so this
        # stream's entries can span more than the 16-bit space: an entry half the space
        # behind the newest would answer for another stream's packet after the wrap.
        while self._packets:
            _, oldest = next(iter(self._packets.values()))
            if self._newest - oldest < 0x8000:
                break
            self._packets.popitem(last=False)

    def get(self, seq: int) -> SentPacket | None:
        found = self._packets.get(seq & 0xFFFF)
        if found is None:
            return None
        packet, number = found
        # A feedback names one of the last half-space of numbers sent on the transport. An
        # entry further back than that is from an earlier wrap: this stream went quiet
        # (a speaker slot with nobody in it) while the others took the numbers in between,
        # and its packet now would be theirs, with a send time minutes old.
        newest = self._newest
        if self._transport_sent is not None:
            newest = max(newest, self._transport_sent() - 1)
        return packet if newest - number < 0x8000 else None

    def __len__(self) -> int:
        return len(self._packets)


@dataclass(frozen=True)
class FeedbackSummary:
    """What one feedback taught us; see FeedbackEstimator for the exact definitions."""

    packets: int  # packets first reported in this feedback (and found in the history)
    lost: int  # of those, reported not received
    recovered: int  # packets reported lost earlier and received in this feedback
    loss_fraction: float  # over the last loss_window_packets distinct packets
    queuing_delay_ms: float | None  # None when no packet was newly received
    delay_trend_ms_per_s: float | None  # None under 2 points
    receive_rate_bps: float | None  # None under 2 packets in the window


class FeedbackEstimator:
    """Turns feedback into loss, queuing delay, delay trend and receive rate.

    Each packet is counted once: repeats add nothing, except a packet first reported lost and
    later received, which turns into a received packet (`recovered`) in the loss window.
    One-way delay = arrival − send on unsynchronised clocks, so only differences are used:
    queuing delay is this feedback's mean delay over newly received packets minus the minimum
    delay seen in the last `min_delay_window_us` (of `now_us`). The trend is the least-squares
    slope of delay against send time over the last `trend_packets` received packets: steadier
    than one feedback's 2-5 packets. The receive rate is the bytes after the first arrival,
    divided by the arrival span, over the last `rate_window_us` of arrivals.
    All state lives in bounded containers.
    """

    def __init__(
        self,
        *,
        min_delay_window_us: int = 10_000_000,
        trend_packets: int = 20,
        rate_window_us: int = 500_000,
        loss_window_packets: int = 100,
        max_tracked: int = 4096,
    ) -> None:
        self._min_window_us = min_delay_window_us
        self._rate_window_us = rate_window_us
        self._loss_window = loss_window_packets
        self._max_tracked = max_tracked
        self._outcomes: OrderedDict[tuple[int, int], bool] = OrderedDict()  # key → received
        self._minima: deque[tuple[int, int]] = deque(maxlen=1024)  # (now, delay), rising delay
        self._trend: deque[tuple[int, int]] = deque(maxlen=trend_packets)  # (send, delay)
        # (arrival, size) in report order, the oldest first; with their bytes' running total,
        # so that a feedback costs O(1) here however many arrivals its peer reports at once.
        self._rate: deque[tuple[int, int]] = deque()
        self._rate_bytes = 0
        self._rate_newest: int | None = None
        self._reference_us: int | None = None  # the last feedback's reference, unwrapped
        self._reference_shift_us = 0  # added to this feedback's arrivals to unwrap them

    def _unwrap_reference(self, reference_us: int) -> None:
        """Keep arrivals on one continuous clock across the reference's wrap, as libwebrtc's
        ``GetBaseDelta`` does: the step from the last reference is taken modulo the wrap
        period, the shortest way round."""
        if self._reference_us is None:
            self._reference_us = reference_us
            return
        step = (reference_us + self._reference_shift_us - self._reference_us) % REFERENCE_WRAP_US
        if step > REFERENCE_WRAP_US // 2:
            step -= REFERENCE_WRAP_US  # an older reference (reordered feedback)
        self._reference_us += step
        self._reference_shift_us = self._reference_us - reference_us

    def on_feedback(
        self, feedback: TransportFeedback, history: SendHistory, now_us: int
    ) -> FeedbackSummary | None:
        packets = lost = recovered = 0
        delays: list[int] = []
        known = False
        self._unwrap_reference(feedback.reference_time_us)
        shift = self._reference_shift_us
        for seq, reported in feedback.packets:
            arrival = None if reported is None else reported + shift
            sent = history.get(seq)
            if sent is None:
                continue
            known = True
            key = (sent.seq, sent.send_time_us)  # send time tells a wrapped seq apart
            before = self._outcomes.get(key)
            if before is None:
                packets += 1
                lost += arrival is None
            elif before or arrival is None:
                continue  # a repeat: nothing new
            else:
                recovered += 1
            self._remember(key, arrival is not None)
            if arrival is not None:
                delay = arrival - sent.send_time_us
                delays.append(delay)
                self._trend.append((sent.send_time_us, delay))
                self._add_arrival(arrival, sent.size_bytes)
        if not known:
            return None
        if not (packets or recovered):
            # Only repeats: nothing new to estimate (a peer repeating one packet's report
            # must not buy the estimator's whole work with it).
            return None
        return FeedbackSummary(
            packets,
            lost,
            recovered,
            self._loss_fraction(),
            self._queuing_delay_ms(delays, now_us),
            self._trend_ms_per_s(),
            self._receive_rate_bps(),
        )

    def _remember(self, key: tuple[int, int], received: bool) -> None:
        self._outcomes[key] = received  # an update keeps its place: report order
        if len(self._outcomes) > self._max_tracked:
            self._outcomes.popitem(last=False)

    def _loss_fraction(self) -> float:
        recent = list(islice(reversed(self._outcomes.values()), self._loss_window))
        return sum(not received for received in recent) / len(recent) if recent else 0.0

    def _queuing_delay_ms(self, delays: list[int], now_us: int) -> float | None:
        if not delays:
            return None
        # Monotonic deque: the front is the sliding-window minimum.
        lowest = min(delays)
        while self._minima and self._minima[-1][1] >= lowest:
            self._minima.pop()
        self._minima.append((now_us, lowest))
        while self._minima[0][0] < now_us - self._min_window_us:
            self._minima.popleft()
        return (sum(delays) / len(delays) - self._minima[0][1]) / 1000

    def _trend_ms_per_s(self) -> float | None:
        if len(self._trend) < 2:
            return None
        mean_x = sum(x for x, _ in self._trend) / len(self._trend)
        mean_y = sum(y for _, y in self._trend) / len(self._trend)
        sxx = sum((x - mean_x) ** 2 for x, _ in self._trend)
        if sxx == 0:
            return None
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in self._trend)
        return sxy / sxx * 1000  # µs per µs → ms per s

    def _add_arrival(self, arrival: int, size: int) -> None:
        newest = self._rate_newest
        if newest is not None and arrival < newest - self._rate_window_us:
            # The receiver's clock stepped back: what was kept is of another timeline.
            self._rate.clear()
            self._rate_bytes = 0
            self._rate_newest = None
        if len(self._rate) >= MAX_RATE_PACKETS:  # a peer reporting thousands at one time
            self._rate_bytes -= self._rate.popleft()[1]
        self._rate.append((arrival, size))
        self._rate_bytes += size
        if self._rate_newest is None or arrival > self._rate_newest:
            self._rate_newest = arrival

    def _receive_rate_bps(self) -> float | None:
        newest = self._rate_newest
        if newest is None:
            return None
        # Arrivals are reported in sequence order, so the oldest are at the front (a packet
        # the network reordered sits a little out of place, and leaves a little late).
        while self._rate and self._rate[0][0] < newest - self._rate_window_us:
            self._rate_bytes -= self._rate.popleft()[1]
        if len(self._rate) < 2:
            return None
        first_arrival, first_size = self._rate[0]
        span = newest - first_arrival
        if span <= 0:
            return None
        # The first arrival opens the interval, so its bytes are not part of the rate.
        return (self._rate_bytes - first_size) * 8 * 1_000_000 / span
