"""Inbound RTP: at most a few sources (SSRCs) per connection.

aiortc 1.16 keeps state per remote SSRC for a connection's whole life (the transport's
router table, the receiver's statistics and last-seen times) and writes one report block
per SSRC into every receiver report: past 31 the report is malformed, past 255 packing it
raises and the receiver's RTCP task dies, after which closing the connection waits for it
forever (a session nobody can close, a shutdown that hangs). A client sending each packet
under a new SSRC did all of that. A microphone is one SSRC; a client may restart its sender
once or twice. Packets under further new SSRCs are dropped before aiortc sees them.

The same router routes RTCP, and a REMB whose SSRC count is more than it carries raised
``struct.error`` from aiortc's REMB parsing (it catches only ValueError): out of the DTLS
transport's receive loop, which ended, closing the whole peer connection. One 20-byte packet
ended a call. Such a REMB is dropped here. So is an RTP packet whose header extension has
the wrong length for what it was negotiated as (a 2-byte audio level, a 1-byte transport-cc
number): aiortc's ``HeaderExtensionsMap.get`` raised ``struct.error`` from the same loop.
Its error is made the ValueError aiortc expects, and aiortc drops the packet.

A NACK asks aiortc's sender to send again every sequence number it lists, duplicates
included, one SRTP packet each: a 1.2 kB RTCP packet listing one number 5000 times (its FCI
repeated) made 5000 retransmissions, ~0.5 MB and tens of ms of the event loop, as often as the
peer liked (every session's audio stalls). A NACK keeps at most MAX_NACKED distinct numbers
(320 ms of audio: a receiver's jitter buffer has no use for older packets).
"""

from __future__ import annotations

import logging
import struct

from aiortc import RTCPeerConnection
from aiortc.rtcdtlstransport import RtpReceiver, RtpRouter, RtpSender
from aiortc.rtp import (
    RTCP_PSFB_APP,
    RTCP_RTPFB_NACK,
    AnyRtcpPacket,
    HeaderExtensions,
    HeaderExtensionsMap,
    RtcpPsfbPacket,
    RtcpRtpfbPacket,
    RtpPacket,
    unpack_remb_fci,
)

log = logging.getLogger(__name__)

MAX_INBOUND_SSRCS = 4
MAX_NACKED = 16  # distinct sequence numbers one NACK may have sent again (20 ms each)


class _GuardedRouter(RtpRouter):
    """aiortc's router with a cap on the SSRCs it learns. Set as the class of an existing
    router (no wrapper object, no closure: nothing for the cyclic collector, see
    signaling/release.py)."""

    ssrc_limit = MAX_INBOUND_SSRCS
    dropped = 0  # packets refused for a new SSRC past the limit (per router once set)
    malformed_rtcp = 0  # RTCP packets dropped because aiortc's parsing of them would raise
    nacks_trimmed = 0  # NACKs that listed a number twice or more than MAX_NACKED numbers

    def route_rtp(self, packet: RtpPacket) -> RtpReceiver | None:
        if packet.ssrc not in self.ssrc_table and len(self.ssrc_table) >= self.ssrc_limit:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "RTP under more than %d sources (SSRCs) on one connection: packets of "
                    "further new sources are dropped",
                    self.ssrc_limit,
                )
            return None
        return super().route_rtp(packet)

    def route_rtcp(self, packet: AnyRtcpPacket) -> set[RtpReceiver | RtpSender]:
        if isinstance(packet, RtcpPsfbPacket) and packet.fmt == RTCP_PSFB_APP:
            try:
                unpack_remb_fci(packet.fci)
            except struct.error:  # its SSRC count overruns it: nothing may read it
                self.malformed_rtcp += 1
                if self.malformed_rtcp == 1:
                    log.warning("a malformed REMB was dropped (more SSRCs than it carries)")
                return set()
            except ValueError:
                pass  # not a REMB: aiortc skips it itself
        elif isinstance(packet, RtcpRtpfbPacket) and packet.fmt == RTCP_RTPFB_NACK:
            self._trim_nack(packet)
        return super().route_rtcp(packet)

    def _trim_nack(self, packet: RtcpRtpfbPacket) -> None:
        """Each number once, the last MAX_NACKED of them (the newest, as a receiver lists
        them), in place: the sender gets the same packet object."""
        unique = list(dict.fromkeys(packet.lost))
        if len(unique) == len(packet.lost) and len(unique) <= MAX_NACKED:
            return
        packet.lost = unique[-MAX_NACKED:]
        self.nacks_trimmed += 1
        if self.nacks_trimmed == 1:
            log.warning("a NACK listed a packet twice or more than %d packets: trimmed", MAX_NACKED)


class _GuardedExtensionsMap(HeaderExtensionsMap):
    """aiortc's header extension map whose malformed values are a ValueError (the module
    docstring). Set as the class of an existing map, like the router."""

    malformed = 0  # RTP packets dropped for a header extension of the wrong length

    def get(self, extension_profile: int, extension_value: bytes) -> HeaderExtensions:
        try:
            return super().get(extension_profile, extension_value)
        except struct.error as exc:
            self.malformed += 1
            if self.malformed == 1:
                log.warning("RTP with a malformed header extension was dropped (%s)", exc)
            raise ValueError(f"malformed RTP header extension: {exc}") from None


def limit_inbound_ssrcs(pc: RTCPeerConnection) -> bool:
    """Cap the remote SSRCs of each of ``pc``'s transports; call after setRemoteDescription.
    Returns False (and changes nothing) if aiortc's internals are not what this was written
    against."""
    routers, maps = [], []
    for transceiver in pc.getTransceivers():
        transport = transceiver.receiver.transport
        router = getattr(transport, "_rtp_router", None)
        extensions = getattr(transport, "_rtp_header_extensions_map", None)
        if type(router) is _GuardedRouter and type(extensions) is _GuardedExtensionsMap:
            continue
        if type(router) is not RtpRouter or type(extensions) is not HeaderExtensionsMap:
            return False
        routers.append(router)
        maps.append(extensions)
    for router in routers:
        router.__class__ = _GuardedRouter
    for extensions in maps:
        extensions.__class__ = _GuardedExtensionsMap
    return True
