"""``serve --workers 2``: sessions spread over two media processes behind one address.

The product in a subprocess (tiny random-weight ChatTTS), Python WebRTC clients, real
processes killed with SIGKILL. Session ids name their worker (``w<index>-...``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.config import Config
from tests.rtc_client import RtcClient
from tests.served import Served, serve_subprocess

pytest_plugins = ["tests.conftest_chattts"]
pytestmark = pytest.mark.timeout(240)


def _both_ready(server: Served) -> Served:
    deadline = time.monotonic() + 120
    while True:
        with urllib.request.urlopen(server.url + "/readyz", timeout=5) as resp:
            if json.loads(resp.read())["ready_workers"] == 2:
                return server
        assert time.monotonic() < deadline, "second worker never became ready"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def two_workers(tiny_model_dir: Path) -> Iterator[Served]:
    """One fleet for the module (a start costs ~20 s of the suite); the test that kills a
    worker runs last and waits for the earlier tests' sessions to be gone first."""
    # Every test's clients come from one address: more new sessions than the default burst
    # of 10, which the front now counts for the whole server (not 10 per worker).
    with serve_subprocess(tiny_model_dir, "--workers", "2", "--offer-burst", "100") as server:
        yield _both_ready(server)


async def readyz(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/readyz") as resp:
        body: dict[str, Any] = await resp.json()
        return body


async def no_sessions_left(http: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        workers = (await readyz(http, url))["workers"]
        if all(w["ready"] and w["sessions"] == 0 for w in workers):
            return
        assert time.monotonic() < deadline, workers
        await asyncio.sleep(0.2)


async def hang_up(http: aiohttp.ClientSession, url: str, client: RtcClient) -> None:
    """DELETE, as the page's Hang up does: a bare close would hold the seat for resume."""
    if client.session_id is not None:
        async with http.delete(f"{url}/sessions/{client.session_id}"):
            pass  # 404 for the one the test already deleted
    await client.close()


def worker_of(client: RtcClient) -> int:
    assert client.session_id is not None and client.session_id.startswith("w")
    return int(client.session_id[1 : client.session_id.index("-")])


async def speaks(client: RtcClient, text: str, utterance: str, timeout: float = 60) -> None:
    client.send({"type": "say", "text": text, "id": utterance})
    ended = await client.wait_event(
        lambda e: e.get("type") == "speech.ended" and e.get("id") == utterance, timeout
    )
    assert ended["interrupted"] is False


async def test_sessions_spread_requests_reach_their_worker_rooms_share_one(
    two_workers: Served,
) -> None:
    url = two_workers.url
    async with aiohttp.ClientSession() as http:
        clients = [RtcClient(url, http) for _ in range(4)]
        try:
            for client in clients:  # one after another: each sees the previous one's load
                await client.connect()
            workers = [worker_of(c) for c in clients]
            assert sorted(workers) == [0, 0, 1, 1], workers

            # HTTP say and GET reach the owning process (the other one would say 404).
            for client in clients[:2]:
                path = f"{url}/sessions/{client.session_id}"
                async with http.post(path + "/say", json={"text": "hello", "id": "h"}) as resp:
                    assert resp.status == 202, await resp.text()
                await client.wait_event(lambda e: e.get("type") == "speech.ended", 60)
                async with http.get(path) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["session_id"] == client.session_id
            # DELETE too; afterwards the id is unknown, whichever worker is asked.
            gone = clients[3]
            async with http.delete(f"{url}/sessions/{gone.session_id}") as resp:
                assert resp.status == 204
            async with http.get(f"{url}/sessions/{gone.session_id}") as resp:
                assert resp.status == 404
                assert (await resp.json())["error"]["code"] == "unknown_session"
            for bogus in ("nope", "w9-abc", "w1-" + "0" * 32):
                async with http.get(f"{url}/sessions/{bogus}") as resp:
                    assert resp.status == 404, bogus

            # One /metrics for the whole server, labelled by worker.
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            assert 'voice_agent_sessions_active{kind="offer",worker="0"}' in text
            assert 'voice_agent_sessions_active{kind="offer",worker="1"}' in text
            assert "voice_agent_workers_alive 2.0" in text
        finally:
            await asyncio.gather(*(hang_up(http, url, c) for c in clients))

        # WHEP through the front: 201 with the Location of the owning worker's session, and
        # DELETE on that Location reaches it.
        listener = RtcClient(url, http)
        try:
            await listener.connect(whep=True)
            assert listener.location == f"/whep/{listener.session_id}"
            worker_of(listener)
            async with http.delete(url + listener.location) as resp:
                assert resp.status == 204, await resp.text()
            async with http.get(f"{url}/sessions/{listener.session_id}") as resp:
                assert resp.status == 404
        finally:
            await listener.close()

        # A room's participants all land in the process that holds the room.
        rooms: dict[str, list[RtcClient]] = {"alpha": [], "beta": []}
        try:
            for name, members in rooms.items():
                for _ in range(3):
                    client = RtcClient(url, http)
                    await client.connect(room=name)
                    members.append(client)
            for members in rooms.values():
                assert len({worker_of(c) for c in members}) == 1
        finally:
            await asyncio.gather(*(hang_up(http, url, c) for m in rooms.values() for c in m))


async def test_a_killed_worker_is_restarted_and_the_other_keeps_speaking(
    two_workers: Served,
) -> None:
    url = two_workers.url
    async with aiohttp.ClientSession() as http:
        await no_sessions_left(http, url)  # so that two new sessions land one per worker
        a, b = RtcClient(url, http), RtcClient(url, http)
        await a.connect()
        await b.connect()
        try:
            assert {worker_of(a), worker_of(b)} == {0, 1}
            victim, survivor = (a, b) if worker_of(a) == 0 else (b, a)
            before = await readyz(http, url)
            pid = before["workers"][0]["pid"]
            # The survivor is speaking when its neighbour dies.
            survivor.send({"type": "say", "text": "one two three four five six", "id": "s1"})
            await survivor.wait_event(lambda e: e.get("type") == "speech.started", 60)
            os.kill(pid, signal.SIGKILL)

            ended = await survivor.wait_event(
                lambda e: e.get("type") == "speech.ended" and e.get("id") == "s1", 60
            )
            assert ended["interrupted"] is False
            await speaks(survivor, "still here after that", "s2")

            # The dead worker's session is reported gone; the worker comes back.
            async with http.get(f"{url}/sessions/{victim.session_id}") as resp:
                assert resp.status in (404, 503), await resp.text()
            deadline = time.monotonic() + 120
            while True:
                state = (await readyz(http, url))["workers"][0]
                if state["ready"] and state["pid"] != pid:
                    break
                assert time.monotonic() < deadline, state
                await asyncio.sleep(0.2)
            assert state["restarts"] == 1
            async with http.get(f"{url}/sessions/{victim.session_id}") as resp:
                assert resp.status == 404
            # New sessions can land on the restarted worker again.
            fresh = [RtcClient(url, http) for _ in range(2)]
            try:
                for client in fresh:
                    await client.connect()
                assert 0 in {worker_of(c) for c in fresh}
            finally:
                await asyncio.gather(*(c.close() for c in fresh))
        finally:
            await asyncio.gather(a.close(), b.close())


def _outlive_the_front(pid_file: str, survived_file: str) -> None:
    """A worker whose front died before it could ask to die with it (spawned workers take a
    second or more to import their way to ``worker_main``)."""
    import multiprocessing

    from signaling.workers import _die_with_parent

    Path(pid_file).write_text(str(os.getpid()))
    front = multiprocessing.parent_process()
    assert front is not None
    while os.getppid() == front.pid:
        time.sleep(0.01)
    _die_with_parent()
    Path(survived_file).write_text("the worker ran on without its front")


def _spawn_a_worker_and_die(pid_file: str, survived_file: str) -> None:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    context.Process(target=_outlive_the_front, args=(pid_file, survived_file)).start()
    os._exit(0)  # as a SIGKILLed front: no cleanup, no join


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "zombie" not in status.read()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_whose_front_died_before_it_started_does_not_run_on(tmp_path: Path) -> None:
    """A worker asks Linux to SIGTERM it when the front dies (PR_SET_PDEATHSIG), but only a
    death after it asked counts: a front SIGKILLed (or OOM-killed) in the second or two a
    worker takes to start left that worker running with nobody to route to it, holding the
    model and its ports (found by killing the front 0.5 s after it spawned its workers).
    Now a worker whose front is already gone exits."""
    import multiprocessing

    pid_file, survived = tmp_path / "pid", tmp_path / "survived"
    front = multiprocessing.get_context("spawn").Process(
        target=_spawn_a_worker_and_die, args=(str(pid_file), str(survived))
    )
    front.start()
    front.join(60)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    while _running(pid):
        assert time.monotonic() < deadline, "the worker is still running"
        time.sleep(0.05)
    assert not survived.exists(), survived.read_text()


async def test_a_worker_that_stops_answering_is_killed_and_started_again(tmp_path: Path) -> None:
    """A worker whose event loop is wedged (SIGSTOPped here) stayed "alive" for good: never
    restarted, its room refused (503 not_ready) for good, and every request for its
    sessions held for the front's 60 s timeout, over and over. The front now kills a worker
    that was up and has not answered its status for ``wedged_s``, and starts it again."""
    from agent.conversation_config import ListenSettings
    from signaling.workers import WorkerPool
    from tests.tone_worker import tone_app

    config = Config(workers=1, listen=ListenSettings(enabled=False))
    pool = WorkerPool(config, tone_app, tmp_path)
    pool.wedged_s = 1.0
    await pool.start()
    try:
        worker = pool.workers[0]
        async with asyncio.timeout(60):
            while not worker.ready:
                await asyncio.sleep(0.05)
        stopped = worker.pid
        assert stopped is not None
        os.kill(stopped, signal.SIGSTOP)
        try:
            async with asyncio.timeout(15):
                while worker.pid == stopped:
                    await asyncio.sleep(0.05)
        finally:
            with contextlib.suppress(ProcessLookupError):  # gone once killed and reaped
                os.kill(stopped, signal.SIGCONT)
        assert worker.restarts == 1
    finally:
        await pool.close(timeout_s=5)
