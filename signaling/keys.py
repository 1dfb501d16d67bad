"""Typed keys for what the application object holds (aiohttp AppKey)."""

from __future__ import annotations

from aiohttp import web

from agent.breaker import CircuitBreaker
from agent.config import Config
from agent.engine import TTSEngine
from signaling.limits import Limits
from signaling.metrics import Metrics
from signaling.sessions import SessionRegistry
from signaling.shutdown import Drain

CONFIG = web.AppKey("config", Config)
ENGINE = web.AppKey("engine", TTSEngine)
SESSIONS = web.AppKey("sessions", SessionRegistry)
# Holds the engine's load failure message, if any (a one-element list: the app is frozen).
ENGINE_ERROR = web.AppKey("engine_error", list[str])
LIMITS = web.AppKey("limits", Limits)
METRICS = web.AppKey("metrics", Metrics)
BREAKER = web.AppKey("breaker", CircuitBreaker)  # the same object as ENGINE
DRAIN = web.AppKey("drain", Drain)  # set when SIGTERM came: new sessions are refused
