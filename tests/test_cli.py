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
    defaults = build(["serve"])
    assert defaults.opus.complexity == 9 and defaults.opus.direct_send
    assert build(["serve"], {"VOICE_AGENT_COMPLEXITY": "5"}).opus.complexity == 5
    lean = build(["serve", "--complexity", "3", "--send-path", "aiortc"])
    assert lean.opus.complexity == 3 and not lean.opus.direct_send
    assert not build(["serve"], {"VOICE_AGENT_SEND_PATH": "aiortc"}).opus.direct_send
    assert build(["serve"], {"VOICE_AGENT_COMPLEXITY": ""}).opus.complexity == 9  # unset
    # The CPU governor's floor: 0 by default, a fixed complexity when equal to it.
    assert defaults.opus.complexity_floor == 0
    assert build(["serve", "--complexity-floor", "9"]).opus.complexity_floor == 9
    assert build(["serve"], {"VOICE_AGENT_COMPLEXITY_FLOOR": "6"}).opus.complexity_floor == 6
    with pytest.raises(ValueError, match="floor"):
        build(["serve", "--complexity", "5", "--complexity-floor", "6"])
    # Under load the band is capped at wide-band before complexity goes below 6, unless told.
    assert defaults.opus.band_cap_under_load
    assert not build(["serve", "--full-band-under-load"]).opus.band_cap_under_load
    full = build(["serve"], {"VOICE_AGENT_FULL_BAND_UNDER_LOAD": "1"})
    assert not full.opus.band_cap_under_load
    # The encoder's input rate: the engine's own by default (None), or one libopus takes.
    assert defaults.opus.input_rate is None
    assert build(["serve", "--opus-input-rate", "48000"]).opus.input_rate == 48_000
    assert build(["serve"], {"VOICE_AGENT_OPUS_INPUT_RATE": "16000"}).opus.input_rate == 16_000
    assert build(["serve"], {"VOICE_AGENT_OPUS_INPUT_RATE": "auto"}).opus.input_rate is None
    with pytest.raises(SystemExit):
        build(["serve", "--opus-input-rate", "22050"])
    # argparse checks choices on the command line only: values from the env are checked too.
    for bad in (
        {"VOICE_AGENT_OPUS_INPUT_RATE": "44100"},
        {"VOICE_AGENT_COMPLEXITY": "14"},
        {"VOICE_AGENT_COMPLEXITY_FLOOR": "11"},
        {"VOICE_AGENT_SEND_PATH": "Direct"},
        {"VOICE_AGENT_ROOM_SEND": "udp"},
    ):
        with pytest.raises(ValueError):
            build(["serve"], bad)
    flagged = build(["serve", "--port", "9100", "--ice-server", "stun:c.example"], env)
    assert flagged.port == 9100 and flagged.ice_servers == ("stun:c.example",)


def test_bad_flags_exit_with_usage() -> None:
    with pytest.raises(SystemExit):
        build(["serve", "--port", "eighty"])
    with pytest.raises(SystemExit):
        build(["serve", "--engine", "nope"])


def test_security_limit_and_log_settings() -> None:
    config = build(["serve"])
    assert config.security.auth_secret is None and config.security.cors_origins == ()
    assert config.limits.max_sessions == 200 and not config.log_json
    env = {
        "VOICE_AGENT_AUTH_SECRET": "e" * 32,
        "VOICE_AGENT_CORS_ORIGINS": "https://a.example, https://b.example",
        "VOICE_AGENT_METRICS_TOKEN": "mt",
        "VOICE_AGENT_OFFER_RATE": "0.25",
        "VOICE_AGENT_OFFER_BURST": "4",
        "VOICE_AGENT_SPEECH_RATE": "3",
        "VOICE_AGENT_SPEECH_BURST": "9",
        "VOICE_AGENT_RATE_LIMIT_CLIENTS": "100",
        "VOICE_AGENT_MAX_SESSIONS": "12",
        "VOICE_AGENT_LOG_JSON": "1",
    }
    config = build(["serve"], env)
    assert config.security.auth_secret == "e" * 32 and config.security.metrics_token == "mt"
    assert config.security.cors_origins == ("https://a.example", "https://b.example")
    limits = config.limits
    assert (limits.offer_rate, limits.offer_burst, limits.speech_rate, limits.speech_burst) == (
        0.25,
        4,
        3.0,
        9,
    )
    assert (limits.max_clients, limits.max_sessions, config.log_json) == (100, 12, True)
    flagged = build(["serve", "--max-sessions", "3", "--auth-secret", "f" * 40], env)
    assert flagged.limits.max_sessions == 3 and flagged.security.auth_secret == "f" * 40


def test_settings_the_config_refuses_exit_with_usage() -> None:
    from signaling.cli import main

    for argv in (["serve", "--auth-secret", "short"], ["serve", "--max-sessions", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv, {})
        assert exit_info.value.code == 2


def test_lifecycle_and_breaker_settings() -> None:
    env = {"VOICE_AGENT_RTCP_TIMEOUT": "5", "VOICE_AGENT_BREAKER_COOLDOWN": "3"}
    config = build(
        ["serve", "--connect-timeout", "7", "--resume-grace", "0", "--breaker-failures", "2"], env
    )
    life = config.lifecycle
    assert (life.connect_timeout_s, life.rtcp_timeout_s, life.resume_grace_s) == (7, 5, 0)
    assert (config.breaker.failures, config.breaker.cooldown_s) == (2, 3)
    defaults = build(["serve"])
    assert defaults.lifecycle.idle_timeout_s == 600 and defaults.lifecycle.drain_deadline_s == 20
    with pytest.raises(ValueError, match="negative"):
        build(["serve", "--idle-timeout", "-1"])
    with pytest.raises(ValueError, match="at least 1"):
        build(["serve", "--breaker-failures", "0"])


def test_workers_default_to_the_cores_but_one_process_starts_local_ray(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from signaling.workers import cores

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert build(["serve"]).workers == cores()
    assert build(["serve", "--workers", "3"]).workers == 3
    assert build(["serve", "--tts", "ray"]).workers == 1
    assert build(["serve", "--tts", "ray://auto", "--workers", "2"]).workers == 2
    with pytest.raises(ValueError, match="ray://auto"):
        build(["serve", "--tts", "ray", "--workers", "2"])
