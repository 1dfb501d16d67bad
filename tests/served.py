"""The product in a subprocess: ``python -m signaling serve`` on a free port, ready to use."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

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


@contextlib.asynccontextmanager
async def serve_subprocess(
    model_dir: Path, *args: str, ready_timeout_s: float = 120
) -> AsyncIterator[Served]:
    """``serve`` with the tiny checkpoint on CPU; yields once /readyz says 200."""
    port = free_port()
    env = {**os.environ, "VOICE_AGENT_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "signaling", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--model-dir", str(model_dir), "--device", "cpu", *args]
    proc = subprocess.Popen(command, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    seen: list[int] = []
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + ready_timeout_s
            while time.monotonic() < deadline:
                assert proc.poll() is None, "server exited"
                try:
                    async with http.get(url + "/readyz") as resp:
                        seen.append(resp.status)
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
            else:
                raise TimeoutError(f"server not ready: {seen[-5:]}")
        yield Served(url, seen, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
