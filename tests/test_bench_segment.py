"""bench/segment.py runs and prints one row per text (figures are the bench's business)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^(\S.*?)\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$")


def test_segment_bench_prints_every_text() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "segment.py"), "--chars", "300", "--repeats", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {
        m[1]: [float(x) for x in m.groups()[1:]]
        for m in map(ROW.match, done.stdout.splitlines())
        if m
    }
    assert set(rows) == {
        "prose",
        "dotted URL",
        "dots that end nothing",
        "abbreviations",
        "initials",
        "CJK",
    }, done.stdout
    for name, (streamed, worst, whole, ratio) in rows.items():
        assert streamed > 0 and whole > 0 and 0 < worst <= streamed and ratio > 0, name
