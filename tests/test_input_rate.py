"""Sessions and rooms encode at the speech path's rate: the engine's own when libopus takes
it (ChatTTS's 24 kHz as generated), or the configured ``OpusSettings.input_rate``."""

from __future__ import annotations

import pytest

from agent.config import Config, OpusSettings
from agent.room import Room
from agent.session import AgentSession
from tests.doubles import ToneEngine


@pytest.mark.parametrize(
    ("engine_rate", "configured", "expected"),
    [
        (24_000, None, 24_000),
        (22_050, None, 24_000),
        (24_000, 48_000, 48_000),
        (24_000, 16_000, 16_000),
    ],
)
async def test_sessions_and_rooms_encode_at_the_speech_paths_rate(
    engine_rate: int, configured: int | None, expected: int
) -> None:
    config = Config(opus=OpusSettings(input_rate=configured))
    session = AgentSession("s", ToneEngine(sample_rate=engine_rate), config)
    room = Room("r", ToneEngine(sample_rate=engine_rate), config)
    try:
        assert session.pipeline.rate == session.track.encoder.sample_rate == expected
        session.renew_track()  # a resumed connection's new track
        assert session.track.encoder.sample_rate == expected
        assert room.pipeline.rate == room.agent_track.encoder.sample_rate == expected
    finally:
        await session.close()
        await room.close()


@pytest.mark.parametrize("rate", [0, 22_050, 44_100, 96_000])
def test_the_configured_rate_must_be_one_libopus_encodes_from(rate: int) -> None:
    with pytest.raises(ValueError, match="input rate"):
        OpusSettings(input_rate=rate)
