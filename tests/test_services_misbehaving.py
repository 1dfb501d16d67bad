"""LLM and speech-to-text services that misbehave: every failure is a ServiceError, in time.

A real HTTP server on loopback answers each request with one kind of misbehaviour: JSON
nested too deep to parse, an error body that stalls or is cut off, an SSE stream of
keep-alive comments only, a whole JSON completion instead of a stream, an empty stream, an
answer or error body too large to buffer. And with every legal way of framing SSE events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from agent.config import Config
from agent.conversation_config import ListenSettings, ServiceSettings
from agent.httpservice import ServiceError, env_proxy
from agent.llm import ChatCompletions
from agent.session import AgentSession
from agent.stt import Transcriber
from agent.turns import Conversation
from agent.vad import Activity, ActivityEvent
from tests.doubles import ToneEngine
from tests.services import FakeLLM
from tests.test_speech_pipeline import Drain, wait_for

NESTED = "[" * 5000 + "]" * 5000  # json.loads raises RecursionError, not ValueError
TIMEOUT_S = 0.5

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def nested_event(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(f"data: {NESTED}\n\n".encode())
    return response


async def nested_error(request: web.Request) -> web.StreamResponse:
    await request.read()
    return web.Response(status=500, text=NESTED, content_type="application/json")


async def nested_body(request: web.Request) -> web.StreamResponse:
    await request.read()
    return web.Response(text=NESTED, content_type="application/json")


async def stalled_error(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=500, headers={"Content-Length": "100"})
    await response.prepare(request)
    await response.write(b"{")
    await asyncio.sleep(30)  # the rest never comes
    return response


async def cut_error(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=502, headers={"Content-Length": "1000"})
    await response.prepare(request)
    await response.write(b'{"error"')
    assert request.transport is not None
    request.transport.close()  # the connection drops mid-body
    return response


async def keep_alive_only(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(100):  # 20 s of comments, never a token
        await response.write(b": keep-alive\n\n")
        await asyncio.sleep(0.2)
    return response


async def whole_completion(request: web.Request) -> web.StreamResponse:
    await request.read()
    return web.json_response({"choices": [{"message": {"content": "Hello there."}}]})


async def empty_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    return response


FIRST_EVENT_TIMEOUT_S = 1.0
SLOW_S = 0.7 * FIRST_EVENT_TIMEOUT_S  # the headers', then the first event's, each inside it


async def slow_headers_then_slow_event(request: web.Request) -> web.StreamResponse:
    await request.read()
    await asyncio.sleep(SLOW_S)  # the headers, inside the timeout
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.sleep(SLOW_S)  # the first event, inside it again counted from the headers
    await response.write(b'data: {"choices":[{"delta":{"content":"Hi."}}]}\n\ndata: [DONE]\n\n')
    return response


async def slow_whole_completion(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await asyncio.sleep(SLOW_S)
    await response.prepare(request)
    await asyncio.sleep(SLOW_S)
    await response.write(b'{"choices": [{"message": {"content": "Hello there."}}]}')
    return response


async def serve(handler: Handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v1/audio/transcriptions", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/v1"


async def llm_deltas(
    handler: Handler, timeout_s: float = TIMEOUT_S
) -> tuple[list[str], ServiceError | None, float]:
    runner, base = await serve(handler)
    settings = ServiceSettings(llm_base_url=base, llm_timeout_s=timeout_s)
    deltas: list[str] = []
    failure = None
    started = time.monotonic()
    try:
        async with aiohttp.ClientSession() as http:
            stream: AsyncIterator[str] = ChatCompletions(settings, http).stream(
                [{"role": "user", "content": "hi"}]
            )
            async with asyncio.timeout(10):  # the test's own guard, far above TIMEOUT_S
                async for delta in stream:
                    deltas.append(delta)
    except ServiceError as exc:
        failure = exc
    finally:
        await runner.cleanup()
    return deltas, failure, time.monotonic() - started


@pytest.mark.parametrize(
    ("handler", "code", "says"),
    [
        (nested_event, "llm_failed", "not JSON"),
        (nested_error, "llm_failed", "HTTP 500"),
        (stalled_error, "llm_failed", "HTTP 500 (its error body could not be read)"),
        (cut_error, "llm_failed", "HTTP 502 (its error body could not be read)"),
        (keep_alive_only, "llm_timeout", "sent nothing for 0.5 s"),
        (empty_stream, "llm_failed", "without any event"),
    ],
)
async def test_a_misbehaving_llm_is_a_service_error_in_time(
    handler: Handler, code: str, says: str
) -> None:
    deltas, failure, took = await llm_deltas(handler)
    assert deltas == []
    assert failure is not None and failure.code == code and says in failure.message
    assert took < 3 * TIMEOUT_S + 1  # not aiohttp's 300 s default, not forever


@pytest.mark.parametrize("handler", [slow_headers_then_slow_event, slow_whole_completion])
async def test_the_first_event_is_due_within_the_timeout_of_the_request(handler: Handler) -> None:
    """Bug: the wait for the response's headers and the wait for its first event each had
    the whole --llm-timeout, so a server that sent its headers just before the deadline and
    its first event just before the next one held the turn silent for nearly twice the
    timeout without an llm_timeout. README: no event for N s, the first included."""
    deltas, failure, took = await llm_deltas(handler, FIRST_EVENT_TIMEOUT_S)
    assert deltas == []  # it came 1.4 x the timeout after the request
    assert failure is not None and failure.code == "llm_timeout", failure
    assert took < SLOW_S * 2


async def finished_then_held_open(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for token, reason in (("Hello", None), (" there.", "stop")):
        chunk = {"choices": [{"index": 0, "delta": {"content": token}, "finish_reason": reason}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await asyncio.sleep(30)  # no [DONE], no end of the body
    return response


async def test_a_finished_answer_ends_the_stream_without_done() -> None:
    """Bug: a server that sent its last chunk with a finish_reason, then held the stream
    open without [DONE], failed the turn with llm_timeout, the reply's last sentence unsaid
    till then. The finish_reason says the answer is whole."""
    deltas, failure, took = await llm_deltas(finished_then_held_open)
    assert failure is None, failure
    assert deltas == ["Hello", " there."]
    assert took < TIMEOUT_S


async def test_a_whole_json_completion_is_spoken() -> None:
    deltas, failure, _ = await llm_deltas(whole_completion)
    assert failure is None
    assert deltas == ["Hello there."]


async def asked_once(
    services: ServiceSettings, question: str, seconds_per_word: float = 0.01
) -> tuple[AgentSession, list[dict[str, object]]]:
    """A session (a tone engine, its audio drained as if heard) asks ``question`` and waits
    for its reply to end; the session, closed, and its events."""
    session = AgentSession(
        "s", ToneEngine(seconds_per_word=seconds_per_word), Config(services=services)
    )
    events: list[dict[str, object]] = []
    session.outbox.send = events.append  # type: ignore[method-assign, assignment]
    session.pipeline.start()
    drain = Drain(session.pipeline)
    try:
        session.conversation.ask(question)
        await wait_for(lambda: any(e["type"] == "speech.ended" for e in events), timeout=30)
        await wait_for(lambda: not session.conversation.agent_active, timeout=10)
    finally:
        drain.stop()
        await session.close()
    return session, events


def json_completion(answer: object) -> Handler:
    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response(answer)

    return complete


async def test_a_whole_json_answer_of_only_tool_calls_is_empty_as_streamed() -> None:
    """OpenAI's whole answer to a tool call has ``content: null``: it was llm_failed ("no
    content"), where the same answer streamed is empty, and the reply's error llm_empty."""
    message = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}
    deltas, failure, _ = await llm_deltas(json_completion({"choices": [{"message": message}]}))
    assert (deltas, failure) == ([], None)


@pytest.mark.parametrize(
    "answer",
    [{"choices": ["not an object"]}, {"choices": [{"message": "text"}]}, {"choices": []}],
)
async def test_a_malformed_whole_json_answer_is_the_llms_failure(answer: object) -> None:
    """A choice that was not an object raised AttributeError: the client got ``internal``
    ("the reply failed") and the log a traceback, for the LLM's bad answer."""
    deltas, failure, _ = await llm_deltas(json_completion(answer))
    assert deltas == []
    assert failure is not None and failure.code == "llm_failed", failure


async def test_a_whole_json_answer_over_the_text_limit_is_spoken_up_to_it() -> None:
    """A whole JSON answer is one delta; over the 5000-character text limit the pipeline
    refused it whole (text_too_long) before the reply's stream opened: nothing at all was
    said. A reply is spoken up to the limit (README), cut between words, then text_too_long."""
    text = "This is a sentence of the long answer. " * 160  # 6240 characters
    runner, base = await serve(json_completion({"choices": [{"message": {"content": text}}]}))
    try:
        services = ServiceSettings(llm_base_url=base, llm_timeout_s=2.0)
        session, events = await asked_once(services, "Tell me everything.", 0.001)
    finally:
        await runner.cleanup()
    errors = [e["code"] for e in events if e["type"] == "error"]
    assert errors == ["text_too_long"], errors
    spoken = " ".join(str(e["text"]) for e in events if e["type"] == "speech.segment")
    limit = session.pipeline.settings.max_text_chars
    assert text.startswith(spoken) and text[len(spoken)] == " ", spoken[-60:]  # a whole word
    assert limit - 40 < len(spoken) <= limit, len(spoken)


async def test_a_slow_but_steady_llm_stream_is_not_cut_by_a_total_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """aiohttp's default total timeout (300 s) also bounds reading the body: a steady
    stream (a slow local model, a reply held behind the client's own text stream) was cut
    300 s after its request, reported as llm_timeout "sent nothing for 20 s". Here that
    default is 1 s, with a token every 0.25 s against a 1 s --llm-timeout."""
    monkeypatch.setattr(
        aiohttp.client, "DEFAULT_TIMEOUT", aiohttp.ClientTimeout(total=1.0, sock_connect=30)
    )
    async with FakeLLM() as llm:
        assert isinstance(llm, FakeLLM)
        llm.replies.append([f"Word{i} " for i in range(8)] + ["end."])
        llm.token_delay_s = 0.25
        services = ServiceSettings(llm_base_url=llm.url, llm_timeout_s=1.0)
        session, events = await asked_once(services, "Tell me a story")
    assert [e for e in events if e["type"] == "error"] == []
    assert str(session.conversation.history[-1]["content"]).endswith("end.")


@pytest.mark.parametrize(
    ("handler", "says"),
    [
        (nested_body, "invalid JSON"),
        (nested_error, "HTTP 500"),
        (stalled_error, "HTTP 500 (its error body could not be read)"),
        (cut_error, "HTTP 502 (its error body could not be read)"),
    ],
)
async def test_a_misbehaving_stt_is_a_service_error(handler: Handler, says: str) -> None:
    failed = await stt_failure(handler, TIMEOUT_S)
    assert failed.code == "stt_failed" and says in failed.message


async def stt_failure(handler: Handler, timeout_s: float) -> ServiceError:
    """What transcribing 0.1 s against ``handler`` fails with."""
    runner, base = await serve(handler)
    settings = ServiceSettings(stt_base_url=base, stt_timeout_s=timeout_s)
    try:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(ServiceError) as failed:
                await Transcriber(settings, http).transcribe(np.zeros(1600, np.float32))
    finally:
        await runner.cleanup()
    return failed.value


class _Idle:
    busy = False


async def test_a_turn_whose_transcription_crashes_still_gets_an_error_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def crash(self: Transcriber, audio: object) -> str:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Transcriber, "transcribe", crash)
    events: list[dict[str, object]] = []
    settings = ServiceSettings(stt_base_url="http://127.0.0.1:9/v1")
    conversation = Conversation(_Idle(), ListenSettings(), settings, events.append)  # type: ignore[arg-type]
    conversation.user_started(ActivityEvent(Activity.STARTED, 0))
    conversation.user_ended(np.zeros(16000, np.float32), ActivityEvent(Activity.ENDED, 10))
    (task,) = conversation._turn_tasks
    await asyncio.wait([task])
    await conversation.close()
    assert task.exception() is None
    errors = [e for e in events if e["type"] == "error"]
    assert [(e["code"], e["id"]) for e in errors] == [("internal", events[0]["id"])]


def chunk(delta: dict[str, object] | None = None, **extra: object) -> str:
    return json.dumps({"choices": [{"index": 0, "delta": delta or {}}], **extra})


def said(text: str) -> str:
    return chunk({"content": text})


def sse(*pieces: bytes, cut: bool = False) -> Handler:
    """An SSE stream written in these pieces, each flushed on its own; ``cut``: then the
    connection is lost mid-body (a chunked body without its last chunk: a crashed upstream,
    a proxy's idle cut, a network drop)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(0.01)  # the next piece in a read of its own
        if cut:
            assert request.transport is not None
            request.transport.close()
        return response

    return handler


HI_THERE = f"data: {said('Hi')}\n\ndata: {said(' there')}\n\ndata: [DONE]\n\n"
LEGAL_STREAMS = {
    # the line-based reader failed these (llm_failed) or lost their first delta
    "json over two data lines": (
        'data: {"choices": [{"index": 0,\ndata: "delta": {"content": "Hi"}}]}\n\n'
        f"data: {said(' there')}\n\ndata: [DONE]\n\n"
    ).encode(),
    "an empty data line": (
        f"data: {said('Hi')}\n\ndata:\n\ndata: {said(' there')}\n\ndata: [DONE]\n\n"
    ).encode(),
    "a leading BOM": b"\xef\xbb\xbf" + HI_THERE.encode(),
    "bare CR line ends": HI_THERE.replace("\n", "\r").encode(),
    # and these it read right, which must stay so
    "CRLF line ends": HI_THERE.replace("\n", "\r\n").encode(),
    "no space after data:": HI_THERE.replace("data: ", "data:").encode(),
    "other fields and comments": (
        f": hello\n\nretry: 3000\n\nevent: message\nid: 1\ndata: {said('Hi')}\n\n"
        f": keep-alive\n\nid: 2\ndata: {said(' there')}\n\ndata: [DONE]\n\n"
    ).encode(),
    "chunks without content": (
        f"data: {chunk({'role': 'assistant'})}\n\ndata: {said('Hi')}\n\n"
        f"data: {chunk({'tool_calls': [{'index': 0, 'function': {'name': 'f'}}]})}\n\n"
        f"data: {said(' there')}\n\ndata: {chunk({}, usage={'total_tokens': 3})}\n\n"
        'data: {"choices": [], "usage": {"total_tokens": 3}}\n\ndata: [DONE]\n\n'
    ).encode(),
    "no [DONE], no last blank line": f"data: {said('Hi')}\n\ndata: {said(' there')}".encode(),
}


@pytest.mark.parametrize("stream", LEGAL_STREAMS.values(), ids=list(LEGAL_STREAMS))
async def test_every_legal_sse_framing_is_spoken(stream: bytes) -> None:
    """Bug: the reader took each line alone as an event (WHATWG SSE joins an event's data
    lines with LF, dispatches on the blank line, ends lines with CR, LF or CRLF, drops a
    leading BOM): JSON split over data lines or an empty data line failed the reply with
    "not JSON", a BOM cost the first delta, CR line ends were one endless line."""
    deltas, failure, _ = await llm_deltas(sse(stream))
    assert failure is None, failure
    assert "".join(deltas) == "Hi there"


async def test_a_stream_split_inside_a_character_and_a_crlf_is_spoken_whole() -> None:
    stream = 'data: {"choices": [{"delta": {"content": "Olá"}}]}\r\n\r\ndata: [DONE]\r\n\r\n'
    raw = stream.encode()
    in_char = raw.index("á".encode()) + 1
    in_crlf = raw.index(b"\r\n") + 1
    deltas, failure, _ = await llm_deltas(sse(raw[:in_char], raw[in_char:in_crlf], raw[in_crlf:]))
    assert failure is None, failure
    assert deltas == ["Olá"]


@pytest.mark.parametrize(
    "stream",
    [
        b"data: " + b"x" * (1 << 20) + b"\n\n",  # one line
        (b"data: " + b"x" * 1000 + b"\n") * 1100,  # many lines of one event
    ],
    ids=["a line", "an event"],
)
async def test_an_oversized_event_fails_the_reply(stream: bytes) -> None:
    deltas, failure, _ = await llm_deltas(sse(stream), timeout_s=5)
    assert deltas == []
    assert failure is not None and failure.code == "llm_failed"
    assert "oversized event" in failure.message


def endless(status: int, start: bytes, sent: list[int]) -> Handler:
    """A body that goes on (up to 64 MiB: a client that buffers it all still ends);
    ``sent`` counts the bytes the client's connection took."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(status=status, headers={"Content-Type": "text/html"})
        await response.prepare(request)
        await response.write(start)
        piece = b"a" * (1 << 16)
        try:
            for _ in range(1 << 10):
                await response.write(piece)
                sent[0] += len(piece)
        except (ConnectionError, RuntimeError):  # the client hung up
            pass
        return response

    return handler


# The client reads ~1 MiB; the two kernels' socket buffers on loopback take some more.
CUT_OFF = 24 << 20


async def test_a_huge_stt_answer_is_refused_not_buffered() -> None:
    """Bug: the answer was read whole (response.json()) before its size was known: an STT
    or proxy sending an endless body had the server buffer ~0.5 GB/s until --stt-timeout."""
    sent = [0]
    failed = await stt_failure(endless(200, b'{"text": "', sent), 10)
    assert failed.code == "stt_failed"
    assert "more than 1 MiB" in failed.message
    assert sent[0] < CUT_OFF


async def test_a_huge_error_body_is_cut_short_not_buffered() -> None:
    """Bug: an error body was read whole (response.text()) to report its first 300
    characters: an endless one was buffered until the timeout."""
    sent = [0]
    runner, base = await serve(endless(502, b"<p>Bad gateway", sent))
    settings = ServiceSettings(llm_base_url=base, llm_timeout_s=10)
    stt = ServiceSettings(stt_base_url=base, stt_timeout_s=10)
    try:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(ServiceError) as llm_failed:
                async for _ in ChatCompletions(settings, http).stream([]):
                    pass
            llm_sent, sent[0] = sent[0], 0
            with pytest.raises(ServiceError) as stt_failed:
                await Transcriber(stt, http).transcribe(np.zeros(1600, np.float32))
    finally:
        await runner.cleanup()
    assert llm_failed.value.message == "the LLM failed: HTTP 502: <p>Bad gateway" + "a" * 286
    assert stt_failed.value.message.endswith("HTTP 502: <p>Bad gateway" + "a" * 286)
    assert llm_sent < CUT_OFF and sent[0] < CUT_OFF


async def unusable_charset_error(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(
        status=503,
        body=b"upstream down",
        headers={"Content-Type": "text/plain; charset*=utf-8''utf%00"},  # "utf\x00"
    )


async def test_an_error_body_whose_charset_no_codec_has_is_still_the_services_failure() -> None:
    """Bug: an error body's charset that Python cannot even look up ("utf\x00") raised a
    bare ValueError: the LLM reply failed as internal, the STT one as "invalid JSON"."""
    deltas, failure, _ = await llm_deltas(unusable_charset_error)
    assert deltas == []
    assert failure is not None and failure.code == "llm_failed"
    assert "HTTP 503: upstream down" in failure.message
    failed = await stt_failure(unusable_charset_error, TIMEOUT_S)
    assert failed.code == "stt_failed" and "HTTP 503: upstream down" in failed.message


async def latin1_transcript(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(
        body='{"text": "café"}'.encode("iso-8859-1"),
        headers={"Content-Type": "application/json; charset=iso-8859-1"},
    )


async def test_a_transcript_is_read_in_its_declared_charset() -> None:
    runner, base = await serve(latin1_transcript)
    settings = ServiceSettings(stt_base_url=base, stt_timeout_s=TIMEOUT_S)
    try:
        async with aiohttp.ClientSession() as http:
            text = await Transcriber(settings, http).transcribe(np.zeros(1600, np.float32))
    finally:
        await runner.cleanup()
    assert text == "café"


async def test_a_model_that_refuses_max_tokens_is_asked_with_max_completion_tokens() -> None:
    """OpenAI's reasoning models (o1, o3, gpt-5...) answer 400 "Unsupported parameter:
    'max_tokens' ... Use 'max_completion_tokens' instead": with --llm-model gpt-5-mini every
    reply failed. The session asks again with the new name, and keeps it."""
    async with FakeLLM() as llm:
        assert isinstance(llm, FakeLLM)
        llm.refuses_max_tokens = True
        settings = ServiceSettings(llm_base_url=llm.url, llm_timeout_s=2.0, llm_max_tokens=123)
        async with aiohttp.ClientSession() as http:
            completions = ChatCompletions(settings, http)
            for _ in range(2):
                deltas = [d async for d in completions.stream([{"role": "user", "content": "hi"}])]
                assert "".join(deltas) == "Hi there."
    limits = [(r.get("max_tokens"), r.get("max_completion_tokens")) for r in llm.requests]
    assert limits == [(123, None), (None, 123), (None, 123)], limits


async def test_the_services_are_reached_through_the_environments_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HTTP_PROXY / HTTPS_PROXY were ignored (aiohttp's default), unlike OpenAI's SDKs: a
    server whose only way out is a proxy could not reach a hosted LLM."""
    seen: list[str] = []

    async def proxy(request: web.Request) -> web.StreamResponse:
        seen.append(str(request.url))  # a forward proxy is asked for the absolute URL
        await request.read()
        return web.json_response({"choices": [{"message": {"content": "Through the proxy."}}]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    try:
        services = ServiceSettings(llm_base_url="http://llm.invalid/v1")
        _, events = await asked_once(services, "Are you there?")
    finally:
        await runner.cleanup()
    assert seen == ["http://llm.invalid/v1/chat/completions"], (seen, events)
    assert [e["text"] for e in events if e["type"] == "speech.segment"] == ["Through the proxy."]


async def test_a_context_overflow_naming_max_completion_tokens_is_not_asked_again() -> None:
    """vLLM's 400 for a history too long for its context says "'max_tokens' or
    'max_completion_tokens' is too large": taken for a model refusing max_tokens, the same
    request went again (the failure took twice as long) and the session kept the other name
    (a server that does not know it then has no cap on the answer)."""
    message = (
        "'max_tokens' or 'max_completion_tokens' is too large: 400. This model's maximum "
        "context length is 4096 tokens and your request has 3900 input tokens."
    )
    requests: list[dict[str, object]] = []

    async def vllm(request: web.Request) -> web.StreamResponse:
        requests.append(await request.json())
        return web.json_response({"error": {"message": message}}, status=400)

    deltas, failure, _ = await llm_deltas(vllm)
    assert deltas == [] and failure is not None and "too large" in failure.message
    assert len(requests) == 1 and "max_tokens" in requests[0]


@pytest.mark.parametrize("api_key", ["sk-test", None], ids=["with-key", "keyless"])
async def test_a_netrc_login_is_never_sent_to_the_services(
    api_key: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp's trust_env (taken for HTTPS_PROXY) also reads ~/.netrc: a developer's
    catch-all entry clashed with the API key's Authorization header (ValueError: every reply
    "internal"), or was sent as Basic auth to a keyless local LLM."""
    netrc = tmp_path / "netrc"
    netrc.write_text("default login someone password git-token\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    seen: list[str | None] = []

    async def llm(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization"))
        await request.read()
        return web.json_response({"choices": [{"message": {"content": "Hello."}}]})

    runner, base = await serve(llm)
    try:
        services = ServiceSettings(llm_base_url=base, llm_api_key=api_key, llm_timeout_s=2.0)
        _, events = await asked_once(services, "hi")
    finally:
        await runner.cleanup()
    assert [e for e in events if e["type"] == "error"] == []
    assert seen == [f"Bearer {api_key}" if api_key else None]


def test_the_proxy_is_read_as_curl_and_httpx_read_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bare host:port is an http:// proxy; the scheme's case does not matter; NO_PROXY
    exempts a host; a proxy aiohttp cannot speak to (https://, socks) is ignored with a
    warning rather than in silence."""
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "proxy.corp:3128")
    assert env_proxy("https://api.openai.com/v1") == "http://proxy.corp:3128"
    monkeypatch.setenv("HTTPS_PROXY", "HTTP://proxy.corp:3128")
    assert env_proxy("https://api.openai.com/v1") == "HTTP://proxy.corp:3128"
    monkeypatch.setenv("NO_PROXY", "api.openai.com")
    assert env_proxy("https://api.openai.com/v1") is None
    monkeypatch.delenv("NO_PROXY")
    monkeypatch.setenv("HTTPS_PROXY", "socks5://proxy.corp:1080")
    with caplog.at_level(logging.WARNING, logger="agent.httpservice"):
        assert env_proxy("https://api.openai.com/v1") is None
    assert "socks5:// ignored" in caplog.text
    assert env_proxy("http://localhost:8000/v1") is None  # no HTTP_PROXY: direct


# llama.cpp's llama-server (server.cpp, handle_completions_impl) reports an error that comes
# after the 200 headers of a stream with server_sent_event(sink, "error", error_data), i.e.
# an "error:" SSE field, then writes its usual "data: [DONE]". The prompt being longer than
# the model's context is reported so (a conversation's history grows to 40 messages).
LLAMA_CPP_CONTEXT_OVERFLOW = (
    b'error: {"code":400,"message":"the request exceeds the available context size, '
    b'try increasing it","type":"exceed_context_size_error"}\n\n'
    b"data: [DONE]\n\n"
)


async def test_an_llm_error_sent_as_an_sse_error_field_is_a_failure_not_an_empty_answer() -> None:
    deltas, failure, _ = await llm_deltas(sse(LLAMA_CPP_CONTEXT_OVERFLOW))
    assert deltas == []
    # It was no failure at all (the "error:" line skipped, [DONE] ending the stream).
    assert failure is not None and failure.code == "llm_failed", failure
    assert "exceeds the available context size" in failure.message


async def test_the_client_is_told_the_llms_error_not_that_it_had_nothing_to_say() -> None:
    """It was told llm_empty ("had nothing to say aloud"), the server's reason lost."""
    runner, base = await serve(sse(LLAMA_CPP_CONTEXT_OVERFLOW))
    services = ServiceSettings(llm_base_url=base, llm_timeout_s=2.0)
    session = AgentSession("s", ToneEngine(seconds_per_word=0.01), Config(services=services))
    events: list[dict[str, object]] = []
    session.outbox.send = events.append  # type: ignore[method-assign, assignment]
    session.pipeline.start()
    try:
        session.conversation.ask("What's the weather like?")
        await wait_for(lambda: any(e["type"] == "error" for e in events), timeout=10)
    finally:
        await session.close()
        await runner.cleanup()
    errors = [(e["code"], e["message"]) for e in events if e["type"] == "error"]
    assert [code for code, _ in errors] == ["llm_failed"], errors


async def test_an_llm_error_field_mid_stream_does_not_end_the_reply_as_if_complete() -> None:
    said = b'data: {"choices":[{"delta":{"content":"The answer is"}}]}\n\n'
    error = b'error: {"code":500,"message":"slot crashed","type":"server_error"}\n\n'
    deltas, failure, _ = await llm_deltas(sse(said, error, b"data: [DONE]\n\n"))
    assert deltas == ["The answer is"]
    assert failure is not None and failure.code == "llm_failed", failure


# An API key read from a file, a Kubernetes/Docker secret or a CRLF .env keeps its line end.
@pytest.mark.parametrize("field", ["llm_api_key", "stt_api_key"])
@pytest.mark.parametrize("key", ["sk-test-key\n", "sk-\r\nX-Injected: 1", "sk-\x00"])
def test_an_api_key_no_header_can_carry_is_refused_at_start(field: str, key: str) -> None:
    """aiohttp refuses such a header with ValueError: every reply failed as ``internal``
    with a traceback, every turn as the STT service's "invalid JSON", a service that was
    never asked, nothing naming the key (found by review)."""
    with pytest.raises(ValueError, match="API key"):
        ServiceSettings(**{field: key})  # type: ignore[arg-type]


async def test_an_stt_request_that_cannot_be_built_is_not_blamed_on_the_services_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ValueError from building the request was caught as the answer's JSON failing to
    parse: "speech-to-text answered with invalid JSON", about a service never asked."""
    from tests.services import FakeSTT

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("Forbidden control character")

    async with FakeSTT() as stt, aiohttp.ClientSession() as http:
        assert isinstance(stt, FakeSTT)
        monkeypatch.setattr(http, "post", refuse)
        settings = ServiceSettings(stt_base_url=stt.url)
        with pytest.raises(ValueError, match="Forbidden"):
            await Transcriber(settings, http).transcribe(np.zeros(1600, np.float32))
        assert stt.uploads == []


@pytest.mark.parametrize(
    "last_chunk",
    [
        b'data: {"choices":[{"delta":{"content":"Hi."}}]}\n\n',
        # the usual OpenAI stream: the last chunk has a finish_reason, which ends the answer
        # (then [DONE]); returning on it must still finish the body as [DONE] does
        b'data: {"choices":[{"delta":{"content":"Hi."},"finish_reason":"stop"}]}\n\n',
    ],
    ids=["done", "finish-reason"],
)
async def test_a_stream_ended_by_done_leaves_its_connection_for_the_next_reply(
    last_chunk: bytes,
) -> None:
    """A server's "data: [DONE]" and the end of its chunked body (the 0-size chunk) are two
    writes; when the end comes a moment after [DONE], the client has already returned on
    [DONE] and released a response whose body is not finished, so aiohttp closes the
    connection: every reply pays a new TCP (and TLS) handshake before its first token."""
    peers: list[int] = []

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername")[1])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(last_chunk)
        await response.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.02)  # the generator's end, then the body's
        with contextlib.suppress(ConnectionError):  # the client hung up already
            await response.write_eof()
        return response

    runner, base = await serve(complete)
    try:
        async with aiohttp.ClientSession() as http:
            client = ChatCompletions(ServiceSettings(llm_base_url=base), http)
            for _ in range(3):
                assert [d async for d in client.stream([])] == ["Hi."]
                await asyncio.sleep(0.1)  # the user listens, then asks again
    finally:
        await runner.cleanup()
    assert len(set(peers)) == 1, f"{len(set(peers))} connections for {len(peers)} replies"
