"""Checks on a client's SDP offer before aiortc sees it."""

from __future__ import annotations

import ipaddress

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


def add_mdns_fallback(sdp: str, peer_ip: str | None, host_ips: list[str]) -> str:
    """Give each mDNS (``*.local``) candidate a twin with a plain IP address.

    Browsers hide their addresses behind random ``.local`` names; aioice resolves them by
    multicast, which fails across subnets, in containers and on many Wi-Fi networks, and then
    fails ICE at once because it has no candidate pair to check. The port in an mDNS
    candidate is real, and the address is usually the one the browser's HTTP request came
    from (or, for a browser on this machine, one of this machine's own addresses). The twin
    gives aioice a pair to check; the browser's own checks then complete the connection.
    A twin that turns out wrong costs one failed check.
    """
    addresses = [peer_ip] if peer_ip and not _is_loopback(peer_ip) else host_ips
    if not addresses or ".local " not in sdp:
        return sdp
    newline = "\r\n" if "\r\n" in sdp else "\n"
    out: list[str] = []
    for line in sdp.splitlines():
        out.append(line)
        parts = line.split()
        # a=candidate:<foundation> <component> <transport> <priority> <address> <port> typ <t>
        if len(parts) >= 8 and line.startswith("a=candidate:") and parts[4].endswith(".local"):
            for index, address in enumerate(addresses):
                twin = list(parts)
                twin[0] = f"{parts[0]}m{index}"[:44]
                twin[3] = str(max(0, int(parts[3]) - 1 - index)) if parts[3].isdigit() else parts[3]
                twin[4] = address
                out.append(" ".join(twin))
    return newline.join(out) + (newline if sdp.endswith(newline) else "")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False
