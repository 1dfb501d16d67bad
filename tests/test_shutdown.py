"""Graceful shutdown: SIGTERM stops admitting (503 shutting_down), lets speech in flight
finish up to --drain-deadline, closes every peer and exits 0. The server runs the product's
CLI and shutdown path in a subprocess: with the tone engine, and with ChatTTS (tiny model)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection

from agent.config import Config
from agent.conversation_config import ServiceSettings
from signaling.keys import DRAIN, SESSIONS
from signaling.shutdown import drain
from tests.conftest import LiveServer, serve
from tests.doubles import ToneEngine
from tests.rtc_client import RtcClient
from tests.server_process import ServerProcess
from tests.services import FakeLLM

pytest_plugins = ["tests.conftest_chattts"]
pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


async def an_offer() -> str:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    sdp: str = pc.localDescription.sdp
    await pc.close()
    return sdp


async def sigterm_while_speaking(server: ServerProcess, text: str, deadline: float) -> None:
    offer = await an_offer()
    async with aiohttp.ClientSession() as http:
        client = RtcClient(server.url, http)
        await client.connect()
        try:
            client.send({"type": "say", "text": text, "id": "last"})
            await client.wait_event(lambda e: e["type"] == "speech.started", 60)
            signalled = time.monotonic()
            server.terminate()
            # New sessions are refused while the speech finishes (the signal may take a
            # moment to be handled: the first answer after it is what counts).
            refused = None
            while refused is None and time.monotonic() - signalled < 2:
                async with http.post(
                    server.url + "/offer", json={"type": "offer", "sdp": offer}
                ) as resp:
                    if resp.status == 503:
                        refused = (await resp.json())["error"]
                        assert resp.headers["Retry-After"]
                    else:
                        assert resp.status == 200
                        await asyncio.sleep(0.02)
            assert refused is not None and refused["code"] == "shutting_down", refused
            async with http.get(server.url + "/readyz") as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "shutting_down"
                assert resp.headers["Retry-After"]  # as README says (it had none)
            ended = await client.wait_event(lambda e: e["type"] == "speech.ended", deadline + 5)
            assert ended == {"type": "speech.ended", "id": "last", "interrupted": False}
            status = await asyncio.get_running_loop().run_in_executor(
                None, server.proc.wait, deadline + 10
            )
            took = time.monotonic() - signalled
        finally:
            await client.close()
    assert status == 0
    assert took <= deadline + 3, took


async def test_sigterm_drains_speech_then_exits_0() -> None:
    server = ServerProcess(["tests.serve_tone"], ["--drain-deadline", "8"])
    try:
        await server.ready()
        await sigterm_while_speaking(server, "one two three four five six seven eight", 8)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


async def test_the_deadline_caps_the_drain() -> None:
    server = ServerProcess(["tests.serve_tone"], ["--drain-deadline", "1"])
    try:
        await server.ready()
        async with aiohttp.ClientSession() as http:
            client = RtcClient(server.url, http)
            await client.connect()
            client.send({"type": "say", "text": " ".join(["word"] * 40), "id": "long"})  # 10 s
            await client.wait_event(lambda e: e["type"] == "speech.started")
            signalled = time.monotonic()
            server.terminate()
            status = await asyncio.get_running_loop().run_in_executor(None, server.proc.wait, 15)
            took = time.monotonic() - signalled
            await client.close()
        assert status == 0
        assert 0.9 <= took <= 4, took
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


async def test_sigterm_with_chattts(tiny_model_dir: Path) -> None:
    """The product as shipped: `python -m signaling serve` with the tiny ChatTTS model."""
    server = ServerProcess(
        ["signaling", "serve"],
        ["--model-dir", str(tiny_model_dir), "--device", "cpu", "--drain-deadline", "30"],
        subprocess.DEVNULL,
    )
    try:
        await server.ready(timeout=120)
        await sigterm_while_speaking(server, "Hello there. One more sentence.", 30)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


@pytest.mark.parametrize("drained", ["while_negotiating", "after_negotiating"])
async def test_an_offer_in_flight_when_the_drain_closes_everything_is_refused(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch, drained: str
) -> None:
    """SIGTERM's drain closes every session while an offer is being answered (ICE takes a
    moment): the offer used to be registered after that, answered 200, and its peer
    connection never closed (the process exits). Now: 503 shutting_down, nothing left."""
    registry = live_server.app[SESSIONS]
    made: list[RTCPeerConnection] = []
    real_connect = registry._connect

    async def connect(*args: Any) -> tuple[RTCPeerConnection, str]:
        if drained == "while_negotiating":
            await drain(registry, live_server.app[DRAIN], 1.0)
        pc, answer = await real_connect(*args)
        made.append(pc)
        if drained == "after_negotiating":
            await drain(registry, live_server.app[DRAIN], 1.0)  # what SIGTERM runs
        return pc, answer

    monkeypatch.setattr(registry, "_connect", connect)
    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        try:
            await client.connect(allow_refusal=True)
            assert client.refusal is not None, "an offer was admitted after the drain"
            status, body, headers = client.refusal
            assert (status, body["error"]["code"]) == (503, "shutting_down")
            assert headers["Retry-After"]
        finally:
            await client.close()
    assert len(registry) == 0 and registry.load == 0
    assert [pc.connectionState for pc in made] == ["closed"] * len(made)
    assert registry._watchdog is None or registry._watchdog.done()


async def test_the_drain_lets_a_chat_reply_being_prepared_be_spoken() -> None:
    """Bug: the drain counted only the speech pipeline, so a ``chat`` whose reply the LLM was
    still preparing (first token not yet in) looked idle and its session was closed at once:
    the user's question went unanswered. A reply being prepared is speech in flight too."""
    llm = FakeLLM(first_token_delay_s=1.0)
    async with llm:
        config = Config(
            host="127.0.0.1",
            port=0,
            services=ServiceSettings(llm_base_url=llm.url, llm_timeout_s=5.0),
        )
        async with serve(config, ToneEngine()) as server, aiohttp.ClientSession() as http:
            client = RtcClient(server.url, http)
            await client.connect()
            try:
                client.send({"type": "chat", "text": "what time is it"})
                while not llm.requests:  # the reply is being prepared
                    await asyncio.sleep(0.01)
                started = time.monotonic()
                finished = await drain(server.app[SESSIONS], server.app[DRAIN], 8.0)
                took = time.monotonic() - started
                spoken = [e for e in client.events if e["type"] == "speech.started"]
                assert spoken, (
                    f"drain closed the session after {took:.2f} s (returned {finished}) "
                    f"with the chat reply unspoken; events: {client.events}"
                )
                assert finished
            finally:
                await client.close()


async def test_a_detached_session_does_not_hold_the_drain_to_its_deadline(
    live_server: LiveServer,
) -> None:
    """Bug: a detached session (its client between networks) has its playout paused, and the
    drain refuses its resume (503 shutting_down): its queued speech can never play, yet the
    drain waited for it, the whole deadline (20 s by default) on every SIGTERM while any
    client was away."""
    from tests.test_lifecycle import detached, wait_for

    async with aiohttp.ClientSession() as http:
        client = RtcClient(live_server.url, http)
        await client.connect()
        sid = client.session_id
        assert sid is not None
        client.send({"type": "say", "text": " ".join(["word"] * 40), "id": "long"})  # 10 s
        await client.wait_event(lambda e: e["type"] == "speech.started")
        await client.close()  # hang-up without DELETE: detached, speech paused
        await wait_for(http, live_server.url, sid, detached, 5)
        started = time.monotonic()
        await drain(live_server.app[SESSIONS], live_server.app[DRAIN], 4.0)
        took = time.monotonic() - started
    assert took < 2.0, f"drain waited {took:.1f} s for a session nobody can resume"
    assert len(live_server.app[SESSIONS]) == 0


async def test_a_slow_request_body_does_not_hold_the_exit_past_the_deadline() -> None:
    """Speech plays on until idle or --drain-deadline, the last events get up to 1 s, then
    every peer is closed and the process exits 0 (README, Shutdown). A client still sending
    an offer's body (a slow uplink, or on purpose) held the exit 60 s more (aiohttp's
    default wait for requests in flight)."""
    server = ServerProcess(["tests.serve_tone"], ["--drain-deadline", "1"])
    try:
        await server.ready()
        _reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            b"POST /offer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 2000\r\n\r\n{"type": "offer", '
        )
        await writer.drain()
        await asyncio.sleep(0.5)  # the handler is reading the body
        signalled = time.monotonic()
        server.terminate()
        loop = asyncio.get_running_loop()
        try:
            status = await loop.run_in_executor(None, server.proc.wait, 20)
        except subprocess.TimeoutExpired:
            status = None
        took = time.monotonic() - signalled
        writer.close()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert status == 0, f"still running {took:.1f} s after SIGTERM (drain deadline 1 s)"
    # The deadline, the last events' second, the runner's 6 s for requests in flight.
    assert took <= 1 + 1 + 6 + 2, f"exited {took:.1f} s after SIGTERM (drain deadline 1 s)"
