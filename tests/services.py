"""Test doubles for the STT and LLM services: real aiohttp HTTP servers on localhost.

``FakeSTT`` answers ``POST /v1/audio/transcriptions`` (multipart, like OpenAI's) with a
scripted transcript and keeps every upload; ``FakeLLM`` answers
``POST /v1/chat/completions`` with ``stream: true`` as server-sent events, one token per
``token_delay_s``, and keeps every request body. Both can be told to fail or stall.
"""

from __future__ import annotations

import asyncio
import io
import json
import wave
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Upload:
    wav: bytes
    fields: dict[str, str]
    authorization: str | None

    def duration_s(self) -> float:
        with wave.open(io.BytesIO(self.wav)) as w:
            return w.getnframes() / w.getframerate()


class _Server:
    def __init__(self) -> None:
        self.url = ""
        self._runner: web.AppRunner | None = None

    def _app(self) -> web.Application:
        raise NotImplementedError

    async def __aenter__(self) -> _Server:
        self._runner = web.AppRunner(self._app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@dataclass
class FakeSTT(_Server):
    transcripts: deque[str] = field(default_factory=deque)  # answered in order, then default
    default: str = "hello"
    status: int = 200  # answer with this status (an error body unless 200)
    stall_s: float = 0.0  # wait this long before answering
    uploads: list[Upload] = field(default_factory=list)

    def __post_init__(self) -> None:
        _Server.__init__(self)

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/audio/transcriptions", self._transcribe)
        return app

    async def _transcribe(self, request: web.Request) -> web.Response:
        reader = await request.multipart()
        wav = b""
        fields: dict[str, str] = {}
        async for part in reader:
            if part.name == "file":  # type: ignore[union-attr]
                wav = await part.read()  # type: ignore[union-attr]
            else:
                fields[part.name or ""] = await part.text()  # type: ignore[union-attr]
        self.uploads.append(Upload(wav, fields, request.headers.get("Authorization")))
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        if self.status != 200:
            return web.json_response(
                {"error": {"message": "model overloaded", "type": "server_error"}},
                status=self.status,
            )
        text = self.transcripts.popleft() if self.transcripts else self.default
        return web.json_response({"text": text})


@dataclass
class FakeLLM(_Server):
    replies: deque[list[str]] = field(default_factory=deque)  # token lists, in order
    default: list[str] = field(default_factory=lambda: ["Hi", " there", "."])
    token_delay_s: float = 0.0
    first_token_delay_s: float = 0.0
    status: int = 200
    requests: list[dict[str, Any]] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    finished: int = 0  # streams sent to the end
    abandoned: int = 0  # streams whose client closed the connection before their end
    # Refuse, as the chat templates of Llama 2, Mistral or Gemma do, messages whose roles do
    # not alternate user/assistant starting with the user's (after an optional system one).
    strict_roles: bool = False
    # Refuse "max_tokens" as OpenAI's reasoning models do (o1, o3, gpt-5...).
    refuses_max_tokens: bool = False

    def __post_init__(self) -> None:
        _Server.__init__(self)

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        return app

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.authorizations.append(request.headers.get("Authorization"))
        if self.status != 200:
            return web.json_response(
                {"error": {"message": "rate limit reached"}}, status=self.status
            )
        assert body.get("stream") is True, body
        if self.refuses_max_tokens and "max_tokens" in body:
            message = (
                "Unsupported parameter: 'max_tokens' is not supported with this model. "
                "Use 'max_completion_tokens' instead."
            )
            error = {"message": message, "type": "invalid_request_error", "param": "max_tokens"}
            return web.json_response({"error": error}, status=400)
        roles = [m["role"] for m in body["messages"] if m["role"] != "system"]
        if self.strict_roles and roles != ["user", "assistant"] * (len(roles) // 2) + (
            ["user"] if len(roles) % 2 else []
        ):
            message = "Conversation roles must alternate user/assistant/user/assistant/..."
            return web.json_response({"error": {"message": message}}, status=400)
        tokens = self.replies.popleft() if self.replies else self.default
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await self._stream(response, tokens)
        except (ConnectionResetError, asyncio.CancelledError):
            self.abandoned += 1  # a write found the connection closed (or aiohttp cancelled)
            raise
        return response

    async def _stream(self, response: web.StreamResponse, tokens: list[str]) -> None:
        await response.write(b": keep-alive\n\n")
        if self.first_token_delay_s:
            await asyncio.sleep(self.first_token_delay_s)
        for i, token in enumerate(tokens):
            if i and self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            chunk = {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": token}, "finish_reason": None}],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await response.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())
        self.finished += 1
        await response.write_eof()
