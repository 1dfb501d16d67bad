"""bench/opus_cost.py runs and prints one row per setting (figures are the bench's business)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_opus_cost_bench_prints_every_setting() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "opus_cost.py"), "--rounds", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {
        line[:26].strip(): line[26:].split()
        for line in done.stdout.splitlines()
        if line.startswith(("complexity", "wide-band", "medium-band", "CELT", "SILK"))
    }
    assert len(rows) == 19, done.stdout
    for name, cells in rows.items():
        microseconds, kbps = float(cells[0]), float(cells[1])
        assert microseconds > 0, name
        assert 20 < kbps < 36, (name, kbps)  # near the 32 kbps asked for, never far above
