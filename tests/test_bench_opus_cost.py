"""bench/opus_cost.py runs and prints one row per setting (figures are the bench's business)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = 19  # complexity 0-10, 3 wide-band and 3 medium-band rungs, CELT only, SILK only
# A row: the setting (padded to 31 columns, so two spaces end it), us/frame, the ratio to
# complexity 9 at the same input rate, kbit/s.
ROW = re.compile(
    r"^((?:complexity|wide-band|medium-band|CELT|SILK).*?)\s{2,}(\d+)\s+([\d.]+)\s+([\d.]+)\s"
)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(ROOT / "bench" / "opus_cost.py"), "--rounds", "1", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_opus_cost_bench_prints_every_setting_at_every_input_rate() -> None:
    done = run("--input-rates", "48000,24000")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {
        m[1]: (float(m[2]), float(m[3]), float(m[4]))
        for m in map(ROW.match, done.stdout.splitlines())
        if m
    }
    assert len(rows) == 2 * SETTINGS, done.stdout
    assert sum(name.endswith(" @24k") for name in rows) == SETTINGS
    # Each rate's baseline is itself: the ratio column is against the same input rate.
    assert rows["complexity 9"][1] == rows["complexity 9 @24k"][1] == 1.0
    for name, (microseconds, ratio, kbps) in rows.items():
        assert microseconds > 0 and ratio > 0, name
        assert 20 < kbps < 36, (name, kbps)  # near the 32 kbps asked for, never far above


def test_opus_cost_bench_refuses_a_rate_libopus_does_not_take() -> None:
    done = run("--input-rates", "44100")
    assert done.returncode == 2 and "--input-rates" in done.stderr
