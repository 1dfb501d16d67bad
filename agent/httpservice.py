"""What the STT and LLM clients share: the error they raise and how they call a service."""

from __future__ import annotations

import asyncio
import codecs
import functools
import json
import logging
import urllib.request
from urllib.parse import urlsplit

import aiohttp

log = logging.getLogger(__name__)

MAX_ERROR_BODY = 300  # characters of a service's error body repeated to the client
# Bytes of an error body read to find them: enough for a JSON error and its message, and
# little enough that a proxy answering with an endless page costs nothing.
MAX_ERROR_READ = 8 << 10


class ServiceError(Exception):
    """A service call failed; ``code`` becomes the ``error`` event's code (session goes on)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def env_proxy(url: str) -> str | None:
    """The proxy ``HTTPS_PROXY``/``HTTP_PROXY`` name for ``url``, unless ``NO_PROXY`` exempts
    its host. Not aiohttp's trust_env, which also reads ~/.netrc: its logins were then sent
    to a keyless service, or clashed with the API key's header and failed every call.
    aiohttp speaks to http:// proxies only."""
    target = urlsplit(url)
    if target.hostname is None or urllib.request.proxy_bypass(target.hostname):
        return None
    proxy = urllib.request.getproxies().get(target.scheme)
    if not proxy:
        return None
    if "://" not in proxy:  # "proxy.corp:3128": http, as curl, requests and httpx take it
        proxy = "http://" + proxy
    if urlsplit(proxy).scheme.lower() != "http":
        _unusable_proxy(proxy)
        return None
    return proxy


@functools.cache  # said once per value, not at every call
def _unusable_proxy(proxy: str) -> None:
    scheme = urlsplit(proxy).scheme
    log.warning("proxy %s:// ignored (only http:// proxies are supported): going direct", scheme)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def endpoint(base_url: str, path: str) -> str:
    return base_url.rstrip("/") + path


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes of the body, and whether it had more.

    Not ``read()``, ``text()`` or ``json()``: they buffer the whole body, so a service or
    proxy sending a huge or endless one would have the server take it in as fast as it
    comes until the timeout. Past the limit the response is closed: the sender is cut off,
    not drained. Memory stays under ``limit`` and one 64 KiB chunk."""
    body = bytearray()
    while chunk := await response.content.read(min(65536, limit + 1 - len(body))):
        body += chunk
        if len(body) > limit:
            response.close()
            return bytes(body[:limit]), True
    return bytes(body), False


async def describe_failure(response: aiohttp.ClientResponse, timeout_s: float) -> str:
    """``HTTP 401: <the service's error message>`` (never the request, so never a key).

    Reading the body is bounded by ``timeout_s``: a service that stalls or cuts its error
    body is still reported as the failure it is, not waited for or turned into another."""
    try:
        async with asyncio.timeout(timeout_s):
            # Only the start is reported: a longer body is cut (then not JSON: shown as text).
            raw, _ = await read_capped(response, MAX_ERROR_READ)
    except (TimeoutError, aiohttp.ClientError):
        return f"HTTP {response.status} (its error body could not be read)"
    text = decode_text(raw, response.charset)
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


def is_text_charset(charset: str) -> bool:
    """Whether ``bytes.decode`` can take ``charset``. LookupError is an unknown name;
    ValueError a name no codec can have (RFC 2231's ``charset*=utf-8''utf%00`` arrives as
    "utf\\x00" and codecs refuse a NUL); base64 or hex are codecs but not text encodings."""
    try:
        return codecs.lookup(charset)._is_text_encoding
    except (LookupError, ValueError):
        return False


def decode_text(body: bytes, charset: str | None) -> str:
    """``body`` in the charset its Content-Type declares (UTF-8 when none), as aiohttp's
    ``text()`` decodes it; one no text codec has is read as UTF-8 rather than fail a reply
    over its label."""
    return body.decode(
        charset if charset is not None and is_text_charset(charset) else "utf-8",
        errors="replace",
    )
