"""Peer connections and the agent sessions they carry: creation from an offer, lookup, close."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
from agent.governor import ComplexityGovernor
from agent.hooks import SessionHooks
from agent.logcontext import SESSION_ID, session_context
from agent.room import Room, RoomMember
from agent.session import AgentSession
from agent.threads import cores
from agent.vad import VadPool
from signaling.errors import ApiError
from signaling.lifecycle import Liveness, Verdict, check_interval, grace_over, tap_rtcp, verdict
from signaling.negotiation import OpusOffer, read_opus_offer, tune_answer
from signaling.release import close_peer_connection
from signaling.resume import TokenBook, new_token, session_expired
from signaling.rooms import RoomRegistry, offer_sends_audio
from signaling.sdp import (
    add_mdns_fallback,
    bundle_as_offered,
    check_dtls_fingerprints,
    check_offer_sdp,
    explicit_directions,
    opus_first,
)
from signaling.shutdown import shutting_down
from signaling.ssrcguard import limit_inbound_ssrcs

log = logging.getLogger(__name__)

DATA_CHANNEL_LABEL = "agent"
WORKER_ID_PREFIX = "w"
SERVER_FULL_RETRY_S = 10  # Retry-After for server_full: sessions last minutes, not seconds


@dataclass
class Peer:
    pc: RTCPeerConnection
    session: AgentSession | RoomMember  # a room participant shares the room's agent
    kind: str  # "offer" | "whep"
    room: str | None = None
    role: str = "host"  # the token's role ("host" without authentication)
    token: str = field(default_factory=new_token, repr=False)  # for resuming (signaling/resume.py)
    life: Liveness = field(default_factory=Liveness)
    ever_connected: bool = False  # a peer connection of this session reached "connected"
    resuming: bool = False  # a resume is negotiating a new peer connection


class SessionRegistry:
    def __init__(
        self,
        config: Config,
        engine: TTSEngine,
        on_closed: Callable[[Peer], None] | None = None,
        on_room_closed: Callable[[Room], None] | None = None,
    ) -> None:
        """``on_closed`` is called once per session as it leaves the registry,
        ``on_room_closed`` once per room as it closes."""
        self.config = config
        self.engine = engine
        self._on_closed = on_closed
        self._peers: dict[str, Peer] = {}
        self._creating = 0  # offers being answered: they count against max_sessions
        self._closing: set[asyncio.Task[Any]] = set()
        # close_all() began (the drain): an offer answered after it must not be registered.
        self._closed = False
        self.encode_executor = _encode_executor(config.opus.encode_threads)
        # Every encoder of this process (sessions, room agents, room speakers) steps its
        # complexity down together while the CPU cannot keep up.
        self.governor = ComplexityGovernor(
            config.opus.complexity,
            config.opus.complexity_floor,
            cap_band=config.opus.band_cap_under_load,
        )
        # In a worker process ids start with "w<index>-": the front routes by the id alone.
        index = config.worker_index
        self._id_prefix = f"{WORKER_ID_PREFIX}{index}-" if index is not None else ""
        self.tokens = TokenBook()
        self._watchdog: asyncio.Task[None] | None = None
        self.rooms = RoomRegistry(
            config, engine, self.encode_executor, self.governor, on_closed=on_room_closed
        )
        # silero-vad for every session's microphone, loaded off the loop at startup by the
        # app, before /readyz says ready (with ChatTTS torch is imported already and loading
        # takes ~0.15 s; alone, ~3 s). Importing torch holds the GIL long enough to stall
        # audio pacing: at the first microphone, as it was, every session's audio paused.
        self.vad_pool = VadPool(config.listen.vad_threads)

    @property
    def listening_ready(self) -> bool:
        """Nothing left to load for microphones (the app loads the model at startup)."""
        return not self.config.listen.enabled or self.vad_pool.settled

    def __len__(self) -> int:
        return len(self._peers)

    @property
    def load(self) -> int:
        """Open sessions plus offers being answered (they take seconds: ICE gathering)."""
        return len(self._peers) + self._creating

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
        name: str | None = None,
    ) -> tuple[Peer, str]:
        """Answer an offer: returns the peer and the answer SDP (ICE gathered, non-trickle).

        ``peer_ip`` is the address the HTTP request came from (for mDNS candidates).
        """
        self.check_capacity()
        offer_sdp, opus_offer = _read_offer(sdp, peer_ip, self.config)
        if not self.engine.ready:
            raise ApiError(
                503, "not_ready", "the speech engine is still loading", {"Retry-After": "5"}
            )
        # No await since check_capacity(): no other offer can have slipped in between.
        self._creating += 1
        unnamed = SESSION_ID.set(SESSION_ID.get())  # what to go back to: _create names the id
        try:
            return await self._create(offer_sdp, opus_offer, kind, room, role, hooks, name)
        except BaseException:
            # No session came of it (room full, SDP aiortc refused, the drain): the request's
            # remaining lines, its access-log line among them, must not name an id that no
            # session and no client ever had. (The half-made session's own lines did.)
            SESSION_ID.reset(unnamed)
            raise
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
        name: str | None = None,
    ) -> tuple[Peer, str]:
        session_id = self._id_prefix + uuid.uuid4().hex
        # Set before the peer connection exists: the tasks it and the session start inherit
        # this context, so their log lines carry the session id too.
        SESSION_ID.set(session_id)
        session: AgentSession | RoomMember
        if room is not None:
            # Admitted before any await, so concurrent joins cannot overfill the room.
            session = self.rooms.join(
                room,
                session_id,
                speaking=kind == "offer" and offer_sends_audio(offer_sdp),
                host=role == "host",
                display_name=name,
                hooks=hooks,
                expects_channel=kind == "offer",
            )
        else:
            session = AgentSession(
                session_id,
                self.engine,
                self.config,
                self.encode_executor,
                governor=self.governor,
                expects_channel=kind == "offer",
                hooks=hooks,
            )
        # The token carries the worker prefix too: a resume reaches this process.
        peer = Peer(
            None,  # type: ignore[arg-type]
            session,
            kind,
            room,
            role,
            token=self._id_prefix + new_token(),
        )
        try:
            peer.pc, answer = await self._connect(peer, offer_sdp, opus_offer)
        except BaseException as exc:
            await session.close()
            if self._closed and isinstance(exc, Exception):
                raise shutting_down() from None  # e.g. the encode threads were shut down
            raise
        if self._closed:
            # close_all() ran while this offer was answered: it cannot have closed this one,
            # and nothing would after it (the process exits).
            log.info("session %s: answered after the drain closed everything", session_id)
            await _close_quietly(peer.pc)
            await session.close()
            raise shutting_down()
        self._peers[session_id] = peer
        self.tokens.add(peer.token, session_id)
        session.start()
        self._start_watchdog()
        log.info("session %s created (%s, %d active)", session_id, kind, len(self._peers))
        return peer, answer

    async def _connect(
        self, peer: Peer, offer_sdp: str, opus_offer: OpusOffer
    ) -> tuple[RTCPeerConnection, str]:
        """A new peer connection carrying ``peer``'s session, answered (not yet connected)."""
        session = peer.session
        pc = RTCPeerConnection(self._rtc_configuration())
        # A new connection's own liveness, but the session's use goes on: a resume is no
        # use of it (else a forgotten tab on a flaky network, resuming by itself, was never
        # closed for idleness).
        life = Liveness(last_activity=peer.life.last_activity)
        # A listener "may only receive": its microphone (a WHEP post with a sendrecv
        # section) is not heard, or it would talk to the agent, barge in on a host's speech
        # and spend the speech-to-text and LLM services (found by review).
        listens = isinstance(session, AgentSession) and peer.role != "listener"
        if listens:
            assert isinstance(session, AgentSession)
            # Fired inside setRemoteDescription for an offer that sends audio (a microphone).
            pc.on("track", lambda track: self._on_track(session, pc, track, life))
        try:
            try:
                await pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
            except Exception as exc:  # noqa: BLE001 - aiortc raises many types on SDP it can't use
                raise ApiError(400, "bad_sdp", f"could not apply the offer: {exc}") from None
            check_dtls_fingerprints(offer_sdp)
            if not limit_inbound_ssrcs(pc):
                log.warning("aiortc's RTP router is not the one known: inbound SSRCs unbounded")
            tune_answer(pc, opus_offer)
            transceiver = None
            if isinstance(session, RoomMember):
                session.attach_peer(pc, _receiver_opus(opus_offer))
            else:
                sender = pc.addTrack(session.track)
                transceiver = next(t for t in pc.getTransceivers() if t.sender is sender)
                if not listens:
                    transceiver.direction = "sendonly"  # answered so: the peer sends nothing
            # The microphone a 1:1 session listens to may be on any audio section (a client
            # that offers recvonly first, then its microphone sendonly): that one stays.
            inbound = session.inbound if isinstance(session, AgentSession) else None
            _refuse_unused_media(pc, inbound.track if inbound is not None else None)
            for each in pc.getSenders():  # any RTCP from the peer says it is still there
                tap_rtcp(each, life.heard)
            if peer.kind == "offer":
                pc.on("datachannel", lambda ch: self._on_datachannel(session, ch, life))
            pc.on("connectionstatechange", lambda: self._on_state(peer, pc, life))
            try:
                answer = await pc.createAnswer()
            except Exception as exc:  # noqa: BLE001 - an offer aiortc parsed but can't answer
                raise ApiError(400, "bad_sdp", f"could not answer the offer: {exc}") from None
            await pc.setLocalDescription(answer)  # gathers ICE: up to 5 s with STUN/TURN
            # The client's time to connect runs from its answer, not from before the
            # gathering (a slow STUN server used to take it off --connect-timeout).
            life.created_at = time.monotonic()
            if transceiver is not None and isinstance(session, AgentSession):
                session.attach_sender(transceiver, _receiver_opus(opus_offer))
        except BaseException:
            await _close_quietly(pc)
            raise
        peer.life = life
        return pc, bundle_as_offered(pc.localDescription.sdp, offer_sdp)

    # --- resume --------------------------------------------------------------------------
    def by_token(self, token: object) -> Peer:
        """The session a client's session token names (4xx: bad, unknown or expired)."""
        peer = self._peers[self.tokens.session_id(token)]
        SESSION_ID.set(peer.session.id)
        if not peer.resuming and grace_over(peer.life, self.config.lifecycle, time.monotonic()):
            # The grace is over even if the watchdog (once a second) has not looked yet: a
            # resume then took the expired session over, and its answer hung on the tick.
            log.info("session %s: not resumed in time", peer.session.id)
            self._spawn(self.close(peer.session.id), peer.session.id)
            raise session_expired()
        return peer

    async def resume(self, peer: Peer, sdp: object, peer_ip: str | None) -> str:
        """Give ``peer``'s session a new peer connection from a fresh offer: same session,
        queue and voice; playout resumes where it paused. Returns the answer SDP."""
        offer_sdp, opus_offer = _read_offer(sdp, peer_ip, self.config)
        if peer.resuming:
            raise ApiError(409, "resume_in_progress", "this session is already being resumed")
        peer.resuming = True
        try:
            old = peer.pc
            if peer.life.detached_at is None:
                # The client knows before we do (it switched networks, say): drop the old one.
                peer.life.detached_at = time.monotonic()
                peer.life.lost_reason = "resumed"
            await close_peer_connection(old)
            if isinstance(peer.session, AgentSession):
                # Its microphone went with it: the new connection's (its track event fires in
                # the negotiation below) takes the old one's place.
                await peer.session.stop_listening()
            # DELETE, the watchdog (grace over) or the drain may have closed the session while
            # the old connection closed: then there is nothing to resume.
            ended = self._ended(peer)
            if ended is not None:
                raise ended
            # aiortc stops a track with its sender: playout goes on in a new one.
            if not isinstance(peer.session, AgentSession):  # routes refuse it before this
                raise ApiError(400, "not_resumable", "room participants rejoin the room instead")
            peer.session.renew_track()
            try:
                pc, answer = await self._connect(peer, offer_sdp, opus_offer)
            except Exception:
                # A session closed mid-negotiation fails it (its encoder is closed, say): the
                # client is told the session ended, not about that failure. _connect closed
                # its peer connection; the session is closed again for what the negotiation
                # attached to it (below).
                ended = self._ended(peer)
                if ended is None:
                    raise
                await peer.session.close()
                raise ended from None
            ended = self._ended(peer)
            if ended is not None:
                # Closed during the negotiation: close() closed the old peer connection, so
                # this one is ours to close, with what it attached to the session (a listener
                # on the new microphone track; closing a session again is harmless).
                await _close_quietly(pc)
                await peer.session.close()
                raise ended
            peer.pc = pc
            log.info("session %s resumed (%s)", peer.session.id, peer.kind)
            return answer
        finally:
            peer.resuming = False

    def _ended(self, peer: Peer) -> ApiError | None:
        """Why a resume's session is gone, if it ended while the resume awaited: 503
        ``shutting_down`` once the drain closes everything, else 410 ``session_expired``
        (closed by DELETE or the watchdog: what its token gets from now on too)."""
        if self._closed:
            return shutting_down()
        if self._peers.get(peer.session.id) is not peer:
            return session_expired()
        return None

    # --- watchdog ------------------------------------------------------------------------
    def _start_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            # Started by the first session's offer, in its context: a copy of that would put
            # its id on every line the watchdog writes about any session, for good.
            self._watchdog = asyncio.get_running_loop().create_task(
                self._watch(), context=contextvars.Context()
            )

    async def _watch(self) -> None:
        interval = check_interval(self.config.lifecycle)
        while True:
            await asyncio.sleep(interval)
            try:
                self._check_all()
            except Exception:  # the watchdog must outlive any one session's trouble
                log.exception("session watchdog failed")

    def _check_all(self) -> None:
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.resuming:
                continue
            session_id = peer.session.id
            named = SESSION_ID.set(session_id)  # the lines below are about this session
            try:
                self._check(peer, now)
            except Exception:
                # One session's trouble must not stop the others' checks (the pass went on
                # to no later session, every tick), and a session whose timeouts can no
                # longer be enforced would live for ever: it is closed.
                log.exception("session %s: lifecycle check failed: closing it", session_id)
                self._spawn(self.close(session_id), session_id)
            finally:
                SESSION_ID.reset(named)

    def _check(self, peer: Peer, now: float) -> None:
        if isinstance(peer.session, RoomMember):
            # Speech anywhere in a room keeps all of it: speakers talking to each other
            # (the agent silent) and the listeners hearing them are in use too.
            peer.life.active_since(peer.session.room.last_speech(now))
        else:
            if peer.session.pipeline.sounding:  # not merely a stream left open
                peer.life.active()
            # The user talking (VAD) is in use too, answered or not: no abandoned tab.
            peer.life.active_since(peer.session.conversation.user_heard_at(now))
        connected = peer.pc.connectionState == "connected"
        session_id = peer.session.id
        match verdict(peer.life, connected, self.config.lifecycle, now):
            case Verdict.LOST:
                self._spawn(self._lose(peer, peer.pc), session_id)
            case Verdict.EXPIRED:
                log.info("session %s: not resumed in time", session_id)
                self._spawn(self.close(session_id), session_id)
            case Verdict.IDLE:
                log.info("session %s: idle", session_id)
                peer.session.send_event({"type": "session.closed", "reason": "idle_timeout"})
                self._spawn(self.close(session_id), session_id)

    async def _lose(self, peer: Peer, pc: RTCPeerConnection) -> None:
        """``pc`` is gone: keep the session for a resume if it may have one, else close."""
        if self._peers.get(peer.session.id) is not peer or peer.pc is not pc or peer.resuming:
            return  # already closed, replaced or being replaced
        if peer.life.detached_at is not None:
            return
        reason = peer.life.lost_reason or pc.connectionState
        resumable = isinstance(peer.session, AgentSession)  # a room seat is simply left
        if resumable and peer.ever_connected and self.config.lifecycle.resume_grace_s > 0:
            peer.life.detached_at = time.monotonic()
            log.info(
                "session %s: peer lost (%s); playout paused, %.0f s to resume",
                peer.session.id,
                reason,
                self.config.lifecycle.resume_grace_s,
            )
            await close_peer_connection(pc)
        else:
            log.info("session %s: peer lost (%s)", peer.session.id, reason)
            await self.close(peer.session.id)

    def _spawn(self, coro: Any, session_id: str) -> None:
        """Run ``coro`` (losing or closing ``session_id``) on its own, its lines naming that
        session whatever context spawns it (the watchdog's names none)."""
        task = asyncio.get_running_loop().create_task(coro, context=session_context(session_id))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @staticmethod
    def _on_datachannel(
        session: AgentSession | RoomMember, channel: RTCDataChannel, life: Liveness
    ) -> None:
        if channel.label == DATA_CHANNEL_LABEL:
            session.attach_channel(channel)

            @channel.on("message")
            def _heard(_raw: object) -> None:
                life.heard()
                life.active()

        else:
            log.info("session %s: ignoring data channel %r", session.id, channel.label[:40])

    def _on_track(
        self, session: AgentSession, pc: RTCPeerConnection, track: Any, life: Liveness
    ) -> None:
        if track.kind != "audio":
            return
        for transceiver in pc.getTransceivers():
            if transceiver.receiver.track is track:
                # The peer still heard (its RTCP, its messages) tells a microphone that
                # stopped from a connection that dropped (agent/inbound.py _watch_quiet).
                session.listen(
                    track, transceiver.receiver, self.vad_pool, lambda: life.last_inbound
                )
                return

    def _on_state(self, peer: Peer, pc: RTCPeerConnection, life: Liveness) -> None:
        state = pc.connectionState
        if state == "connected":
            life.connected()
            peer.ever_connected = True
        elif state in ("failed", "closed"):
            if life.lost_reason is None:
                life.lost_reason = state
            self._spawn(self._lose(peer, pc), peer.session.id)

    async def close(self, session_id: str) -> bool:
        peer = self._peers.pop(session_id, None)
        if peer is None:
            return False
        self.tokens.end(peer.token)
        if self._on_closed is not None:
            self._on_closed(peer)
        try:
            await peer.session.close()
        finally:
            await close_peer_connection(peer.pc)
        log.info("session %s closed (%d active)", session_id, len(self._peers))
        return True

    async def close_all(self) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(
            *(
                loop.create_task(self.close(sid), context=session_context(sid))
                for sid in list(self._peers)
            ),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                log.error("closing a session failed: %r", result)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self.encode_executor is not None:
            self.encode_executor.shutdown(wait=False, cancel_futures=True)
        self.governor.close()
        self.vad_pool.close()


MIN_OFFER_SECTIONS = 16


def _read_offer(sdp: object, peer_ip: str | None, config: Config) -> tuple[str, OpusOffer]:
    """The offer's SDP checked and prepared for aiortc, and what it says about Opus."""
    # The agent's audio, a room's speaker slots and the data channel, plus a few a client
    # may add and get refused in the answer (video): aiortc's parse and answer cost the
    # event loop ~0.2 ms a section, 15 ms for the 80 that fit in the size limit. At least
    # MIN_OFFER_SECTIONS: a room page offers its slots whatever the server's setting
    # (static/room.js: 4 unless ?slots=N), and the extra ones are answered unused.
    max_sections = max(MIN_OFFER_SECTIONS, config.rooms.max_speakers + 4)
    offer_sdp = add_mdns_fallback(
        explicit_directions(opus_first(check_offer_sdp(sdp, max_sections))),
        peer_ip,
        lambda: get_host_addresses(use_ipv4=True, use_ipv6=False),
    )
    return offer_sdp, read_opus_offer(offer_sdp)


async def _close_quietly(pc: RTCPeerConnection) -> None:
    """Close a peer connection that failed half-way through negotiation. aiortc 1.16 itself
    raises from close() in some of those states (e.g. an SCTP transport never bound when
    the audio section has no a=mid; found by tests/test_fuzz.py): the offer's own error is
    what the client must get, never this one."""
    try:
        await close_peer_connection(pc)
    except Exception:  # see above; nothing else holds this pc
        log.debug("closing a half-negotiated peer connection failed", exc_info=True)


def _refuse_unused_media(pc: RTCPeerConnection, listened: object | None) -> None:
    """Answer ``inactive`` the sections the agent neither sends on nor listens to (a second
    audio section of a 1:1 call, one past a room's slots, video): aiortc would otherwise
    receive what the peer sends there, decoding it (video too, at a video decoder's cost)
    into a queue that only a reader empties, on the event loop's CPU. ``listened``: the
    microphone track the session listens to."""
    for transceiver in pc.getTransceivers():
        if transceiver.sender.track is None and transceiver.receiver.track is not listened:
            transceiver.direction = "inactive"


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
        threads = cores() - 1
    if threads == 0:
        return None
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="opus-encode")
