"""``RayServeEngine``: the TTSEngine of a media process whose speech runs on Ray Serve.

The media process keeps sessions, pacing and encoding; the model and generation live in the
``SpeechReplica`` deployment. ``synthesize`` calls it through a DeploymentHandle with
``stream=True``: chunks arrive as an async stream; closing or cancelling the consumer calls
``response.cancel()``, which cancels the replica's generator and with it the engine stream
(its row leaves the batch at the next step). A replica that dies mid-stream raises here as
``EngineError`` (the session reports ``tts_failed`` and lives on); Serve restarts the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from agent.chattts.speakers import check_voice_without_model
from agent.config import ChatTTSSettings, RaySettings
from agent.engine import PCM, EngineError, EngineLoadError, RequestError, VoiceOptions
from agent.raytts.deployment import fingerprint, speech_app
from agent.text.normalize import reads_aloud
from agent.threads import job_settling

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

log = logging.getLogger(__name__)

T = TypeVar("T")

# The directory holding the ``agent`` package: a local Ray instance's workers import it from
# here (not from wherever an installed copy points), so replicas run this very code.
SOURCE_ROOT = Path(__file__).resolve().parent.parent.parent

# While the app deploys: how often its state is read, and its message logged.
DEPLOY_POLL_S = 0.5
DEPLOY_REPORT_S = 30.0
DEPLOY_APPEAR_S = 5.0  # an app not in Serve's status this long after its deploy is gone
# How long close() waits for Ray to disconnect.
DISCONNECT_TIMEOUT_S = 10.0

# Serve application states in which no replica can take a stream.
FAILED_STATES = ("DEPLOY_FAILED", "UNHEALTHY", "DELETING")


class RayServeEngine:
    name = "chattts-ray"

    def __init__(self, settings: RaySettings, chattts: ChatTTSSettings) -> None:
        self.settings = settings
        self.chattts = chattts
        self.sample_rate = 24_000  # replaced by the replica's own at start
        self._handle: DeploymentHandle[Any] | None = None
        self._inited_ray = False  # True: this engine connected this process to Ray
        self._started_ray = False  # True: ... and started the (local) instance it uses
        self._warm = False
        self._status: str | None = None  # the Serve application's latest status
        self._failure: str | None = None
        self._watch: asyncio.Task[None] | None = None
        self._start_lock = asyncio.Lock()
        self._driver = _DriverThread()
        self._speaker_dim: int | None = None  # from a replica's info, once started

    @property
    def ready(self) -> bool:
        return self._warm and self._failure is None and self._status == "RUNNING"

    @property
    def failure(self) -> str | None:
        return self._failure

    def check_voice(self, voice: VoiceOptions) -> None:
        """Raise ``RequestError`` (``UnknownVoice``) for a voice the replicas would refuse, as
        the in-process engine does at ``config``: accepted, it replaced the session's voice
        and every utterance after failed (found by review). Without the model: a speaker
        string is read once a replica said its width (start)."""
        check_voice_without_model(voice, self.chattts.default_voice, self._speaker_dim)

    @property
    def handle(self) -> DeploymentHandle[Any]:
        """The deployment's handle (tests and benches read replica ``stats`` through it)."""
        if self._handle is None:
            raise EngineError("the Ray Serve engine is not started")
        return self._handle

    async def start(self) -> None:
        """Connect to Ray, deploy (or find) the app, warm the stream path up; idempotent."""
        async with self._start_lock:
            if self._warm:
                return
            if self._handle is None:
                handle = await self._driver.call(self._connect_and_deploy)
                # Waited for here, not on the driver thread: a replica that cannot be
                # placed keeps the app DEPLOYING for good, and close() must still get
                # the thread to disconnect.
                await self._until_running()
                self._handle = handle
                self._status = "RUNNING"
            info = await self._handle.info.remote()
            self.sample_rate = int(info["sample_rate"])
            dim = info.get("speaker_dim")
            self._speaker_dim = int(dim) if isinstance(dim, int) else None
            samples = 0
            async for chunk in self._stream(self.chattts.warmup_text, VoiceOptions()):
                samples += len(chunk)
            log.info(
                "Ray Serve speech app %r ready: warm-up %.2f s of audio",
                self.settings.app_name,
                samples / self.sample_rate,
            )
            self._warm = True
            self._watch = asyncio.get_running_loop().create_task(self._watch_status())

    async def _until_running(self) -> None:
        """Wait for the Serve app to run; say why now and then while it does not (Serve's
        own message: "... could not be scheduled ... resources"), and fail if it cannot."""
        from ray import serve

        loop = asyncio.get_running_loop()
        started_at = said_at = loop.time()
        while True:
            status = await asyncio.to_thread(serve.status)
            app = status.applications.get(self.settings.app_name)
            state = _app_state(app)
            if state == "RUNNING":
                return
            if state == "DELETING" or (
                state is None and loop.time() - started_at > DEPLOY_APPEAR_S
            ):
                # Deleted while it deployed (Serve shut down by the process that owned a
                # shared local instance, say): waiting on would never end.
                raise EngineLoadError("the Ray Serve speech app was deleted while it deployed")
            if state in ("DEPLOY_FAILED", "UNHEALTHY"):
                message = app.message if app is not None else ""
                raise EngineLoadError(
                    f"the Ray Serve speech app did not start ({state}): {message}"
                )
            now = asyncio.get_running_loop().time()
            if now - said_at >= DEPLOY_REPORT_S:
                said_at = now
                log.warning(
                    "the Ray Serve speech app is still %s: %s",
                    state,
                    (app.message if app is not None else "") or "no replica is running yet",
                )
            await asyncio.sleep(DEPLOY_POLL_S)

    async def close(self) -> None:
        self._warm = False
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        self._handle = None
        if self._inited_ray:
            try:
                async with asyncio.timeout(DISCONNECT_TIMEOUT_S):
                    await self._driver.call(self._disconnect)
            except TimeoutError:
                # The driver thread is stuck in Ray (a connect that hangs): a shutdown must
                # not wait on it. The thread is a daemon; the process exits without it.
                log.warning("Ray did not disconnect within %g s: leaving it", DISCONNECT_TIMEOUT_S)
        self._driver.stop()

    def speakable(self, text: str) -> bool:
        """As ChatTTS on the replicas reads it (their engine's ``speakable``)."""
        return reads_aloud(text)

    async def synthesize(
        self, text: str, voice: VoiceOptions, *, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        if not self._warm:
            raise EngineError("the Ray Serve engine is not started")
        # Closing this generator does not close one it iterates: aclosing does.
        async with contextlib.aclosing(self._stream(text, voice, continuation)) as inner:
            async for chunk in inner:
                yield chunk

    async def _stream(
        self, text: str, voice: VoiceOptions, continuation: bool = False
    ) -> AsyncGenerator[PCM, None]:
        # ``continuation`` travels to the replica's engine, whose scheduler is where a next
        # sentence could otherwise queue behind newer streams (one bool on the request).
        response = cast(
            "DeploymentResponseGenerator[bytes]",
            self.handle.options(stream=True).synthesize.remote(text, voice, continuation),
        )
        finished = False
        try:
            async for data in response:
                # A copy: frombuffer views the immutable bytes read-only.
                yield np.frombuffer(data, dtype=np.float32).copy()
            finished = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a replica died, Ray lost its node, the app was deleted...
            finished = True
            # ... or the replica's engine refused this request (a voice it cannot speak):
            # the client's mistake, which the circuit breaker must not count as a fault.
            # A replica's exception arrives as a RayTaskError that is also an instance of
            # its cause's class, whose str() is Ray's whole traceback (the replica's pid, IP
            # and file paths): only the cause's own words go to the client.
            cause = getattr(exc, "cause", None)
            original = cause if isinstance(cause, BaseException) else exc
            if isinstance(original, RequestError):
                raise type(original)(*original.args) from None
            log.warning("speech replica failed", exc_info=exc)
            raise EngineError(
                f"the speech replica failed: {_first_line(original)}",
                incident=_incident(original),
            ) from None
        finally:
            if not finished:
                # aclose() (barge-in, hang-up) or task cancellation: the replica's generator
                # is cancelled and its engine stream stops using compute.
                response.cancel()

    async def _watch_status(self) -> None:
        """Follow the Serve application: readiness drops while no replica can speak."""
        from ray import serve

        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            try:
                status = await asyncio.to_thread(serve.status)
            except Exception as exc:  # noqa: BLE001 - the cluster or our link to it is gone
                self._failure = f"Ray Serve unreachable: {exc}"
                continue
            app = status.applications.get(self.settings.app_name)
            if app is None:
                self._status, self._failure = None, "the Ray Serve speech app was deleted"
                continue
            was = self._failure
            self._status = _app_state(app)
            if self._status in FAILED_STATES:
                self._failure = f"Ray Serve speech app {self._status}: {app.message or ''}".strip()
            else:
                self._failure = None
            if self._failure != was:
                log.warning("Ray Serve speech app: %s", self._failure or self._status)

    # -- blocking parts (worker threads) -----------------------------------------------------
    def _connect_and_deploy(self) -> DeploymentHandle[Any]:
        try:
            import ray
            from ray import serve
        except ImportError as exc:
            raise EngineLoadError(
                "--tts ray needs Ray Serve: pip install 'rtc-voice-agent[ray]'"
            ) from exc
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if self.settings.address is not None:
                # ray://HOST:PORT names the cluster's GCS (HOST:6379 by default), and this
                # process joins as a driver on a node of the cluster. Not Ray Client (Ray's own
                # ray:// scheme): Serve's streaming handles refuse to work through it
                # ("Streaming DeploymentHandles are not currently supported ... Ray Client").
                kwargs["address"] = self.settings.address.removeprefix("ray://")
            elif not os.environ.get("RAY_ADDRESS"):
                # A new local instance: its workers import this checkout's code.
                self._started_ray = True
                kwargs["num_cpus"] = self.settings.local_cpus
                kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": str(SOURCE_ROOT)}}
            try:
                ray.init(**kwargs)
            except Exception as exc:
                self._started_ray = False
                raise EngineLoadError(f"could not connect to Ray: {exc}") from exc
            self._inited_ray = True
        # Media processes call the deployment through handles: no HTTP proxy needed. On a
        # cluster where Serve already runs, this connects to it and changes nothing.
        serve.start(proxy_location="Disabled")
        running = self._running_app(serve)
        if running is not None:
            return running
        if self._started_ray:
            unplaceable = unplaceable_replica(ray.cluster_resources(), self.settings)
            if unplaceable is not None:
                raise EngineLoadError(unplaceable)
        ours = fingerprint(self.settings, self.chattts)
        try:
            # Before the deploy: a media process that finds the app DEPLOYING attaches.
            _record_fingerprint(self.settings.app_name, ours)
            # Not waiting for it to run (start() does): see _until_running.
            target = serve.RunTarget(
                speech_app(self.settings, self.chattts),
                name=self.settings.app_name,
                route_prefix=None,
            )
            handle: DeploymentHandle[Any] = serve.run_many(
                [target], wait_for_applications_running=False
            )[0]
            return handle
        except Exception as exc:
            raise EngineLoadError(f"the Ray Serve speech app did not start: {exc}") from exc

    def _running_app(self, serve: Any) -> DeploymentHandle[Any] | None:
        """The app another media process (or an earlier run) deployed with these very
        settings, if it is up or on its way: attach to it rather than deploy again (which
        would replace its replicas under the streams of the other media processes).

        The settings it was deployed with are read from the cluster's key-value store, not
        asked of a replica: a busy one (every --tts-max-streams slot playing) answered after
        the wait, and an app still DEPLOYING (every --workers N worker starts at once) has
        none to ask; either way the app was deployed again over itself, which cut every
        stream on it (found by review)."""
        name = self.settings.app_name
        state = _app_state(serve.status().applications.get(name))
        if state not in ("RUNNING", "DEPLOYING"):
            return None
        recorded = _deployed_fingerprint(name)
        if recorded is not None:
            if recorded != fingerprint(self.settings, self.chattts):
                log.info("the running speech app has other settings; deploying ours over it")
                return None
            log.info("attached to the Ray Serve speech app %r (%s)", name, state.lower())
            attached: DeploymentHandle[Any] = serve.get_app_handle(name)
            return attached
        if state != "RUNNING":
            return None  # deployed by an older version, which recorded nothing: ask it
        handle: DeploymentHandle[Any] = serve.get_app_handle(self.settings.app_name)
        try:
            info = handle.info.remote().result(timeout_s=30)
        except Exception:  # noqa: BLE001 - an older or broken app: deploy ours over it
            log.warning("the running speech app did not answer; deploying it again")
            return None
        if info.get("fingerprint") != fingerprint(self.settings, self.chattts):
            log.info("the running speech app has other settings; deploying ours over it")
            return None
        log.info("attached to the running Ray Serve speech app %r", self.settings.app_name)
        return handle

    def _disconnect(self) -> None:
        import ray
        from ray import serve

        if self._started_ray:
            # Our own instance: take the app down with it. On a shared cluster the app stays
            # for the other media processes.
            with contextlib.suppress(Exception):
                serve.shutdown()
            self._started_ray = False
        ray.shutdown()
        self._inited_ray = False


# Where the deployer records the fingerprint of the app it deployed (Ray's internal key-value
# store, in the cluster's GCS: every media process of the cluster reads the same one).
_KV_NAMESPACE = "rtc_voice_agent"


def _fingerprint_key(app_name: str) -> bytes:
    return f"speech-app-fingerprint:{app_name}".encode()


def _deployed_fingerprint(app_name: str) -> str | None:
    """The fingerprint the app ``app_name`` was deployed with, None if none was recorded."""
    from ray.experimental import internal_kv

    try:
        value = internal_kv._internal_kv_get(_fingerprint_key(app_name), namespace=_KV_NAMESPACE)
    except Exception:  # no record to trust: the replica is asked instead
        log.warning("could not read the speech app's recorded settings", exc_info=True)
        return None
    return value.decode() if isinstance(value, bytes) else None


def _record_fingerprint(app_name: str, value: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(
        _fingerprint_key(app_name), value.encode(), overwrite=True, namespace=_KV_NAMESPACE
    )


def _app_state(app: Any) -> str | None:
    """A Serve application's status as its name ("RUNNING", "DEPLOYING"...); None: no app."""
    return None if app is None else str(getattr(app.status, "value", app.status))  # a str enum


def unplaceable_replica(resources: dict[str, float], settings: RaySettings) -> str | None:
    """Why the replicas could never all be placed on a local instance with ``resources``
    (Ray's cluster_resources()), or None. Serve would wait for them without end, saying
    nothing. ``replicas``: the fixed number, or autoscaling's minimum."""
    n = settings.replicas
    for kind, each, flag, offer in (
        ("CPU", settings.cpus_per_replica, "--tts-cpus-per-replica", "--ray-cpus"),
        ("GPU", settings.gpus_per_replica, "--tts-gpus-per-replica", "the machine's GPUs"),
    ):
        have = resources.get(kind, 0.0)
        if n * each > have:
            return (
                f"{n} speech replica(s) (--tts-replicas) need {n * each:g} {kind} ({each:g} "
                f"each, {flag}) but the local Ray instance has {have:g} ({offer})"
            )
    return None


def _incident(exc: BaseException) -> str | None:
    """The fault behind a replica's failure, for the breaker to count once (EngineError):
    the replica engine's own (a crashed worker ending its batch), or the actor that died,
    which failed every stream it served (found by review: five streams on a replica that
    died opened the breaker for every session, on every replica)."""
    incident = getattr(exc, "incident", None)
    if isinstance(incident, str):
        return incident
    from ray.exceptions import ActorDiedError  # imported: the error came from Ray

    # Died, not merely unavailable for a while (ActorUnavailableError, also a
    # RayActorError): each of those is a failure of its own.
    if isinstance(exc, ActorDiedError) and exc.actor_id:
        return f"Ray actor {exc.actor_id} died"
    return None


def _first_line(exc: BaseException, limit: int = 300) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:limit]


class _DriverThread:
    """One long-lived daemon thread for everything that starts or stops Ray in this process.

    Not a short-lived thread per call: Ray starts its local processes (GCS, raylet) with a
    parent-death signal, which Linux sends when the *thread* that spawned them exits (seen:
    the GCS was killed the moment a one-shot connect thread ended). Not the default executor
    either: it is joined at shutdown, so Ctrl-C would wait for a slow deployment.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def call(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ray-driver", daemon=True)
            self._thread.start()
        self._jobs.put(job_settling(loop, future, fn))
        return await future

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
