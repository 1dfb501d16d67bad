"""ChatTTS streaming: our engine against ChatTTS's own ``infer(stream=True)``, same model, same run.

The model is a real-size random-weight checkpoint (``build_tiny_model(size="full")``: the
published dimensions, ~280M parameters, so compute per token and per decoded frame is the
real model's; it speaks noise). Built into ``--model-dir`` (reused when already there) or a
temporary directory.

Measured, each as a ratio against a baseline measured in this run:

1. first audio: generated tokens and wall time from request to the first audio chunk, ours
   (the engine's scheduler) vs ``Chat.infer(stream=True)`` with its defaults;
2. decode work for one utterance of ``--tokens`` tokens (469 = 10 s): our streamed decode vs
   one non-streamed decode of the same tokens; ChatTTS's own streaming schedule (re-decode the
   whole utterance every 24 tokens) replayed on the same tokens beside it;
3. seams: our streamed waveform vs the full decode of the same tokens (SNR around seams);
4. 4 sessions at once vs 1: aggregate tokens/s and spread of per-session token rates.

    .venv/bin/python bench/tts.py [--model-dir DIR] [--tokens 469] [--quick] [--device cuda]
                                  [--compile]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.chattts.decode import StreamingDecoder, StreamParams, auto_growth, chat_decode_fn
from agent.chattts.gpt import BatchedGPT, Sampling
from agent.chattts.loader import load_chat
from agent.chattts.scheduler import SAMPLE_RATE, Scheduler
from agent.config import ChatTTSSettings
from agent.engine import VoiceOptions
from bench._common import full_size_model

TEXT = (
    "streaming speech for a live voice agent should start quickly and sound smooth, "
    "so this sentence is long enough to keep the model talking for a good ten seconds or more "
    "while we measure how much work each approach really does"
)


# First audio and sessions: a prompt of realistic length. The random model's tokenizer is
# character level (~4x more prompt tokens than ChatTTS's own for English), and its speech
# length follows the text, so only the 10 s utterance (capped by --tokens) uses TEXT.
SHORT_TEXT = "thanks for calling, how can I help you today"


class DecodeMeter:
    """Wraps ``chat._decode_to_wavs`` on this Chat instance to count decode calls, time, tokens."""

    def __init__(self, chat: Any) -> None:
        self.chat = chat
        self.inner: Callable[..., Any] = chat._decode_to_wavs
        self.seconds = 0.0
        self.tokens = 0
        self.calls = 0
        self.last_len = 0
        chat._decode_to_wavs = self

    def __call__(self, result_list: list[torch.Tensor], use_decoder: bool) -> Any:
        self.last_len = max(int(r.shape[0]) for r in result_list) if result_list else 0
        self.tokens += sum(int(r.shape[0]) for r in result_list)
        self.calls += 1
        t0 = time.perf_counter()
        out = self.inner(result_list, use_decoder)
        self.seconds += time.perf_counter() - t0
        return out

    def reset(self) -> None:
        self.seconds, self.tokens, self.calls, self.last_len = 0.0, 0, 0, 0

    def restore(self) -> None:
        self.chat._decode_to_wavs = self.inner


def chattts_first_audio(chat: Any, max_tokens: int) -> tuple[float, int, float, int]:
    """ChatTTS's own streaming: (seconds to first audio, tokens decoded for it, decode s, decode
    tokens) for one run capped at ``max_tokens``."""
    import ChatTTS

    meter = DecodeMeter(chat)
    try:
        params = ChatTTS.Chat.InferCodeParams(
            max_new_token=max_tokens, show_tqdm=False, manual_seed=7
        )
        t0 = time.perf_counter()
        first_t, first_tokens = None, 0
        for wav in chat.infer(
            SHORT_TEXT,
            stream=True,
            skip_refine_text=True,
            split_text=False,
            params_infer_code=params,
        ):
            if first_t is None and np.asarray(wav).size > 0:
                first_t = time.perf_counter() - t0
                first_tokens = meter.last_len
        assert first_t is not None, "ChatTTS produced no audio"
        return first_t, first_tokens, meter.seconds, meter.tokens
    finally:
        meter.restore()


async def ours_first_audio(sched: Scheduler) -> tuple[float, int]:
    t0 = time.perf_counter()
    stream = sched.submit(SHORT_TEXT, VoiceOptions(voice="seed:7"))
    first = await stream.get()
    elapsed = time.perf_counter() - t0
    assert first is not None and stream.stats.first_audio_tokens is not None
    stream.cancel()
    return elapsed, stream.stats.first_audio_tokens


async def sessions(sched: Scheduler, n: int) -> list[tuple[int, float]]:
    """``n`` sessions submitted together, each drained as fast as it comes: (tokens, seconds)."""

    async def one(i: int) -> tuple[int, float]:
        stream = sched.submit(SHORT_TEXT, VoiceOptions(voice=f"seed:{100 + i}"))
        while await stream.get() is not None:
            pass
        assert stream.stats.finished is not None
        return stream.stats.tokens, stream.stats.finished - stream.stats.submitted

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def snr_db(x: np.ndarray, ref: np.ndarray) -> float:
    n = min(len(x), len(ref))
    err = float(np.sum((x[:n] - ref[:n]) ** 2))
    return float(10 * np.log10(float(np.sum(ref[:n] ** 2)) / max(err, 1e-20)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-dir", type=Path, help="full-size random model (built if missing)")
    ap.add_argument("--tokens", type=int, default=469, help="utterance for decode work/seams")
    ap.add_argument("--session-tokens", type=int, default=72, help="tokens per session, item 4")
    ap.add_argument("--reps", type=int, default=3, help="first-audio repetitions (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--compile", action="store_true", help="torch.compile the GPT (ChatTTS: CUDA only)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="--tokens 160 --session-tokens 48 --reps 1"
    )
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.session_tokens, args.reps = 160, 48, 1

    with full_size_model(args.model_dir) as model_dir:
        run(args, model_dir)


def run(args: argparse.Namespace, model_dir: Path) -> None:
    settings = ChatTTSSettings(
        model_dir=model_dir, device=args.device, threads=args.threads, compile=args.compile
    )
    model = load_chat(settings)
    chat = model.chat
    n_params = sum(
        p.numel() for m in (chat.gpt, chat.embed, chat.decoder, chat.vocos) for p in m.parameters()
    )
    params = StreamParams(first_chunk_tokens=settings.first_chunk_tokens)
    print(
        f"device={model.device} compile={settings.compile} threads={torch.get_num_threads()} "
        f"torch={torch.__version__} "
        f"params(gpt+embed+decoder+vocos)={n_params / 1e6:.0f}M stream={params}"
    )

    # --- 1. first audio ---------------------------------------------------------------------
    sched = Scheduler(chat, params, max_new_tokens=max(args.session_tokens, 32))
    sched.start()
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(ours_first_audio(sched))  # warm-up
        # ChatTTS needs stream_batch * (pass_first_n_batches + 1) = 72 tokens for its first chunk.
        chattts_first_audio(chat, 80)  # warm-up
        ours, base = [], []
        for _ in range(args.reps):  # interleaved, so that load from elsewhere hits both alike
            ours.append(loop.run_until_complete(ours_first_audio(sched)))
            base.append(chattts_first_audio(chat, 80))
        o_t = statistics.median(t for t, _ in ours)
        o_n = max(n for _, n in ours)
        b_t = statistics.median(b[0] for b in base)
        b_n = max(b[1] for b in base)
        print("\n1. first audio                 ours    ChatTTS   ratio  target")
        print(f"   tokens generated before  {o_n:7d}  {b_n:8d}  {o_n / b_n:6.2f}  <= 0.40")
        print(f"   seconds to first audio   {o_t:7.2f}  {b_t:8.2f}  {o_t / b_t:6.2f}  <= 0.40")

        # --- 4. sessions ----------------------------------------------------------------------
        before = dataclasses.replace(sched.stats)
        one = loop.run_until_complete(sessions(sched, 1))
        mid = dataclasses.replace(sched.stats)
        four = loop.run_until_complete(sessions(sched, 4))
        after = dataclasses.replace(sched.stats)
        rtf = sched.measured_rtf()
    finally:
        sched.stop()
        loop.close()
    rate1 = one[0][0] / one[0][1]
    agg4 = sum(n for n, _ in four) / max(s for _, s in four)
    rates = [n / s for n, s in four]
    print("\n4. sessions (tokens/s)        1 session  4 sessions  ratio  target")
    print(f"   aggregate                {rate1:9.2f}  {agg4:10.2f}  {agg4 / rate1:5.2f}  >= 2.0")
    print(
        f"   per-session rates        {', '.join(f'{r:.2f}' for r in rates)}  "
        f"spread {max(rates) / min(rates):.2f}  <= 1.5"
    )
    for label, a, b in (("1 session ", before, mid), ("4 sessions", mid, after)):
        steps = b.steps - a.steps
        print(
            f"   {label}: {steps} steps of {(b.row_steps - a.row_steps) / max(steps, 1):.1f} rows,"
            f" {(b.step_seconds - a.step_seconds) / max(steps, 1) * 1000:.0f} ms/step;"
            f" prefill {b.prefill_seconds - a.prefill_seconds:.2f} s;"
            f" decode {b.decode_seconds - a.decode_seconds:.2f} s in {b.decodes - a.decodes} calls"
        )

    # --- 2./3. decode work and seams on one utterance ---------------------------------------
    # The engine picks chunk growth from the speed it measures at warm-up; do the same here.
    assert rtf is not None
    params = dataclasses.replace(params, growth=auto_growth(rtf))
    print(f"\n   generation RTF {rtf:.2f} -> chunk growth {params.growth} (decode.auto_growth)")
    gpt = BatchedGPT(chat)
    row = gpt.make_row(
        chat.normalizer(TEXT, True, True, None),
        prompt="[speed_5]",
        spk_emb=None,
        sampling=Sampling(max_new_tokens=args.tokens),
        seed=3,
    )
    t0 = time.perf_counter()
    gpt.add(row)
    while gpt.rows:
        gpt.step()
    gen_s = time.perf_counter() - t0
    hiddens = row.hiddens
    n = len(hiddens)
    decode = chat_decode_fn(chat)
    decode(torch.stack(hiddens[:48]))  # warm-up

    # Work = CPU seconds of this process (all torch threads; the worker thread is stopped), and
    # wall seconds beside it. Each figure is the minimum of --reps runs: other processes on
    # the machine only ever add time.
    def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        return out, time.perf_counter() - w0, time.process_time() - c0

    def full_decode() -> np.ndarray:
        return decode(torch.stack(hiddens))

    def streamed_decode(p: StreamParams = params) -> tuple[np.ndarray, list[int], int]:
        dec = StreamingDecoder(decode, p)
        parts, seams = [], []
        for k in range(1, n + 1):
            if dec.due(k):
                parts.append(dec.push(hiddens[:k], final=False))
                seams.append(dec.emitted_samples)
        parts.append(dec.push(hiddens, final=True))
        return np.concatenate(parts), seams, dec.decoded_tokens

    def replay() -> int:
        # ChatTTS's own streaming schedule on the same tokens: a full re-decode every 24 tokens.
        total = 0
        for k in [*range(24, n, 24), n]:
            decode(torch.stack(hiddens[:k]))
            total += k
        return total

    fulls = [timed(full_decode) for _ in range(args.reps)]
    streams = [timed(streamed_decode) for _ in range(args.reps)]
    # Every chunk at chunk_tokens (growth 0): the setting for devices near real time.
    flat = dataclasses.replace(params, growth=0.0)
    aheads = [timed(lambda: streamed_decode(flat)) for _ in range(args.reps)]
    replays = [timed(replay) for _ in range(max(1, args.reps // 2))]
    full = fulls[0][0]
    streamed, seams, decoded_tokens = streams[0][0]
    full_s, full_c = min(f[1] for f in fulls), min(f[2] for f in fulls)
    stream_s, stream_c = min(f[1] for f in streams), min(f[2] for f in streams)
    replay_s, replay_c = min(f[1] for f in replays), min(f[2] for f in replays)
    ahead, ahead_seams, ahead_tokens = aheads[0][0]
    ahead_s, ahead_c = min(f[1] for f in aheads), min(f[2] for f in aheads)
    replay_tokens = replays[0][0]

    print(
        f"\n2. decode work, {n} tokens = {n / 46.875:.1f} s of audio "
        f"(generated in {gen_s:.1f} s, {gen_s / n * 1000:.0f} ms/token)"
    )
    print("                            wall s   cpu s  tokens  x full: cpu  wall  tokens  target")
    rows = [
        ("one full decode", full_s, full_c, n, ""),
        ("ours, streamed (auto)", stream_s, stream_c, decoded_tokens, "<= 1.5"),
        ("ours, flat 24-tok chunks", ahead_s, ahead_c, ahead_tokens, "<= 1.5"),
        ("ChatTTS stream schedule", replay_s, replay_c, replay_tokens, ""),
    ]
    for name, w, c, tok, target in rows:
        print(
            f"   {name:<24}{w:7.2f} {c:7.2f} {tok:7d}  {c / full_c:10.2f} {w / full_s:5.2f}"
            f" {tok / n:7.2f}  {target}"
        )

    around = [slice(max(0, s - 1024), s + 1024) for s in seams]
    seam = snr_db(
        np.concatenate([streamed[w] for w in around]), np.concatenate([full[w] for w in around])
    )
    print(
        f"\n3. seams: {len(seams)} seams, streamed vs full decode: SNR {seam:.1f} dB within "
        f"+-1024 samples of seams (target >= 30), {snr_db(streamed, full):.1f} dB overall; "
        f"lengths {len(streamed)} / {len(full)} samples ({len(full) / SAMPLE_RATE:.2f} s)"
    )
    around = [slice(max(0, s - 1024), s + 1024) for s in ahead_seams]
    seam = snr_db(
        np.concatenate([ahead[w] for w in around]), np.concatenate([full[w] for w in around])
    )
    print(f"   flat 24-token chunks: {len(ahead_seams)} seams, SNR {seam:.1f} dB around seams")


if __name__ == "__main__":
    main()
