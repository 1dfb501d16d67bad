"""The one Config is built from flags and environment variables."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.config import BreakerSettings, Config, LifecycleSettings, RaySettings
from agent.conversation_config import ListenSettings, ServiceSettings
from signaling.auth import verify_token
from signaling.cli import build_parser, config_from_args, main
from signaling.envflags import env_name, number


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
        with pytest.raises(SystemExit):
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
    for argv in (["serve", "--auth-secret", "short"], ["serve", "--max-sessions", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv, {})
        assert exit_info.value.code == 2


def _number_flags() -> list[str]:
    serve = next(
        sub
        for action in build_parser({})._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
        if name == "serve"
    )
    return [action.option_strings[-1] for action in serve._actions if action.type is number]


def test_every_number_flag_refuses_nan_and_infinity() -> None:
    """float() takes "nan" and "inf", which pass every ``<= 0`` check: --max-turn-s inf
    served, then every offer with a microphone was 400 bad_sdp (a turn of inf seconds in
    windows); --llm-timeout nan made every reply fail at once. A usage error now, from a
    flag or its variable."""
    flags = _number_flags()
    assert {"--max-turn-s", "--llm-timeout", "--stt-timeout", "--idle-timeout"} <= set(flags)
    for flag in flags:
        for value in ("nan", "inf", "-inf"):
            with pytest.raises(SystemExit):
                build(["serve", flag, value])
            with pytest.raises(SystemExit):
                build(["serve"], {"VOICE_AGENT_" + flag[2:].upper().replace("-", "_"): value})


def test_the_settings_refuse_non_finite_numbers() -> None:
    """Through the Python API too (the CLI refuses them first): nan passes every ``<= 0``."""
    settings: list[Callable[[float], object]] = [
        lambda bad: LifecycleSettings(idle_timeout_s=bad),
        lambda bad: BreakerSettings(window_s=bad),
        lambda bad: RaySettings(lead_s=bad),
        lambda bad: RaySettings(gpus_per_replica=bad),
        lambda bad: ListenSettings(max_turn_s=bad),
        lambda bad: ServiceSettings(llm_timeout_s=bad),
        lambda bad: ServiceSettings(stt_timeout_s=bad),
    ]
    for make in settings:
        for bad in (math.nan, math.inf):
            with pytest.raises(ValueError):
                make(bad)


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


def test_one_per_core_counts_the_cores_this_process_may_run_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In a container pinned to 2 CPUs of a 64-core host, --workers 0 counted 2 cores (the
    CPU affinity) but --encode-threads -1 sized its pool by os.cpu_count(): 63 threads on 2
    cores. Every "one per core" counts the affinity now (agent.threads.cores)."""
    import agent.threads
    from signaling.sessions import _encode_executor

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(agent.threads, "CGROUP_ROOT", tmp_path)  # no quota (whatever CI's)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert build(["serve", "--workers", "0"]).workers == 2
    executor = _encode_executor(-1)
    try:
        assert executor is not None and executor._max_workers == 1
    finally:
        if executor is not None:
            executor.shutdown()


@pytest.mark.parametrize(
    ("files", "quota", "workers"),
    [
        ({"cpu.max": "200000 100000\n"}, 2.0, 2),  # cgroup v2: a container given 2 CPUs
        ({"cpu.max": "150000 100000\n"}, 1.5, 1),  # a share of a core is not a process
        ({"cpu.max": "20000 100000\n"}, 0.2, 1),  # at least one
        ({"cpu.max": "max 100000\n"}, None, 64),  # no quota
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0, 3),
        (
            {"cpu,cpuacct/cpu.cfs_quota_us": "400000", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
            4.0,
            4,
        ),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None, 64),
        ({"cpu.max": "garbage\n"}, None, 64),
        ({}, None, 64),  # no cgroup files (macOS, a bare process)
    ],
)
def test_one_per_core_counts_a_container_s_cpu_quota(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    files: dict[str, str],
    quota: float | None,
    workers: int,
) -> None:
    """A container limited to 2 CPUs (docker --cpus 2, a Kubernetes CPU limit) on a 64-core
    host sees all 64 in its affinity: --workers 0 started 64 media processes, which the
    quota then throttled together (every stream stopped for the rest of each 100 ms period
    once the group spent its share). The quota caps "one per core" now, rounded down."""
    import agent.threads

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(agent.threads, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert agent.threads.cgroup_cpu_quota() == quota
    assert build(["serve", "--workers", "0"]).workers == workers
    assert build(["serve", "--workers", "5"]).workers == 5  # asked for: as asked


def test_workers_default_to_the_cores_but_one_process_starts_local_ray(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agent.threads import cores

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert build(["serve"]).workers == cores()
    assert build(["serve", "--workers", "3"]).workers == 3
    assert build(["serve", "--tts", "ray"]).workers == 1
    assert build(["serve", "--tts", "ray://auto", "--workers", "2"]).workers == 2
    with pytest.raises(ValueError, match="ray://auto"):
        build(["serve", "--tts", "ray", "--workers", "2"])


def run_with_output(
    argv: list[str],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> tuple[int, str, str, list[Config]]:
    """``voice-agent ARGV`` with ``env``: (exit status, stdout, stderr, the Config served)."""
    served: list[Config] = []
    monkeypatch.setattr("signaling.cli.serve", served.append)
    monkeypatch.setattr("signaling.cli.configure_logging", lambda config: None)
    try:
        status = main(argv, env)
    except SystemExit as exit_info:
        assert isinstance(exit_info.code, int)
        status = exit_info.code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return status, captured.out, captured.err, served


def run(
    argv: list[str],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> tuple[int, str, list[Config]]:
    """``voice-agent ARGV`` with ``env``: (exit status, stderr, the Config it would serve)."""
    status, _, err, served = run_with_output(argv, env, monkeypatch, capsys)
    return status, err, served


def serve_env_names() -> list[str]:
    """Every VOICE_AGENT_* variable of ``voice-agent serve``."""
    parser = build_parser({})
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    names = [env_name(action) for action in commands.choices["serve"]._actions]
    return ["ICE_SERVERS", *(name for name in names if name not in (None, "HELP", "ICE_SERVER"))]


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("PORT", "abc", "is not a valid int"),
        ("OFFER_RATE", "fast", "is not a valid number"),
        ("VAD_THRESHOLD", "high", "is not a valid number"),
        ("ROOM_MAX_SPEAKERS", "two", "is not a valid int"),
        ("BREAKER_FAILURES", "1.5", "is not a valid int"),
        ("TTS_LEAD", "soon", "is not a valid number"),
        ("RAY_CPUS", "all", "is not a valid int"),
        ("COMPILE", "maybe", "is not one of 1, true"),
    ],
)
def test_a_malformed_variable_is_a_usage_error_naming_it(
    variable: str,
    value: str,
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, err, served = run(["serve"], {"VOICE_AGENT_" + variable: value}, monkeypatch, capsys)
    assert (status, served) == (2, [])
    assert f"error: VOICE_AGENT_{variable}={value!r} {expected}" in err
    assert "usage:" not in err  # no flag was wrong: the message alone


def test_help_is_shown_whatever_the_variables_hold(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad variable used to answer ``serve --help`` with its error instead of the help."""
    env = {"VOICE_AGENT_PORT": "abc", "VOICE_AGENT_COMPLEXITY": "11"}
    for argv in (["serve", "--help"], ["serve", "-h"], ["serve", "--port", "1", "-h"]):
        status, err, served = run(argv, env, monkeypatch, capsys)
        assert (status, err, served) == (0, "", [])
    status, err, _ = run(["serve", "--", "-h"], env, monkeypatch, capsys)
    assert status == 2 and "VOICE_AGENT_PORT='abc' is not a valid int" in err


def test_a_subcommand_reads_only_its_own_variables(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"VOICE_AGENT_OFFER_BURST": "ten", "VOICE_AGENT_PORT": "abc"}  # serve's, not token's
    status, err, _ = run(["token", "--auth-secret", "t" * 32], env, monkeypatch, capsys)
    assert status == 0 and err == ""
    status, err, _ = run(["token"], {**env, "VOICE_AGENT_AUTH_SECRET": " "}, monkeypatch, capsys)
    assert status == 2 and "no secret" in err  # blank is unset


def test_an_empty_or_blank_variable_is_unset(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    names = serve_env_names()
    assert {"PORT", "ROOM_MAX_SPEAKERS", "WORKERS", "OFFER_RATE", "VAD_THRESHOLD"} <= set(names)
    defaults = build(["serve"])
    for blank in ("", "  "):
        env = {"VOICE_AGENT_" + name: blank for name in names}
        assert build(["serve"], env) == defaults
        status, _, served = run(["serve"], env, monkeypatch, capsys)
        assert status == 0 and served == [defaults]
    assert build(["serve"], {"VOICE_AGENT_ROOM_MAX_SPEAKERS": ""}).rooms.max_speakers == 4


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--log-level", "bogus"], {}, "--log-level: invalid choice"),
        ([], {"VOICE_AGENT_LOG_LEVEL": "verbose"}, "VOICE_AGENT_LOG_LEVEL='verbose' is not one of"),
        ([], {"VOICE_AGENT_ENGINE": "bogus"}, "VOICE_AGENT_ENGINE='bogus' is not one of chattts"),
        ([], {"VOICE_AGENT_SEND_PATH": "udp"}, "VOICE_AGENT_SEND_PATH='udp' is not one of"),
        ([], {"VOICE_AGENT_ROOM_INSTRUCT": "all"}, "VOICE_AGENT_ROOM_INSTRUCT='all' is not one"),
        ([], {"VOICE_AGENT_ROOM_SEND": "udp"}, "VOICE_AGENT_ROOM_SEND='udp' is not one of"),
        ([], {"VOICE_AGENT_OPUS_INPUT_RATE": "44100"}, "INPUT_RATE='44100' is not one of auto"),
        ([], {"VOICE_AGENT_COMPLEXITY": "14"}, "VOICE_AGENT_COMPLEXITY='14' is not one of 0-10"),
        (["--port", "70000"], {}, "--port) must be 0-65535"),
        ([], {"VOICE_AGENT_PORT": "-1"}, "--port) must be 0-65535"),
        (["--workers", "-3"], {}, "--workers must be 0 (one per core) or more"),
        ([], {"VOICE_AGENT_WORKERS": "-3"}, "--workers must be 0 (one per core) or more"),
        (["--bitrate", "0"], {}, "(--bitrate) must be 6000-510000"),
        (["--bitrate", "-32000"], {}, "(--bitrate) must be 6000-510000"),
        (["--bitrate", "600000"], {}, "(--bitrate) must be 6000-510000"),
        (["--min-bitrate", "40000"], {}, "(--min-bitrate, 40000) must not be above"),
        (["--bitrate", "10000"], {}, "(--min-bitrate, 12000) must not be above"),
        (["--min-bitrate", "0"], {}, "(--min-bitrate) must be 6000-510000"),
        (["--fec-min-bitrate", "-1"], {}, "(--fec-min-bitrate) must be 6000-510000"),
        (["--encode-threads", "-2"], {}, "(--encode-threads) must be -1"),
        (["--threads", "-1"], {}, "(--threads) must be 0 (automatic) or more"),
        # Refused by torch only when the engine loaded: the server was up, /readyz 503.
        (["--device", "gpu"], {}, "(--device) must be auto, cpu, cuda, cuda:N or mps"),
        (["--device", "CPU"], {}, "(--device) must be auto, cpu, cuda, cuda:N or mps"),
        (["--device", "cuda:"], {}, "(--device) must be auto, cpu, cuda, cuda:N or mps"),
        ([], {"VOICE_AGENT_DEVICE": "gpu"}, "(--device) must be auto, cpu, cuda, cuda:N or mps"),
        # aiortc parses them for every new peer: each offer was 400 bad_sdp.
        (["--ice-server", "stun.l.google.com:19302"], {}, "is not a STUN or TURN URL"),
        (["--ice-server", "stun:a.example?transport=tcp"], {}, "is not a STUN or TURN URL"),
        ([], {"VOICE_AGENT_ICE_SERVERS": "stun:a.example, b.example"}, "'b.example' (--ice"),
        # Ray Serve refused it when the engine deployed: the server was up, /readyz 503.
        (["--tts=ray://auto", "--tts-target-streams", "0"], {}, "(--tts-target-streams) must be"),
        (["--tts=ray://auto", "--tts-target-streams", "-2"], {}, "(--tts-target-streams) must be"),
        (["--tts=ray://auto", "--tts-target-streams", "nan"], {}, "invalid number value: 'nan'"),
        # An empty flag (e.g. --auth-secret "$SECRET" with SECRET unset) turned auth off.
        (["--auth-secret", ""], {}, "(--auth-secret) is empty: leave it out"),
        (["--metrics-token", ""], {}, "(--metrics-token) is empty: leave it out"),
        # No request can present it: a header's value loses its surrounding whitespace.
        (["--metrics-token", "s3cret "], {}, "(--metrics-token) starts or ends with whitespace"),
        # The conversation's named no flag ("service timeouts must be positive": which one?).
        (["--end-of-turn-ms", "10"], {}, "(--end-of-turn-ms) must be 32 ms or more"),
        (["--min-speech-ms", "-5"], {}, "(--min-speech-ms) must be 0 ms or more"),
        (["--vad-threshold", "1.5"], {}, "(--vad-threshold) must be above 0 and below 1"),
        (["--vad-neg-threshold", "0.6"], {}, "(--vad-neg-threshold) must be above 0 and at"),
        (["--vad-threads", "0"], {}, "(--vad-threads) must be 1 or more"),
        (["--max-turn-s", "0"], {}, "(--max-turn-s) must be a positive number"),
        (["--stt-timeout", "0"], {}, "(--stt-timeout) must be a positive number"),
        ([], {"VOICE_AGENT_LLM_TIMEOUT": "0"}, "(--llm-timeout) must be a positive number"),
    ],
)
def test_a_setting_that_would_crash_or_be_changed_is_refused(
    argv: list[str],
    env: dict[str, str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, err, served = run(["serve", *argv], env, monkeypatch, capsys)
    assert (status, served) == (2, [])
    assert expected in err


def test_the_edges_of_those_ranges_are_accepted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent.threads import cores

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert build(["serve", "--log-level", "debug"]).log_level == "DEBUG"
    assert build(["serve"], {"VOICE_AGENT_LOG_LEVEL": "Warning"}).log_level == "WARNING"
    assert build(["serve", "--log-level", "warn"]).log_level == "WARNING"
    assert build(["serve", "--port", "0"]).port == 0  # any free port
    assert build(["serve", "--port", "65535"]).port == 65535
    assert build(["serve", "--workers", "0"]).workers == cores()
    assert build(["serve", "--encode-threads", "-1"]).opus.encode_threads == -1
    low = build(["serve", "--bitrate", "6000", "--min-bitrate", "6000"])
    assert (low.opus.bitrate, low.adaptation.min_bitrate) == (6000, 6000)
    fixed = build(["serve", "--bitrate", "8000", "--no-adaptation"])  # no floor to respect
    assert fixed.opus.bitrate == 8000
    assert build(["serve", "--bitrate", "510000"]).opus.bitrate == 510_000
    for device in ("auto", "cpu", "cuda", "cuda:1", "mps"):
        assert build(["serve", "--device", device]).chattts.device == device
    ray = build(["serve", "--tts", "ray://auto", "--tts-target-streams", "0.5"]).ray
    assert ray.target_streams == 0.5
    ice = ["stun:a.example", "stun:b.example:19302", "turns:c.example:443?transport=tcp"]
    credentials = ["--ice-username", "u", "--ice-credential", "c"]
    flags = [*(f"--ice-server={url}" for url in ice), *credentials]
    assert build(["serve", *flags]).ice_servers == tuple(ice)
    # The Config refuses them itself, whoever builds it.
    for bad in ({"port": 70000}, {"log_level": "verbose"}, {"workers": 0}):
        with pytest.raises(ValueError):
            Config(**bad)  # type: ignore[arg-type]


def test_a_variable_loses_its_surrounding_whitespace(capsys: pytest.CaptureFixture[str]) -> None:
    """An env file's trailing space, the newline of a secret read from a file:
    ``VOICE_AGENT_DEVICE='cpu '`` failed when the engine loaded, and a metrics token
    ``s3cret\\n`` could never be presented (tests/test_metrics.py). Secrets are stripped
    alike for the server and ``voice-agent token``, so its tokens still verify."""
    env = {
        "VOICE_AGENT_DEVICE": "cpu ",
        "VOICE_AGENT_PORT": " 9000\n",
        "VOICE_AGENT_SEND_PATH": "aiortc\n",
        "VOICE_AGENT_METRICS_TOKEN": "s3cret\n",
        "VOICE_AGENT_AUTH_SECRET": "a" * 32 + "\n",
    }
    config = build(["serve"], env)
    assert (config.chattts.device, config.port, config.opus.direct_send) == ("cpu", 9000, False)
    assert config.security.metrics_token == "s3cret"
    assert config.security.auth_secret == "a" * 32
    assert main(["token"], env) == 0
    verify_token(capsys.readouterr().out.strip(), config.security.auth_secret)


def test_an_empty_secret_flag_is_refused_an_empty_variable_is_unset(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``serve --auth-secret ""`` (``--auth-secret "$SECRET"`` with SECRET unset) ran
    without authentication, where ``token --auth-secret ""`` was an error: failing open.
    An empty VOICE_AGENT_AUTH_SECRET is unset, as every empty variable is."""
    status, err, served = run(["serve", "--auth-secret", ""], {}, monkeypatch, capsys)
    assert (status, served) == (2, []) and "voice-agent: error:" in err
    status, err, _ = run(["token", "--auth-secret", ""], {}, monkeypatch, capsys)
    assert status == 2 and "no secret" in err
    status, _, served = run(["serve"], {"VOICE_AGENT_AUTH_SECRET": ""}, monkeypatch, capsys)
    assert status == 0 and served[0].security.auth_secret is None


@pytest.mark.parametrize("inside", ["a-file", "a-file/model"])
def test_tiny_model_where_no_directory_can_be_is_a_usage_error(
    inside: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tiny-model DIR`` with DIR a file (or under one, or not writable) ended in a
    traceback after seconds of imports; it is a usage error at once now."""
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        main(["tiny-model", str(tmp_path / inside)], {})
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert f"voice-agent: error: cannot write the model into {tmp_path / inside}: " in err
    assert "Not a directory" in err


def test_an_error_while_configuring_logging_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(config: Config) -> None:
        raise ValueError("Unknown level: 'LOUD'")

    monkeypatch.setattr("signaling.cli.serve", lambda config: None)
    monkeypatch.setattr("signaling.cli.configure_logging", refuse)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve"], {})
    assert exit_info.value.code == 2 and "Unknown level" in capsys.readouterr().err


def test_a_tmpdir_too_deep_for_the_workers_sockets_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``serve --workers N`` under a $TMPDIR too deep for Unix socket paths said what to do
    ("set TMPDIR to a shorter directory") in a ValueError traceback, after the weights'
    download; it is a usage error, before anything is loaded, now."""
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.setattr("signaling.cli.configure_logging", lambda config: None)
    monkeypatch.setattr(
        "agent.chattts.loader.ensure_downloaded", lambda settings: pytest.fail("downloading")
    )
    monkeypatch.setattr(
        "signaling.front.run_front", lambda config, pool, prepare=None: pytest.fail("served")
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--workers", "2"], {})
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "voice-agent: error: socket paths under" in err and "set TMPDIR" in err


def test_an_empty_model_dir_is_a_usage_error_not_the_working_directory() -> None:
    """``--model-dir "$MODEL_DIR"`` with MODEL_DIR unset was Path(""): the working
    directory, taken for a Hugging Face cache and downloaded into."""
    for value in ("", "  "):
        with pytest.raises(SystemExit):
            build(["serve", "--model-dir", value])
    assert build(["serve", "--model-dir", "m"]).chattts.model_dir == Path("m")


@pytest.mark.parametrize(("tts", "downloads"), [("local", 1), ("ray", 0)])
def test_the_front_downloads_the_model_only_where_its_workers_load_it(
    tts: str, downloads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve --workers N --tts ray://...``: the model is on the cluster's replicas, yet the
    media machine's front fetched the 1.1 GB model nobody there loads."""
    import agent.chattts.loader as loader
    import signaling.front
    import signaling.workers
    from agent.config import RaySettings
    from signaling.cli import serve

    calls: list[object] = []
    monkeypatch.setattr(loader, "ensure_downloaded", calls.append)
    monkeypatch.setattr(signaling.workers, "WorkerPool", lambda *args: object())
    monkeypatch.setattr(
        signaling.front, "run_front", lambda config, pool, prepare=None: prepare and prepare()
    )
    ray = RaySettings(address="ray://auto") if tts == "ray" else RaySettings()
    serve(Config(tts=tts, ray=ray, workers=2))
    assert len(calls) == downloads


MAKE_ROOT = Path(__file__).resolve().parent.parent


def _make_n(target: str, env: dict[str, str], cwd: Path = MAKE_ROOT) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make")
    full = {k: v for k, v in os.environ.items() if not k.startswith("VOICE_AGENT_")}
    full.pop("HOST", None)
    full.pop("PORT", None)
    full.update(env)
    done = subprocess.run(
        ["make", "-n", target], cwd=cwd, env=full, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_run_honours_the_documented_voice_agent_host_and_port_variables() -> None:
    """README: every flag of `voice-agent serve` can be set as VOICE_AGENT_<FLAG>; `make run`
    is the README's way to start. The Makefile passes `--host 0.0.0.0 --port 8080` itself,
    which beat the variables: VOICE_AGENT_HOST=127.0.0.1 make run listened on every
    interface, VOICE_AGENT_PORT=9000 on 8080 (found by review)."""
    env = {"VOICE_AGENT_HOST": "127.0.0.1", "VOICE_AGENT_PORT": "9000"}
    out = _make_n("run", env)
    line = next(ln for ln in out.splitlines() if "voice-agent serve" in ln)
    argv = shlex.split(line)
    argv = argv[argv.index("serve") :]
    config = config_from_args(build_parser(env).parse_args(argv), env)
    assert (config.host, config.port) == ("127.0.0.1", 9000), line


def test_make_run_repairs_a_venv_whose_python_is_gone(tmp_path: Path) -> None:
    """A .venv whose interpreter is gone (the checkout moved, the Python it was made with
    removed) but whose stamp is there: `make run` should rebuild it, not run a
    .venv/bin/voice-agent that cannot start (found by review)."""
    shutil.copy(MAKE_ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(MAKE_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    stamp = tmp_path / ".venv" / ".installed"
    stamp.touch()
    os.utime(stamp, (os.path.getmtime(tmp_path / "pyproject.toml") + 10,) * 2)
    out = _make_n("run", {}, cwd=tmp_path)
    assert "-m venv" in out, out


def _demo_wheel(where: Path) -> Path:
    """A wheel whose only content is a ``voice-agent`` console script (installed offline)."""
    wheel = where / "demo-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo/__init__.py", "def main():\n    print('hi')\n")
        z.writestr(
            "demo-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 0.1\n"
        )
        z.writestr(
            "demo-0.1.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(
            "demo-0.1.dist-info/entry_points.txt", "[console_scripts]\nvoice-agent = demo:main\n"
        )
        z.writestr("demo-0.1.dist-info/RECORD", "")
    return wheel


def test_make_keeps_a_working_venv_in_a_checkout_whose_path_has_a_space(tmp_path: Path) -> None:
    """Bug: in a checkout whose path holds a space (or is over 127 bytes long), pip writes
    every script with a ``#!/bin/sh`` shebang and an ``exec`` line; the Makefile took
    ``/bin/sh`` for the venv's Python, found it could not run ``print("yes")`` and deleted
    the working .venv at every make invocation (even ``make -n``): every `make run`
    reinstalled torch and the rest (found by review)."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    checkout = tmp_path / "my projects" / "rtc-voice-agent"
    checkout.mkdir(parents=True)
    shutil.copy(MAKE_ROOT / "Makefile", checkout / "Makefile")
    shutil.copy(MAKE_ROOT / "pyproject.toml", checkout / "pyproject.toml")
    subprocess.run([sys.executable, "-m", "venv", str(checkout / ".venv")], check=True)
    venv_python = checkout / ".venv" / "bin" / "python"
    subprocess.run(
        [str(venv_python), "-m", "pip", "install", "-q", "--no-index", str(_demo_wheel(tmp_path))],
        check=True,
    )
    script = checkout / ".venv" / "bin" / "voice-agent"
    # The script pip wrote starts, as `make run` would start it.
    assert subprocess.run([str(script)], capture_output=True, text=True).stdout == "hi\n"
    stamp = checkout / ".venv" / ".installed"
    stamp.touch()
    os.utime(stamp, (os.path.getmtime(checkout / "pyproject.toml") + 10,) * 2)
    env = {k: v for k, v in os.environ.items() if k not in ("HOST", "PORT")}
    done = subprocess.run(
        ["make", "-n", "install"], cwd=checkout, env=env, capture_output=True, text=True, timeout=60
    )
    assert script.exists(), "make deleted a .venv whose scripts start"
    assert "-m venv" not in done.stdout, done.stdout


def test_a_negative_ray_cpus_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every other negative count is refused at start naming its flag; --ray-cpus -1 went
    to ray.init(num_cpus=-1), which refuses it ("Resource quantities must be nonnegative")
    only once the server is up: /readyz engine_failed, naming no flag (found by review)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    served: list[Config] = []
    monkeypatch.setattr("signaling.cli.serve", served.append)
    monkeypatch.setattr("signaling.cli.configure_logging", lambda config: None)
    argv = ["serve", "--tts", "ray", "--workers", "1", "--ray-cpus", "-1"]
    try:
        status = main(argv, {})
    except SystemExit as exc:
        status = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert (status, served) == (2, []), f"accepted: local_cpus={served[0].ray.local_cpus}"
    assert "--ray-cpus" in err


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_already_in_use_is_a_plain_error_not_a_traceback(
    workers: str, tmp_path: Path
) -> None:
    """A second `make run` (or anything on 8080) ended in an OSError traceback; with
    --workers above 1 (the default on a multi-core machine) only after the model's download
    and the workers' start (found by review)."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    model = tmp_path / "model-file"
    model.write_text("not a model")  # the engine fails fast, no download
    try:
        done = subprocess.run(
            [
                *(sys.executable, "-m", "signaling", "serve", "--host", "127.0.0.1"),
                *("--port", str(port), "--workers", workers, "--no-listen"),
                *("--model-dir", str(model)),
            ],
            cwd=MAKE_ROOT,
            env={**os.environ, "PYTHONPATH": str(MAKE_ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        busy.close()
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-600:]
    assert str(port) in done.stderr


def test_a_misspelt_voice_agent_variable_is_named_at_start_with_what_was_meant() -> None:
    """``VOICE_AGENT_MAX_SESION=5`` was ignored without a word: the server ran with the
    default the operator meant to change. ``VOICE_AGENT_ICE_SERVER`` (the flag's name, but
    the variable is ICE_SERVERS) likewise; the variables serve does read are not named."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(MAKE_ROOT),
        "VOICE_AGENT_MAX_SESION": "5",
        "VOICE_AGENT_ICE_SERVER": "stun:a.example:3478",
        "VOICE_AGENT_ICE_SERVERS": "stun:b.example:3478",
        "VOICE_AGENT_BITRATE": "24000",
        "VOICE_AGENT_REQUIRE_BROWSER": "1",
    }
    try:
        # The port is taken: serve stops right after its start-up checks.
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "signaling",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=MAKE_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        busy.close()
    assert done.returncode == 2, done.stderr[-600:]
    assert (
        "VOICE_AGENT_MAX_SESION is not a setting of voice-agent serve; it is ignored "
        "(did you mean VOICE_AGENT_MAX_SESSIONS?)"
    ) in done.stderr
    assert "VOICE_AGENT_ICE_SERVER is not a setting" in done.stderr
    assert "did you mean VOICE_AGENT_ICE_SERVERS?" in done.stderr
    for read in ("VOICE_AGENT_ICE_SERVERS is", "VOICE_AGENT_BITRATE", "VOICE_AGENT_REQUIRE"):
        assert read not in done.stderr


_SERVE_WHILE_DOWNLOADING = """
import sys, time
import agent.chattts.loader as loader
import signaling.workers as workers

def downloading(settings):  # the first start's 1.1 GB fetch from Hugging Face
    time.sleep(60)

async def no_workers(self):  # the workers are not what this test is about
    print("workers started", flush=True)

loader.ensure_downloaded = downloading
workers.WorkerPool.start = no_workers
from signaling.cli import main
main(["serve", "--workers", "2", "--host", "127.0.0.1", "--port", sys.argv[1]])
"""


def test_the_front_serves_while_the_model_downloads_and_stops_at_once() -> None:
    """Bug: with --workers N (the default on a machine with several cores) serve() fetched the
    model before the front bound its port: for the whole first download (~1.1 GB) the page,
    /healthz and /readyz were refused, where one process serves them (/readyz 503 not_ready)
    while it loads; a liveness probe would kill it mid-download (found by review). The
    workers start after the download; a stop signal during it exits without waiting."""
    import signal
    import urllib.error
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOICE_AGENT_")}
    env["PYTHONPATH"] = str(MAKE_ROOT)
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVE_WHILE_DOWNLOADING, str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    statuses: dict[str, object] = {}
    try:
        deadline = time.monotonic() + 30  # the front's imports; the download takes 60 s
        while time.monotonic() < deadline and "/healthz" not in statuses:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    statuses["/healthz"] = r.status
            except OSError:
                time.sleep(0.2)
        for path in ("/", "/readyz"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                    statuses[path] = r.status
            except urllib.error.HTTPError as exc:
                statuses[path] = exc.code
        assert server.poll() is None, "the server exited"
        server.send_signal(signal.SIGTERM)
        started = time.monotonic()
        out, _ = server.communicate(timeout=15)
        took = time.monotonic() - started
    finally:
        server.kill()
        server.wait(10)
    assert statuses == {"/healthz": 200, "/": 200, "/readyz": 503}, statuses
    assert "workers started" not in out  # not before the download ended
    assert server.returncode == 0 and took < 10, (server.returncode, took)
