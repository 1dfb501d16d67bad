"""The client's microphone: decoded frames -> mono 16 kHz -> 32 ms windows -> VAD -> turns.

Two tasks per session, joined by a bounded queue: a reader that takes aiortc's decoded
frames, downmixes and resamples them (soxr, streaming) and cuts 512-sample windows; and a
scorer that runs silero-vad on each window in the VAD pool's threads, feeds the speech
detector and collects the turn's audio. If scoring falls behind, the oldest windows are
dropped (counted) rather than letting memory or latency grow.

Where the time goes between the user's first word and a barge-in (bench/bargein.py measures
it): the uplink, aiortc's receive jitter buffer (which holds 4 frames = 80 ms for audio;
``install_receive_buffer`` in agent/receive_buffer.py replaces it with one that releases
each packet as it arrives), waiting for a full 32 ms window, silero-vad's own reaction
(its probability rises over a window or two) and the minimum speech duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import soxr
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from agent.conversation_config import (
    VAD_SAMPLE_RATE,
    VAD_WINDOW_MS,
    VAD_WINDOW_SAMPLES,
    ListenSettings,
)
from agent.vad import Activity, ActivityEvent, SileroVad, SpeechDetector, VadPool, Window

log = logging.getLogger(__name__)

# How long a turn the microphone's end cut short waits before it ends (see _read).
TRACK_END_SETTLE_S = 0.5
# No frame at all for this long (or the end-of-turn silence, if longer) ends a turn (see
# _watch_quiet): shorter gaps are the network's jitter or a stalled loop, not the user.
QUIET_ENDS_TURN_MIN_S = 1.0
# RTP time a sender skipped, up to this long, is heard as silence (see _gap_windows); a longer
# jump is a restarted sender (a new timestamp origin), not time.
MAX_GAP_FILLED_S = 2.0


class Listener(Protocol):
    """What the inbound audio reports to (the conversation)."""

    def user_started(self, event: ActivityEvent) -> None:
        """The user started talking (onset confirmed)."""

    def user_ended(self, audio: npt.NDArray[np.float32], event: ActivityEvent) -> None:
        """The user's turn ended; ``audio`` is the turn at 16 kHz, with its pre-roll."""


@dataclass
class InboundStats:
    frames: int = 0
    windows: int = 0
    dropped_windows: int = 0
    onsets: int = 0
    turns: int = 0
    vad_seconds: float = 0.0  # summed inference time (worker threads)
    # Most recent onset: when the frame completing its first speech window arrived from
    # aiortc, and when the onset was confirmed (time.monotonic()).
    last_onset_frame_at: float | None = None
    last_onset_detected_at: float | None = None


def to_mono_float(frame: Any) -> npt.NDArray[np.float32]:
    """An aiortc/PyAV audio frame (s16 or flt, packed or planar) as mono float32."""
    data = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if data.dtype == np.int16:
        samples = data.astype(np.float32) / 32768.0
    else:
        samples = data.astype(np.float32)
    if channels > 1:
        if frame.format.is_planar:
            return np.asarray(samples.mean(axis=0), dtype=np.float32)
        return np.asarray(samples.reshape(-1, channels).mean(axis=1), dtype=np.float32)
    return np.asarray(samples.reshape(-1), dtype=np.float32)


class InboundAudio:
    def __init__(
        self,
        track: MediaStreamTrack,
        pool: VadPool,
        settings: ListenSettings,
        listener: Listener,
        clock: Callable[[], float] = time.monotonic,
        heard: Callable[[], float] | None = None,
    ) -> None:
        self.track = track
        self.settings = settings
        self.stats = InboundStats()
        self.detector = SpeechDetector(settings)
        self.ready = asyncio.Event()  # the VAD model is loaded and scoring
        self._pool = pool
        self._listener = listener
        self._clock = clock
        self._queue: asyncio.Queue[tuple[Window, float]] = asyncio.Queue(
            maxsize=settings.max_pending_windows
        )
        self._resampler: soxr.ResampleStream | None = None
        self._rate = 0
        self._pending = np.zeros(0, dtype=np.float32)
        self._next_pts: int | None = None  # where the next frame starts if none is missing
        # Set when a turn ends mid-speech without the audio saying so (the microphone went
        # quiet or ended): the model's memory is still inside a word, and would hear the
        # next window of mere noise as that word going on. The scorer resets it first.
        self._model_stale = False
        preroll = max(1, settings.preroll_ms // VAD_WINDOW_MS) + self.detector.onset_windows
        self._recent: deque[tuple[Window, float]] = deque(maxlen=preroll)
        self._turn: list[Window] = []
        self._max_turn_windows = self.detector.max_turn_windows + preroll
        self._tasks: list[asyncio.Task[None]] = []
        self._last_frame_at = 0.0  # time.monotonic() of the microphone's last frame (_watch_quiet)
        # time.monotonic() when anything last came from the peer (RTCP, a data-channel
        # message): None where unknown (see _watch_quiet).
        self._heard = heard

    def snapshot(self) -> dict[str, Any]:
        st = self.stats
        return {
            "ready": self.ready.is_set(),
            "speaking": self.detector.speaking,
            "frames": st.frames,
            "windows": st.windows,
            "dropped_windows": st.dropped_windows,
            "onsets": st.onsets,
            "turns": st.turns,
            "vad_ms_per_window": round(st.vad_seconds * 1000 / st.windows, 3)
            if st.windows
            else None,
        }

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._last_frame_at = time.monotonic()
        self._tasks = [
            loop.create_task(self._read()),
            loop.create_task(self._score()),
            loop.create_task(self._watch_quiet()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self._end_turn()  # closed mid-turn: a resumed session's new connection replaces it

    def _end_turn(self) -> None:
        """The microphone is gone mid-turn: the turn ends with what was heard of it.

        Left open, the user would be talking for ever: no reply starts while they do, and
        the client would never get ``user.speech.ended``. The detector had confirmed the
        speech (``--min-speech-ms``), so the audio so far is a turn like any other; one
        cut too short to say anything has an empty transcript, like a cough.
        """
        if not self.detector.speaking:
            return
        last = self.detector.index
        self.detector = SpeechDetector(self.settings)  # no window comes after this one
        self._model_stale = True
        # Nothing of the cut word may reach the reset model, or open the next turn as its
        # pre-roll: the reader's part-window and the resampler's held tail (when the
        # microphone came back, its first window was that word: a new onset in 66 of 155
        # cut points of a clip, and a barge-in; found by review), windows still queued.
        self._pending = np.zeros(0, dtype=np.float32)
        self._resampler = None
        self._recent.clear()
        while not self._queue.empty():
            self._queue.get_nowait()
        self.stats.turns += 1
        audio = np.concatenate(self._turn) if self._turn else np.zeros(0, np.float32)
        self._turn = []
        self._listener.user_ended(audio, ActivityEvent(Activity.ENDED, last))

    # --- reader: frames -> windows -----------------------------------------------------
    async def _read(self) -> None:
        try:
            while True:
                frame = await self.track.recv()
                self._last_frame_at = time.monotonic()
                arrived = self._clock()
                self.stats.frames += 1
                for window in self._gap_windows(frame) + self._windows(frame):
                    if self._queue.full():
                        self._queue.get_nowait()  # the scorer is behind: drop the oldest
                        self.stats.dropped_windows += 1
                    self._queue.put_nowait((window, arrived))
        except MediaStreamError:
            log.debug("inbound audio ended")
        # No window will come any more: stop the scorer (it keeps up, so at most a window or
        # two are left unscored) and end a turn the track ended in the middle of.
        others = [task for task in self._tasks if task is not asyncio.current_task()]
        for task in others:
            task.cancel()
        for task in others:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.detector.speaking:
            # The track ends on the client's RTCP BYE, which a closing connection sends
            # before its SCTP ABORT: ended at once, the turn's user.speech.ended went out on
            # a data channel about to close and was lost to the resumed connection (found by
            # a chaos run). A moment lets the server see the connection go first: the event
            # then waits for the resume. (A resume's stop_listening ends the turn sooner.)
            await asyncio.sleep(TRACK_END_SETTLE_S)
        self._end_turn()

    async def _watch_quiet(self) -> None:
        """Ends a turn the microphone goes quiet in the middle of.

        Quiet on the wire, not in the audio: a client that stops sending mid-turn (it stops
        its track or replaces it with none: no RTCP BYE, so the track does not end) sends no
        windows, and the detector counts silence in windows. The turn stayed open for good:
        no reply started, and the user "talking" kept the session from its idle timeout.
        No frame for as long as the silence that ends a turn (at least
        QUIET_ENDS_TURN_MIN_S) is that silence: the turn ends with what was heard of it,
        as when the track ends. A timer of its own, not a timeout on each frame's wait:
        that would cost a task and a timer handle per frame, 50 a second per session.

        Only while the peer is still heard after that last frame (``heard``: its RTCP, a
        data-channel message): a peer gone quiet as a whole lost its network, and its data
        channel is as dead as its microphone. Ended here, the turn's events and the reply's
        first ones went out on it and were lost, and the reply played to nobody until the
        session was detached (--rtcp-timeout). The connection's loss ends that turn instead
        (its track ends, or a resume's stop_listening), its events kept for the resume.
        """
        quiet_s = max(QUIET_ENDS_TURN_MIN_S, self.settings.end_of_turn_silence_ms / 1000)
        while True:
            remaining = self._last_frame_at + quiet_s - time.monotonic()
            if remaining > 0:
                await asyncio.sleep(remaining)
                continue
            # The queue empty: windows still to score may hold the turn's own end (or, with
            # the scorer behind, its onset), which the detector then sees first.
            peer_there = self._heard is None or self._heard() > self._last_frame_at
            if self.detector.speaking and self._queue.empty() and peer_there:
                self._end_turn()
            await asyncio.sleep(quiet_s)

    def _gap_windows(self, frame: Any) -> list[Window]:
        """The silence before ``frame`` that its sender did not send, as silent windows.

        A client whose Opus encoder runs with DTX sends one packet per 400 ms of silence,
        and a lost packet sends nothing: the turn's end is counted in windows, so 600 ms of
        silence took ~12 s to arrive from a DTX microphone (and the quiet watchdog never
        fired: a packet came every 0.4 s; found by review). The RTP time the frames skip is
        that silence: at most enough of it to end a turn, and none across a jump longer than
        MAX_GAP_FILLED_S (a restarted sender)."""
        pts, rate, samples = frame.pts, int(frame.sample_rate), int(frame.samples)
        expected = self._next_pts
        base = frame.time_base  # compared by parts: no Fraction made per frame
        on_rate_clock = pts is not None and base.numerator == 1 and base.denominator == rate
        self._next_pts = pts + samples if on_rate_clock else None
        if not on_rate_clock or expected is None:
            return []
        missing = pts - expected
        if missing < 2 * samples or missing > rate * MAX_GAP_FILLED_S:  # a lost packet: none
            return []
        most = (self.detector.silence_windows + 1) * VAD_WINDOW_SAMPLES
        silence = np.zeros(min(most, missing * VAD_SAMPLE_RATE // rate), dtype=np.float32)
        return self._cut_windows(silence)

    def _windows(self, frame: Any) -> list[Window]:
        rate = int(frame.sample_rate)
        if self._resampler is None or rate != self._rate:
            self._rate = rate
            self._resampler = soxr.ResampleStream(rate, VAD_SAMPLE_RATE, 1, dtype="float32")
        return self._cut_windows(self._resampler.resample_chunk(to_mono_float(frame)))

    def _cut_windows(self, samples: npt.NDArray[np.float32]) -> list[Window]:
        """``samples`` (16 kHz) after the part-window held back: the whole windows now."""
        data = np.concatenate((self._pending, samples)) if self._pending.size else samples
        whole = data.size // VAD_WINDOW_SAMPLES * VAD_WINDOW_SAMPLES
        windows = [
            np.ascontiguousarray(data[i : i + VAD_WINDOW_SAMPLES], dtype=np.float32)
            for i in range(0, whole, VAD_WINDOW_SAMPLES)
        ]
        self._pending = np.array(data[whole:], dtype=np.float32)
        return windows

    # --- scorer: windows -> VAD -> turns -------------------------------------------------
    async def _score(self) -> None:
        try:
            vad: SileroVad = await self._pool.new_vad()
        except Exception:  # the reader keeps draining (and dropping) windows: no growth
            log.exception("the voice activity model could not load: not listening")
            return
        self.ready.set()
        while True:
            window, arrived = await self._queue.get()
            if self._model_stale:
                vad.reset()  # between two scorings: the model is not in use
                self._model_stale = False
            started = time.perf_counter()
            try:
                probability = await vad.probability(window)
            except Exception:  # a model failure must not end the session; skip the window
                log.exception("voice activity detection failed")
                continue
            self.stats.vad_seconds += time.perf_counter() - started
            self.stats.windows += 1
            self._on_window(window, arrived, probability)

    def _on_window(self, window: Window, arrived: float, probability: float) -> None:
        detector = self.detector
        was_speaking = detector.speaking
        event = detector.push(probability)
        if was_speaking:
            if len(self._turn) < self._max_turn_windows:
                self._turn.append(window)
        else:
            self._recent.append((window, arrived))
        if event is None:
            return
        if event.kind is Activity.STARTED:
            self.stats.onsets += 1
            first = max(0, len(self._recent) - (detector.index - event.window + 1))
            self.stats.last_onset_frame_at = self._recent[first][1]
            self.stats.last_onset_detected_at = self._clock()
            self._turn = [w for w, _ in self._recent]
            self._recent.clear()
            self._listener.user_started(event)
        elif event.kind is Activity.ENDED:
            self.stats.turns += 1
            audio = np.concatenate(self._turn) if self._turn else np.zeros(0, np.float32)
            self._turn = []
            self._listener.user_ended(audio, event)
