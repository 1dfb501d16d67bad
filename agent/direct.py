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
from aiortc.rtp import HeaderExtensions

log = logging.getLogger(__name__)

MAX_BUFFERED_BYTES = 64 * 1024  # a backed-up socket drops packets beyond this
SR_CLOCK_EVERY = 25  # refresh the sender report's NTP/RTP pair every 0.5 s of packets
_RTP_HEADER = struct.Struct("!BBHLL")
_EXT_HEADER = struct.Struct("!HH")


class DirectSender:
    def __init__(self, transceiver: Any) -> None:
        self._transceiver = transceiver
        self._sender: Any = transceiver.sender
        self._seq = random.getrandbits(16)
        self._ts_origin = random.getrandbits(32)
        self._ready = False
        self._failed = False
        self._srtp: Any = None
        self._ice: Any = None
        self._ext = b""
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
            profile, value = extensions.set(HeaderExtensions(mid=self._transceiver.mid))
        except (AttributeError, IndexError, TypeError) as exc:
            log.warning("direct send unavailable (aiortc internals changed?): %r", exc)
            self._failed = True
            return False
        if value:
            self._first_byte = 0x90  # version 2, extension bit
            self._ext = _EXT_HEADER.pack(profile, len(value) >> 2) + value
        self._ready = True
        return True

    def send(self, payload: bytes, pts: int) -> None:
        pair = self._ice._nominated.get(1)
        if pair is None:
            self.dropped += 1
            return
        transport = pair.protocol.transport
        if transport is None or transport.get_write_buffer_size() > MAX_BUFFERED_BYTES:
            self.dropped += 1
            return
        seq = self._seq = (self._seq + 1) & 0xFFFF
        timestamp = (self._ts_origin + pts) & 0xFFFFFFFF
        header = _RTP_HEADER.pack(self._first_byte, self._pt, seq, timestamp, self._ssrc)
        transport.sendto(self._srtp.protect(header + self._ext + payload), pair.remote_addr)
        self.packets += 1
        self.octets += len(payload)
        sender = self._sender
        # What aiortc's RTCP task puts in sender reports (packets, octets, NTP<->RTP time).
        sender._RTCRtpSender__packet_count = self.packets
        sender._RTCRtpSender__octet_count = self.octets
        if self.packets % SR_CLOCK_EVERY == 1:
            sender._RTCRtpSender__ntp_timestamp = clock.current_ntp_time()
            sender._RTCRtpSender__rtp_timestamp = timestamp
