"""The real server with the test ToneEngine, in a process of its own.

For tests and benches that need the server out of their own process (its own GIL and event
loop, a real SIGTERM): the product's CLI parses the flags into the one Config and the
product's ``signaling.shutdown.serve`` runs it; only the engine is the test double.

    python -m tests.serve_tone [--seconds-per-word S] [voice-agent serve flags ...]
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys

from signaling.app import build_app, runner_options
from signaling.cli import build_parser, config_from_args
from signaling.keys import DRAIN, SESSIONS
from signaling.logs import configure_logging
from signaling.shutdown import serve
from tests.doubles import ToneEngine


def main(argv: list[str]) -> int:
    seconds_per_word = 0.25
    if "--seconds-per-word" in argv:
        at = argv.index("--seconds-per-word")
        seconds_per_word = float(argv[at + 1])
        del argv[at : at + 2]
    args = build_parser(os.environ).parse_args(["serve", *argv])
    config = config_from_args(args, os.environ)
    configure_logging(config)
    # For bench/soak.py: SIGUSR1 returns the C heap's free memory to the OS (glibc
    # malloc_trim), which tells a native leak (RSS stays) from fragmentation (RSS drops).
    libc = ctypes.CDLL(None)
    signal.signal(signal.SIGUSR1, lambda *_: libc.malloc_trim(0))
    app = build_app(config, ToneEngine(seconds_per_word=seconds_per_word))
    asyncio.run(serve(app, config, app[SESSIONS], app[DRAIN], **runner_options()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
