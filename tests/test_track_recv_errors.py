"""aiortc's path (``--send-path aiortc``, the fallback, and every room's agent track, which
a task pumps with ``recv``) must survive a failed encode as the lean path does: aiortc's RTP
sender task (and a room's pump) ends for good on any exception but MediaStreamError, and
the popped frame's marks (speech.started/segment/ended) would be lost with it."""

from __future__ import annotations

import numpy as np

from agent.opus import FRAME_SAMPLES
from agent.playout import PlayoutBuffer
from agent.track import OpusPacketTrack
from tests.test_track import tone_frame


async def test_a_failing_encode_on_aiortc_path_loses_one_packet_and_the_clock_goes_on() -> None:
    buffer = PlayoutBuffer(100)
    track = OpusPacketTrack(buffer, rephase_on_onset=False)
    marked: list[int] = []
    for i in range(10):
        await buffer.put(tone_frame(i), (lambda i=i: marked.append(i),))
    real_encode = track.encoder.encode
    calls = [0]

    def flaky(pcm: np.ndarray) -> bytes:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("encoder hiccup")
        return real_encode(pcm)

    track.encoder.encode = flaky  # type: ignore[method-assign]
    pts = [(await track.recv()).pts for _ in range(5)]  # the third recv must not raise
    assert pts == [0, FRAME_SAMPLES, 3 * FRAME_SAMPLES, 4 * FRAME_SAMPLES, 5 * FRAME_SAMPLES]
    assert marked == [0, 1, 2, 3, 4, 5]  # the lost packet's frame still fired its events
    assert track.stats.direct_errors == 1
    assert track.readyState == "live"
    track.stop()
