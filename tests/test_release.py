"""A closed session is freed by reference counting, not left to the cyclic garbage collector.

signaling/release.py explains why it matters (bench/soak.py's RSS growth). With the
collector switched off, a session that connected, spoke and left (goodbye, hang-up or a
vanished client) must leave none of its server-side objects alive: the peer connection and
its transports, the OpenSSL DTLS connection, the agent session, its track and its libopus
encoder. Any new reference cycle through them fails this test.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection

from agent.config import Config, LifecycleSettings
from agent.room import RoomMember
from agent.session import AgentSession
from signaling.keys import SESSIONS
from signaling.release import close_peer_connection, release_closed
from signaling.sessions import SessionRegistry
from tests.conftest import LiveServer
from tests.doubles import ToneMicrophone
from tests.netem import relayed_client
from tests.rtc_client import RtcClient

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server_config() -> Config:
    life = LifecycleSettings(
        connect_timeout_s=5, rtcp_timeout_s=2.0, resume_grace_s=0.5, idle_timeout_s=0
    )
    return Config(host="127.0.0.1", port=0, lifecycle=life)


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def watch_session(registry: SessionRegistry) -> dict[str, weakref.ref[Any]]:
    """Weak references to the one open session's server-side objects."""
    (peer,) = registry.peers()
    session = peer.session
    assert isinstance(session, AgentSession)
    objects: dict[str, Any] = {
        "peer connection": peer.pc,
        "session": session,
        "track": session.track,
        "encoder": session.track.encoder,
    }
    sctp = peer.pc.sctp
    assert sctp is not None
    objects["sctp"] = sctp
    for index, transceiver in enumerate(peer.pc.getTransceivers()):
        dtls = transceiver.sender.transport
        objects[f"sender {index}"] = transceiver.sender
        objects[f"dtls {index}"] = dtls
        objects[f"ice {index}"] = dtls.transport
        objects[f"openssl connection {index}"] = dtls._ssl
    return {name: weakref.ref(obj) for name, obj in objects.items()}


async def session_closed(registry: SessionRegistry) -> None:
    async with asyncio.timeout(10):
        while len(registry):
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # closing tasks finish


def alive(watched: dict[str, weakref.ref[Any]]) -> list[str]:
    return [name for name, ref in watched.items() if ref() is not None]


async def speak(client: RtcClient) -> None:
    client.send({"type": "say", "text": "hello there", "id": "u1"})
    await client.wait_event(lambda e: e["type"] == "speech.ended", 10)


async def speak_and_end(
    client: RtcClient,
    registry: SessionRegistry,
    watched: dict[str, weakref.ref[Any]],
    *,
    delete: bool = True,
) -> None:
    """Speak, end the call (a DELETE first: "goodbye"), and check nothing watched lives on."""
    await speak(client)
    if delete:
        async with client.http.delete(f"{client.base_url}/sessions/{client.session_id}"):
            pass
    await client.close()
    await session_closed(registry)
    assert alive(watched) == []


@pytest.mark.parametrize("how", ["goodbye", "hang-up"])
async def test_a_closed_session_is_freed_without_the_cyclic_collector(
    live_server: LiveServer, how: str
) -> None:
    registry = live_server.app[SESSIONS]
    async with aiohttp.ClientSession() as http:
        with collector_off():
            client = RtcClient(live_server.url, http)
            await client.connect()
            watched = watch_session(registry)
            await speak_and_end(client, registry, watched, delete=how == "goodbye")


async def test_a_vanished_client_s_session_is_freed_without_the_cyclic_collector(
    live_server: LiveServer,
) -> None:
    """Nothing passes any more: lost after the RTCP timeout, closed after the grace."""
    registry = live_server.app[SESSIONS]
    async with aiohttp.ClientSession() as http:
        with collector_off():
            async with relayed_client(live_server.url, http) as (client, relay):
                watched = watch_session(registry)
                await speak(client)
                relay.blackout = True
                await session_closed(registry)
            assert alive(watched) == []


async def test_release_is_idempotent_and_works_on_a_never_connected_pc() -> None:
    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="recvonly")
    pc.createDataChannel("agent")
    await pc.setLocalDescription(await pc.createOffer())
    await pc.close()
    release_closed(pc)
    release_closed(pc)
    watched = weakref.ref(pc)
    with collector_off():
        del pc
        assert watched() is None


def watch_peer(peer: Any) -> dict[str, weakref.ref[Any]]:
    """Weak references to a room participant's server-side objects."""
    member = peer.session
    assert isinstance(member, RoomMember)
    objects: dict[str, Any] = {
        "peer connection": peer.pc,
        "member": member,
        "track": member.track,
    }
    for index, transceiver in enumerate(peer.pc.getTransceivers()):
        dtls = transceiver.sender.transport
        objects[f"sender {index}"] = transceiver.sender
        objects[f"dtls {index}"] = dtls
        objects[f"openssl connection {index}"] = dtls._ssl
    return {name: weakref.ref(obj) for name, obj in objects.items()}


async def test_a_room_participant_and_then_the_room_are_freed_without_the_cyclic_collector(
    live_server: LiveServer,
) -> None:
    """One participant leaves a room that goes on (its objects go), then the last one leaves
    (the room and its agent pipeline go too)."""
    registry = live_server.app[SESSIONS]
    async with aiohttp.ClientSession() as http:
        with collector_off():
            first = RtcClient(live_server.url, http)
            second = RtcClient(live_server.url, http)
            await first.connect(room="freed", slots=2)
            await second.connect(room="freed", mic=ToneMicrophone(1000.0), slots=2)
            peers = {peer.session.id: peer for peer in registry.peers()}
            watched_first = watch_peer(peers[first.session_id])
            watched_second = watch_peer(peers[second.session_id])
            room = peers[first.session_id].session.room
            async with asyncio.timeout(10):  # the speaker's microphone gets its feed
                while not any(room.slots):
                    await asyncio.sleep(0.05)
            (feed,) = [feed for feed in room.slots if feed is not None]
            watched_room = {
                "room": weakref.ref(room),
                "pipeline": weakref.ref(room.pipeline),
                "speaker feed": weakref.ref(feed),
            }
            del peers, room, feed
            async with http.delete(f"{live_server.url}/sessions/{first.session_id}"):
                pass
            await first.close()
            async with asyncio.timeout(10):
                while len(registry) > 1:
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            assert alive(watched_first) == []
            # The speaker is still in the room.
            assert alive(watched_room) == ["room", "pipeline", "speaker feed"]
            async with http.delete(f"{live_server.url}/sessions/{second.session_id}"):
                pass
            await second.close()
            await session_closed(registry)
            assert alive(watched_second) == []
            assert alive(watched_room) == []


async def test_a_close_that_hangs_is_given_up(caplog: pytest.LogCaptureFixture) -> None:
    """aiortc's close waits for its receivers' RTCP tasks to say they exited; one that died
    of an exception never says so, and the session's close (and the drain at shutdown)
    waited forever with it. It is given up after a deadline now, and said."""
    pc = RTCPeerConnection()

    async def hangs() -> None:
        await asyncio.Event().wait()

    pc.close = hangs  # type: ignore[method-assign]
    async with asyncio.timeout(5):
        await close_peer_connection(pc, timeout_s=0.2)
    assert "did not finish in 0 s: given up" in caplog.text
    await RTCPeerConnection.close(pc)


async def connected_pair() -> tuple[RTCPeerConnection, RTCPeerConnection]:
    """Two peer connections on loopback, connected: audio both ways and a data channel."""
    offerer = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    answerer = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    offerer.addTransceiver("audio", direction="sendrecv")
    offerer.createDataChannel("agent")
    await offerer.setLocalDescription(await offerer.createOffer())
    await answerer.setRemoteDescription(offerer.localDescription)
    await answerer.setLocalDescription(await answerer.createAnswer())
    await offerer.setRemoteDescription(answerer.localDescription)
    async with asyncio.timeout(15):
        while answerer.connectionState != "connected":
            await asyncio.sleep(0.05)
    return offerer, answerer


async def rtcp_task_never_exits(receiver: Any) -> None:
    """As a receiver whose RTCP task died of an exception: its stop() stops the decoder
    thread, then waits for that task to say it exited, which it never will (replacing stop()
    whole left the decoder thread running, and the test process never exited)."""
    rtcp_task = receiver._RTCRtpReceiver__rtcp_task
    rtcp_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await rtcp_task
    receiver._RTCRtpReceiver__rtcp_exited = asyncio.Event()


async def test_a_close_given_up_still_stops_the_transports_and_a_later_close_returns() -> None:
    """Bug: wait_for cancelled ``pc.close()`` inside its first step (stopping the
    transceivers), so the steps after it never ran: the DTLS and ICE transports were never
    stopped, the session's UDP sockets stayed open and aioice kept sending consent checks,
    per session whose close was given up, for the life of the process; and a later close()
    waited forever on the close future it had left unsettled (found by review)."""
    offerer, answerer = await connected_pair()
    receiver = answerer.getTransceivers()[0].receiver
    await rtcp_task_never_exits(receiver)
    ice = receiver.transport.transport
    try:
        await close_peer_connection(answerer, timeout_s=0.3)
        await asyncio.sleep(0.1)
        state = (ice.state, len(ice._connection._protocols))
        async with asyncio.timeout(2):
            await answerer.close()
    finally:
        await offerer.close()
        await ice.stop()
    assert state == ("closed", 0), (
        f"after the close was given up: ICE {state[0]}, {state[1]} sockets"
    )
