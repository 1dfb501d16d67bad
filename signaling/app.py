"""Builds the aiohttp application from one Config and one engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from agent.config import Config
from agent.engine import EngineLoadError, TTSEngine
from signaling.errors import error_middleware
from signaling.keys import CONFIG, ENGINE, ENGINE_ERROR, SESSIONS
from signaling.routes import add_routes
from signaling.sessions import SessionRegistry

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 256 * 1024


def build_app(config: Config, engine: TTSEngine) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_REQUEST_BYTES)
    app[CONFIG] = config
    app[ENGINE] = engine
    app[SESSIONS] = SessionRegistry(config, engine)
    app[ENGINE_ERROR] = []
    add_routes(app)
    app.cleanup_ctx.append(_engine_lifecycle)
    app.on_shutdown.append(_close_sessions)
    return app


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Load the engine in the background: the server answers /healthz while it loads."""
    engine = app[ENGINE]

    async def load() -> None:
        try:
            await engine.start()
            log.info("engine %s ready", engine.name)
        except EngineLoadError as exc:
            # An expected failure (no network, missing files): the message says what to do.
            log.error("engine %s failed to load: %s", engine.name, exc)
            app[ENGINE_ERROR].append(str(exc))
        except Exception as exc:
            log.exception("engine %s failed to load", engine.name)
            app[ENGINE_ERROR].append(str(exc) or type(exc).__name__)

    task = asyncio.get_running_loop().create_task(load())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await engine.close()


async def _close_sessions(app: web.Application) -> None:
    await app[SESSIONS].close_all()
