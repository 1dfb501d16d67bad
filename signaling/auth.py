"""Bearer tokens: HS256 JWTs with ``exp`` and optional ``room`` and ``role`` claims.

With a secret configured every signaling request needs a token, from the ``Authorization:
Bearer`` header or, for browsers (which cannot set headers on every request they make), a
``token`` query parameter or a ``token`` field of a JSON body. Health checks, the static
client and /metrics (which has its own optional token) stay open.

Tokens and the secret are never logged: error messages only say what was wrong.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import jwt
from aiohttp import web

from agent.config import ROLES, ROOM_NAME_RULE, is_room_name
from agent.httpservice import is_text_charset
from signaling.errors import ApiError, Handler, read_body

ALGORITHM = "HS256"
DEFAULT_ROLE = "speaker"


@dataclass(frozen=True)
class Claims:
    """What a verified token allows. ``room`` None: any room."""

    role: str = DEFAULT_ROLE
    room: str | None = None


CLAIMS = web.RequestKey("claims", Claims)
# Requests without authentication enforcement (a configured secret changes nothing for them).
ANONYMOUS = Claims(role="host")


def mint_token(secret: str, *, ttl_s: int, room: str | None = None, role: str | None = None) -> str:
    if ttl_s <= 0:
        raise ValueError("the token lifetime must be positive")
    if role is not None and role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    if room is not None and not is_room_name(room):
        # verify_token would refuse it: minting it only hands out a token that never works.
        raise ValueError(f"the room must be {ROOM_NAME_RULE}")
    now = int(time.time())
    payload: dict[str, Any] = {"iat": now, "exp": now + ttl_s}
    if room is not None:
        payload["room"] = room
    if role is not None:
        payload["role"] = role
    return jwt.encode(payload, secret, algorithm=ALGORITHM)


def verify_token(token: str | None, secret: str) -> Claims:
    """The token's claims, or ApiError 401 ``unauthorized`` saying missing/expired/invalid."""
    if not token:
        raise _unauthorized("a token is required (Authorization: Bearer, or 'token')")
    try:
        # iat is not checked: it only says when the token was made, and a token minted on a
        # host whose clock runs a second ahead was refused as "invalid" until then, i.e.
        # always when a page fetches one and uses it at once (found by review).
        payload = jwt.decode(
            token,
            secret,
            algorithms=[ALGORITHM],
            options={"require": ["exp"], "verify_iat": False},
        )
    except jwt.ExpiredSignatureError:
        raise _unauthorized("the token has expired") from None
    except jwt.ImmatureSignatureError:
        raise _unauthorized("the token is not valid yet ('nbf'; check the clocks)") from None
    except jwt.MissingRequiredClaimError:
        raise _unauthorized("the token is invalid: it has no 'exp' claim") from None
    except (jwt.InvalidTokenError, UnicodeError):
        # The library's message may quote token parts; ours does not. UnicodeError: PyJWT
        # encodes the token as UTF-8 first, and a lone surrogate (from JSON's "\ud800", or
        # a header's non-UTF-8 bytes) cannot be.
        raise _unauthorized("the token is invalid (bad signature or format)") from None
    role = payload.get("role", DEFAULT_ROLE)
    room = payload.get("room")
    if role not in ROLES:
        raise _unauthorized(f"the token is invalid: 'role' must be one of {', '.join(ROLES)}")
    # Present, the claim must name a room: {"room": null} (a backend whose room variable was
    # unset) was a token for every room, failing open (found by review).
    if "room" in payload and not is_room_name(room):
        # A room the API itself refuses to name ('', too long, a newline in it) would
        # otherwise be joined silently: room_for takes the token's room as it is.
        raise _unauthorized(f"the token is invalid: 'room' must be a string of {ROOM_NAME_RULE}")
    return Claims(role=role, room=room)


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})


async def request_token(request: web.Request) -> str | None:
    """The bearer token from the header, the ``token`` query parameter or a JSON body."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    if "token" in request.query:
        return request.query["token"]
    # Any body but WHEP's SDP: the JSON handlers parse a body whatever its Content-Type
    # (fetch() with a string body sends text/plain), and a token in it was unseen: 401.
    if request.content_type != "application/sdp" and request.body_exists:
        # The body is cached: the handler reads it again. Bad JSON is the handler's error to
        # report to an authenticated caller; here it only means "no token". Decoded in its
        # Content-Type's charset, as the handler decodes it (signaling/routes.py
        # _body_text): read as UTF-8, a Latin-1 body ("Zoë") was no JSON, its token unseen.
        charset = request.charset or "utf-8"
        if not is_text_charset(charset):
            return None  # no text: the handler's 415, once authenticated
        try:
            body = json.loads((await read_body(request)).decode(charset))
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return None
        token = body.get("token") if isinstance(body, dict) else None
        return token if isinstance(token, str) else None
    return None


def make_auth_middleware(secret: str | None, public: frozenset[Handler]) -> Any:
    """Checks every matched route except the ``public`` handlers; stores the claims."""

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        route_handler = request.match_info.handler
        if secret is None or route_handler in public or request.match_info.http_exception:
            request[CLAIMS] = ANONYMOUS
            return await handler(request)
        request[CLAIMS] = verify_token(await request_token(request), secret)
        return await handler(request)

    return auth_middleware


def claims(request: web.Request) -> Claims:
    found: Claims = request.get(CLAIMS, ANONYMOUS)
    return found


def room_for(request: web.Request, requested: str | None) -> str | None:
    """The room a new session joins: the token's room, which a request may only repeat."""
    token_room = claims(request).room
    if token_room is None:
        return requested
    if requested is not None and requested != token_room:
        raise ApiError(403, "forbidden", "the token is not valid for this room")
    return token_room


def require_room(request: web.Request, session_room: str | None) -> None:
    """A token bound to a room controls only sessions in that room."""
    token_room = claims(request).room
    if token_room is not None and token_room != session_room:
        raise ApiError(403, "forbidden", "the token is not valid for this session's room")


def require_speaker(request: web.Request) -> None:
    """Listener tokens receive audio only (WHEP): no data channel, no speech requests."""
    if claims(request).role == "listener":
        raise ApiError(403, "forbidden", "a listener token may only receive audio (use WHEP)")
