"""The brain: what the agent answers to what the user said.

``EchoBrain`` speaks the user's words back (the default: it needs no service);
``LLMBrain`` streams an OpenAI-compatible chat completion. Both get the conversation so far
(what the user said, and what the user actually heard of the agent's replies) and yield text
as it comes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from agent.conversation_config import ServiceSettings
from agent.llm import ChatCompletions, Message


class Brain(Protocol):
    name: str

    def reply(self, history: list[Message]) -> AsyncIterator[str]:
        """Text deltas answering the last (user) message of ``history``."""
        ...


class EchoBrain:
    name = "echo"

    async def reply(self, history: list[Message]) -> AsyncIterator[str]:
        for message in reversed(history):
            if message["role"] == "user":
                yield message["content"]
                return


class LLMBrain:
    name = "llm"

    def __init__(self, client: ChatCompletions, settings: ServiceSettings) -> None:
        self._client = client
        self._system = settings.system_prompt

    def reply(self, history: list[Message]) -> AsyncIterator[str]:
        messages = [{"role": "system", "content": self._system}] if self._system else []
        return self._client.stream(messages + history)
