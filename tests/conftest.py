"""Shared fixtures: the real aiohttp server on a localhost port with a test engine."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aioice.ice
import pytest
from aiohttp import web

from agent.config import Config
from signaling.app import build_app, runner_options
from signaling.keys import SESSIONS
from tests.doubles import ToneEngine


@dataclass
class LiveServer:
    url: str
    app: web.Application
    engine: ToneEngine
    config: Config


@pytest.fixture(autouse=True)
def _unfreeze_the_heap(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every server a test starts freezes the heap once its engine is ready
    (signaling/app.py): in a long test process that would keep each earlier test's garbage
    out of the collector's reach. Hand it back after each test.

    A test measuring real-time figures (``serial``) starts with the heap frozen, as the
    product's is: in CI's serial pass the process holds every earlier test's objects, and
    one collection over them delayed a tick by milliseconds (tests/test_track.py's onset
    test saw 5 early re-phases of 8 where 6 are due: 2 of 3 runs in a process holding 3
    million objects, 0 of 4 with the heap frozen). Frozen without a collection first: a
    freeze costs nothing, a collection of that heap up to a second per test."""
    if request.node.get_closest_marker("serial") is not None:
        gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _forget_aioice_mdns() -> Iterator[None]:
    """aioice keeps one mDNS resolver per process, guarded by an asyncio.Lock made on first
    use (aioice.ice._mdns): bound to that test's event loop, it fails every later test's
    offer with mDNS candidates (Firefox's and Chromium's default) with "bound to a
    different event loop". A server runs one loop for its life; tests run one each."""
    yield
    for name in ("lock", "protocol", "subscribers"):
        if hasattr(aioice.ice._mdns, name):
            delattr(aioice.ice._mdns, name)


@pytest.fixture
def tone_engine() -> ToneEngine:
    return ToneEngine()


@pytest.fixture
def server_config() -> Config:
    return Config(host="127.0.0.1", port=0)


@contextlib.asynccontextmanager
async def serve(config: Config, engine: ToneEngine) -> AsyncIterator[LiveServer]:
    """The real application on a free localhost port, run the way the CLI runs it."""
    app = build_app(config, engine)
    runner = web.AppRunner(app, **runner_options())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    # The app loads the voice activity model at startup (its torch import stalls the loop
    # for a while) and /readyz waits for it: so do the tests, for the same ground truth.
    async with asyncio.timeout(60):
        while not app[SESSIONS].listening_ready:
            await asyncio.sleep(0.01)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app, engine, config)
    finally:
        await runner.cleanup()


async def raw_http(url: str, request: bytes) -> bytes:
    """Send ``request`` as is (bytes aiohttp's client would not send: non-UTF-8 headers)
    and return the whole reply; the request should say ``Connection: close``."""
    import asyncio

    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await reader.read()
    finally:
        writer.close()


def raw_status(reply: bytes) -> int:
    """The status code of a raw HTTP/1.1 reply."""
    return int(reply.split(b" ", 2)[1])


@pytest.fixture
async def live_server(tone_engine: ToneEngine, server_config: Config) -> AsyncIterator[LiveServer]:
    async with serve(server_config, tone_engine) as server:
        yield server
