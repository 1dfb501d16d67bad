"""Start the server in a subprocess (``python -m signaling`` or ``tests.serve_tone``), wait
until it is ready, stop it with SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import aiohttp

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(
        self,
        command: list[str],
        args: list[str],
        log: IO[bytes] | int | None = None,
        port: int | None = None,
    ) -> None:
        """``command``: e.g. ``["signaling", "serve"]`` or ``["tests.serve_tone"]``;
        ``port``: a free one unless given (e.g. a server restarted on its predecessor's)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VOICE_AGENT_LOG_LEVEL": os.environ.get("SERVER_LOG_LEVEL", "WARNING")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                *command,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *args,
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=log,
        )

    async def ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}")
                try:
                    async with http.get(self.url + "/readyz") as resp:
                        if resp.status == 200:
                            return
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
        raise TimeoutError("server not ready")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30) -> int:
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
