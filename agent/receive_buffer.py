"""A receive buffer for the microphone, which the server analyses and never plays.

aiortc's ``JitterBuffer`` is built for playout. Two of its habits cost the agent latency:

- it releases a frame only once the next frame's first packet has arrived (one frame,
  20 ms, even with ``prefetch=0``);
- a missing packet stalls it until its 16-packet window overflows. After that it still
  releases one frame per arriving packet, so the ~15 frames that piled up behind the gap
  are never caught up: one lost packet made every later onset, barge-in and end of turn
  ~280 ms late for the rest of the call.

Opus sends one packet per frame, so ``PromptAudioBuffer`` releases each packet as it
arrives, in sequence order. A missing packet is given up once ``reorder_wait + 1`` later
packets have arrived; a packet that arrives after it was given up is dropped (the decoder
has moved on). With ``reorder_wait`` 0 (the default) the delay is never more than the
network's, and reordered packets count as lost. With ``reorder_wait`` W, up to W frames
may queue behind a late packet and stay queued; the added delay is bounded by W frames.

A packet with no payload (an RTP header alone: padding, or a hostile client) takes its
place in the sequence but releases no frame: handed to libavcodec, an empty packet means
the end of the stream, and the decoder then refuses every later packet of the call.
"""

from __future__ import annotations

from collections import OrderedDict

from aiortc import RTCRtpReceiver
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.rtp import RtpPacket

SEQUENCE_SPACE = 1 << 16
# A packet this far behind the next expected one is not late: the sender restarted its
# sequence numbers (aiortc's JitterBuffer uses the same bound).
MAX_MISORDER = 100
RETIRED_SOURCES = 4  # replaced SSRCs whose late packets are recognised as such
_JITTER_BUFFER_ATTR = "_RTCRtpReceiver__jitter_buffer"  # aiortc 1.16's private attribute
_JITTER_BUFFER_CAPACITY = 16  # aiortc's own for audio


class PromptAudioBuffer(JitterBuffer):
    """Releases audio packets in order as soon as they arrive (one packet is one frame)."""

    def __init__(self, capacity: int = 16, reorder_wait: int = 0) -> None:
        super().__init__(capacity)
        if not 0 <= reorder_wait < capacity - 1:
            raise ValueError(f"reorder_wait must be 0-{capacity - 2}, got {reorder_wait}")
        self.reorder_wait = reorder_wait
        self.given_up = 0  # missing packets skipped over
        self.dropped_late = 0  # packets that came after they were given up, or twice
        self.empty = 0  # packets with no payload, released as nothing (see the docstring)
        self._held: dict[int, RtpPacket] = {}
        self._next: int | None = None  # the sequence number released next
        # The source whose sequence numbers these are, and the few it replaced: a sender
        # that restarts (signaling/ssrcguard.py allows it) starts a new sequence space at a
        # random number, which may fall just behind the old one's.
        self._ssrc: int | None = None
        # Replaced sources -> the sequence number each would have sent next (see _straggler).
        self._retired: OrderedDict[int, int] = OrderedDict()

    @property
    def queued(self) -> int:
        """Packets held: waiting behind a missing one, or for their turn."""
        return len(self._held)

    def add(self, packet: RtpPacket) -> tuple[bool, JitterFrame | None]:
        """(no PLI, the next frame in order if there is one now)."""
        seq = packet.sequence_number
        if packet.ssrc != self._ssrc:
            stopped_at = self._retired.get(packet.ssrc)
            if stopped_at is not None and self._straggler(seq, stopped_at):
                self.dropped_late += 1  # a late packet of a source already replaced
                return False, None
            if self._ssrc is not None and self._next is not None:
                # Another source (new, or one sending again): the held audio is stale.
                self._retired[self._ssrc] = self._next
                self._retired.move_to_end(self._ssrc)
                while len(self._retired) > RETIRED_SOURCES:
                    self._retired.popitem(last=False)
                self.given_up += len(self._held)
                self._held.clear()
            self._retired.pop(packet.ssrc, None)
            self._ssrc = packet.ssrc
            self._next = seq
        assert self._next is not None
        ahead = (seq - self._next) % SEQUENCE_SPACE
        if ahead >= SEQUENCE_SPACE - MAX_MISORDER:  # behind the next one: already gone
            self.dropped_late += 1
            return False, None
        if ahead >= self.capacity and not self._near_held(seq):
            # A long burst lost, or the sender restarted its numbers. Measured from the
            # newest packet held, not from the next one due: with reorder_wait W, W packets
            # can stay queued, and a short burst must not throw them away.
            self.given_up += ahead - len(self._held)
            self._held.clear()
            self._next = seq
        self._held[seq] = packet
        return False, self._release()

    def _straggler(self, seq: int, stopped_at: int) -> bool:
        """Is ``seq``, of a source replaced when ``stopped_at`` was due next, one of its
        late packets? Behind that point, or less than a buffer past it (packets it sent
        before the switch, delayed on the way); further on, the source is sending again."""
        behind = (stopped_at - seq) % SEQUENCE_SPACE
        return 0 < behind <= MAX_MISORDER or (seq - stopped_at) % SEQUENCE_SPACE < self.capacity

    def _near_held(self, seq: int) -> bool:
        """Whether ``seq`` is less than ``capacity`` after some packet held."""
        return any((seq - held) % SEQUENCE_SPACE < self.capacity for held in self._held)

    def _release(self) -> JitterFrame | None:
        assert self._next is not None
        while self._held:
            head = self._held.pop(self._next, None)
            if head is None:
                offsets = [(seq - self._next) % SEQUENCE_SPACE for seq in self._held]
                if max(offsets) <= self.reorder_wait:
                    return None  # the missing one may still come
                skip = min(offsets)  # give up what is missing before the oldest held packet
                self.given_up += skip
                self._next = (self._next + skip) % SEQUENCE_SPACE
                head = self._held.pop(self._next)
            self._next = (self._next + 1) % SEQUENCE_SPACE
            data: bytes = head._data  # type: ignore[attr-defined]
            if data:
                return JitterFrame(data=data, timestamp=head.timestamp)
            self.empty += 1  # nothing to decode: the next held packet, if any, is due
        return None


def install_receive_buffer(receiver: RTCRtpReceiver, reorder_wait: int) -> bool:
    """Replace an audio receiver's jitter buffer with a ``PromptAudioBuffer``.

    aiortc has no setting for it. Nothing on the server plays the audio (the agent analyses
    a session's microphone; a room re-encodes a speaker's for listeners, whose browsers
    buffer it for playout), so aiortc's playout buffer is pure latency: 80 ms, and ~280 ms
    for the rest of the call after one lost packet. Its empty-payload frames also end the
    decoder (see the module's docstring). Returns False (and changes nothing) if aiortc's
    internals are not what this was written against.
    """
    current = getattr(receiver, _JITTER_BUFFER_ATTR, None)
    if type(current) is not JitterBuffer or current.capacity != _JITTER_BUFFER_CAPACITY:
        return False
    buffer = PromptAudioBuffer(_JITTER_BUFFER_CAPACITY, reorder_wait)
    setattr(receiver, _JITTER_BUFFER_ATTR, buffer)
    return True
