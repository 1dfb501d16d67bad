"""Peer connections and the agent sessions they carry: creation from an offer, lookup, close."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aioice.ice import get_host_addresses
from aiortc import (
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCSessionDescription,
)

from agent.adaptation import ReceiverOpus
from agent.config import Config
from agent.engine import TTSEngine
from agent.hooks import SessionHooks
from agent.logcontext import SESSION_ID
from agent.session import AgentSession
from agent.vad import VadPool
from signaling.errors import ApiError
from signaling.negotiation import OpusOffer, read_opus_offer, tune_answer
from signaling.sdp import add_mdns_fallback, check_offer_sdp, opus_first

log = logging.getLogger(__name__)

DATA_CHANNEL_LABEL = "agent"
SERVER_FULL_RETRY_S = 10  # Retry-After for server_full: sessions last minutes, not seconds


@dataclass
class Peer:
    pc: RTCPeerConnection
    session: AgentSession
    kind: str  # "offer" | "whep"
    room: str | None = None
    role: str = "host"  # the token's role ("host" without authentication)


class SessionRegistry:
    def __init__(
        self,
        config: Config,
        engine: TTSEngine,
        on_closed: Callable[[Peer], None] | None = None,
    ) -> None:
        """``on_closed`` is called once per session as it leaves the registry."""
        self.config = config
        self.engine = engine
        self._on_closed = on_closed
        self._peers: dict[str, Peer] = {}
        self._creating = 0  # offers being answered: they count against max_sessions
        self._closing: set[asyncio.Task[bool]] = set()
        self.encode_executor = _encode_executor(config.opus.encode_threads)
        # silero-vad for every session's microphone, loaded off the loop on first use (with
        # ChatTTS torch is imported already and loading takes ~0.15 s; alone, ~3 s). Not
        # loaded eagerly: importing torch holds the GIL long enough to stall audio pacing.
        self.vad_pool = VadPool(config.listen.vad_threads)

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, session_id: str) -> Peer:
        peer = self._peers.get(session_id)
        if peer is None:
            raise ApiError(404, "unknown_session", f"no session {session_id[:64]!r}")
        SESSION_ID.set(session_id)  # this request's log lines name the session
        return peer

    def peers(self) -> list[Peer]:
        return list(self._peers.values())

    def _rtc_configuration(self) -> RTCConfiguration:
        servers = [
            RTCIceServer(
                urls=url, username=self.config.ice_username, credential=self.config.ice_credential
            )
            for url in self.config.ice_servers
        ]
        return RTCConfiguration(iceServers=servers)

    def check_capacity(self) -> None:
        """503 ``server_full`` when max_sessions are open or being opened."""
        if len(self._peers) + self._creating >= self.config.limits.max_sessions:
            raise ApiError(
                503,
                "server_full",
                f"the server holds its maximum of {self.config.limits.max_sessions} sessions",
                {"Retry-After": str(SERVER_FULL_RETRY_S)},
            )

    async def create(
        self,
        sdp: object,
        kind: str,
        room: str | None = None,
        peer_ip: str | None = None,
        *,
        role: str = "host",
        hooks: SessionHooks | None = None,
    ) -> tuple[Peer, str]:
        """Answer an offer: returns the peer and the answer SDP (ICE gathered, non-trickle).

        ``peer_ip`` is the address the HTTP request came from (for mDNS candidates).
        """
        self.check_capacity()
        offer_sdp = add_mdns_fallback(
            opus_first(check_offer_sdp(sdp)),
            peer_ip,
            lambda: get_host_addresses(use_ipv4=True, use_ipv6=False),
        )
        opus_offer = read_opus_offer(offer_sdp)
        if not self.engine.ready:
            raise ApiError(
                503, "not_ready", "the speech engine is still loading", {"Retry-After": "5"}
            )
        # No await since check_capacity(): no other offer can have slipped in between.
        self._creating += 1
        try:
            return await self._create(offer_sdp, opus_offer, kind, room, role, hooks)
        finally:
            self._creating -= 1

    async def _create(
        self,
        offer_sdp: str,
        opus_offer: OpusOffer,
        kind: str,
        room: str | None,
        role: str,
        hooks: SessionHooks | None,
    ) -> tuple[Peer, str]:
        session_id = uuid.uuid4().hex
        # Set before the peer connection exists: the tasks it and the session start inherit
        # this context, so their log lines carry the session id too.
        SESSION_ID.set(session_id)
        pc = RTCPeerConnection(self._rtc_configuration())
        session = AgentSession(
            session_id,
            self.engine,
            self.config,
            self.encode_executor,
            expects_channel=kind == "offer",
            hooks=hooks,
        )
        peer = Peer(pc, session, kind, room, role)
        # Fired inside setRemoteDescription for an offer that sends audio (a microphone).
        pc.on("track", lambda track: self._on_track(session, pc, track))
        try:
            try:
                await pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
            except Exception as exc:  # noqa: BLE001 - aiortc raises many types on SDP it can't use
                raise ApiError(400, "bad_sdp", f"could not apply the offer: {exc}") from None
            tune_answer(pc, opus_offer)
            sender = pc.addTrack(session.track)
            if kind == "offer":
                pc.on("datachannel", lambda channel: self._on_datachannel(session, channel))
            pc.on("connectionstatechange", lambda: self._on_state(session_id, pc))
            answer = await pc.createAnswer()
            await pc.setLocalDescription(answer)
            session.attach_sender(sender, _receiver_opus(opus_offer))
        except BaseException:
            await session.close()
            await pc.close()
            raise
        self._peers[session_id] = peer
        session.start()
        log.info("session %s created (%s, %d active)", session_id, kind, len(self._peers))
        return peer, pc.localDescription.sdp

    @staticmethod
    def _on_datachannel(session: AgentSession, channel: RTCDataChannel) -> None:
        if channel.label == DATA_CHANNEL_LABEL:
            session.attach_channel(channel)
        else:
            log.info("session %s: ignoring data channel %r", session.id, channel.label[:40])

    def _on_track(self, session: AgentSession, pc: RTCPeerConnection, track: Any) -> None:
        if track.kind != "audio":
            return
        for transceiver in pc.getTransceivers():
            if transceiver.receiver.track is track:
                session.listen(track, transceiver.receiver, self.vad_pool)
                return

    def _on_state(self, session_id: str, pc: RTCPeerConnection) -> None:
        if pc.connectionState in ("failed", "closed"):
            self._close_soon(session_id)

    def _close_soon(self, session_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.close(session_id))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self, session_id: str) -> bool:
        peer = self._peers.pop(session_id, None)
        if peer is None:
            return False
        if self._on_closed is not None:
            self._on_closed(peer)
        try:
            await peer.session.close()
        finally:
            await peer.pc.close()
        log.info("session %s closed (%d active)", session_id, len(self._peers))
        return True

    async def close_all(self) -> None:
        results = await asyncio.gather(
            *(self.close(sid) for sid in list(self._peers)), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                log.error("closing a session failed: %r", result)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self.encode_executor is not None:
            self.encode_executor.shutdown(wait=False, cancel_futures=True)
        self.vad_pool.close()


def _receiver_opus(offer: OpusOffer) -> ReceiverOpus:
    return ReceiverOpus(
        fec=offer.useinbandfec,
        max_bitrate=offer.maxaveragebitrate,
        max_playback_rate=offer.maxplaybackrate,
        transport_cc=offer.transport_cc,
    )


def _encode_executor(threads: int) -> ThreadPoolExecutor | None:
    """Threads shared by every session's track to encode speech frames ahead of their tick."""
    if threads < 0:
        threads = (os.cpu_count() or 1) - 1
    if threads == 0:
        return None
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="opus-encode")
