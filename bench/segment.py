"""What the text segmenter costs the event loop, streamed a character at a time.

A client's ``text.delta`` stream is segmented on the event loop as each delta arrives
(agent/speech.py), and deltas are not rate-limited (an LLM sends many a second), so a
stream's cost must grow with its length, not with its square. For each text: one push per
character (total and worst single push, ms) against splitting the whole text at once in the
same run (``split_text``); the ratio is streamed/whole. Linear: the ratio stays small
whatever the text; a rescan per push made the dotted URL's ratio ~1000x (5.2 s of loop
time for one 5000-character stream).

    .venv/bin/python bench/segment.py [--chars 5000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.text.segment import Segmenter, split_text


def texts(chars: int) -> dict[str, str]:
    def fill(unit: str, head: str = "") -> str:
        return (head + unit * (chars // len(unit) + 1))[:chars]

    return {
        "prose": fill("The quick brown fox jumps over the lazy dog. "),
        "dotted URL": fill("a.", "https://"),
        "dots that end nothing": fill("a. ", "see "),
        "abbreviations": fill("Dr. "),
        "initials": fill("J. "),
        "CJK": fill("今天天气很好，我们去公园散步吧。"),
    }


def streamed(text: str) -> tuple[float, float]:
    """(total, worst push) in ms for one push per character, then a flush."""
    segmenter = Segmenter()
    worst = 0.0
    start = time.perf_counter()
    for ch in text:
        t = time.perf_counter()
        segmenter.push(ch)
        worst = max(worst, time.perf_counter() - t)
    segmenter.flush()
    return (time.perf_counter() - start) * 1000, worst * 1000


def whole(text: str) -> float:
    start = time.perf_counter()
    split_text(text)
    return (time.perf_counter() - start) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=int, default=5000, help="text length (max_text_chars)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per text (median shown)")
    args = parser.parse_args()
    print(
        f"{'text':24s} {'streamed ms':>12s} {'worst push ms':>14s} {'whole ms':>9s} {'ratio':>7s}"
    )
    for name, text in texts(args.chars).items():
        runs = [streamed(text) for _ in range(args.repeats)]
        total = statistics.median(r[0] for r in runs)
        worst = statistics.median(r[1] for r in runs)
        once = statistics.median(whole(text) for _ in range(args.repeats))
        ratio = total / once if once > 0 else float("inf")
        print(f"{name:24s} {total:12.1f} {worst:14.3f} {once:9.2f} {ratio:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
