"""Choosing the product's speech engine by name (tests build their own doubles)."""

from __future__ import annotations

from agent.config import Config
from agent.engine import TTSEngine

ENGINE_NAMES = ("chattts",)


def create_engine(config: Config) -> TTSEngine:
    if config.engine == "chattts" and config.tts == "ray":
        # Ray is imported only once the engine connects (it is an optional extra).
        from agent.raytts.engine import RayServeEngine

        return RayServeEngine(config.ray, config.chattts)
    if config.engine == "chattts":
        # Imported here: torch and ChatTTS take seconds to import and are not needed by
        # the commands that don't speak (tiny-model, token, ...).
        from agent.chattts.engine import ChatTTSEngine

        return ChatTTSEngine(config.chattts)
    raise ValueError(f"unknown engine {config.engine!r}; choose from {', '.join(ENGINE_NAMES)}")
