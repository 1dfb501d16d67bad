"""Headless Firefox driven over WebDriver BiDi, for the browser tests' Firefox leg.

Playwright drives a stock Firefox only through BiDi commands that Firefox ESR does not have
yet (it fails on ``emulation.setMediaFeaturesOverride`` before opening a page), and its own
patched Firefox cannot be downloaded here. Firefox itself speaks WebDriver BiDi
(``--remote-debugging-port``), so this module does: start Firefox with a fresh profile, open
the BiDi session over a websocket (aiohttp), navigate, evaluate scripts, click elements with
real pointer input, and keep the console. Only what the tests use.

Needs Firefox at /usr/bin/firefox-esr (Debian: ``apt-get install -y firefox-esr``; .ci/run
installs it; FIREFOX_PATH overrides the path).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

FIREFOX = os.environ.get("FIREFOX_PATH", "/usr/bin/firefox-esr")
HAVE_FIREFOX = os.path.exists(FIREFOX)

# The preferences a call needs headless on localhost; everything else is Firefox's default.
PREFS: dict[str, object] = {
    # A fake microphone, no permission prompt (Chromium: --use-fake-*-for-media-stream).
    "media.navigator.streams.fake": True,
    "media.navigator.permission.disabled": True,
    # Play the agent's audio without a user gesture (Chromium: --autoplay-policy).
    "media.autoplay.default": 0,
    # Firefox gathers no loopback ICE candidates by default; the server is on 127.0.0.1.
    "media.peerconnection.ice.loopback": True,
    # Quiet and offline: no first-run pages, updates or telemetry.
    "browser.shell.checkDefaultBrowser": False,
    "browser.startup.homepage_override.mstone": "ignore",
    "app.update.disabledForTesting": True,
    "datareporting.policy.dataSubmissionEnabled": False,
    "toolkit.telemetry.reportingpolicy.firstRun": False,
    "remote.prefs.recommended": True,
}

LISTENING = re.compile(r"WebDriver BiDi listening on (ws://\S+)")


class BiDiError(AssertionError):
    pass


class Firefox:
    """One BiDi session on one Firefox; one top-level browsing context (the first tab)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.log: list[str] = []
        self.context_id = ""
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(message.data)
            if "id" in data and data["id"] in self._pending:
                future = self._pending.pop(data["id"])
                if not future.done():
                    future.set_result(data)
            elif data.get("method") == "log.entryAdded":
                entry = data["params"]
                self.log.append(f"{entry.get('type')}.{entry.get('level')}: {entry.get('text')}")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(BiDiError("Firefox closed the BiDi connection"))

    async def send(self, method: str, params: dict[str, Any], timeout: float = 30) -> Any:
        command_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[command_id] = future
        await self._ws.send_json({"id": command_id, "method": method, "params": params})
        try:
            answer = await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(command_id, None)
        if answer.get("type") == "error":
            raise BiDiError(f"{method}: {answer.get('error')}: {answer.get('message')}")
        return answer["result"]

    async def goto(self, url: str) -> None:
        await self.send(
            "browsingContext.navigate",
            {"context": self.context_id, "url": url, "wait": "complete"},
        )

    async def evaluate(self, function: str, arg: Any = None, timeout: float = 30) -> Any:
        """Call the JS ``function`` (awaited) with ``arg``; its JSON-serialisable result."""
        # The result crosses as a JSON string: BiDi's own value serialisation is verbose.
        declaration = f"async (raw) => JSON.stringify(await ({function})(JSON.parse(raw)))"
        result = await self.send(
            "script.callFunction",
            {
                "functionDeclaration": declaration,
                "arguments": [{"type": "string", "value": json.dumps(arg)}],
                "target": {"context": self.context_id},
                "awaitPromise": True,
                "resultOwnership": "none",
            },
            timeout=timeout + 5,
        )
        if result.get("type") == "exception":
            details = result.get("exceptionDetails", {})
            raise BiDiError(f"script threw: {details.get('text')}{self.context()}")
        value = result["result"]
        if value.get("type") != "string":  # undefined: JSON.stringify(undefined)
            return None
        return json.loads(value["value"])

    async def wait_for(self, predicate: str, timeout: float = 15) -> Any:
        """Poll the JS ``predicate`` (a function of no arguments) until it is truthy."""
        poll = """async ({predicate, timeoutMs}) => {
          const test = eval(predicate);
          const t0 = performance.now();
          while (performance.now() - t0 < timeoutMs) {
            const value = await test();
            if (value) return value;
            await new Promise((r) => setTimeout(r, 20));
          }
          return null;
        }"""
        value = await self.evaluate(
            poll, {"predicate": predicate, "timeoutMs": timeout * 1000}, timeout=timeout
        )
        if not value:
            raise BiDiError(f"timed out after {timeout} s waiting for {predicate}{self.context()}")
        return value

    async def click(self, selector: str) -> None:
        """A real click (pointer input) in the middle of the element ``selector``."""
        found = await self.send(
            "script.callFunction",
            {
                "functionDeclaration": "(s) => document.querySelector(s)",
                "arguments": [{"type": "string", "value": selector}],
                "target": {"context": self.context_id},
                "awaitPromise": False,
                "resultOwnership": "root",
            },
        )
        node = found.get("result", {})
        if node.get("type") != "node":
            raise BiDiError(f"no element {selector!r}{self.context()}")
        origin = {"type": "element", "element": {"sharedId": node["sharedId"]}}
        await self.send(
            "input.performActions",
            {
                "context": self.context_id,
                "actions": [
                    {
                        "type": "pointer",
                        "id": "mouse",
                        "parameters": {"pointerType": "mouse"},
                        "actions": [
                            {"type": "pointerMove", "x": 0, "y": 0, "origin": origin},
                            {"type": "pointerDown", "button": 0},
                            {"type": "pointerUp", "button": 0},
                        ],
                    }
                ],
            },
        )

    async def fill(self, selector: str, text: str) -> None:
        """Set an input's value as typing would leave it (an ``input`` event fired)."""
        await self.evaluate(
            """({selector, text}) => {
              const el = document.querySelector(selector);
              el.focus(); el.value = text;
              el.dispatchEvent(new Event('input', {bubbles: true})); }""",
            {"selector": selector, "text": text},
        )

    def context(self) -> str:
        return "\nfirefox log:\n" + "\n".join(self.log[-40:])

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.send("session.end", {}), 5)
        await self._ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@contextlib.asynccontextmanager
async def launch(extra_prefs: dict[str, object] | None = None) -> AsyncIterator[Firefox]:
    """A headless Firefox with a fresh profile and a BiDi session on its first tab."""
    profile = Path(tempfile.mkdtemp(prefix="firefox-profile-"))
    prefs = {**PREFS, **(extra_prefs or {})}
    (profile / "user.js").write_text(
        "".join(f"user_pref({json.dumps(k)}, {json.dumps(v)});\n" for k, v in prefs.items())
    )
    process = await asyncio.create_subprocess_exec(
        FIREFOX,
        "--headless",
        "--no-remote",
        "--profile",
        str(profile),
        "--remote-debugging-port=0",
        "about:blank",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # its content processes go with it
    )
    output: list[str] = []
    drain: asyncio.Task[None] | None = None
    try:
        try:
            url = await asyncio.wait_for(_listening_url(process, output), 60)
        except TimeoutError as exc:
            raise BiDiError("Firefox did not start its BiDi server:\n" + "".join(output)) from exc
        # Firefox's stderr must keep draining, or a chatty Firefox blocks on the pipe.
        assert process.stderr is not None
        drain = asyncio.create_task(_drain(process.stderr))
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(url + "/session", max_msg_size=0)
            firefox = Firefox(ws)
            try:
                await firefox.send("session.new", {"capabilities": {}})
                await firefox.send("session.subscribe", {"events": ["log.entryAdded"]})
                tree = await firefox.send("browsingContext.getTree", {"maxDepth": 0})
                firefox.context_id = tree["contexts"][0]["context"]
                yield firefox
            finally:
                await firefox.close()
    finally:
        if drain is not None:
            drain.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        shutil.rmtree(profile, ignore_errors=True)


async def _listening_url(process: asyncio.subprocess.Process, output: list[str]) -> str:
    assert process.stderr is not None
    while line := await process.stderr.readline():
        text = line.decode(errors="replace")
        output.append(text)
        if match := LISTENING.search(text):
            return match.group(1)
    raise BiDiError("Firefox exited before its BiDi server started:\n" + "".join(output))


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass
