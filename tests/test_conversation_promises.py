"""Promises of the conversational front-end (agent/llm.py, agent/turns.py, agent/speech.py,
agent/session.py) that no other test held the code to: found by hand mutation testing (55
mutations, 18 survived; these nine changed what a user gets). Each test fails with one
plausible change to the code: an LLM stream that breaks mid-answer taken for a whole answer,
the reply's stream left open after an LLM error, a token-limit refusal retried for ever, an
empty SSE stream, a header timeout, the stream idle timeout, a refused config half applied,
a closed conversation answering, an empty transcript not sent."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp import web

from agent.config import Config, SpeechSettings
from agent.conversation_config import ServiceSettings
from agent.session import AgentSession
from agent.speech import CLIENT, SpeechError, SpeechPipeline
from tests.doubles import FailingEngine, ToneEngine
from tests.test_conversation_units import RecordingBrain, ScriptedSTT, say_turn, talking_session
from tests.test_services_misbehaving import llm_deltas, said, serve, sse
from tests.test_speech_pipeline import Drain, wait_for


def data(text: str) -> bytes:
    """One SSE event of a streamed reply saying ``text``."""
    return f"data: {said(text)}\n\n".encode()


# --- agent/llm.py -------------------------------------------------------------------------------
async def test_an_llm_stream_that_breaks_mid_answer_is_a_failure_not_a_complete_answer() -> None:
    """README: llm_failed for a stream that breaks; "a reply that failed part-way plays what
    was already said". A stream whose connection dropped after its first delta must fail,
    not end as if the answer were complete (the client was told nothing, and the cut answer
    went into the history as the whole reply).
    Mutation: llm.py stream() ``except aiohttp.ClientError`` returns instead of raising."""
    deltas, failure, _ = await llm_deltas(sse(data("The answer is 42. "), data("And"), cut=True))
    assert deltas == ["The answer is 42. ", "And"]
    assert failure is not None and failure.code == "llm_failed", failure
    assert "broke" in failure.message


async def test_a_reply_whose_llm_stream_breaks_plays_what_was_said_and_names_its_question() -> None:
    """The same break seen by the client: the part already said is spoken and ends
    (``speech.ended``), the reply's ``llm_failed`` carries its id and the chat's (``reply_to``),
    and the history holds what was heard of it.
    Mutations: llm.py ClientError returns (no error); turns.py _run_reply not closing the
    reply's stream after a ServiceError (no speech.ended, the session held for good)."""
    runner, base = await serve(sse(data("The answer is 42. "), data("And then"), cut=True))
    services = ServiceSettings(llm_base_url=base, llm_timeout_s=2.0)
    session = AgentSession("s", ToneEngine(seconds_per_word=0.01), Config(services=services))
    events: list[dict[str, Any]] = []
    session.outbox.send = events.append  # type: ignore[method-assign, assignment]
    session.pipeline.start()
    drain = Drain(session.pipeline)
    try:
        reply_id = session.conversation.ask("What is the answer?", question_id="q1")
        await wait_for(lambda: any(e["type"] == "speech.ended" for e in events), timeout=10)
        await wait_for(lambda: not session.conversation.agent_active, timeout=5)
        history = [dict(m) for m in session.conversation.history]
    finally:
        drain.stop()
        await session.close()
        await runner.cleanup()
    errors = [(e["code"], e.get("id"), e.get("reply_to")) for e in events if e["type"] == "error"]
    assert errors == [("llm_failed", reply_id, "q1")], errors
    spoken = [e["text"] for e in events if e["type"] == "speech.segment" and e["id"] == reply_id]
    assert spoken == ["The answer is 42.", "And then"], spoken
    ended = [e for e in events if e["type"] == "speech.ended"]
    assert ended == [{"type": "speech.ended", "id": reply_id, "interrupted": False}], ended
    assert history == [
        {"role": "user", "content": "What is the answer?"},
        {"role": "assistant", "content": "The answer is 42. And then"},
    ], history


async def test_a_server_refusing_both_token_limit_names_is_asked_twice_not_for_ever() -> None:
    """A server that refuses ``max_tokens`` naming ``max_completion_tokens``, then refuses
    that too (it knows neither), is asked once with each name: the reply fails (llm_failed)
    rather than asking again and again (each retry a new request, the turn never answered).
    Mutation: llm.py stream() retries on every such refusal (the check that the old name
    was the one refused dropped)."""
    requests: list[dict[str, Any]] = []

    async def refuses_both(request: web.Request) -> web.StreamResponse:
        requests.append(await request.json())
        if len(requests) > 3:  # the test's own guard: a client that asks for ever ends here
            return web.json_response({"choices": [{"message": {"content": "Asked again."}}]})
        field = "max_tokens" if "max_tokens" in requests[-1] else "max_completion_tokens"
        message = (
            f"Unsupported parameter: '{field}' is not supported with this model. "
            "Use 'max_completion_tokens' instead."
        )
        return web.json_response({"error": {"message": message}}, status=400)

    deltas, failure, _ = await llm_deltas(refuses_both)
    assert deltas == []
    assert failure is not None and failure.code == "llm_failed", failure
    assert len(requests) == 2, len(requests)
    assert "max_tokens" in requests[0] and "max_completion_tokens" in requests[1]


async def test_a_stream_of_only_empty_data_lines_answered_without_any_event() -> None:
    """An empty ``data:`` is no chunk (some servers' keep-alive): a stream of nothing else
    that ends is "answered without any event" (llm_failed), as an empty stream is, not an
    answer with nothing to say (llm_empty).
    Mutation: llm.py counts an empty data line as an event."""
    deltas, failure, _ = await llm_deltas(sse(b"data:\n\n", b"data:\n\n"))
    assert deltas == []
    assert failure is not None and failure.code == "llm_failed", failure
    assert "without any event" in failure.message


async def test_an_llm_that_never_sends_its_headers_is_an_llm_timeout() -> None:
    """README: llm_timeout is "no event for --llm-timeout seconds, the first included,
    counted from the request": a server that holds its response's headers is a timeout too
    (llm_timeout), not a failure (llm_failed).
    Mutation: llm.py _post() reports its timeout as llm_failed."""

    async def silent(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.sleep(3)
        return web.json_response({"choices": [{"message": {"content": "Too late."}}]})

    deltas, failure, took = await llm_deltas(silent, timeout_s=0.3)
    assert deltas == []
    assert failure is not None and failure.code == "llm_timeout", failure
    assert took < 2


# --- agent/speech.py ------------------------------------------------------------------------------
async def test_a_stream_quiet_just_past_its_idle_timeout_is_ended() -> None:
    """README: a stream with no delta for 30 s is ended as its text.end would. Not 60 s:
    the existing test looked only at 10 s (not yet) and 60 s (ended).
    Mutation: speech.py end_stalled_stream waits twice the timeout."""
    pipeline = SpeechPipeline(ToneEngine(), SpeechSettings(stream_idle_timeout_s=30), print)
    pipeline.text_delta("Hello and", "s")
    fed = time.monotonic()
    assert pipeline.end_stalled_stream(fed + 29, (CLIENT,)) is None
    assert pipeline.end_stalled_stream(fed + 31, (CLIENT,)) == (CLIENT, "s")
    pipeline.discard()


# --- agent/session.py ---------------------------------------------------------------------------
async def test_a_config_whose_voice_is_refused_changes_nothing_barge_in_included() -> None:
    """A ``config`` whose voice the engine refuses (unknown_voice) is refused whole: "the
    voice in use is kept", and the ``barge_in`` sent with it is not applied either (the
    session applies the voice first so that "a voice it refuses changes nothing").
    Mutation: session.py apply() sets barge_in before configuring the voice."""
    session = AgentSession("s", FailingEngine(), Config())
    events: list[dict[str, Any]] = []
    session.outbox.send = events.append  # type: ignore[method-assign, assignment]
    assert session.conversation.barge_in is True
    session.handle_message(json.dumps({"type": "config", "voice": "nobody", "barge_in": False}))
    assert [e["code"] for e in events if e["type"] == "error"] == ["unknown_voice"], events
    assert session.conversation.barge_in is True
    assert session.pipeline.voice.voice is None
    session.handle_message(json.dumps({"type": "config", "voice": "seed:7", "barge_in": False}))
    assert session.conversation.barge_in is False and session.pipeline.voice.voice == "seed:7"
    session.pipeline.discard()
    session.conversation.discard()


# --- agent/turns.py -----------------------------------------------------------------------------
async def test_a_closed_conversation_refuses_a_chat_and_starts_no_reply() -> None:
    """A chat that reaches a closed conversation (a data-channel message racing the
    session's close, a room's chat as the room closes) is refused (``closed``): a reply
    started then is a task nobody cancels or waits for, and an LLM brain made on it opens
    a new HTTP client after close() closed the last one.
    Mutation: turns.py ask() without its ``closed`` check."""
    services = ServiceSettings(llm_base_url="http://127.0.0.1:9/v1")
    session = AgentSession("s", ToneEngine(seconds_per_word=0.01), Config(services=services))
    session.outbox.send = lambda event: None  # type: ignore[method-assign]
    await session.close()
    with pytest.raises(SpeechError) as info:
        session.conversation.ask("Are you there?")
    assert info.value.code == "closed"
    assert session.conversation._reply_tasks == []
    assert session.conversation._http is None


async def test_an_empty_transcript_is_still_sent_to_the_client() -> None:
    """README: ``{"type": "user.transcript", "id", "text"}`` (``text`` may be empty): a
    turn transcribed as nothing (a cough, a breath) still gets its transcript event, so the
    page can close the turn it opened at ``user.speech.started``.
    Mutation: turns.py _transcribe emits user.transcript only for non-empty text."""
    stt = ScriptedSTT(("", 0.0))
    brain = RecordingBrain()
    session, events, drain = talking_session(stt, brain)
    try:
        say_turn(session, 0.3)
        await wait_for(lambda: stt.calls == 1 and not session.conversation._turn_tasks)
    finally:
        drain.stop()
        await session.close()
    turn = next(e["id"] for e in events if e["type"] == "user.speech.started")
    kinds = [e["type"] for e in events if e["type"].startswith("user.")]
    assert kinds == ["user.speech.started", "user.speech.ended", "user.transcript"], kinds
    assert {"type": "user.transcript", "id": turn, "text": ""} in events, events
    assert brain.asked == []  # nothing to answer
