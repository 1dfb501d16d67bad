"""Session tokens: what a client that lost its connection shows to come back to its session.

A token is 32 random bytes (``secrets.token_urlsafe``): opaque, unguessable, valid while its
session lives (it does not change on resume, so a resume whose answer got lost can be tried
again). Only SHA-256 digests are kept, so a lookup's timing says nothing about other
tokens. Tokens of ended sessions are remembered (bounded) to tell "expired" from "unknown".
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict

from signaling.errors import ApiError

MAX_TOKEN_CHARS = 256
MAX_EXPIRED = 10_000  # ended sessions remembered for session_expired; older ones: unknown


def new_token() -> str:
    return secrets.token_urlsafe(32)


def checked_token(token: object) -> str:
    """``token`` if it could be a session token, else 400 ``bad_token`` (the front checks it
    before routing, as a worker's TokenBook would)."""
    if not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN_CHARS:
        raise ApiError(
            400, "bad_token", f"'resume' must be a session token (1-{MAX_TOKEN_CHARS} chars)"
        )
    return token


def _digest(token: str) -> bytes:
    # surrogatepass: JSON may carry lone surrogates; they must not become a 500.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class TokenBook:
    def __init__(self) -> None:
        self._live: dict[bytes, str] = {}  # digest -> session id
        self._ended: OrderedDict[bytes, None] = OrderedDict()

    def add(self, token: str, session_id: str) -> None:
        self._live[_digest(token)] = session_id

    def end(self, token: str) -> None:
        digest = _digest(token)
        if self._live.pop(digest, None) is None:
            return
        self._ended[digest] = None
        while len(self._ended) > MAX_EXPIRED:
            self._ended.popitem(last=False)

    def session_id(self, token: object) -> str:
        """The live session ``token`` belongs to, or a 4xx saying why there is none."""
        digest = _digest(checked_token(token))
        session_id = self._live.get(digest)
        if session_id is not None:
            return session_id
        if digest in self._ended:
            raise session_expired()
        raise ApiError(404, "unknown_session", "no session has this token")


def session_expired() -> ApiError:
    """410 for a token whose session has ended (also: ended while its resume negotiated)."""
    return ApiError(
        410,
        "session_expired",
        "this session has ended (closed, or not resumed within its grace period)",
    )
