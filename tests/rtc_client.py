"""A Python WebRTC client for end-to-end tests: negotiates with the real server, records audio."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack


@dataclass
class ReceivedAudio:
    """Decoded mono 48 kHz audio with the arrival time of each 20 ms frame."""

    frames: list[np.ndarray] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    pts: list[int] = field(default_factory=list)

    def samples(self) -> np.ndarray:
        if not self.frames:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(self.frames)


class RtcClient:
    def __init__(
        self, base_url: str, http: aiohttp.ClientSession, token: str | None = None
    ) -> None:
        self.base_url = base_url
        self.http = http
        self.token = token  # sent as an Authorization: Bearer header unless told otherwise
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.audio = ReceivedAudio()
        self.events: list[dict[str, Any]] = []
        self.event_times: list[float] = []  # time.monotonic() each event arrived
        self.session_id: str | None = None
        self.session_token: str | None = None  # for resuming the session (signaling/resume.py)
        self.refusal: tuple[int, Any, dict[str, str]] | None = None  # see connect()
        self.offer_seconds: float | None = None  # POST /offer -> its response
        self.location: str | None = None
        self._event_signal = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        self._slot_readers: list[asyncio.Task[None]] = []
        self.channel = None
        self.codec_preferences: list[Any] | None = None  # audio codecs to offer, in order
        # Called with (sequence number, payload) of every RTP packet received (benches).
        self.rtp_tap: Callable[[int, bytes], None] | None = None
        # Rooms: audio of each speaker slot (receive-only transceivers after the first).
        self.slot_audio: dict[int, ReceivedAudio] = {}
        self.participant_id: str | None = None
        # A microphone to send (sendrecv audio); None: listen only (recvonly).
        self.mic: MediaStreamTrack | None = None

    async def connect(
        self,
        *,
        whep: bool = False,
        room: str | None = None,
        rewrite_offer: Callable[[str], str] | None = None,
        rewrite_answer: Callable[[str], str] | None = None,
        token_in: str = "header",
        resume: str | None = None,
        mic: MediaStreamTrack | None = None,
        slots: int = 0,
        name: str | None = None,
        expect_status: int | None = None,
        allow_refusal: bool = False,
    ) -> dict[str, Any] | None:
        """``token_in``: where the offer carries the token: header, query or body (JSON).
        ``resume``: a session token: take over that session instead of starting one.

        Rooms: ``mic`` is sent on the first transceiver (a speaker); ``slots`` receive-only
        transceivers follow it for the other speakers. With ``expect_status`` the server's
        refusal is expected: its JSON error body is returned and nothing is connected.
        ``allow_refusal``: an error answer to the offer is kept in ``refusal`` (status,
        error body) instead of failing the call.
        """
        mic = mic if mic is not None else self.mic
        if mic is not None:
            transceiver = self.pc.addTransceiver(mic, direction="sendrecv")
        else:
            transceiver = self.pc.addTransceiver("audio", direction="recvonly")
        slot_transceivers = [
            self.pc.addTransceiver("audio", direction="recvonly") for _ in range(slots)
        ]
        if self.rtp_tap is not None:
            tap = self.rtp_tap
            receiver = transceiver.receiver
            original = receiver._handle_rtp_packet

            async def tapped(packet: Any, arrival_time_ms: int) -> None:
                tap(packet.sequence_number, packet.payload)
                await original(packet, arrival_time_ms=arrival_time_ms)

            receiver._handle_rtp_packet = tapped  # type: ignore[method-assign]
        if self.codec_preferences is not None:
            transceiver.setCodecPreferences(self.codec_preferences)
        if not whep:
            self.channel = self.pc.createDataChannel("agent")
            self.channel.on("message", self._on_message)
            opened = asyncio.Event()
            self.channel.on("open", opened.set)

        @self.pc.on("track")
        def on_track(track: MediaStreamTrack) -> None:
            for slot, slot_transceiver in enumerate(slot_transceivers):
                if slot_transceiver.receiver.track is track:
                    audio = self.slot_audio.setdefault(slot, ReceivedAudio())
                    self._slot_readers.append(asyncio.ensure_future(self._read(track, audio)))
                    return
            self._reader = asyncio.ensure_future(self._read(track))

        await self.pc.setLocalDescription(await self.pc.createOffer())
        sdp = self.pc.localDescription.sdp
        if rewrite_offer is not None:
            sdp = rewrite_offer(sdp)
        headers: dict[str, str] = {}
        params: dict[str, str] = {}
        if self.token and token_in == "header":
            headers["Authorization"] = f"Bearer {self.token}"
        elif self.token and token_in == "query":
            params["token"] = self.token
        if whep:
            if room:
                params["room"] = room
            async with self.http.post(
                self.base_url + "/whep",
                data=sdp,
                headers={
                    **headers,
                    "Content-Type": "application/sdp",
                    **({"X-Session-Token": resume} if resume else {}),
                },
                params=params,
            ) as resp:
                assert resp.status == 201, await resp.text()
                assert resp.content_type == "application/sdp"
                self.location = resp.headers["Location"]
                self.session_id = self.location.rsplit("/", 1)[1]
                self.session_token = resp.headers.get("X-Session-Token")
                answer = await resp.text()
        else:
            body: dict[str, Any] = {"sdp": sdp, "type": "offer"}
            if room:
                body["room"] = room
            if name:
                body["name"] = name
            if self.token and token_in == "body":
                body["token"] = self.token
            if resume is not None:
                body["resume"] = resume
            posted = time.monotonic()
            async with self.http.post(
                self.base_url + "/offer", json=body, headers=headers, params=params
            ) as resp:
                self.offer_seconds = time.monotonic() - posted
                if expect_status is not None:
                    assert resp.status == expect_status, await resp.text()
                    error: dict[str, Any] = await resp.json()
                    return error
                if allow_refusal and resp.status != 200:
                    self.refusal = (resp.status, await resp.json(), dict(resp.headers))
                    return None
                assert resp.status == 200, await resp.text()
                data = await resp.json()
                assert data["type"] == "answer"
                self.session_id = data["session_id"]
                self.session_token = data.get("session_token")
                self.participant_id = data.get("participant_id")
                answer = data["sdp"]
        if rewrite_answer is not None:
            answer = rewrite_answer(answer)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        if not whep:
            await asyncio.wait_for(opened.wait(), 10)
        return None

    def _on_message(self, raw: str | bytes) -> None:
        self.events.append(json.loads(raw))
        self.event_times.append(time.monotonic())
        self._event_signal.set()

    async def _read(self, track: MediaStreamTrack, audio: ReceivedAudio | None = None) -> None:
        into = self.audio if audio is None else audio
        try:
            while True:
                frame = await track.recv()
                now = time.monotonic()
                pcm = frame.to_ndarray().astype(np.float32) / 32768.0
                channels = len(frame.layout.channels)
                mono = pcm.reshape(-1, channels).mean(axis=1) if channels > 1 else pcm.reshape(-1)
                into.frames.append(mono)
                into.arrivals.append(now)
                into.pts.append(frame.pts or 0)
        except MediaStreamError:
            pass

    def send(self, message: dict[str, Any] | str) -> None:
        assert self.channel is not None
        self.channel.send(message if isinstance(message, str) else json.dumps(message))

    async def wait_event(self, predicate: Any, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for event in self.events[seen:]:
                if predicate(event):
                    return event
            seen = len(self.events)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no matching event; got {self.events}")
            self._event_signal.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event_signal.wait(), remaining)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for reader in self._slot_readers:
            reader.cancel()
        await self.pc.close()


TWCC_URI = "http://www.ietf.org/id/draft-holmer-rmcat-transport-wide-cc-extensions-01"


def opus_fmtp_rewriter(fmtp: str, transport_cc: bool = False) -> Callable[[str], str]:
    """An offer rewriter: the client's Opus line gets ``fmtp`` (and transport-cc)."""

    def rewrite(sdp: str) -> str:
        pt = re.search(r"a=rtpmap:(\d+) opus/48000", sdp)
        assert pt, sdp
        lines = []
        for line in sdp.split("\r\n"):
            lines.append(line)
            if line.startswith(f"a=rtpmap:{pt.group(1)} opus"):
                lines.append(f"a=fmtp:{pt.group(1)} {fmtp}")
                if transport_cc:
                    lines.append(f"a=rtcp-fb:{pt.group(1)} transport-cc")
                    lines.append(f"a=extmap:7 {TWCC_URI}")
        return "\r\n".join(lines)

    return rewrite
