"""Once the engine is loaded the server freezes its startup heap (signaling/app.py): a full
cyclic collection then walks only what sessions created, and stops the event loop (every
session's packets) for less time."""

from __future__ import annotations

import asyncio
import gc

import pytest

import signaling.app as app_module
from agent.config import Config
from tests.conftest import serve
from tests.doubles import ToneEngine


def test_freezing_moves_the_heap_out_of_the_collectors_sight() -> None:
    before = gc.get_freeze_count()
    kept = [[object()] for _ in range(1000)]  # live objects made before the freeze
    try:
        app_module._freeze_startup_heap()
        assert gc.get_freeze_count() >= before + len(kept)
        tracked = {id(o) for gen in range(3) for o in gc.get_objects(gen)}
        assert not any(id(o) in tracked for o in kept)  # no generation holds them now
    finally:
        gc.unfreeze()  # hand the test process's heap back to the collector


async def test_the_heap_is_frozen_once_the_engine_has_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = ToneEngine()
    seen: list[bool] = []
    monkeypatch.setattr(app_module, "_freeze_startup_heap", lambda: seen.append(engine.ready))
    async with serve(Config(host="127.0.0.1", port=0), engine):
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.01)
    assert seen == [True]  # once, after the model (its objects live as long as the process)
