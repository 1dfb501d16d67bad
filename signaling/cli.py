"""The ``voice-agent`` command: builds the one Config from flags and environment and runs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from agent.config import (
    ROLES,
    AdaptationSettings,
    BreakerSettings,
    ChatTTSSettings,
    Config,
    LifecycleSettings,
    LimitSettings,
    OpusSettings,
    SecuritySettings,
)
from agent.engines import ENGINE_NAMES
from signaling.auth import mint_token
from signaling.logs import configure_logging

ENV_PREFIX = "VOICE_AGENT_"


def _env(env: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    return env.get(ENV_PREFIX + name, default)


def _env_bool(env: Mapping[str, str], name: str) -> bool:
    return (_env(env, name) or "").strip().lower() in ("1", "true", "yes", "on")


def _cores() -> int:
    from signaling.workers import cores

    return cores()


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    defaults = Config()
    parser = argparse.ArgumentParser(
        prog="voice-agent",
        description="WebRTC real-time voice agent. Every flag can also be set as "
        f"{ENV_PREFIX}<FLAG> in the environment (e.g. {ENV_PREFIX}PORT=8080).",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the signaling server and the agent")
    serve.add_argument("--host", default=_env(env, "HOST", defaults.host))
    serve.add_argument("--port", type=int, default=int(_env(env, "PORT", str(defaults.port)) or 0))
    serve.add_argument(
        "--ice-server",
        action="append",
        dest="ice_servers",
        default=None,
        help="STUN/TURN URL (repeatable); default none, which works on a LAN and localhost "
        f"(env {ENV_PREFIX}ICE_SERVERS, comma-separated)",
    )
    serve.add_argument("--ice-username", default=_env(env, "ICE_USERNAME"))
    serve.add_argument("--ice-credential", default=_env(env, "ICE_CREDENTIAL"))
    serve.add_argument("--engine", choices=ENGINE_NAMES, default=_env(env, "ENGINE", "chattts"))
    serve.add_argument(
        "--model-dir",
        type=Path,
        default=_env(env, "MODEL_DIR"),
        help="a local ChatTTS model (default: ChatTTS's own download from Hugging Face)",
    )
    serve.add_argument(
        "--device", default=_env(env, "DEVICE", "auto"), help="auto (CUDA when present), cpu, cuda"
    )
    serve.add_argument(
        "--compile", action="store_true", default=_env_bool(env, "COMPILE"), help="torch.compile"
    )
    serve.add_argument(
        "--threads",
        type=int,
        default=int(_env(env, "THREADS", "0") or 0),
        help="torch threads for inference (0: all cores but one on CPU)",
    )
    serve.add_argument(
        "--bitrate",
        type=int,
        default=int(_env(env, "BITRATE", str(OpusSettings().bitrate)) or 0),
        help="Opus bitrate: the start and the ceiling of network adaptation (bits/s)",
    )
    adaptation = AdaptationSettings()
    serve.add_argument(
        "--no-adaptation",
        action="store_true",
        default=_env_bool(env, "NO_ADAPTATION"),
        help="fixed bitrate, no FEC: ignore the receiver's reports",
    )
    serve.add_argument(
        "--min-bitrate",
        type=int,
        default=int(_env(env, "MIN_BITRATE", str(adaptation.min_bitrate)) or 0),
        help="adaptation's floor under congestion (bits/s)",
    )
    serve.add_argument(
        "--fec-min-bitrate",
        type=int,
        default=int(_env(env, "FEC_MIN_BITRATE", str(adaptation.fec_min_bitrate)) or 0),
        help="adaptation's floor under random loss, where in-band FEC still fits (bits/s)",
    )
    serve.add_argument(
        "--encode-threads",
        type=int,
        default=int(_env(env, "ENCODE_THREADS", "0") or 0),
        help="threads encoding speech one frame ahead, off the event loop "
        "(0: on the loop; -1: one per core but one)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=int(_env(env, "WORKERS", str(_cores())) or 1),
        help="media processes behind the one address (default: one per core); each holds "
        "its own sessions and, with the in-process engine, its own copy of the model",
    )
    serve.add_argument("--log-level", default=_env(env, "LOG_LEVEL", "INFO"))
    serve.add_argument(
        "--log-json",
        action="store_true",
        default=_env_bool(env, "LOG_JSON"),
        help="one JSON object per log line",
    )
    _add_auth_secret(serve, env)
    serve.add_argument(
        "--cors-origins",
        default=_env(env, "CORS_ORIGINS", ""),
        help="comma-separated web origins allowed to call the API from another site "
        "(e.g. https://app.example.com); default none: same-origin only",
    )
    serve.add_argument(
        "--metrics-token",
        default=_env(env, "METRICS_TOKEN"),
        help="bearer token required by GET /metrics (default: /metrics is open)",
    )
    limits = LimitSettings()
    for flag, kind, default, text in [
        ("offer-rate", float, limits.offer_rate, "new sessions per second per client address"),
        ("offer-burst", int, limits.offer_burst, "new sessions a client address may burst"),
        ("speech-rate", float, limits.speech_rate, "speech requests per second per address"),
        ("speech-burst", int, limits.speech_burst, "speech requests an address may burst"),
        ("rate-limit-clients", int, limits.max_clients, "client addresses tracked per limit"),
        ("max-sessions", int, limits.max_sessions, "concurrent sessions; more get server_full"),
    ]:
        env_name = flag.upper().replace("-", "_")
        serve.add_argument(
            "--" + flag, type=kind, default=kind(_env(env, env_name, str(default))), help=text
        )

    _add_lifecycle_flags(serve, env)

    tiny = commands.add_parser(
        "tiny-model", help="build a tiny random-weight ChatTTS checkpoint for offline smoke tests"
    )
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--size", choices=("tiny", "full"), default="tiny")
    tiny.add_argument("--seed", type=int, default=0)

    token = commands.add_parser("token", help="print a signed access token (JWT, HS256)")
    _add_auth_secret(token, env)
    token.add_argument("--room", default=None, help="the only room the token is valid for")
    token.add_argument("--role", choices=ROLES, default=None, help="default: speaker")
    token.add_argument("--ttl", type=int, default=3600, help="lifetime in seconds")
    return parser


def _add_lifecycle_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    life, breaker = LifecycleSettings(), BreakerSettings()
    for flag, kind, default, text in [
        ("connect-timeout", float, life.connect_timeout_s, "seconds a peer may take to connect"),
        ("rtcp-timeout", float, life.rtcp_timeout_s, "seconds without RTCP before a peer is lost"),
        ("resume-grace", float, life.resume_grace_s, "seconds a lost session waits for resume"),
        ("idle-timeout", float, life.idle_timeout_s, "seconds of no request and no speech"),
        ("drain-deadline", float, life.drain_deadline_s, "seconds speech may finish on SIGTERM"),
        ("breaker-failures", int, breaker.failures, "engine failures in a row that open it"),
        ("breaker-window", float, breaker.window_s, "seconds those failures must fall within"),
        ("breaker-cooldown", float, breaker.cooldown_s, "seconds open before a probe"),
    ]:
        env_name = flag.upper().replace("-", "_")
        parser.add_argument(
            "--" + flag, type=kind, default=kind(_env(env, env_name, str(default))), help=text
        )


def _add_auth_secret(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    parser.add_argument(
        "--auth-secret",
        default=_env(env, "AUTH_SECRET"),
        help="HS256 secret (at least 32 bytes) for access tokens; prefer the environment "
        f"({ENV_PREFIX}AUTH_SECRET): flags show in the process list. Default: no auth",
    )


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> Config:
    ice = args.ice_servers
    if ice is None:
        ice = [u.strip() for u in (_env(env, "ICE_SERVERS") or "").split(",") if u.strip()]
    base = Config()
    origins = tuple(o.strip() for o in args.cors_origins.split(",") if o.strip())
    return Config(
        host=args.host,
        port=args.port,
        ice_servers=tuple(ice),
        ice_username=args.ice_username,
        ice_credential=args.ice_credential,
        engine=args.engine,
        log_level=args.log_level.upper(),
        log_json=args.log_json,
        workers=args.workers,
        opus=replace(base.opus, bitrate=args.bitrate, encode_threads=args.encode_threads),
        adaptation=replace(
            base.adaptation,
            enabled=not args.no_adaptation,
            min_bitrate=args.min_bitrate,
            fec_min_bitrate=args.fec_min_bitrate,
        ),
        chattts=replace(
            ChatTTSSettings(),
            model_dir=Path(args.model_dir) if args.model_dir else None,
            device=args.device,
            compile=args.compile,
            threads=args.threads,
        ),
        security=SecuritySettings(
            auth_secret=args.auth_secret or None,
            cors_origins=origins,
            metrics_token=args.metrics_token or None,
        ),
        limits=LimitSettings(
            offer_rate=args.offer_rate,
            offer_burst=args.offer_burst,
            speech_rate=args.speech_rate,
            speech_burst=args.speech_burst,
            max_clients=args.rate_limit_clients,
            max_sessions=args.max_sessions,
        ),
        lifecycle=LifecycleSettings(
            connect_timeout_s=args.connect_timeout,
            rtcp_timeout_s=args.rtcp_timeout,
            resume_grace_s=args.resume_grace,
            idle_timeout_s=args.idle_timeout,
            drain_deadline_s=args.drain_deadline,
        ),
        breaker=replace(
            BreakerSettings(),
            failures=args.breaker_failures,
            window_s=args.breaker_window,
            cooldown_s=args.breaker_cooldown,
        ),
    )


def serve(config: Config) -> None:
    import asyncio

    from signaling.app import product_app, runner_options
    from signaling.keys import DRAIN, SESSIONS
    from signaling.shutdown import serve as serve_app

    logging.getLogger(__name__).info(
        "serving the browser client on http://%s:%d (%d media %s)",
        "localhost" if config.host in ("0.0.0.0", "::") else config.host,
        config.port,
        config.workers,
        "process" if config.workers == 1 else "processes",
    )
    if config.workers > 1:
        import tempfile

        from signaling.front import run_front
        from signaling.workers import WorkerPool

        if config.engine == "chattts":
            from agent.chattts.loader import ModelLoadError, ensure_downloaded

            try:
                ensure_downloaded(config.chattts)
            except ModelLoadError as exc:
                # The workers try themselves and report it on /readyz (engine_failed).
                logging.getLogger(__name__).error("%s", exc)
        with tempfile.TemporaryDirectory(prefix="voice-agent-") as sockets:
            run_front(config, WorkerPool(config, product_app, Path(sockets)))
        return
    app = product_app(config)
    # Until SIGTERM/SIGINT; then drain (signaling/shutdown.py) and return: exit status 0.
    asyncio.run(serve_app(app, config, app[SESSIONS], app[DRAIN], **runner_options()))


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    parser = build_parser(env)
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            config = config_from_args(args, env)
        except ValueError as exc:  # a setting the Config refuses (e.g. a short secret)
            parser.error(str(exc))
        configure_logging(config)
        serve(config)
        return 0
    if args.command == "token":
        if not args.auth_secret:
            parser.error(f"no secret: pass --auth-secret or set {ENV_PREFIX}AUTH_SECRET")
        try:
            SecuritySettings(auth_secret=args.auth_secret)  # the server's own length check
            print(mint_token(args.auth_secret, ttl_s=args.ttl, room=args.room, role=args.role))
        except ValueError as exc:
            parser.error(str(exc))
        return 0
    if args.command == "tiny-model":
        from agent.chattts.tiny import build_tiny_model

        path = build_tiny_model(args.dir, size=args.size, seed=args.seed)
        print(f"built a {args.size} random-weight ChatTTS checkpoint in {path}")
        print(f"use it with: voice-agent serve --model-dir {path}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
