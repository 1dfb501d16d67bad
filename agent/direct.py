"""A lean per-subscriber send path: the source's tick writes RTP straight to SRTP and UDP.

Through aiortc's ``RTCRtpSender`` every packet of every subscriber costs a task wake-up
(``track.recv()``), an ``RtpPacket`` with header extensions (abs-send-time from a datetime
computation), serialisation, SRTP and ``sendto``: ~100-130 us per packet per peer measured
on this VM (bench/room.py). Fanning one encode out that way leaves the per-listener cost
dominated by the send path. ``DirectSender`` keeps only what a receiver needs: a 12-byte RTP
header plus the constant MID extension, SRTP ``protect`` (C, libsrtp) and one ``sendto``,
all called synchronously from the source's 20 ms tick for every subscriber in turn. Nothing
waits: UDP ``sendto`` never blocks, and a subscriber whose socket buffer is backed up has
the packet dropped (bounded like the queue it replaces).

When the peer negotiated transport-cc (agent/feedback.py swapped the sender's header-extension
map for a ``TransportSequenceMap``), every packet carries the next transport-wide sequence
number, written into a header template built once, and the map records its send time and
size exactly as on aiortc's path, so delay-based adaptation works the same on both.

aiortc still owns the connection: negotiation, DTLS, ICE, RTCP (sender reports use the
counters kept here; receiver reports feed the subscriber's bitrate controller as usual).
Its RTP task stays parked on the subscriber track's ``recv()``, which never returns while
this path is used. This reads aiortc 1.16 / aioice internals (sender's started flag, SSRC,
header-extension map and SR counters; the DTLS transport's SRTP session; the ICE
connection's nominated pair): ``resolve`` checks each, and when one is missing the track
uses aiortc's ordinary path instead.
"""

from __future__ import annotations

import logging
import random
import struct
from typing import Any

from aiortc import clock
from aiortc.rtcrtpsender import random_sequence_number
from aiortc.rtp import HeaderExtensions, HeaderExtensionsMap

from agent.feedback import TransportSequenceMap

log = logging.getLogger(__name__)

MAX_BUFFERED_BYTES = 64 * 1024  # a backed-up socket drops packets beyond this
SR_CLOCK_EVERY = 25  # refresh the sender report's NTP/RTP pair every 0.5 s of packets
_RTP_HEADER = struct.Struct("!BBHLL")
_EXT_HEADER = struct.Struct("!HH")
_SEQUENCE = struct.Struct("!H")


class DirectSender:
    def __init__(self, transceiver: Any) -> None:
        self._transceiver = transceiver
        self._sender: Any = transceiver.sender
        # Below 2^15 like aiortc and libwebrtc: an early wrap-around can leave a receiver
        # unable to derive the SRTP index when the first packets are lost.
        self._seq = random_sequence_number()
        self._ts_origin = random.getrandbits(32)
        self._ready = False
        self._failed = False
        self._srtp: Any = None
        self._ice: Any = None
        self._ext = b""
        # transport-cc: the extension block around the sequence number, and its source
        self._ext_head = b""
        self._ext_tail = b""
        self._stamp: TransportSequenceMap | None = None
        self._first_byte = 0x80
        self._pt = 0
        self._ssrc = 0
        self.packets = 0
        self.octets = 0
        self.dropped = 0

    @property
    def usable(self) -> bool:
        """False once the internals turned out not to be what this module expects."""
        return not self._failed

    def resolve(self) -> bool:
        """Whether the connection is up and its internals found (checked until they are)."""
        if self._ready:
            return True
        if self._failed:
            return False
        sender = self._sender
        try:
            if not sender._RTCRtpSender__started:
                return False  # not connected yet: nothing can be sent either way
            dtls = sender.transport
            if dtls.state != "connected" or dtls._tx_srtp is None:
                return False
            self._srtp = dtls._tx_srtp
            self._ice = dtls.transport._connection
            self._pt = int(self._transceiver._codecs[0].payloadType)
            self._ssrc = int(sender._ssrc)
            extensions = sender._RTCRtpSender__rtp_header_extensions_map
            mid = self._transceiver.mid
            # The base class's set: a TransportSequenceMap's own would consume a number.
            profile, value = HeaderExtensionsMap.set(extensions, HeaderExtensions(mid=mid))
            offset = None
            if isinstance(extensions, TransportSequenceMap):
                profile, value, offset = _sequence_template(extensions, mid)
        # AssertionError and struct.error: header extensions aiortc cannot pack (an id or a
        # mid the offer checks let through); aiortc's own sender is left to report them.
        except (
            AssertionError,
            AttributeError,
            IndexError,
            TypeError,
            ValueError,
            struct.error,
        ) as exc:
            log.warning("direct send unavailable (aiortc internals changed?): %r", exc)
            self._failed = True
            return False
        if value:
            self._first_byte = 0x90  # version 2, extension bit
            self._ext = _EXT_HEADER.pack(profile, len(value) >> 2) + value
        if offset is not None:
            at = _EXT_HEADER.size + offset
            self._ext_head, self._ext_tail = self._ext[:at], self._ext[at + _SEQUENCE.size :]
            self._stamp = extensions
        self._ready = True
        return True

    def send(self, payload: bytes, pts: int) -> None:
        pair = self._ice._nominated.get(1)
        if pair is None:
            self.dropped += 1
            return
        transport = pair.protocol.transport
        if transport is None:
            self.dropped += 1
            return
        # A UDP transport says how much it holds back; a TURN relay's (aioice) does not.
        backlog = getattr(transport, "get_write_buffer_size", None)
        if backlog is not None and backlog() > MAX_BUFFERED_BYTES:
            self.dropped += 1
            return
        seq = self._seq = (self._seq + 1) & 0xFFFF
        timestamp = (self._ts_origin + pts) & 0xFFFFFFFF
        header = _RTP_HEADER.pack(self._first_byte, self._pt, seq, timestamp, self._ssrc)
        if self._stamp is None:
            packet = header + self._ext + payload
        else:
            number = _SEQUENCE.pack(self._stamp.stamp(len(payload)))
            packet = b"".join((header, self._ext_head, number, self._ext_tail, payload))
        transport.sendto(self._srtp.protect(packet), pair.remote_addr)
        self.packets += 1
        self.octets += len(payload)
        sender = self._sender
        # What aiortc's RTCP task puts in sender reports (packets, octets, NTP<->RTP time).
        sender._RTCRtpSender__packet_count = self.packets
        sender._RTCRtpSender__octet_count = self.octets
        if self.packets % SR_CLOCK_EVERY == 1:
            sender._RTCRtpSender__ntp_timestamp = clock.current_ntp_time()
            sender._RTCRtpSender__rtp_timestamp = timestamp


def _sequence_template(extensions: HeaderExtensionsMap, mid: str) -> tuple[int, bytes, int]:
    """The extension block with the MID and a transport-wide sequence number, and the
    offset of that number in it: found by serialising two numbers that differ in every bit
    (aiortc's map knows the negotiated id and element layout; this keeps it the authority)."""
    values = [
        HeaderExtensionsMap.set(extensions, HeaderExtensions(mid=mid, transport_sequence_number=n))
        for n in (0x0000, 0xFFFF)
    ]
    (profile, low), (_, high) = values
    differ = [i for i in range(len(low)) if low[i] != high[i]]
    if len(low) != len(high) or len(differ) != 2 or differ[1] != differ[0] + 1:
        raise ValueError("transport-wide sequence number not found in the extension block")
    return profile, low, differ[0]
