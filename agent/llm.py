"""An OpenAI-compatible ``POST {base}/chat/completions`` client with ``stream: true``.

Server-sent events are parsed as they arrive (``agent.sse``); each event's
``choices[0].delta.content`` is yielded at once, so the speech pipeline can speak the first
sentence while the model is still writing. A timeout applies to the wait for every event
(the first included, counted from the request: the response's headers are part of that wait;
keep-alive comments do not count), so a stalled stream fails instead of hanging the turn.
A server that ignores ``stream`` and answers ``application/json`` has its whole completion
spoken.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp

from agent.conversation_config import ServiceSettings
from agent.httpservice import (
    ServiceError,
    auth_headers,
    describe_failure,
    endpoint,
    env_proxy,
    read_capped,
)
from agent.sse import SSEError, SSEParser

log = logging.getLogger(__name__)

Message = dict[str, str]
# A line, an event's data or a whole answer larger than this is no chat completion.
MAX_SSE_LINE = 1 << 20
MAX_SSE_EVENT = 1 << 20
# After [DONE]: how long, and how much, to read for the body's end before letting go.
FINISH_BODY_S = 0.1
FINISH_BODY_BYTES = 1 << 16


class ChatCompletions:
    def __init__(self, settings: ServiceSettings, http: aiohttp.ClientSession) -> None:
        if not settings.llm_base_url:
            raise ValueError("no LLM base URL")
        self._url = endpoint(settings.llm_base_url, "/chat/completions")
        self._settings = settings
        self._http = http
        # OpenAI's reasoning models (o1, o3, gpt-5...) refuse "max_tokens" for
        # "max_completion_tokens", which many OpenAI-compatible servers do not know yet:
        # the old name first, the new one from the first refusal that names it.
        self._token_limit_field = "max_tokens"

    async def stream(self, messages: list[Message]) -> AsyncGenerator[str, None]:
        s = self._settings
        loop = asyncio.get_running_loop()
        while True:
            body = {
                "model": s.llm_model,
                "messages": messages,
                "stream": True,
                self._token_limit_field: s.llm_max_tokens,
            }
            # The first event is due one timeout after the request, not after the headers:
            # each wait with a whole timeout of its own let a slow server hold the turn for two.
            deadline = loop.time() + s.llm_timeout_s
            response = await self._post(body, deadline)
            if response.status == 200:
                break
            async with response:
                detail = await describe_failure(response, s.llm_timeout_s)
            if (
                response.status == 400
                and self._token_limit_field == "max_tokens"
                and _wants_max_completion_tokens(detail)
            ):
                log.info("the LLM wants max_completion_tokens for max_tokens: asking again")
                self._token_limit_field = "max_completion_tokens"
                continue
            raise ServiceError("llm_failed", f"the LLM failed: {detail}")
        async with response:
            if response.content_type == "application/json":
                # A server that ignores "stream": true answers with one whole completion.
                answer = await _whole_answer(response, deadline, s.llm_timeout_s)
                if answer:
                    yield answer
                return
            # Only events count as progress: an upstream that sends ': keep-alive' comments
            # while it queues must still time out.
            parser = SSEParser(MAX_SSE_LINE, MAX_SSE_EVENT)
            events = 0
            while True:
                try:
                    # timeout_at, not wait_for: on 3.11 wait_for(read, 0) cancels the read
                    # before it runs, even with the stream's next bytes already buffered.
                    async with asyncio.timeout_at(deadline):
                        chunk = await response.content.read(65536)
                    data = parser.feed(chunk) if chunk else parser.close()
                except TimeoutError:
                    raise _timeout(s.llm_timeout_s) from None
                except SSEError as exc:
                    raise ServiceError(
                        "llm_failed", f"the LLM sent an oversized event: {exc}"
                    ) from None
                except aiohttp.ClientError as exc:
                    raise ServiceError("llm_failed", f"the LLM stream broke: {exc}") from None
                for event in data:
                    if event.type == "error":
                        # After its 200 headers (llama.cpp: a prompt past the context size,
                        # then its usual [DONE]): ending there read as a whole answer, or
                        # none (llm_empty), with the server's reason lost (found by review).
                        raise ServiceError(
                            "llm_failed", f"the LLM reported an error: {_error_text(event.data)}"
                        )
                    if event.data.strip() == "[DONE]":
                        await _finish_body(response)
                        return
                    if event.data:  # an empty 'data:' is no chunk (some servers' keep-alive)
                        events += 1
                        delta, finished = _delta_content(event.data)
                        if delta:
                            yield delta
                        if finished:
                            # The answer is whole: a server that then holds the stream open
                            # without [DONE] kept the reply's last sentence unsaid until
                            # llm_timeout, which then failed the turn.
                            await _finish_body(response)
                            return
                        # Counted from here, after the consumer let go: the time it held
                        # the stream (a reply waiting behind the client's own text stream)
                        # is not the server's.
                        deadline = loop.time() + s.llm_timeout_s
                if not chunk:
                    if not events:
                        raise ServiceError("llm_failed", "the LLM answered without any event")
                    return  # the server closed the stream (some omit [DONE])

    async def _post(self, body: dict[str, Any], deadline: float) -> aiohttp.ClientResponse:
        headers = {**auth_headers(self._settings.llm_api_key), "Accept": "text/event-stream"}
        try:
            async with asyncio.timeout_at(deadline):
                return await self._http.post(
                    self._url, json=body, headers=headers, proxy=env_proxy(self._url)
                )
        except TimeoutError:
            raise _timeout(self._settings.llm_timeout_s) from None
        except aiohttp.ClientError as exc:
            raise ServiceError("llm_failed", f"the LLM is unreachable: {exc}") from None


async def _whole_answer(response: aiohttp.ClientResponse, deadline: float, timeout_s: float) -> str:
    """The message of a non-streamed completion (bounded in size, and due by ``deadline``:
    the whole answer is its first event)."""
    try:
        async with asyncio.timeout_at(deadline):
            body, more = await read_capped(response, MAX_SSE_EVENT)
    except TimeoutError:
        raise _timeout(timeout_s) from None
    except aiohttp.ClientError as exc:
        raise ServiceError("llm_failed", f"the LLM answer broke off: {exc}") from None
    if more:
        raise ServiceError("llm_failed", "the LLM sent an oversized answer")
    answer = _parse(body.decode("utf-8", "replace"))
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise ServiceError("llm_failed", "the LLM answer has no choices[0].message")
    content = message.get("content")
    if content is None:  # only tool calls: an empty answer, as streamed (llm_empty)
        return ""
    if not isinstance(content, str):
        raise ServiceError("llm_failed", "the LLM answer's message content is not text")
    return content


def _wants_max_completion_tokens(detail: str) -> bool:
    """OpenAI's (and Azure's) refusal: "Unsupported parameter: 'max_tokens' is not supported
    with this model. Use 'max_completion_tokens' instead." Not any error naming both: vLLM's
    context overflow says "'max_tokens' or 'max_completion_tokens' is too large"."""
    lowered = detail.lower()
    return "max_completion_tokens" in lowered and (
        "not supported" in lowered or "unsupported" in lowered
    )


def _timeout(seconds: float) -> ServiceError:
    return ServiceError("llm_timeout", f"the LLM sent nothing for {seconds:g} s")


def _parse(data: str) -> dict[str, Any]:
    """One JSON object from the LLM; an ``error`` object in it is raised as the failure."""
    try:
        event: Any = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
        raise ServiceError("llm_failed", "the LLM sent an event that is not JSON") from None
    if not isinstance(event, dict):
        raise ServiceError("llm_failed", "the LLM sent an event that is not an object")
    error = event.get("error")
    if error is not None:
        raise ServiceError("llm_failed", f"the LLM reported an error: {_message_of(error)}")
    return event


def _error_text(data: str) -> str:
    """The message of an error event's data: JSON with a ``message`` (its own, or its
    ``error``'s), else the text itself."""
    try:
        body: Any = json.loads(data)
    except (ValueError, RecursionError):
        return data[:300]
    return _message_of(body.get("error", body) if isinstance(body, dict) else body)


def _message_of(error: Any) -> str:
    """An error object's ``message`` (or the error itself, when it is no object)."""
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message)[:300]


async def _finish_body(response: aiohttp.ClientResponse) -> None:
    """Read what follows [DONE] (the chunked body's end, usually a separate write), briefly:
    a response released before its body ended closes its connection, and every reply paid
    a new TCP and TLS handshake before its first token (found by review)."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
        async with asyncio.timeout(FINISH_BODY_S):
            await read_capped(response, FINISH_BODY_BYTES)


def _delta_content(data: str) -> tuple[str | None, bool]:
    """A chunk's text, and whether its choice has finished (a ``finish_reason``)."""
    event = _parse(data)
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None, False  # e.g. a usage-only chunk
    delta = choices[0].get("delta")
    content = delta.get("content") if isinstance(delta, dict) else None
    finished = isinstance(choices[0].get("finish_reason"), str)
    return (content if isinstance(content, str) else None), finished
