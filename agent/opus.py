"""Opus encoding with the libopus that PyAV bundles, through ctypes.

aiortc's own encoder is fixed at 96 kbps stereo with no FEC (NOTES); FFmpeg's wrapper cannot
change settings after opening. libopus itself can, with ``opus_encoder_ctl``, at any frame
boundary: that is what network adaptation needs, so we talk to it directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import threading
from functools import cache
from typing import cast

import av
import numpy as np
import numpy.typing as npt

from agent.opus_rates import FRAME_SAMPLES as FRAME_SAMPLES  # re-exported for its users
from agent.opus_rates import INPUT_RATES, frame_samples
from agent.opus_rates import MAX_BITRATE as MAX_BITRATE  # re-exported for its users
from agent.opus_rates import MIN_BITRATE as MIN_BITRATE  # re-exported for its users
from agent.opus_rates import SAMPLE_RATE as SAMPLE_RATE  # re-exported for its users

MAX_PACKET_BYTES = 1_275  # largest Opus frame (RFC 6716 section 3.2.1)
# One array type for every encoder's output buffer: ctypes caches ``c_char * n`` only while
# an instance lives, and a type object is its own reference cycle, so creating one per
# encoder (create_string_buffer) left garbage for the cyclic collector at every session.
_PacketBuffer = ctypes.c_char * MAX_PACKET_BYTES

_OPUS_APPLICATION_VOIP = 2048
_OPUS_OK = 0
# opus_defines.h request codes
_SET_BITRATE = 4002
_SET_MAX_BANDWIDTH = 4004
_SET_COMPLEXITY = 4010
_SET_INBAND_FEC = 4012
_SET_PACKET_LOSS_PERC = 4014
_SET_DTX = 4016
_SET_SIGNAL = 4024
_RESET_STATE = 4028
_SIGNAL_VOICE = 3001

# maxplaybackrate (Hz, RFC 7587) -> the widest Opus band worth coding for it.
_BANDWIDTH_FOR_RATE = ((8_000, 1101), (12_000, 1102), (16_000, 1103), (24_000, 1104))
_FULLBAND = 1105


class OpusError(RuntimeError):
    pass


@cache
def _frame_buffer_type(samples: int) -> type[ctypes.Array[ctypes.c_int16]]:
    # One array type per frame size for every encoder: ctypes caches ``c_int16 * n`` only
    # while an instance lives, and a type object is its own reference cycle.
    return ctypes.c_int16 * samples


@cache
def _state_buffer_type(size: int) -> type[ctypes.Array[ctypes.c_char]]:
    # One array type for every encoder's snapshot buffer, as for the frame buffers.
    return ctypes.c_char * size


@cache
def _libopus() -> ctypes.CDLL:
    """Find and load the libopus shipped inside the av wheel (or a system one as fallback)."""
    av_dir = os.path.dirname(av.__file__)
    candidates = sorted(glob.glob(os.path.join(av_dir, os.pardir, "av.libs", "libopus*.so*")))
    candidates += sorted(glob.glob(os.path.join(av_dir, ".dylibs", "libopus*.dylib")))
    candidates += ["libopus.so.0", "libopus.so"]
    errors = []
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        lib.opus_encoder_create.restype = ctypes.c_void_p
        lib.opus_encoder_create.argtypes = [
            ctypes.c_int32,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_int),
        ]
        lib.opus_encode.restype = ctypes.c_int32
        lib.opus_encode.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int32,
        ]
        lib.opus_encoder_destroy.restype = None
        lib.opus_encoder_destroy.argtypes = [ctypes.c_void_p]
        lib.opus_encoder_ctl.restype = ctypes.c_int
        lib.opus_encoder_get_size.restype = ctypes.c_int
        lib.opus_encoder_get_size.argtypes = [ctypes.c_int]
        lib.opus_decoder_create.restype = ctypes.c_void_p
        lib.opus_decoder_create.argtypes = [
            ctypes.c_int32,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_int),
        ]
        lib.opus_decode.restype = ctypes.c_int
        lib.opus_decode.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int32,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
        ]
        lib.opus_decoder_destroy.restype = None
        lib.opus_decoder_destroy.argtypes = [ctypes.c_void_p]
        lib.opus_packet_has_lbrr.restype = ctypes.c_int
        lib.opus_packet_has_lbrr.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.opus_strerror.restype = ctypes.c_char_p
        lib.opus_strerror.argtypes = [ctypes.c_int]
        return lib
    raise OpusError("libopus not found (looked inside the av wheel): " + "; ".join(errors))


def _check(code: int, what: str) -> int:
    if code < 0:
        message = _libopus().opus_strerror(code)
        raise OpusError(f"{what}: {message.decode() if message else code}")
    return code


class OpusEncoder:
    """A mono libopus encoder for 20 ms frames whose settings can change any time.

    ``sample_rate`` is the input's (one of ``INPUT_RATES``); the packets are 48 kHz-clock
    Opus packets either way.

    Setters are thread-safe with respect to ``encode`` (a lock serialises them), so a
    controller on the event loop can adjust an encoder used from anywhere.

    ``snapshot`` and ``restore`` take a frame back: the track encodes the next frame ahead in
    a worker thread, and if an interrupt drops that frame the encoder must be left as if it
    never saw it (agent/track.py).
    """

    def __init__(
        self,
        bitrate: int = 32_000,
        complexity: int = 9,
        fec: bool = False,
        expected_loss_pct: int = 0,
        dtx: bool = False,
        sample_rate: int = SAMPLE_RATE,
    ) -> None:
        if sample_rate not in INPUT_RATES:
            raise ValueError(f"libopus encodes from {INPUT_RATES} Hz, not {sample_rate}")
        self.sample_rate = sample_rate
        self.frame_samples = frame_samples(sample_rate)
        lib = _libopus()
        error = ctypes.c_int(0)
        handle = lib.opus_encoder_create(
            sample_rate, 1, _OPUS_APPLICATION_VOIP, ctypes.byref(error)
        )
        _check(error.value, "opus_encoder_create")
        if not handle:
            raise OpusError("opus_encoder_create returned NULL")
        self._lib = lib
        self._handle: int | None = handle
        self._handle_arg = ctypes.c_void_p(handle)
        self._lock = threading.Lock()
        self._out = _PacketBuffer()
        self._out_addr = ctypes.addressof(self._out)
        # Each frame is copied into this buffer rather than passed by its own address:
        # ``ndarray.ctypes.data`` costs ~1.8 us a call, the copy ~0.5 us, and any strided or
        # read-only frame works too (measured: ~2 us of ~100 at complexity 0, per packet).
        self._in = _frame_buffer_type(self.frame_samples)()
        self._in_addr = ctypes.addressof(self._in)
        self._in_view: npt.NDArray[np.int16] = np.frombuffer(memoryview(self._in), dtype=np.int16)
        self._bitrate = 0
        self._fec = False
        self._loss = 0
        self._dtx = False
        self._complexity = 0
        # The last value of every setting made (ctl request -> value), and which were made
        # since the snapshot: restore replays those.
        self._settings: dict[int, int] = {}
        self._changed: set[int] = set()
        # The snapshot: allocated at the first one (only encoding ahead uses it), then reused.
        self._saved: ctypes.Array[ctypes.c_char] | None = None
        self._saved_addr = 0
        self.max_playback_rate: int | None = None
        self.band_cap: int | None = None
        self._ctl(_SET_SIGNAL, _SIGNAL_VOICE)
        self.set_complexity(complexity)
        self.set_bitrate(bitrate)
        self.set_fec(fec)
        self.set_expected_loss(expected_loss_pct)
        self.set_dtx(dtx)

    # --- settings -------------------------------------------------------------------
    @property
    def bitrate(self) -> int:
        return self._bitrate

    @property
    def fec(self) -> bool:
        return self._fec

    @property
    def expected_loss_pct(self) -> int:
        return self._loss

    @property
    def dtx(self) -> bool:
        return self._dtx

    @property
    def complexity(self) -> int:
        return self._complexity

    @property
    def closed(self) -> bool:
        return self._handle is None

    def set_bitrate(self, bits_per_second: int) -> None:
        value = int(min(MAX_BITRATE, max(MIN_BITRATE, bits_per_second)))
        self._ctl(_SET_BITRATE, value)
        self._bitrate = value

    def set_fec(self, enabled: bool) -> None:
        self._ctl(_SET_INBAND_FEC, 1 if enabled else 0)
        self._fec = bool(enabled)

    def set_expected_loss(self, percent: int) -> None:
        value = int(min(100, max(0, percent)))
        self._ctl(_SET_PACKET_LOSS_PERC, value)
        self._loss = value

    def set_dtx(self, enabled: bool) -> None:
        self._ctl(_SET_DTX, 1 if enabled else 0)
        self._dtx = bool(enabled)

    def set_max_playback_rate(self, hertz: int | None) -> None:
        """Code no wider a band than a receiver playing at ``hertz`` can reproduce (None:
        any receiver, the full band)."""
        self.max_playback_rate = hertz
        self._apply_max_band()

    def set_band_cap(self, hertz: int | None) -> None:
        """Code no wider a band than ``hertz`` of playback rate would need, whatever the
        receiver plays (None lifts the cap): the CPU governor's cheap rungs, where 16000
        (wide-band) leaves libopus to code SILK alone, a third cheaper (agent/governor.py).
        The narrower of this and the receiver's rate applies."""
        self.band_cap = hertz
        self._apply_max_band()

    def _apply_max_band(self) -> None:
        limits = [r for r in (self.max_playback_rate, self.band_cap) if r is not None]
        hertz = min(limits, default=None)
        band = (
            _FULLBAND
            if hertz is None
            else next((code for rate, code in _BANDWIDTH_FOR_RATE if hertz <= rate), _FULLBAND)
        )
        self._ctl(_SET_MAX_BANDWIDTH, band)

    def set_complexity(self, complexity: int) -> None:
        value = int(min(10, max(0, complexity)))
        self._ctl(_SET_COMPLEXITY, value)
        self._complexity = value

    def _ctl(self, request: int, value: int) -> None:
        with self._lock:
            self._ctl_locked(request, value)

    def _ctl_locked(self, request: int, value: int) -> None:
        if self._handle is None:
            raise OpusError("encoder is closed")
        # opus_encoder_ctl is variadic; every setter takes one opus_int32.
        _check(
            self._lib.opus_encoder_ctl(
                ctypes.c_void_p(self._handle), ctypes.c_int(request), ctypes.c_int32(value)
            ),
            f"opus_encoder_ctl({request})",
        )
        # Recorded under the lock, with the call: a restore replays exactly what was set.
        self._settings[request] = value
        self._changed.add(request)

    def reset(self) -> None:
        """OPUS_RESET_STATE: back to a freshly created encoder's state, settings kept."""
        with self._lock:
            if self._handle is None:
                raise OpusError("encoder is closed")
            code = self._lib.opus_encoder_ctl(
                ctypes.c_void_p(self._handle), ctypes.c_int(_RESET_STATE)
            )
            _check(code, "opus_encoder_ctl(OPUS_RESET_STATE)")

    # --- taking a frame back ----------------------------------------------------------
    # libopus's encoder state is one allocation of opus_encoder_get_size(channels) bytes: the
    # SILK and CELT encoders sit inside it at offsets (silk_enc_offset, celt_enc_offset), and
    # its only pointers are to static const data (CELT's mode, SILK's codebooks and iCDF and
    # resampler tables) or NULL (the surround energy mask, which only a multistream encoder
    # sets). opus.h says so: "The encoder state is always continuous in memory and only a
    # shallow copy is sufficient to copy it (e.g. memcpy())", "position independent and can
    # be freely copied" (1.1 to 1.6.1; checked against opus_encoder.c, celt_encoder.c and
    # silk/structs.h of 1.6.1, the version PyAV bundles). tests/test_opus.py checks that a
    # restored encoder codes every later frame byte for byte as one that never saw the
    # dropped frame, at every complexity, with FEC, DTX, band caps and both input rates.
    # Cost (measured on the dev VM, libopus 1.6.1: the state is 31,668 bytes for mono): 1.7 us
    # a snapshot, 1.9 us a restore plus ~1.4 us per setting replayed, against 220-270 us an
    # encode of speech at complexity 9 (under 1%).
    def snapshot(self) -> None:
        """Save the whole encoder state, for ``restore`` to go back to (one slot: each
        snapshot replaces the last). Settings are not part of it (see ``restore``)."""
        with self._lock:
            if self._handle is None:
                raise OpusError("encoder is closed")
            if self._saved is None:
                # The size opus_encoder_create allocated for a mono VOIP encoder.
                size = _check(self._lib.opus_encoder_get_size(1), "opus_encoder_get_size")
                self._saved = _state_buffer_type(size)()
                self._saved_addr = ctypes.addressof(self._saved)
            ctypes.memmove(self._saved_addr, self._handle, len(self._saved))
            self._changed.clear()

    def restore(self) -> None:
        """Back to the last ``snapshot``: the frames encoded since are forgotten, as is a
        ``reset``; the settings made since are kept (replayed: a controller's change made
        while a worker encoded the dropped frame must not be undone)."""
        with self._lock:
            if self._handle is None:
                raise OpusError("encoder is closed")
            if self._saved is None:
                raise OpusError("no snapshot to restore")
            ctypes.memmove(self._handle, self._saved_addr, len(self._saved))
            # Only the settings made since the snapshot: each setter is a plain assignment of
            # config fields (opus_encoder_ctl, 1.6.1), so the state is then byte for byte that
            # of an encoder that never saw the dropped frames. Replaying every setting would
            # not be: encoding overwrites one of them (SILK's max internal rate) as scratch.
            for request in tuple(self._changed):
                self._ctl_locked(request, self._settings[request])

    # --- encoding -------------------------------------------------------------------
    def encode(self, pcm: npt.NDArray[np.int16]) -> bytes:
        """Encode exactly one 20 ms frame of mono int16 PCM at the encoder's input rate."""
        samples = self.frame_samples
        if pcm.dtype != np.int16 or pcm.shape != (samples,):
            raise ValueError(f"expected {samples} int16 samples, got {pcm.dtype} {pcm.shape}")
        with self._lock:
            if self._handle is None:
                raise OpusError("encoder is closed")
            self._in_view[:] = pcm
            size = _check(
                self._lib.opus_encode(
                    self._handle_arg, self._in_addr, samples, self._out_addr, MAX_PACKET_BYTES
                ),
                "opus_encode",
            )
            # A c_char array's slice is bytes (typeshed says list); half the cost of .raw.
            return cast(bytes, self._out[:size])

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                self._lib.opus_encoder_destroy(ctypes.c_void_p(self._handle))
                self._handle = None

    def __del__(self) -> None:
        # Encoders are small, but sessions come and go for days: never leak native state.
        # Interpreter shutdown can have torn ctypes down already: nothing left to free then.
        with contextlib.suppress(Exception):
            self.close()


class OpusDecoder:
    """A mono 48 kHz libopus decoder that can recover a lost frame from the next packet's FEC.

    What a WebRTC receiver does on loss: if the packet after a lost one arrived and carries
    in-band FEC (LBRR), decode the lost frame from it; otherwise conceal (PLC). Tests and
    ``bench/loss.py`` use it to count how much audio a receiver had to conceal.
    """

    def __init__(self) -> None:
        lib = _libopus()
        error = ctypes.c_int(0)
        handle = lib.opus_decoder_create(SAMPLE_RATE, 1, ctypes.byref(error))
        _check(error.value, "opus_decoder_create")
        if not handle:
            raise OpusError("opus_decoder_create returned NULL")
        self._lib = lib
        self._handle: int | None = handle
        self._pcm = np.zeros(FRAME_SAMPLES, dtype=np.int16)

    def _decode(self, packet: bytes | None, fec: bool) -> npt.NDArray[np.int16]:
        if self._handle is None:
            raise OpusError("decoder is closed")
        data = packet if packet else None
        size = _check(
            self._lib.opus_decode(
                ctypes.c_void_p(self._handle),
                data,
                len(packet) if packet else 0,
                self._pcm.ctypes.data,
                FRAME_SAMPLES,
                1 if fec else 0,
            ),
            "opus_decode",
        )
        return self._pcm[:size].copy()

    def decode(self, packet: bytes) -> npt.NDArray[np.int16]:
        """One received 20 ms packet to PCM."""
        return self._decode(packet, fec=False)

    def recover(self, next_packet: bytes) -> npt.NDArray[np.int16]:
        """The lost frame before ``next_packet``, from its FEC (or concealment if it has none)."""
        return self._decode(next_packet, fec=True)

    def conceal(self) -> npt.NDArray[np.int16]:
        """Packet loss concealment for one lost frame with nothing to recover it from."""
        return self._decode(None, fec=False)

    def close(self) -> None:
        if self._handle is not None:
            self._lib.opus_decoder_destroy(ctypes.c_void_p(self._handle))
            self._handle = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def packet_has_fec(packet: bytes) -> bool:
    """Whether an Opus packet carries in-band FEC (LBRR) for the frame before it."""
    return _check(_libopus().opus_packet_has_lbrr(packet, len(packet)), "opus_packet_has_lbrr") > 0
