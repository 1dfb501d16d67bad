"""JSON error bodies for every failure: ``{"error": {"code", "message"}}``, never a traceback."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def not_ready_response(refusal: ApiError, **fields: Any) -> web.Response:
    """A /readyz answer refusing readiness: ``{"ready": false, **fields, "error"}``, with
    the refusal's status and headers (its Retry-After, as the same refusal of an offer)."""
    error = {"code": refusal.code, "message": refusal.message}
    return web.json_response(
        {"ready": False, **fields, "error": error},
        status=refusal.status,
        headers=refusal.headers,
    )


async def read_body(request: web.Request) -> bytes:
    """The request body (cached: a second read is free), or 400 ``bad_body`` when it cannot
    be read: bytes that are not in its Content-Encoding (aiohttp decompresses as it reads:
    RequestPayloadError), or a client that left before sending all of it
    (ConnectionResetError). Either was a 500 and an error traceback in the log, for what a
    client did: every read of a body goes through here. A body over the size limit stays
    aiohttp's 413."""
    try:
        return await request.read()
    except (RequestPayloadError, ConnectionResetError):
        raise ApiError(
            400,
            "bad_body",
            "the request body could not be read (not in its Content-Encoding, or cut short)",
        ) from None


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(
        {"error": {"code": code, "message": message}}, status=status, headers=headers
    )


HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    415: "unsupported_media_type",
}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await _answer(request, handler)
    if request.body_exists and request.content.exception() is not None:
        # A body that could not be read (not in its Content-Encoding) and was refused
        # unread: aiohttp reads what is left after the answer, to keep the connection,
        # and the error then escaped its server loop as an ERROR "Unhandled exception" with
        # a traceback, which any client could repeat at will. The body is over (nothing
        # more of it can be read) and the connection closes after the answer.
        request.content.feed_eof()
        response.force_close()
    return response


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.code, exc.message, exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = HTTP_CODES.get(exc.status, "http_error")
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(exc.status, code, exc.reason, allow)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal", "internal server error")
