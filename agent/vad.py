"""Voice activity: silero-vad run off the event loop, and the onset / end-of-turn logic.

silero-vad scores one 32 ms window (512 samples at 16 kHz) at a time and keeps recurrent
state between windows, so each session needs its own model instance and its windows must be
scored in order. ``VadPool`` loads the TorchScript model once (from the wheel: no download),
hands each session a copy, and runs every inference on its own worker threads: a window costs
~1.5 ms of CPU (measured on the 2-core VM), which must never stall the audio clock.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.conversation_config import VAD_SAMPLE_RATE, VAD_WINDOW_MS, ListenSettings

Window = npt.NDArray[np.float32]  # 512 mono float32 samples at 16 kHz


class VadPool:
    """One silero model loaded once, copied per session; inference on worker threads."""

    def __init__(self, threads: int = 1) -> None:
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vad")
        self._base: Any = None
        self._lock = threading.Lock()
        self.settled = False  # load() ended: the model is loaded, or failed to load

    def _load_base(self) -> Any:
        with self._lock:
            if self._base is None:
                # Imported here, on a worker thread: torch takes seconds to import.
                import torch
                from silero_vad import load_silero_vad

                torch.set_grad_enabled(False)
                self._base = load_silero_vad(onnx=False)
            return self._base

    def _new_model(self) -> Any:
        model = copy.deepcopy(self._load_base())  # ~14 ms; the first load ~3 s (torch import)
        model.reset_states()
        return model

    async def new_vad(self) -> SileroVad:
        loop = asyncio.get_running_loop()
        model = await loop.run_in_executor(self.executor, self._new_model)
        return SileroVad(model, self)

    async def load(self) -> None:
        """Load the model now (otherwise the first session's microphone waits for it)."""
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, self._load_base)
        finally:
            self.settled = True

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class SileroVad:
    """One session's model: windows are scored in order, one at a time, off the loop."""

    def __init__(self, model: Any, pool: VadPool) -> None:
        self._model = model
        self._pool = pool

    def _score(self, window: Window) -> float:
        import torch

        with torch.inference_mode():
            return float(self._model(torch.from_numpy(window), VAD_SAMPLE_RATE).item())

    def reset(self) -> None:
        """Forget the audio heard so far (silero is recurrent): the next window starts afresh."""
        self._model.reset_states()

    async def probability(self, window: Window) -> float:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool.executor, self._score, window)


class Activity(Enum):
    STARTED = "started"  # the user started talking (onset confirmed)
    ENDED = "ended"  # the user's turn ended (enough silence, or the turn got too long)


@dataclass(frozen=True)
class ActivityEvent:
    kind: Activity
    # Index of the window where the speech began (STARTED) or the last speech window (ENDED).
    window: int


class SpeechDetector:
    """Turns per-window speech probabilities into onsets and ends of turn.

    Onset: ``min_speech_ms`` of consecutive windows at or above the threshold (at least one);
    the event names the first of them. End of turn: ``end_of_turn_silence_ms`` of windows
    below the lower threshold after an onset, or ``max_turn_s`` of turn. Windows between the
    two thresholds keep whatever state holds (hysteresis); before an onset, for no longer
    than the onset itself.
    """

    def __init__(self, settings: ListenSettings) -> None:
        self.settings = settings
        self.onset_windows = max(1, math.ceil(settings.min_speech_ms / VAD_WINDOW_MS))
        self.silence_windows = math.ceil(settings.end_of_turn_silence_ms / VAD_WINDOW_MS)
        self.max_turn_windows = max(1, int(settings.max_turn_s * 1000 / VAD_WINDOW_MS))
        self.index = -1
        self.speaking = False
        self._run = 0  # consecutive speech windows before an onset
        self._between = 0  # windows between the thresholds since the run's last speech
        self._silence = 0  # consecutive silent windows inside a turn
        self._turn_start = 0
        self._last_speech = 0

    def push(self, probability: float) -> ActivityEvent | None:
        self.index += 1
        s = self.settings
        is_speech = probability >= s.vad_threshold
        is_silence = probability < s.vad_neg_threshold
        if not self.speaking:
            # Windows between the thresholds neither count nor break the run (hysteresis),
            # but only for as long as the onset itself: two clicks a second apart, with
            # background scoring 0.4 between them, made 64 ms of "speech" and barged in
            # (found by review).
            if is_speech:
                self._run += 1
                self._between = 0
            elif is_silence:
                self._run = 0
            else:
                self._between += 1
                if self._between > self.onset_windows:
                    self._run = 0
            if self._run >= self.onset_windows:
                self.speaking = True
                self._run = 0
                self._silence = 0
                self._turn_start = self.index - self.onset_windows + 1
                self._last_speech = self.index
                return ActivityEvent(Activity.STARTED, self._turn_start)
            return None
        if is_speech:
            self._silence = 0
            self._last_speech = self.index
        elif is_silence:
            self._silence += 1
        too_long = self.index - self._turn_start + 1 >= self.max_turn_windows
        if self._silence >= self.silence_windows or too_long:
            self.speaking = False
            self._silence = 0
            return ActivityEvent(Activity.ENDED, self._last_speech)
        return None
