"""What the STT and LLM clients share: the error they raise and how they call a service."""

from __future__ import annotations

import asyncio
import json

import aiohttp

MAX_ERROR_BODY = 300  # characters of a service's error body repeated to the client


class ServiceError(Exception):
    """A service call failed; ``code`` becomes the ``error`` event's code (session goes on)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def endpoint(base_url: str, path: str) -> str:
    return base_url.rstrip("/") + path


async def describe_failure(response: aiohttp.ClientResponse, timeout_s: float) -> str:
    """``HTTP 401: <the service's error message>`` (never the request, so never a key).

    Reading the body is bounded by ``timeout_s``: a service that stalls or cuts its error
    body is still reported as the failure it is, not waited for or turned into another."""
    try:
        async with asyncio.timeout(timeout_s):
            text = await response.text(errors="replace")
    except (TimeoutError, aiohttp.ClientError):
        return f"HTTP {response.status} (its error body could not be read)"
    detail = text[:MAX_ERROR_BODY]
    try:
        body = json.loads(text)
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            detail = error["message"][:MAX_ERROR_BODY]
        elif isinstance(error, str):
            detail = error[:MAX_ERROR_BODY]
    except (ValueError, RecursionError):  # not JSON, or nested too deep to parse
        pass
    return f"HTTP {response.status}: {detail}".strip()
