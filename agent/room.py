"""Voice rooms: several people and one agent, every voice encoded once and fanned out.

A room owns one speech pipeline (the agent), its paced Opus track, and one ``FanoutSource``
per voice: the agent's, and each speaking person's (their microphone, decoded once by
aiortc, encoded once here). A participant's peer connection carries:
- audio track 0: the agent (and, from a speaker, their microphone in the other direction);
- audio tracks 1..K ("slots"): slot s carries the person who holds speaker slot s, except
  on that person's own connection (nobody hears themselves). Clients offer the slots as
  receive-only transceivers up front, so speakers joining later need no renegotiation
  (aiortc only adds tracks through a new offer/answer, which the client would have to
  start); an unused slot sends nothing.
Room events (participant.joined/left, speaker.active, the agent's speech.*) go to everyone
over their data channels. The room closes, agent and encoders with it, when its last
participant leaves.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor
from functools import partial
from typing import Any

import av
import numpy as np
from aiortc import RTCDataChannel, RTCPeerConnection, RTCRtpSender
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from agent.adaptation import ReceiverOpus, receiver_ceiling
from agent.bitrate import BitrateController, EncoderTarget
from agent.config import Config
from agent.direct import DirectSender
from agent.engine import TTSEngine
from agent.fanout import FanoutSource, FanoutTrack, SubscriberWish
from agent.feedback import Applier, FeedbackTap, TransportSequence
from agent.governor import ComplexityGovernor
from agent.hooks import SessionHooks
from agent.opus import FRAME_SAMPLES, OpusEncoder
from agent.outbox import EventOutbox, admit_speech, error_event, refusal
from agent.protocol import (
    Chat,
    ConfigUpdate,
    Interrupt,
    Message,
    ProtocolError,
    Say,
    TextDelta,
    TextEnd,
    parse_message,
)
from agent.receive_buffer import install_receive_buffer
from agent.speech import STREAM_TIMEOUT_MESSAGE, Event, SpeechError, SpeechPipeline
from agent.track import OpusPacketTrack
from agent.turns import Conversation

log = logging.getLogger(__name__)

AGENT_ID = "agent"  # the agent's participant id in room events
ROOM_TICK_S = 1.0  # feedback hold-offs (FEC off after quiet, REMB expiry)
# How often a speaker's hold is checked without frames: a speaker whose frames stop goes
# quiet within speaking_hold_s plus this.
SPEAKING_CHECK_S = 0.2
SILENCE_DBFS = -100.0  # the level of a speaker from whom nothing arrives
# A participant's mute changes are told to the room at most this often (the latest state
# wins): a client toggling it as fast as its channel goes had every change broadcast to
# every participant, the room's CPU spent on one sender's flood.
MUTE_ANNOUNCE_INTERVAL_S = 0.2


class RoomError(Exception):
    """A join the room refuses: ``code`` is ``room_full`` or ``speakers_full``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Room:
    def __init__(
        self,
        name: str,
        engine: TTSEngine,
        config: Config,
        encode_executor: Executor | None = None,
        on_closed: Callable[[Room], None] | None = None,
        governor: ComplexityGovernor | None = None,
        on_first_audio: Callable[[float], None] | None = None,
    ) -> None:
        self.name = name
        self.governor = governor
        # Speakers' microphones are encoded there too (--encode-threads), off the loop.
        self.encode_executor = encode_executor
        self.config = config
        self.settings = config.rooms
        # ``on_first_audio``: the server's first-audio measurement, as a session's pipeline
        # has it; without it the room agent's utterances were missing from the histogram.
        self.pipeline = SpeechPipeline(
            engine,
            config.speech,
            self._agent_event,
            on_first_audio=on_first_audio,
            rate=config.opus.input_rate,
        )
        # The room's agent answers `chat` with the brain (an LLM with --llm-url, else echo),
        # one history for the room: what it said, as everyone heard it, and what was asked.
        self.conversation = Conversation(
            self.pipeline, config.listen, config.services, self.broadcast
        )
        self.agent_track = OpusPacketTrack(
            self.pipeline.buffer, config.opus, encode_executor=encode_executor, governor=governor
        )
        self.agent = FanoutSource(AGENT_ID, self._apply_agent_target)
        self.members: dict[str, RoomMember] = {}  # by participant id
        self.slots: list[SpeakerFeed | None] = [None] * self.settings.max_speakers
        self.closed = False
        # When someone in the room last talked (monotonic): its members are in use while
        # people talk to each other, whether or not anyone instructs the agent.
        self._last_speech = -math.inf
        self._on_closed = on_closed
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        # Started by the first participant's join, in its context: the room's tasks (its
        # agent's speech included) outlive that participant and are no one session's, so
        # they must not log with its id.
        contextvars.Context().run(self._start_tasks)

    def _start_tasks(self) -> None:
        self.pipeline.start()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._pump_agent()))
        self._tasks.append(loop.create_task(self._tick()))
        self._tasks.append(loop.create_task(self._watch_speakers()))

    async def _pump_agent(self) -> None:
        """The agent's one encode per 20 ms (paced by its track), published to everyone."""
        track = self.agent_track
        try:
            while True:
                spoken = track.stats.speech_packets
                packet = await track.recv()
                # Each participant counts the agent's speech it was sent, as a 1:1 peer does
                # (voice_agent_speech_packets_sent_total stayed at 0 for rooms).
                self.agent.publish(bytes(packet), speech=track.stats.speech_packets != spoken)
        except MediaStreamError:
            pass

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(ROOM_TICK_S)
            for member in list(self.members.values()):
                try:
                    member.tick()
                except Exception:  # feedback bookkeeping must never end the room
                    log.exception("room %s: tick failed", self.name)

    async def _watch_speakers(self) -> None:
        """End the hold of speakers whose frames stopped (a network drop mid-word, a client
        that sends RTCP but no RTP): their feeds measure nothing, so only a timer can."""
        while True:
            await asyncio.sleep(SPEAKING_CHECK_S)
            now = time.monotonic()
            for feed in list(self.slots):
                if feed is not None:
                    feed.check_hold(now)
            ended = self.pipeline.end_stalled_stream(now, self.members)
            member = self.members.get(ended[0]) if ended is not None else None
            if ended is not None and member is not None:
                member.send_error("stream_timeout", STREAM_TIMEOUT_MESSAGE, ended[1])

    async def close(self) -> None:
        self.closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.conversation.close()  # a reply being written, and its HTTP client
        await self.pipeline.close()
        self.agent_track.stop()
        self.agent.close()
        for feed in self.slots:
            if feed is not None:
                await feed.close()
        log.info("room %s closed", self.name)

    def discard(self) -> None:
        """Release a room that was never started (its first join was refused), at once and
        without the event loop: the agent's encoder (the governor no longer counts it) and
        the pipeline's link back to the room, which would leave the room to the cyclic
        garbage collector (the conversation's link likewise)."""
        if self._tasks:
            raise RuntimeError("a started room is closed with close()")
        self.closed = True
        self.pipeline.discard()
        self.conversation.discard()  # its events went to the room: the same link
        self.agent_track.stop()  # closes its encoder
        self.agent.close()

    # --- membership ----------------------------------------------------------------------
    def join(
        self,
        session_id: str,
        *,
        speaking: bool,
        host: bool,
        name: str | None = None,
        hooks: SessionHooks | None = None,
        expects_channel: bool = True,
    ) -> RoomMember:
        """Admit a participant now (no await: the count cannot race); RoomError when full."""
        if self.closed:
            raise RoomError("room_closed", f"room {self.name!r} is closing; join again")
        if len(self.members) >= self.settings.max_participants:
            raise RoomError(
                "room_full",
                f"room {self.name!r} holds its maximum of {self.settings.max_participants} "
                "participants",
            )
        slot: int | None = None
        if speaking:
            # Slots are reserved at join (before the microphone's track exists).
            reserved = {m.slot for m in self.members.values() if m.slot is not None}
            slot = next((i for i in range(self.settings.max_speakers) if i not in reserved), None)
            if slot is None:
                raise RoomError(
                    "speakers_full",
                    f"room {self.name!r} has its maximum of {self.settings.max_speakers} "
                    "speakers; join as a listener (receive-only)",
                )
        member = RoomMember(
            self,
            session_id,
            slot=slot,
            host=host,
            name=name,
            hooks=hooks,
            expects_channel=expects_channel,
        )
        self.members[member.participant_id] = member
        # Kept past the pending-event bound: what the client starts from (who is here, its
        # own id, who may instruct), which a busy room's events would otherwise push out.
        member.outbox.send_first({"type": "room.state", **self.describe(member)})
        # One who joins while the agent speaks gets that utterance's start too, or its
        # segments and end would come with no start.
        audible = self.pipeline.audible
        if audible is not None:
            member.send_event({"type": "speech.started", "id": audible})
        self.broadcast({"type": "participant.joined", **member.describe()}, skip=member)
        log.info(
            "room %s: %s joined (%d present)", self.name, member.participant_id, len(self.members)
        )
        return member

    async def leave(self, member: RoomMember) -> None:
        if self.members.pop(member.participant_id, None) is None:
            return
        # A text stream left open would hold the room's agent (and every other writer)
        # forever: what was streamed is spoken, as if the leaver had sent text.end.
        self.pipeline.forget_writer(member.participant_id)
        if member.slot is not None:
            feed = self.slots[member.slot]
            self.slots[member.slot] = None
            if feed is not None:
                await feed.close()
        member.release_media()
        if not self.members:
            # Out of the registry before any await: a new join makes a new room.
            self.closed = True
            if self._on_closed is not None:
                self._on_closed(self)
            await self.close()
            return
        self.broadcast({"type": "participant.left", "participant_id": member.participant_id})

    def describe(self, member: RoomMember) -> dict[str, Any]:
        return {
            "room": self.name,
            "participant_id": member.participant_id,
            "participants": [m.describe() for m in self.members.values()],
            "max_speakers": self.settings.max_speakers,
            "instruct": self.settings.instruct,
            # Heard now (from its speech.started to its end), as its speaker.active says:
            # not merely a stream open or an utterance queued.
            "agent_speaking": self.pipeline.audible is not None,
        }

    # --- media ---------------------------------------------------------------------------
    def start_speaker(self, member: RoomMember, mic: MediaStreamTrack) -> None:
        assert member.slot is not None
        feed = SpeakerFeed(self, member, mic)
        self.slots[member.slot] = feed
        for other in self.members.values():
            if other is not member:
                other.subscribe_slot(member.slot, feed.source)
        feed.start()

    def heard_speech(self, now: float) -> None:
        """A speaker's microphone was loud at ``now``."""
        self._last_speech = max(self._last_speech, now)

    def last_speech(self, now: float) -> float:
        """When anyone here last talked: ``now`` while the agent or a speaker is talking."""
        if self.pipeline.sounding or any(feed is not None and feed.active for feed in self.slots):
            self._last_speech = now
        return self._last_speech

    def on_speaking(self, member: RoomMember, active: bool, level_dbfs: float) -> None:
        self.broadcast(
            {
                "type": "speaker.active",
                "participant_id": member.participant_id,
                "slot": member.slot,
                "active": active,
                "level_dbfs": round(level_dbfs, 1),
            }
        )

    def _apply_agent_target(self, target: EncoderTarget) -> None:
        track = self.agent_track
        track.set_bitrate(target.bitrate)
        track.set_fec(target.fec)
        track.set_expected_loss(target.expected_loss_pct)
        track.set_max_playback_rate(target.max_playback_rate)

    # --- events --------------------------------------------------------------------------
    def _agent_event(self, event: Event) -> None:
        self.conversation.observe(event)  # what was played becomes the history
        self.broadcast(event)

    def broadcast(self, event: Event, skip: RoomMember | None = None) -> None:
        kind = event.get("type")
        if kind in ("speech.started", "speech.ended"):
            active = kind == "speech.started"
            self._send_all(
                {"type": "speaker.active", "participant_id": AGENT_ID, "active": active}, skip
            )
        self._send_all(event, skip)

    def _send_all(self, event: Event, skip: RoomMember | None) -> None:
        for member in list(self.members.values()):
            if member is not skip:
                member.send_event(event)


class SpeakerFeed:
    """One person's microphone: aiortc's decoded frames, encoded once, fanned out."""

    def __init__(self, room: Room, member: RoomMember, mic: MediaStreamTrack) -> None:
        self.room = room
        self.member = member
        self.mic = mic
        opus = room.config.opus
        self.encoder = OpusEncoder(
            bitrate=opus.bitrate,
            complexity=opus.complexity,
            fec=opus.fec,
            expected_loss_pct=opus.expected_loss_pct,
        )
        if room.governor is not None:
            room.governor.register(self.encoder)
        self.source = FanoutSource(f"speaker:{member.participant_id}", self._apply_target)
        self._pending = np.zeros(0, dtype=np.int16)  # samples short of a whole 20 ms frame
        # With encode threads, _on_frame leaves its 20 ms frames here for _run to encode off
        # the loop, in order (one decoded frame's worth: _run empties it before the next).
        self._executor = room.encode_executor
        self._to_encode: collections.deque[Int16Array] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        settings = room.settings
        self._threshold = settings.speaking_threshold_dbfs
        self._hold = settings.speaking_hold_s
        self._level = SILENCE_DBFS  # smoothed dBFS
        self.active = False
        self._last_loud = -math.inf
        self.frames = 0
        self.encodes = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def _apply_target(self, target: EncoderTarget) -> None:
        self.encoder.set_bitrate(target.bitrate)
        self.encoder.set_fec(target.fec)
        self.encoder.set_expected_loss(target.expected_loss_pct)
        self.encoder.set_max_playback_rate(target.max_playback_rate)

    async def _run(self) -> None:
        # Reading every frame matters even with no subscriber: aiortc's receiver queue behind
        # this track is unbounded.
        try:
            while True:
                frame = await self.mic.recv()
                if not isinstance(frame, av.AudioFrame):
                    continue
                self._on_frame(
                    _mono_int16(frame.to_ndarray(), len(frame.layout.channels)), frame.sample_rate
                )
                while self._to_encode:
                    self.source.publish(await self._encode_off_loop(self._to_encode.popleft()))
        except MediaStreamError:
            pass
        except Exception:  # a bad frame must not take the room down
            log.exception(
                "room %s: speaker %s feed failed", self.room.name, self.member.participant_id
            )

    def _on_frame(self, pcm: np.ndarray[Any, np.dtype[np.int16]], rate: int) -> None:
        if rate != 48_000:
            return  # aiortc decodes Opus at 48 kHz; anything else is not ours to fan out
        self.frames += 1
        pcm = np.concatenate((self._pending, pcm)) if self._pending.size else pcm
        whole = pcm.size // FRAME_SAMPLES * FRAME_SAMPLES
        self._pending = pcm[whole:].copy()
        for start in range(0, whole, FRAME_SAMPLES):
            chunk = pcm[start : start + FRAME_SAMPLES]
            self._measure(chunk)
            if self.source.subscribers:
                self.encodes += 1
                if self._executor is None:
                    self.source.publish(self.encoder.encode(np.ascontiguousarray(chunk)))
                else:
                    self._to_encode.append(np.ascontiguousarray(chunk))

    async def _encode_off_loop(self, chunk: Int16Array) -> bytes:
        """libopus in an encode thread (it releases the GIL): a room of four talking
        speakers is 200 encodes a second that the event loop no longer pays for."""
        assert self._executor is not None
        try:
            job = self._executor.submit(self.encoder.encode, chunk)
        except RuntimeError:  # the server is shutting its encode threads down
            return self.encoder.encode(chunk)
        # Cancelled (the speaker leaves), the encode still finishes: close() then waits on
        # the encoder's lock, and an encode after it raises instead of touching freed state.
        return await asyncio.wrap_future(job)

    def _measure(self, chunk: np.ndarray[Any, np.dtype[np.int16]]) -> None:
        rms = float(np.sqrt(np.mean(np.square(chunk, dtype=np.float64)))) / 32768.0
        level = 20 * math.log10(max(rms, 1e-6))
        # Fast attack, slow release: one loud frame counts, a short pause does not.
        self._level = level if level > self._level else 0.8 * self._level + 0.2 * level
        now = time.monotonic()
        if self._level > self._threshold:
            self._last_loud = now
            self.room.heard_speech(now)
            if not self.active:
                self.active = True
                self.room.on_speaking(self.member, True, self._level)
        else:
            self.check_hold(now)

    def check_hold(self, now: float) -> None:
        """Off ``speaking_hold_s`` after the last loud frame: from quiet frames, or from the
        room's timer when no frames arrive at all."""
        if not self.active or now - self._last_loud <= self._hold:
            return
        if self._level > self._threshold:
            # Still loud, so no frame came for the whole hold: what was heard last is not
            # what is heard now (nothing). Without this the first quiet frame after the gap
            # would smooth down from the stale loud level and flag the speaker again.
            self._level = SILENCE_DBFS
        self.active = False
        self.room.on_speaking(self.member, False, self._level)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.active:
            self.active = False
            self.room.on_speaking(self.member, False, self._level)
        self.source.close()
        self.encoder.close()


Int16Array = np.ndarray[Any, np.dtype[np.int16]]


def _mono_int16(samples: np.ndarray[Any, Any], channels: int) -> Int16Array:
    """aiortc's decoded frames are packed s16 (interleaved channels): average to mono."""
    flat = samples.reshape(-1)
    mono: Int16Array
    if channels <= 1:
        mono = flat.astype(np.int16, copy=False)
    else:
        mono = flat.reshape(-1, channels).mean(axis=1).astype(np.int16)
    return mono


def _negotiated_opus(transceiver: Any) -> bool:
    """Whether the section was negotiated with Opus first, as the fan-out sends it (aiortc
    keeps the negotiated codecs on the transceiver, the offer's order, Opus moved first)."""
    codecs = getattr(transceiver, "_codecs", None) or []
    return bool(codecs) and str(codecs[0].mimeType).lower() == "audio/opus"


@dataclasses.dataclass
class _Subscription:
    track: FanoutTrack
    wish: SubscriberWish | None = None
    tap: FeedbackTap | None = None


class RoomMember:
    """One participant: what the session registry holds in place of an AgentSession."""

    def __init__(
        self,
        room: Room,
        session_id: str,
        *,
        slot: int | None,
        host: bool,
        name: str | None,
        hooks: SessionHooks | None,
        expects_channel: bool,
    ) -> None:
        self.room = room
        self.id = session_id
        self.participant_id = uuid.uuid4().hex[:8]
        self.slot = slot  # the speaker slot this participant's microphone fills
        self.host = host
        self.name = name
        self.muted = False
        self._announced_muted = False  # as the room last heard it
        self._muted_announced_at = -math.inf
        self._mute_announcement: asyncio.TimerHandle | None = None
        self.hooks = hooks or SessionHooks()
        self.pipeline = room.pipeline  # the room's agent: HTTP say speaks into the room
        queue = room.settings.subscriber_queue_frames
        self.track = FanoutTrack(queue)  # the agent, to this participant
        self._subs: list[_Subscription] = []
        self._slots: dict[int, _Subscription] = {}
        self.outbox = EventOutbox(expects_channel, f"room {room.name}")
        self._receiver = ReceiverOpus()
        # Transport-wide sequence numbers, per transport of this participant's connection.
        self._sequences: dict[Any, TransportSequence] = {}

    @property
    def role(self) -> str:
        return "speaker" if self.slot is not None else "listener"

    @property
    def may_instruct(self) -> bool:
        return self.room.settings.instruct == "everyone" or self.host

    def describe(self) -> dict[str, Any]:
        return {
            "participant_id": self.participant_id,
            "name": self.name,
            "role": self.role,
            "slot": self.slot,
            "host": self.host,
            # As the room was told (changes go out at most every MUTE_ANNOUNCE_INTERVAL_S):
            # a joiner told otherwise could miss the next change for good.
            "muted": self._announced_muted,
            "speaking": self.speaking,
        }

    @property
    def speaking(self) -> bool:
        """Talking now (speaker.active's last word for this participant)."""
        feed = self.room.slots[self.slot] if self.slot is not None else None
        return feed is not None and feed.active

    # --- media ---------------------------------------------------------------------------
    def attach_peer(self, pc: RTCPeerConnection, receiver: ReceiverOpus) -> None:
        """Bind this participant's negotiated audio transceivers (after setRemoteDescription)."""
        self._receiver = receiver
        audio = [t for t in pc.getTransceivers() if t.kind == "audio"]
        if not audio:
            return
        room = self.room
        agent_sub = _Subscription(self.track)
        room.agent.subscribe(self.track)
        self._subs.append(agent_sub)
        # Only a speaker's microphone is received (on track 0). Anything else the peer might
        # send (a listener's or WHEP guest's microphone, audio on a slot) would be decoded
        # by aiortc into a queue nobody reads, without bound: ~200 KB/s for the whole call.
        self._send_on(audio[0], agent_sub, room.agent, receive=self.slot is not None)
        for slot, transceiver in enumerate(audio[1 : 1 + room.settings.max_speakers]):
            if not _negotiated_opus(transceiver):
                # Only G.711/G.722 offered for it: the speakers' Opus packets would go out
                # under that codec's payload type and play as noise (found by review). The
                # slot is refused; this client does not hear that speaker.
                transceiver.direction = "inactive"
                log.info("room %s: slot %d offered without Opus: refused", room.name, slot)
                continue
            sub = _Subscription(FanoutTrack(room.settings.subscriber_queue_frames))
            self._subs.append(sub)
            self._slots[slot] = sub
            feed = room.slots[slot]
            self._send_on(transceiver, sub, feed.source if feed is not None else None)
            if feed is not None and slot != self.slot:
                feed.source.subscribe(sub.track)
        mic = audio[0].receiver.track
        if self.slot is not None and mic is not None:
            # Released as packets arrive: the listeners' browsers buffer for playout, so
            # aiortc's own buffer only added 80 ms (280 ms after a loss) to every voice
            # relayed, and one packet with no payload ended its decoder for the call.
            reorder_wait = room.config.listen.receive_reorder_wait
            if not install_receive_buffer(audio[0].receiver, reorder_wait):
                log.warning("room %s: aiortc's jitter buffer left as is (+80 ms)", room.name)
            room.start_speaker(self, mic)

    def _send_on(
        self,
        transceiver: Any,
        sub: _Subscription,
        source: FanoutSource | None,
        receive: bool = False,
    ) -> None:
        transceiver.sender.replaceTrack(sub.track)
        # The answer intersects it with the offer's direction.
        transceiver.direction = "sendrecv" if receive else "sendonly"
        if self.room.settings.direct_send:
            sub.track.use_direct(DirectSender(transceiver))
        self._watch(transceiver.sender, sub, source)

    def _watch(self, sender: RTCRtpSender, sub: _Subscription, source: FanoutSource | None) -> None:
        """This subscriber's own feedback loop; its wish joins its source's encoder policy.
        With adaptation off, a fixed wish: the configured settings within what its receiver
        allows (maxaveragebitrate, useinbandfec, maxplaybackrate), as a 1:1 session gets."""
        settings = self.room.config.adaptation
        receiver = self._receiver
        opus = self.room.config.opus
        ceiling = receiver_ceiling(opus.bitrate, receiver)
        control = (source or self.room.agent).control
        if not settings.enabled:
            fixed = EncoderTarget(
                ceiling,
                opus.fec and receiver.fec,
                opus.expected_loss_pct,
                receiver.max_playback_rate,
            )
            sub.wish = SubscriberWish(control, fixed)
            if source is None:
                sub.wish.withdraw()  # an empty slot: its speaker's source gets it (move_to)
            else:
                control.wish(sub.wish, fixed)
            return
        controller = BitrateController(
            settings, ceiling, fec_allowed=receiver.fec, now=time.monotonic()
        )
        wish = SubscriberWish(
            control,
            dataclasses.replace(controller.target, max_playback_rate=receiver.max_playback_rate),
        )
        sub.wish = wish
        track = sub.track
        applier = Applier(wish.set_bitrate, wish.set_fec, wish.set_expected_loss)
        sub.tap = FeedbackTap(
            sender,
            controller,
            applier,
            packet_size=lambda: track.last_size,
            # The agent's and the slots' senders share one bundled transport: one sequence.
            sequence=self._sequences.setdefault(sender.transport, TransportSequence()),
        )
        # Both send paths stamp transport-wide sequence numbers (agent/direct.py).
        sub.tap.install(transport_cc=receiver.transport_cc)
        if source is None:
            wish.withdraw()  # an empty slot has no encoder to steer yet
        else:
            control.wish(wish, wish.target)  # from the start: its band cap above all

    def subscribe_slot(self, slot: int, source: FanoutSource) -> None:
        sub = self._slots.get(slot)
        if sub is None:
            return  # this client offered fewer slots: it does not hear that speaker
        source.subscribe(sub.track)
        if sub.wish is not None:
            sub.wish.move_to(source.control)

    def tick(self) -> None:
        for sub in self._subs:
            if sub.tap is not None:
                sub.tap.tick()

    def release_media(self) -> None:
        if self._mute_announcement is not None:
            self._mute_announcement.cancel()
            self._mute_announcement = None
        for sub in self._subs:
            if sub.wish is not None:
                sub.wish.close()
            sub.track.stop()

    # --- data channel --------------------------------------------------------------------
    @property
    def channel(self) -> RTCDataChannel | None:
        return self.outbox.channel

    def attach_channel(self, channel: RTCDataChannel) -> None:
        self.outbox.attach(channel, self.handle_message)

    def handle_message(self, raw: str | bytes) -> None:
        if self.room.members.get(self.participant_id) is not self:
            # Left already: the seat leaves the room before its connection closes, and a
            # message in flight then opened a text stream no one would end (forget_writer
            # had run), holding the room's agent for the room's life (found by review).
            return
        message: Message | None = None
        try:
            if self._room_message(raw):
                return
            message = parse_message(raw, self.room.config.speech.max_message_bytes)
            if not self.may_instruct:
                raise ProtocolError("forbidden", "only hosts may instruct the agent in this room")
            admit_speech(
                message, partial(self.pipeline.opens_stream, owner=self.participant_id), self.hooks
            )
            self._apply(message)
        except (ProtocolError, SpeechError) as exc:
            rest = partial(self.pipeline.refuse_rest, owner=self.participant_id)
            self.send_error(exc.code, exc.message, refusal(message, exc, rest))
        except Exception:
            log.exception("room %s: message handling failed", self.room.name)
            self.send_error("internal", "the server could not handle this message")

    def _room_message(self, raw: str | bytes) -> bool:
        """Room-only messages (``mute``); False for everything the agent handles."""
        if len(raw) > self.room.config.speech.max_message_bytes or '"mute"' not in str(raw):
            return False
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):  # deep nesting: parse_message says bad_json
            return False
        if not isinstance(obj, dict) or obj.get("type") != "mute":
            return False
        muted = obj.get("muted")
        if not isinstance(muted, bool):
            raise ProtocolError("bad_message", "'muted' must be true or false")
        self.muted = muted
        if self._mute_announcement is None:
            wait = self._muted_announced_at + MUTE_ANNOUNCE_INTERVAL_S - time.monotonic()
            if wait <= 0:
                self._announce_mute()
            else:  # told when the interval is up, as it is then
                loop = asyncio.get_running_loop()
                self._mute_announcement = loop.call_later(wait, self._announce_mute)
        return True

    def _announce_mute(self) -> None:
        self._mute_announcement = None
        if self.muted == self._announced_muted or self.participant_id not in self.room.members:
            return  # only a change is news (a client re-syncing its button is not)
        self._announced_muted = self.muted
        self._muted_announced_at = time.monotonic()
        self.room.broadcast({"type": "participant.updated", **self.describe()})

    def _apply(self, message: Message) -> None:
        pipeline = self.pipeline
        match message:
            case Say(text=text, id=utt_id):
                pipeline.say(text, utt_id)
            # A participant's text stream is its own: another's text.end or id-less delta
            # gets no_stream / stream_open rather than cutting or joining it.
            case TextDelta(delta=delta, id=utt_id):
                pipeline.text_delta(delta, utt_id, owner=self.participant_id)
            case TextEnd():
                pipeline.text_end(owner=self.participant_id)
            case Interrupt():
                self.room.conversation.interrupt()  # a reply being written too
            case Chat(text=text, id=chat_id):
                # The room's brain; everyone hears it. Named, the asker is named to it.
                self.room.conversation.ask(text, asker=self.name, question_id=chat_id)
            case ConfigUpdate(fields=fields):
                if "barge_in" in fields:  # refused whole: no voice setting half applied
                    raise ProtocolError(
                        "bad_config",
                        "barge_in is a 1:1 call's setting: a room's agent listens to no one",
                    )
                pipeline.configure(fields)

    def send_event(self, event: Event) -> None:
        self.outbox.send(event)

    def send_error(self, code: str, message: str, request_id: str | None = None) -> None:
        self.send_event(error_event(code, message, request_id))

    # --- what the registry and metrics ask ----------------------------------------------
    def start(self) -> None:
        """Nothing per participant: the room's agent runs from the first join."""

    def stats(self) -> dict[str, Any]:
        encoder = self.room.agent_track.encoder
        return {
            "session_id": self.id,
            "room": self.room.name,
            "participant_id": self.participant_id,
            "participant_role": self.role,
            "slot": self.slot,
            "participants": len(self.room.members),
            "bitrate": encoder.bitrate,
            "fec": encoder.fec,
            "expected_loss_pct": encoder.expected_loss_pct,
            "packets": self.track.stats.packets,
            "bytes": self.track.stats.bytes,
            "dropped": sum(sub.track.dropped_total for sub in self._subs),
            "direct_send": self.track.direct,
            "agent_encodes": self.room.agent_track.stats.encode_calls,
            "agent_packets_published": self.room.agent.packets,
            "buffered_ms": round(self.pipeline.buffer.buffered_seconds * 1000),
            "underruns": self.pipeline.buffer.underruns,
        }

    async def close(self) -> None:
        await self.room.leave(self)
