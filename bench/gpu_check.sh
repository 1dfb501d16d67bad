#!/usr/bin/env bash
# One-shot check of the ChatTTS engine on a CUDA GPU: the engine tests and bench/tts.py.
#
# Made for a bare GPU machine with PyTorch but without this project's other Python packages and
# without network access: the missing packages travel as wheels in .whl/ (ignored by git) and
# are installed into $SITE, never into the machine's own environment. Steps, in order, each
# under its own timeout and all inside one overall budget (BUDGET_S), so one hang cannot eat
# the others' time; a failed step does not stop the later ones:
#
#   install   the wheels in $WHEELS into $SITE (pip --no-index --no-deps --target)
#   env       GPU, driver, Python and package versions
#   build     a tiny and a full-size random-weight checkpoint (agent/chattts/tiny.py)
#   smoke     the engine on the tiny checkpoint: start, one utterance, GPU memory
#   pytest    tests/test_chattts_engine.py and tests/test_chattts_internals.py on $DEVICE
#   tts       bench/tts.py on the full-size checkpoint on $DEVICE
#   compile   only with COMPILE=1: the same, --quick, with --compile (torch.compile of the
#             GPT), in the time left. Off by default: on an H200 (2026-11-29) it had printed
#             only its first section when stopped at 267 s, so it mostly burns device time.
#
# Logs and a summary go to $OUT (default bench/results/gpu_check, ignored by git).
#
#   bash bench/gpu_check.sh
#
# Environment (defaults in brackets): PYTHON [python3], DEVICE [cuda], WHEELS [.whl],
# SITE [/tmp/site], MODELS [/tmp/gpu_check_models], BUDGET_S [390], BENCH_ARGS [] (extra
# bench/tts.py flags, e.g. --quick), FULL_SIZE [full] (tiny: a quick dry run on a CPU box),
# COMPILE [0].
# Exit status: 0 when every step that ran passed, 1 otherwise.

set -u
set -o pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
MODELS=${MODELS:-/tmp/gpu_check_models}
BUDGET_S=${BUDGET_S:-390}
BENCH_ARGS=${BENCH_ARGS:-}
FULL_SIZE=${FULL_SIZE:-full}
COMPILE=${COMPILE:-0}
OUT=${OUT:-bench/results/gpu_check}

mkdir -p "$OUT" "$MODELS"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$SITE:$PWD"
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 # nothing may be downloaded: every model is built here

DEADLINE=$((SECONDS + BUDGET_S))
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

# step NAME LOG CAP RESERVE CMD...: run CMD for at most CAP seconds, leaving RESERVE seconds
# of the budget to the steps after it; output to the console and appended to $OUT/LOG.
step() {
    local name=$1 log=$2 cap=$3 reserve=$4
    shift 4
    local left=$((DEADLINE - SECONDS - reserve))
    local limit=$((cap < left ? cap : left))
    if ((limit < 15)); then
        echo "$name: SKIPPED (${limit}s left of the budget)" | tee -a "$SUMMARY"
        return 0
    fi
    echo "=== $name (limit ${limit}s) ===" | tee -a "$OUT/$log"
    local t0=$SECONDS rc=0
    timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$OUT/$log" || rc=$?
    local verdict=ok
    if ((rc == 124 || rc == 137)); then
        verdict="TIMED OUT"
    elif ((rc != 0)); then
        verdict="FAILED"
    fi
    ((rc == 0)) || FAILED=1
    echo "$name: $verdict (rc $rc, $((SECONDS - t0))s)" | tee -a "$SUMMARY" "$OUT/$log"
}

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    step install setup.log 90 300 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
else
    echo "install: no wheels in $WHEELS, using the environment as it is" | tee -a "$SUMMARY"
fi

ENV_PY='
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.0f} GiB", "sm", f"{p.major}.{p.minor}",
          "tf32 matmul", torch.backends.cuda.matmul.allow_tf32, "tf32 cudnn",
          torch.backends.cudnn.allow_tf32)
else:
    print("no CUDA device visible to torch")
for name in ("chattts", "transformers", "tokenizers", "huggingface_hub", "safetensors", "numpy",
             "numba", "torchaudio", "vocos", "vector_quantize_pytorch", "einx", "encodec",
             "pybase16384", "pytest", "pytest-asyncio", "pytest-timeout", "triton"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
'
step nvidia-smi setup.log 30 290 bash -c 'nvidia-smi || echo "no nvidia-smi here"'
step env setup.log 45 280 "$PYTHON" -c "$ENV_PY"

step build-tiny setup.log 60 270 "$PYTHON" -m agent.chattts.tiny "$MODELS/tiny"
step build-full setup.log 120 240 "$PYTHON" -m agent.chattts.tiny "$MODELS/full" --size "$FULL_SIZE"

SMOKE_PY='
import asyncio, sys, time, torch
from agent.chattts.engine import ChatTTSEngine
from agent.config import ChatTTSSettings
from agent.engine import VoiceOptions

async def main(model_dir: str, device: str) -> None:
    engine = ChatTTSEngine(ChatTTSSettings(model_dir=model_dir, device=device))
    t0 = time.perf_counter()
    await engine.start()
    assert engine.model is not None and engine.scheduler is not None
    print(f"engine started on {engine.model.device} in {time.perf_counter() - t0:.2f} s "
          f"(warm-up RTF {engine.scheduler.measured_rtf()}, growth {engine.params.growth})")
    t0, first, samples = time.perf_counter(), None, 0
    async for chunk in engine.synthesize("hello from the gpu, one two three", VoiceOptions()):
        first = first if first is not None else time.perf_counter() - t0
        samples += len(chunk)
    assert samples > 0 and first is not None, "no audio"
    print(f"one utterance: {samples / 24000:.2f} s of audio, first chunk after "
          f"{first * 1000:.0f} ms, all after {time.perf_counter() - t0:.2f} s")
    if torch.cuda.is_available():
        print(f"peak CUDA memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    await engine.close()

asyncio.run(main(sys.argv[1], sys.argv[2]))
'
step smoke setup.log 60 230 "$PYTHON" -c "$SMOKE_PY" "$MODELS/tiny" "$DEVICE"

# --noconftest: tests/conftest.py imports the WebRTC server (aiortc, av), which these two modules
# do not use; they take their fixtures from tests/conftest_chattts.py (pytest_plugins).
step pytest pytest.log 150 110 env VOICE_AGENT_TEST_DEVICE="$DEVICE" \
    "$PYTHON" -m pytest -p no:cacheprovider --noconftest -v -rfE --durations=15 \
    --junitxml="$OUT/pytest.xml" tests/test_chattts_engine.py tests/test_chattts_internals.py

# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
step tts tts.log 150 0 "$PYTHON" bench/tts.py --device "$DEVICE" --model-dir "$MODELS/full" \
    $BENCH_ARGS
# --quick: compiling takes much of what is left; the ratios are within-run either way.
if [[ $COMPILE == 1 ]]; then
    # shellcheck disable=SC2086
    step compile tts_compile.log 600 0 "$PYTHON" bench/tts.py --device "$DEVICE" \
        --model-dir "$MODELS/full" --compile --quick $BENCH_ARGS
fi

echo "=== summary ($SECONDS s) ==="
cat "$SUMMARY"
exit $FAILED
