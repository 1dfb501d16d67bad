"""What the server plugs into a session: speech admission (rate limits) and measurements.

The agent package never imports the signaling server; the server hands each session these
callables instead. The defaults admit everything and measure nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def _admit_all() -> float:
    return 0.0


def _ignore(_seconds: float) -> None:
    return None


@dataclass(frozen=True)
class SessionHooks:
    # A speech request (say, chat, a text stream's first delta) arrives: 0.0 admits it,
    # otherwise the seconds until the client may try again (the request is refused).
    admit_speech: Callable[[], float] = _admit_all
    # An utterance's first audio packet was sent: seconds since its synthesis started.
    first_audio: Callable[[float], None] = _ignore
