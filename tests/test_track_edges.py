"""Track behaviour the other tests left unguarded (found by mutation testing): onset
lead bounds and payback, the speech tail after the last frame, a failing mark."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError

from agent.config import OpusSettings
from agent.opus import FRAME_SAMPLES, OpusDecoder
from agent.playout import PlayoutBuffer
from agent.track import SILENCE_SETTLE_FRAMES, OpusPacketTrack
from tests.test_track import tone_frame, unpaced


async def _onset_during_the_wait(track: OpusPacketTrack, buffer: PlayoutBuffer) -> None:
    """Speech arrives ~2 ms into the track's wait for its next tick; returns once sent."""

    async def arrive() -> None:
        await asyncio.sleep(0.002)
        await buffer.put(tone_frame())

    task = asyncio.ensure_future(arrive())
    packet = await track.recv()
    await task
    # On a loaded machine the 2 ms sleep can outlast the tick: the frame then goes out with
    # the next packet, on the old phase (the callers check that some onset re-phased).
    for _ in range(3):
        if len(bytes(packet)) > 40:  # the speech frame, not silence
            return
        packet = await track.recv()
    raise AssertionError("the speech frame was never sent")


async def test_onset_lead_stays_bounded_when_speech_arrives_during_each_wait() -> None:
    """Each onset re-phased early moves the clock ~18 ms ahead; the lead must stop at
    ``max_lead_s`` (the existing test put its frames before the wait began, so it never
    re-phased at all)."""
    buffer = PlayoutBuffer(100)
    track = OpusPacketTrack(buffer, max_lead_s=0.03)
    await track.recv()
    for _ in range(6):
        await track.recv()  # one silent frame: speaking stops, onset may re-phase again
        await _onset_during_the_wait(track, buffer)
    assert track.stats.early_rephases >= 1
    assert track._lead <= 0.03 + 1e-9, track._lead
    track.stop()


async def test_onset_lead_is_paid_back_exactly_never_past_the_original_schedule() -> None:
    buffer = PlayoutBuffer(100)
    track = OpusPacketTrack(buffer, payback_per_frame_s=0.005)
    await track.recv()
    for _ in range(5):  # a loaded machine may miss the wait once: try another onset
        await track.recv()  # a silent frame: the next speech is an onset
        await _onset_during_the_wait(track, buffer)
        if track._lead > 0.005:
            break
    lead = track._lead
    start = track._start
    assert start is not None and 0.005 < lead <= 0.1  # re-phased, by most of a frame
    for _ in range(8):  # 40 ms of payback capacity: more than the lead
        await track.recv()
    assert track._lead == 0.0
    assert track._start is not None and abs(track._start - start - lead) < 1e-9
    first, second = (await track.recv()).pts, (await track.recv()).pts
    assert first is not None and second == first + FRAME_SAMPLES
    track.stop()


async def test_the_speech_tail_goes_out_in_the_first_silence_packet() -> None:
    """libopus holds back 6.5 ms of lookahead: the encoder must not be reset until the
    silence frames after speech have carried that tail (else every utterance is clipped)."""
    buffer = PlayoutBuffer(100)
    track = OpusPacketTrack(buffer, rephase_on_onset=False)
    for i in range(10):
        await buffer.put(tone_frame(i))
    packets = [bytes(await track.recv()) for _ in range(10 + SILENCE_SETTLE_FRAMES + 2)]
    track.stop()
    decoder = OpusDecoder()
    try:
        rms = [float(np.sqrt(np.mean(decoder.decode(p).astype(np.float64) ** 2))) for p in packets]
    finally:
        decoder.close()
    speech = float(np.median(rms[2:9]))
    # The first silence packet decodes to the tone's last ~6.5 ms: about sqrt(6.5/20) of a
    # full frame's level (measured 0.55); a reset encoder leaves ~0.2.
    assert rms[10] > 0.4 * speech, (rms[10], speech)
    assert max(rms[-2:]) < 0.01 * speech  # and then it is silent


async def test_a_failing_mark_does_not_stop_the_track() -> None:
    """A mark (an event sink) that raises must not end aiortc's sender: the packet goes
    out, the frame's other marks fire, and the next packets follow."""
    buffer = PlayoutBuffer(10)
    track = OpusPacketTrack(buffer, rephase_on_onset=False)
    fired: list[str] = []

    def broken() -> None:
        raise RuntimeError("event sink failed")

    await buffer.put(tone_frame(0), (broken, lambda: fired.append("after")))
    await buffer.put(tone_frame(1), (lambda: fired.append("next"),))
    pts = [(await track.recv()).pts for _ in range(3)]
    track.stop()
    assert fired == ["after", "next"]
    assert pts == [0, FRAME_SAMPLES, 2 * FRAME_SAMPLES]


async def test_replayed_silence_is_what_the_encoder_would_have_made() -> None:
    """Idle silence is encoded until libopus's output repeats, then the cycle is replayed
    (no encoding). At complexity 5 the cycle is several packets long: replaying a cycle cut
    short would send packets libopus never made. The same packets as encoding every frame."""
    settings = OpusSettings(complexity=5, complexity_floor=5)
    cached = unpaced(OpusPacketTrack(PlayoutBuffer(10), settings))
    encoded = unpaced(OpusPacketTrack(PlayoutBuffer(10), settings))
    replay, reference = [], []
    for _ in range(60):
        replay.append(bytes(await cached.recv()))
        encoded._settings_changed()  # forgets the cycle: every frame is encoded
        reference.append(bytes(await encoded.recv()))
    assert cached.stats.encode_calls < 30 and encoded.stats.encode_calls == 60
    assert len(set(reference[-20:])) > 1  # a cycle longer than one packet
    assert replay == reference
    cached.stop()
    encoded.stop()


async def test_stop_ends_a_waiting_recv_at_once() -> None:
    """A recv waiting for its tick ends as soon as the track stops, not at the tick."""
    track = OpusPacketTrack(PlayoutBuffer(10))
    await track.recv()
    await track.recv()
    pending = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0)  # waiting now, its tick up to 20 ms away
    track.stop()
    for _ in range(5):  # a few turns of the loop (microseconds), not the tick's wait
        await asyncio.sleep(0)
    assert pending.done()
    with pytest.raises(MediaStreamError):
        await pending
