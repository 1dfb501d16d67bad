"""The front process of ``serve --workers N``: one public address, HTTP routed to workers.

What it routes where:
- ``POST /offer`` and ``POST /whep``: a room goes to the worker that holds it (its name's
  hash), anything else to the least-loaded ready worker;
- ``/sessions/{id}...`` and ``DELETE /whep/{id}``: to the worker named in the id;
- ``GET /ice-servers``: to any ready worker;
- ``/``, the client's files, ``/healthz``: served here; ``/readyz`` and ``/metrics``: one
  answer for the whole server, from every worker's.

The worker does every check (auth, limits, SDP) itself; the front checks the offer rate
per client address as well (spread over N workers, the workers' own buckets would let a
client open N times the rate), and so, before it, a new session's token, as one process
does: an offer refused 401 or 403 must not use up the client's offers. The front forwards
the request as it came (path and query not decoded), plus ``X-Forwarded-For``; only a
session path that would resolve to another route (encoded ``..``, ``/``, ``?``) it
refuses, 404. It checks ``--metrics-token`` on its own ``/metrics`` as the workers do. It
never touches media.
CORS (signaling/cors.py, the same allow-list as the workers') is the front's own: it
answers preflights and puts the headers on its own answers (errors such as
``unknown_session`` or ``worker_unavailable`` too); a worker's answer, which carries them
already, passes through unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from agent.config import Config
from agent.httpservice import is_text_charset
from agent.logcontext import SESSION_ID
from signaling import routes
from signaling.app import FORWARDED_FOR_HEADER, MAX_REQUEST_BYTES, runner_options
from signaling.auth import CLAIMS, claims, request_token, require_speaker, verify_token
from signaling.cors import make_cors_middleware
from signaling.errors import ApiError, error_middleware, not_ready_response, read_body
from signaling.keys import CONFIG, DRAIN, LIMITS
from signaling.limits import Limits
from signaling.metrics import (
    RESUMING,
    offer_outcome_middleware,
    offers_counter,
    resumes_counter,
)
from signaling.resume import checked_token
from signaling.routes import SESSION_TOKEN_HEADER
from signaling.shutdown import Drain, log_listening, shutting_down
from signaling.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

POOL: web.AppKey[WorkerPool] = web.AppKey("pool", WorkerPool)
FRONT_METRICS = web.AppKey("front_metrics", CollectorRegistry)  # the front's own series
FRONT_LABEL = "front"  # the ``worker`` label of the front's own series in /metrics
# Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp recomputes: never forwarded.
_HOP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
        # The body forwarded is the one aiohttp decoded as the front read it: announcing
        # the client's encoding made the worker try to decode it a second time.
        "Content-Encoding",
    )
)


def build_front_app(config: Config, pool: WorkerPool) -> web.Application:
    # The offers the front refuses itself (no worker ready, shutting down...) reach no
    # worker's count: the front counts them, and /metrics merges them into the same series.
    registry = CollectorRegistry()
    offers = offers_counter(registry)
    resumes = resumes_counter(registry)
    app = web.Application(
        # Outermost first, as in signaling/app.py: CORS headers on every answer, errors too.
        middlewares=[
            make_cors_middleware(config.security.cors_origins),
            error_middleware,
            offer_outcome_middleware(
                offers,
                resumes,
                {post_offer: "offer", post_whep: "whep"},
                resume_header=SESSION_TOKEN_HEADER,
                count_answers=False,
            ),
        ],
        client_max_size=MAX_REQUEST_BYTES,
    )
    app[CONFIG] = config
    app[POOL] = pool
    app[FRONT_METRICS] = registry
    app[DRAIN] = Drain()
    # The offer rate per client address is the whole server's: each worker keeps its own
    # buckets too, but new sessions are spread over the workers, so alone they would let a
    # client open N times the rate.
    app[LIMITS] = Limits(config.limits)
    app.router.add_post("/offer", post_offer)
    app.router.add_post("/whep", post_whep)
    app.router.add_route("*", "/whep/{session_id}", to_session_worker)
    app.router.add_route("*", "/sessions/{session_id}", to_session_worker)
    app.router.add_route("*", "/sessions/{session_id}/{rest:.*}", to_session_worker)
    app.router.add_get("/ice-servers", to_any_worker)
    app.router.add_get("/healthz", routes.healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", routes.index)
    name = r"{name:[A-Za-z0-9_-]+\.[A-Za-z0-9]+}"
    app.router.add_get("/" + name, routes.static_file)
    app.router.add_get("/static/" + name, routes.static_file)
    return app


# --- routing -------------------------------------------------------------------------------
async def post_offer(request: web.Request) -> web.StreamResponse:
    await _check_token(request)
    require_speaker(request)  # as a worker refuses it: before the rate
    request.app[LIMITS].check_offer(request.remote)
    body = await read_body(request)
    # Decoded as the worker decodes it (signaling/routes.py _body_text: the Content-Type's
    # charset, UTF-8 when none): json.loads(bytes) guesses UTF-8, so a Latin-1 body (a name
    # "Zoë") was no JSON here, routed as if it named no room, and joined its room on another
    # worker than the room's other participants.
    charset = request.charset or "utf-8"
    try:
        parsed = json.loads(body.decode(charset)) if is_text_charset(charset) else None
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        parsed = None  # the worker answers it with bad_json (or 415)
    fields = parsed if isinstance(parsed, dict) else {}

    def text(key: str) -> str | None:
        value = fields.get(key)
        return value if isinstance(value, str) else None

    resume = text("resume")
    if resume is not None:
        request[RESUMING] = True
        # Refused while draining, as one process refuses it (its worker may have exited
        # already: its sessions were all detached, so it had nothing to wait for).
        request.app[DRAIN].check()
        # A session token names its worker like a session id does.
        answer = await _forward(request, _resume_worker(request, resume), body)
    else:
        room = text("room") or claims(request).room
        answer = await _forward_new_session(request, room, body)
    return _offer_counted(request, answer)


async def post_whep(request: web.Request) -> web.StreamResponse:
    await _check_token(request)
    counted = request.content_type == "application/sdp"  # else the worker's 415, as in one process
    if counted:
        request.app[LIMITS].check_offer(request.remote)
    resume = request.headers.get(SESSION_TOKEN_HEADER)
    if resume is not None:
        request.app[DRAIN].check()  # as for /offer's resume
        answer = await _forward(request, _resume_worker(request, resume))
    else:
        room = request.query.get("room") or claims(request).room
        answer = await _forward_new_session(request, room)
    return _offer_counted(request, answer) if counted else answer


def _offer_counted(request: web.Request, answer: web.StreamResponse) -> web.StreamResponse:
    """An offer the worker refused 401 or 403 (the token's room is another, the resumed
    session is not the token's: found out only there) gives back its place in the front's
    rate, as the worker gives back its own: only new sessions count."""
    if answer.status in (401, 403):
        request.app[LIMITS].give_back_offer(request.remote)
    return answer


async def _check_token(request: web.Request) -> None:
    """Verifies a new session's token as the worker will (401 ``unauthorized``), so that
    the offer rate counts only offers a worker may answer; stores the claims, whose room
    routes the offer. Without ``--auth-secret`` tokens are not read: the workers ignore
    them too."""
    secret = request.app[CONFIG].security.auth_secret
    if secret is not None:
        request[CLAIMS] = verify_token(await request_token(request), secret)


async def _forward_new_session(
    request: web.Request, room: str | None, body: bytes | None = None
) -> web.StreamResponse:
    """A new session's offer, to the worker that should take it. One that cannot be
    reached (it died since its last status poll, up to a second ago: the watch has not
    restarted it yet) never saw the offer: a session in no room goes to the next worker
    rather than answer 503 ``worker_unavailable``. A room's worker is its only one."""
    for _ in range(len(request.app[POOL].workers)):
        worker = _new_session_worker(request, room)
        try:
            return await _forward(request, worker, body)
        except _WorkerUnreachable:
            if room is not None:
                raise
            worker.ready = False  # until its next status poll says otherwise
    raise _unavailable(_WorkerUnreachable)


def _new_session_worker(request: web.Request, room: str | None) -> Worker:
    request.app[DRAIN].check()
    pool = request.app[POOL]
    worker = pool.for_new_session(room)
    if worker is None:
        candidates = pool.workers if room is None else [pool.for_room(room)]
        refusal = workers_refusal(candidates)
        if refusal is not None:
            raise refusal
        what = f"the worker for room {room[:64]!r} is not" if room is not None else "no worker is"
        raise ApiError(503, "not_ready", f"{what} ready yet", {"Retry-After": "2"})
    worker.sessions += 1  # until the next status poll: a burst of offers spreads out
    return worker


async def to_session_worker(request: web.Request) -> web.StreamResponse:
    _check_session_path(request)
    # As a worker's middleware checks it, before the 404 the front may answer itself: a
    # request without a token got 404 for an id naming no worker (or one restarting) and
    # 401 otherwise, which told a stranger which workers were up (found by review).
    await _check_token(request)
    session_id = request.match_info["session_id"]
    return await _forward(request, _session_worker(request, session_id), session_id=session_id)


def _check_session_path(request: web.Request) -> None:
    """404 for a session path whose segments, once decoded, are dot segments or hold a
    separator: ``/sessions/w1-x/..%2f..%2foffer`` names worker 1 here but, resolved, is
    another route (a worker's private ``/_worker/status``, or an offer to the worker of the
    client's choice, past room pinning, load balancing and the front's checks), and an
    encoded ``?`` or ``#`` would move the query. _forward sends the raw path, which the
    worker's router does not resolve either; this refuses such a path before any worker
    sees it."""
    for segment in request.rel_url.raw_path.split("/")[2:]:  # after "", "sessions"/"whep"
        part = unquote(segment)
        if part == "." or ".." in part or any(c in part for c in "/\\?#"):
            raise ApiError(404, "not_found", "no such path")


# What a worker refuses new sessions with that the client should hear as it is: the engine
# failed to load (e.g. no network for the weights: the message says what to do), or its
# circuit breaker is open. Anything else (starting, restarting, draining) is ``not_ready``.
_PASSED_ON_REFUSALS = ("tts_unavailable", "engine_failed")


def workers_refusal(workers: Iterable[Worker]) -> ApiError | None:
    """The workers' own reason for refusing new sessions, when every one of ``workers`` is
    up and gives one (as a single process's offer and /readyz would say it); None if any of
    them may still take sessions (loading, restarting, not yet polled): not_ready, then.
    An open breaker wins over a failed load (it retries), with the soonest Retry-After."""
    refusals = []
    for worker in workers:
        refusal = worker.status.get("refusal") if worker.alive else None
        if not isinstance(refusal, dict) or refusal.get("code") not in _PASSED_ON_REFUSALS:
            return None
        refusals.append(refusal)
    if not refusals:
        return None
    unavailable = [r for r in refusals if r["code"] == "tts_unavailable"]
    if unavailable:
        soonest = min(unavailable, key=_retry_after)
        headers = {"Retry-After": str(_retry_after(soonest))}
        return ApiError(503, "tts_unavailable", str(soonest.get("message")), headers)
    return ApiError(503, "engine_failed", str(refusals[0].get("message")))


def _retry_after(refusal: dict[str, Any]) -> int:
    return int(refusal.get("headers", {}).get("Retry-After", 1))


def _resume_worker(request: web.Request, token: str) -> Worker:
    """The worker a resume's session token names; 400 ``bad_token`` for one that is no token
    at all, as one process answers it (signaling/resume.py), not the front's 404."""
    return _session_worker(request, checked_token(token))


def _session_worker(request: web.Request, session_id_or_token: str) -> Worker:
    worker = request.app[POOL].for_session(session_id_or_token)
    # A worker not polled ready since it (re)started holds no session (new ones go only to
    # workers seen ready): a dead worker's sessions are unknown while its successor starts,
    # not "worker_unavailable", which sent the page retrying a session that is gone.
    if worker is None or not worker.alive or not worker.answered_at:
        raise ApiError(404, "unknown_session", "no session has this id or token")
    return worker


async def to_any_worker(request: web.Request) -> web.StreamResponse:
    """A GET about no session (``/ice-servers``): any worker answers it the same, so one
    that does not answer (it died since its last status poll) is passed over for the next,
    rather than the page failing its call with 503 ``worker_unavailable``."""
    serving = request.app[POOL].serving()
    if not serving:
        raise ApiError(503, "not_ready", "no worker is up yet", {"Retry-After": "2"})
    body = await read_body(request)
    for worker in serving[:-1]:
        try:
            return await _forward(request, worker, body)
        except ApiError as exc:
            if exc.code != "worker_unavailable":
                raise
    return await _forward(request, serving[-1], body)


async def _forward(
    request: web.Request,
    worker: Worker,
    body: bytes | None = None,
    *,
    session_id: str | None = None,
) -> web.StreamResponse:
    """The worker's answer to ``request``; ``session_id``: the session the path names."""
    if body is None:
        body = await read_body(request)
    # A multidict, as the request's: a header sent twice reaches the worker twice (a dict
    # kept the last value, where the front, like the worker, reads the first: two tokens
    # were checked here by one and at the worker by the other).
    headers = CIMultiDict(
        (k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS
    )
    headers[FORWARDED_FOR_HEADER] = request.remote or ""  # replaces the client's, any case
    assert worker.http is not None
    # The path and query exactly as the client sent them (encoded=True: nothing decoded,
    # nothing resolved): path_qs is decoded, and yarl then resolved an encoded "..%2f" into
    # another route, and an encoded "%3F" (path) or "%23" (query: ?room=a%23b was room "a"
    # for the worker, "a#b" for the front's pinning) into a query the front never routed by.
    url = URL("http://worker" + request.rel_url.raw_path_qs, encoded=True)
    try:
        async with worker.http.request(
            request.method,
            url,
            headers=headers,
            data=body,
            allow_redirects=False,
        ) as resp:
            payload = await resp.read()
            _name_session(session_id, resp, payload)
            out_headers = CIMultiDict(
                (k, v) for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS
            )
            return web.Response(status=resp.status, body=payload, headers=out_headers)
    except (aiohttp.ClientError, TimeoutError) as exc:
        # The worker died (or is restarting) mid-request: its sessions are gone.
        log.warning(
            "worker %d did not answer %s %s: %r",
            worker.index,
            request.method,
            request.rel_url.path,
            exc,
        )
        # Not connected at all: the worker never saw the request (see _forward_new_session).
        unreached = isinstance(exc, aiohttp.ClientConnectorError)
        raise _unavailable(_WorkerUnreachable if unreached else ApiError) from None


class _WorkerUnreachable(ApiError):
    """``worker_unavailable`` for a request that reached no worker (its connect failed)."""


def _unavailable(kind: type[ApiError]) -> ApiError:
    return kind(
        503,
        "worker_unavailable",
        "the media worker for this request is restarting",
        {"Retry-After": "2"},
    )


def _name_session(path_id: str | None, resp: aiohttp.ClientResponse, payload: bytes) -> None:
    """Name the request's session on its log lines, the access log's included, as a single
    process does (workers write no access log): the one the path names, unless the worker
    refused the request before looking (401) or knew no such session (404); or the one an
    offer created or resumed (JSON ``session_id``; a WHEP answer's ``Location``)."""
    session_id: object = None
    if path_id is not None:
        session_id = path_id if resp.status not in (401, 404) else None
    elif resp.status < 300 and resp.headers.get("Location", "").startswith("/whep/"):
        session_id = resp.headers["Location"].removeprefix("/whep/")
    elif resp.status < 300 and resp.content_type == "application/json":
        with contextlib.suppress(ValueError, RecursionError):  # a JSON error is a ValueError
            answer = json.loads(payload)
            session_id = answer.get("session_id") if isinstance(answer, dict) else None
    if isinstance(session_id, str) and session_id:
        SESSION_ID.set(session_id)


# --- one readiness and one metrics page for the whole server ---------------------------------
async def readyz(request: web.Request) -> web.Response:
    if request.app[DRAIN].draining:
        return not_ready_response(shutting_down())  # as a worker's /readyz says it
    pool = request.app[POOL]
    workers = [
        {
            "index": w.index,
            "pid": w.pid,
            "alive": w.alive,
            "ready": w.ready,
            "sessions": w.sessions,
            "restarts": w.restarts,
        }
        for w in pool.workers
    ]
    # As a single process's /readyz: the engine and the voice activity model loaded.
    ready = sum(
        1 for w in pool.workers if w.alive and w.ready and w.status.get("listening_ready", True)
    )
    # The engine's own name, as a worker reports it ("chattts", "chattts-ray", ...).
    engine = next(
        (w.status["engine"] for w in pool.workers if w.status.get("engine")),
        request.app[CONFIG].engine,
    )
    body: dict[str, Any] = {
        "ready": ready > 0,
        "engine": engine,
        "workers": workers,
        "ready_workers": ready,
    }
    if ready:
        return web.json_response(body)
    # The workers' refusal with its headers (an open breaker's Retry-After), as an offer's.
    refusal = workers_refusal(pool.workers) or ApiError(
        503, "not_ready", "no media worker is ready yet", {"Retry-After": "2"}
    )
    del body["ready"]
    return not_ready_response(refusal, **body)


async def metrics(request: web.Request) -> web.Response:
    """Every worker's metrics with a ``worker`` label, plus the front's own (its offer
    refusals labelled ``worker="front"``, in the workers' families)."""
    # Here as well as in each worker: with no worker answering (starting, restarting, all
    # dead) the front would otherwise serve its own series without the token.
    routes.check_metrics_token(request)
    pool = request.app[POOL]
    texts = await asyncio.gather(*(_scrape(request, w) for w in pool.workers))
    scraped = [(str(w.index), text) for w, text in zip(pool.workers, texts, strict=True)]
    # Through the text format, as the workers' come: one family per name, whoever has it.
    scraped.append((FRONT_LABEL, generate_latest(request.app[FRONT_METRICS]).decode()))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_MergedCollector(pool, scraped))
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def _scrape(request: web.Request, worker: Worker) -> str:
    """One worker's metrics text ("" if it cannot answer). Concurrent /metrics requests with
    the same credentials share one scrape: a burst of them (public by default) made as many
    scrapes, each rendered on the worker's loop, which also paces its media."""
    if not worker.alive or worker.scrape is None:
        return ""
    # Only a metrics token needs passing on (checked here already): without one, a made-up
    # header per request made one scrape per request again (found by review).
    has_token = request.app[CONFIG].security.metrics_token is not None
    auth = request.headers.get("Authorization") if has_token else None
    pending = worker.scrapes.get(auth)
    if pending is None:
        pending = asyncio.ensure_future(_scrape_once(worker.scrape, auth))
        worker.scrapes[auth] = pending
        pending.add_done_callback(lambda done: _forget_scrape(worker, auth, done))
    # shield: one request that gives up (its client gone) does not cancel the others' scrape
    text = await asyncio.shield(pending)
    if text is None:  # the front checked the same token: only if it differs
        raise ApiError(401, "unauthorized", routes.METRICS_UNAUTHORIZED)
    return text


def _forget_scrape(worker: Worker, auth: str | None, done: asyncio.Future[str | None]) -> None:
    if worker.scrapes.get(auth) is done:
        del worker.scrapes[auth]


async def _scrape_once(client: aiohttp.ClientSession, auth: str | None) -> str | None:
    """The worker's metrics text, "" if it cannot answer, None if it refuses the token."""
    headers = {"Authorization": auth} if auth is not None else {}
    try:
        async with client.get(
            "http://worker/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=5)
        ) as resp:
            if resp.status == 401:
                return None
            return await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, TimeoutError):
        return ""


class _MergedCollector:
    def __init__(self, pool: WorkerPool, scraped: list[tuple[str, str]]) -> None:
        """``scraped``: (``worker`` label, metrics text) pairs."""
        self._pool = pool
        self._scraped = scraped

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for worker, text in self._scraped:
            for family in text_string_to_metric_families(text):
                target = merged.get(family.name)
                if target is None:
                    target = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = target
                for sample in family.samples:
                    labels = {**sample.labels, "worker": worker}
                    target.add_sample(sample.name, labels, sample.value, sample.timestamp)
        yield from merged.values()
        alive = Metric("voice_agent_workers_alive", "Media worker processes running", "gauge")
        alive.add_sample("voice_agent_workers_alive", {}, sum(w.alive for w in self._pool.workers))
        yield alive
        restarts = Metric(
            "voice_agent_worker_restarts", "Media workers started again after dying", "counter"
        )
        restarts.add_sample(
            "voice_agent_worker_restarts_total", {}, sum(w.restarts for w in self._pool.workers)
        )
        yield restarts


# --- running ---------------------------------------------------------------------------------
def run_front(config: Config, pool: WorkerPool, prepare: Callable[[], None] | None = None) -> None:
    """Serve the front on the public address until SIGTERM/SIGINT, then shut down like a
    single process does (signaling/shutdown.py): keep listening but refuse new sessions
    (503 ``shutting_down``), let every worker drain its speech, and exit 0.

    ``prepare`` (the model's first download) runs in a thread once the front listens, and
    the workers start after it: run before, nothing listened for the whole download, where
    one process serves the page, ``/healthz`` 200 and ``/readyz`` 503 ``not_ready``."""
    asyncio.run(_serve_front(config, pool, prepare))


async def _prepared(prepare: Callable[[], None], stop: asyncio.Event) -> bool:
    """Run ``prepare`` in a daemon thread (a download cannot be cancelled: a stop signal
    must not wait for it, nor the interpreter's exit); False if ``stop`` came first."""
    outcome: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run() -> None:
        try:
            prepare()
        except Exception as exc:  # noqa: BLE001 - raised on the loop, as serve() raised it
            outcome.set_exception(exc)
        else:
            outcome.set_result(None)

    threading.Thread(target=run, name="prepare", daemon=True).start()
    done = asyncio.wrap_future(outcome)
    stopped = asyncio.ensure_future(stop.wait())
    waiting: set[asyncio.Future[Any]] = {done, stopped}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not done.done():
        return False
    done.result()
    return True


async def _serve_front(
    config: Config, pool: WorkerPool, prepare: Callable[[], None] | None = None
) -> None:
    app = build_front_app(config, pool)
    runner = web.AppRunner(app, handle_signals=False, **runner_options())
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log_listening(runner.addresses, config)
        if prepare is not None and not await _prepared(prepare, stop):
            log.info("stop signal received while preparing: stopping")
            return
        # Inside the try: a spawn failing part-way (EAGAIN, EMFILE) still stops the workers
        # it started and closes their clients, as a stop signal would.
        await pool.start()
        await stop.wait()
        log.info("stop signal received: draining the workers")
        app[DRAIN].draining = True
        # Workers get SIGTERM and drain their own sessions; the front waits for them.
        await pool.close()
    finally:
        await pool.close()
        await runner.cleanup()
    log.info("stopped")
