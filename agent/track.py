"""The agent's outgoing audio: a MediaStreamTrack that returns 20 ms pre-encoded Opus packets.

aiortc's sender only packetizes an ``av.Packet`` (no resampling, no encoder thread hop), so
the whole per-frame cost is one libopus call, and the encoder's settings stay ours to change.

Pacing: one packet per 20 ms on a clock anchored at the first ``recv``; pts advance by
exactly 960 every packet (no timestamp gaps); an empty playout buffer sends silence.
Two refinements over a plain clock:
- re-phasing on speech onset: while only silence is flowing, the first speech frame is sent
  the moment it arrives instead of at the next tick (up to 20 ms sooner); the lead this
  creates is bounded and paid back by stretching later silence by 1 ms per frame;
- no bursts: if the event loop was late by more than ``max_late_s`` the clock is moved
  forward (by whole frames, so the track keeps its phase among the others) rather than
  sending a catch-up burst.

Lean send path (``use_direct``, the default for sessions): once the connection is up, the
track paces itself with one loop timer per packet and hands each payload straight to a
``DirectSender`` (agent/direct.py: RTP header, SRTP, ``sendto``); aiortc's sender task stays
parked in ``recv``. The same clock, re-phasing and encoding run on both paths; the lean one
skips, per packet, a task wake-up, an ``av.Packet`` and its ``Fraction`` time base, an
``RtpPacket`` with an abs-send-time computed from a datetime, and two coroutine layers. If
the internals it needs are missing the track stays on aiortc's path.

Encoding ahead: with an ``encode_executor`` (worker threads), while speech flows the next
buffered frame is handed to a worker right after the current packet goes out, so libopus
runs (with the GIL released: it is a ctypes call) on another core during the 20 ms sleep and
the event loop only collects the result. The frame stays in the playout buffer until its
tick, so an interrupt still drops it; a result whose frame was dropped is discarded, and the
encoder is restored to its state from before that frame (the listener never got it: what
follows must not be predicted from it), so the packets are byte-identical to inline
encoding's, interrupts included. The first frame after silence is encoded inline, so onset
latency is unchanged.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import cache
from typing import Any

import av
import numpy as np
import numpy.typing as npt
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from agent.config import OpusSettings
from agent.direct import DirectSender
from agent.governor import ComplexityGovernor
from agent.opus import FRAME_SAMPLES, SAMPLE_RATE, OpusEncoder
from agent.playout import PlayoutBuffer, PlayoutFrame

log = logging.getLogger(__name__)

TIME_BASE = fractions.Fraction(1, SAMPLE_RATE)
FRAME_SECONDS = FRAME_SAMPLES / SAMPLE_RATE
# Silence frames encoded after speech before the encoder is reset: they carry the speech
# tail (libopus's 6.5 ms lookahead) and let the decoder fade out.
SILENCE_SETTLE_FRAMES = 3
# libopus's output for digital silence is periodic, not constant: one packet at complexity
# 9-10, a cycle of 4 at complexity 5 and 7 (measured, libopus 1.6). Cycles up to this long
# are detected and replayed.
MAX_SILENCE_CYCLE = 4
MAX_LOGGED_ERRORS = 3  # per track: a failure that repeats every 20 ms must not flood the log


@dataclass
class TrackStats:
    packets: int = 0
    speech_packets: int = 0
    silence_packets: int = 0
    bytes: int = 0
    early_rephases: int = 0  # speech onsets sent before their tick
    late_rephases: int = 0  # times the clock moved forward instead of bursting
    encode_calls: int = 0
    # Packets lost to an exception, on either send path (the packet is lost, the clock goes
    # on); the name predates aiortc's path counting them too.
    direct_errors: int = 0
    # Packets dropped by lean-path senders this track has let go of (a stopped track, one
    # renewed on resume): the live sender's own count is added on top (``send_dropped``).
    released_send_dropped: int = 0


class OpusPacketTrack(MediaStreamTrack):
    kind = "audio"

    def __init__(
        self,
        source: PlayoutBuffer,
        opus: OpusSettings | None = None,
        *,
        rephase_on_onset: bool = True,
        max_lead_s: float = 0.1,
        payback_per_frame_s: float = 0.001,
        max_late_s: float = 0.06,
        encode_executor: Executor | None = None,
        governor: ComplexityGovernor | None = None,
    ) -> None:
        super().__init__()
        settings = opus or OpusSettings()
        self.encoder = OpusEncoder(
            bitrate=settings.bitrate,
            complexity=settings.complexity,
            fec=settings.fec,
            expected_loss_pct=settings.expected_loss_pct,
            dtx=settings.dtx,
            # The frames' rate (the RTP clock is 48 kHz whatever it is).
            sample_rate=source.sample_rate,
        )
        if governor is not None:
            governor.register(self.encoder)  # complexity follows the process's CPU load
        self._source = source
        self._rephase_on_onset = rephase_on_onset
        self._max_lead = max_lead_s
        self._payback = payback_per_frame_s
        self._max_late = max_late_s
        self._start: float | None = None
        self._pts = -FRAME_SAMPLES
        self._lead = 0.0  # how far ahead of the original schedule onsets have moved us
        self._speaking = False  # was the last packet speech?
        # Encoding digital silence from a reset encoder settles to a short cycle of packets
        # after a few frames; replaying it saves a libopus call per idle frame per session.
        self._silence_cycle: list[bytes] | None = None
        self._silence_pos = 0
        self._silence_run: list[bytes] = []
        self._silent_frames = 0  # silence frames encoded since the last speech frame
        self._spoke = False  # speech was encoded since the encoder was created or reset
        self._waiter: asyncio.Future[None] | None = None
        self._executor = encode_executor
        # (frame, its encoding in flight) while a worker encodes the next frame ahead.
        self._ahead: tuple[PlayoutFrame, Future[bytes]] | None = None
        self.stats = TrackStats()
        self._direct: DirectSender | None = None
        self._direct_timer: asyncio.Handle | None = None
        self._parked: asyncio.Future[None] | None = None

    # --- lean send path -----------------------------------------------------------------
    def use_direct(self, direct: DirectSender) -> None:
        """Send through ``direct`` from this track's own timer once connected."""
        self._direct = direct

    @property
    def direct(self) -> bool:
        """Is the lean path sending (rather than aiortc's sender task)?"""
        return self._parked is not None

    @property
    def send_dropped(self) -> int:
        """Packets the lean path dropped: no nominated ICE pair yet, or a backed-up socket."""
        live = self._direct.dropped if self._direct is not None else 0
        return self.stats.released_send_dropped + live

    # --- encoder settings (network adaptation drives these) ----------------------------
    def set_bitrate(self, bits_per_second: int) -> None:
        self.encoder.set_bitrate(bits_per_second)
        self._settings_changed()

    def set_fec(self, enabled: bool) -> None:
        self.encoder.set_fec(enabled)
        self._settings_changed()

    def set_expected_loss(self, percent: int) -> None:
        self.encoder.set_expected_loss(percent)
        self._settings_changed()

    def set_dtx(self, enabled: bool) -> None:
        self.encoder.set_dtx(enabled)
        self._settings_changed()

    def set_max_playback_rate(self, hertz: int | None) -> None:
        """The receivers' band (a room's widest): silence packets made for another band are
        made again."""
        if hertz != self.encoder.max_playback_rate:
            self.encoder.set_max_playback_rate(hertz)
            self._settings_changed()

    def _settings_changed(self) -> None:
        self._silence_cycle = None
        self._silence_run.clear()

    # --- pacing -------------------------------------------------------------------------
    async def recv(self) -> av.Packet[Any]:
        if self.readyState != "live":
            raise MediaStreamError
        loop = asyncio.get_running_loop()
        direct, self._direct = self._direct, None
        if direct is not None and direct.usable and direct.resolve():
            # From here on the track sends by itself; aiortc's task waits here until stop.
            self._direct = direct
            self._parked = loop.create_future()
            self._direct_schedule(loop)
            await self._parked
            raise MediaStreamError
        if direct is not None:  # not usable: aiortc's sender sends; keep what it counted
            self.stats.released_send_dropped += direct.dropped
        # Decided at the first packet (aiortc calls recv once DTLS is up, so the lean path
        # resolves then or never): switching later would restart the RTP sequence numbers,
        # timestamps and sender-report counts of a running stream.
        if self._start is None:
            self._start = loop.time()
        while True:
            due = self._start + (self._pts + FRAME_SAMPLES) / SAMPLE_RATE
            wait = due - loop.time()
            arrived = False
            if wait > 0:
                arrived = await self._sleep_until(
                    loop, due, wake_on_arrival=self._onset_possible(wait)
                )
                if self.readyState != "live":
                    raise MediaStreamError
            frame = self._advance(loop.time(), arrived)
            # As on the lean path, nothing but MediaStreamError may escape: aiortc's RTP
            # task (and a room's pump) would end for good, and the popped frame's marks
            # (speech.ended...) would be lost. A failed encode costs this one packet: its
            # marks still fire and the next tick's packet is returned, the clock going on.
            payload: bytes | None = None
            try:
                payload = self._encode(frame)
            except Exception:
                if self._count_error():
                    log.exception("aiortc send path: a packet was lost")
            try:
                self._after_packet(frame)
            except Exception:
                if self._count_error():
                    log.exception("aiortc send path: failed after a packet")
            if payload is not None:
                packet = av.Packet(payload)
                packet.pts = self._pts
                packet.time_base = TIME_BASE
                return packet
            if self.readyState != "live":
                raise MediaStreamError

    def _count_error(self) -> bool:
        """Count a packet lost to an exception; should it be logged (not every 20 ms)?"""
        self.stats.direct_errors += 1
        return self.stats.direct_errors <= MAX_LOGGED_ERRORS

    def _onset_possible(self, wait: float) -> bool:
        """Should speech arriving during this wait go out at once (re-phasing)?"""
        return (
            self._rephase_on_onset
            and not self._speaking
            and not len(self._source)
            and self._lead + wait <= self._max_lead
        )

    def _advance(self, now: float, arrived: bool) -> PlayoutFrame | None:
        """Step the clock to the next packet at ``now`` and take its frame (None: silence);
        ``arrived``: speech cut the wait short (re-phase the clock to it)."""
        assert self._start is not None
        self._pts += FRAME_SAMPLES
        due = self._start + self._pts / SAMPLE_RATE
        late = now - due
        if arrived and late < 0:
            self._start += late
            self._lead -= late
            self.stats.early_rephases += 1
        elif late > self._max_late:
            # Whatever woke the tick (speech arriving after a stall too: its packets all fell
            # due at once, found by review).
            # The loop stalled: move the clock instead of bursting packets to catch up, by
            # whole frames, so the track keeps its phase. Moving it to "now" would give
            # every track that one stall delayed the same phase: from then on their packets
            # all fall due in one burst per tick, the ones served last are late, and the
            # next stall is more likely (a saturated process then clusters all its tracks).
            self._start += late - late % FRAME_SECONDS
            self.stats.late_rephases += 1
        return self._source.pop()

    def _after_packet(self, frame: PlayoutFrame | None) -> None:
        if frame is None:
            return
        for mark in frame.marks:
            try:
                mark()
            except Exception:  # a failing event must never stop the RTP sender
                log.exception("playout mark failed")
        self._encode_next_ahead()

    def _direct_schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """Arm the timer for the next packet (and the onset wake-up while silent)."""
        if self._start is None:
            self._start = loop.time()
        due = self._start + (self._pts + FRAME_SAMPLES) / SAMPLE_RATE
        wait = due - loop.time()
        if wait <= 0:
            self._direct_timer = loop.call_soon(self._direct_tick, loop, False)
            return
        if self._onset_possible(wait):
            self._source.on_arrival = self._direct_arrival
        self._direct_timer = loop.call_at(due, self._direct_tick, loop, False)

    def _direct_arrival(self) -> None:
        # Called from the playout buffer's push: send from a fresh loop callback, not from
        # inside the producer's call.
        self._source.on_arrival = None
        timer = self._direct_timer
        if timer is not None:
            timer.cancel()
            loop = asyncio.get_running_loop()
            self._direct_timer = loop.call_soon(self._direct_tick, loop, True)

    def _direct_tick(self, loop: asyncio.AbstractEventLoop, arrived: bool) -> None:
        self._direct_timer = None
        if self._source.on_arrival == self._direct_arrival:
            self._source.on_arrival = None
        direct = self._direct
        if self.readyState != "live" or direct is None:
            return
        # Nothing may escape a tick: the loop would only log it, and this track would never
        # tick again. A failed encode or send costs one packet; the clock goes on.
        frame = None
        try:
            frame = self._advance(loop.time(), arrived)
            direct.send(self._encode(frame), self._pts)
        except Exception:
            if self._count_error():
                log.exception("lean send path: a packet was lost")
        try:
            self._after_packet(frame)  # its marks fire even if its packet was lost
        except Exception:
            if self._count_error():
                log.exception("lean send path: failed after a packet")
        if self.readyState == "live" and self._direct is not None:
            self._direct_schedule(loop)

    def _encode_next_ahead(self) -> None:
        if self._executor is None:
            return
        upcoming = self._source.peek()
        if upcoming is not None:
            self._ahead = (
                upcoming,
                self._executor.submit(_encode_undoably, self.encoder, upcoming.pcm),
            )

    def _take_ahead(self, frame: PlayoutFrame | None) -> bytes | None:
        """The ahead-encoded payload for ``frame``, or None (and the stale job settled)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        upcoming, job = ahead
        if frame is not None and upcoming.pcm is frame.pcm:  # peek and pop: same array
            if not job.done() and job.cancel():
                return None  # still queued behind other sessions' jobs: encode it inline
            return job.result()  # normally done already: it had 20 ms
        # The frame was dropped (interrupt): the encoder must not run it after what follows.
        if not job.cancel():
            # It ran (or is running): libopus took the frame into its prediction and
            # lookahead. Take it back, or every later packet is coded from audio the
            # listener never got (louder residue 10-20 ms after a barge-in, then drift).
            try:
                job.result()
            finally:
                self.encoder.restore()
        return None

    async def _sleep_until(
        self, loop: asyncio.AbstractEventLoop, when: float, *, wake_on_arrival: bool
    ) -> bool:
        """Sleep until ``when``; return True if a frame arrived first (and woke us)."""
        fut: asyncio.Future[None] = loop.create_future()
        timer = loop.call_at(when, _resolve, fut)
        arrived = False

        def on_arrival() -> None:
            nonlocal arrived
            arrived = True
            _resolve(fut)

        if wake_on_arrival:
            self._source.on_arrival = on_arrival
        self._waiter = fut
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None
            # Only if the hook is still ours: a stopped track's wait ends a loop step after
            # stop(), and a track renewed on the same buffer (a resume) may have set its own.
            if self._source.on_arrival is on_arrival:
                self._source.on_arrival = None
        return arrived

    def _encode(self, frame: PlayoutFrame | None) -> bytes:
        stats = self.stats
        stats.packets += 1
        ready = self._take_ahead(frame)
        if frame is not None:
            self._speaking = True
            self._silence_run.clear()
            self._silence_cycle = None
            self._silent_frames = 0
            self._spoke = True
            stats.speech_packets += 1
            stats.encode_calls += 1
            payload = ready if ready is not None else self.encoder.encode(frame.pcm)
            stats.bytes += len(payload)
            return payload
        self._speaking = False
        stats.silence_packets += 1
        if self._lead > 0:
            # Pay back the onset lead by stretching silence slightly (inaudible).
            step = min(self._payback, self._lead)
            assert self._start is not None
            self._start += step
            self._lead -= step
        if self._silence_cycle is None:
            self._silent_frames += 1
            if self._spoke and self._silent_frames > SILENCE_SETTLE_FRAMES:
                # After speech libopus's silence output keeps changing for seconds (at
                # complexity 5 it never repeats); from a reset state it is periodic within a
                # few frames. The speech tail went out in the frames before.
                self.encoder.reset()
                self._spoke = False
                self._silence_run.clear()
            stats.encode_calls += 1
            payload = self.encoder.encode(_zero_frame(self.encoder.frame_samples))
            run = self._silence_run
            run.append(payload)
            # With DTX the encoder switches to 1-byte "no data" packets after ~200 ms of
            # silence: replay that packet, not the full silence frames that come first.
            if not self.encoder.dtx:
                periods = range(1, MAX_SILENCE_CYCLE + 1)
            elif len(payload) <= 2:
                periods = range(1, 2)
            else:
                periods = range(0)  # DTX has not kicked in yet: keep encoding
            for period in periods:
                # Two full identical periods plus one more packet agreeing: a cycle.
                if len(run) >= 2 * period + 1 and all(
                    run[-1 - i] == run[-1 - i - period] for i in range(period + 1)
                ):
                    self._silence_cycle = run[-period:]
                    self._silence_pos = 0
                    run.clear()
                    break
            else:
                if len(run) > 2 * MAX_SILENCE_CYCLE + 1:
                    run.pop(0)
        else:
            payload = self._silence_cycle[self._silence_pos]
            self._silence_pos = (self._silence_pos + 1) % len(self._silence_cycle)
        stats.bytes += len(payload)
        return payload

    def stop(self) -> None:
        super().stop()
        if self._direct_timer is not None:
            self._direct_timer.cancel()
            self._direct_timer = None
        if self._source.on_arrival == self._direct_arrival:
            self._source.on_arrival = None
        if self._parked is not None and not self._parked.done():
            self._parked.set_result(None)
        if self._direct is not None:  # its count outlives it, like the other figures
            self.stats.released_send_dropped += self._direct.dropped
        self._direct = None  # holds the sender and its transports: let them go with the pc
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        try:
            self._take_ahead(None)
        finally:
            self.encoder.close()


def _encode_undoably(encoder: OpusEncoder, pcm: npt.NDArray[np.int16]) -> bytes:
    """Encode a frame ahead, in a worker, saving the encoder's state first for
    ``restore`` should the frame be dropped. The snapshot runs here rather than on the loop
    before the job is handed over: it costs the loop nothing, and a job cancelled before it
    started took nothing to take back (the loop awaits or cancels each job before touching
    the encoder again, so nothing else encodes in between)."""
    encoder.snapshot()
    return encoder.encode(pcm)


@cache
def _zero_frame(samples: int) -> npt.NDArray[np.int16]:
    frame = np.zeros(samples, dtype=np.int16)
    frame.flags.writeable = False
    return frame


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
