"""One agent session: a speech pipeline, its Opus track and (optionally) a data channel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from aiortc import RTCDataChannel, RTCRtpTransceiver

from agent.adaptation import NetworkAdaptation, ReceiverOpus
from agent.config import Config
from agent.direct import DirectSender
from agent.engine import TTSEngine
from agent.governor import ComplexityGovernor
from agent.hooks import SessionHooks
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
from agent.speech import CLIENT, STREAM_TIMEOUT_MESSAGE, Event, SpeechError, SpeechPipeline
from agent.track import OpusPacketTrack
from agent.turns import Conversation

if TYPE_CHECKING:
    from aiortc import RTCRtpReceiver
    from aiortc.mediastreams import MediaStreamTrack

    from agent.inbound import InboundAudio
    from agent.vad import VadPool

log = logging.getLogger(__name__)


class AgentSession:
    def __init__(
        self,
        session_id: str,
        engine: TTSEngine,
        config: Config,
        encode_executor: Executor | None = None,
        *,
        governor: ComplexityGovernor | None = None,
        expects_channel: bool = True,
        hooks: SessionHooks | None = None,
    ) -> None:
        self.id = session_id
        self.config = config
        self.hooks = hooks or SessionHooks()
        self.pipeline = SpeechPipeline(
            engine,
            config.speech,
            self.send_event,
            on_first_audio=self.hooks.first_audio,
            rate=config.opus.input_rate,
        )
        self._encode_executor = encode_executor
        self._governor = governor
        self.track = self._new_track()
        self.outbox = EventOutbox(expects_channel, f"session {session_id}")
        self.network = NetworkAdaptation(self.track, config.adaptation, ReceiverOpus())
        self._stats_task: asyncio.Task[None] | None = None
        # The user's side: turns, the brain, barge-in (fed by the microphone, if any).
        self.conversation = Conversation(
            self.pipeline, config.listen, config.services, self.send_event
        )
        self.inbound: InboundAudio | None = None
        # Microphone tracks read but not listened to (a second one, or listening off): a task
        # leaves the set when its track ends, or when a resume replaces its connection
        # (stop_listening), so resumes do not grow it.
        self._drain_tasks: set[asyncio.Task[None]] = set()

    def attach_sender(self, transceiver: RTCRtpTransceiver, receiver: ReceiverOpus) -> None:
        """The transceiver whose sender carries our track, and what its receiver allows:
        adaptation starts, and (unless configured off) the lean send path is armed."""
        self.network = NetworkAdaptation(self.track, self.config.adaptation, receiver)
        self.network.attach(transceiver.sender)
        if self.config.opus.direct_send:
            self.track.use_direct(DirectSender(transceiver))

    def renew_track(self) -> None:
        """A new track on the same playout buffer, for a resumed session's new connection.

        aiortc stops a track when its sender stops, so a new peer connection needs a new
        one; what was queued or buffered plays from where it paused. The counters carry over.
        """
        stats = self.track.stats
        self.track.stop()
        self.track = self._new_track()
        self.track.stats = stats
        self.pipeline.playout_resumed()
        # The old adaptation steered the old track: the new one starts afresh, as at first,
        # until the new connection's receiver is known (attach_sender). Kept if the
        # negotiation fails, the stats would show a closed encoder's settings.
        self.network = NetworkAdaptation(self.track, self.config.adaptation, ReceiverOpus())

    def _new_track(self) -> OpusPacketTrack:
        return OpusPacketTrack(
            self.pipeline.buffer,
            self.config.opus,
            encode_executor=self._encode_executor,
            governor=self._governor,
        )

    def start(self) -> None:
        self.pipeline.start()
        self._stats_task = asyncio.get_running_loop().create_task(self._stats_loop())

    async def _stats_loop(self) -> None:
        """About once a second: FEC hold-off and REMB expiry (even with no feedback coming),
        and a ``stats`` event unless those are turned off (interval 0)."""
        interval = self.config.adaptation.stats_interval_s
        send_stats = interval > 0
        while True:
            await asyncio.sleep(interval if send_stats else 1.0)
            try:
                self.network.tick()
                self._end_stalled_stream()
                if send_stats and self.outbox.open:
                    self.send_event({"type": "stats", **self.network_stats()})
            except Exception:  # stats must never end the session
                log.exception("session %s: stats failed", self.id)

    def _end_stalled_stream(self) -> None:
        ended = self.pipeline.end_stalled_stream(time.monotonic(), (CLIENT,))
        if ended is not None:
            self.send_error("stream_timeout", STREAM_TIMEOUT_MESSAGE, ended[1])

    def listen(
        self,
        track: MediaStreamTrack,
        receiver: RTCRtpReceiver,
        pool: VadPool,
        heard: Callable[[], float] | None = None,
    ) -> None:
        """The client's microphone: voice activity, turns and barge-in run on it. ``heard``:
        when anything last came from the peer (agent/inbound.py _watch_quiet)."""
        from agent.inbound import InboundAudio
        from agent.receive_buffer import install_receive_buffer

        if self.inbound is not None or not self.config.listen.enabled:
            # Not listened to: still read it, or aiortc queues its decoded frames unbounded.
            self._track_task(_drain(track))
            return
        if not install_receive_buffer(receiver, self.config.listen.receive_reorder_wait):
            log.warning("session %s: aiortc's jitter buffer left as is (+80 ms)", self.id)
        self.inbound = InboundAudio(track, pool, self.config.listen, self.conversation, heard=heard)
        self.inbound.start()

    async def stop_listening(self) -> None:
        """The microphone's peer connection is gone (a resume replaces it): stop reading its
        tracks, so that the new connection's microphone is the one listened to.

        The session is told rather than left to notice the old track ending: in aiortc 1.16
        the track of a receiver that never started (a resume whose answer was lost, so its
        connection never came up) never ends, and a retried resume was then left listening
        to that silent track, deaf to the user for the rest of the call.
        """
        inbound, self.inbound = self.inbound, None
        drains = list(self._drain_tasks)
        for task in drains:
            task.cancel()
        if inbound is not None:
            await inbound.close()  # ends a turn it was in the middle of
        await asyncio.gather(*drains, return_exceptions=True)

    def _track_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._drain_tasks.add(task)
        task.add_done_callback(self._drain_tasks.discard)

    @property
    def channel(self) -> RTCDataChannel | None:
        return self.outbox.channel

    def attach_channel(self, channel: RTCDataChannel) -> None:
        self.outbox.attach(channel, self.handle_message)

    # --- inbound -------------------------------------------------------------------------
    def handle_message(self, raw: str | bytes) -> None:
        """Apply one client message; any problem becomes an ``error`` event, never a crash."""
        message: Message | None = None
        try:
            message = parse_message(raw, self.config.speech.max_message_bytes)
            admit_speech(message, self.pipeline.opens_stream, self.hooks)
            self.apply(message)
        except (ProtocolError, SpeechError) as exc:
            request_id = refusal(message, exc, self.pipeline.refuse_rest)
            self.send_error(exc.code, exc.message, request_id)
        except Exception:  # a bug must not take the session down; say so and log it
            log.exception("session %s: message handling failed", self.id)
            self.send_error("internal", "the server could not handle this message")

    def apply(self, message: Message) -> str | None:
        match message:
            case Say(text=text, id=utt_id):
                return self.pipeline.say(text, utt_id)
            case TextDelta(delta=delta, id=utt_id):
                return self.pipeline.text_delta(delta, utt_id)
            case TextEnd():
                return self.pipeline.text_end()
            case Interrupt():
                self.conversation.interrupt()  # the brain's reply too, not only the audio
                return None
            case Chat(text=text, id=chat_id):
                # Ask the brain (echo unless an LLM is configured); its reply is spoken.
                return self.conversation.ask(text, question_id=chat_id)
            case ConfigUpdate(fields=fields):
                fields = dict(fields)
                barge_in = fields.pop("barge_in", None)
                self.pipeline.configure(fields)  # first: a voice it refuses changes nothing
                if barge_in is not None:
                    self.conversation.barge_in = bool(barge_in)
                return None
        raise ProtocolError("unknown_type", "unsupported message")

    # --- outbound ------------------------------------------------------------------------
    def send_event(self, event: Event) -> None:
        self.conversation.observe(event)  # what was played becomes the history
        self.outbox.send(event)

    def send_error(self, code: str, message: str, request_id: str | None = None) -> None:
        self.send_event(error_event(code, message, request_id))

    def network_stats(self) -> dict[str, Any]:
        track = self.track.stats
        return {
            **self.network.stats(),
            "packets": track.packets,
            "speech_packets": track.speech_packets,
            "bytes": track.bytes,
            "buffered_ms": round(self.pipeline.buffer.buffered_seconds * 1000),
            "send_path": "direct" if self.track.direct else "aiortc",
            "send_errors": self.track.stats.direct_errors,
            "send_dropped": self.track.send_dropped,
            "complexity": self.track.encoder.complexity,
            # The CPU governor's band cap (16000: wide-band, 12000: medium-band), or None.
            "band_cap_hz": self.track.encoder.band_cap,
        }

    def stats(self) -> dict[str, Any]:
        return {
            "session_id": self.id,
            **self.network_stats(),
            "underruns": self.pipeline.buffer.underruns,
            "dtx": self.track.encoder.dtx,
            "conversation": self.conversation.snapshot(),
            "inbound": None if self.inbound is None else self.inbound.snapshot(),
        }

    async def close(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats_task
        for task in list(self._drain_tasks):
            task.cancel()
        if self.inbound is not None:
            await self.inbound.close()
        await self.conversation.close()
        await self.pipeline.close()
        self.track.stop()


async def _drain(track: MediaStreamTrack) -> None:
    from aiortc.mediastreams import MediaStreamError

    with contextlib.suppress(MediaStreamError):
        while True:
            await track.recv()
