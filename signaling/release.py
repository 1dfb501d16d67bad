"""Closing a peer connection so that its memory is freed when the last reference goes.

A closed aiortc 1.16 peer connection is not freed by reference counting: its objects sit in
reference cycles, so only CPython's cyclic garbage collector frees them, and a session lives
long enough (seconds) for them to reach the oldest generation, which is collected only after
about a quarter as many new objects as already live have been promoted. Measured with the
collector off (tests/test_release.py): every closed session left ~370 server-side objects
behind, with their native parts (OpenSSL DTLS connection and context, SRTP sessions, the
libopus encoder); dozens of closed sessions waited for a full collection at any time, the
heap grew to hold them, and glibc and pymalloc kept that high-water mark (bench/soak.py:
+18-30% RSS after warm-up; with a full collection after each close, +1.4-1.7%, but a full
collection stalls the event loop 40-100 ms).

The cycles, and which side breaks each:

- aiortc: ``RTCPeerConnection`` listens to each ``RTCDtlsTransport``'s ``statechange`` with
  a bound method and never removes it (``close()`` clears the listeners on itself and the
  ICE transport clears its own, the DTLS transport does not): pc -> transceivers -> sender
  -> DTLS transport -> listener -> pc. Removed here after ``close()``.
- aioice 0.13: ``Connection.close()`` empties its protocol list but not its check list, whose
  candidate pairs hold the STUN protocols that hold the connection. Emptied here.
- ours: signaling/lifecycle.py's RTCP tap and agent/feedback.py's feedback tap wrap the
  sender's (and the DTLS transport's) handler, and the feedback tap the sender's RTCP send
  (to time its sender reports), in an instance attribute that calls the original bound
  method: sender -> wrapper -> bound method -> sender. The wrappers are
  dropped here, after the pc is closed (nothing calls them any more).

Left to the collector: pyOpenSSL's ``_VerifyHelper`` (its ffi callback refers back to it;
six small objects per peer connection, the SSL context is not in the cycle).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiortc import RTCPeerConnection

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
# Each step of a close finished by hand, after pc.close() was given up.
STEP_TIMEOUT_S = 1.0

# Instance attributes that wrap an aiortc method (the taps above); class methods remain.
_TAPPED_SENDER = ("_handle_rtcp_packet", "_send_rtcp")
_TAPPED_DTLS = "_handle_rtcp_data"


async def close_peer_connection(pc: RTCPeerConnection, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """``pc.close()``, then break the reference cycles it leaves (see the module doc).

    At most ``timeout_s``: aiortc 1.16's receiver waits for its RTCP task to say it exited,
    and one that died of an exception never says so (signaling/ssrcguard.py closes the way
    known to kill it). A close that hangs would hang the session's close with it, and the
    drain at shutdown; it is given up instead, and said."""
    try:
        await asyncio.wait_for(pc.close(), timeout_s)
    except TimeoutError:
        log.error("closing a peer connection did not finish in %.0f s: given up", timeout_s)
        await _finish_close(pc)
    release_closed(pc)


async def _finish_close(pc: RTCPeerConnection) -> None:
    """The steps of ``pc.close()`` after the one that hung, each bounded: given up inside
    its first step (stopping a transceiver), it never stopped the senders, the DTLS and ICE
    transports: the session's UDP sockets stayed open and aioice kept sending consent checks
    for the life of the process (found by review). And its close future is settled, so a
    later ``close()`` returns instead of waiting on it forever."""
    steps: list[Callable[[], Awaitable[None]]] = []
    for transceiver in pc.getTransceivers():
        steps.append(transceiver.sender.stop)
    if pc.sctp is not None:
        steps.append(pc.sctp.stop)
    for transceiver in pc.getTransceivers():
        dtls = transceiver.receiver.transport
        steps += [dtls.stop, dtls.transport.stop]
    if pc.sctp is not None:
        steps += [pc.sctp.transport.stop, pc.sctp.transport.transport.stop]
    for step in steps:
        # one more hang or a transport already half-stopped must not stop the others
        with contextlib.suppress(Exception):
            await asyncio.wait_for(step(), STEP_TIMEOUT_S)
    closed = getattr(pc, "_RTCPeerConnection__isClosed", None)
    if isinstance(closed, asyncio.Future) and not closed.done():
        closed.set_result(True)
    pc.remove_all_listeners()


def release_closed(pc: RTCPeerConnection) -> None:
    """Break the cycles of an already closed peer connection. Idempotent."""
    dtls_transports: list[Any] = []
    for transceiver in pc.getTransceivers():
        for name in _TAPPED_SENDER:
            vars(transceiver.sender).pop(name, None)
        dtls_transports.append(transceiver.sender.transport)
    if pc.sctp is not None:
        dtls_transports.append(pc.sctp.transport)
    for dtls in dtls_transports:
        dtls.remove_all_listeners()
        vars(dtls).pop(_TAPPED_DTLS, None)
        # RTCIceTransport has no public handle on its aioice Connection.
        connection = getattr(dtls.transport, "_connection", None)
        if connection is not None:
            connection._check_list.clear()
