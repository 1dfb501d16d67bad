"""Checks on a client's SDP offer before aiortc sees it."""

from __future__ import annotations

from signaling.errors import ApiError

MAX_SDP_BYTES = 64 * 1024


def check_offer_sdp(sdp: object) -> str:
    """Return the SDP if it is an offer we can answer with agent audio, else raise ApiError."""
    if not isinstance(sdp, str) or not sdp.strip():
        raise ApiError(400, "bad_sdp", "'sdp' must be a non-empty string")
    if len(sdp.encode("utf-8", "replace")) > MAX_SDP_BYTES:
        raise ApiError(413, "sdp_too_large", f"SDP is limited to {MAX_SDP_BYTES} bytes")
    if not sdp.lstrip().startswith("v=0"):
        raise ApiError(400, "bad_sdp", "SDP must start with 'v=0'")
    audio = _audio_sections(sdp)
    if not audio:
        raise ApiError(400, "no_audio", "the offer has no audio m-line: the agent sends audio")
    if all(
        _direction(section) in ("sendonly", "inactive") or _port_zero(section) for section in audio
    ):
        raise ApiError(400, "no_audio", "the offer's audio does not accept audio from the agent")
    return sdp


def _audio_sections(sdp: str) -> list[list[str]]:
    sections: list[list[str]] = []
    current: list[str] | None = None
    for line in sdp.splitlines():
        if line.startswith("m="):
            current = [line] if line.startswith("m=audio") else None
            if current is not None:
                sections.append(current)
        elif current is not None:
            current.append(line)
    return sections


def _direction(section: list[str]) -> str:
    for line in section:
        if line.strip() in ("a=sendrecv", "a=sendonly", "a=recvonly", "a=inactive"):
            return line.strip()[2:]
    return "sendrecv"


def _port_zero(section: list[str]) -> bool:
    parts = section[0].split()
    return len(parts) > 1 and parts[1] == "0"
