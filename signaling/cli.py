"""The ``voice-agent`` command: builds the one Config from flags and environment and runs."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from agent.config import (
    INSTRUCT_POLICIES,
    LOG_LEVELS,
    ROLES,
    ROOM_NAME_RULE,
    AdaptationSettings,
    BreakerSettings,
    ChatTTSSettings,
    Config,
    LifecycleSettings,
    LimitSettings,
    RaySettings,
    RoomSettings,
    SecuritySettings,
    is_room_name,
)
from agent.engines import ENGINE_NAMES
from agent.opus_rates import INPUT_RATES as OPUS_INPUT_RATES
from agent.opus_rates import MAX_BITRATE as OPUS_MAX_BITRATE
from agent.opus_rates import MIN_BITRATE as OPUS_MIN_BITRATE
from signaling.auth import mint_token
from signaling.conversation_flags import add_conversation_flags, conversation_settings
from signaling.envflags import ENV_PREFIX, EnvParser, env_value, number, unknown_variables
from signaling.logs import configure_logging

SEND_PATHS = ("direct", "aiortc")
INPUT_RATE_CHOICES = ("auto", *(str(rate) for rate in OPUS_INPUT_RATES))


# flag, type, default, help
FlagSpec = tuple[str, Callable[[str], Any], Any, str]


def _add_flags(parser: argparse.ArgumentParser, flags: Sequence[FlagSpec]) -> None:
    for flag, kind, default, text in flags:
        parser.add_argument("--" + flag, type=kind, default=default, help=text)


def _cores() -> int:
    from agent.threads import cores

    return cores()


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    defaults = Config()
    parser = argparse.ArgumentParser(
        prog="voice-agent",
        description="WebRTC real-time voice agent. Every flag of `serve` can also be set as "
        f"{ENV_PREFIX}<FLAG> in the environment (e.g. {ENV_PREFIX}PORT=8080); `token` reads "
        f"{ENV_PREFIX}AUTH_SECRET only.",
    )
    # Each subcommand reads its flags' VOICE_AGENT_* variables as it is parsed, with one rule
    # for all (signaling/envflags.py): empty is unset, a value its flag refuses is an error.
    commands = parser.add_subparsers(dest="command", required=True, parser_class=EnvParser)

    serve = commands.add_parser("serve", help="run the signaling server and the agent")
    serve.env, serve.env_flags = env, None  # every flag
    serve.add_argument("--host", default=defaults.host)
    serve.add_argument("--port", type=int, default=defaults.port, help="0-65535 (0: any free port)")
    serve.add_argument(
        "--ice-server",
        action="append",
        dest="ice_servers",
        default=None,
        help="STUN/TURN URL (repeatable); default none, which works on a LAN and localhost "
        f"(env {ENV_PREFIX}ICE_SERVERS, comma-separated)",
    )
    serve.add_argument("--ice-username")
    serve.add_argument("--ice-credential")
    serve.add_argument("--engine", choices=ENGINE_NAMES, default=defaults.engine)
    serve.add_argument(
        "--model-dir",
        type=_model_dir,
        default=None,
        help="a local ChatTTS model (default: ChatTTS's own download from Hugging Face)",
    )
    serve.add_argument(
        "--device",
        default=defaults.chattts.device,
        help="auto (CUDA when present), cpu, cuda, cuda:N, mps",
    )
    serve.add_argument("--compile", action="store_true", help="torch.compile")
    serve.add_argument(
        "--threads",
        type=int,
        default=defaults.chattts.threads,
        help="torch threads for inference (0: all cores but one on CPU)",
    )
    serve.add_argument(
        "--bitrate",
        type=int,
        default=defaults.opus.bitrate,
        help="Opus bitrate: the start and the ceiling of network adaptation (bits/s, "
        f"{OPUS_MIN_BITRATE}-{OPUS_MAX_BITRATE})",
    )
    serve.add_argument(
        "--complexity",
        type=int,
        choices=range(11),
        metavar="0-10",
        default=defaults.opus.complexity,
        help="libopus complexity: the encode is most of a session's CPU; lower it to hold "
        "more sessions per core at some quality (bench/README: 'Encoder cost and quality')",
    )
    serve.add_argument(
        "--complexity-floor",
        type=int,
        choices=range(11),
        metavar="0-10",
        default=defaults.opus.complexity_floor,
        help="while the CPU cannot keep up, all encoders step down towards this complexity "
        "and climb back after (agent/governor.py); set it to --complexity for a fixed one",
    )
    serve.add_argument(
        "--full-band-under-load",
        action="store_true",
        help="the CPU governor steps complexity alone; by default, from complexity 6 down it "
        "caps the coded band at wide-band (8 kHz of audio), and at medium-band (6 kHz) at "
        "complexity 1 or 0",
    )
    serve.add_argument(
        "--opus-input-rate",
        choices=INPUT_RATE_CHOICES,
        default="auto",
        help="the rate speech is handed to the encoder at (Hz): auto takes the engine's own "
        "when libopus does (ChatTTS: 24000, no resampling and 3-12%% less encoder time than "
        "upsampled to 48000, same quality), else the next one up; 48000 resamples "
        "everything to 48 kHz",
    )
    adaptation = AdaptationSettings()
    serve.add_argument(
        "--no-adaptation",
        action="store_true",
        help="fixed bitrate, no FEC: ignore the receiver's reports",
    )
    serve.add_argument(
        "--min-bitrate",
        type=int,
        default=adaptation.min_bitrate,
        help="adaptation's floor under congestion (bits/s; at most --bitrate)",
    )
    serve.add_argument(
        "--fec-min-bitrate",
        type=int,
        default=adaptation.fec_min_bitrate,
        help="adaptation's floor under random loss, where in-band FEC still fits (bits/s)",
    )
    serve.add_argument(
        "--encode-threads",
        type=int,
        default=defaults.opus.encode_threads,
        help="threads encoding speech one frame ahead, off the event loop "
        "(0: on the loop; -1: one per core but one)",
    )
    serve.add_argument(
        "--send-path",
        choices=SEND_PATHS,
        default="direct" if defaults.opus.direct_send else "aiortc",
        help="how a session's packets leave: direct (RTP+SRTP+sendto from the track's own "
        "timer, lean) or aiortc (its RTP sender task)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=0,
        help="media processes behind the one address (default 0: one per core; one with a "
        "local --tts ray); each holds its own sessions and, with the in-process engine, its "
        "own copy of the model",
    )
    _add_tts_plane(serve)
    serve.add_argument(
        "--log-level",
        type=_log_level,
        choices=LOG_LEVELS,
        default=defaults.log_level,
        help="any case; warn for warning (default INFO)",
    )
    serve.add_argument("--log-json", action="store_true", help="one JSON object per log line")
    _add_auth_secret(serve)
    serve.add_argument(
        "--cors-origins",
        default="",
        help="comma-separated web origins allowed to call the API from another site "
        "(e.g. https://app.example.com); default none: same-origin only",
    )
    serve.add_argument(
        "--metrics-token",
        default=None,
        help="bearer token required by GET /metrics (default: /metrics is open)",
    )
    limits = LimitSettings()
    _add_flags(
        serve,
        [
            ("offer-rate", number, limits.offer_rate, "new sessions per second per client address"),
            ("offer-burst", int, limits.offer_burst, "new sessions a client address may burst"),
            ("speech-rate", number, limits.speech_rate, "speech requests per second per address"),
            ("speech-burst", int, limits.speech_burst, "speech requests an address may burst"),
            ("rate-limit-clients", int, limits.max_clients, "client addresses tracked per limit"),
            ("max-sessions", int, limits.max_sessions, "concurrent sessions; more get server_full"),
        ],
    )
    _add_room_flags(serve)

    _add_lifecycle_flags(serve)

    add_conversation_flags(serve)

    tiny = commands.add_parser(
        "tiny-model", help="build a tiny random-weight ChatTTS checkpoint for offline smoke tests"
    )
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--size", choices=("tiny", "full"), default="tiny")
    tiny.add_argument("--seed", type=int, default=0)

    token = commands.add_parser("token", help="print a signed access token (JWT, HS256)")
    token.env, token.env_flags = env, ("auth_secret",)
    _add_auth_secret(token)
    token.add_argument(
        "--room", type=_room_name, default=None, help="the only room the token is valid for"
    )
    token.add_argument("--role", choices=ROLES, default=None, help="default: speaker")
    token.add_argument("--ttl", type=int, default=3600, help="lifetime in seconds")
    return parser


def _add_lifecycle_flags(parser: argparse.ArgumentParser) -> None:
    life, breaker = LifecycleSettings(), BreakerSettings()
    _add_flags(
        parser,
        [
            (
                "connect-timeout",
                number,
                life.connect_timeout_s,
                "seconds a peer may take to connect",
            ),
            (
                "rtcp-timeout",
                number,
                life.rtcp_timeout_s,
                "seconds without RTCP before a peer is lost",
            ),
            (
                "resume-grace",
                number,
                life.resume_grace_s,
                "seconds a lost session waits for resume",
            ),
            ("idle-timeout", number, life.idle_timeout_s, "seconds of no request and no speech"),
            (
                "drain-deadline",
                number,
                life.drain_deadline_s,
                "seconds speech may finish on SIGTERM",
            ),
            ("breaker-failures", int, breaker.failures, "engine failures in a row that open it"),
            ("breaker-window", number, breaker.window_s, "seconds those failures must fall within"),
            ("breaker-cooldown", number, breaker.cooldown_s, "seconds open before a probe"),
            (
                "engine-stall-timeout",
                number,
                breaker.stall_s,
                "seconds an utterance may wait for audio from the engine (0: no limit)",
            ),
        ],
    )


def _add_tts_plane(parser: argparse.ArgumentParser) -> None:
    """Where speech is generated: in this process (default) or on Ray Serve replicas."""
    ray = RaySettings()
    parser.add_argument(
        "--tts",
        default="local",
        help="local: the engine runs in this process (default); ray: on Ray Serve, a new "
        "local Ray instance (or RAY_ADDRESS); ray://HOST:PORT: a running Ray cluster's GCS "
        "address (this machine must be a node of it: ray start --address HOST:PORT)",
    )
    _add_flags(
        parser,
        [
            (
                "tts-replicas",
                int,
                ray.replicas,
                "Ray Serve replicas (the minimum when autoscaling)",
            ),
            ("tts-max-replicas", int, ray.max_replicas, "above --tts-replicas: Serve autoscales"),
            ("tts-target-streams", number, ray.target_streams, "autoscaling: streams per replica"),
            ("tts-max-streams", int, ray.max_streams, "streams a replica takes at once (playing)"),
            ("tts-gpus-per-replica", number, ray.gpus_per_replica, "0.5: two replicas per GPU"),
            ("tts-cpus-per-replica", number, ray.cpus_per_replica, "CPUs Ray reserves per replica"),
            ("tts-lead", number, ray.lead_s, "seconds a replica may run ahead of playout"),
        ],
    )
    parser.add_argument(
        "--ray-cpus",
        type=int,
        default=None,
        help="CPUs a local Ray instance (--tts ray) offers (default: all)",
    )


def _workers(asked: int, tts: str, ray: RaySettings) -> int:
    """``--workers``; 0 (the default): one per core, but one when this process starts its
    own local Ray (each worker would start another; start Ray once and pass
    ``--tts ray://auto`` to run several)."""
    if asked < 0:
        raise ValueError(f"--workers must be 0 (one per core) or more, not {asked}")
    local_ray = tts == "ray" and ray.address is None and not os.environ.get("RAY_ADDRESS")
    if asked > 1 and local_ray:
        raise ValueError(
            "--workers above 1 with --tts ray would start one Ray instance per worker: start "
            "Ray once (ray start --head) and pass --tts ray://auto"
        )
    if asked > 0:
        return asked
    return 1 if local_ray else _cores()


def _tts_plane(args: argparse.Namespace) -> tuple[str, RaySettings]:
    """``--tts`` and its settings: ("local" | "ray", RaySettings)."""
    spec = args.tts.strip()
    if spec == "local":
        return "local", RaySettings()
    if spec == "ray":
        address = None
    elif spec.startswith("ray://") and len(spec) > len("ray://"):
        address = spec
    else:
        raise ValueError(f"--tts must be local, ray or ray://HOST:PORT, not {spec!r}")
    return "ray", RaySettings(
        address=address,
        replicas=args.tts_replicas,
        max_replicas=args.tts_max_replicas,
        target_streams=args.tts_target_streams,
        max_streams=args.tts_max_streams,
        gpus_per_replica=args.tts_gpus_per_replica,
        cpus_per_replica=args.tts_cpus_per_replica,
        lead_s=args.tts_lead,
        local_cpus=int(args.ray_cpus) if args.ray_cpus is not None else None,
    )


def _add_room_flags(serve: argparse.ArgumentParser) -> None:
    rooms = RoomSettings()
    serve.add_argument(
        "--room-max-participants",
        type=int,
        default=rooms.max_participants,
        help="people per room (speakers and listeners); more get 409 room_full",
    )
    serve.add_argument(
        "--room-max-speakers",
        type=int,
        default=rooms.max_speakers,
        help="people sending a microphone per room; more get 409 speakers_full",
    )
    serve.add_argument(
        "--room-instruct",
        choices=INSTRUCT_POLICIES,
        default=rooms.instruct,
        help="who may instruct a room's agent (say, chat, text.delta, interrupt, config)",
    )
    serve.add_argument(
        "--room-send",
        choices=SEND_PATHS,
        default="direct" if rooms.direct_send else "aiortc",
        help="how room audio reaches each listener: direct (RTP+SRTP from the source's "
        "tick, lean) or aiortc (each listener's own RTP sender task)",
    )


def _add_auth_secret(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--auth-secret",
        default=None,
        help="HS256 secret (at least 32 bytes) for access tokens; prefer the environment "
        f"({ENV_PREFIX}AUTH_SECRET): flags show in the process list. Default: no auth",
    )


def _input_rate(choice: str) -> int | None:
    return None if choice == "auto" else int(choice)


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> Config:
    ice = args.ice_servers
    if ice is None:
        ice = [u.strip() for u in (env_value(env, "ICE_SERVERS") or "").split(",") if u.strip()]
    base = Config()
    origins = tuple(o.strip() for o in args.cors_origins.split(",") if o.strip())
    listen, services = conversation_settings(args)
    tts, ray = _tts_plane(args)
    return Config(
        host=args.host,
        port=args.port,
        ice_servers=tuple(ice),
        ice_username=args.ice_username,
        ice_credential=args.ice_credential,
        engine=args.engine,
        tts=tts,
        ray=ray,
        log_level=args.log_level.upper(),
        log_json=args.log_json,
        workers=_workers(args.workers, tts, ray),
        opus=replace(
            base.opus,
            bitrate=args.bitrate,
            complexity=args.complexity,
            complexity_floor=args.complexity_floor,
            band_cap_under_load=not args.full_band_under_load,
            encode_threads=args.encode_threads,
            direct_send=args.send_path == "direct",
            input_rate=_input_rate(args.opus_input_rate),
        ),
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
            auth_secret=args.auth_secret,
            cors_origins=origins,
            metrics_token=args.metrics_token,
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
            stall_s=args.engine_stall_timeout,
        ),
        rooms=replace(
            RoomSettings(),
            max_participants=args.room_max_participants,
            max_speakers=args.room_max_speakers,
            instruct=args.room_instruct,
            direct_send=args.room_send == "direct",
        ),
        listen=listen,
        services=services,
    )


def serve(config: Config) -> None:
    import asyncio

    from signaling.app import product_app, runner_options
    from signaling.keys import DRAIN, SESSIONS
    from signaling.shutdown import serve as serve_app

    _check_listen_address(config)
    # The address is logged once bound (signaling/shutdown.py log_listening): --port 0
    # picks the port then.
    if config.workers > 1:
        import tempfile

        from signaling.front import run_front
        from signaling.workers import WorkerPool

        with tempfile.TemporaryDirectory(prefix="voice-agent-") as sockets:
            try:
                pool = WorkerPool(config, product_app, Path(sockets))
            except ValueError as exc:
                # Socket paths too long under $TMPDIR: the message says what to do, which a
                # traceback buried (after the weights' download, which now waits for it).
                _usage_error(str(exc))
            # Only where the workers load the model: speaking through Ray, the replicas on
            # the cluster do, and a media machine has no use for 1.1 GB of weights. Once
            # the front listens (it serves the page, /healthz, and /readyz not_ready), and
            # before the workers start, so that they do not all fetch it at once.
            prepare: Callable[[], None] | None = None
            if config.engine == "chattts" and config.tts == "local":
                prepare = partial(_download_model, config)
            run_front(config, pool, prepare)
        return
    app = product_app(config)
    # Until SIGTERM/SIGINT; then drain (signaling/shutdown.py) and return: exit status 0.
    asyncio.run(serve_app(app, config, app[SESSIONS], app[DRAIN], **runner_options()))


def _download_model(config: Config) -> None:
    from agent.chattts.loader import ModelLoadError, ensure_downloaded

    try:
        ensure_downloaded(config.chattts)
    except ModelLoadError as exc:
        # The workers try themselves and report it on /readyz (engine_failed).
        logging.getLogger(__name__).error("%s", exc)


def _check_listen_address(config: Config) -> None:
    """A usage error now if the port is taken (or the address not this machine's), before
    the model's download and the workers' start: it was an OSError traceback at the end of
    the start-up (found by review). Bound as asyncio binds it, then let go."""
    if config.port == 0:
        return
    where = f"{config.host}:{config.port}"
    try:
        infos = socket.getaddrinfo(
            config.host or None, config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        _usage_error(f"cannot listen on {where}: {exc.strerror}")
    for family, kind, proto, _, address in infos:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue  # a family this kernel lacks (no IPv6): asyncio skips it too
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                _usage_error(f"cannot listen on {where}: {exc.strerror or exc}")


# Variables of serve's read other than by a flag's own name: the ICE servers' list, and the
# test suite's switch (a shell that ran ``make test`` may still export it).
SERVE_VARIABLES = ("ICE_SERVERS", "REQUIRE_BROWSER")


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]  # type: ignore[no-any-return]
    raise KeyError(name)


def _usage_error(message: str) -> NoReturn:
    """argparse's way: the message on stderr, exit status 2."""
    sys.stderr.write(f"voice-agent: error: {message}\n")
    raise SystemExit(2)


def _model_dir(value: str) -> Path:
    """Not empty: ``--model-dir "$MODEL_DIR"`` with MODEL_DIR unset was ``Path("")``, the
    working directory, taken for a Hugging Face cache and downloaded into."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty: leave it out for ChatTTS's own download")
    return Path(value)


def _room_name(value: str) -> str:
    """A room the API accepts: an empty one (``--room "$ROOM"`` with ROOM unset) would mint a
    token the server refuses. argparse names the flag: ``argument --room: ...``, exit 2."""
    if not is_room_name(value):
        raise argparse.ArgumentTypeError(f"a room name is {ROOM_NAME_RULE}")
    return value


def _os_error(exc: OSError) -> str:
    """``Not a directory: 'x/asset'``: the reason and the path, without ``[Errno 20]``."""
    reason = exc.strerror or str(exc)
    return f"{reason}: {str(exc.filename)!r}" if exc.filename else reason


def _log_level(value: str) -> str:
    """Any case; ``warn`` for WARNING, as Python's logging itself accepts it."""
    level = value.upper()
    return "WARNING" if level == "WARN" else level


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    try:
        parser = build_parser(env)
    except ValueError as exc:
        _usage_error(str(exc))
    # A VOICE_AGENT_* variable the subcommand's flag refuses is a usage error here too.
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            config = config_from_args(args, env)
            configure_logging(config)
        except ValueError as exc:  # a setting the Config refuses (e.g. a short secret)
            parser.error(str(exc))
        for line in unknown_variables(_subcommand(parser, "serve"), env, also=SERVE_VARIABLES):
            logging.getLogger(__name__).warning("%s", line)
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

        try:
            path = build_tiny_model(args.dir, size=args.size, seed=args.seed)
        except OSError as exc:  # DIR is a file, or not writable, or the disk is full
            parser.error(f"cannot write the model into {args.dir}: {_os_error(exc)}")
        print(f"built a {args.size} random-weight ChatTTS checkpoint in {path}")
        print(f"use it with: voice-agent serve --model-dir {path}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
