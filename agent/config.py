"""The one configuration object, built by the CLI from flags and environment and passed down."""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard
from urllib.parse import urlsplit

import idna

from agent.conversation_config import ListenSettings, ServiceSettings
from agent.opus_rates import INPUT_RATES as OPUS_INPUT_RATES
from agent.opus_rates import MAX_BITRATE as OPUS_MAX_BITRATE
from agent.opus_rates import MIN_BITRATE as OPUS_MIN_BITRATE

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"


@dataclass(frozen=True)
class OpusSettings:
    """Initial encoder settings; the track exposes setters to change them at any time."""

    bitrate: int = 32_000
    complexity: int = 9
    # While the process's CPU cannot keep up, every encoder steps down towards this
    # complexity and climbs back after (agent/governor.py); equal to ``complexity``: fixed.
    complexity_floor: int = 0
    # ... and below complexity 6 it caps the coded band at wide-band first (8 kHz of audio:
    # SILK alone, a fifth to a third cheaper than full band at the same complexity), and at
    # medium-band (6 kHz) at complexity 1 or 0 (agent/governor.py); False (or a floor above
    # 6): the band stays full and only complexity steps.
    band_cap_under_load: bool = True
    fec: bool = False
    expected_loss_pct: int = 0
    # DTX would cut idle sessions from ~14 kbps (coded digital silence) to 0.4 kbps (1-byte
    # "no data" packets), but speech after a DTX stretch fades in over ~200 ms (measured:
    # frame RMS 0.10 -> 0.35 over 10 frames at an aiortc/FFmpeg receiver; resetting the
    # encoder at onset does not change it, so it is the decoder's recovery from DTX): every
    # utterance would start softly. Off by default; the setter is there for bandwidth.
    dtx: bool = False
    # Worker threads that encode the next speech frame ahead, off the event loop (-1: one
    # per core but one; 0: encode on the event loop). libopus releases the GIL, but the
    # hand-off costs loop time too: measured on 2 cores, 25 continuously speaking streams
    # held real time with one worker (0.93% gaps inline) while 40 fared worse (35 vs 42
    # packets/s). Off by default; one process per core (scale-out) is the main path.
    encode_threads: int = 0
    # The rate the speech path hands to the encoder (one libopus takes: 8, 12, 16, 24 or
    # 48 kHz). None: the engine's own rate when libopus takes it (ChatTTS: 24 kHz, encoded
    # as generated), else the next one up: no resampling, and 3-12% less encoder time than
    # the same audio upsampled to 48 kHz at the same quality (nothing above 12 kHz is lost:
    # a 24 kHz engine has nothing there). 48000: everything is resampled to 48 kHz.
    input_rate: int | None = None
    # Send a session's packets from its track's own timer straight to SRTP and UDP
    # (agent/direct.py) instead of through aiortc's per-sender task; False: aiortc's path.
    direct_send: bool = True

    def __post_init__(self) -> None:
        _check_bitrate("the Opus bitrate (--bitrate)", self.bitrate)
        if self.encode_threads < -1:
            raise ValueError(
                "encode threads (--encode-threads) must be -1 (one per core but one), 0 (on "
                f"the event loop) or more, got {self.encode_threads}"
            )
        if self.input_rate is not None and self.input_rate not in OPUS_INPUT_RATES:
            raise ValueError(
                f"the Opus input rate must be one of {OPUS_INPUT_RATES} Hz, got {self.input_rate}"
            )
        if not 0 <= self.complexity <= 10:
            raise ValueError(f"Opus complexity must be 0-10, got {self.complexity}")
        if not 0 <= self.complexity_floor <= self.complexity:
            raise ValueError(
                f"the Opus complexity floor must be 0-{self.complexity} (the complexity), "
                f"got {self.complexity_floor}"
            )


@dataclass(frozen=True)
class AdaptationSettings:
    """The bitrate controller's control law (agent/bitrate.py explains each rule).

    ``OpusSettings.bitrate`` is the ceiling and the start: a clean path stays there. The
    browser's ``maxaveragebitrate`` lowers the ceiling further.
    """

    enabled: bool = True
    min_bitrate: int = 12_000  # floor for congestion (delay, RTT, REMB) decreases
    # Floor for loss-driven decreases: below ~20 kbps libopus drops in-band FEC at 10% loss
    # (measured: no LBRR at 16 kbps, LBRR in 89% of speech packets at 20 kbps), and lowering
    # the rate further does not fix random loss, FEC does.
    fec_min_bitrate: int = 20_000
    loss_decrease: float = 0.05  # smoothed loss above this lowers the bitrate (agent/bitrate.py)
    loss_increase: float = 0.02  # loss at or below this lets the bitrate climb back
    increase_per_s: float = 0.15  # climb rate on a clean path (fraction of bitrate per second)
    increase_hold_s: float = 2.0  # no climbing this soon after a decrease
    decrease_interval_s: float = 0.3  # at most one decrease per interval (TWCC is ~10/s)
    fec_on_loss: float = 0.01  # this much loss over the newest 200 packets turns FEC on
    fec_off_after_s: float = 10.0  # FEC goes off after this long without loss
    # libopus only narrows the audio band to make room for FEC when told loss is above 5%;
    # at 5% or less and under ~28 kbps it silently sends no FEC (measured). FEC on therefore
    # tells it at least this much.
    fec_min_expected_loss_pct: int = 6
    rtt_spike_factor: float = 2.0  # RTT above factor x baseline (and +rtt_spike_min_s) ...
    rtt_spike_min_s: float = 0.1  # ... is queueing: decrease and hold
    congestion_backoff: float = 0.85  # multiplier on congestion signals
    queuing_delay_overuse_ms: float = 60.0  # TWCC: queueing above this and growing = overuse
    # ... growing: its trend over the newest 20 packets above this. Any positive slope
    # counted, and a standing queue's noise (0.5 ms of jitter) read as growth half the time:
    # a steady 80 ms queue was cut to the floor in 3.5 s (found by review).
    queuing_delay_trend_ms_per_s: float = 5.0
    queuing_delay_hold_ms: float = 20.0  # TWCC: no climbing while queueing exceeds this
    stats_interval_s: float = 1.0  # the data channel's ``stats`` event period (0: off)

    def __post_init__(self) -> None:
        _check_bitrate("the congestion floor min_bitrate (--min-bitrate)", self.min_bitrate)
        _check_bitrate("the loss floor fec_min_bitrate (--fec-min-bitrate)", self.fec_min_bitrate)


def _check_bitrate(name: str, value: int) -> None:
    """An Opus bitrate libopus takes as it is (it clamps one outside, silently)."""
    if not OPUS_MIN_BITRATE <= value <= OPUS_MAX_BITRATE:
        raise ValueError(
            f"{name} must be {OPUS_MIN_BITRATE}-{OPUS_MAX_BITRATE} bits/s, got {value}"
        )


@dataclass(frozen=True)
class SpeechSettings:
    """Limits of the per-session speech pipeline."""

    # Generation pauses when it is this far ahead of playout (seconds of audio buffered).
    max_buffer_ahead_s: float = 3.0
    # Utterances waiting behind the one being spoken; one more is refused with an error.
    max_queued_utterances: int = 32
    # Longest text accepted in one say / one text stream (characters).
    max_text_chars: int = 5_000
    # Largest data-channel message accepted (bytes).
    max_message_bytes: int = 16_384
    # A client's (or room participant's) text stream with no delta for this long is ended
    # as if its text.end came: one left open (an LLM call that died) held every later say
    # and reply of the session, of a whole room, for good. Longer than the LLM timeout.
    stream_idle_timeout_s: float = 30.0


# The devices ChatTTS may load on (torch's names); "auto": CUDA when present, else CPU.
DEVICES = re.compile(r"auto|cpu|mps|cuda(:[0-9]+)?")


@dataclass(frozen=True)
class ChatTTSSettings:
    """How the ChatTTS engine loads and streams."""

    model_dir: Path | None = None  # None: ChatTTS's own download from Hugging Face
    device: str = "auto"  # DEVICES: auto (CUDA when present) | cpu | cuda | cuda:N | mps
    compile: bool = False
    first_chunk_tokens: int = 24  # tokens generated before the first audio chunk
    chunk_tokens: int = 24  # smallest later chunk (tokens)
    threads: int = 0  # torch intra-op threads; 0: all cores but one on CPU, torch's on GPU
    decode_left_context: int = 4  # tokens re-decoded left of each decode window
    decode_lookahead: int = 4  # tokens at the frontier decoded but not emitted yet
    crossfade_samples: int = 512  # samples blended at each seam (21 ms at 24 kHz)
    # Later chunks grow with the audio already emitted (growth x emitted tokens, capped);
    # None: chosen after warm-up from the device's measured speed.
    chunk_growth: float | None = None
    max_chunk_tokens: int = 192
    # Streams generating together; more wait for a slot. A parked stream (far ahead of its
    # listener) lends its slot, and takes it back when its listener needs more even if the
    # batch is then wider for a while.
    max_batch: int = 8
    max_buffered_s: float = 2.0  # unread audio per stream before it stops using compute
    default_voice: str = "seed:2"
    max_new_tokens: int = 2048  # ChatTTS's own cap (~44 s per utterance)
    warmup_text: str = "Hello there."

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(
                f"torch threads (--threads) must be 0 (automatic) or more, got {self.threads}"
            )
        # Checked here, not by torch when the engine loads: by then the server is up, and a
        # typo (gpu, CPU) only shows as a traceback in its log and /readyz 503 for ever.
        if not DEVICES.fullmatch(self.device):
            raise ValueError(
                f"the device (--device) must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}"
            )


TTS_PLANES = ("local", "ray")


@dataclass(frozen=True)
class RaySettings:
    """The speech plane on Ray Serve (``--tts ray`` or ``--tts ray://ADDRESS``).

    Replicas, GPUs and autoscaling are Ray Serve's own deployment options, passed through;
    README "Speech on a Ray cluster" explains each.
    """

    # None: ray.init() without an address (a new local instance, or RAY_ADDRESS if set);
    # "ray://HOST:PORT": a running cluster's GCS address ("ray://auto": the cluster of this
    # node), joined from a node of that cluster (README "Speech on a Ray cluster").
    address: str | None = None
    app_name: str = "voice-agent-tts"
    replicas: int = 1  # fixed replica count; the floor when autoscaling
    max_replicas: int = 0  # above ``replicas``: Serve autoscales between the two
    # Autoscaling target: streams per replica (a replica generates up to max_batch at once).
    target_streams: float = 4.0
    # Streams one replica takes at once (Serve's max_ongoing_requests); more wait in Serve's
    # queue. A stream stays open while its audio *plays* (the replica paces it to lead_s
    # ahead of real time), mostly parked in the engine, so this bounds open streams (their
    # KV caches, a replica's share of sessions), not compute: the engine's scheduler shares
    # its max_batch rows among them. At max_batch, playing utterances alone would fill a
    # replica and a new one would wait for one of them to finish playing.
    max_streams: int = 32
    gpus_per_replica: float = 0.0  # 0: CPU; 0.5: two replicas share a GPU
    cpus_per_replica: float = 1.0
    # A replica stops pulling audio from its engine once it is this far ahead of real-time
    # playout of the stream (Ray Serve buffers streamed items without bound; README).
    lead_s: float = 3.0
    local_cpus: int | None = None  # CPUs a local instance offers (None: all)
    health_interval_s: float = 2.0  # how often the media process reads the app's status

    def __post_init__(self) -> None:
        # Each names its flag (signaling/cli.py): --ray-cpus -1 reached ray.init and failed
        # only after the server was up, as /readyz engine_failed (found by review).
        if self.replicas < 1:
            raise ValueError("the replicas (--tts-replicas) must be 1 or more")
        if self.max_replicas < 0:
            raise ValueError("the most replicas (--tts-max-replicas) must be 0 or more")
        if not 0 < self.lead_s < math.inf:
            raise ValueError("the lead (--tts-lead) must be a positive number of seconds")
        if self.max_streams < 1:
            raise ValueError(
                f"a replica's streams (--tts-max-streams) must be 1 or more, got {self.max_streams}"
            )
        if not 0 <= self.gpus_per_replica < math.inf:
            raise ValueError("the GPUs per replica (--tts-gpus-per-replica) must not be negative")
        if not 0 <= self.cpus_per_replica < math.inf:
            raise ValueError("the CPUs per replica (--tts-cpus-per-replica) must not be negative")
        if self.local_cpus is not None and self.local_cpus < 1:
            raise ValueError("the local Ray instance's CPUs (--ray-cpus) must be 1 or more")
        # Ray Serve refuses it only when the deployment starts, after the server is up.
        # (Checked even without autoscaling: turning it on later should not find it broken.)
        if not 0 < self.target_streams < math.inf:
            raise ValueError(
                "the autoscaling target (--tts-target-streams) must be a positive number of "
                f"streams per replica, got {self.target_streams}"
            )


# HS256 keys shorter than the hash output are brute-forceable (RFC 7518 section 3.2).
MIN_SECRET_BYTES = 32
ROLES = ("speaker", "listener", "host")
# Characters that end or rewrite a line of text: C0 controls (LF, CR among them), DEL, C1
# controls (NEL among them) and Unicode's line and paragraph separators (str.splitlines
# breaks at each). The text log escapes them (signaling/logs.py); a room name has none.
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# A room's name: what a request may ask for, a token may be bound to, and the token
# command mints (one rule, so a token never names a room the API refuses).
MAX_ROOM_CHARS = 64
ROOM_NAME_RULE = f"1-{MAX_ROOM_CHARS} characters, none a control character (e.g. a newline)"


def is_room_name(room: object) -> TypeGuard[str]:
    """A newline or other control character in a name has no use and would let it pose as
    separate lines wherever it is shown or logged (the text log escapes them too)."""
    return (
        isinstance(room, str)
        and 0 < len(room) <= MAX_ROOM_CHARS
        and CONTROL_CHARS.search(room) is None
    )


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _ascii_host(host: str) -> str:
    """A host as browsers put it in ``Origin``: ASCII as it is (lower case: "web_ui", which
    IDNA refuses, included), other labels in punycode after UTS #46 mapping."""
    if host.isascii():
        return host.lower()
    try:
        return idna.encode(host, uts46=True).decode("ascii")
    except idna.IDNAError:  # e.g. an emoji label: browsers still punycode it
        mapped = idna.uts46_remap(host, std3_rules=False, transitional=False)
        return ".".join(
            label if label.isascii() else "xn--" + label.encode("punycode").decode("ascii")
            for label in mapped.split(".")
        )


def serialized_origin(text: str) -> str:
    """``text`` as a browser's ``Origin`` header spells it (scheme://host[:port], lower case,
    an IDN host in punycode, IPv6 compressed, no default port); ValueError for what is no
    origin (a path, "*", no scheme) and for "null"."""
    if text.strip().lower() == "null":
        # Sent by file:// pages and sandboxed iframes of any site: allowing it allows all.
        raise ValueError(
            "CORS origin 'null' is refused: any site can send it (a sandboxed iframe); "
            "serve the page from an origin and list that"
        )
    try:
        parts = urlsplit(text.strip().rstrip("/"))
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (
        parts is None
        or not parts.scheme  # any: an app's own (capacitor://localhost) is an origin too
        or not parts.hostname
        or parts.path
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ValueError(
            f"CORS origin {text!r} is not an origin: give scheme://host[:port], e.g. "
            "https://app.example.com"
        )
    try:
        if ":" in parts.hostname:
            host = f"[{ipaddress.ip_address(parts.hostname).compressed}]"
        else:
            host = _ascii_host(parts.hostname)
    except (ValueError, idna.IDNAError):
        raise ValueError(f"CORS origin {text!r} has a host no browser would send") from None
    shown_port = "" if port in (None, _DEFAULT_PORTS.get(parts.scheme)) else f":{port}"
    return f"{parts.scheme}://{host}{shown_port}"


@dataclass(frozen=True)
class SecuritySettings:
    """Who may use the signaling API, and from which web origins."""

    # HS256 secret for bearer tokens; None: no authentication (a trusted network only).
    # repr=False: a logged or printed Config never shows it.
    auth_secret: str | None = field(default=None, repr=False)
    # Browser origins (scheme://host[:port]) allowed to call the API cross-origin; empty:
    # same-origin only (no CORS headers at all).
    cors_origins: tuple[str, ...] = ()
    # A static bearer token for GET /metrics; None: /metrics is open (scrapers rarely
    # mint JWTs, so it is separate from auth_secret).
    metrics_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Empty is not "none": None turns authentication off, which an empty value (e.g.
        # --auth-secret "$SECRET" with SECRET unset) must never do silently.
        if self.auth_secret == "":
            raise ValueError(
                "the auth secret (--auth-secret) is empty: leave it out to run without "
                "authentication"
            )
        if self.auth_secret is not None and len(self.auth_secret.encode()) < MIN_SECRET_BYTES:
            raise ValueError(f"the auth secret must be at least {MIN_SECRET_BYTES} bytes long")
        # Browsers send an Origin serialized: scheme and host in lower case, no default port.
        # An entry written otherwise never matched it, with no word of why.
        object.__setattr__(self, "cors_origins", tuple(map(serialized_origin, self.cors_origins)))
        if self.metrics_token == "":
            raise ValueError(
                "the metrics token (--metrics-token) is empty: leave it out for an open /metrics"
            )
        # An HTTP header's value loses its surrounding whitespace on the way (and the token
        # presented is stripped too): a token with any could never be presented.
        if self.metrics_token is not None and self.metrics_token != self.metrics_token.strip():
            raise ValueError(
                "the metrics token (--metrics-token) starts or ends with whitespace, which no "
                "request can present"
            )


@dataclass(frozen=True)
class LimitSettings:
    """Per-client rate limits (token buckets keyed by client address) and admission control."""

    # New sessions (POST /offer and POST /whep together): sustained rate per second, burst.
    offer_rate: float = 0.5
    offer_burst: int = 10
    # Speech requests (say and chat, a text.delta that opens a stream, HTTP say).
    speech_rate: float = 2.0
    speech_burst: int = 20
    # Most client addresses tracked per limiter; the least recently seen is dropped beyond.
    max_clients: int = 10_000
    # Concurrent sessions; more offers get 503 server_full before any peer connection exists.
    max_sessions: int = 200

    def __post_init__(self) -> None:
        # Not min(...) <= 0: a rate of nan passes it, and a nan bucket never runs dry.
        if not all(0 < rate < math.inf for rate in (self.offer_rate, self.speech_rate)):
            raise ValueError("rates must be positive numbers")
        if min(self.offer_burst, self.speech_burst, self.max_clients, self.max_sessions) < 1:
            raise ValueError("bursts, max_clients and max_sessions must be at least 1")


INSTRUCT_POLICIES = ("everyone", "hosts")


@dataclass(frozen=True)
class RoomSettings:
    """Voice rooms: several people and one agent; each voice encoded once (agent/room.py)."""

    max_participants: int = 50  # speakers and listeners together; more get 409 room_full
    # People sending a microphone at once; each takes a slot every other participant
    # receives on its own track, so a client offers this many extra receive-only tracks.
    max_speakers: int = 4
    # Who may send say/chat/text.delta/interrupt/config to the room's agent: everyone, or
    # only participants whose token role is "host" (without authentication, everyone is).
    instruct: str = "everyone"
    # Packets queued per subscriber track before the oldest is dropped (20 ms each).
    subscriber_queue_frames: int = 10
    # A speaker counts as talking above this level (dBFS of a 20 ms frame, smoothed) and
    # stops after ``speaking_hold_s`` below it.
    speaking_threshold_dbfs: float = -45.0
    speaking_hold_s: float = 0.6
    # Send each subscriber's packets straight from the source's tick (RTP header, SRTP,
    # sendto: agent/direct.py) instead of through aiortc's per-sender task; False: aiortc's
    # path (bench/room.py compares them).
    direct_send: bool = True

    def __post_init__(self) -> None:
        if self.instruct not in INSTRUCT_POLICIES:
            raise ValueError(f"room instruct policy must be one of {', '.join(INSTRUCT_POLICIES)}")
        if self.max_participants < 1 or self.max_speakers < 0:
            raise ValueError("max_participants must be at least 1, max_speakers at least 0")
        if self.subscriber_queue_frames < 1:
            raise ValueError("subscriber_queue_frames must be at least 1")


@dataclass(frozen=True)
class LifecycleSettings:
    """How long sessions wait for their peer, and how the server stops (0 turns a timer off)."""

    # A peer that has not connected (ICE + DTLS) this long after its offer was answered is
    # closed: a client that never came, or one behind a firewall.
    connect_timeout_s: float = 20.0
    # A connected peer that sent no RTCP (and no data-channel message) for this long is
    # treated as gone. Chrome sends an audio receiver report every ~2.5-7 s, aiortc every
    # 0.5-1.5 s; aioice's own consent check needs ~30 s (6 failed checks 5 s apart).
    rtcp_timeout_s: float = 12.0
    # A lost peer's session (same id, queue, voice) waits this long for the client to come
    # back with its session token; playout pauses meanwhile. 0: closed at once.
    resume_grace_s: float = 15.0
    # A session with no client request and no speech (played, or the user's voice activity)
    # for this long is closed.
    idle_timeout_s: float = 600.0
    # On SIGTERM: speech in flight may finish for up to this long before every peer closes.
    drain_deadline_s: float = 20.0

    def __post_init__(self) -> None:
        timers = (
            self.connect_timeout_s,
            self.rtcp_timeout_s,
            self.resume_grace_s,
            self.idle_timeout_s,
            self.drain_deadline_s,
        )
        if not all(0 <= t < math.inf for t in timers):  # nan fails every comparison
            raise ValueError("timeouts must be finite and not negative (0: off)")


@dataclass(frozen=True)
class BreakerSettings:
    """The circuit breaker around the speech engine (agent/breaker.py)."""

    # This many engine failures in a row, all within window_s, open the breaker: new speech
    # fails fast with tts_unavailable and /readyz turns unready.
    failures: int = 5
    window_s: float = 30.0
    # After this long open, one probe utterance runs; its success closes the breaker.
    cooldown_s: float = 10.0
    probe_text: str = "Hello."
    # An utterance whose engine stream gives no audio for this long while the engine gives
    # no stream any (agent/breaker.py; the listener's own back-pressure does not count)
    # fails (tts_failed) and counts as a failure: a hung engine (a wedged GPU, a lost
    # replica) would otherwise keep its sessions silent, queued speech behind it, with
    # /readyz still ready. 0: no limit.
    stall_s: float = 60.0

    def __post_init__(self) -> None:
        if self.failures < 1 or not (
            0 < self.window_s < math.inf and 0 < self.cooldown_s < math.inf
        ):
            raise ValueError("breaker failures must be at least 1, window and cool-down positive")
        if not 0 <= self.stall_s < math.inf:
            raise ValueError("the engine stall timeout must be 0 (none) or positive")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Config:
    host: str = "0.0.0.0"
    port: int = 8080
    # ICE server URLs (stun:/turn:). Empty works on a LAN and on localhost.
    ice_servers: tuple[str, ...] = ()
    ice_username: str | None = None
    ice_credential: str | None = None
    engine: str = "chattts"
    tts: str = "local"  # where the engine runs: in this process, or on Ray Serve (TTS_PLANES)
    static_dir: Path = STATIC_DIR
    log_level: str = "INFO"
    log_json: bool = False  # one JSON object per log line (for log collectors)
    opus: OpusSettings = field(default_factory=OpusSettings)
    adaptation: AdaptationSettings = field(default_factory=AdaptationSettings)
    speech: SpeechSettings = field(default_factory=SpeechSettings)
    chattts: ChatTTSSettings = field(default_factory=ChatTTSSettings)
    ray: RaySettings = field(default_factory=RaySettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    lifecycle: LifecycleSettings = field(default_factory=LifecycleSettings)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    # Media processes behind one address (signaling/workers.py); 1 = this process alone.
    workers: int = 1
    # Set inside a worker process: its index (session ids carry it, so the front process
    # can route every later request for a session to the process that holds it).
    worker_index: int | None = None
    rooms: RoomSettings = field(default_factory=RoomSettings)
    listen: ListenSettings = field(default_factory=ListenSettings)
    services: ServiceSettings = field(default_factory=ServiceSettings)

    def __post_init__(self) -> None:
        for url in self.ice_servers:
            _check_ice_server(url)
        # A TURN server takes no call without credentials, and the browser's
        # RTCPeerConnection refuses such an entry outright: every Connect would fail.
        turn = [u for u in self.ice_servers if u.startswith(("turn:", "turns:"))]
        if turn and not (self.ice_username and self.ice_credential):
            raise ValueError(
                f"the TURN server {turn[0]!r} (--ice-server) needs --ice-username and "
                "--ice-credential"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(
                f"the port (--port) must be 0-65535 (0: any free one), got {self.port}"
            )
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"the log level (--log-level) must be one of {', '.join(LOG_LEVELS)}, "
                f"got {self.log_level!r}"
            )
        if self.workers < 1:
            raise ValueError(f"workers (media processes) must be at least 1, got {self.workers}")
        # Fewer would leave batch rows idle while streams wait in Serve's queue.
        if self.tts == "ray" and self.ray.max_streams < self.chattts.max_batch:
            raise ValueError(
                f"streams per replica (--tts-max-streams, {self.ray.max_streams}) must not be "
                f"below the engine's batch (max_batch, {self.chattts.max_batch})"
            )
        # The controller would silently use the ceiling as its floor (agent/bitrate.py).
        if self.adaptation.enabled and self.adaptation.min_bitrate > self.opus.bitrate:
            raise ValueError(
                f"the adaptation floor min_bitrate (--min-bitrate, {self.adaptation.min_bitrate})"
                f" must not be above the Opus bitrate (--bitrate, {self.opus.bitrate})"
            )


def _check_ice_server(url: str) -> None:
    """A URL aiortc parses: it parses them for every new peer connection, so one it refuses
    would fail every offer (400 bad_sdp) instead of stopping the server at start."""
    # aiortc is imported only with ICE servers configured (most setups have none): it is
    # ~0.2 s that a Config, and the command line, need not pay otherwise.
    from aiortc import RTCIceServer
    from aiortc.rtcicetransport import connection_kwargs

    usage = (
        f"the ICE server {url!r} (--ice-server) is not a STUN or TURN URL aiortc uses: "
        "stun:HOST[:PORT], turn:HOST[:PORT][?transport=udp|tcp] or "
        "turns:HOST[:PORT]?transport=tcp"
    )
    try:
        # What each peer connection does with it (placeholder credentials: those are the
        # --ice-username/--ice-credential flags' business). Parsing alone is not enough:
        # aiortc silently skips stuns:, TURN over another transport and TURNS over UDP.
        used = connection_kwargs([RTCIceServer(urls=url, username="u", credential="c")])
    except ValueError as exc:
        raise ValueError(f"{usage} (aiortc: {exc})") from None
    if not used:
        raise ValueError(usage)
    # aiortc takes any digits for a port: 99999 started the server, then every offer's ICE
    # gathering failed to send to it (an OverflowError traceback per session, and no
    # reflexive or relayed candidate: the calls from behind NAT it was configured for).
    for server in ("stun_server", "turn_server"):
        address = used.get(server)
        if address is not None and not 1 <= address[1] <= 65535:
            raise ValueError(f"{usage}: port {address[1]} is not 1-65535")
