"""End to end in headless Firefox: the page from the real server, a real WebRTC call.

The same calls as tests/test_browser.py makes in Chromium, through Firefox's own WebRTC
stack (its Opus encoder and decoder, its jitter buffer, its ICE and DTLS, its getStats()),
driven over WebDriver BiDi (tests/firefox.py). The server is the real application with the
ToneEngine (0.25 s of sine tone per word).

Headless Firefox here has no audio output device, so its WebAudio clock never runs (an
AudioContext stays "suspended"): what the pages play is read from getStats(), whose
inbound-rtp figures come from Firefox's decoder, not from an analyser.

Needs Firefox at /usr/bin/firefox-esr (``apt-get install -y firefox-esr``; .ci/run installs
it). Without it these tests are skipped, or fail when ``VOICE_AGENT_REQUIRE_BROWSER=1``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests import firefox
from tests.conftest import LiveServer
from tests.doubles import tone_frequency
from tests.test_browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    HAVE_CHROMIUM,
    INBOUND_JS,
    INTERRUPT_JS,
    QUIET_LEVEL,
    REQUIRE_BROWSER,
    SECONDS_PER_WORD,
    SILENCE_LEVEL,
    SPEECH_PROBE_JS,
    TRANSCRIPT_ITEM_JS,
    event_index,
    speaking_packet_rate,
    speaking_window,
    spoken_whole,
)
from tests.test_browser_room import TRACKS_JS, heard, write_tone

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

# Firefox's fake microphone (media.navigator.streams.fake) is a sine tone of this pitch.
FIREFOX_FAKE_TONE_HZ = 1000.0


@pytest.fixture
async def fox() -> AsyncIterator[firefox.Firefox]:
    if not firefox.HAVE_FIREFOX:
        message = (
            f"Firefox not found at {firefox.FIREFOX}: install it with "
            "`apt-get install -y firefox-esr` (.ci/run does) or point FIREFOX_PATH at one"
        )
        if REQUIRE_BROWSER:
            pytest.fail(message)
        pytest.skip(message)
    async with firefox.launch() as browser:
        yield browser


async def open_page(fox: firefox.Firefox, url: str) -> None:
    await fox.goto(url)
    await fox.wait_for("() => window.voiceAgent !== undefined || window.voiceRoom !== undefined")


async def connect(fox: firefox.Firefox, *, mic: bool = False) -> None:
    """The main page's Connect, clicked; waits for the call and for packets to flow."""
    await fox.evaluate("(mic) => { document.getElementById('mic').checked = mic; }", mic)
    await fox.click("#connect")
    await fox.wait_for("() => document.getElementById('state').dataset.state === 'connected'", 20)
    # The agent sends packets (silence) even while it has nothing to say.
    await fox.wait_for(
        f"async () => ((await ({INBOUND_JS})()) || {{}}).packetsReceived > 25", timeout=10
    )


async def say_in_ui(fox: firefox.Firefox, text: str) -> int:
    """Type ``text``, click Say; returns len(voiceAgent.events) before the click."""
    before = int(await fox.evaluate("() => window.voiceAgent.events.length"))
    await fox.fill("#text", text)
    await fox.click("#say")
    return before


async def events(fox: firefox.Firefox) -> list[dict[str, Any]]:
    return list(await fox.evaluate("() => window.voiceAgent.events"))


def console_errors(fox: firefox.Firefox) -> list[str]:
    # log.entryAdded: "javascript.error" is an uncaught exception, "console.error" a logged one.
    return [line for line in fox.log if line.split(":", 1)[0].endswith(".error")]


@pytest.mark.serial  # 50 packets/s and under 1% concealed: measured alone
async def test_firefox_says_a_sentence_through_the_ui(
    fox: firefox.Firefox, live_server: LiveServer
) -> None:
    await open_page(fox, live_server.url + "/")
    await connect(fox)
    before = await fox.evaluate(INBOUND_JS)
    assert (before.get("audioLevel") or 0.0) < SILENCE_LEVEL, f"sound before speech: {before}"

    sentence = "the quick brown fox jumps over the lazy dog and runs away"
    start_index = await say_in_ui(fox, sentence)
    probe = await fox.evaluate(
        SPEECH_PROBE_JS,
        {
            "fromIndex": start_index,
            "timeoutMs": 15_000,
            "intervalMs": 100,
            "tailMs": 300,
            "inbound": INBOUND_JS,
        },
        timeout=20,
    )
    assert probe["id"] is not None and probe["endedAt"] is not None, (
        f"no complete utterance: {await events(fox)}{fox.context()}"
    )
    uid = probe["id"]

    # Events in order for the page's own id, none of them an error.
    spoken_whole((await events(fox))[start_index:], uid)
    item = await fox.evaluate(TRANSCRIPT_ITEM_JS, uid)
    assert item == {"text": sentence, "status": "done"}, item

    # As long as the tone, at 50 packets/s, audible, (almost) nothing concealed.
    words = len(sentence.split())
    duration_s = (probe["endedAt"] - probe["startedAt"]) / 1000
    assert words * SECONDS_PER_WORD - 0.5 <= duration_s <= words * SECONDS_PER_WORD + 0.8
    first, last, packet_rate = speaking_packet_rate(probe)
    levels = [s.get("audioLevel") or 0.0 for s in speaking_window(probe, trim_ms=400)]
    assert levels and sum(level > SILENCE_LEVEL for level in levels) >= 0.8 * len(levels), levels
    received = last["totalSamplesReceived"] - first["totalSamplesReceived"]
    concealed = last["concealedSamples"] - first["concealedSamples"]
    assert received > 0 and concealed < 0.01 * received, (concealed, received)
    print(
        f"\nfirefox: {duration_s:.2f} s of speech, {packet_rate:.1f} packets/s, "
        f"concealed {concealed} of {received} samples"
    )

    # The page's once-a-second figures (what the plots draw) read Firefox's getStats() too.
    page_stats = await fox.evaluate("() => window.voiceAgent.stats")
    rates = [s["packetsPerSecond"] for s in page_stats if s.get("packetsPerSecond") is not None]
    assert any(40 <= r <= 60 for r in rates), page_stats
    assert any((s.get("bitrateKbps") or 0) > 0 for s in page_stats), page_stats
    for figure in ("packetsPerSecond", "bitrateKbps", "jitterMs", "jitterBufferMs", "rttMs"):
        shown = await fox.evaluate(f"() => document.getElementById('stat-{figure}').textContent")
        assert shown and shown != "—", (figure, shown, page_stats[-1])

    # Hang up: the server's session is gone, the page is back to closed with no alert.
    session_id = await fox.evaluate("() => window.voiceAgent.sessionId")
    await fox.click("#hangup")
    await fox.wait_for("() => document.getElementById('state').dataset.state === 'closed'")
    assert await fox.evaluate("() => window.voiceAgent.pc === null")
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{live_server.url}/sessions/{session_id}") as response,
    ):
        assert response.status == 404, await response.text()
    assert not await fox.evaluate("() => document.getElementById('alert').textContent.trim()")
    assert not console_errors(fox), fox.context()


@pytest.mark.serial  # silence within a second of the click: measured alone
async def test_firefox_interrupt_stops_speech(
    fox: firefox.Firefox, live_server: LiveServer
) -> None:
    await open_page(fox, live_server.url + "/")
    await connect(fox)
    start_index = await say_in_ui(fox, " ".join(["this sentence keeps going"] * 10))
    await fox.wait_for(
        f"async () => ((await ({INBOUND_JS})()) || {{}}).audioLevel > {SILENCE_LEVEL}", 5
    )
    uid = await fox.wait_for(
        f"() => (window.voiceAgent.events.slice({start_index})"
        ".find((e) => e.type === 'speech.started') || {}).id"
    )
    result = await fox.evaluate(
        INTERRUPT_JS, {"id": uid, "quiet": QUIET_LEVEL, "inbound": INBOUND_JS}, timeout=10
    )
    assert result["endedAt"] is not None and result["endedAt"] < 1000, result
    assert result["quietAt"] is not None and result["quietAt"] < 1000, result
    assert max(result["after"]) < SILENCE_LEVEL, f"sound came back after interrupt: {result}"
    evs = (await events(fox))[start_index:]
    assert evs[event_index(evs, "speech.ended", uid)]["interrupted"] is True, evs
    assert not console_errors(fox), fox.context()


async def session_figures(url: str, session_id: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/sessions/{session_id}") as response,
    ):
        assert response.status == 200, await response.text()
        figures: dict[str, Any] = await response.json()
        return figures


async def test_firefox_microphone_reaches_the_agent(
    fox: firefox.Firefox, live_server: LiveServer
) -> None:
    """Firefox's Opus from its (fake) microphone is received and decoded: the agent's
    listener counts 20 ms frames at the rate they are sent."""
    await open_page(fox, live_server.url + "/")
    await connect(fox, mic=True)
    session_id = await fox.evaluate("() => window.voiceAgent.sessionId")
    await fox.wait_for(
        "() => window.voiceAgent.micTrack && window.voiceAgent.micTrack.readyState === 'live'"
    )
    first = (await session_figures(live_server.url, session_id))["inbound"]
    assert first is not None, "a microphone call has no listener"
    started = time.monotonic()
    await asyncio.sleep(2.0)
    last = (await session_figures(live_server.url, session_id))["inbound"]
    rate = (last["frames"] - first["frames"]) / (time.monotonic() - started)
    assert 40 <= rate <= 60, (first, last, rate)
    assert last["windows"] > first["windows"], (first, last)  # the voice detector ran on it
    assert not console_errors(fox), fox.context()


# Each received track's audioLevel from its receiver's own getStats() (index 0 = the agent).
ROOM_LEVELS_JS = """
async () => {
  const pc = window.voiceRoom.call.pc;
  if (!pc) return [];
  const levels = [];
  for (const t of pc.getTransceivers()) {
    let level = null;
    (await t.receiver.getStats()).forEach((s) => {
      if (s.type === 'inbound-rtp') level = s.audioLevel || 0;
    });
    levels.push(level);
  }
  return levels;
}
"""


async def test_firefox_and_chromium_hear_each_other_and_the_agent_in_a_room(
    fox: firefox.Firefox, live_server: LiveServer, tmp_path: Path
) -> None:
    if not HAVE_CHROMIUM:
        if REQUIRE_BROWSER:
            pytest.fail(f"Chromium not found at {CHROMIUM}")
        pytest.skip(f"Chromium not found at {CHROMIUM}")
    from playwright.async_api import async_playwright

    ann_hz = 800.0
    wav = tmp_path / "ann.wav"
    write_tone(wav, ann_hz)
    text = "one two three four five six seven eight nine ten eleven twelve"
    agent_hz = tone_frequency(text)
    room_url = f"{live_server.url}/room.html?room=mixed&processing=off"
    await open_page(fox, room_url + "&name=fox")
    await fox.click("#join")
    await fox.wait_for("() => document.getElementById('state').dataset.state === 'connected'", 20)
    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[*CHROMIUM_ARGS, f"--use-file-for-fake-audio-capture={wav}"],
        )
        try:
            ann = await (await chromium.new_context()).new_page()
            ann.set_default_timeout(20_000)
            await ann.goto(room_url + "&name=ann")
            await ann.click("#join")
            await ann.wait_for_selector('#state[data-state="connected"]')
            for who in ("ann", "fox"):
                await ann.wait_for_function(
                    f"() => document.getElementById('people').textContent.includes('{who}')"
                )
            await fox.wait_for(
                "() => document.getElementById('people').textContent.includes('ann')"
            )
            await ann.fill("#text", text)
            await ann.click("#say")

            # ann (Chromium, analysers): the agent on track 0, Firefox's tone on a slot.
            # fox (Firefox, getStats): the agent on track 0 and ann's voice on a slot.
            ann_heard: set[float] = set()
            fox_loud: set[int] = set()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                tracks = await ann.evaluate(TRACKS_JS)
                if heard(tracks, agent_hz) == [0]:
                    ann_heard.add(agent_hz)
                if [i for i in heard(tracks, FIREFOX_FAKE_TONE_HZ) if i >= 1]:
                    ann_heard.add(FIREFOX_FAKE_TONE_HZ)
                levels = await fox.evaluate(ROOM_LEVELS_JS)
                fox_loud |= {i for i, level in enumerate(levels) if (level or 0) > SILENCE_LEVEL}
                if (
                    ann_heard == {agent_hz, FIREFOX_FAKE_TONE_HZ}
                    and 0 in fox_loud
                    and any(i >= 1 for i in fox_loud)
                ):
                    break
                await asyncio.sleep(0.2)
            assert ann_heard == {agent_hz, FIREFOX_FAKE_TONE_HZ}, (ann_heard, tracks)
            assert 0 in fox_loud and any(i >= 1 for i in fox_loud), (fox_loud, fox.context())
        finally:
            await chromium.close()
    assert not console_errors(fox), fox.context()
