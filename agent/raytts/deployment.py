"""The Ray Serve deployment: one ChatTTS engine per replica, streaming PCM to media processes.

The replica runs the same ``ChatTTSEngine`` as ``--tts local`` (its worker thread, continuous
batching, per-stream cancellation, parking); Serve adds placement (GPUs), replica counts,
autoscaling, health checks and restarts. Chunks travel as float32 bytes (little-endian,
native on every Ray platform): no pickled numpy objects on the wire.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.config import ChatTTSSettings, RaySettings
from agent.engine import VoiceOptions
from agent.raytts.pacing import Pacer

if TYPE_CHECKING:
    from ray.serve import Application

    from agent.chattts.engine import ChatTTSEngine

log = logging.getLogger(__name__)

DEPLOYMENT_NAME = "ChatTTS"


@dataclass
class ReplicaCounts:
    """Streams seen by this replica (read through ``stats``: tests, benches, operators)."""

    active: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    sent_samples: int = 0
    paced_s: float = 0.0  # time streams waited for the listener (pacing)
    # The latest stream's request-to-first-chunk time inside the replica: what the engine
    # takes, without Serve's routing and transport (benches subtract it).
    last_first_audio_s: float | None = None


class SpeechReplica:
    """A Serve replica: loads and warms ChatTTS in its constructor, then streams speech."""

    # Ray actors (and so Serve replicas) may have an async constructor.
    async def __init__(  # type: ignore[misc]
        self, settings: ChatTTSSettings, lead_s: float, fingerprint: str
    ) -> None:
        # Imported here: the media process imports this module to build the application and
        # needs neither torch nor ChatTTS.
        from agent.chattts.engine import ChatTTSEngine

        self._engine: ChatTTSEngine = ChatTTSEngine(settings)
        self._lead_s = lead_s
        self._fingerprint = fingerprint
        self._counts = ReplicaCounts()
        await self._engine.start()

    def info(self) -> dict[str, Any]:
        return {
            "sample_rate": self._engine.sample_rate,
            "pid": os.getpid(),
            "fingerprint": self._fingerprint,
            # for the media process's check of a client's voice (RayServeEngine.check_voice)
            "speaker_dim": self._engine.speaker_dim,
        }

    async def synthesize(
        self, text: str, voice: VoiceOptions, continuation: bool = False
    ) -> AsyncGenerator[bytes, None]:
        """Stream one utterance. Serve cancels this generator when the caller cancels: the
        engine stream is closed with it and its row leaves the batch at the next step."""
        counts = self._counts
        pacer = Pacer(self._engine.sample_rate, self._lead_s)
        started = time.perf_counter()
        counts.active += 1
        outcome = "failed"
        try:
            speech = self._engine.synthesize(text, voice, continuation=continuation)
            async with aclosing(speech) as chunks:
                async for chunk in chunks:
                    if pacer.samples == 0:
                        counts.last_first_audio_s = time.perf_counter() - started
                    yield chunk.tobytes()
                    counts.sent_samples += len(chunk)
                    wait = pacer.sent(len(chunk))
                    if wait > 0:
                        counts.paced_s += wait
                        await asyncio.sleep(wait)
            outcome = "completed"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            counts.active -= 1
            setattr(counts, outcome, getattr(counts, outcome) + 1)

    def stats(self) -> dict[str, Any]:
        """This replica's streams and its scheduler's rows (what is using compute now)."""
        sched = self._engine.scheduler
        return {
            "pid": os.getpid(),
            "active": self._counts.active,
            "completed": self._counts.completed,
            "cancelled": self._counts.cancelled,
            "failed": self._counts.failed,
            "sent_samples": self._counts.sent_samples,
            "paced_s": self._counts.paced_s,
            "last_first_audio_s": self._counts.last_first_audio_s,
            "rows": len(sched.gpt.rows) if sched is not None else 0,
            "steps": sched.stats.steps if sched is not None else 0,
            "row_steps": sched.stats.row_steps if sched is not None else 0,
        }

    def check_health(self) -> None:
        """Serve's health check: a crashed engine worker makes Serve replace this replica."""
        failure = self._engine.failure
        if failure is not None or not self._engine.ready:
            raise RuntimeError(failure or "the ChatTTS engine is not running")


def deployment_options(ray: RaySettings) -> dict[str, Any]:
    """Ray Serve's own deployment options, from our settings (no scheduling of our own)."""
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {
            "num_cpus": ray.cpus_per_replica,
            "num_gpus": ray.gpus_per_replica,
        },
        # Not the engine's max_batch: a request stays open while its audio plays (paced to
        # lead_s ahead), so max_batch playing utterances would hold every slot and a new one
        # would wait in Serve's queue until one finished playing, while the engine's own
        # scheduler (parking) would start it at once. Beyond max_streams, streams wait in
        # Serve's queue, where autoscaling sees them.
        "max_ongoing_requests": ray.max_streams,
    }
    if ray.max_replicas > ray.replicas:
        options["autoscaling_config"] = {
            "min_replicas": ray.replicas,
            "max_replicas": ray.max_replicas,
            "target_ongoing_requests": ray.target_streams,
        }
    else:
        options["num_replicas"] = ray.replicas
    return options


def speech_app(ray: RaySettings, chattts: ChatTTSSettings) -> Application:
    from ray import serve

    deployment = serve.deployment(**deployment_options(ray))(SpeechReplica)
    return deployment.bind(chattts, ray.lead_s, fingerprint(ray, chattts))


def fingerprint(ray: RaySettings, chattts: ChatTTSSettings) -> str:
    """Names what a deployment was built from. Deploying an app again, even unchanged, makes
    Serve replace its replicas (measured: a new replica process, in-flight streams lost), so
    a media process that finds the app running with the same fingerprint only attaches."""
    options = deployment_options(ray)
    return hashlib.sha256(repr((sorted(options.items()), chattts, ray.lead_s)).encode()).hexdigest()
