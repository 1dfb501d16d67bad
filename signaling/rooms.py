"""The rooms registry: named rooms created on first join, dropped when the last one leaves."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor

from agent.config import Config
from agent.engine import TTSEngine
from agent.governor import ComplexityGovernor
from agent.hooks import SessionHooks
from agent.room import Room, RoomError, RoomMember
from signaling.errors import ApiError

log = logging.getLogger(__name__)

MAX_NAME_CHARS = 64
# room_full and speakers_full are conflicts with the room's current state, not bad requests.
ROOM_ERROR_STATUS = {"room_full": 409, "speakers_full": 409, "room_closed": 409}


class RoomRegistry:
    def __init__(
        self,
        config: Config,
        engine: TTSEngine,
        encode_executor: Executor | None = None,
        governor: ComplexityGovernor | None = None,
        on_closed: Callable[[Room], None] | None = None,
    ) -> None:
        """``on_closed``: called once per room as it leaves the registry (it closes)."""
        self.config = config
        self._on_closed = on_closed
        self.engine = engine
        self.encode_executor = encode_executor
        self.governor = governor
        self._rooms: dict[str, Room] = {}

    def __len__(self) -> int:
        return len(self._rooms)

    def get(self, name: str) -> Room | None:
        return self._rooms.get(name)

    def rooms(self) -> list[Room]:
        return list(self._rooms.values())

    def join(
        self,
        name: str,
        session_id: str,
        *,
        speaking: bool,
        host: bool,
        display_name: str | None,
        hooks: SessionHooks | None,
        expects_channel: bool,
    ) -> RoomMember:
        """Admit a participant (creating the room); ApiError 409 when the room is full."""
        room = self._rooms.get(name)
        created = room is None
        if room is None:
            # The joiner's first-audio hook is the app's one measurement (every session of
            # this registry has the same): the room's agent is measured like a session's.
            room = Room(
                name,
                self.engine,
                self.config,
                self.encode_executor,
                self._forget,
                self.governor,
                on_first_audio=hooks.first_audio if hooks is not None else None,
            )
        try:
            member = room.join(
                session_id,
                speaking=speaking,
                host=host,
                name=display_name,
                hooks=hooks,
                expects_channel=expects_channel,
            )
        except RoomError as exc:
            if created:  # a room nobody is in: its encoder must not wait for the collector
                room.discard()
            raise ApiError(ROOM_ERROR_STATUS.get(exc.code, 409), exc.code, exc.message) from None
        if created:
            self._rooms[name] = room
            room.start()
            log.info("room %s created (%d rooms)", name, len(self._rooms))
        return member

    def _forget(self, room: Room) -> None:
        if self._rooms.get(room.name) is room:
            del self._rooms[room.name]
            if self._on_closed is not None:
                self._on_closed(room)


def offer_sends_audio(sdp: str) -> bool:
    """Does the offer's first audio section send (a microphone: sendrecv or sendonly)?"""
    inside = False
    for raw in sdp.splitlines():
        line = raw.strip()
        if line.startswith("m="):
            if inside:
                break
            inside = line.startswith("m=audio")
        elif inside and line in ("a=recvonly", "a=inactive"):
            return False
        elif inside and line in ("a=sendrecv", "a=sendonly"):
            return True
    return inside  # no direction attribute means sendrecv (RFC 3264)
