"""One encode, many listeners: an Opus packet stream fanned out to per-subscriber tracks.

A room source (the agent's speech, or one person's microphone) is encoded exactly once per
20 ms frame; ``FanoutSource.publish`` hands the same payload bytes to every subscriber. Each
subscriber has its own ``FanoutTrack`` (one per peer connection's sender) with:
- a bounded queue that drops the oldest packet when full: a slow or gone subscriber loses
  its own audio and never holds up the source or the others (publish never waits);
- its own RTP timeline: pts advance by 960 per packet (a short stall of the event loop
  moves its clock instead) and jump forward by the silent time when its source paused for
  half a second or more (also across a change of source: a new speaker on the slot after a
  shorter gap continues the timeline), so pts stay monotonic and on the 20 ms grid whatever
  the sources do;
- no clock of its own: the source's clock paces every subscriber (one timer per source,
  not one per listener), which is part of keeping the per-listener path lean.

Bitrate: a source serves receivers with different networks but has one encoder. Each
subscriber keeps its own feedback loop (RTCP tap + controller); ``SharedEncoderControl``
combines their wishes: the lowest bitrate, FEC on if anyone asks, the highest expected loss.
Reasoning: a bitrate above a receiver's estimate congests that receiver's path, while FEC
and a lower rate only cost the others a little quality; speech at the 12-20 kbps floor stays
intelligible. A few layers (one encode per distinct target) would bound that cost; with 1-3
encodes per source instead of one per listener it is the natural next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fractions
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import av
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from agent.bitrate import EncoderTarget
from agent.direct import DirectSender
from agent.opus import FRAME_SAMPLES, SAMPLE_RATE
from agent.track import TrackStats

log = logging.getLogger(__name__)

TIME_BASE = fractions.Fraction(1, SAMPLE_RATE)
# A subscriber this many frames behind or ahead of its clock moves its clock (a stall or a
# burst: timestamps stay continuous, like OpusPacketTrack's late re-phasing) ...
RESYNC_FRAMES = 3
# ... and this many or more is a pause of its source (a speaker stopped sending, a slot
# changed hands): the timestamps jump by the pause, as with DTX.
PAUSE_FRAMES = 25


class FanoutTrack(MediaStreamTrack):
    """One subscriber's outgoing track: packets published by whichever source feeds it."""

    kind = "audio"

    def __init__(self, queue_frames: int = 10) -> None:
        super().__init__()
        # (payload, speech?): what aiortc's sender takes next, and whether it is speech.
        self._queue: deque[tuple[bytes, bool]] = deque(maxlen=max(1, queue_frames))
        self._waiter: asyncio.Future[None] | None = None
        self._start: float | None = None
        self._pts = -FRAME_SAMPLES
        self.dropped = 0  # packets dropped because this subscriber fell behind
        self.stats = TrackStats()
        self.source: FanoutSource | None = None
        self.last_size = 0  # bytes of the packet returned last (transport-cc bookkeeping)
        self._direct: DirectSender | None = None
        # Has aiortc's sender started pulling (its connection is up)? Before, only the
        # newest packet is kept and nothing counts as dropped: the queue filled during ICE
        # and DTLS, each overflow counted as falling behind, then the joiner got 200 ms of
        # stale audio at once (found by review).
        self._pulling = False

    def use_direct(self, direct: DirectSender) -> None:
        """Send from the source's tick (agent/direct.py) instead of through aiortc's sender."""
        self._direct = direct

    @property
    def dropped_total(self) -> int:
        """Packets this subscriber missed: queue overflow or a backed-up socket."""
        return self.dropped + (self._direct.dropped if self._direct is not None else 0)

    @property
    def direct(self) -> bool:
        """Is the lean path in use (rather than aiortc's sender)?"""
        return self._direct is not None and self._direct.usable

    def push(self, payload: bytes, now: float, speech: bool = False) -> None:
        """Hand over one packet (never waits): sent at once on the lean path, else queued
        for aiortc's sender, the oldest dropped when the queue is full. ``speech``: it
        carries speech, not silence (counted as such)."""
        if self.readyState != "live":
            return
        direct = self._direct
        if direct is not None and direct.usable:
            if direct.resolve():
                try:
                    direct.send(payload, self._stamp(now))
                except Exception:  # one subscriber's failure must not reach the others
                    log.exception("direct send failed; this subscriber drops the packet")
                    self.dropped += 1
                    return
                self._count(payload, speech)
                return
            if direct.usable:
                return  # not connected yet: aiortc could not send it either
        if not self._pulling:
            self._queue.clear()  # not connected yet: the newest packet only, as the lean path
        elif len(self._queue) == self._queue.maxlen:
            self.dropped += 1
        self._queue.append((payload, speech))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def recv(self) -> av.Packet[Any]:
        self._pulling = True
        while not self._queue:
            if self.readyState != "live":
                raise MediaStreamError
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.readyState != "live":
            raise MediaStreamError
        payload, speech = self._queue.popleft()
        packet = av.Packet(payload)
        packet.pts = self._stamp(asyncio.get_running_loop().time())
        packet.time_base = TIME_BASE
        self._count(payload, speech)
        return packet

    def _stamp(self, now: float) -> int:
        """This subscriber's pts for a packet sent ``now``: +960, or the clock after a pause."""
        if self._start is None:
            self._start = now
        pts = self._pts + FRAME_SAMPLES
        on_clock = int((now - self._start) * SAMPLE_RATE) // FRAME_SAMPLES * FRAME_SAMPLES
        lag = on_clock - pts
        if lag >= PAUSE_FRAMES * FRAME_SAMPLES:
            pts = on_clock
        elif abs(lag) > RESYNC_FRAMES * FRAME_SAMPLES:
            # Late (a stall) or early (a source that bursts, e.g. a microphone's jitter buffer
            # releasing frames): follow it, so that a later pause is measured from here.
            self._start += lag / SAMPLE_RATE
        self._pts = pts
        return pts

    def _count(self, payload: bytes, speech: bool) -> None:
        stats = self.stats
        stats.packets += 1
        if speech:
            stats.speech_packets += 1
        stats.bytes += len(payload)
        self.last_size = len(payload)

    def stop(self) -> None:
        super().stop()
        if self.source is not None:
            self.source.unsubscribe(self)
        self._queue.clear()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _ignore_target(target: EncoderTarget) -> None:
    """The apply callback of a released control: its encoder is gone."""


class SharedEncoderControl:
    """Combines each subscriber's encoder wish into the one encoder's settings."""

    def __init__(self, apply: Callable[[EncoderTarget], None]) -> None:
        self._apply = apply
        self._wishes: dict[object, EncoderTarget] = {}
        self.current: EncoderTarget | None = None

    def wish(self, who: object, target: EncoderTarget) -> None:
        self._wishes[who] = target
        self._update()

    def forget(self, who: object) -> None:
        if self._wishes.pop(who, None) is not None:
            self._update()

    def release(self) -> None:
        """Drop the apply callback: it is usually a bound method of the source's owner (a
        room), which holds the source, and a cycle would leave a closed room to the cyclic
        garbage collector (signaling/release.py says why that matters)."""
        self._wishes.clear()
        self._apply = _ignore_target

    def _update(self) -> None:
        if not self._wishes:
            return  # keep the last settings for whoever subscribes next
        wishes = self._wishes.values()
        # The band: the widest any listener plays (a narrow-band one hears the wide band's
        # low part), capped only when every listener asked for a cap.
        rates = [w.max_playback_rate for w in wishes]
        target = EncoderTarget(
            bitrate=min(w.bitrate for w in wishes),
            fec=any(w.fec for w in wishes),
            expected_loss_pct=max(w.expected_loss_pct for w in wishes),
            max_playback_rate=None if None in rates else max(r for r in rates if r is not None),
        )
        if target != self.current:
            self.current = target
            self._apply(target)


class SubscriberWish:
    """A subscriber's controller output, shaped like an encoder's setters (for ``Applier``)."""

    def __init__(self, control: SharedEncoderControl, initial: EncoderTarget) -> None:
        self._control = control
        self.target = initial
        # Withdrawn (an empty slot: no encoder to steer yet) its controller still runs, and
        # a wish it sent then would join the control it last named (the agent's) for good;
        # closed (the member left) it never comes back, whatever RTCP still arrives.
        self._active = True
        self._closed = False

    def set_bitrate(self, bits_per_second: int) -> None:
        self._set(bitrate=bits_per_second)

    def set_fec(self, enabled: bool) -> None:
        self._set(fec=enabled)

    def set_expected_loss(self, percent: int) -> None:
        self._set(expected_loss_pct=percent)

    def _set(self, **changes: Any) -> None:
        self.target = dataclasses.replace(self.target, **changes)
        if self._active:
            self._control.wish(self, self.target)

    def move_to(self, control: SharedEncoderControl) -> None:
        """The subscriber's track now carries another source (a slot changed speaker)."""
        if self._closed or (control is self._control and self._active):
            return
        self._control.forget(self)
        self._control = control
        self._active = True
        control.wish(self, self.target)

    def withdraw(self) -> None:
        """No source to steer for now (an empty slot); ``move_to`` gives it one."""
        self._active = False
        self._control.forget(self)

    def close(self) -> None:
        """The subscriber is gone: its wish never counts again."""
        self._closed = True
        self.withdraw()


class FanoutSource:
    """A once-encoded packet stream and the tracks it feeds."""

    def __init__(self, name: str, apply: Callable[[EncoderTarget], None]) -> None:
        self.name = name
        self._tracks: list[FanoutTrack] = []
        self.control = SharedEncoderControl(apply)
        self.packets = 0  # packets published (= encoder outputs): independent of listeners

    @property
    def subscribers(self) -> int:
        return len(self._tracks)

    def subscribe(self, track: FanoutTrack) -> None:
        if track.source is not None:
            track.source.unsubscribe(track)
        track.source = self
        self._tracks.append(track)

    def unsubscribe(self, track: FanoutTrack) -> None:
        if track in self._tracks:
            self._tracks.remove(track)
        if track.source is self:
            track.source = None

    def publish(self, payload: bytes, speech: bool = False) -> None:
        self.packets += 1
        now = asyncio.get_running_loop().time()
        for track in self._tracks:
            track.push(payload, now, speech)

    def close(self) -> None:
        for track in list(self._tracks):
            self.unsubscribe(track)
        self.control.release()
