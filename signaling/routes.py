"""HTTP routes: JSON offer, WHEP, sessions, health, static client."""

from __future__ import annotations

import hmac
import json
import math
from functools import partial
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from agent.config import ROOM_NAME_RULE, is_room_name
from agent.engine import TTSEngine
from agent.hooks import SessionHooks
from agent.httpservice import is_text_charset
from agent.room import RoomMember
from agent.speech import SpeechError
from signaling.auth import claims, require_room, require_speaker, room_for
from signaling.errors import ApiError, Handler, not_ready_response, read_body
from signaling.keys import BREAKER, CONFIG, DRAIN, ENGINE, ENGINE_ERROR, LIMITS, METRICS, SESSIONS
from signaling.metrics import RESUMING
from signaling.sessions import Peer, SessionRegistry
from signaling.shutdown import shutting_down

MAX_NAME_CHARS = 64
# WHEP answers carry the session token here; a WHEP resume sends it back in the same header.
SESSION_TOKEN_HEADER = "X-Session-Token"


async def _body_text(request: web.Request) -> str:
    """The body decoded with its Content-Type charset (UTF-8 when none is given): 415 for a
    charset Python has no text codec for. UnicodeError (bytes not in the charset) is the
    caller's to report. Every text body (/offer, /say, WHEP) is read here, so the three
    answer an unusable charset alike."""
    charset = request.charset or "utf-8"
    # Checked before decoding so that nothing but UnicodeError can come out of it.
    if not is_text_charset(charset):
        raise ApiError(
            415, "unsupported_media_type", f"unknown charset {charset[:40]!r}: send UTF-8"
        )
    return (await read_body(request)).decode(charset)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await _body_text(request))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise ApiError(400, "bad_json", "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_json", "request body must be a JSON object")
    return body


def _check_room(room: object) -> str | None:
    if room is None or is_room_name(room):
        return room
    raise ApiError(400, "bad_room", f"'room' must be a string of {ROOM_NAME_RULE}")


def _check_name(name: object) -> str | None:
    """A room participant's display name (optional)."""
    if name is not None and (not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS):
        raise ApiError(400, "bad_name", f"'name' must be a string of 1-{MAX_NAME_CHARS} characters")
    return name


def _sessions(request: web.Request) -> SessionRegistry:
    return request.app[SESSIONS]


def _new_sessions(request: web.Request) -> SessionRegistry:
    """The registry for a new session: 503 with the reason if the engine failed to load."""
    refusal = new_session_refusal(request.app)
    if refusal is not None:
        raise refusal
    return _sessions(request)


def new_session_refusal(app: web.Application) -> ApiError | None:
    """The 503 a new session gets now, whatever its offer (None: it would be admitted):
    shutting down, the engine failed, or its circuit breaker is open. A worker's status
    carries it (signaling/app.py), so that the front answers with the workers' reason."""
    if app[DRAIN].draining:
        return shutting_down()
    failure = _engine_failure(app)
    if failure:
        return ApiError(503, "engine_failed", failure)
    return _breaker_refusal(app)


def _check_breaker(request: web.Request) -> None:
    """503 ``tts_unavailable`` while the engine's circuit breaker is open."""
    refusal = _breaker_refusal(request.app)
    if refusal is not None:
        raise refusal


def _breaker_refusal(app: web.Application) -> ApiError | None:
    breaker = app[BREAKER]
    reason = breaker.unavailable
    if reason is None:
        return None
    retry = str(max(1, math.ceil(breaker.retry_after_s)))
    return ApiError(503, "tts_unavailable", reason, {"Retry-After": retry})


def takes_new_sessions(app: web.Application) -> bool:
    """Whether an offer would get a new session now: the engine loaded and working, its
    circuit breaker closed, no shutdown begun (what /readyz says, but for the voice activity
    model: offers are answered while it loads). A worker's status reports it: the front
    routes new sessions only to workers that take them."""
    return app[ENGINE].ready and new_session_refusal(app) is None


def _engine_failure(app: web.Application) -> str | None:
    """Why the engine cannot speak: it failed to load, or failed after it started."""
    load_error = app[ENGINE_ERROR]
    if load_error:
        return f"the speech engine failed to load: {load_error[0]}"
    failure = app[ENGINE].failure
    return f"the speech engine failed: {failure}" if failure else None


def _session_hooks(request: web.Request) -> SessionHooks:
    """A new session's speech requests share the rate limit of the address that made it."""
    return SessionHooks(
        admit_speech=partial(request.app[LIMITS].admit_speech, request.remote),
        first_audio=request.app[METRICS].first_audio.observe,
    )


def _peer(request: web.Request) -> Peer:
    """The session named in the path, if this request's token may control it."""
    peer = _sessions(request).get(request.match_info["session_id"])
    require_room(request, peer.room)
    return peer


async def post_offer(request: web.Request) -> web.Response:
    require_speaker(request)  # an offer opens a data channel: speech requests
    with request.app[LIMITS].offer(request.remote):
        return await _answer_offer(request)


async def _answer_offer(request: web.Request) -> web.Response:
    body = await _json_body(request)
    if body.get("type") != "offer":
        raise ApiError(400, "not_an_offer", "'type' must be \"offer\"")
    if "resume" in body:
        peer = _resumable(request, body["resume"], "offer")
        answer = await _sessions(request).resume(peer, body.get("sdp"), request.remote)
        return _offer_answer(peer, answer)
    room = room_for(request, _check_room(body.get("room")))
    name = _check_name(body.get("name"))
    peer, answer = await _new_sessions(request).create(
        body.get("sdp"),
        "offer",
        room,
        request.remote,
        role=claims(request).role,
        hooks=_session_hooks(request),
        name=name,
    )
    return _offer_answer(peer, answer)


def _offer_answer(peer: Peer, answer: str) -> web.Response:
    reply = {
        "sdp": answer,
        "type": "answer",
        "session_id": peer.session.id,
        "session_token": peer.token,
    }
    if isinstance(peer.session, RoomMember):
        reply["participant_id"] = peer.session.participant_id
    return web.json_response(reply)


def _resumable(request: web.Request, token: object, kind: str) -> Peer:
    """The session a resume names, if this request may take it over."""
    request[RESUMING] = True  # counted apart from new sessions, whatever the outcome
    request.app[DRAIN].check()
    peer = _sessions(request).by_token(token)
    require_room(request, peer.room)
    if peer.kind != kind:
        raise ApiError(400, "wrong_kind", f"this token belongs to a {peer.kind} session")
    if claims(request).role == "listener" and peer.role != "listener":
        # The session keeps the role it was made with: a listener's JWT resuming a
        # speaker's WHEP session would get its microphone listened to (found by review).
        raise ApiError(403, "forbidden", "a listener token may not resume a speaker's session")
    if isinstance(peer.session, RoomMember):
        # A room seat is left when its connection is lost: join the room again instead.
        raise ApiError(400, "not_resumable", "room participants rejoin the room instead")
    return peer


async def post_whep(request: web.Request) -> web.Response:
    if request.content_type != "application/sdp":
        raise ApiError(415, "unsupported_media_type", "WHEP offers are 'application/sdp'")
    with request.app[LIMITS].offer(request.remote):
        return await _answer_whep(request)


async def _answer_whep(request: web.Request) -> web.Response:
    try:
        sdp = await _body_text(request)
    except UnicodeError:  # bytes not in the charset (or a codec that decodes nothing)
        raise ApiError(400, "bad_sdp", "SDP must be UTF-8 text") from None
    if SESSION_TOKEN_HEADER in request.headers:
        peer = _resumable(request, request.headers[SESSION_TOKEN_HEADER], "whep")
        answer = await _sessions(request).resume(peer, sdp, request.remote)
        return _whep_answer(peer, answer)
    room = room_for(request, _check_room(request.query.get("room")))
    peer, answer = await _new_sessions(request).create(
        sdp,
        "whep",
        room,
        request.remote,
        role=claims(request).role,
        hooks=_session_hooks(request),
    )
    return _whep_answer(peer, answer)


def _whep_answer(peer: Peer, answer: str) -> web.Response:
    location = f"/whep/{peer.session.id}"
    return web.Response(
        status=201,
        text=answer,
        content_type="application/sdp",
        headers={
            "Location": location,
            "ETag": f'"{peer.session.id}"',
            SESSION_TOKEN_HEADER: peer.token,
        },
    )


async def delete_whep(request: web.Request) -> web.Response:
    return await _delete(request)


async def delete_session(request: web.Request) -> web.Response:
    return await _delete(request)


async def _delete(request: web.Request) -> web.Response:
    peer = _peer(request)  # 404 for an unknown id, 403 for another room's
    await _sessions(request).close(peer.session.id)
    return web.Response(status=204)


async def post_say(request: web.Request) -> web.Response:
    peer = _peer(request)
    require_speaker(request)
    # Both the session's participant and the caller: a speaker's token that learnt a
    # host's session id must not instruct the agent of a hosts-only room through it.
    if isinstance(peer.session, RoomMember) and not (
        peer.session.may_instruct
        and (peer.session.room.settings.instruct == "everyone" or claims(request).role == "host")
    ):
        raise ApiError(403, "forbidden", "only hosts may instruct the agent in this room")
    request.app[LIMITS].check_speech(request.remote)
    body = await _json_body(request)
    peer.life.active()
    _check_breaker(request)
    utterance_id = body.get("id")
    try:
        utt = peer.session.pipeline.say(body.get("text"), utterance_id)  # type: ignore[arg-type]
    except SpeechError as exc:
        status = 429 if exc.code == "queue_full" else 400
        raise ApiError(status, exc.code, exc.message) from None
    return web.json_response({"id": utt}, status=202)


async def get_session(request: web.Request) -> web.Response:
    peer = _peer(request)
    return web.json_response(
        {
            **peer.session.stats(),
            "kind": peer.kind,
            "room": peer.room,
            "role": peer.role,
            "connection": peer.pc.connectionState,
            "detached": peer.life.detached_at is not None,  # lost, waiting for a resume
        }
    )


async def ice_servers(request: web.Request) -> web.Response:
    """The ICE servers the browser should use (the same list the server uses), and how many
    speaker slots a room page should offer (``--room-max-speakers``): a page offering fewer
    never heard the higher slots' speakers (found by review)."""
    config = request.app[CONFIG]
    servers = []
    for url in config.ice_servers:
        server: dict[str, str] = {"urls": url}
        if url.startswith(("turn:", "turns:")) and config.ice_username:
            server["username"] = config.ice_username
            server["credential"] = config.ice_credential or ""
        servers.append(server)
    return web.json_response({"iceServers": servers, "roomSlots": config.rooms.max_speakers})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    engine: TTSEngine = request.app[ENGINE]
    refusal = _readiness_refusal(request.app, engine)
    if refusal is None:
        return web.json_response({"ready": True, "engine": engine.name})
    return not_ready_response(refusal, engine=engine.name)


def _readiness_refusal(app: web.Application, engine: TTSEngine) -> ApiError | None:
    """Why the server is not ready, as an offer would be refused (Retry-After included,
    README: a balancer can wait that long before asking again); None: ready."""
    if app[DRAIN].draining:
        return shutting_down()
    refusal = _breaker_refusal(app)
    if engine.ready and refusal is not None:
        return refusal  # when the breaker's next probe runs
    if engine.ready and not app[SESSIONS].listening_ready:
        # Offers are answered already; ready waits because the load stalls the loop a while.
        return ApiError(503, "not_ready", "loading the voice activity model", {"Retry-After": "2"})
    if engine.ready:
        return None
    failure = _engine_failure(app)
    if failure:
        return ApiError(503, "engine_failed", failure)
    return ApiError(503, "not_ready", "loading the model", {"Retry-After": "5"})  # as an offer


METRICS_UNAUTHORIZED = "/metrics needs 'Authorization: Bearer <metrics token>'"


def check_metrics_token(request: web.Request) -> None:
    """With a metrics token configured, 401 unless the request bears it. The front process
    checks it too (signaling/front.py), not only its workers: with none answering it would
    otherwise serve its own series to anyone."""
    expected = request.app[CONFIG].security.metrics_token
    if expected is not None:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            # surrogatepass: a header's non-UTF-8 bytes arrive as lone surrogates.
            given.strip().encode("utf-8", "surrogatepass"),
            expected.encode("utf-8", "surrogatepass"),
        ):
            raise ApiError(401, "unauthorized", METRICS_UNAUTHORIZED)


async def get_metrics(request: web.Request) -> web.Response:
    """Prometheus text format; with a metrics token configured, only for its bearer."""
    check_metrics_token(request)
    return web.Response(
        body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(request.app[CONFIG].static_dir / "index.html")


async def static_file(request: web.Request) -> web.FileResponse:
    """A file of the browser client (flat folder; the name pattern rules out traversal)."""
    path = request.app[CONFIG].static_dir / request.match_info["name"]
    if not path.is_file():
        raise ApiError(404, "not_found", f"no such file {request.match_info['name'][:64]!r}")
    return web.FileResponse(path)


# Open even with authentication on: probes, the page that asks for a token, and /metrics
# (which has its own token option).
PUBLIC_HANDLERS: frozenset[Handler] = frozenset({healthz, readyz, index, static_file, get_metrics})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/offer", post_offer)
    app.router.add_post("/whep", post_whep)
    app.router.add_delete("/whep/{session_id}", delete_whep)
    app.router.add_delete("/sessions/{session_id}", delete_session)
    app.router.add_get("/sessions/{session_id}", get_session)
    app.router.add_post("/sessions/{session_id}/say", post_say)
    app.router.add_get("/ice-servers", ice_servers)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/", index)
    # The client's relative links (app.js, style.css) resolve at the root; /static/ also works.
    name = r"{name:[A-Za-z0-9_-]+\.[A-Za-z0-9]+}"
    app.router.add_get("/" + name, static_file)
    app.router.add_get("/static/" + name, static_file)
