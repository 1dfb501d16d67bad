"""CORS for an allow-list of web origins; without one, the API is same-origin only.

Only listed origins get ``Access-Control-Allow-Origin`` (their own origin echoed, never
``*``), on every answer including errors, so a page on that origin can read the JSON
error body. A preflight (OPTIONS with ``Access-Control-Request-Method``) from a listed
origin is answered 204; from any other origin 403 ``forbidden``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiohttp import web

from signaling.errors import Handler, error_response

# PATCH: no route takes it, but WHEP's ETag invites a player to PATCH (trickle ICE, ICE
# restart); allowed here, its request reaches the server, whose 405 (with Allow) the player
# can read. Refused by the preflight, it was a network error the player may take as fatal.
ALLOW_METHODS = "GET, POST, DELETE, PATCH, OPTIONS"
# X-Session-Token (signaling/routes.py SESSION_TOKEN_HEADER): a WHEP resume sends it.
# If-Match: a WHEP player's ICE-restart PATCH must carry it (RFC 9725 4.3); not allowed, the
# preflight failed the PATCH as a network error after all (found by review).
ALLOW_HEADERS = "Authorization, Content-Type, X-Session-Token, If-Match, If-None-Match"
# Headers a cross-origin page may read: WHEP's Location, ETag and session token (for a
# resume), and the back-off hint.
EXPOSE_HEADERS = "Location, ETag, X-Session-Token, Retry-After"
PREFLIGHT_MAX_AGE_S = 600


def make_cors_middleware(origins: Iterable[str]) -> Any:
    allowed = frozenset(origin.rstrip("/") for origin in origins)

    @web.middleware
    async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        preflight = (
            request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
        )
        response: web.StreamResponse
        if origin is not None and preflight:
            if origin not in allowed:
                return error_response(403, "forbidden", "this origin may not call the API")
            response = web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Methods": ALLOW_METHODS,
                    "Access-Control-Allow-Headers": ALLOW_HEADERS,
                    "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
                },
            )
        else:
            response = await handler(request)
        if origin is not None and origin in allowed:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
        if allowed and not _varies_on_origin(response):
            # Caches must not hand one origin's answer to another. (A worker's answer that
            # the front forwards says so already: once is enough.)
            response.headers.add("Vary", "Origin")
        return response

    return cors_middleware


def _varies_on_origin(response: web.StreamResponse) -> bool:
    return any(
        name.strip().lower() == "origin"
        for value in response.headers.getall("Vary", [])
        for name in value.split(",")
    )
