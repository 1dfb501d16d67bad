"""bench/streams.py end to end at a tiny size: the harness's own fast receive path works.

The load generator records RTP at the socket and decrypts it after the window
(bench/_common.py ``SocketPoller``); if that broke, every bench figure would be wrong
(packets missed, nothing decrypted, or the server hearing no receiver reports and closing
the sessions). Real time is not asserted (CI machines are loaded): only what must hold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def test_streams_bench_records_decrypts_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "streams.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "streams.py"),
        *("--n", "2", "--seconds", "3", "--warmup", "1"),
        *("--patterns", "continuous", "--retries", "0", "--json", str(out), "--no-listen"),
        *("--variants", "ours,ours-aiortc,default"),
        *("--complexity", "7", "--complexity-floor", "7"),  # reaches the server: fixed 7
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(runs) == {"ours", "ours-aiortc", "default"}
    for variant, run in runs.items():
        assert run["connected"] == 2, variant
        # Every packet decrypted and decoded; the tone is heard in every packet.
        assert run["undecryptable"] == 0, variant
        assert run["decode_errors"] == 0, variant
        assert run["speech_share"] > 0.9, variant
        assert run["pps_total"] > 2 * 30, variant  # ~50 each unless the machine is swamped
        # The server heard receiver reports built from the socket-level statistics.
        assert run["receiver_reports_per_stream_s"] > 0.2, variant
    # The encoders' complexity as the server's governor reports it (none on the default path).
    assert runs["ours"]["complexity"] == runs["ours-aiortc"]["complexity"] == 7
    assert runs["ours"]["complexity_steps_down"] == 0
    assert runs["ours"]["band_cap_hz"] is None  # a fixed complexity: the band never narrows
    assert runs["ours"]["rung"] == "7"


def test_speech_clip_is_the_recording_at_chattts_rate() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import _common

    clip = _common.speech_clip()
    assert clip.dtype == np.float32 and clip.ndim == 1
    assert abs(clip.size / _common.SPEECH_CLIP_RATE - 3.52) < 0.01  # the whole 3.52 s clip
    assert abs(float(np.abs(clip).max()) - _common.SPEECH_CLIP_PEAK) < 1e-3
    opts = _common._server_options(["--signal", "speech"])
    engine = _common._bench_engine(opts)
    assert engine.sample_rate == _common.SPEECH_CLIP_RATE
    np.testing.assert_array_equal(engine.clip, clip)
    assert _common._bench_engine(_common._server_options([])).name == "tone"


def test_streams_bench_speaks_recorded_speech(tmp_path: Path) -> None:
    out = tmp_path / "streams.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "streams.py"),
        *("--n", "1", "--seconds", "3", "--warmup", "1", "--signal", "speech"),
        *("--patterns", "continuous", "--retries", "0", "--json", str(out), "--no-listen"),
        *("--variants", "ours"),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "signal=speech" in done.stdout
    (run,) = json.loads(out.read_text())
    assert run["signal"] == "speech" and run["connected"] == 1
    assert run["undecryptable"] == 0 and run["decode_errors"] == 0
    # Speech with its pauses, not the tone heard in every packet (> 0.9 above).
    assert 0.3 < run["speech_share"] < 0.9, run["speech_share"]
