"""Media worker processes: N copies of the server app, each on a private Unix socket.

One Python process tops out at about one core (the GIL), so ``serve --workers N`` runs N
processes that each own their peer connections, tracks and speech pipelines, and a front
process (signaling/front.py) that owns the public address and routes HTTP to them. Media
never passes through the front: each worker's ICE candidates are its own UDP ports.

A worker that dies is started again at once (with a back-off if it keeps dying), and one
that stops answering (wedged) is killed first; its sessions died with it, and requests for
them get 404 from the new process. Workers are started with the ``spawn`` method: forking
a process that has threads (torch, aioice) is unsafe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.process
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from agent.config import Config
from agent.threads import cores
from signaling.app import STATUS_PATH

log = logging.getLogger(__name__)

AppFactory = Callable[[Config], web.Application]
STATUS_INTERVAL_S = 1.0
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0)  # after 1, 2, 3... quick deaths in a row
MAX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux, 104 on macOS
QUICK_DEATH_S = 30.0  # a worker that lived longer than this starts the back-off over
# A worker that was up (ready once) and has answered no status poll for this long is
# wedged (its event loop, which also paces its media, is stuck; or it was SIGSTOPped):
# it is killed and started again.
WEDGED_S = 30.0
# Connections for one worker's status polls, and, apart, for its /metrics scrapes: sharing
# them, a burst of /metrics requests (public by default) queued the poll past its timeout, and
# a healthy worker was taken for an unready, then a wedged one, and killed (found by review).
CONTROL_CONNECTIONS = 2
SCRAPE_CONNECTIONS = 2


def worker_main(config: Config, socket_path: str, factory: AppFactory) -> None:
    """The worker process: the whole server app, on a Unix socket only the front can reach."""
    _die_with_parent()  # first: the imports below take a while
    from signaling.app import runner_options
    from signaling.keys import DRAIN, SESSIONS
    from signaling.logs import configure_logging
    from signaling.shutdown import serve as serve_app

    configure_logging(config)
    app = factory(config)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    # No access log: the front logs each request once (with the client's address).
    options = {**runner_options(), "access_log": None}
    # Like a single-process server: SIGTERM (from the front) drains speech, then exits.
    asyncio.run(serve_app(app, config, app[SESSIONS], app[DRAIN], path=socket_path, **options))


def _die_with_parent() -> None:
    """A front that is SIGKILLed (or OOM-killed) must not leave workers holding the model,
    the GPU and UDP ports: Linux sends them SIGTERM when it dies (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    # The signal comes only for a death after the prctl: a front killed while this process
    # was still starting (a spawned worker imports its way here for a second or more) left
    # it running, reparented, with nobody to route to it. Gone already: exit now.
    front = multiprocessing.parent_process()
    if front is not None and os.getppid() != front.pid:
        raise SystemExit(f"the front process (pid {front.pid}) is gone: not starting")


@dataclass
class Worker:
    index: int
    socket_path: str
    process: multiprocessing.process.BaseProcess | None = None
    http: aiohttp.ClientSession | None = None  # forwarded client requests
    # Status polls and /metrics scrapes, on connections of their own: sharing the forwarding
    # pool (100 connections), they queued behind a burst of slow requests (offers gathering
    # ICE, a room's listeners joining) and a busy worker was taken for an unready, then a
    # wedged one, and killed.
    control: aiohttp.ClientSession | None = None
    scrape: aiohttp.ClientSession | None = None  # /metrics scrapes
    # The scrape under way per Authorization header: concurrent /metrics requests share it.
    scrapes: dict[str | None, asyncio.Future[str | None]] = field(default_factory=dict)
    started_at: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0
    ready: bool = False  # takes new sessions, as its last status said (signaling/app.py)
    sessions: int = 0  # from the last status poll, plus offers routed since
    status: dict[str, Any] = field(default_factory=dict)
    # The last status poll it answered, once it has been ready since it started (monotonic
    # time; 0: not yet): a worker still loading its engine is never taken for a wedged one.
    answered_at: float = 0.0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def open_clients(self) -> None:
        """The HTTP clients that reach this worker's socket (kept across its restarts)."""
        if self.http is None:
            self.http = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path),
                timeout=aiohttp.ClientTimeout(total=60),
            )
        if self.control is None:
            self.control = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path, limit=CONTROL_CONNECTIONS),
                timeout=aiohttp.ClientTimeout(total=10),
            )
        if self.scrape is None:
            self.scrape = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path, limit=SCRAPE_CONNECTIONS),
                timeout=aiohttp.ClientTimeout(total=10),
            )

    async def close_clients(self) -> None:
        for client in (self.http, self.control, self.scrape):
            if client is not None:
                await client.close()
        self.http = self.control = self.scrape = None


class WorkerPool:
    """Starts, watches and restarts the workers; knows which is ready and how loaded."""

    def __init__(self, config: Config, factory: AppFactory, socket_dir: Path) -> None:
        if config.workers < 1:
            raise ValueError("workers must be at least 1")
        self.config = config
        self.factory = factory
        self._context = multiprocessing.get_context("spawn")
        self.workers = [
            Worker(index, str(socket_dir / f"worker-{index}.sock"))
            for index in range(config.workers)
        ]
        longest = max(len(w.socket_path.encode()) for w in self.workers)
        if longest > MAX_SOCKET_PATH:
            # The worker could not bind and would restart forever: say so now.
            raise ValueError(
                f"socket paths under {socket_dir} are {longest} bytes, over the {MAX_SOCKET_PATH} "
                "a Unix socket allows: set TMPDIR to a shorter directory"
            )
        self.wedged_s = WEDGED_S
        self._watches: list[asyncio.Task[None]] = []
        self._closing = False
        self._closed = False

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        for worker in self.workers:
            self._spawn(worker)
        loop = asyncio.get_running_loop()
        self._watches = [loop.create_task(self._watch(worker)) for worker in self.workers]

    async def close(self, timeout_s: float | None = None) -> None:
        """SIGTERM every worker (each drains its speech, up to the drain deadline), then
        wait for them; any still running after that is killed."""
        if timeout_s is None:
            timeout_s = self.config.lifecycle.drain_deadline_s + 5.0
        if self._closed:
            return
        self._closed = True
        self._closing = True
        for task in self._watches:
            task.cancel()
        await asyncio.gather(*self._watches, return_exceptions=True)
        for worker in self.workers:
            if worker.alive and worker.process is not None:
                worker.process.terminate()  # SIGTERM: aiohttp closes its sessions and exits
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            process = worker.process
            if process is None:
                continue
            await asyncio.to_thread(process.join, max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("worker %d did not stop in time: killing it", worker.index)
                process.kill()
                await asyncio.to_thread(process.join, 2)
            await worker.close_clients()

    def _spawn(self, worker: Worker) -> None:
        config = replace(self.config, worker_index=worker.index, workers=1)
        # "All cores but one" is per process: split it, or N workers oversubscribe.
        share = max(1, (cores() - 1) // len(self.workers))
        # Only for a model in this process: with --tts ray the replicas' threads are the
        # cluster's business, and in their settings (the app's fingerprint) a per-process
        # split made media servers of other sizes redeploy the shared app over each other.
        if config.chattts.threads == 0 and config.tts == "local":
            config = replace(config, chattts=replace(config.chattts, threads=share))
        if config.opus.encode_threads < 0:
            config = replace(config, opus=replace(config.opus, encode_threads=share))
        process = self._context.Process(
            target=worker_main,
            args=(config, worker.socket_path, self.factory),
            name=f"voice-agent-worker-{worker.index}",
            daemon=True,
        )
        process.start()
        worker.process = process
        worker.started_at = time.monotonic()
        worker.ready = False
        worker.sessions = 0
        worker.status = {}
        worker.answered_at = 0.0
        worker.open_clients()
        log.info("worker %d started (pid %s)", worker.index, process.pid)

    async def _watch(self, worker: Worker) -> None:
        """Restart this worker when it dies; poll it for readiness and load. One task per
        worker, so a restart's back-off or a stuck worker never delays the others."""
        while not self._closing:
            try:
                if not worker.alive:
                    await self._restart(worker)
                else:
                    await self._poll(worker)
            except asyncio.CancelledError:
                raise
            except Exception:  # e.g. EMFILE spawning: keep watching, try again
                log.exception("watching worker %d failed", worker.index)
            await asyncio.sleep(STATUS_INTERVAL_S / 2 if not worker.ready else STATUS_INTERVAL_S)

    async def _restart(self, worker: Worker) -> None:
        process = worker.process
        code = process.exitcode if process is not None else None
        lived = time.monotonic() - worker.started_at
        worker.quick_deaths = worker.quick_deaths + 1 if lived < QUICK_DEATH_S else 1
        delay = RESTART_BACKOFF_S[min(worker.quick_deaths - 1, len(RESTART_BACKOFF_S) - 1)]
        log.error(
            "worker %d (pid %s) died with exit code %s after %.1f s; its %d sessions are gone;"
            " restarting in %.0f s",
            worker.index,
            worker.pid,
            code,
            lived,
            worker.sessions,
            delay,
        )
        worker.ready = False
        worker.restarts += 1
        if delay:
            await asyncio.sleep(delay)
        if not self._closing:
            self._spawn(worker)

    async def _poll(self, worker: Worker) -> None:
        assert worker.control is not None
        try:
            async with worker.control.get(
                "http://worker" + STATUS_PATH, timeout=aiohttp.ClientTimeout(total=2)
            ) as resp:
                status = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            # Starting up (no socket yet) or stuck: what it said before is stale (a refusal
            # the front would pass on, say).
            worker.ready = False
            worker.status = {}
            self._kill_if_wedged(worker)
            return
        worker.status = status
        worker.ready = bool(status.get("ready"))
        worker.sessions = int(status.get("sessions", 0))
        if worker.ready or worker.answered_at:
            worker.answered_at = time.monotonic()

    def _kill_if_wedged(self, worker: Worker) -> None:
        """A live process that stopped answering would otherwise stay for good: never
        restarted, its room refused, each request for its sessions held until the forward
        times out. Killed, it is restarted by the watch like any dead worker."""
        silent = time.monotonic() - worker.answered_at
        if not worker.answered_at or silent < self.wedged_s or worker.process is None:
            return
        log.error(
            "worker %d (pid %s) has not answered for %.0f s: killing it",
            worker.index,
            worker.pid,
            silent,
        )
        worker.process.kill()

    # --- routing -------------------------------------------------------------------------
    def for_new_session(self, room: str | None) -> Worker | None:
        """A room's participants share its worker; other sessions go to the least loaded."""
        live = [w for w in self.workers if w.alive and w.ready]
        if room is not None:
            worker = self.for_room(room)
            return worker if worker in live else None
        if not live:
            return None
        return min(live, key=lambda w: (w.sessions, w.index))

    def for_room(self, room: str) -> Worker:
        """The worker that holds ``room``: pinned by its name's hash, which is stable across
        restarts of the front."""
        return self.workers[_stable_hash(room) % len(self.workers)]

    def for_session(self, session_id: str) -> Worker | None:
        """The worker whose ids start with ``w<index>-``, if the id has that form."""
        from signaling.sessions import WORKER_ID_PREFIX

        head, sep, _ = session_id.partition("-")
        if not sep or not head.startswith(WORKER_ID_PREFIX):
            return None
        number = head[len(WORKER_ID_PREFIX) :]
        if not (number.isascii() and number.isdigit()) or len(number) > 4:
            return None
        if int(number) >= len(self.workers):
            return None
        return self.workers[int(number)]

    def serving(self) -> list[Worker]:
        """Workers that answer requests about no session (``/ice-servers``), which need no
        engine, best first: the ready ones, then any whose status came back (its breaker may
        be open or it may be draining, and a live session's resume still needs the ICE
        servers)."""
        serving = [w for w in self.workers if w.alive and (w.ready or w.status)]
        return sorted(serving, key=lambda w: not w.ready)  # stable: ready ones first


def _stable_hash(text: str) -> int:
    import zlib

    # surrogatepass: a JSON room name may hold a lone surrogate ("\ud800"); it must route
    # (the worker judges the name), not raise UnicodeEncodeError.
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))
