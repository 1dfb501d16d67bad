"""Three headless Chromium instances in one room, each with a fake microphone of its own tone.

Each browser gets ``--use-file-for-fake-audio-capture`` with a WAV of a different sine tone
(a browser instance has one fake microphone, hence three instances). They join the room
through static/room.html; one asks the agent to speak (the ToneEngine speaks a tone too).
Each page must receive the agent on its first track and the other two people's tones on
its slot tracks, read with a WebAudio analyser (loudest frequency per received track), and
never its own tone. Needs Chromium like tests/test_browser.py.
"""

from __future__ import annotations

import asyncio
import time
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from signaling.keys import SESSIONS
from tests.conftest import LiveServer
from tests.doubles import ToneMicrophone, tone_frequency
from tests.rtc_client import RtcClient
from tests.server_process import ServerProcess
from tests.test_browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    END_TRACK_JS,
    HAVE_CHROMIUM,
    REQUIRE_BROWSER,
)
from tests.test_browser import browser as one_browser  # noqa: F401 - its one-browser fixture

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(150)]

try:
    from playwright.async_api import Browser, Page, async_playwright
except ImportError:  # pragma: no cover - test_browser.py already skipped or failed
    pytest.skip("the playwright Python package is not installed", allow_module_level=True)

TONES = {"ann": 800.0, "ben": 1300.0, "cat": 2000.0}
AGENT_TEXT = "one two three four five six seven eight nine ten eleven twelve"
HEARD_DB = -70.0  # analyser level (dB) of the loudest bin that counts as sound
TOLERANCE_HZ = 20.0

TRACKS_JS = """
() => window.voiceRoom.tracks.map((t) => t ? {freq: t.freq, level: t.level} : null)
"""


def write_tone(path: Path, frequency: float, seconds: float = 4.0, rate: int = 48_000) -> None:
    # Whole cycles per file: Chromium loops it, and a seam would add a click.
    samples = round(seconds * frequency) * rate // int(frequency)
    t = np.arange(samples) / rate
    pcm = (0.3 * 32767 * np.sin(2 * np.pi * frequency * t)).astype(np.int16)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())


@pytest.fixture
async def browsers(tmp_path: Path) -> AsyncIterator[dict[str, Browser]]:
    if not HAVE_CHROMIUM:
        message = f"Chromium not found at {CHROMIUM}"
        if REQUIRE_BROWSER:
            pytest.fail(message)
        pytest.skip(message)
    async with async_playwright() as pw:
        launched: dict[str, Browser] = {}
        try:
            for name, frequency in TONES.items():
                wav = tmp_path / f"{name}.wav"
                write_tone(wav, frequency)
                launched[name] = await pw.chromium.launch(
                    executable_path=CHROMIUM,
                    headless=True,
                    args=[*CHROMIUM_ARGS, f"--use-file-for-fake-audio-capture={wav}"],
                )
            yield launched
        finally:
            for browser in launched.values():
                await browser.close()


async def open_room(browser: Browser, server: LiveServer, name: str, log: list[str]) -> Page:
    page = await (await browser.new_context()).new_page()
    page.set_default_timeout(20_000)
    page.on("console", lambda m: log.append(f"{name} console.{m.type}: {m.text}"))
    page.on("pageerror", lambda e: log.append(f"{name} pageerror: {e}"))
    await page.goto(f"{server.url}/room.html?room=trio&name={name}&processing=off")
    await page.wait_for_function("() => window.voiceRoom !== undefined")
    await page.click("#join")
    await page.wait_for_selector('#state[data-state="connected"]')
    return page


def heard(tracks: list[dict[str, Any] | None], frequency: float) -> list[int]:
    """Indexes of the received tracks whose loudest frequency is ``frequency``."""
    return [
        i
        for i, t in enumerate(tracks)
        if t is not None and t["level"] > HEARD_DB and abs(t["freq"] - frequency) < TOLERANCE_HZ
    ]


async def test_three_pages_hear_the_agent_and_each_other(
    browsers: dict[str, Browser], live_server: LiveServer
) -> None:
    log: list[str] = []
    pages = {}
    for name, browser in browsers.items():
        pages[name] = await open_room(browser, live_server, name, log)
    # Everyone sees everyone (names from room.state / participant.joined).
    for page in pages.values():
        await page.wait_for_function(
            "() => document.querySelectorAll('#people li').length === 4"  # 3 people + agent
        )
    await pages["ann"].fill("#text", AGENT_TEXT)
    await pages["ann"].click("#say")
    agent_hz = tone_frequency(AGENT_TEXT)
    wanted = {name: {agent_hz} | {f for n, f in TONES.items() if n != name} for name in pages}
    seen: dict[str, dict[float, list[int]]] = {name: {} for name in pages}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for name, page in pages.items():
            tracks = await page.evaluate(TRACKS_JS)
            for frequency in wanted[name] | {TONES[name]}:
                where = heard(tracks, frequency)
                if where:
                    seen[name].setdefault(frequency, where)
        if all(set(seen[name]) >= wanted[name] for name in pages):
            break
        await asyncio.sleep(0.2)
    for name in pages:
        assert set(seen[name]) >= wanted[name], (name, seen[name], log[-20:])
        assert TONES[name] not in seen[name], f"{name} heard its own microphone"
        assert seen[name][agent_hz] == [0], "the agent comes on the first track"
        assert all(i >= 1 for f, where in seen[name].items() if f != agent_hz for i in where)
    # Who is talking: every page marks the two other people (and itself) as talking.
    talking = await pages["cat"].evaluate(
        "() => [...document.querySelectorAll('#people li')]"
        ".filter((li) => li.dataset.speaking === 'true').length"
    )
    assert talking >= 3, log[-20:]
    # Mute: ann's tone stops for the others and her entry says so.
    await pages["ann"].click("#mute")
    await pages["ben"].wait_for_function(
        "() => [...document.querySelectorAll('#people li')]"
        ".some((li) => li.textContent.includes('ann') && li.dataset.muted === 'true')"
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not heard(await pages["ben"].evaluate(TRACKS_JS), TONES["ann"]):
            break
        await asyncio.sleep(0.2)
    assert not heard(await pages["ben"].evaluate(TRACKS_JS), TONES["ann"])
    assert not [line for line in log if "pageerror" in line], log


# Every RTCPeerConnection the page makes, so a test can see that none is left open.
KEEP_PCS_JS = """
window.__pcs = [];
const RTCPeerConnectionBefore = window.RTCPeerConnection;
window.RTCPeerConnection = function (...args) {
  const pc = new RTCPeerConnectionBefore(...args);
  window.__pcs.push(pc);
  return pc;
};
window.RTCPeerConnection.prototype = RTCPeerConnectionBefore.prototype;
"""

ROOM_UI_JS = """
() => ({
  state: document.getElementById('state').dataset.state,
  me: document.getElementById('me').textContent,
  caption: document.getElementById('caption').textContent,
  enabled: [...document.querySelectorAll('button')].filter((b) => !b.disabled).map((b) => b.id),
  openPcs: window.__pcs.filter((pc) => pc.connectionState !== 'closed').length,
})
"""

NOT_JOINED = {"state": "idle", "me": "", "caption": "", "enabled": ["join"], "openPcs": 0}

# Joined (the answer applied) while the data channel is still opening: what the controls
# offer, and what a message sent meanwhile (the box's Say) does.
SAY_BEFORE_OPEN_JS = """
async () => {
  await window.voiceRoom.join('solo', '', false);
  const ui = (id) => document.getElementById(id);
  const channel = window.voiceRoom.call.channel.readyState;
  const enabled = [...document.querySelectorAll('button, input')]
    .filter((el) => !el.disabled).map((el) => el.id);
  ui('text').value = 'too early';
  ui('say-form').requestSubmit();
  return {channel, enabled, box: ui('text').value, alert: ui('alert').textContent};
}
"""

# `n` speaker.active events, as a long meeting brings them: how many the page keeps, and
# the newest one's level.
FEED_JS = """
(n) => {
  const channel = window.voiceRoom.call.channel;
  for (let i = 0; i < n; i++) {
    const msg = {type: 'speaker.active', participant_id: 'agent', slot: 0,
                 active: i % 2 === 0, level_dbfs: -i};
    channel.dispatchEvent(new MessageEvent('message', {data: JSON.stringify(msg)}));
  }
  const events = window.voiceRoom.events;
  return [events.length, events[0].level_dbfs, events[events.length - 1].level_dbfs];
}
"""


async def test_join_once_leave_cleanly_and_see_the_call_end(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
    live_server: LiveServer,
) -> None:
    """Join clicked twice makes one call; Leave deletes the session before closing and
    resets the page; a session the server ends (session.closed, or just closed) is shown
    and the page goes back to not joined. Say, Ask, Interrupt and Mute wait for the data
    channel to open (they were enabled with the answer, and what they sent before was
    dropped silently, the box emptied); the page keeps the newest 1000 events of a long
    call. The main page in a room connects without a barge-in setting (a room has none)."""
    registry = live_server.app[SESSIONS]
    log: list[str] = []
    page = await (await one_browser.new_context()).new_page()
    page.set_default_timeout(10_000)
    page.on("console", lambda m: log.append(f"console.{m.type}: {m.text}"))
    page.on("pageerror", lambda e: log.append(f"pageerror: {e}"))
    offers: list[str] = []
    deletes: list[int] = []
    page.on("request", lambda r: r.url.endswith("/offer") and offers.append(r.method))
    page.on("response", lambda r: r.request.method == "DELETE" and deletes.append(r.status))
    await page.add_init_script(KEEP_PCS_JS)
    await page.goto(f"{live_server.url}/room.html?room=solo")
    await page.set_checked("#speak", False)

    async def join() -> str:
        await page.click("#join")
        await page.wait_for_selector('#state[data-state="connected"]')
        return str(await page.evaluate("() => window.voiceRoom.call.sessionId"))

    # A double click on Join: one call.
    await page.evaluate(
        "() => { for (let i = 0; i < 2; i++) document.getElementById('join').click(); }"
    )
    await page.wait_for_selector('#state[data-state="connected"]')
    await page.wait_for_timeout(300)
    assert offers == ["POST"], offers
    assert len(registry) == 1
    # Ask: the room's brain answers (the echo brain: the question back), heard as a reply.
    await page.fill("#text", "Is anyone there?")
    await page.click("#ask")
    await page.wait_for_function(
        "() => window.voiceRoom.events.some((e) => e.type === 'speech.ended'"
        " && String(e.id).startsWith('reply-'))"
    )
    replies = await page.evaluate(
        "() => window.voiceRoom.events.filter((e) => e.type === 'speech.segment')"
        ".map((e) => [e.id.slice(0, 6), e.text])"
    )
    assert replies == [["reply-", "Is anyone there?"]], replies
    # Leave while the agent speaks: DELETE first (204, not 404), then nothing is left over.
    await page.fill("#text", "one two three four five six")
    await page.click("#say")
    await page.wait_for_function("() => document.getElementById('caption').textContent !== ''")
    await page.click("#leave")
    await page.wait_for_selector('#state[data-state="idle"]')
    assert await page.evaluate(ROOM_UI_JS) == NOT_JOINED
    assert deletes == [204], deletes
    assert len(registry) == 0

    # The server ends the seat the way its idle check does: the page says so and why.
    session_id = await join()
    peer = registry.get(session_id)
    peer.session.send_event({"type": "session.closed", "reason": "idle_timeout"})
    await registry.close(session_id)
    await page.wait_for_selector("#alert:not([hidden])")
    assert "idle_timeout" in (await page.text_content("#alert") or ""), log[-10:]
    assert await page.evaluate(ROOM_UI_JS) == {**NOT_JOINED, "state": "closed"}

    # The connection just goes (the server is gone): the same.
    session_id = await join()
    assert await page.is_hidden("#alert")
    await registry.close(session_id)
    await page.wait_for_selector("#alert:not([hidden])")
    ui = await page.evaluate(ROOM_UI_JS)
    assert ui["enabled"] == ["join"] and ui["openPcs"] == 0, ui

    early = await page.evaluate(SAY_BEFORE_OPEN_JS)
    assert early["channel"] == "connecting", early  # else this step proves nothing
    assert early["enabled"] == ["leave"], early  # the name box too is fixed while joined
    assert early["box"] == "too early" and "nothing was sent" in early["alert"], early
    await page.wait_for_function("() => !document.getElementById('say').disabled")
    assert await page.evaluate(FEED_JS, 1500) == [1000, -500, -1499]

    # The main page in this room: no `config` barge_in on connect (the room would refuse
    # it: an error on every connect), and no Barge-in box to tick.
    main = await page.context.new_page()
    main.on("pageerror", lambda e: log.append(f"main pageerror: {e}"))
    await main.goto(f"{live_server.url}/?room=solo")
    await main.set_checked("#mic", False)
    await main.click("#connect")
    await main.wait_for_selector('#state[data-state="connected"]')
    said = await main.evaluate("() => window.voiceAgent.say('hello room')")
    await main.wait_for_function(
        "(id) => window.voiceAgent.events.some((e) => e.type === 'speech.started' && e.id === id)",
        arg=said,
    )
    errors = await main.evaluate("() => window.voiceAgent.events.filter((e) => e.type === 'error')")
    assert errors == [] and await main.is_hidden("#alert"), errors
    assert await main.is_disabled("#barge-in")
    assert not [line for line in log if "pageerror" in line], log


async def _joined_listener(browser: Browser, url: str, log: list[str]) -> Page:
    page = await (await browser.new_context()).new_page()
    page.set_default_timeout(10_000)
    page.on("console", lambda m: log.append(f"console.{m.type}: {m.text}"))
    page.on("pageerror", lambda e: log.append(f"pageerror: {e}"))
    await page.add_init_script(KEEP_PCS_JS)
    await page.goto(f"{url}/room.html?room=gone")
    await page.set_checked("#speak", False)
    await page.click("#join")
    await page.wait_for_selector('#state[data-state="connected"]')
    return page


async def test_a_server_that_vanishes_ends_the_call_in_seconds(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
) -> None:
    """A server killed with SIGKILL says nothing: no data-channel close, and Chromium calls
    the connection failed only ~18 s later, the page looking joined all that time. Now the
    page notices that its audio stopped and asks the server about its seat: a new server
    on the address, which has no such seat (404), ends the call at once; no server at all
    (no answer for 4 s) ends it in about 7 s."""
    log: list[str] = []
    first = ServerProcess(["tests.serve_tone"], ["--no-listen"])
    second = None
    try:
        await first.ready()
        page = await _joined_listener(one_browser, first.url, log)
        # Killed, and at once a new server on the same address (a restart).
        first.proc.kill()
        first.proc.wait()
        second = ServerProcess(["tests.serve_tone"], ["--no-listen"], port=first.port)
        await second.ready()
        await page.wait_for_selector("#alert:not([hidden])")
        assert "seat in the room is gone" in (await page.text_content("#alert") or ""), log
        assert await page.get_attribute("#state", "data-state") == "closed"
        assert await page.evaluate(ROOM_UI_JS) == {**NOT_JOINED, "state": "closed"}

        # Joined on the new one, which is killed for good.
        await page.click("#join")
        await page.wait_for_selector('#state[data-state="connected"]')
        start = time.monotonic()
        second.proc.kill()
        second.proc.wait()
        await page.wait_for_selector("#alert:not([hidden])", timeout=14_000)
        took = time.monotonic() - start
        assert "stopped answering" in (await page.text_content("#alert") or ""), log
        assert await page.evaluate(ROOM_UI_JS) == {**NOT_JOINED, "state": "failed"}
        assert took < 12, took  # ~7 s: 2 s of no audio, then 4 s of no answer
    finally:
        for server in (first, second):
            if server is not None and server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait()


async def test_a_failed_connection_gives_its_seat_back_at_once(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
    live_server: LiveServer,
) -> None:
    """The browser calls the connection failed (the network went): the page ends the call
    and deletes its session, since closing a connection that failed tells the server
    nothing. Before, the seat, and its slot, stayed until the server's RTCP timeout (12 s).
    Here the connection's close is kept from reaching the server, as a failed network
    would, while the page is told that it failed."""
    registry = live_server.app[SESSIONS]
    log: list[str] = []
    page = await _joined_listener(one_browser, live_server.url, log)
    assert len(registry) == 1
    await page.evaluate(
        """() => {
          const pc = window.voiceRoom.call.pc;
          pc.close = () => {};  // a failed network: nothing reaches the server
          Object.defineProperty(pc, 'connectionState', {get: () => 'failed'});
          pc.dispatchEvent(new Event('connectionstatechange'));
        }"""
    )
    await page.wait_for_selector("#alert:not([hidden])")
    assert await page.get_attribute("#state", "data-state") == "failed", log
    deadline = time.monotonic() + 3
    while len(registry) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert len(registry) == 0, log


async def test_an_event_from_a_call_already_left_changes_nothing(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
    live_server: LiveServer,
) -> None:
    """A message the old call's channel delivers after Leave (queued as it closed) is not
    this page's news: it filled the people list and "me" of a page no longer in a room."""
    log: list[str] = []
    page = await _joined_listener(one_browser, live_server.url, log)
    await page.evaluate("() => { window.__oldChannel = window.voiceRoom.call.channel; }")
    await page.click("#leave")
    await page.wait_for_selector('#state[data-state="idle"]')
    await page.evaluate(
        """() => window.__oldChannel.dispatchEvent(new MessageEvent('message', {data:
             JSON.stringify({type: 'room.state', room: 'gone', participant_id: 'p9',
                             agent_speaking: false, instruct: 'anyone',
                             participants: [{participant_id: 'p9', name: 'ghost'}]})}))"""
    )
    assert await page.evaluate(ROOM_UI_JS) == NOT_JOINED, log
    assert await page.evaluate("() => window.voiceRoom.people.size") == 0, log


async def test_audio_that_stops_while_the_seat_is_there_does_not_end_the_call(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
    live_server: LiveServer,
) -> None:
    """The other side of the check above: the server still has the seat (200) while the
    audio stopped (a media path broken, HTTP fine): the call goes on; ICE decides."""
    log: list[str] = []
    page = await _joined_listener(one_browser, live_server.url, log)
    checks: list[int] = []
    page.on(
        "response",
        lambda r: r.request.method == "GET" and "/sessions/" in r.url and checks.append(r.status),
    )
    (peer,) = live_server.app[SESSIONS].peers()
    for sender in peer.pc.getSenders():
        if sender.track is not None:
            sender.track.stop()  # the server's audio to this page stops; the seat stays
    deadline = time.monotonic() + 10
    while not checks:
        assert time.monotonic() < deadline, log
        await page.wait_for_timeout(200)
    await page.wait_for_timeout(1500)  # the next checks (one a second) say the same
    assert set(checks) == {200}, checks
    assert await page.get_attribute("#state", "data-state") == "connected"
    assert await page.is_hidden("#alert"), await page.text_content("#alert")


ROOM_SECRET = "browser-test-secret-0123456789abcdef"


def hosts_only_config() -> Any:
    from agent.config import Config, RoomSettings, SecuritySettings

    return Config(
        host="127.0.0.1",
        port=0,
        security=SecuritySettings(auth_secret=ROOM_SECRET),
        rooms=RoomSettings(instruct="hosts"),
    )


INSTRUCT_UI_JS = """
() => ({
  enabled: ['text', 'say', 'ask', 'interrupt']
    .filter((id) => !document.getElementById(id).disabled),
  hint: document.getElementById('text').placeholder,
})
"""


@pytest.mark.parametrize("server_config", [hosts_only_config()], ids=["hosts_only"])
async def test_a_hosts_only_room_offers_its_agent_only_to_hosts(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
    live_server: LiveServer,
) -> None:
    """`--room-instruct hosts`: the agent takes Say, Ask and Interrupt from hosts only.
    Everyone else had the box and the three buttons enabled, and every use ended in a
    `forbidden` error; room.state says the policy and who is a host."""
    from signaling.auth import mint_token

    log: list[str] = []
    context = await one_browser.new_context()
    try:
        pages = {}
        for role in ("speaker", "host"):
            token = mint_token(ROOM_SECRET, ttl_s=600, room="lobby", role=role)
            page = await context.new_page()
            page.set_default_timeout(10_000)
            page.on("pageerror", lambda e: log.append(f"pageerror: {e}"))
            await page.goto(f"{live_server.url}/room.html?token={token}")
            await page.set_checked("#speak", False)
            await page.click("#join")
            await page.wait_for_function(
                "() => window.voiceRoom.events.some((e) => e.type === 'room.state')"
            )
            await page.wait_for_timeout(100)
            pages[role] = page
        guest = await pages["speaker"].evaluate(INSTRUCT_UI_JS)
        assert guest["enabled"] == [] and "host" in guest["hint"], guest
        host = await pages["host"].evaluate(INSTRUCT_UI_JS)
        assert host["enabled"] == ["text", "say", "ask", "interrupt"], host
        assert "host" not in host["hint"], host
        assert not log, log
    finally:
        await context.close()


# Rows of the people list added or removed while `msgs` arrive on the data channel.
PEOPLE_CHURN_JS = """
async (msgs) => {
  const list = document.getElementById('people');
  const before = [...list.children];
  let churn = 0;
  const observer = new MutationObserver((records) => {
    for (const r of records) {
      if (r.target === list) churn += r.addedNodes.length + r.removedNodes.length;
    }
  });
  observer.observe(list, {childList: true});
  const channel = window.voiceRoom.call.channel;
  for (const m of msgs) {
    channel.dispatchEvent(new MessageEvent('message', {data: JSON.stringify(m)}));
  }
  await new Promise((r) => setTimeout(r, 0));
  observer.disconnect();
  return {churn, same: before.every((li, i) => list.children[i] === li),
          rows: [...list.children].map((li) => li.textContent)};
}
"""


async def test_the_people_list_is_not_rebuilt_by_every_event(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
    live_server: LiveServer,
) -> None:
    """The people list is a live region: a screen reader reads out the rows added to it.
    It was rebuilt on every data-channel event (each caption, each `speaker.active`), so
    the whole room was read out again with every sentence the agent spoke."""
    log: list[str] = []
    page = await _joined_listener(one_browser, live_server.url, log)
    await page.wait_for_function("() => document.querySelectorAll('#people li').length === 2")
    speech = [
        {"type": "speech.started", "id": "u1"},
        {"type": "speech.segment", "id": "u1", "text": "Hello room.", "start_ms": 0},
        {"type": "speech.ended", "id": "u1", "interrupted": False},
    ]
    quiet = await page.evaluate(PEOPLE_CHURN_JS, speech)
    assert quiet["churn"] == 0 and quiet["same"], quiet
    # The agent starts talking: its row says so, in place.
    talking = {"type": "speaker.active", "participant_id": "agent", "active": True}
    active = await page.evaluate(PEOPLE_CHURN_JS, [talking])
    assert active["churn"] == 0 and active["same"], active
    assert active["rows"][0] == "🤖 Agent · talking", active
    # Someone joins and leaves: one row each way.
    guest = {"participant_id": "p2", "name": "zoe", "role": "listener", "slot": None}
    joined = await page.evaluate(PEOPLE_CHURN_JS, [{"type": "participant.joined", **guest}])
    assert joined["churn"] == 1 and joined["same"], joined
    assert joined["rows"][2] == "🎧 zoe", joined
    gone = {"type": "participant.left", "participant_id": "p2"}
    left = await page.evaluate(PEOPLE_CHURN_JS, [gone])
    assert left["churn"] == 1 and len(left["rows"]) == 2, left
    assert not [line for line in log if "pageerror" in line], log


DENY_MIC_JS = """
window.__denyMic = true;
const getUserMediaBefore = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
navigator.mediaDevices.getUserMedia = async (constraints) => {
  if (window.__denyMic) throw new DOMException('Permission denied', 'NotAllowedError');
  return getUserMediaBefore(constraints);
};
"""


async def test_the_room_page_says_what_happened_to_the_microphone(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
    live_server: LiveServer,
) -> None:
    """Joining to speak with the microphone refused showed only "Permission denied" (which
    permission, and what now?); a microphone that stopped mid-call (unplugged, permission
    withdrawn) was not shown at all, the room no longer hearing its speaker."""
    log: list[str] = []
    page = await (await one_browser.new_context()).new_page()
    page.set_default_timeout(10_000)
    page.on("pageerror", lambda e: log.append(f"pageerror: {e}"))
    await page.add_init_script(DENY_MIC_JS)
    await page.goto(f"{live_server.url}/room.html?room=mic")
    await page.click("#join")
    await page.wait_for_selector("#alert:not([hidden])")
    alert = await page.text_content("#alert") or ""
    assert "icrophone" in alert and "listener" in alert, alert
    assert await page.get_attribute("#state", "data-state") == "idle"
    assert await page.is_enabled("#join")

    await page.evaluate("() => { window.__denyMic = false; }")
    await page.click("#join")
    await page.wait_for_selector('#state[data-state="connected"]')
    await page.wait_for_selector("#mute:not([disabled])")
    assert await page.is_hidden("#alert")
    await page.evaluate(END_TRACK_JS, "window.voiceRoom.call.mic")
    await page.wait_for_selector("#alert:not([hidden])", timeout=2_000)
    assert "icrophone" in (await page.text_content("#alert") or "")
    assert await page.is_disabled("#mute")
    assert await page.get_attribute("#state", "data-state") == "connected"
    assert not log, log


HANG_MIC_JS = """
navigator.mediaDevices.getUserMedia = () => new Promise(() => {});  // a prompt never answered
"""


async def test_a_join_under_way_can_be_left(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
    live_server: LiveServer,
) -> None:
    """Leave was disabled until a join finished: a join waiting on a microphone prompt the
    user never answers, or on a slow server, could not be given up (found by review; the
    main page's Hang up can). Leave now ends a join under way; a seat the server made
    meanwhile is deleted. The room, name and speak fields are fixed while a join is under
    way or made (the name box stayed editable, to no effect)."""
    log: list[str] = []
    context = await one_browser.new_context()
    page = await context.new_page()
    page.set_default_timeout(10_000)
    page.on("pageerror", lambda e: log.append(f"pageerror: {e}"))
    await page.add_init_script(HANG_MIC_JS)
    await page.goto(f"{live_server.url}/room.html?room=stuck")
    await page.click("#join")  # to speak: the microphone prompt hangs
    await page.wait_for_selector('#state[data-state="connecting"]')
    # What the join was made with cannot be changed under it (edits changed nothing).
    for field in ("#room-name", "#display-name", "#speak"):
        assert await page.is_disabled(field), field
    await page.click("#leave")
    await page.wait_for_selector('#state[data-state="idle"]')
    assert await page.is_enabled("#join") and await page.is_disabled("#leave")
    for field in ("#room-name", "#display-name", "#speak"):
        assert await page.is_enabled(field), field

    # A slow server: the offer is answered only after Leave.
    held: list[Any] = []
    await page.route("**/offer", lambda route: held.append(route))
    await page.uncheck("#speak")
    await page.click("#join")
    deadline = time.monotonic() + 10
    while not held:
        assert time.monotonic() < deadline, "the offer was not sent"
        await asyncio.sleep(0.05)
    await page.click("#leave")
    await page.wait_for_selector('#state[data-state="idle"]')
    answered: list[int] = []
    page.on("response", lambda r: r.url.endswith("/offer") and answered.append(r.status))
    await held[0].continue_()
    registry = live_server.app[SESSIONS]
    deadline = time.monotonic() + 10
    while answered != [200] or len(registry):
        assert time.monotonic() < deadline, (answered, len(registry))
        await asyncio.sleep(0.1)
    assert await page.is_enabled("#join")
    assert not log, log
    await context.close()


async def test_a_refused_join_says_when_to_try_again(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
    live_server: LiveServer,
) -> None:
    """A refusal with Retry-After (server_full, not_ready...) showed only its message, not
    when to try again (rate_limited's message says it itself)."""
    body = {"error": {"code": "server_full", "message": "the server is full"}}
    context = await one_browser.new_context()
    page = await context.new_page()
    page.set_default_timeout(10_000)
    await page.route(
        "**/offer",
        lambda route: route.fulfill(status=503, json=body, headers={"Retry-After": "5"}),
    )
    await page.goto(f"{live_server.url}/room.html?room=full")
    await page.uncheck("#speak")
    await page.click("#join")
    await page.wait_for_selector("#alert:not([hidden])")
    alert = await page.text_content("#alert") or ""
    assert "server_full" in alert and "retry in 5 s" in alert, alert
    assert await page.is_enabled("#join")
    await context.close()


async def test_the_room_page_plays_its_audio_after_the_click_it_asks_for(
    live_server: Any,
) -> None:
    """Bug: when the browser blocked playback (an autoplay policy: Safari's, or a join made
    without a user gesture) the page said "Click anywhere on the page to hear the room." but
    nothing listened for that click: the players stayed paused, the room silent."""
    if not HAVE_CHROMIUM:
        if REQUIRE_BROWSER:
            pytest.fail(f"Chromium not found at {CHROMIUM}")
        pytest.skip(f"Chromium not found at {CHROMIUM}")
    args = [a for a in CHROMIUM_ARGS if not a.startswith("--autoplay-policy")]
    args.append("--autoplay-policy=document-user-activation-required")
    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            page = await (await chromium.new_context()).new_page()
            page.set_default_timeout(20_000)
            # A join with no user activation (as a page joining by itself would): the
            # players' audio is blocked until the user clicks.
            await page.add_init_script(
                "addEventListener('load', () => setTimeout(() =>"
                " window.voiceRoom.join('review', '', false), 300))"
            )
            await page.goto(f"{live_server.url}/room.html")
            # No look at the page meanwhile: Playwright's evaluations count as user gestures.
            await asyncio.sleep(4)
            assert await page.get_attribute("#state", "data-state") == "connected"
            await page.wait_for_function(
                "() => /Click anywhere/.test(document.getElementById('alert').textContent)"
            )
            await page.click("h1")  # the click the page asked for
            await page.wait_for_timeout(1000)
            paused = await page.evaluate(
                "() => [...document.querySelectorAll('#players audio')].map((a) => a.paused)"
            )
            assert paused and not any(paused), paused
            assert not await page.is_visible("#alert")
            # The meters' AudioContext, made with the players, runs too.
            await page.wait_for_function(
                "() => window.voiceRoom.tracks.some((t) => t && Number.isFinite(t.level))"
            )
        finally:
            await chromium.close()


# Counts the audio graph's connections the page makes and undoes (AudioNode.connect and a
# whole-node disconnect()), so a test can see what a finished call leaves connected.
COUNT_AUDIO_LINKS_JS = """
window.__audioLinks = 0;
const connectBefore = AudioNode.prototype.connect;
const disconnectBefore = AudioNode.prototype.disconnect;
AudioNode.prototype.connect = function (...args) {
  this.__links = (this.__links || 0) + 1;
  window.__audioLinks += 1;
  return connectBefore.apply(this, args);
};
AudioNode.prototype.disconnect = function (...args) {
  if (args.length === 0) { window.__audioLinks -= this.__links || 0; this.__links = 0; }
  return disconnectBefore.apply(this, args);
};
"""


async def test_a_finished_call_leaves_nothing_connected_in_the_audio_graph(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
    live_server: LiveServer,
) -> None:
    """The page's one AudioContext outlives its calls, and each call connected a source and
    an 8192-point analyser per received track (5 per join) that were never disconnected:
    every Join and Leave left them, and the ended streams they hold, behind (found by
    review)."""
    page = await (await one_browser.new_context()).new_page()
    page.set_default_timeout(10_000)
    await page.add_init_script(COUNT_AUDIO_LINKS_JS)
    await page.goto(f"{live_server.url}/room.html?room=graph")
    await page.set_checked("#speak", False)
    for _ in range(2):
        await page.click("#join")
        await page.wait_for_selector('#state[data-state="connected"]')
        await page.wait_for_function("() => window.voiceRoom.tracks.filter(Boolean).length > 0")
        assert await page.evaluate("() => window.__audioLinks") > 0
        await page.click("#leave")
        await page.wait_for_selector('#state[data-state="idle"]')
        assert await page.evaluate("() => window.__audioLinks") == 0


def five_speakers_config() -> Any:
    from agent.config import Config, RoomSettings

    return Config(host="127.0.0.1", port=0, rooms=RoomSettings(max_speakers=5))


@pytest.mark.parametrize("server_config", [five_speakers_config()], ids=["max_speakers_5"])
async def test_the_room_page_hears_every_speaker_the_server_admits(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
    live_server: LiveServer,
) -> None:
    """`--room-max-speakers 5`: the server admits five microphones, but room.js offered a
    fixed 4 slots (?slots= default): the fifth speaker (slot 4) was listed, shown talking,
    and never heard on the page (found by review). It offers what /ice-servers says."""
    page = await (await one_browser.new_context()).new_page()
    page.set_default_timeout(20_000)
    await page.goto(f"{live_server.url}/room.html?room=wide")
    await page.set_checked("#speak", False)
    await page.click("#join")
    await page.wait_for_selector('#state[data-state="connected"]')
    tones = [600.0, 900.0, 1200.0, 1500.0, 1800.0]  # slots 0..4, in join order
    async with aiohttp.ClientSession() as http:
        speakers = [RtcClient(live_server.url, http) for _ in tones]
        try:
            for client, tone in zip(speakers, tones, strict=True):
                await client.connect(room="wide", mic=ToneMicrophone(tone), name=f"s{tone:.0f}")
            state = await page.evaluate(
                "() => window.voiceRoom.events.find((e) => e.type === 'room.state')"
            )
            assert state["max_speakers"] == 5, state
            seen: set[float] = set()
            deadline = time.monotonic() + 12
            while time.monotonic() < deadline and seen != set(tones):
                tracks = await page.evaluate(TRACKS_JS)
                seen |= {tone for tone in tones if heard(tracks, tone)}
                await asyncio.sleep(0.2)
            assert tones[3] in seen, (seen, tracks)  # slot 3: the setup works
            assert seen == set(tones), f"speakers never heard: {set(tones) - seen}"
        finally:
            for client in speakers:
                await client.close()


def authenticated_config() -> Any:
    from agent.config import Config, SecuritySettings

    return Config(host="127.0.0.1", port=0, security=SecuritySettings(auth_secret=ROOM_SECRET))


@pytest.mark.parametrize("server_config", [authenticated_config()], ids=["auth"])
async def test_a_room_bound_token_joins_its_room_from_the_room_page(
    one_browser: Browser,  # noqa: F811 - the fixture imported above
    live_server: LiveServer,
) -> None:
    """A token minted for one room (`voice-agent token --room standup`), opened as the
    README says (room.html?token=...): the page sent its room box's value ("lobby" by
    default) and the join was refused 403 forbidden (found by review). The box now shows
    the token's room, read-only."""
    from signaling.auth import mint_token

    token = mint_token(ROOM_SECRET, ttl_s=600, room="standup")
    page = await (await one_browser.new_context()).new_page()
    page.set_default_timeout(10_000)
    await page.goto(f"{live_server.url}/room.html?token={token}")
    await page.set_checked("#speak", False)
    await page.click("#join")
    await page.wait_for_function(
        "() => ['connected', 'idle'].includes(document.getElementById('state').dataset.state)"
        " && (document.getElementById('state').dataset.state === 'connected'"
        " || !document.getElementById('alert').hidden)"
    )
    alert = await page.text_content("#alert")
    assert await page.get_attribute("#state", "data-state") == "connected", alert
    assert await page.input_value("#room-name") == "standup"
    assert await page.eval_on_selector("#room-name", "(box) => box.readOnly")
