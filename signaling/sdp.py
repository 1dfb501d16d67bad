"""Checks on a client's SDP offer before aiortc sees it."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

from aiortc import sdp as aiortc_sdp

from signaling.errors import ApiError

MAX_SDP_BYTES = 64 * 1024
_DIGITS = re.compile(r"[0-9]{1,10}")  # a candidate priority: up to 2**31 - 1
# A browser offers a handful of candidates (one per interface, component and protocol, a
# few relayed) and a few ssrc lines per section; far more is an attack on the event loop.
MAX_CANDIDATES = 64
MAX_PORT = 65535
MAX_SSRC_LINES = 256
MAX_EXTENSION_ID = 255  # RFC 8285: 1-14 in one-byte headers, up to 255 in two-byte ones
MAX_MID_BYTES = 255  # the longest value a two-byte header extension carries
# a=rtcp-fb and a=fmtp lines in one media section: Chrome's video section, the longest a
# browser sends, has about 80 rtcp-fb lines.
MAX_FORMAT_LINES = 256


def check_offer_sdp(sdp: object, max_sections: int) -> str:
    """Return the SDP if it is an offer we can answer with agent audio, else raise ApiError:
    at most ``max_sections`` media sections; its first audio section must receive (the
    agent's audio goes there) and offer Opus."""
    if not isinstance(sdp, str) or not sdp.strip():
        raise ApiError(400, "bad_sdp", "'sdp' must be a non-empty string")
    try:
        size = len(sdp.encode("utf-8"))
    except UnicodeEncodeError:
        # A lone surrogate (JSON's "\ud800", a UTF-7 body): aiortc echoes the offer's mid
        # into the answer, which could then not be sent (a 500 after the session was made).
        raise ApiError(400, "bad_sdp", "SDP must be Unicode text (no lone surrogates)") from None
    if size > MAX_SDP_BYTES:
        raise ApiError(413, "sdp_too_large", f"SDP is limited to {MAX_SDP_BYTES} bytes")
    if not sdp.lstrip().startswith("v=0"):
        raise ApiError(400, "bad_sdp", "SDP must start with 'v=0'")
    # Lines as aiortc reads them (str.splitlines: \r, \x0c, \u2028... end a line too), so
    # that the rewrites after this (opus_first, explicit_directions), which split on \r\n,
    # see the same lines: an offer joining lines with \u2028 got past them, and Opus went
    # out labelled PCMU (found by review).
    sdp = "\r\n".join(sdp.splitlines()) + "\r\n"
    sdp = _listed_formats_only(_session_direction_into_sections(sdp))
    _check_attributes(sdp.splitlines())
    _check_mids(sdp.splitlines())
    sections = sum(1 for line in sdp.splitlines() if line.startswith("m="))
    if sections > max_sections:
        raise ApiError(
            400,
            "bad_sdp",
            f"the offer has {sections} media sections, at most {max_sections} are answered "
            "(the agent's audio, a room's speaker slots, the data channel)",
        )
    audio = _audio_sections(sdp)
    if not audio:
        raise ApiError(400, "no_audio", "the offer has no audio m-line: the agent sends audio")
    # aiortc's addTrack puts the agent's track on the first audio transceiver (a room's
    # agent audio goes there too; later sections are a room's speaker slots): an offer whose
    # first audio section does not receive would be answered, and never hear anything.
    first = audio[0]
    if _direction(first) in ("sendonly", "inactive") or _port_zero(first):
        raise ApiError(
            400,
            "no_audio",
            "the offer's first audio section must accept audio from the agent (sendrecv or "
            "recvonly): the agent sends on it",
        )
    if not _offers_opus(first):
        message = "the offer's first audio section has no opus/48000: the agent sends Opus"
        raise ApiError(400, "no_opus", message)
    return sdp


def _session_direction_into_sections(sdp: str) -> str:
    """A direction at session level, written into each audio/video section stating none.

    RFC 4566 section 6: it applies to every such section. aiortc reads directions in
    sections only: a session-level ``a=inactive`` offer was answered sendrecv, a listen-only
    ``a=recvonly`` one sendrecv too, the agent listening to a microphone that never sends
    (found by review)."""
    lines = sdp.split("\r\n")
    first_media = next((i for i, line in enumerate(lines) if line.startswith("m=")), len(lines))
    session_level = [line.strip() for line in lines[:first_media] if line.strip() in DIRECTIONS]
    if not session_level:
        return sdp
    out = [line for line in lines[:first_media] if line.strip() not in DIRECTIONS]
    section: list[str] = []
    for line in [*lines[first_media:], "m=end"]:
        if line.startswith("m="):
            media = section and section[0].startswith(("m=audio", "m=video"))
            if media and not any(each.strip() in DIRECTIONS for each in section):
                section.insert(1, session_level[0])
            out.extend(section)
            section = []
        section.append(line)
    return "\r\n".join(out)


def _listed_formats_only(sdp: str) -> str:
    """Audio/video sections without the rtpmap, fmtp and rtcp-fb lines of payload types
    their m-line does not list.

    An m-line lists the formats its offerer takes; an ``a=rtpmap`` for another (SDP edited
    to drop Opus, its rtpmap left behind) is no offer of it. aiortc reads codecs from
    rtpmap lines alone: such an offer was answered with Opus, on a payload type the client
    never offered, where the README says 400 ``no_opus`` (found by review)."""
    lines = sdp.split("\r\n")
    listed: set[str] | None = None  # the current audio/video section's formats
    out: list[str] = []
    for line in lines:
        if line.startswith("m="):
            parts = line.split()
            media = line.startswith(("m=audio", "m=video"))
            listed = {_format(f) for f in parts[3:]} if media else None
        elif listed is not None and line.startswith(("a=rtpmap:", "a=fmtp:", "a=rtcp-fb:")):
            payload_type = line.split(":", 1)[1].split(" ", 1)[0]
            if payload_type != "*" and _format(payload_type) not in listed:
                continue
        out.append(line)
    return "\r\n".join(out)


def _format(value: str) -> str:
    """A payload type as its number reads ("096" is 96, as aiortc's int() reads both)."""
    return str(int(value)) if _DIGITS.fullmatch(value) else value


def bundle_as_offered(answer: str, offer: str) -> str:
    """The answer's BUNDLE group limited to the offer's (RFC 8843 section 7.3).

    aiortc answers every section bundled, whatever the offer said, while it bundles only
    what the offer's first session-level group names: an offer without BUNDLE was answered
    with a group the server did not do, and a client following it moved its data channel
    onto the audio transport, where nobody listened (the call never connected; found by
    review)."""
    offered = _bundle_group(offer.splitlines())
    newline = "\r\n" if "\r\n" in answer else "\n"
    out: list[str] = []
    in_session = True
    for line in answer.split(newline):
        if line.startswith("m="):
            in_session = False
        if in_session and line.startswith("a=group:BUNDLE"):
            items = [mid for mid in line.split()[1:] if mid in offered]
            if not items:
                continue
            line = " ".join(["a=group:BUNDLE", *items])
        out.append(line)
    return newline.join(out)


def _bundle_group(lines: list[str]) -> list[str]:
    """The mids of the first session-level BUNDLE group: the only one aiortc bundles."""
    for line in lines:
        if line.startswith("m="):
            break
        bits = line[len("a=group:") :].split() if line.startswith("a=group:") else []
        if bits and bits[0] == "BUNDLE":
            return bits[1:]
    return []


def _check_attributes(lines: list[str]) -> None:
    """400 for attributes aiortc would choke on, each cheap to send in 64 KiB:
    - candidates and ssrc lines past what a browser sends: aioice adds candidates one by one,
      re-sorting its check list each time, and aiortc's parser goes over ssrc lines likewise
      (quadratic, on the event loop that paces every session: 1000 candidates stalled it
      180-360 ms, 2600 ssrc lines 75 ms; and each candidate is an address aioice sends
      STUN checks to);
    - header extension ids outside RFC 8285's 1-255 and mids longer than a two-byte header
      extension holds: answered 200, then the first RTP packet failed an assertion in
      aiortc's header packing, and the session never sent a packet."""
    candidates = _candidates_to_add(lines)
    if candidates > MAX_CANDIDATES:
        raise ApiError(
            400,
            "bad_sdp",
            f"the offer has {candidates} ICE candidates to add, at most {MAX_CANDIDATES}",
        )
    ssrc_lines = sum(1 for line in lines if line.startswith("a=ssrc:"))
    if ssrc_lines > MAX_SSRC_LINES:
        raise ApiError(
            400, "bad_sdp", f"the offer has {ssrc_lines} a=ssrc lines, at most {MAX_SSRC_LINES}"
        )
    _check_format_lines(lines)
    for line in lines:
        if line.startswith("a=extmap:"):
            ident = line[len("a=extmap:") :].split(" ", 1)[0].split("/", 1)[0]
            if not (_DIGITS.fullmatch(ident) and 1 <= int(ident) <= MAX_EXTENSION_ID):
                raise ApiError(
                    400,
                    "bad_sdp",
                    f"header extension id {ident[:20]!r} is not 1-{MAX_EXTENSION_ID} (RFC 8285)",
                )
        elif line.startswith("a=mid:") and len(line[len("a=mid:") :].encode()) > MAX_MID_BYTES:
            raise ApiError(400, "bad_sdp", f"an a=mid is limited to {MAX_MID_BYTES} bytes")


def _check_format_lines(lines: list[str]) -> None:
    """400 for a payload type's a=rtpmap given twice in a section, and for more than
    MAX_FORMAT_LINES a=rtcp-fb and a=fmtp lines in one: aiortc's parser walks every codec
    for each rtcp-fb line (a wildcard one adds a feedback object to each), so rtpmaps times
    rtcp-fb lines is quadratic; a 63 KB offer repeating one rtpmap held the event loop
    12-16 s and its session ~400 MB (found by review)."""
    payload_types: set[str] = set()
    format_lines = 0
    for line in lines:
        if line.startswith("m="):
            payload_types.clear()
            format_lines = 0
        elif line.startswith("a=rtpmap:"):
            # As aiortc reads it: "096" is 96 again (_listed_formats_only keeps it for 96).
            payload_type = _format(line[len("a=rtpmap:") :].split(" ", 1)[0])
            if payload_type in payload_types:
                raise ApiError(
                    400, "bad_sdp", f"payload type {payload_type[:20]!r} has two a=rtpmap lines"
                )
            payload_types.add(payload_type)
        elif line.startswith(("a=rtcp-fb:", "a=fmtp:")):
            format_lines += 1
            if format_lines > MAX_FORMAT_LINES:
                raise ApiError(
                    400,
                    "bad_sdp",
                    f"a media section has more than {MAX_FORMAT_LINES} a=rtcp-fb and a=fmtp lines",
                )


def _check_mids(lines: list[str]) -> None:
    """400 for media ids aiortc 1.16 cannot bundle: a section with two a=mid lines, a mid
    two sections share, or a BUNDLE group naming no section's mid. aiortc gives such a
    bundled section no transport at all: setRemoteDescription raised AttributeError (a 400
    by luck), or the answer went out and its connect task died in the background (an error
    logged, a session that never connected). Found by tests/test_fuzz.py."""
    mids: list[str] = []
    groups: list[list[str]] = []
    section_mids = -1  # before the first m= line: session level
    for line in lines:
        if line.startswith("m="):
            section_mids = 0
        elif line.startswith("a=mid:") and section_mids >= 0:
            section_mids += 1
            if section_mids > 1:
                raise ApiError(400, "bad_sdp", "a media section has more than one a=mid")
            mids.append(line[len("a=mid:") :])
        elif line.startswith("a=group:") and section_mids < 0:
            bits = line[len("a=group:") :].split()
            if bits and bits[0] == "BUNDLE":
                groups.append(bits[1:])
    if len(set(mids)) < len(mids):
        raise ApiError(400, "bad_sdp", "two media sections have the same a=mid")
    for group in groups:
        unknown = [item for item in group if item not in mids]
        if unknown:
            raise ApiError(
                400, "bad_sdp", f"the BUNDLE group names {unknown[0][:20]!r}, no section's mid"
            )


def _candidates_to_add(lines: list[str]) -> int:
    """How many candidates aioice would add. Browsers list the shared (BUNDLE) transport's
    candidates again in every section (a room page's 6 sections, 4 each), and aioice
    ignores one whose address its transport has: what costs is each new one. A section the
    BUNDLE group does not name has a transport of its own, adding its candidates again
    (counting every line once any BUNDLE line was present let an offer bundling one
    section add 64 per other section: found by review).

    400 for a candidate port outside 0-65535 too: answered, aioice's checks to it raised
    OverflowError in ``sendto``, which closed the session's ICE socket and logged errors
    with tracebacks (found by review)."""
    # aiortc bundles the first session-level BUNDLE group only: a second group, or one
    # inside a media section, shares nothing (counting them let 90 candidates in).
    bundled_mids = set(_bundle_group(lines))
    sections: list[tuple[str | None, set[tuple[str, ...]]]] = [(None, set())]  # session level
    for line in lines:
        if line.startswith("m="):
            sections.append((None, set()))
        elif line.startswith("a=mid:"):
            sections[-1] = (line[len("a=mid:") :], sections[-1][1])
        elif line.startswith("a=candidate:"):
            address = _candidate_address(line)
            if len(address) == 3 and not (
                _DIGITS.fullmatch(address[2]) and int(address[2]) <= MAX_PORT
            ):
                raise ApiError(
                    400, "bad_sdp", f"a candidate's port {address[2][:20]!r} is not 0-{MAX_PORT}"
                )
            sections[-1][1].add(address)
    shared: set[tuple[str, ...]] = set()
    own = 0
    for mid, addresses in sections:
        if mid is not None and mid in bundled_mids:
            shared |= addresses
        else:
            own += len(addresses)
    return len(shared) + own


def _candidate_address(line: str) -> tuple[str, ...]:
    """A candidate line's transport address (protocol, address, port); the line itself
    when it has none (aiortc refuses it later)."""
    # a=candidate:<foundation> <component> <transport> <priority> <address> <port> typ <t>
    parts = line.split()
    return (parts[2].lower(), parts[4].lower(), parts[5]) if len(parts) >= 6 else (line,)


def check_dtls_fingerprints(sdp: str) -> None:
    """400 for a section in use without a DTLS fingerprint (its own or the session's); call
    once aiortc applied the offer (so it parses).

    aiortc applies such an offer and answers it; only once ICE connects does its DTLS start
    assert on the missing fingerprint, in a task nobody awaits: the client got a 200 for a
    call that can never carry audio, and the server logged an unhandled error (found by
    tests/test_fuzz.py)."""
    for media in aiortc_sdp.SessionDescription.parse(sdp).media:
        if media.port != 0 and (media.dtls is None or not media.dtls.fingerprints):
            raise ApiError(
                400,
                "bad_sdp",
                f"the offer's {media.kind} section has no DTLS fingerprint (a=fingerprint): "
                "no secure connection could be made",
            )


def opus_first(sdp: str) -> str:
    """Put Opus first in each audio section: in the m-line and among the rtpmap lines.

    aiortc answers with the offer's first common codec (in rtpmap order, not m-line order),
    and the agent's track only makes Opus packets: an offer listing PCMU first would
    otherwise get Opus bytes labelled PCMU.
    """
    newline = "\r\n" if "\r\n" in sdp else "\n"
    lines = sdp.split(newline)
    opus_types = {line.split()[0].split(":", 1)[1] for line in lines if _is_opus_rtpmap(line)}
    in_audio = False
    rtpmap_rows: list[int] = []
    for index, line in enumerate([*lines, "m=end"]):
        if line.startswith("m="):
            _opus_rows_first(lines, rtpmap_rows)
            rtpmap_rows = []
            in_audio = line.startswith("m=audio")
            if in_audio:
                head, formats = line.split()[:3], line.split()[3:]
                formats.sort(key=lambda f: f not in opus_types)  # stable: others keep order
                lines[index] = " ".join(head + formats)
        elif in_audio and line.startswith("a=rtpmap:"):
            rtpmap_rows.append(index)
    return newline.join(lines)


def explicit_directions(sdp: str) -> str:
    """Write ``a=sendrecv`` into audio/video sections that state no direction.

    RFC 3264 makes sendrecv the default, and check_offer_sdp reads it so, but aiortc cannot
    answer a section without one (it failed with a 500 before; found by fuzzing).
    """
    newline = "\r\n" if "\r\n" in sdp else "\n"
    lines = sdp.split(newline)
    out: list[str] = []
    media_start: int | None = None  # index in ``out`` of the current audio/video m-line

    def close_section() -> None:
        if media_start is not None and not any(
            line.strip() in DIRECTIONS for line in out[media_start + 1 :]
        ):
            out.insert(media_start + 1, "a=sendrecv")

    for line in lines:
        if line.startswith("m="):
            close_section()
            media_start = len(out) if line.startswith(("m=audio", "m=video")) else None
        out.append(line)
    if out and out[-1] == "":
        out.pop()
        close_section()
        out.append("")
    else:
        close_section()
    return newline.join(out)


DIRECTIONS = ("a=sendrecv", "a=sendonly", "a=recvonly", "a=inactive")


def _is_opus_rtpmap(line: str) -> bool:
    return line.startswith("a=rtpmap:") and " opus/48000" in line.lower()


def _opus_rows_first(lines: list[str], rows: list[int]) -> None:
    ordered = sorted((lines[i] for i in rows), key=lambda line: not _is_opus_rtpmap(line))
    for row, line in zip(rows, ordered, strict=True):
        lines[row] = line


def _offers_opus(section: list[str]) -> bool:
    return any(_is_opus_rtpmap(line) for line in section)


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
        if line.strip() in DIRECTIONS:
            return line.strip()[2:]
    return "sendrecv"


def _port_zero(section: list[str]) -> bool:
    parts = section[0].split()
    return len(parts) > 1 and parts[1] == "0"


def add_mdns_fallback(sdp: str, peer_ip: str | None, host_ips: Callable[[], list[str]]) -> str:
    """Give each mDNS (``*.local``) candidate a twin with a plain IP address.

    Browsers hide their addresses behind random ``.local`` names; aioice resolves them by
    multicast, which fails across subnets, in containers and on many Wi-Fi networks, and then
    fails ICE at once because it has no candidate pair to check. The port in an mDNS
    candidate is real, and the address is usually the one the browser's HTTP request came
    from (or, for a browser on this machine, one of this machine's own addresses). The twin
    gives aioice a pair to check; the browser's own checks then complete the connection.
    A twin that turns out wrong costs one failed check.
    """
    if ".local " not in sdp:
        return sdp
    addresses = [peer_ip] if peer_ip and not _is_loopback(peer_ip) else host_ips()
    if not addresses:
        return sdp
    newline = "\r\n" if "\r\n" in sdp else "\n"
    lines = sdp.splitlines()
    # Every twin, in order, as (the line it follows, the twin).
    twins: list[tuple[int, str]] = []
    for at, line in enumerate(lines):
        parts = line.split()
        # a=candidate:<foundation> <component> <transport> <priority> <address> <port> typ <t>
        if len(parts) >= 8 and line.startswith("a=candidate:") and parts[4].endswith(".local"):
            for index, address in enumerate(addresses):
                twin = list(parts)
                twin[0] = f"{parts[0]}m{index}"[:44]
                priority = parts[3]
                # ASCII digits only: str.isdigit() also accepts "²", which int() refuses.
                if _DIGITS.fullmatch(priority):
                    twin[3] = str(max(0, int(priority) - 1 - index))
                twin[4] = address
                twins.append((at, " ".join(twin)))

    def with_twins(count: int) -> list[str]:
        after: dict[int, list[str]] = {}
        for at, twin in twins[:count]:
            after.setdefault(at, []).append(twin)
        return [out for at, line in enumerate(lines) for out in (line, *after.get(at, ()))]

    # The twins count against the offer's candidate limit too, counted as check_offer_sdp
    # counts (shared across the BUNDLE group, per section outside it): a server with many
    # addresses would otherwise multiply a legal offer's mDNS candidates past what aioice
    # adds cheaply (distinct addresses across the offer, counted before, let an offer
    # without BUNDLE add 1024: found by review). The most twins that fit, first ones first
    # (the count only grows with more).
    low, high = 0, len(twins)
    while low < high:
        middle = (low + high + 1) // 2
        if _candidates_to_add(with_twins(middle)) <= MAX_CANDIDATES:
            low = middle
        else:
            high = middle - 1
    return newline.join(with_twins(low)) + (newline if sdp.endswith(newline) else "")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False
