"""The product in a subprocess: ``python -m signaling serve`` on a free port, ready to use."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    def __init__(self, url: str, readiness: list[int], proc: subprocess.Popen[bytes]) -> None:
        self.url = url
        self.readiness = readiness  # /readyz status codes seen while starting
        self.proc = proc


@contextlib.contextmanager
def serve_subprocess(model_dir: Path, *args: str, ready_timeout_s: float = 120) -> Iterator[Served]:
    """``serve`` with the tiny checkpoint on CPU; yields once /readyz says 200.

    Synchronous (it only polls), so module-scoped fixtures can share one server between
    tests: starting the product (torch, the model, N workers) is most of their cost.
    """
    port = free_port()
    env = {**os.environ, "VOICE_AGENT_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "signaling", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--model-dir", str(model_dir), "--device", "cpu", *args]
    proc = subprocess.Popen(command, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    seen: list[int] = []
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            assert proc.poll() is None, "server exited"
            assert time.monotonic() < deadline, f"server not ready: {seen[-5:]}"
            status = _status(url + "/readyz")
            if status is not None:
                seen.append(status)
                if status == 200:
                    break
            time.sleep(0.05)
        yield Served(url, seen, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
