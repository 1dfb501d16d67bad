"""ChatTTS on Ray Serve against ChatTTS in process: same model, same run, same machine.

The model is the real-size random-weight checkpoint of ``bench/tts.py`` (~280M parameters:
the real model's compute per token; it speaks noise). Both engines load it with the same
settings; the Ray one runs it in a Serve replica on a local Ray instance and streams chunks
back through a DeploymentHandle (``--tts ray``). Runs alternate between the two engines so
that load from elsewhere on the machine hits both alike.

1. time to first audio: request -> first PCM chunk in this process (median of ``--reps``);
   the Ray engine's extra time, and the same minus the replica's own request-to-first-chunk
   time (what Serve's routing and transport add, without generation noise);
2. chunk throughput: one utterance of at most ``--tokens`` tokens (the head of LONG_TEXT
   that the engine speaks as one generation) drained as fast as it comes, flat 24-token
   chunks (the most chunks, so the most per-chunk overhead): chunks/s and audio s/s.

    .venv/bin/python bench/tts_ray.py [--model-dir DIR] [--tokens 240] [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.chattts.engine import ChatTTSEngine, split_spoken
from agent.config import ChatTTSSettings, RaySettings
from agent.engine import TTSEngine, VoiceOptions
from agent.raytts.engine import RayServeEngine
from agent.text.normalize import normalize_for_tts
from bench._common import full_size_model

SHORT_TEXT = "thanks for calling, how can I help you today"
LONG_TEXT = (
    "streaming speech for a live voice agent should start quickly and sound smooth, "
    "so this sentence is long enough to keep the model talking for a good ten seconds or more "
    "while we measure how much work each approach really does"
)


async def first_audio(engine: TTSEngine) -> float:
    t0 = time.perf_counter()
    stream = engine.synthesize(SHORT_TEXT, VoiceOptions(voice="seed:7"))
    try:
        chunk = await anext(stream)
        elapsed = time.perf_counter() - t0
        assert len(chunk) > 0
    finally:
        await stream.aclose()  # cancels the rest (on the replica too)
    await asyncio.sleep(0.3)  # let the cancelled row leave the batch before the next run
    return elapsed


def throughput_text(max_new_tokens: int) -> str:
    """The head of LONG_TEXT the engine speaks in one generation of ``max_new_tokens``: it
    plans a generation to need at most half of them (agent/chattts/engine.py) and speaks a
    longer text in several, so the whole of LONG_TEXT was up to ~2000 tokens, not --tokens."""
    return split_spoken(normalize_for_tts(LONG_TEXT), max_new_tokens // 2)[0]


async def throughput(engine: TTSEngine, text: str) -> tuple[int, float, float]:
    """(chunks, seconds of audio, wall seconds) for one utterance drained as fast as it comes."""
    t0 = time.perf_counter()
    chunks, samples = 0, 0
    async for chunk in engine.synthesize(text, VoiceOptions(voice="seed:3")):
        chunks += 1
        samples += len(chunk)
    return chunks, samples / engine.sample_rate, time.perf_counter() - t0


async def run(args: argparse.Namespace, model_dir: Path) -> None:
    settings = ChatTTSSettings(
        model_dir=model_dir,
        device="cpu",
        threads=args.threads,
        chunk_growth=0.0,  # the same chunking in both (auto growth depends on warm-up speed)
        max_new_tokens=args.tokens,
    )
    local = ChatTTSEngine(settings)
    # The replica reserves one Ray CPU; its torch threads are settings.threads, as in process.
    remote = RayServeEngine(RaySettings(local_cpus=2, app_name="bench-tts-ray"), settings)
    t0 = time.perf_counter()
    await local.start()
    t1 = time.perf_counter()
    await remote.start()
    t2 = time.perf_counter()
    print(
        f"in-process engine ready in {t1 - t0:.1f} s; Ray Serve engine (local instance, "
        f"deployment, model load, warm-up) in {t2 - t1:.1f} s"
    )
    try:
        ttfa: dict[str, list[float]] = {"local": [], "ray": []}
        inside: list[float] = []
        await first_audio(local)  # one more warm-up each: first calls set up routing
        await first_audio(remote)
        for _ in range(args.reps):
            ttfa["local"].append(await first_audio(local))
            ttfa["ray"].append(await first_audio(remote))
            stats: dict[str, Any] = await remote.handle.stats.remote()
            inside.append(ttfa["ray"][-1] - stats["last_first_audio_s"])
        runs: dict[str, list[tuple[int, float, float]]] = {"local": [], "ray": []}
        text = throughput_text(args.tokens)
        for _ in range(args.throughput_reps):
            runs["local"].append(await throughput(local, text))
            runs["ray"].append(await throughput(remote, text))
        stats = await remote.handle.stats.remote()
    finally:
        await remote.close()
        await local.close()

    lo, ra = statistics.median(ttfa["local"]), statistics.median(ttfa["ray"])
    transport = statistics.median(inside)
    print(f"\n1. time to first audio ({args.reps} runs each, median)   target")
    print(f"   in process               {lo * 1000:8.0f} ms")
    print(f"   Ray Serve                {ra * 1000:8.0f} ms")
    print(
        f"   added by Ray (medians)   {(ra - lo) * 1000:8.0f} ms   <= 30 ms   ratio {ra / lo:.3f}"
    )
    print(
        f"   added by Ray (transport) {transport * 1000:8.1f} ms   <= 30 ms   "
        f"(request -> first chunk here, minus the same inside the replica; "
        f"runs {', '.join(f'{x * 1000:.1f}' for x in inside)})"
    )
    print(f"      runs in process: {', '.join(f'{x * 1000:.0f}' for x in ttfa['local'])} ms")
    print(f"      runs Ray Serve:  {', '.join(f'{x * 1000:.0f}' for x in ttfa['ray'])} ms")

    def best(rs: list[tuple[int, float, float]]) -> tuple[float, float, int, float]:
        # The fastest run of each: other processes on the machine only ever add time.
        chunks, audio, wall = min(rs, key=lambda r: r[2])
        return chunks / wall, audio / wall, chunks, audio

    lc, la, n_chunks, audio_s = best(runs["local"])
    rc, rav, _, _ = best(runs["ray"])
    print(
        f"\n2. chunk throughput, one utterance of {audio_s:.1f} s in {n_chunks} chunks "
        f"(best of {args.throughput_reps})"
    )
    print("                            chunks/s   audio s/s")
    print(f"   in process               {lc:8.3f}   {la:9.3f}")
    print(f"   Ray Serve                {rc:8.3f}   {rav:9.3f}")
    print(f"   ratio Ray / in process   {rc / lc:8.3f}   {rav / la:9.3f}   target >= 0.90")
    print(f"      all runs (chunks, audio s, wall s): {runs}")
    print(f"   replica: paced {stats['paced_s']:.2f} s (pacing waits; 0: slower than real time)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-dir", type=Path, help="full-size random model (built if missing)")
    ap.add_argument("--tokens", type=int, default=240, help="utterance length for item 2")
    ap.add_argument("--reps", type=int, default=5, help="first-audio runs per engine")
    ap.add_argument("--throughput-reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--quick", action="store_true", help="--tokens 120 --reps 3 --throughput-reps 1"
    )
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.reps, args.throughput_reps = 120, 3, 1
    with full_size_model(args.model_dir) as model_dir:
        asyncio.run(run(args, model_dir))


if __name__ == "__main__":
    main()
