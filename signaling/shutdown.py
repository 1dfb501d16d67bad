"""Running the server, and stopping it gracefully on SIGTERM (or SIGINT).

On the signal the server keeps listening but stops admitting: new sessions and resumes get
503 ``shutting_down`` (``/readyz`` too, so a load balancer moves traffic away); speech in
flight (replies being prepared included) goes on until every session is idle or
``drain_deadline_s`` passes; the last events are given a moment to leave; then every peer
is closed and the process exits 0.
(aiohttp's own ``run_app`` stops listening first, so late offers would be refused at the
TCP level, not told why.)
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agent.config import Config
from agent.room import RoomMember
from signaling.errors import ApiError

if TYPE_CHECKING:  # signaling/sessions.py refuses offers with shutting_down() too
    from signaling.sessions import Peer, SessionRegistry

log = logging.getLogger(__name__)

POLL_S = 0.05
FLUSH_S = 1.0  # at most this long for the last data-channel events to leave
RETRY_AFTER_S = 5


class Drain:
    """Whether the server is shutting down; new sessions ask ``check`` first."""

    def __init__(self) -> None:
        self.draining = False

    def check(self) -> None:
        if self.draining:
            raise shutting_down()


def shutting_down() -> ApiError:
    """503 ``shutting_down``: what a new session or a resume gets once the drain began."""
    return ApiError(
        503,
        "shutting_down",
        "the server is shutting down; connect again (to another instance)",
        {"Retry-After": str(RETRY_AFTER_S)},
    )


async def drain(sessions: SessionRegistry, state: Drain, deadline_s: float) -> bool:
    """Stop admitting, let speech finish (up to the deadline), close every peer.

    Returns True if every session finished its speech in time.
    """
    state.draining = True
    end = time.monotonic() + deadline_s

    def speaking() -> int:
        return sum(1 for p in sessions.peers() if _in_flight(p))

    def unsent() -> bool:
        return any(
            p.session.channel is not None and p.session.channel.bufferedAmount > 0
            for p in sessions.peers()
        )

    log.info(
        "draining: %d sessions, %d speaking, %.0f s at most", len(sessions), speaking(), deadline_s
    )
    await _poll_until(lambda: not speaking(), end)
    busy = speaking()
    # The last events (speech.ended) are queued on the data channels: let them leave.
    await _poll_until(lambda: not unsent(), min(end, time.monotonic() + FLUSH_S))
    if busy:
        log.warning("drain deadline passed with %d sessions still speaking", busy)
    await sessions.close_all()
    return not busy


def _in_flight(peer: Peer) -> bool:
    """Whether the drain waits for this session: speech is playing or queued, a reply is
    being prepared (the LLM's first token not in yet) or a turn transcribed (its reply comes
    next), and its client can still hear it."""
    if peer.life.detached_at is not None and not peer.resuming:
        # Its playout is paused and the drain refuses its resume: it can never play, and
        # waiting for it held every SIGTERM to the deadline. (A resume that was already
        # negotiating when the drain began may still bring the client back: waited for.)
        return False
    session = peer.session
    conversation = (
        session.room.conversation if isinstance(session, RoomMember) else session.conversation
    )
    return conversation.in_flight


async def _poll_until(done: Callable[[], bool], until: float) -> None:
    """Poll ``done`` until it is true or the monotonic clock reaches ``until`` (the states
    polled change inside aiortc and the speech pipeline, which offer no event to wait on)."""
    while True:
        if done() or time.monotonic() >= until:
            return
        await asyncio.sleep(POLL_S)


async def serve(
    app: web.Application,
    config: Config,
    sessions: SessionRegistry,
    drain_state: Drain,
    path: str | None = None,
    **runner_kw: object,
) -> None:
    """Serve ``app`` until SIGTERM/SIGINT, then drain and stop (on ``path``, a Unix socket,
    when given: a worker process behind the front)."""
    runner = web.AppRunner(app, handle_signals=False, **runner_kw)  # type: ignore[arg-type]
    await runner.setup()
    try:
        site: web.BaseSite = (
            web.UnixSite(runner, path) if path else web.TCPSite(runner, config.host, config.port)
        )
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if not path:  # a worker's socket is the front's business, not the user's
            log_listening(runner.addresses, config)
        await stop.wait()
        log.info("stop signal received")
        await drain(sessions, drain_state, config.lifecycle.drain_deadline_s)
    finally:
        await runner.cleanup()
    log.info("stopped")


def log_listening(addresses: list[Any], config: Config) -> None:
    """Where the browser client is, said once the server is bound: with ``--port 0`` (any
    free port) only the sockets know the port, and a host name may bind more than one
    address (localhost: 127.0.0.1 and ::1, each with its own port under ``--port 0``)."""
    urls: list[str] = []
    for address in addresses:  # (host, port) or, for IPv6, (host, port, flowinfo, scope)
        host, port = address[0], address[1]
        if host in ("0.0.0.0", "::"):  # every interface: this machine's own name works
            host = "localhost"
        elif ":" in host:
            host = f"[{host}]"
        url = f"http://{host}:{port}"
        if url not in urls:
            urls.append(url)
    log.info(
        "serving the browser client on %s (%d media %s)",
        ", ".join(urls),
        config.workers,
        "process" if config.workers == 1 else "processes",
    )
