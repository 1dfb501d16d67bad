"""Configuration promises (README "Configuration") pinned by mutation testing.

Each test here failed with a small change to signaling/cli.py, signaling/envflags.py,
signaling/conversation_flags.py, agent/config.py or agent/conversation_config.py that the
rest of the suite let through: a flag ignored, the environment winning over a flag, an
on/off variable read the wrong way, a default changed, a documented edge refused or an
out-of-range value accepted.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jwt
import pytest

from agent.config import Config
from signaling.cli import build_parser, main
from signaling.envflags import env_name, unknown_variables
from tests.test_cli import build
from tests.test_cli import run_with_output as run


def _serve_parser(env: dict[str, str] | None = None) -> argparse.ArgumentParser:
    parser = build_parser(env or {})
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices["serve"]  # type: ignore[no-any-return]


def _serve_flags() -> dict[str, argparse.Action]:
    """Every ``--flag`` of serve that reads its own VOICE_AGENT_* variable."""
    return {
        action.option_strings[-1]: action
        for action in _serve_parser()._actions
        if env_name(action) is not None
        and not isinstance(action, argparse._HelpAction | argparse._AppendAction)
    }


RAY = ["--tts", "ray://auto"]  # the Ray settings reach the Config with a Ray plane only

Get = Callable[[Config], Any]

# flag: (variable's value, what it makes of it, flag's value, what it makes of it, getter,
# flags the row needs). The variable's differs from the default, the flag's from the variable's.
VALUED: dict[str, tuple[str, Any, str, Any, Get, list[str]]] = {
    "--host": ("127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3", lambda c: c.host, []),
    "--port": ("9001", 9001, "9002", 9002, lambda c: c.port, []),
    "--ice-username": ("u1", "u1", "u2", "u2", lambda c: c.ice_username, []),
    "--ice-credential": ("c1", "c1", "c2", "c2", lambda c: c.ice_credential, []),
    "--model-dir": ("/m1", Path("/m1"), "/m2", Path("/m2"), lambda c: c.chattts.model_dir, []),
    "--device": ("cpu", "cpu", "cuda:1", "cuda:1", lambda c: c.chattts.device, []),
    "--threads": ("3", 3, "4", 4, lambda c: c.chattts.threads, []),
    "--bitrate": ("40000", 40_000, "48000", 48_000, lambda c: c.opus.bitrate, []),
    "--complexity": ("5", 5, "7", 7, lambda c: c.opus.complexity, []),
    "--complexity-floor": ("2", 2, "3", 3, lambda c: c.opus.complexity_floor, []),
    "--opus-input-rate": ("16000", 16_000, "48000", 48_000, lambda c: c.opus.input_rate, []),
    "--min-bitrate": ("14000", 14_000, "16000", 16_000, lambda c: c.adaptation.min_bitrate, []),
    "--fec-min-bitrate": (
        "22000",
        22_000,
        "24000",
        24_000,
        lambda c: c.adaptation.fec_min_bitrate,
        [],
    ),
    "--encode-threads": ("1", 1, "2", 2, lambda c: c.opus.encode_threads, []),
    "--send-path": ("aiortc", False, "direct", True, lambda c: c.opus.direct_send, []),
    "--workers": ("5", 5, "6", 6, lambda c: c.workers, []),
    "--tts": (
        "ray://h1:1",
        ("ray", "ray://h1:1"),
        "ray://h2:2",
        ("ray", "ray://h2:2"),
        lambda c: (c.tts, c.ray.address),
        [],
    ),
    "--tts-replicas": ("2", 2, "3", 3, lambda c: c.ray.replicas, RAY),
    "--tts-max-replicas": ("4", 4, "5", 5, lambda c: c.ray.max_replicas, RAY),
    "--tts-target-streams": ("2", 2.0, "3", 3.0, lambda c: c.ray.target_streams, RAY),
    "--tts-max-streams": ("16", 16, "24", 24, lambda c: c.ray.max_streams, RAY),
    "--tts-gpus-per-replica": ("0.5", 0.5, "0.25", 0.25, lambda c: c.ray.gpus_per_replica, RAY),
    "--tts-cpus-per-replica": ("2", 2.0, "3", 3.0, lambda c: c.ray.cpus_per_replica, RAY),
    "--tts-lead": ("1.5", 1.5, "2.5", 2.5, lambda c: c.ray.lead_s, RAY),
    "--ray-cpus": ("2", 2, "3", 3, lambda c: c.ray.local_cpus, RAY),
    "--log-level": ("debug", "DEBUG", "error", "ERROR", lambda c: c.log_level, []),
    "--auth-secret": ("a" * 32, "a" * 32, "b" * 32, "b" * 32, lambda c: c.security.auth_secret, []),
    "--cors-origins": (
        "https://a.example",
        ("https://a.example",),
        "https://b.example",
        ("https://b.example",),
        lambda c: c.security.cors_origins,
        [],
    ),
    "--metrics-token": ("m1", "m1", "m2", "m2", lambda c: c.security.metrics_token, []),
    "--offer-rate": ("1", 1.0, "1.5", 1.5, lambda c: c.limits.offer_rate, []),
    "--offer-burst": ("3", 3, "4", 4, lambda c: c.limits.offer_burst, []),
    "--speech-rate": ("3", 3.0, "4", 4.0, lambda c: c.limits.speech_rate, []),
    "--speech-burst": ("5", 5, "6", 6, lambda c: c.limits.speech_burst, []),
    "--rate-limit-clients": ("100", 100, "200", 200, lambda c: c.limits.max_clients, []),
    "--max-sessions": ("7", 7, "8", 8, lambda c: c.limits.max_sessions, []),
    "--room-max-participants": ("9", 9, "10", 10, lambda c: c.rooms.max_participants, []),
    "--room-max-speakers": ("2", 2, "3", 3, lambda c: c.rooms.max_speakers, []),
    "--room-instruct": ("hosts", "hosts", "everyone", "everyone", lambda c: c.rooms.instruct, []),
    "--room-send": ("aiortc", False, "direct", True, lambda c: c.rooms.direct_send, []),
    "--connect-timeout": ("5", 5.0, "6", 6.0, lambda c: c.lifecycle.connect_timeout_s, []),
    "--rtcp-timeout": ("7", 7.0, "8", 8.0, lambda c: c.lifecycle.rtcp_timeout_s, []),
    "--resume-grace": ("0", 0.0, "1", 1.0, lambda c: c.lifecycle.resume_grace_s, []),
    "--idle-timeout": ("100", 100.0, "200", 200.0, lambda c: c.lifecycle.idle_timeout_s, []),
    "--drain-deadline": ("3", 3.0, "4", 4.0, lambda c: c.lifecycle.drain_deadline_s, []),
    "--breaker-failures": ("2", 2, "3", 3, lambda c: c.breaker.failures, []),
    "--breaker-window": ("11", 11.0, "12", 12.0, lambda c: c.breaker.window_s, []),
    "--breaker-cooldown": ("4", 4.0, "5", 5.0, lambda c: c.breaker.cooldown_s, []),
    "--engine-stall-timeout": ("0", 0.0, "9", 9.0, lambda c: c.breaker.stall_s, []),
    "--vad-threshold": ("0.6", 0.6, "0.7", 0.7, lambda c: c.listen.vad_threshold, []),
    "--vad-neg-threshold": ("0.2", 0.2, "0.3", 0.3, lambda c: c.listen.vad_neg_threshold, []),
    "--min-speech-ms": ("64", 64, "96", 96, lambda c: c.listen.min_speech_ms, []),
    "--end-of-turn-ms": ("700", 700, "800", 800, lambda c: c.listen.end_of_turn_silence_ms, []),
    "--max-turn-s": ("10", 10.0, "20", 20.0, lambda c: c.listen.max_turn_s, []),
    "--vad-threads": ("2", 2, "3", 3, lambda c: c.listen.vad_threads, []),
    "--stt-url": (
        "http://s1/v1",
        "http://s1/v1",
        "http://s2/v1",
        "http://s2/v1",
        lambda c: c.services.stt_base_url,
        [],
    ),
    "--stt-model": ("m1", "m1", "m2", "m2", lambda c: c.services.stt_model, []),
    "--stt-language": ("en", "en", "fr", "fr", lambda c: c.services.stt_language, []),
    "--stt-api-key": ("k1", "k1", "k2", "k2", lambda c: c.services.stt_api_key, []),
    "--stt-timeout": ("5", 5.0, "6", 6.0, lambda c: c.services.stt_timeout_s, []),
    "--llm-url": (
        "http://l1/v1",
        "http://l1/v1",
        "http://l2/v1",
        "http://l2/v1",
        lambda c: c.services.llm_base_url,
        [],
    ),
    "--llm-model": ("m1", "m1", "m2", "m2", lambda c: c.services.llm_model, []),
    "--llm-api-key": ("k1", "k1", "k2", "k2", lambda c: c.services.llm_api_key, []),
    "--llm-timeout": ("7", 7.0, "8", 8.0, lambda c: c.services.llm_timeout_s, []),
    "--system-prompt": ("p1", "p1", "p2", "p2", lambda c: c.services.system_prompt, []),
}

# on/off flags: what "on" sets.
SWITCHES: dict[str, tuple[Get, Any]] = {
    "--compile": (lambda c: c.chattts.compile, True),
    "--full-band-under-load": (lambda c: c.opus.band_cap_under_load, False),
    "--no-adaptation": (lambda c: c.adaptation.enabled, False),
    "--log-json": (lambda c: c.log_json, True),
    "--no-listen": (lambda c: c.listen.enabled, False),
    "--no-barge-in": (lambda c: c.listen.barge_in, False),
}

# --engine has one choice (chattts): no second value to set it to.
ONE_CHOICE = {"--engine"}


def _variable(flag: str) -> str:
    return "VOICE_AGENT_" + flag[2:].upper().replace("-", "_")


def test_the_tables_name_every_serve_flag() -> None:
    """A new flag joins the tables below, so that its variable and its precedence are
    checked too."""
    assert set(_serve_flags()) == set(VALUED) | set(SWITCHES) | ONE_CHOICE


@pytest.mark.parametrize("flag", sorted(VALUED))
def test_every_flag_reaches_the_config_from_its_variable_and_the_flag_wins(
    flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: every flag of serve can be set as VOICE_AGENT_<FLAG>, and a flag given on
    the command line wins over its variable. --drain-deadline, --breaker-window,
    --engine-stall-timeout and --tts-cpus-per-replica were each dropped on the way to the
    Config with every test passing, and so was a variable that beat its flag."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    from_env, env_expected, from_flag, flag_expected, get, extra = VALUED[flag]
    default = get(build(["serve", *extra]))
    assert env_expected != default and flag_expected != env_expected
    env = {_variable(flag): from_env}
    assert get(build(["serve", *extra], env)) == env_expected
    assert get(build(["serve", *extra, flag, from_flag])) == flag_expected
    assert get(build(["serve", *extra, flag, from_flag], env)) == flag_expected  # flag wins


@pytest.mark.parametrize("flag", sorted(SWITCHES))
def test_an_on_off_variable_reads_every_documented_spelling(flag: str) -> None:
    """README: an on/off variable is 1/0, true/false, yes/no or on/off: VOICE_AGENT_NO_LISTEN=0
    must leave the microphones heard (every value but an unknown one read as "on" passed),
    and --no-listen itself must be heard (it was dropped with every test passing)."""
    get, on = SWITCHES[flag]
    off = get(build(["serve"]))
    assert off != on
    assert get(build(["serve", flag])) == on
    variable = _variable(flag)
    for value in ("1", "true", "yes", "on", "TRUE", "Yes", "On"):
        assert get(build(["serve"], {variable: value})) == on, value
    for value in ("0", "false", "no", "off", "FALSE", "No", "Off"):
        assert get(build(["serve"], {variable: value})) == off, value
    assert get(build(["serve", flag], {variable: "0"})) == on  # the flag wins


def test_the_defaults_are_the_readmes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's Configuration table: each default is a promise."""
    from agent.threads import cores

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    c = build(["serve"])
    assert (c.host, c.port, c.ice_servers, c.ice_username, c.ice_credential) == (
        "0.0.0.0",
        8080,
        (),
        None,
        None,
    )
    assert (c.engine, c.chattts.model_dir, c.chattts.device, c.chattts.compile) == (
        "chattts",
        None,
        "auto",
        False,
    )
    assert c.chattts.threads == 0
    o = c.opus
    assert (o.bitrate, o.complexity, o.complexity_floor, o.band_cap_under_load) == (
        32_000,
        9,
        0,
        True,
    )
    assert (o.input_rate, o.direct_send, o.encode_threads) == (None, True, 0)
    a = c.adaptation
    assert (a.enabled, a.min_bitrate, a.fec_min_bitrate) == (True, 12_000, 20_000)
    assert (c.workers, c.log_level, c.log_json) == (cores(), "INFO", False)
    s = c.security
    assert (s.auth_secret, s.cors_origins, s.metrics_token) == (None, (), None)
    li = c.limits
    assert (li.offer_rate, li.offer_burst, li.speech_rate, li.speech_burst) == (0.5, 10, 2, 20)
    assert (li.max_clients, li.max_sessions) == (10_000, 200)
    ls = c.listen
    assert (ls.enabled, ls.barge_in, ls.vad_threshold, ls.vad_neg_threshold) == (
        True,
        True,
        0.5,
        0.35,
    )
    assert (ls.min_speech_ms, ls.end_of_turn_silence_ms, ls.max_turn_s, ls.vad_threads) == (
        32,
        600,
        30,
        1,
    )
    sv = c.services
    assert (sv.stt_base_url, sv.stt_model, sv.stt_language, sv.stt_api_key) == (
        None,
        "whisper-1",
        None,
        None,
    )
    assert (sv.stt_timeout_s, sv.llm_base_url, sv.llm_model, sv.llm_api_key) == (
        15,
        None,
        "gpt-4o-mini",
        None,
    )
    assert sv.llm_timeout_s == 20 and sv.system_prompt.startswith("You are a friendly voice")
    r = build(["serve", *RAY]).ray
    assert (c.tts, r.replicas, r.max_replicas, r.target_streams, r.max_streams) == (
        "local",
        1,
        0,
        4,
        32,
    )
    assert (r.gpus_per_replica, r.cpus_per_replica, r.lead_s, r.local_cpus) == (0, 1, 3, None)
    lc = c.lifecycle
    assert (lc.connect_timeout_s, lc.rtcp_timeout_s, lc.resume_grace_s) == (20, 12, 15)
    assert (lc.idle_timeout_s, lc.drain_deadline_s) == (600, 20)
    b = c.breaker
    assert (b.failures, b.window_s, b.cooldown_s, b.stall_s) == (5, 30, 10, 60)


SECRET = "s" * 32


def _claims(out: str) -> dict[str, Any]:
    return jwt.decode(out.strip(), SECRET, algorithms=["HS256"])


def test_the_token_command_reads_its_secret_variable_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """README: `voice-agent token` reads only VOICE_AGENT_AUTH_SECRET. Letting it read every
    flag's variable passed every test: a VOICE_AGENT_TTL or _ROOM left in a shell would
    change every token minted (and a bad one would stop the command)."""
    env = {
        "VOICE_AGENT_AUTH_SECRET": SECRET,
        "VOICE_AGENT_TTL": "5",
        "VOICE_AGENT_ROOM": "elsewhere",
        "VOICE_AGENT_ROLE": "host",
    }
    status, out, err, _ = run(["token"], env, monkeypatch, capsys)
    assert (status, err) == (0, "")
    claims = _claims(out)
    assert "room" not in claims and claims.get("role", "speaker") == "speaker"
    assert 3590 <= claims["exp"] - time.time() <= 3600  # the default --ttl, 3600 s
    status, _, err, _ = run(["token"], {**env, "VOICE_AGENT_TTL": "soon"}, monkeypatch, capsys)
    assert (status, err) == (0, "")


def test_the_token_command_takes_a_room_of_64_characters_not_65(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """README: a room name is 1-64 characters; only 65 and the empty name were tested."""
    env = {"VOICE_AGENT_AUTH_SECRET": SECRET}
    status, out, _, _ = run(["token", "--room", "r" * 64], env, monkeypatch, capsys)
    assert status == 0 and _claims(out)["room"] == "r" * 64
    status, _, err, _ = run(["token", "--room", "r" * 65], env, monkeypatch, capsys)
    assert status == 2 and "argument --room" in err


def test_the_auth_secret_is_at_least_32_bytes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """README: at least 32 bytes. Only "short" was tested refused, and only 32 ASCII
    characters accepted: 31 bytes passed, and so did counting characters, not bytes."""
    for argv in (["serve"], ["token"]):
        status, _, err, served = run(
            argv, {"VOICE_AGENT_AUTH_SECRET": "x" * 31}, monkeypatch, capsys
        )
        assert (status, served) == (2, []) and "at least 32 bytes" in err, argv
        status, _, _, _ = run(argv, {"VOICE_AGENT_AUTH_SECRET": "x" * 32}, monkeypatch, capsys)
        assert status == 0, argv
    # 16 characters, 32 bytes in UTF-8: a secret long enough
    assert build(["serve", "--auth-secret", "é" * 16]).security.auth_secret == "é" * 16


def test_workers_below_zero_are_refused_minus_one_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """README: --workers is not negative. Only -3 was tested: -1 (which --encode-threads
    takes for "one per core but one") was silently taken for 0, one per core."""
    for argv, env in ((["--workers", "-1"], {}), ([], {"VOICE_AGENT_WORKERS": "-1"})):
        status, _, err, served = run(["serve", *argv], env, monkeypatch, capsys)
        assert (status, served) == (2, [])
        assert "--workers must be 0 (one per core) or more" in err


def test_ray_address_in_the_environment_is_a_running_ray_for_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """README: several media workers point at one Ray with `--tts ray://auto`, or with
    `RAY_ADDRESS=auto` and `--tts ray`. Ignoring RAY_ADDRESS passed every test: --workers 2
    was refused, and the default was one worker instead of one per core."""
    from agent.threads import cores

    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert build(["serve", "--tts", "ray", "--workers", "2"]).workers == 2
    assert build(["serve", "--tts", "ray"]).workers == cores()
    monkeypatch.delenv("RAY_ADDRESS")
    assert build(["serve", "--tts", "ray"]).workers == 1


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--tts-replicas", "0"], "(--tts-replicas) must be 1 or more"),
        (["--tts-max-replicas", "-1"], "(--tts-max-replicas) must be 0 or more"),
        (["--ray-cpus", "0"], "(--ray-cpus) must be 1 or more"),
        (["--tts-cpus-per-replica", "-1"], "(--tts-cpus-per-replica) must not be negative"),
        (["--tts-gpus-per-replica", "-0.5"], "(--tts-gpus-per-replica) must not be negative"),
    ],
)
def test_ray_settings_out_of_range_are_usage_errors(
    argv: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each reached Ray only once the server was up (/readyz engine_failed) when its check
    was loosened, with every test passing (only --ray-cpus -1 was tested)."""
    status, _, err, served = run(["serve", *RAY, *argv], {}, monkeypatch, capsys)
    assert (status, served) == (2, []) and expected in err


def test_the_documented_edges_of_ray_and_listening_settings_are_accepted() -> None:
    """README: --tts-max-streams 'not below the engine's batch (8)': 8 itself is fine;
    --vad-neg-threshold at most --vad-threshold (equal is fine); --end-of-turn-ms
    '32 ms or more' (32 is fine). A check one step too strict refused each, unnoticed."""
    assert build(["serve", *RAY, "--tts-max-streams", "8"]).ray.max_streams == 8
    equal = build(["serve", "--vad-threshold", "0.4", "--vad-neg-threshold", "0.4"]).listen
    assert (equal.vad_threshold, equal.vad_neg_threshold) == (0.4, 0.4)
    assert build(["serve", "--end-of-turn-ms", "32"]).listen.end_of_turn_silence_ms == 32


def test_only_voice_agent_variables_are_warned_about() -> None:
    """serve warns about VOICE_AGENT_* variables that are none of its settings; warning
    about every other variable (PATH, HOME, a variable whose name has the prefix inside it)
    passed every test."""
    env = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "MY_VOICE_AGENT_PORT": "1",
        "VOICE_AGENT_PORT": "9000",
        "VOICE_AGENT_NOPE": "1",
    }
    lines = unknown_variables(_serve_parser(env), env)
    assert lines == ["VOICE_AGENT_NOPE is not a setting of voice-agent serve; it is ignored"]


def test_a_trailing_comma_in_the_ice_servers_variable_is_no_server() -> None:
    """VOICE_AGENT_ICE_SERVERS is comma-separated: 'stun:a.example, ' (an env file's
    trailing comma and space) is one server, not one and an empty URL refused."""
    env = {"VOICE_AGENT_ICE_SERVERS": "stun:a.example, , stun:b.example, "}
    assert build(["serve"], env).ice_servers == ("stun:a.example", "stun:b.example")


def test_tiny_model_builds_the_tiny_one_with_seed_0_by_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """README: `voice-agent tiny-model DIR` builds the tiny checkpoint; `--size full` the
    real model's dimensions. A default of full passed every test."""
    import agent.chattts.tiny

    calls: list[tuple[Path, str, int]] = []

    def fake(out_dir: Path, *, size: str = "?", seed: int = -1) -> Path:
        calls.append((out_dir, size, seed))
        return out_dir

    monkeypatch.setattr(agent.chattts.tiny, "build_tiny_model", fake)
    assert main(["tiny-model", str(tmp_path)], {}) == 0
    assert main(["tiny-model", str(tmp_path), "--size", "full", "--seed", "3"], {}) == 0
    assert calls == [(tmp_path, "tiny", 0), (tmp_path, "full", 3)]
    assert "built a tiny random-weight ChatTTS checkpoint" in capsys.readouterr().out
