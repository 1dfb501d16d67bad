"""The one Config is built from flags and environment variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from signaling.cli import build_parser, config_from_args


def build(argv: list[str], env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    env = env or {}
    return config_from_args(build_parser(env).parse_args(argv), env)


def test_defaults() -> None:
    config = build(["serve"])
    assert (config.host, config.port, config.ice_servers, config.engine) == (
        "0.0.0.0",
        8080,
        (),
        "chattts",
    )
    assert config.chattts.model_dir is None and config.chattts.device == "auto"
    assert config.opus.bitrate == 32_000
    assert config.adaptation.enabled and config.adaptation.min_bitrate == 12_000


def test_environment_then_flags() -> None:
    env = {
        "VOICE_AGENT_PORT": "9000",
        "VOICE_AGENT_ICE_SERVERS": "stun:a.example:3478, turn:b.example:3478",
        "VOICE_AGENT_ICE_USERNAME": "u",
        "VOICE_AGENT_ICE_CREDENTIAL": "p",
        "VOICE_AGENT_MODEL_DIR": "/models/chattts",
        "VOICE_AGENT_DEVICE": "cpu",
        "VOICE_AGENT_COMPILE": "true",
        "VOICE_AGENT_BITRATE": "24000",
        "VOICE_AGENT_ENCODE_THREADS": "2",
        "VOICE_AGENT_NO_ADAPTATION": "1",
        "VOICE_AGENT_MIN_BITRATE": "10000",
    }
    config = build(["serve"], env)
    assert config.port == 9000
    assert config.ice_servers == ("stun:a.example:3478", "turn:b.example:3478")
    assert (config.ice_username, config.ice_credential) == ("u", "p")
    assert config.chattts.model_dir == Path("/models/chattts")
    assert config.chattts.device == "cpu" and config.chattts.compile
    assert config.opus.bitrate == 24_000 and config.opus.encode_threads == 2
    assert not config.adaptation.enabled and config.adaptation.min_bitrate == 10_000
    assert build(["serve", "--fec-min-bitrate", "24000"]).adaptation.fec_min_bitrate == 24_000
    flagged = build(["serve", "--port", "9100", "--ice-server", "stun:c.example"], env)
    assert flagged.port == 9100 and flagged.ice_servers == ("stun:c.example",)


def test_bad_flags_exit_with_usage() -> None:
    with pytest.raises(SystemExit):
        build(["serve", "--port", "eighty"])
    with pytest.raises(SystemExit):
        build(["serve", "--engine", "nope"])
