"""A lossy UDP relay on this machine, for tests and benches: real packet loss between peers.

``LossyRelay`` owns two UDP sockets on the host address that aioice gathers (aioice never
gathers 127.0.0.1, so a relay on loopback would never be paired):

* ``client_side``: the address the *client* talks to. The server's answer is rewritten so
  its only ICE candidate is this address.
* ``server_side``: the address the *server* talks to. The client's offer is rewritten so its
  only ICE candidate is this address.

The relay learns the real endpoints from the original SDP (the first IPv4 UDP host candidate
of each; with BUNDLE that is the transport both peers keep) and, after that, from the source
of every datagram, and forwards ``client_side <-> server_side``. Both peers see only the
relay, so every STUN check, DTLS record, SCTP chunk and SRTP packet crosses it.

Loss is per direction (``downstream``: server -> client, ``upstream``: client -> server)
and deterministic: each direction draws ``random.Random(seed)`` exactly once per RTP packet,
whatever the loss rate is at that moment, and drops the packet when the draw is below the
rate. So the Nth RTP packet of a direction meets the same draw in every run with the same
seed, the dropped set only grows with the rate, and ``set_loss`` at runtime changes the rate
without shifting the pattern. Packets are classified as RFC 7983 / RFC 5761 say: STUN and
DTLS (so also the data channel, which is SCTP over DTLS) are never dropped; RTCP is dropped
only with ``drop_rtcp=True`` (with its own generator, so it does not shift the RTP pattern).
Optional per direction: Gilbert-Elliott bursts (``set_burst``) and a fixed extra delay
(``set_delay``, applied to every packet of that direction, STUN included).

Python client (``tests/rtc_client.py``)::

    async with aiohttp.ClientSession() as http, relayed_client(
        live_server.url, http, {"seed": 7}
    ) as (client, relay):
        relay.set_loss(downstream=0.10)
        ...
        print(relay.downstream.rtp_dropped, relay.downstream.dropped_rtp_indices[:10])

Playwright (Chromium must be launched with ``--disable-features=WebRtcHideLocalIpsWithMdns``
so its candidates carry real IP addresses, not ``*.local`` names the relay cannot reach)::

    async with LossyRelay(seed=7, downstream_loss=0.1) as relay:
        await page.route("**/offer", playwright_offer_route(relay))
        ...  # connect through the page as usual

or, by hand, ``relay.rewrite_offer(offer_sdp)`` on the request's ``sdp`` and
``relay.rewrite_answer(answer_sdp)`` on the response's (offer first: it tells the relay where
the client is).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.rtc_client import RtcClient

Address = tuple[str, int]

CANDIDATE_PRIORITY = 2130706431  # a host candidate's usual priority (type pref 126)
DEFAULT_MAX_RECORDED = 10_000


# ---------------------------------------------------------------------------------------
# Packet classification (RFC 7983 demultiplexing, RFC 5761 RTP/RTCP on one port)


class PacketKind(enum.Enum):
    STUN = "stun"
    DTLS = "dtls"
    RTP = "rtp"
    RTCP = "rtcp"
    OTHER = "other"


def classify(data: bytes) -> PacketKind:
    """What a datagram on a WebRTC 5-tuple carries, by its first byte(s)."""
    if not data:
        return PacketKind.OTHER
    first = data[0]
    if first <= 3:
        return PacketKind.STUN
    if 20 <= first <= 63:
        return PacketKind.DTLS
    if 128 <= first <= 191:
        # RTCP packet types 192..223 (SR, RR, SDES, BYE, APP, RTPFB, PSFB, ...) sit where an
        # RTP packet has marker + payload type; RFC 5761 keeps RTP payload types 64..95 free.
        if len(data) >= 2 and 192 <= data[1] <= 223:
            return PacketKind.RTCP
        return PacketKind.RTP
    return PacketKind.OTHER


# ---------------------------------------------------------------------------------------
# Loss models and counters


@dataclass(frozen=True)
class GilbertElliott:
    """Two-state burst loss: ``p`` good->bad and ``r`` bad->good per RTP packet.

    Mean burst length is ``1 / r``; the long-run share of packets in the bad state is
    ``p / (p + r)``, so the mean loss is ``(r * loss_good + p * loss_bad) / (p + r)``.
    """

    p: float
    r: float
    loss_good: float = 0.0
    loss_bad: float = 1.0

    @property
    def mean_loss(self) -> float:
        if self.p + self.r == 0:
            return self.loss_good
        return (self.r * self.loss_good + self.p * self.loss_bad) / (self.p + self.r)


@dataclass
class DirectionStats:
    """Counters of one direction. ``dropped_rtp_indices`` are 0-based indices among the RTP
    packets of this direction (the first ``max_recorded`` drops)."""

    rtp_forwarded: int = 0
    rtp_dropped: int = 0
    rtcp_forwarded: int = 0
    rtcp_dropped: int = 0
    stun_forwarded: int = 0
    dtls_forwarded: int = 0
    other_forwarded: int = 0
    unroutable: int = 0  # arrived before the other peer's address was known
    dropped_rtp_indices: list[int] = field(default_factory=list)

    @property
    def rtp_seen(self) -> int:
        return self.rtp_forwarded + self.rtp_dropped

    @property
    def rtp_loss(self) -> float:
        return self.rtp_dropped / self.rtp_seen if self.rtp_seen else 0.0


class _Direction:
    def __init__(self, name: str, seed: int, loss: float, drop_rtcp: bool, max_recorded: int):
        self.name = name
        self.loss = _check_rate(loss)
        self.drop_rtcp = drop_rtcp
        self.delay = 0.0
        self.burst: GilbertElliott | None = None
        self.bad = False
        self.max_recorded = max_recorded
        self.stats = DirectionStats()
        self._rtp_rng = random.Random(seed)
        self._rtcp_rng = random.Random(f"rtcp:{seed}")
        self._burst_rng = random.Random(f"burst:{seed}")

    def admit(self, kind: PacketKind) -> bool:
        """Count the packet; True to forward it, False to drop it."""
        stats = self.stats
        if kind is PacketKind.RTP:
            index = stats.rtp_seen
            draw = self._rtp_rng.random()  # once per RTP packet, whatever the rate
            if self.burst is not None:
                if self._burst_rng.random() < (self.burst.r if self.bad else self.burst.p):
                    self.bad = not self.bad
                rate = self.burst.loss_bad if self.bad else self.burst.loss_good
            else:
                rate = self.loss
            if draw < rate:
                stats.rtp_dropped += 1
                if len(stats.dropped_rtp_indices) < self.max_recorded:
                    stats.dropped_rtp_indices.append(index)
                return False
            stats.rtp_forwarded += 1
            return True
        if kind is PacketKind.RTCP:
            draw = self._rtcp_rng.random()
            if self.drop_rtcp and draw < self.loss:
                stats.rtcp_dropped += 1
                return False
            stats.rtcp_forwarded += 1
            return True
        if kind is PacketKind.STUN:
            stats.stun_forwarded += 1
        elif kind is PacketKind.DTLS:
            stats.dtls_forwarded += 1
        else:
            stats.other_forwarded += 1
        return True


def _check_rate(rate: float) -> float:
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"a loss rate is between 0 and 1, not {rate}")
    return float(rate)


# ---------------------------------------------------------------------------------------
# SDP helpers


def first_udp_ipv4_candidate(sdp: str) -> Address:
    """The address of the first ``typ host`` UDP candidate with an IPv4 address."""
    for line in sdp.splitlines():
        parts = line.strip().split()
        # a=candidate:<foundation> <component> <transport> <priority> <address> <port> typ <t>
        if len(parts) < 8 or not line.startswith("a=candidate:"):
            continue
        if parts[2].lower() != "udp" or parts[6] != "typ" or parts[7] != "host":
            continue
        try:
            ipaddress.IPv4Address(parts[4])
        except ValueError:
            continue  # IPv6 or an mDNS name
        return parts[4], int(parts[5])
    raise ValueError("the SDP has no IPv4 UDP host candidate (mDNS-hidden browser candidates?)")


def rewrite_candidates(sdp: str, host: str, port: int) -> str:
    """Replace every ``a=candidate`` line with one UDP host candidate at ``host:port``.

    Each media section that had candidates gets exactly one, where its first one was;
    ``a=end-of-candidates`` stays. The section's ``c=`` address and (non-zero) m-line port
    follow, so the SDP tells one story; ICE itself only reads the candidates.
    """
    newline = "\r\n" if "\r\n" in sdp else "\n"
    trailing = sdp.endswith(newline)
    lines = sdp.split(newline)
    if trailing:
        lines = lines[:-1]
    candidate = f"a=candidate:netem0 1 udp {CANDIDATE_PRIORITY} {host} {port} typ host"
    sections: list[list[str]] = [[]]
    for line in lines:
        if line.startswith("m="):
            sections.append([])
        sections[-1].append(line)
    out: list[str] = []
    for index, section in enumerate(sections):
        has_candidates = any(line.startswith("a=candidate:") for line in section)
        if index == 0 or not has_candidates:
            out.extend(section)
            continue
        placed = False
        for line in section:
            if line.startswith("a=candidate:"):
                if not placed:
                    out.append(candidate)
                    placed = True
            elif line.startswith("m="):
                parts = line.split(" ")
                if len(parts) > 1 and parts[1] != "0":
                    parts[1] = str(port)
                out.append(" ".join(parts))
            elif line.startswith("c=IN IP4 ") or line.startswith("c=IN IP6 "):
                out.append(f"c=IN IP4 {host}")
            else:
                out.append(line)
    return newline.join(out) + (newline if trailing else "")


def host_ipv4() -> str:
    """The first IPv4 address aioice gathers host candidates on (never 127.0.0.1)."""
    from aioice.ice import get_host_addresses

    addresses = get_host_addresses(use_ipv4=True, use_ipv6=False)
    if not addresses:
        raise RuntimeError("no non-loopback IPv4 address: aioice would gather no candidate")
    return str(addresses[0])


# ---------------------------------------------------------------------------------------
# The relay


class _Side(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes, Address], None]) -> None:
        self._on_datagram = on_datagram

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self._on_datagram(data, (str(addr[0]), int(addr[1])))

    def error_received(self, exc: Exception) -> None:  # ICMP port unreachable etc.
        pass


class LossyRelay:
    """A UDP relay between one WebRTC client and the server with seeded, per-direction loss.

    ``seed`` drives downstream; upstream uses ``seed + 1`` unless ``upstream_seed`` is given.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        downstream_loss: float = 0.0,
        upstream_loss: float = 0.0,
        drop_rtcp: bool = False,
        upstream_seed: int | None = None,
        host: str | None = None,
        max_recorded: int = DEFAULT_MAX_RECORDED,
    ) -> None:
        self.host = host
        self._down = _Direction("downstream", seed, downstream_loss, drop_rtcp, max_recorded)
        self._up = _Direction(
            "upstream",
            seed + 1 if upstream_seed is None else upstream_seed,
            upstream_loss,
            drop_rtcp,
            max_recorded,
        )
        self.client_addr: Address | None = None  # the client's real address
        self.server_addr: Address | None = None  # the server's real address
        self._client_transport: asyncio.DatagramTransport | None = None
        self._server_transport: asyncio.DatagramTransport | None = None
        self._pending: set[asyncio.TimerHandle] = set()
        # Drop every datagram both ways, STUN and DTLS included: a client that vanished.
        self.blackout = False
        self.blackout_dropped = 0

    # -- lifecycle

    async def start(self) -> LossyRelay:
        loop = asyncio.get_running_loop()
        host = self.host or host_ipv4()
        self.host = host
        client_transport, _ = await loop.create_datagram_endpoint(
            lambda: _Side(self._from_client), local_addr=(host, 0)
        )
        server_transport, _ = await loop.create_datagram_endpoint(
            lambda: _Side(self._from_server), local_addr=(host, 0)
        )
        self._client_transport = client_transport
        self._server_transport = server_transport
        return self

    async def close(self) -> None:
        for handle in self._pending:
            handle.cancel()
        self._pending.clear()
        for transport in (self._client_transport, self._server_transport):
            if transport is not None:
                transport.close()
        self._client_transport = self._server_transport = None

    async def __aenter__(self) -> LossyRelay:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- addresses

    @property
    def client_side(self) -> Address:
        """Where the client sends (the candidate put in the server's answer)."""
        return _local_address(self._client_transport)

    @property
    def server_side(self) -> Address:
        """Where the server sends (the candidate put in the client's offer)."""
        return _local_address(self._server_transport)

    # -- SDP

    def rewrite_offer(self, sdp: str) -> str:
        """Learn the client from its offer; the server will see only ``server_side``."""
        self.client_addr = first_udp_ipv4_candidate(sdp)
        return rewrite_candidates(sdp, *self.server_side)

    def rewrite_answer(self, sdp: str) -> str:
        """Learn the server from its answer; the client will see only ``client_side``."""
        self.server_addr = first_udp_ipv4_candidate(sdp)
        return rewrite_candidates(sdp, *self.client_side)

    # -- impairments

    @property
    def downstream(self) -> DirectionStats:
        """Counters of server -> client."""
        return self._down.stats

    @property
    def upstream(self) -> DirectionStats:
        """Counters of client -> server."""
        return self._up.stats

    def set_loss(self, *, downstream: float | None = None, upstream: float | None = None) -> None:
        """Change the loss rate of a direction from its next packet on (``None``: keep)."""
        if downstream is not None:
            self._down.loss = _check_rate(downstream)
        if upstream is not None:
            self._up.loss = _check_rate(upstream)

    def set_drop_rtcp(self, drop: bool) -> None:
        """Drop RTCP too (at each direction's loss rate), or not."""
        self._down.drop_rtcp = self._up.drop_rtcp = drop

    def set_burst(
        self,
        *,
        downstream: GilbertElliott | bool | None = False,
        upstream: GilbertElliott | bool | None = False,
    ) -> None:
        """Gilbert-Elliott bursts for a direction; ``None`` back to plain ``loss``;
        ``False`` (the default) leaves a direction as it is. While bursts are on they
        decide the rate and ``set_loss`` only matters for RTCP."""
        for direction, model in ((self._down, downstream), (self._up, upstream)):
            if model is False:
                continue
            direction.burst = model if isinstance(model, GilbertElliott) else None
            direction.bad = False

    def set_delay(self, *, downstream: float | None = None, upstream: float | None = None) -> None:
        """A fixed extra one-way delay in seconds for every packet of a direction."""
        if downstream is not None:
            self._down.delay = max(0.0, downstream)
        if upstream is not None:
            self._up.delay = max(0.0, upstream)

    # -- forwarding

    def _from_client(self, data: bytes, addr: Address) -> None:
        self.client_addr = addr
        self._forward(self._up, data, self._server_transport, self.server_addr)

    def _from_server(self, data: bytes, addr: Address) -> None:
        self.server_addr = addr
        self._forward(self._down, data, self._client_transport, self.client_addr)

    def _forward(
        self,
        direction: _Direction,
        data: bytes,
        transport: asyncio.DatagramTransport | None,
        target: Address | None,
    ) -> None:
        if transport is None:
            return
        if self.blackout:
            self.blackout_dropped += 1
            return
        if target is None:
            direction.stats.unroutable += 1
            return
        if not direction.admit(classify(data)):
            return
        if direction.delay <= 0:
            transport.sendto(data, target)
            return
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle

        def send() -> None:
            self._pending.discard(handle)
            if not transport.is_closing():
                transport.sendto(data, target)

        handle = loop.call_later(direction.delay, send)
        self._pending.add(handle)


def _local_address(transport: asyncio.DatagramTransport | None) -> Address:
    if transport is None:
        raise RuntimeError("the relay is not started")
    sockname = transport.get_extra_info("sockname")
    return str(sockname[0]), int(sockname[1])


# ---------------------------------------------------------------------------------------
# Wiring for tests


@contextlib.asynccontextmanager
async def relayed_client(
    base_url: str,
    http: aiohttp.ClientSession,
    relay_kwargs: Mapping[str, Any] | None = None,
    *,
    whep: bool = False,
    room: str | None = None,
    prepare: Callable[[RtcClient], None] | None = None,
) -> AsyncIterator[tuple[RtcClient, LossyRelay]]:
    """A started relay and an ``RtcClient`` connected to the server through it.

    ``prepare`` is called on the client before it connects (e.g. to set codec preferences).
    """
    async with LossyRelay(**dict(relay_kwargs or {})) as relay:
        client = RtcClient(base_url, http)
        if prepare is not None:
            prepare(client)
        try:
            await client.connect(
                whep=whep,
                room=room,
                rewrite_offer=relay.rewrite_offer,
                rewrite_answer=relay.rewrite_answer,
            )
            yield client, relay
        finally:
            await client.close()


def playwright_offer_route(relay: LossyRelay) -> Callable[[Any], Awaitable[None]]:
    """A ``page.route("**/offer", ...)`` handler that sends the page's call through ``relay``.

    Rewrites the request JSON's ``sdp`` (the offer) and, on success, the response JSON's
    ``sdp`` (the answer); the server's errors pass through untouched. An offer without an
    IPv4 UDP host candidate gets a 400 ``netem_no_candidate`` error. Launch Chromium with
    ``--disable-features=WebRtcHideLocalIpsWithMdns`` so its candidates are never hidden
    behind ``*.local`` names (Chromium 156 headless with tests/test_browser.py's flags
    showed real addresses even without it; the flag makes that independent of version and
    permissions).
    """

    async def handle(route: Any) -> None:
        body = route.request.post_data_json
        if not isinstance(body, dict) or not isinstance(body.get("sdp"), str):
            await route.continue_()
            return
        try:
            body["sdp"] = relay.rewrite_offer(body["sdp"])
        except ValueError as exc:  # no IPv4 candidate: mDNS-hidden, or none gathered
            error = {"code": "netem_no_candidate", "message": str(exc)}
            await route.fulfill(status=400, json={"error": error})
            return
        response = await route.fetch(post_data=json.dumps(body))
        if not response.ok:
            await route.fulfill(response=response)
            return
        data = await response.json()
        data["sdp"] = relay.rewrite_answer(data["sdp"])
        await route.fulfill(response=response, json=data)

    return handle
