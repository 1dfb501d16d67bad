"""The front's routing decisions (no processes started: the pool only decides), and the
front's own answers, with a worker app in this process behind it."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from agent.config import BreakerSettings, Config, LimitSettings, SecuritySettings
from agent.conversation_config import ListenSettings
from signaling.app import STATUS_PATH, build_app, runner_options
from signaling.auth import mint_token
from signaling.front import build_front_app, workers_refusal
from signaling.keys import BREAKER, DRAIN, ENGINE, ENGINE_ERROR
from signaling.workers import Worker, WorkerPool
from tests.conftest import raw_http, raw_status
from tests.doubles import ToneEngine
from tests.test_shutdown import an_offer


def pool(tmp_path: Path, workers: int = 3) -> WorkerPool:
    return WorkerPool(Config(workers=workers), lambda config: None, tmp_path)  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize(
    "session_id", ["nope", "w-1", "w\u00b2-x", "w9-x", "w" + "1" * 40 + "-x", "x1-abc"]
)
def test_ids_that_name_no_worker(tmp_path: Path, session_id: str) -> None:
    assert pool(tmp_path).for_session(session_id) is None


def test_ids_name_their_worker(tmp_path: Path) -> None:
    p = pool(tmp_path)
    assert p.for_session("w2-" + "a" * 32) is p.workers[2]


def test_socket_paths_too_long_for_unix_sockets_are_refused(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    with pytest.raises(ValueError, match="TMPDIR"):
        pool(deep)


# --- the front app in this process, routing to one worker app on a Unix socket --------------
class _Running:
    """Stands in for a worker's process: the worker app runs in this event loop."""

    pid = 1

    def is_alive(self) -> bool:
        return True


@contextlib.asynccontextmanager
async def front_and_worker(
    config: Config,
    *,
    ready: bool = True,
    pools: list[WorkerPool] | None = None,
    workers: int = 1,
    apps: list[web.Application] | None = None,
    stubs: Sequence[web.Application] = (),
    process: Callable[[], object] = lambda: _Running(),
) -> AsyncIterator[str]:
    """The front app on a localhost port (its URL is yielded) and ``workers`` worker apps on
    their sockets, all in this event loop (no processes: fast, and the front's own code
    runs), each run as ``serve`` runs it; ``pools`` receives the front's worker pool,
    ``apps`` the front's app and then the workers'. ``stubs``: apps to serve in place of
    the real workers (one worker each); ``process``: what stands in for a worker process."""
    if stubs:
        workers = len(stubs)
    socket_dir = Path(tempfile.mkdtemp(prefix="front"))  # short: Unix socket paths are
    pool = WorkerPool(replace(config, workers=workers), lambda c: None, socket_dir)  # type: ignore[arg-type,return-value]
    worker_apps, runners = [], []
    for worker in pool.workers:
        worker_app = (
            stubs[worker.index]
            if stubs
            else build_app(replace(config, worker_index=worker.index, workers=1), ToneEngine())
        )
        # As worker_main runs it: no access log (the front writes one line per request).
        worker_runner = web.AppRunner(worker_app, **{**runner_options(), "access_log": None})
        await worker_runner.setup()
        runners.append(worker_runner)
        worker_apps.append(worker_app)
        await web.UnixSite(worker_runner, worker.socket_path).start()
        worker.process = process()  # type: ignore[assignment]
        worker.ready = ready
        if ready:  # as a status poll that found it ready leaves it
            worker.answered_at = time.monotonic()
        worker.open_clients()
    if pools is not None:
        pools.append(pool)
    front_app = build_front_app(config, pool)
    if apps is not None:
        apps.extend([front_app, *worker_apps])
    front_runner = web.AppRunner(front_app, **runner_options())
    await front_runner.setup()
    site = web.TCPSite(front_runner, "127.0.0.1", 0)
    await site.start()
    assert site._server is not None
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for worker in pool.workers:
            await worker.close_clients()
        await front_runner.cleanup()
        for worker_runner in runners:
            await worker_runner.cleanup()
        shutil.rmtree(socket_dir, ignore_errors=True)


async def test_tokens_and_rooms_that_are_not_utf8_route_like_any_other() -> None:
    """The front reads a token's room claim (no verification) to route it: a lone surrogate
    made PyJWT raise UnicodeEncodeError, a 500, even with no authentication configured (and
    hashing such a room name did the same). Now such an offer goes to a worker like any
    other, whose answer the client gets."""
    body = b'{"type": "offer", "sdp": "v=0"}'
    async with front_and_worker(Config(host="127.0.0.1", port=0)) as url:
        reply = await raw_http(
            url,
            b"POST /offer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer a.b.\xff\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % len(body)
            + body,
        )
        assert raw_status(reply) == 400, reply
        assert b'"no_audio"' in reply  # the worker's answer to "v=0"
        async with aiohttp.ClientSession() as http:
            async with http.post(
                url + "/offer",
                data=b'{"type": "offer", "sdp": "v=0", "token": "\\ud800"}',
                headers={"Content-Type": "application/json"},
            ) as resp:
                assert resp.status == 400, await resp.text()
                assert (await resp.json())["error"]["code"] == "no_audio"
            async with http.post(
                url + "/offer",
                data=b'{"type": "offer", "sdp": "v=0", "room": "\\ud800"}',
                headers={"Content-Type": "application/json"},
            ) as resp:
                assert resp.status == 400, await resp.text()
                assert (await resp.json())["error"]["code"] == "no_audio"
            async with http.post(
                url + "/whep?token=%ED%A0%80",
                data=b"v=0\r\n",
                headers={"Content-Type": "application/sdp"},
            ) as resp:
                assert resp.status == 400, await resp.text()
                assert (await resp.json())["error"]["code"] == "no_audio"


async def test_a_compressed_body_reaches_the_worker_as_the_front_read_it() -> None:
    """aiohttp decodes a body by its Content-Encoding as the front reads it; the front sent
    the decoded bytes on with the Content-Encoding header, so the worker failed to decode
    them again: a gzip offer that one process answers was refused (a 500 before bodies that
    cannot be read became 400 ``bad_body``). A body not in its encoding was a 500 at the
    front itself."""
    async with (
        front_and_worker(Config(host="127.0.0.1", port=0)) as url,
        # aiohttp closes a connection whose body it could not read: one per request.
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http,
    ):
        for path, content_type, body in [
            ("/offer", "application/json", b'{"type": "offer", "sdp": "v=0"}'),
            ("/whep", "application/sdp", b"v=0\r\n"),
        ]:
            headers = {"Content-Type": content_type, "Content-Encoding": "gzip"}
            async with http.post(url + path, data=gzip.compress(body), headers=headers) as resp:
                assert resp.status == 400, await resp.text()
                assert (await resp.json())["error"]["code"] == "no_audio"  # the worker read it
            async with http.post(url + path, data=b"not gzip", headers=headers) as resp:
                assert resp.status == 400, await resp.text()
                assert (await resp.json())["error"]["code"] == "bad_body"


# Session paths whose decoded segments resolve to another route: (method, raw target).
_ESCAPING_PATHS = [
    (b"GET", b"/sessions/w0-x/..%2f..%2f_worker/status"),  # the worker's private page
    (b"GET", b"/sessions/w0-x/../../_worker/status"),
    (b"GET", b"/sessions/w0-x/%2e%2e/%2e%2e/_worker/status"),
    (b"POST", b"/sessions/w1-x/..%2f..%2foffer"),  # an offer to the worker of one's choice
    (b"POST", b"/sessions/w1-x%2f..%2f..%2foffer"),
    (b"POST", b"/whep/w1-x%2f..%2f..%2fwhep"),
    (b"GET", b"/sessions/w0-x/say%3Fa=1"),  # an encoded "?": a query the front never saw
]


async def test_session_paths_never_reach_another_route_of_a_worker() -> None:
    """The front forwarded the *decoded* path: ``/sessions/w0-x/..%2f..%2f_worker/status``
    matched the front's session route, and yarl resolved the dot segments, so worker 0 served
    its private status page; ``POST /sessions/w1-x/..%2f..%2foffer`` made an offer on a
    worker the client picked (past room pinning, load balancing, drain and ready checks), and
    an encoded ``%3F`` moved part of the path into the query. Such a path is refused (404
    ``not_found``) before any worker sees it; the path and query go to the worker as the
    client sent them (``?room=%23`` is the room "#" there too, not an empty one); and the
    worker itself, sent such a path, serves no other route either."""
    body = b"v=0\r\n"
    pools: list[WorkerPool] = []
    async with front_and_worker(Config(host="127.0.0.1", port=0), workers=2, pools=pools) as url:
        for method, target in _ESCAPING_PATHS:
            reply = await raw_http(
                url,
                b"%s %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/sdp\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (method, target, len(body), body),
            )
            assert raw_status(reply) == 404, (target, reply)
            assert b'"not_found"' in reply, (target, reply)
        reply = await raw_http(
            url,
            b"POST /whep?room=%%23 HTTP/1.1\r\nHost: x\r\nContent-Type: application/sdp\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body),
        )
        # The room was "#" (valid) for the front but "" (bad_room) for the worker.
        assert raw_status(reply) == 400 and b'"no_audio"' in reply, reply
        worker = pools[0].workers[0]
        assert worker.http is not None
        for method, target in _ESCAPING_PATHS:
            raw = URL("http://worker" + target.decode(), encoded=True)
            async with worker.http.request(method.decode(), raw, data=body) as resp:
                text = await resp.text()
            # 404, or 405 from its session route (an id with "/" in it): never the status
            # page's "pid" nor /offer's or /whep's answer to "v=0" (no_audio).
            assert resp.status in (404, 405), (target, text)
            assert "pid" not in text and "no_audio" not in text, (target, text)


ORIGIN = "https://app.example"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type, x-session-token",
}


async def test_the_fronts_own_answers_carry_cors_headers_once() -> None:
    """The front had no CORS handling: its own errors went out without
    Access-Control-Allow-Origin (a page could not read why), and preflights needed a ready
    worker. Answers forwarded from a worker carry the headers once, not twice."""
    config = Config(host="127.0.0.1", port=0, security=SecuritySettings(cors_origins=(ORIGIN,)))
    cross = {"Origin": ORIGIN}
    async with aiohttp.ClientSession() as http:
        async with front_and_worker(config, ready=False) as url:
            # Preflights are the front's: answered with no worker ready.
            async with http.options(url + "/whep", headers=PREFLIGHT) as resp:
                assert resp.status == 204
                assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN
                assert "X-Session-Token" in resp.headers["Access-Control-Allow-Headers"]
            async with http.options(
                url + "/offer", headers={**PREFLIGHT, "Origin": "https://evil.example"}
            ) as resp:
                assert resp.status == 403
                assert (await resp.json())["error"]["code"] == "forbidden"
                assert "Access-Control-Allow-Origin" not in resp.headers
            own = [
                ("POST", "/offer", 503, "not_ready"),  # no worker ready
                ("DELETE", "/sessions/nope", 404, "unknown_session"),  # names no worker
                ("POST", "/sessions/w7-x/say", 404, "unknown_session"),
                ("GET", "/no/such/route", 404, "not_found"),
            ]
            for method, path, status, code in own:
                async with http.request(method, url + path, headers=cross, json={}) as resp:
                    assert resp.status == status, (path, await resp.text())
                    assert (await resp.json())["error"]["code"] == code
                    assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN, path
                    assert "Retry-After" in resp.headers["Access-Control-Expose-Headers"]
                    assert resp.headers.getall("Vary") == ["Origin"]
        async with front_and_worker(config) as url:
            # Forwarded: the worker's own answer, its headers not doubled.
            async with http.delete(url + "/sessions/w0-nope", headers=cross) as resp:
                assert resp.status == 404
                assert resp.headers.getall("Access-Control-Allow-Origin") == [ORIGIN]
                assert resp.headers.getall("Vary") == ["Origin"]
            async with http.get(url + "/ice-servers", headers=cross) as resp:
                assert resp.status == 200
                assert resp.headers.getall("Access-Control-Allow-Origin") == [ORIGIN]
                assert resp.headers.getall("Vary") == ["Origin"]


async def test_the_fronts_readyz_waits_for_the_workers_voice_activity_model() -> None:
    """A worker routes offers once its engine is ready, but the server is ready (as one
    process's /readyz) only once the worker says its voice activity model is loaded too."""
    pools: list[WorkerPool] = []
    async with (
        front_and_worker(Config(host="127.0.0.1", port=0), pools=pools) as url,
        aiohttp.ClientSession() as http,
    ):
        worker = pools[0].workers[0]
        async with http.get(url + "/readyz") as resp:
            assert resp.status == 200  # a status without the field: an older worker
        worker.status = {"ready": True, "listening_ready": False}
        async with http.get(url + "/readyz") as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "not_ready"
            assert resp.headers["Retry-After"] == "2"  # as the front's offers (found by review)
        worker.status = {"ready": True, "listening_ready": True}
        async with http.get(url + "/readyz") as resp:
            assert resp.status == 200


def breaker_config(**config: Any) -> Config:
    """Workers without listening, whose circuit breaker stays open once opened."""
    return Config(
        host="127.0.0.1",
        port=0,
        listen=ListenSettings(enabled=False),
        breaker=BreakerSettings(cooldown_s=600),
        **config,
    )


@contextlib.asynccontextmanager
async def front_with_a_broken_worker(
    workers: int, **config: Any
) -> AsyncIterator[tuple[str, aiohttp.ClientSession, WorkerPool]]:
    """A front and ``workers`` workers, the first one's circuit breaker open (as its engine's
    failures open it), every worker's status polled by the front since."""
    cfg = breaker_config(**config)
    pools: list[WorkerPool] = []
    apps: list[web.Application] = []
    async with (
        front_and_worker(cfg, pools=pools, workers=workers, apps=apps) as url,
        aiohttp.ClientSession() as http,
    ):
        pool, broken = pools[0], apps[1][BREAKER]
        async with asyncio.timeout(30):  # the engines load in the apps' startup
            while not all(app[BREAKER].ready for app in apps[1:]):
                await asyncio.sleep(0.01)
        for _ in range(cfg.breaker.failures):
            broken._failed(RuntimeError("CUDA out of memory"))
        assert broken.state == "open"
        for worker in pool.workers:  # the front's status poll
            await pool._poll(worker)
        yield url, http, pool


async def test_new_sessions_go_around_a_worker_whose_circuit_breaker_is_open() -> None:
    """A worker whose engine's circuit breaker was open refused every offer (503
    ``tts_unavailable``) but its status said ready (its engine was loaded): refusing kept it
    the least loaded, so the front sent it every new session while a healthy worker stood
    idle, and the front's /readyz counted it. Now its status says it takes no sessions."""
    async with front_with_a_broken_worker(2) as (url, http, pool):
        assert [w.ready for w in pool.workers] == [False, True]
        offer = await an_offer()
        for _ in range(3):
            async with http.post(url + "/offer", json={"type": "offer", "sdp": offer}) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["session_id"].startswith("w1-")
        async with http.get(url + "/readyz") as resp:
            assert resp.status == 200
            body = await resp.json()
            assert body["ready_workers"] == 1
            assert [w["ready"] for w in body["workers"]] == [False, True]


async def test_offers_the_front_refuses_itself_are_counted() -> None:
    """voice_agent_offers_total counts every new-session request, but the offers the front
    refused itself (503 ``not_ready``: no worker, or the room's, ready; 503 ``shutting_down``)
    reached no worker and were counted nowhere. The front counts them now, in the same
    family as the workers' series (labelled ``worker="front"``), one HELP/TYPE for it."""
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    pools: list[WorkerPool] = []
    apps: list[web.Application] = []
    async with (
        front_and_worker(config, ready=False, pools=pools, apps=apps) as url,
        aiohttp.ClientSession() as http,
    ):
        offer = {"type": "offer", "sdp": "v=0"}
        answers = []
        async with http.post(url + "/offer", json=offer) as resp:
            answers.append((resp.status, (await resp.json())["error"]["code"]))
        async with http.post(url + "/whep?room=r", data="v=0") as resp:
            answers.append((resp.status, (await resp.json())["error"]["code"]))
        pools[0].workers[0].ready = True
        async with http.post(url + "/offer", json=offer) as resp:  # the worker's refusal
            answers.append((resp.status, (await resp.json())["error"]["code"]))
        apps[0][DRAIN].draining = True
        async with http.post(url + "/offer", json=offer) as resp:
            answers.append((resp.status, (await resp.json())["error"]["code"]))
        assert answers == [
            (503, "not_ready"),
            (503, "not_ready"),
            (400, "no_audio"),
            (503, "shutting_down"),
        ]
        async with http.get(url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
    offers = {
        (s.labels["worker"], s.labels["kind"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "voice_agent_offers_total"
    }
    assert offers == {
        ("front", "offer", "rejected_not_ready"): 1,
        ("front", "whep", "rejected_not_ready"): 1,
        ("0", "offer", "rejected_no_audio"): 1,
        ("front", "offer", "rejected_shutting_down"): 1,
    }
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a family described twice"


async def test_the_fronts_metrics_need_the_metrics_token_with_no_worker_answering() -> None:
    """The front left --metrics-token to its workers: only a worker's 401 refused a scrape,
    so with none answering (starting, restarting, all dead) /metrics served the front's
    own page to anyone. The front checks the token itself now, as a worker does."""
    token = "s3cret-metrics-token"
    config = Config(host="127.0.0.1", port=0, security=SecuritySettings(metrics_token=token))
    pools: list[WorkerPool] = []
    async with (
        front_and_worker(config, pools=pools) as url,
        aiohttp.ClientSession() as http,
    ):
        pools[0].workers[0].process = None  # dead, not started yet again: nothing to ask
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            async with http.get(url + "/metrics", headers=headers) as resp:
                assert resp.status == 401, (headers, await resp.text())
                assert (await resp.json())["error"]["code"] == "unauthorized"
        async with http.get(url + "/metrics", headers={"Authorization": f"Bearer {token}"}) as r:
            assert r.status == 200
            assert "voice_agent_workers_alive 0.0" in await r.text()


async def test_ice_servers_are_answered_while_no_worker_takes_new_sessions() -> None:
    """/ice-servers went only to a worker that takes new sessions: with every breaker open it
    was 503 not_ready, and the page resumed live sessions without STUN/TURN."""
    turn = ("turn:turn.example.com:3478",)
    credentials = {"ice_username": "u", "ice_credential": "c"}
    async with front_with_a_broken_worker(1, ice_servers=turn, **credentials) as (url, http, pool):
        assert not any(worker.ready for worker in pool.workers)
        async with http.get(url + "/ice-servers") as resp:
            assert resp.status == 200, await resp.text()
            servers = (await resp.json())["iceServers"]
        assert servers and "turn:turn.example.com:3478" in str(servers)


async def test_the_front_says_why_the_workers_refuse_new_sessions() -> None:
    """With --workers (the default on a multi-core machine) an engine that failed to load
    (no network for the weights) or an open circuit breaker on every worker was answered
    503 ``not_ready`` "no worker is ready yet", offers and /readyz alike: the reason, and
    what to do about it, stayed in the workers' logs. The front now answers with the
    workers' own refusal, as one process does; while any worker may still take sessions
    (loading, restarting) it is still ``not_ready``."""
    config = breaker_config()
    pools: list[WorkerPool] = []
    apps: list[web.Application] = []
    async with (
        front_and_worker(config, pools=pools, workers=2, apps=apps) as url,
        aiohttp.ClientSession() as http,
    ):
        pool, workers = pools[0], apps[1:]
        async with asyncio.timeout(30):
            while not all(app[BREAKER].ready for app in workers):
                await asyncio.sleep(0.01)

        async def answers() -> list[tuple[int, str, str, str | None]]:
            for worker in pool.workers:  # the front's status poll
                await pool._poll(worker)
            got = []
            for method, path, kwargs in (
                ("POST", "/offer", {"json": {"type": "offer", "sdp": "v=0"}}),
                ("POST", "/whep?room=r", {"data": "v=0"}),
                ("GET", "/readyz", {}),
            ):
                async with http.request(method, url + path, **kwargs) as resp:
                    error = (await resp.json()).get("error", {"code": "", "message": ""})
                    retry = resp.headers.get("Retry-After")
                    got.append((resp.status, error["code"], error["message"], retry))
            return got

        # Worker 0's load failed (as signaling/app.py records it); worker 1 is still
        # loading: not ready, and no refusal to pass on.
        workers[0][ENGINE_ERROR].append("no network: download the weights or use --model-dir")
        workers[1][ENGINE].inner._ready = False  # the breaker wraps the ToneEngine
        assert [a[1] for a in await answers()] == ["not_ready"] * 3
        # Both failed: the reason, and what to do, reach the client.
        workers[1][ENGINE_ERROR].append("no network: download the weights or use --model-dir")
        for status, code, message, _ in await answers():
            assert (status, code) == (503, "engine_failed")
            assert "use --model-dir" in message
        # Worker 1 loaded after all, but its breaker is open: an open breaker retries, so
        # its answer wins, with when to come back. A room goes to its own worker, and gets
        # that worker's reason.
        workers[1][ENGINE_ERROR].clear()
        workers[1][ENGINE].inner._ready = True
        for _ in range(config.breaker.failures):
            workers[1][BREAKER]._failed(RuntimeError("CUDA out of memory"))
        offer, room_offer, ready = await answers()
        for status, code, message, _ in (offer, ready):
            assert (status, code) == (503, "tts_unavailable"), (offer, ready)
            assert "CUDA out of memory" in message
        assert offer[3] is not None and 590 <= int(offer[3]) <= 600, offer
        assert ready[3] == offer[3], ready  # /readyz says when too, as one process does
        pinned = pool.for_room("r").index
        assert room_offer[1] == ("engine_failed", "tts_unavailable")[pinned], room_offer


async def test_the_offer_rate_limit_is_the_whole_servers() -> None:
    """Each worker kept its own offer buckets, and new sessions are spread over the
    workers: with two, a client opened twice the documented rate (and N times with N).
    The front checks the rate too, once per client address for the whole server."""
    config = Config(
        host="127.0.0.1",
        port=0,
        listen=ListenSettings(enabled=False),
        limits=LimitSettings(offer_rate=0.01, offer_burst=3),
    )
    async with (
        front_and_worker(config, workers=2) as url,
        aiohttp.ClientSession() as http,
    ):
        codes = []
        for i in range(5):
            # An offer and a WHEP offer draw on the same bucket, as in one process.
            kwargs: dict[str, Any] = (
                {"json": {"type": "offer", "sdp": "v=0"}} if i % 2 else {"data": "v=0"}
            )
            path = "/offer" if i % 2 else "/whep"
            headers = {} if i % 2 else {"Content-Type": "application/sdp"}
            async with http.post(url + path, headers=headers, **kwargs) as resp:
                codes.append((resp.status, (await resp.json())["error"]["code"]))
                if resp.status == 429:
                    assert int(resp.headers["Retry-After"]) >= 1
    assert codes == [(400, "no_audio")] * 3 + [(429, "rate_limited")] * 2, codes


async def test_a_worker_that_stops_answering_its_status_gives_no_stale_reason(
    tmp_path: Path,
) -> None:
    """A worker whose status poll fails (stuck, or restarting) keeps no status from before:
    its last refusal would be passed on as if current (found by review)."""
    p = pool(tmp_path, workers=1)
    worker = p.workers[0]
    worker.process = _Running()  # type: ignore[assignment]
    worker.status = {"ready": False, "refusal": {"code": "engine_failed", "message": "old"}}
    worker.socket_path = str(tmp_path / "nobody-listens.sock")
    worker.open_clients()
    try:
        await p._poll(worker)
    finally:
        await worker.close_clients()
    assert worker.status == {} and not worker.ready
    assert workers_refusal(p.workers) is None  # not_ready, then


async def test_offers_refused_for_their_token_use_up_none_of_the_offer_rate() -> None:
    """The front counted an offer against its client's rate before a worker checked the
    token: offers refused 401 (no token, an expired or forged one) or 403 (a listener's
    /offer) used up the client's offers, which one process does not do (found by review).
    The front now verifies a new session's token first, and routes by its verified room."""
    secret = "s" * 32
    config = Config(
        host="127.0.0.1",
        port=0,
        listen=ListenSettings(enabled=False),
        limits=LimitSettings(offer_rate=0.01, offer_burst=2),
        security=SecuritySettings(auth_secret=secret),
    )
    pools: list[WorkerPool] = []
    room = "blue"
    async with (
        front_and_worker(config, workers=2, pools=pools) as url,
        aiohttp.ClientSession() as http,
    ):
        forged = mint_token("f" * 32, ttl_s=60)
        listener = mint_token(secret, ttl_s=60, role="listener")
        refused = []
        for headers, path in [
            ({}, "/offer"),
            ({"Authorization": f"Bearer {forged}"}, "/offer"),
            ({"Authorization": f"Bearer {listener}"}, "/offer"),
            ({}, "/whep"),
        ] * 2:
            async with http.post(url + path, headers=headers, json={"type": "offer"}) as resp:
                refused.append((resp.status, (await resp.json())["error"]["code"]))
        expected = [(401, "unauthorized")] * 2 + [(403, "forbidden"), (401, "unauthorized")]
        assert refused == expected * 2, refused
        roomed = mint_token(secret, ttl_s=60, room=room)
        # Another room than the token's: the worker refuses it 403 (the front routes it by
        # the token's room), and the front gives its place in the rate back.
        for _ in range(3):
            async with http.post(
                url + "/offer", json={"type": "offer", "room": "red", "token": roomed}
            ) as resp:
                assert (resp.status, (await resp.json())["error"]["code"]) == (403, "forbidden")
            async with http.post(
                url + "/whep?room=red",
                data="v=0",
                headers={"Authorization": f"Bearer {roomed}", "Content-Type": "application/sdp"},
            ) as resp:
                assert (resp.status, (await resp.json())["error"]["code"]) == (403, "forbidden")
        offer = await an_offer()
        answered = []
        for _ in range(3):
            async with http.post(
                url + "/offer", json={"type": "offer", "sdp": offer, "token": roomed}
            ) as resp:
                body = await resp.json()
                answered.append(resp.status)
                if resp.status == 200:
                    # The token's room is held by one worker: the offer went there.
                    pinned = pools[0].for_room(room).index
                    assert body["session_id"].startswith(f"w{pinned}-"), body
                    async with http.delete(
                        url + f"/sessions/{body['session_id']}",
                        headers={"Authorization": f"Bearer {roomed}"},
                    ) as gone:
                        assert gone.status in (200, 204), await gone.text()
        assert answered == [200, 200, 429], answered


@pytest.mark.parametrize("room_in", ["body", "token"])
async def test_an_offer_in_another_charset_joins_its_room_on_the_rooms_worker(
    room_in: str,
) -> None:
    """The front parsed an offer's body as UTF-8 whatever its Content-Type said, the worker
    with the charset it names: a Latin-1 body (a name "Zoë") was no JSON to the front, so
    it went to the least-loaded worker, which read the room and opened it there, split from
    the room's other participants on the room's own worker. With the room in a token in
    such a body, the token was not read at all (401 'a token is required', at the front
    since it verifies tokens, and at the worker)."""
    secret = "s" * 32
    offer = await an_offer()
    pools: list[WorkerPool] = []
    security = SecuritySettings(auth_secret=secret if room_in == "token" else None)
    config = Config(
        host="127.0.0.1", port=0, listen=ListenSettings(enabled=False), security=security
    )
    async with (
        front_and_worker(config, workers=2, pools=pools) as url,
        aiohttp.ClientSession() as http,
    ):
        # A room held by worker 1: the least loaded (a tie) would be worker 0.
        room = next(r for r in ("a", "b", "c", "d") if pools[0].for_room(r).index == 1)
        fields = {"type": "offer", "sdp": offer, "name": "Zo\u00eb"}
        if room_in == "token":
            fields["token"] = mint_token(secret, ttl_s=60, room=room)
        else:
            fields["room"] = room
        async with http.post(
            url + "/offer",
            data=json.dumps(fields, ensure_ascii=False).encode("latin-1"),
            headers={"Content-Type": "application/json; charset=iso-8859-1"},
        ) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["session_id"].startswith("w1-")


def _authenticated(secret: str) -> Config:
    """A front whose workers need a token, with no voice activity model to load."""
    return Config(
        host="127.0.0.1",
        port=0,
        listen=ListenSettings(enabled=False),
        security=SecuritySettings(auth_secret=secret),
    )


async def test_a_header_sent_twice_reaches_the_worker_twice() -> None:
    """The front copied the request's headers into a dict, keeping the last of a repeated
    one, while it (like the worker) reads the first: with two tokens, the front checked one
    and the worker the other (found by review). One process answers by the first."""
    secret = "s" * 32
    config = _authenticated(secret)
    body = b'{"type": "offer", "sdp": "v=0"}'
    good = mint_token(secret, ttl_s=60).encode()
    async with front_and_worker(config) as url:
        reply = await raw_http(
            url,
            b"POST /offer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + good + b"\r\nAuthorization: Bearer forged\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body,
        )
    assert raw_status(reply) == 400, reply  # the worker read the first token too
    assert b'"no_audio"' in reply


async def test_a_new_session_goes_around_a_worker_that_cannot_be_reached() -> None:
    """A worker that died since its last status poll (up to a second ago) was still picked
    for new sessions: the offer, which it never saw, got 503 worker_unavailable while
    another worker stood ready (found by review). Such an offer now goes to the next
    worker; a room's offer still waits for the room's own worker."""
    offer = await an_offer()
    pools: list[WorkerPool] = []
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    async with (
        front_and_worker(config, workers=2, pools=pools) as url,
        aiohttp.ClientSession() as http,
    ):
        dead = pools[0].workers[0]  # the least loaded (a tie): picked first
        os.unlink(dead.socket_path)  # nothing listens there any more
        async with http.post(url + "/offer", json={"type": "offer", "sdp": offer}) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["session_id"].startswith("w1-")
        assert not dead.ready  # until its next status poll
        dead.ready = True
        room = next(r for r in ("a", "b", "c", "d") if pools[0].for_room(r).index == 0)
        async with http.post(
            url + "/offer", json={"type": "offer", "sdp": offer, "room": room}
        ) as resp:
            assert resp.status == 503, await resp.text()
            assert (await resp.json())["error"]["code"] == "worker_unavailable"


async def test_ice_servers_go_around_a_worker_that_cannot_be_reached() -> None:
    """/ice-servers went to one worker: one that died since its last status poll made the
    page's call fail (503 worker_unavailable) while another stood ready."""
    pools: list[WorkerPool] = []
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    async with (
        front_and_worker(config, workers=2, pools=pools) as url,
        aiohttp.ClientSession() as http,
    ):
        os.unlink(pools[0].workers[0].socket_path)  # the first ready one: nothing listens
        async with http.get(url + "/ice-servers") as resp:
            assert resp.status == 200, await resp.text()
            assert "iceServers" in await resp.json()


async def test_ice_servers_go_around_every_worker_that_cannot_be_reached() -> None:
    """With the first and the last of three workers unreachable, /ice-servers must reach the
    one in the middle (found by mutation testing: only the first was passed over)."""
    pools: list[WorkerPool] = []
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    async with (
        front_and_worker(config, workers=3, pools=pools) as url,
        aiohttp.ClientSession() as http,
    ):
        os.unlink(pools[0].workers[0].socket_path)
        os.unlink(pools[0].workers[2].socket_path)
        async with http.get(url + "/ice-servers") as resp:
            assert resp.status == 200, await resp.text()


async def test_the_fronts_readyz_while_draining_says_when_to_ask_again() -> None:
    """The README's shutting_down is a 503 with Retry-After, /readyz's too: the front's
    (and a single process's) /readyz had no Retry-After (found by review)."""
    apps: list[web.Application] = []
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    async with front_and_worker(config, apps=apps) as url, aiohttp.ClientSession() as http:
        apps[0][DRAIN].draining = True
        async with http.get(url + "/readyz") as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "shutting_down"
            assert int(resp.headers["Retry-After"]) >= 1


def _restarting(pool: WorkerPool) -> None:
    """Worker 0 died and was spawned again (workers.py _spawn): the new process is still
    importing its way to its socket; its old sessions died with the old process."""
    worker = pool.workers[0]
    os.unlink(worker.socket_path)  # the new process has not bound it yet
    worker.ready = False
    worker.sessions = 0
    worker.status = {}
    worker.answered_at = 0.0


async def test_a_dead_worker_s_session_is_unknown_while_its_worker_restarts() -> None:
    """A dead worker's sessions died with it: requests for their ids get 404
    unknown_session (README, Scaling out). While its successor started (~5 s) they got 503
    worker_unavailable, and the page kept retrying a session that was gone."""
    pools: list[WorkerPool] = []
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    async with (
        front_and_worker(config, workers=2, pools=pools) as url,
        aiohttp.ClientSession() as http,
    ):
        _restarting(pools[0])
        sid = "w0-" + "a" * 32
        async with http.get(f"{url}/sessions/{sid}") as resp:
            got = (resp.status, (await resp.json())["error"]["code"])
        assert got == (404, "unknown_session"), got


async def test_a_resume_for_a_dead_worker_s_session_is_not_told_to_retry() -> None:
    pools: list[WorkerPool] = []
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    offer = await an_offer()
    async with (
        front_and_worker(config, workers=2, pools=pools) as url,
        aiohttp.ClientSession() as http,
    ):
        _restarting(pools[0])
        body = {"type": "offer", "sdp": offer, "resume": "w0-" + "b" * 43}
        async with http.post(url + "/offer", json=body) as resp:
            got = (resp.status, (await resp.json())["error"]["code"])
        # One process that restarted answers such a token 404 (the browser then stops).
        assert got == (404, "unknown_session"), got


class _Exited:
    pid = 1
    exitcode = 0

    def is_alive(self) -> bool:
        return False


async def test_a_resume_during_the_front_s_drain_is_told_shutting_down() -> None:
    """Offers, WHEP posts and resumes get 503 shutting_down while draining (README,
    Shutdown). Under the front, a worker whose sessions were all detached finishes its
    drain at once and exits (the front does not restart it while closing): a resume then
    got 404."""

    pools: list[WorkerPool] = []
    apps: list[web.Application] = []
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    offer = await an_offer()
    async with (
        front_and_worker(config, workers=2, pools=pools, apps=apps) as url,
        aiohttp.ClientSession() as http,
    ):
        apps[0][DRAIN].draining = True  # the front got SIGTERM
        for worker_app in apps[1:]:
            worker_app[DRAIN].draining = True  # ...and passed it on
        pools[0].workers[0].process = _Exited()  # type: ignore[assignment]
        body = {"type": "offer", "sdp": offer, "resume": "w0-" + "b" * 43}
        async with http.post(url + "/offer", json=body) as resp:
            got = (resp.status, (await resp.json())["error"]["code"])
        assert got == (503, "shutting_down"), got


class _Healthy(_Running):
    """A running worker process that records whether the front killed it."""

    killed = False

    def kill(self) -> None:
        self.killed = True


@contextlib.asynccontextmanager
async def _front_before_a_stub_worker(
    worker_app: web.Application,
) -> AsyncIterator[tuple[WorkerPool, Worker, _Healthy, str]]:
    """A front (its URL) before one worker whose app is ``worker_app``, polled once and
    ready; the worker's process records whether the front killed it (wedged_s 0.5 s)."""
    socket_dir = Path(tempfile.mkdtemp(prefix="stub"))
    config = Config(host="127.0.0.1", port=0, workers=1)
    pool = WorkerPool(config, lambda _config: None, socket_dir)  # type: ignore[arg-type, return-value]
    pool.wedged_s = 0.5
    worker = pool.workers[0]
    worker_runner = web.AppRunner(worker_app)
    await worker_runner.setup()
    await web.UnixSite(worker_runner, worker.socket_path).start()
    process = _Healthy()
    worker.process = process  # type: ignore[assignment]
    worker.open_clients()
    front_runner = web.AppRunner(build_front_app(config, pool), **runner_options())
    await front_runner.setup()
    site = web.TCPSite(front_runner, "127.0.0.1", 0)
    await site.start()
    assert site._server is not None
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        await pool._poll(worker)
        assert worker.ready and worker.answered_at
        yield pool, worker, process, url
    finally:
        await worker.close_clients()
        await front_runner.cleanup()
        await worker_runner.cleanup()
        shutil.rmtree(socket_dir, ignore_errors=True)


async def test_a_busy_worker_is_not_taken_for_an_unready_or_wedged_one() -> None:
    """Status polls and /metrics scrapes have connections of their own: when they shared
    the 100 connections forwarded requests use, 100 slow requests in flight to one worker
    (offers gathering ICE, a room's listeners joining) made the poll time out, the front
    marked a worker that answers in milliseconds not ready (/readyz 503) and, wedged_s
    later, killed it with every session on it (found by review)."""

    async def status(request: web.Request) -> web.Response:
        return web.json_response(
            {"ready": True, "sessions": 0, "listening_ready": True, "refusal": None}
        )

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(4)  # e.g. an offer gathering ICE against a slow STUN server
        return web.json_response({"ok": True})

    worker_app = web.Application()
    worker_app.router.add_get(STATUS_PATH, status)
    worker_app.router.add_route("*", "/sessions/{id}/{rest:.*}", slow)
    async with _front_before_a_stub_worker(worker_app) as (pool, worker, process, url):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

            async def one() -> int:
                async with http.post(url + "/sessions/w0-abc/say") as resp:
                    return resp.status

            busy = [asyncio.create_task(one()) for _ in range(100)]
            await asyncio.sleep(0.5)
            started = time.monotonic()
            await pool._poll(worker)
            await asyncio.sleep(0.6)
            await pool._poll(worker)
            polled_in = time.monotonic() - started
            async with http.get(url + "/readyz") as resp:
                readyz = resp.status
            statuses = await asyncio.gather(*busy)
        assert (worker.ready, readyz, process.killed) == (True, 200, False), (
            f"after polls taking {polled_in:.1f} s: ready={worker.ready}, /readyz {readyz}, "
            f"killed={process.killed}"
        )
        assert statuses == [200] * 100  # all forwarded, none refused for the polls' sake


async def test_a_rooms_unready_worker_is_said_to_be_not_ready() -> None:
    """The 503 for a room whose worker is starting said "the worker for room 'a' is ready
    yet" (found by review)."""
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    offer = await an_offer()
    async with (
        front_and_worker(config, ready=False) as url,
        aiohttp.ClientSession() as http,
        http.post(url + "/offer", json={"type": "offer", "sdp": offer, "room": "a"}) as resp,
    ):
        error = (await resp.json())["error"]
    assert (resp.status, error["code"]) == (503, "not_ready"), error
    assert error["message"] == "the worker for room 'a' is not ready yet", error["message"]


@pytest.mark.parametrize("token", ["", "x" * 300])
async def test_a_resume_with_a_malformed_token_is_bad_token_as_in_one_process(token: str) -> None:
    """README: 400 ``bad_token`` is "a resume that is not a token string" (the registry's
    TokenBook: 1-256 characters), which one process answers to ``"resume": ""`` or an
    over-long token, and to the same in ``X-Session-Token``. The front routes the token by
    its ``w<index>-`` prefix first and answers any token without one 404
    ``unknown_session`` itself, so the same request gets another status and code (found
    by review)."""
    config = Config(host="127.0.0.1", port=0, listen=ListenSettings(enabled=False))
    offer = await an_offer()
    async with front_and_worker(config, workers=2) as url, aiohttp.ClientSession() as http:
        body = {"type": "offer", "sdp": offer, "resume": token}
        async with http.post(url + "/offer", json=body) as resp:
            offer_got = (resp.status, (await resp.json())["error"]["code"])
        headers = {"Content-Type": "application/sdp", "X-Session-Token": token}
        async with http.post(url + "/whep", data=offer, headers=headers) as resp:
            whep_got = (resp.status, (await resp.json())["error"]["code"])
    assert (offer_got, whep_got) == ((400, "bad_token"), (400, "bad_token"))


async def test_session_requests_without_a_token_are_unauthorized_at_the_front() -> None:
    """README, Authentication: with --auth-secret every signaling request, GET/DELETE
    /sessions/{id} included, needs a token, "otherwise: 401 unauthorized" (one process
    checks it before looking the session up). The front answers a session request it
    routes nowhere (an id naming no worker, or a worker that is restarting) 404
    ``unknown_session`` without looking at the token: an unauthenticated client gets 404,
    and tells a restarting worker (404) from a running one (401; found by review)."""
    secret = "s" * 40
    config = _authenticated(secret)
    pools: list[WorkerPool] = []
    async with (
        front_and_worker(config, workers=2, pools=pools) as url,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(f"{url}/sessions/w1-{'a' * 32}") as resp:
            running = resp.status  # worker 1 is up: it answers, 401
        _restarting(pools[0])
        async with http.get(f"{url}/sessions/w0-{'a' * 32}") as resp:
            restarting = resp.status
        async with http.delete(f"{url}/sessions/{'a' * 32}") as resp:
            no_worker = resp.status
    assert (running, restarting, no_worker) == (401, 401, 401)


async def test_metrics_requests_do_not_make_a_healthy_worker_unready_or_wedged() -> None:
    """Bug: /metrics is public (no --metrics-token by default) and each request to the front
    scraped every worker over the same connections the status polls used. A burst of
    /metrics requests (anyone may send them) queued the status poll behind the scrapes:
    the poll timed out after 2 s, the worker (answering its status in ms) was taken for
    unready (/readyz 503, no new sessions) and, wedged_s later, killed with every session on
    it (found by review). Concurrent requests now share one scrape, on connections apart."""

    async def status(request: web.Request) -> web.Response:
        return web.json_response(
            {"ready": True, "sessions": 0, "listening_ready": True, "refusal": None}
        )

    scraped = 0

    async def metrics(request: web.Request) -> web.Response:
        nonlocal scraped
        scraped += 1
        await asyncio.sleep(1.0)  # a busy worker's scrape (its loop loaded by its sessions)
        return web.Response(text="# no series\n", content_type="text/plain")

    worker_app = web.Application()
    worker_app.router.add_get(STATUS_PATH, status)
    worker_app.router.add_get("/metrics", metrics)
    async with _front_before_a_stub_worker(worker_app) as (pool, worker, process, url):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

            async def scrape() -> int:
                async with http.get(url + "/metrics") as resp:
                    await resp.read()
                    return resp.status

            scrapes = [asyncio.create_task(scrape()) for _ in range(12)]
            await asyncio.sleep(0.2)
            started = time.monotonic()
            await pool._poll(worker)
            polled_in = time.monotonic() - started
            ready_after_poll = worker.ready
            async with http.get(url + "/readyz") as resp:
                readyz = resp.status
            statuses = await asyncio.gather(*scrapes)
        assert statuses == [200] * 12 and scraped <= 2, (statuses, scraped)
        assert (ready_after_poll, readyz, process.killed) == (True, 200, False), (
            f"after a poll taking {polled_in:.1f} s: ready={ready_after_poll}, "
            f"/readyz {readyz}, killed={process.killed}"
        )
