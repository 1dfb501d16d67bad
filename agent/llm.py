"""An OpenAI-compatible ``POST {base}/chat/completions`` client with ``stream: true``.

Server-sent events are read line by line as they arrive; each ``data:`` line's
``choices[0].delta.content`` is yielded at once, so the speech pipeline can speak the first
sentence while the model is still writing. A timeout applies to the wait for every line
(the first token included), so a stalled stream fails instead of hanging the turn.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from agent.conversation_config import ServiceSettings
from agent.httpservice import ServiceError, auth_headers, describe_failure, endpoint

Message = dict[str, str]
MAX_SSE_LINE = 1 << 20  # a single event larger than this is not a chat delta


class ChatCompletions:
    def __init__(self, settings: ServiceSettings, http: aiohttp.ClientSession) -> None:
        if not settings.llm_base_url:
            raise ValueError("no LLM base URL")
        self._url = endpoint(settings.llm_base_url, "/chat/completions")
        self._settings = settings
        self._http = http

    async def stream(self, messages: list[Message]) -> AsyncIterator[str]:
        s = self._settings
        body = {
            "model": s.llm_model,
            "messages": messages,
            "stream": True,
            "max_tokens": s.llm_max_tokens,
        }
        headers = {**auth_headers(s.llm_api_key), "Accept": "text/event-stream"}
        try:
            async with asyncio.timeout(s.llm_timeout_s):
                response = await self._http.post(self._url, json=body, headers=headers)
        except TimeoutError:
            raise _timeout(s.llm_timeout_s) from None
        except aiohttp.ClientError as exc:
            raise ServiceError("llm_failed", f"the LLM is unreachable: {exc}") from None
        async with response:
            if response.status != 200:
                raise ServiceError(
                    "llm_failed", f"the LLM failed: {await describe_failure(response)}"
                )
            while True:
                try:
                    line = await asyncio.wait_for(response.content.readline(), s.llm_timeout_s)
                except TimeoutError:
                    raise _timeout(s.llm_timeout_s) from None
                except (aiohttp.ClientError, ValueError) as exc:
                    raise ServiceError("llm_failed", f"the LLM stream broke: {exc}") from None
                if not line:
                    return  # the server closed the stream (some omit [DONE])
                if len(line) > MAX_SSE_LINE:
                    raise ServiceError("llm_failed", "the LLM sent an oversized event")
                text = line.decode("utf-8", "replace").strip()
                if not text.startswith("data:"):
                    continue  # blank separators, ': keep-alive' comments, event:/id: fields
                data = text[5:].strip()
                if data == "[DONE]":
                    return
                delta = _delta_content(data)
                if delta:
                    yield delta


def _timeout(seconds: float) -> ServiceError:
    return ServiceError("llm_timeout", f"the LLM sent nothing for {seconds:g} s")


def _delta_content(data: str) -> str | None:
    try:
        event: Any = json.loads(data)
    except ValueError:
        raise ServiceError("llm_failed", "the LLM sent an event that is not JSON") from None
    if not isinstance(event, dict):
        raise ServiceError("llm_failed", "the LLM sent an event that is not an object")
    error = event.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else error
        raise ServiceError("llm_failed", f"the LLM reported an error: {str(message)[:300]}")
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None  # e.g. a usage-only chunk
    delta = choices[0].get("delta")
    content = delta.get("content") if isinstance(delta, dict) else None
    return content if isinstance(content, str) else None
