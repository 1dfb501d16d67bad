"""Builds the aiohttp application from one Config and one engine."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from agent.breaker import CircuitBreaker
from agent.config import Config
from agent.engine import EngineLoadError, TTSEngine
from signaling import routes
from signaling.auth import make_auth_middleware
from signaling.cors import make_cors_middleware
from signaling.errors import ApiError, error_middleware
from signaling.keys import BREAKER, CONFIG, DRAIN, ENGINE, ENGINE_ERROR, LIMITS, METRICS, SESSIONS
from signaling.limits import Limits
from signaling.logs import AccessLogger
from signaling.metrics import Metrics
from signaling.sessions import SessionRegistry
from signaling.shutdown import Drain

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
FORWARDED_FOR_HEADER = "X-Forwarded-For"
STATUS_PATH = "/_worker/status"  # served by workers only, on their private socket

MAX_REQUEST_BYTES = 256 * 1024


def build_app(config: Config, engine: TTSEngine) -> web.Application:
    # Sessions, readiness and metrics all see the engine through its circuit breaker.
    breaker = CircuitBreaker(engine, config.breaker)
    engine = breaker
    metrics = Metrics(engine, config.limits.max_sessions)
    sessions = SessionRegistry(
        config, engine, on_closed=metrics.retire, on_room_closed=metrics.retire_room
    )
    load_errors: list[str] = []  # the engine's failure to load, if it fails (app[ENGINE_ERROR])
    metrics.watch(sessions.peers, sessions.governor, sessions.rooms.rooms, load_errors)
    app = web.Application(
        # Outermost first: CORS headers go on every answer, errors included; offer outcomes
        # are counted whichever layer refuses (auth too); auth runs before any handler.
        middlewares=[
            *([forwarded_client_middleware] if config.worker_index is not None else []),
            make_cors_middleware(config.security.cors_origins),
            error_middleware,
            metrics.offer_outcome_middleware(
                {routes.post_offer: "offer", routes.post_whep: "whep"},
                resume_header=routes.SESSION_TOKEN_HEADER,
            ),
            make_auth_middleware(
                config.security.auth_secret, routes.PUBLIC_HANDLERS | {worker_status}
            ),
        ],
        client_max_size=MAX_REQUEST_BYTES,
    )
    app[CONFIG] = config
    app[ENGINE] = engine
    app[SESSIONS] = sessions
    app[ENGINE_ERROR] = load_errors
    app[LIMITS] = Limits(config.limits)
    app[METRICS] = metrics
    app[DRAIN] = Drain()
    app[BREAKER] = breaker
    routes.add_routes(app)
    if config.worker_index is not None:
        _add_worker_parts(app)
    app.cleanup_ctx.append(_engine_lifecycle)
    app.on_shutdown.append(_close_sessions)
    return app


@web.middleware
async def forwarded_client_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """In a worker (reachable only through the front's Unix socket): the client's address is
    the one the front saw, for rate limits, logs and mDNS candidates."""
    client = request.headers.get(FORWARDED_FOR_HEADER)
    if client:
        request = request.clone(remote=client)
    return await handler(request)


async def worker_status(request: web.Request) -> web.Response:
    """What the front polls (over the worker's private socket). Public to the auth check:
    the front has no client's token to poll with, and refused, it found every worker
    unready for good (with --auth-secret, nothing was ever served)."""
    engine = request.app[ENGINE]
    load_errors: list[str] = request.app[ENGINE_ERROR]
    return web.json_response(
        {
            "index": request.app[CONFIG].worker_index,
            "pid": os.getpid(),
            # New sessions are routed here only while this worker takes them: its engine
            # loaded, its circuit breaker closed, not draining (a worker that refuses every
            # offer stays the least loaded and would get them all). The front's /readyz
            # also waits for listening.
            "ready": routes.takes_new_sessions(request.app),
            "listening_ready": request.app[SESSIONS].listening_ready,
            "engine": engine.name,
            "engine_error": load_errors[0] if load_errors else engine.failure,
            # What a new offer here is refused with (the front answers with it when no
            # worker takes new sessions), or null.
            "refusal": _refusal_json(routes.new_session_refusal(request.app)),
            "sessions": request.app[SESSIONS].load,
        }
    )


def _add_worker_parts(app: web.Application) -> None:
    app.router.add_get(STATUS_PATH, worker_status)


def _refusal_json(refusal: ApiError | None) -> dict[str, Any] | None:
    if refusal is None:
        return None
    return {"code": refusal.code, "message": refusal.message, "headers": refusal.headers}


def product_app(config: Config) -> web.Application:
    """The server as shipped: the configured engine (a worker process builds it this way)."""
    from agent.engines import create_engine

    return build_app(config, create_engine(config))


# How long a stopping runner waits for requests still being handled (after the drain):
# aiohttp's 60 s let one client trickling an offer's body hold the exit a minute past
# --drain-deadline, past an orchestrator's grace period (SIGKILL). Long enough for an
# offer being answered to get its 503 (ICE gathering against a silent STUN server: 5 s).
RUNNER_SHUTDOWN_S = 6.0


def runner_options() -> dict[str, Any]:
    """What every runner of the app passes (web.run_app / web.AppRunner): an access log
    that cannot leak tokens, and a short wait for requests still in flight at exit."""
    return {"access_log_class": AccessLogger, "shutdown_timeout": RUNNER_SHUTDOWN_S}


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Load the engine in the background: the server answers /healthz while it loads."""
    engine = app[ENGINE]
    config, sessions = app[CONFIG], app[SESSIONS]

    async def load_vad() -> None:
        # At startup, beside the engine: loading silero-vad imports torch, seconds of CPU
        # with the GIL held in long stretches. Left to the first microphone it stalled the
        # event loop, so every session's audio, by up to 0.6 s (measured in tests/test_fuzz).
        try:
            await sessions.vad_pool.load()
        except Exception:  # a session's listener reports it again; speech still works
            log.exception("the voice activity model failed to load")

    async def load() -> None:
        try:
            await engine.start()
            log.info("engine %s ready", engine.name)
            _freeze_startup_heap()
        except EngineLoadError as exc:
            # An expected failure (no network, missing files): the message says what to do.
            log.error("engine %s failed to load: %s", engine.name, exc)
            app[ENGINE_ERROR].append(str(exc))
        except Exception as exc:
            log.exception("engine %s failed to load", engine.name)
            app[ENGINE_ERROR].append(str(exc) or type(exc).__name__)

    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(load())]
    if config.listen.enabled:
        tasks.append(loop.create_task(load_vad()))
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await engine.close()


def _freeze_startup_heap() -> None:
    """Move what exists once the engine is loaded (modules, the model) out of the cyclic
    collector's sight. A full collection stops the event loop, so every session's packets
    with it, for as long as it takes to walk every object: with 100 sessions and the tone
    engine it took 75 ms before, 32 ms after (68,000 objects frozen; a loaded torch model
    has many more). These objects live as long as the process, so nothing is lost."""
    gc.collect()
    gc.freeze()


async def _close_sessions(app: web.Application) -> None:
    await app[SESSIONS].close_all()
