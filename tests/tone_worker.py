"""A worker app factory with the test ToneEngine, for a WorkerPool in a test: spawned
worker processes import it by name (a lambda or a test's local function cannot be)."""

from __future__ import annotations

from aiohttp import web

from agent.config import Config


def tone_app(config: Config) -> web.Application:
    from signaling.app import build_app
    from tests.doubles import ToneEngine

    return build_app(config, ToneEngine())
