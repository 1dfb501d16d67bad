"""The brain: what the agent answers to what the user said.

``EchoBrain`` speaks the user's words back (the default: it needs no service);
``LLMBrain`` streams an OpenAI-compatible chat completion. Both get the conversation so far
(what the user said, and what the user actually heard of the agent's replies) and yield text
as it comes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from agent.conversation_config import ServiceSettings
from agent.llm import ChatCompletions, Message


class Brain(Protocol):
    name: str

    def reply(self, history: list[Message]) -> AsyncGenerator[str, None]:
        """Text deltas answering the last (user) message of ``history``: an async generator,
        closed (``aclose``) when its reader stops early."""
        ...


class EchoBrain:
    name = "echo"

    async def reply(self, history: list[Message]) -> AsyncGenerator[str, None]:
        # Every user message since the agent last spoke: a reply answers every turn since
        # the last one heard (a transcript that came late, a reply cut off unheard). Only the
        # newest was said back, so "My name is Ann." went unspoken (found by review).
        unanswered: list[str] = []
        for message in reversed(history):
            if message["role"] != "user":
                break
            # The words as typed: a room member's "Ann: " is for an LLM, not to be said back.
            unanswered.append(message.get("typed", message["content"]))
        if unanswered:
            yield " ".join(reversed(unanswered))


class LLMBrain:
    name = "llm"

    def __init__(self, client: ChatCompletions, settings: ServiceSettings) -> None:
        self._client = client
        self._system = settings.system_prompt

    def reply(self, history: list[Message]) -> AsyncGenerator[str, None]:
        messages = [{"role": "system", "content": self._system}] if self._system else []
        return self._client.stream(messages + alternating(history))


def alternating(history: list[Message]) -> list[Message]:
    """``history`` as user and assistant messages taking turns, starting with the user's.

    The conversation does not alternate by itself: every turn since the last reply is
    answered at once (two user messages in a row), a reply nobody heard leaves none, and
    trimming the oldest may leave an assistant message first. OpenAI takes that, but many
    OpenAI-compatible servers do not: the chat templates of Llama 2, Mistral or Gemma (on
    vLLM, TGI, llama.cpp) refuse it ("Conversation roles must alternate"), an HTTP 400 at
    every later reply while the pair stays in the history. Neighbours of one role are
    joined into one message; what was said, and its order, is unchanged.
    """
    out: list[Message] = []
    for message in history:
        if not out and message["role"] == "assistant":
            continue  # its question was trimmed away
        if out and out[-1]["role"] == message["role"]:
            joiner = "\n" if message["role"] == "user" else " "
            out[-1] = {**out[-1], "content": out[-1]["content"] + joiner + message["content"]}
        else:
            # Role and content only: what the API takes ("typed" is the echo brain's).
            out.append({"role": message["role"], "content": message["content"]})
    return out
