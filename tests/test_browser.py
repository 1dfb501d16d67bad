"""End to end in headless Chromium: the page from the real server, a real WebRTC call.

The `live_server` fixture (tests/conftest.py) runs the aiohttp application on a localhost
port with a ToneEngine that speaks every text as a sine tone, 0.25 s per word. The browser
loads static/ from it, connects through the UI, says things through the UI and reads
``RTCPeerConnection.getStats()`` while the agent speaks.

Needs Chromium at /usr/bin/chromium (Debian: ``apt-get install -y chromium``; .ci/run
installs it; CHROMIUM_PATH overrides the path) and the ``playwright`` Python package;
Playwright's own browser download (``playwright install``) is never used. Without them
these tests are skipped, or fail when ``VOICE_AGENT_REQUIRE_BROWSER=1`` (set it in CI so
that a missing browser cannot pass silently). Run with ``pytest -s`` to see the measured
figures.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
HAVE_CHROMIUM = os.path.exists(CHROMIUM)
REQUIRE_BROWSER = os.environ.get("VOICE_AGENT_REQUIRE_BROWSER") == "1"

# Shared NOTES.md: the flags measured to work headless on these machines.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
]

SECONDS_PER_WORD = 0.25  # ToneEngine's default
SILENCE_LEVEL = 0.01  # inbound-rtp audioLevel (linear, 0..1) above this counts as sound
QUIET_LEVEL = 0.005  # "back to ~0" after an interrupt

pytestmark = [pytest.mark.browser, pytest.mark.timeout(90)]

try:
    from playwright.async_api import Browser, Page, async_playwright
    from playwright.async_api import TimeoutError as PlaywrightTimeout
except ImportError:  # pragma: no cover - depends on the machine
    if REQUIRE_BROWSER:
        raise
    pytest.skip(
        "the playwright Python package is not installed (pip install playwright; "
        "no `playwright install` needed: the tests drive the system Chromium)",
        allow_module_level=True,
    )


# ---------------------------------------------------------------------------------------
# Fixtures


@pytest_asyncio.fixture
async def browser() -> AsyncIterator[Browser]:
    if not HAVE_CHROMIUM:
        message = (
            f"Chromium not found at {CHROMIUM}: install it with `apt-get install -y chromium` "
            "(.ci/run does) or point CHROMIUM_PATH at a Chromium/Chrome binary"
        )
        if REQUIRE_BROWSER:
            pytest.fail(message)
        pytest.skip(message)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield browser
        finally:
            await browser.close()


@dataclass
class AgentPage:
    page: Page
    log: list[str] = field(default_factory=list)

    def page_errors(self) -> list[str]:
        return [line for line in self.log if line.startswith("pageerror")]

    def context(self) -> str:
        return "\nbrowser log:\n" + "\n".join(self.log[-40:])


async def open_agent_page(context: Any, url: str) -> AgentPage:
    """The main page of the server at ``url`` in a new page of ``context``, its console kept."""
    page = await context.new_page()
    page.set_default_timeout(15_000)
    result = AgentPage(page)
    page.on("console", lambda m: result.log.append(f"console.{m.type}: {m.text}"))
    page.on("pageerror", lambda e: result.log.append(f"pageerror: {e}"))
    await page.goto(url + "/")
    await page.wait_for_function("() => window.voiceAgent !== undefined")
    return result


@contextlib.asynccontextmanager
async def page_hearing(url: str, wav: Path) -> AsyncIterator[AgentPage]:
    """The main page of the server at ``url`` in a Chromium whose microphone plays ``wav``
    (once) from the moment the call opens it."""
    args = [*CHROMIUM_ARGS, f"--use-file-for-fake-audio-capture={wav}%noloop"]
    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            yield await open_agent_page(chromium, url)
        finally:
            await chromium.close()


@pytest_asyncio.fixture
async def agent_page(browser: Browser, live_server: Any) -> AsyncIterator[AgentPage]:
    context = await browser.new_context()
    try:
        yield await open_agent_page(context, live_server.url)
    finally:
        await context.close()


# ---------------------------------------------------------------------------------------
# Page-side helpers (JavaScript run in the page)

# The audio inbound-rtp stats object, or null.
INBOUND_JS = """
async () => {
  const pc = window.voiceAgent.pc;
  if (!pc) return null;
  const report = await pc.getStats();
  let s = null;
  report.forEach((x) => { if (x.type === 'inbound-rtp' && x.kind === 'audio') s = x; });
  return s ? {...s} : null;
}
"""

# Polls the inbound stats every 20 ms until predicate(stats) holds; the stats, or null.
WAIT_INBOUND_JS = """
async ({predicate, timeoutMs, inbound}) => {
  const getInbound = eval(inbound);
  const test = eval(predicate);
  const t0 = performance.now();
  while (performance.now() - t0 < timeoutMs) {
    const s = await getInbound();
    if (s && test(s)) return s;
    await new Promise((r) => setTimeout(r, 20));
  }
  return null;
}
"""

# Polls the inbound stats every `intervalMs` while the agent speaks the first utterance that
# starts after events[fromIndex]; stops `tailMs` after its speech.ended. Times are ms from
# the start of the probe.
SPEECH_PROBE_JS = """
async ({fromIndex, timeoutMs, intervalMs, tailMs, inbound}) => {
  const va = window.voiceAgent;
  const getInbound = eval(inbound);
  const t0 = performance.now();
  const samples = [];
  let id = null, startedAt = null, endedAt = null;
  while (performance.now() - t0 < timeoutMs) {
    const events = va.events.slice(fromIndex);
    if (id === null) {
      const started = events.find((e) => e.type === 'speech.started');
      if (started) { id = started.id; startedAt = performance.now() - t0; }
    }
    if (id !== null && endedAt === null &&
        events.some((e) => e.type === 'speech.ended' && e.id === id)) {
      endedAt = performance.now() - t0;
    }
    const stats = await getInbound();
    samples.push({t: performance.now() - t0, stats});
    if (endedAt !== null && performance.now() - t0 - endedAt >= tailMs) break;
    await new Promise((r) => setTimeout(r, intervalMs));
  }
  return {id, startedAt, endedAt, samples};
}
"""

# Clicks Interrupt, then times speech.ended for `id` and the level falling to `quiet`;
# then samples the level for another second (nothing queued may play on).
INTERRUPT_JS = """
async ({id, quiet, inbound}) => {
  const va = window.voiceAgent;
  const getInbound = eval(inbound);
  const level = async () => ((await getInbound()) || {}).audioLevel || 0;
  const ended = () => va.events.some((e) => e.type === 'speech.ended' && e.id === id);
  document.getElementById('interrupt').click();
  const t0 = performance.now();
  let endedAt = null, quietAt = null;
  const levels = [];
  while (performance.now() - t0 < 5000 && (endedAt === null || quietAt === null)) {
    if (endedAt === null && ended()) endedAt = performance.now() - t0;
    const l = await level();
    levels.push([Math.round(performance.now() - t0), l]);
    if (quietAt === null && l < quiet) quietAt = performance.now() - t0;
    await new Promise((r) => setTimeout(r, 20));
  }
  const after = [];
  for (let i = 0; i < 10; i++) {
    await new Promise((r) => setTimeout(r, 100));
    after.push(await level());
  }
  return {endedAt, quietAt, levels, after};
}
"""

TRANSCRIPT_ITEM_JS = """
(id) => {
  const items = [...document.querySelectorAll('#transcript li')];
  const li = items.find((el) => el.dataset.id === id);
  if (!li) return null;
  return {text: li.querySelector('.text').textContent, status: li.dataset.status};
}
"""


async def wait_for_inbound(
    ap: AgentPage, predicate: str, timeout_s: float
) -> dict[str, Any] | None:
    """Poll the audio inbound-rtp stats until `predicate` (a JS function of them) holds."""
    arg = {"predicate": predicate, "timeoutMs": timeout_s * 1000, "inbound": INBOUND_JS}
    result: dict[str, Any] | None = await ap.page.evaluate(WAIT_INBOUND_JS, arg)
    return result


async def connect(ap: AgentPage, *, mic: bool = False) -> None:
    """Click Connect; wait for the connected state and for audio packets to flow.

    Without ``mic`` the call is listen-only: Chromium's fake microphone beeps, and the agent
    would hear it.
    """
    await ap.page.set_checked("#mic", mic)
    await ap.page.click("#connect")
    try:
        await ap.page.wait_for_selector('#state[data-state="connected"]', timeout=20_000)
    except PlaywrightTimeout as exc:
        state = await ap.page.text_content("#state")
        alert = await ap.page.text_content("#alert")
        raise AssertionError(
            f"not connected: state={state!r} alert={alert!r}{ap.context()}"
        ) from exc
    # The agent sends packets (silence) even while it has nothing to say.
    packets = await wait_for_inbound(ap, "(s) => (s.packetsReceived || 0) > 25", timeout_s=10)
    assert packets is not None, f"no audio packets after connecting{ap.context()}"


async def say_in_ui(ap: AgentPage, text: str) -> int:
    """Type `text`, click Say; returns len(voiceAgent.events) before the click."""
    before = int(await ap.page.evaluate("() => window.voiceAgent.events.length"))
    await ap.page.fill("#text", text)
    await ap.page.click("#say")
    return before


async def events(ap: AgentPage) -> list[dict[str, Any]]:
    return list(await ap.page.evaluate("() => window.voiceAgent.events"))


async def probe_speech(ap: AgentPage, from_index: int, timeout_s: float) -> dict[str, Any]:
    """Stats sampled every 100 ms over the next utterance (see SPEECH_PROBE_JS)."""
    arg = {
        "fromIndex": from_index,
        "timeoutMs": timeout_s * 1000,
        "intervalMs": 100,
        "tailMs": 300,
        "inbound": INBOUND_JS,
    }
    probe: dict[str, Any] = await ap.page.evaluate(SPEECH_PROBE_JS, arg)
    if probe["id"] is None or probe["endedAt"] is None:
        what = "speech.started" if probe["id"] is None else "speech.ended"
        raise AssertionError(f"no {what} within {timeout_s} s: {await events(ap)}{ap.context()}")
    return probe


def speaking_packet_rate(
    probe: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], float]:
    """The first and last stats samples taken while the agent spoke (at least 10, over 2 s
    or more) and the packets per second between them, checked to be 45-55."""
    window = speaking_window(probe, trim_ms=0)
    assert len(window) >= 10, probe["samples"]
    first, last = window[0], window[-1]
    seconds = (last["timestamp"] - first["timestamp"]) / 1000
    assert seconds >= 2.0, (seconds, probe)
    packet_rate = (last["packetsReceived"] - first["packetsReceived"]) / seconds
    assert 45 <= packet_rate <= 55, f"{packet_rate:.1f} packets/s over {seconds:.2f} s"
    return first, last, packet_rate


def speaking_window(probe: dict[str, Any], trim_ms: float) -> list[dict[str, Any]]:
    """Stats samples taken while the agent was speaking, trimmed by `trim_ms` at both ends."""
    lo = probe["startedAt"] + trim_ms
    hi = probe["endedAt"] - trim_ms
    return [s["stats"] for s in probe["samples"] if s["stats"] and lo <= s["t"] <= hi]


def spoken_whole(evs: list[dict[str, Any]], uid: str) -> tuple[int, int]:
    """The indexes of ``uid``'s speech.started and speech.ended, checked: in that order, not
    interrupted, and no error among ``evs``."""
    i_started = event_index(evs, "speech.started", uid)
    i_ended = event_index(evs, "speech.ended", uid)
    assert i_started < i_ended, evs
    assert evs[i_ended]["interrupted"] is False, evs[i_ended]
    assert not [e for e in evs if e.get("type") == "error"], evs
    return i_started, i_ended


def event_index(evs: list[dict[str, Any]], type_: str, id_: str) -> int:
    for i, e in enumerate(evs):
        if e.get("type") == type_ and e.get("id") == id_:
            return i
    raise AssertionError(f"no {type_} for {id_!r} in {json.dumps(evs)}")


async def transcript_item(ap: AgentPage, id_: str) -> dict[str, Any] | None:
    item: dict[str, Any] | None = await ap.page.evaluate(TRANSCRIPT_ITEM_JS, id_)
    return item


# ---------------------------------------------------------------------------------------
# Tests


@pytest.mark.serial  # 50 packets/s and under 1% concealed: measured alone
async def test_says_a_sentence_through_the_ui(agent_page: AgentPage) -> None:
    ap = agent_page
    await connect(ap)

    before = await ap.page.evaluate(INBOUND_JS)
    assert (before.get("audioLevel") or 0.0) < SILENCE_LEVEL, f"sound before speech: {before}"

    sentence = "the quick brown fox jumps over the lazy dog and runs away"
    words = len(sentence.split())
    assert words == 12
    start_index = await say_in_ui(ap, sentence)
    probe = await probe_speech(ap, start_index, timeout_s=15)
    uid = probe["id"]

    # Events: speech.started, then speech.ended (not interrupted) for the client's id;
    # captions, if any, in between.
    evs = (await events(ap))[start_index:]
    i_started, i_ended = spoken_whole(evs, uid)
    for i, e in enumerate(evs):
        if e.get("type") == "speech.segment" and e.get("id") == uid:
            assert i_started < i < i_ended, evs
            assert e["text"].strip() in sentence, e

    # The transcript shows the sentence under the id the page sent (the server echoed it).
    item = await transcript_item(ap, uid)
    assert item is not None, f"no transcript item for {uid!r}"
    assert item["text"] == sentence, f"transcript item {item!r}: server did not echo our id?"
    assert item["status"] == "done", item
    assert sentence in (await ap.page.text_content("#transcript") or "")

    # Speech lasts as long as the tone (0.25 s per word), give or take event timing.
    duration_s = (probe["endedAt"] - probe["startedAt"]) / 1000
    expected_s = words * SECONDS_PER_WORD
    assert expected_s - 0.5 <= duration_s <= expected_s + 0.8, (duration_s, expected_s)

    # getStats over the speech: 50 packets/s, sound, (almost) nothing concealed.
    first, last, packet_rate = speaking_packet_rate(probe)

    levels = [s.get("audioLevel") or 0.0 for s in speaking_window(probe, trim_ms=400)]
    assert levels, probe["samples"]
    loud = sum(level > SILENCE_LEVEL for level in levels) / len(levels)
    median = sorted(levels)[len(levels) // 2]
    assert loud >= 0.8, f"audioLevel above {SILENCE_LEVEL} in only {loud:.0%}: {levels}"

    received = last["totalSamplesReceived"] - first["totalSamplesReceived"]
    concealed = last["concealedSamples"] - first["concealedSamples"]
    assert received > 0, (first, last)
    assert concealed < 0.01 * received, f"{concealed} of {received} samples concealed"
    print(
        f"\nspeech: {duration_s:.2f} s for {expected_s:.2f} s of tone, "
        f"{packet_rate:.1f} packets/s, audible in {loud:.0%} of {len(levels)} samples "
        f"(median level {median:.3f}), concealed {concealed} of {received} samples"
    )

    # The page's own once-a-second samples (what the plots draw) saw the same stream.
    page_stats = await ap.page.evaluate("() => window.voiceAgent.stats")
    rates = [s["packetsPerSecond"] for s in page_stats if s.get("packetsPerSecond") is not None]
    assert any(40 <= r <= 60 for r in rates), page_stats
    assert any((s.get("bitrateKbps") or 0) > 0 for s in page_stats), page_stats
    assert (await ap.page.text_content("#stat-packetsPerSecond")) != "—"

    assert not ap.page_errors(), ap.context()

    # Hang up: the server is told first (DELETE /sessions/{id} -> 204), then the call closes.
    session_id = await ap.page.evaluate("() => window.voiceAgent.sessionId")
    assert session_id, "no session_id from POST /offer"
    async with ap.page.expect_response(lambda r: r.request.method == "DELETE") as deleted:
        await ap.page.click("#hangup")
    response = await deleted.value
    assert response.url.endswith(f"/sessions/{session_id}"), response.url
    assert response.status == 204, (response.status, await response.text())
    await ap.page.wait_for_selector('#state[data-state="closed"]')
    assert await ap.page.evaluate("() => window.voiceAgent.pc === null")
    assert not await ap.page.is_visible("#alert"), await ap.page.text_content("#alert")
    console_errors = [line for line in ap.log if line.startswith("console.error")]
    assert not console_errors, ap.context()


@pytest.mark.serial  # silence within a second of the click: measured alone
async def test_interrupt_stops_speech(agent_page: AgentPage) -> None:
    ap = agent_page
    await connect(ap)

    long_text = " ".join(["this sentence keeps going for a long while"] * 5)  # 40 words: 10 s
    start_index = await say_in_ui(ap, long_text)
    loud = await wait_for_inbound(ap, f"(s) => (s.audioLevel || 0) > {SILENCE_LEVEL}", 5)
    assert loud is not None, f"the agent never became audible: {await events(ap)}{ap.context()}"
    uid = await ap.page.evaluate(
        """async (n) => {
          for (let i = 0; i < 100; i++) {
            const e = window.voiceAgent.events.slice(n).find((e) => e.type === 'speech.started');
            if (e) return e.id;
            await new Promise((r) => setTimeout(r, 20));
          }
          return null;
        }""",
        start_index,
    )
    assert uid is not None, f"audible but no speech.started: {await events(ap)}"

    result = await ap.page.evaluate(
        INTERRUPT_JS, {"id": uid, "quiet": QUIET_LEVEL, "inbound": INBOUND_JS}
    )
    print(
        f"\ninterrupt: speech.ended after {result['endedAt']:.0f} ms, "
        f"audioLevel < {QUIET_LEVEL} after {result['quietAt']:.0f} ms"
    )
    assert result["endedAt"] is not None, f"no speech.ended after interrupt: {await events(ap)}"
    assert result["endedAt"] < 1000, result
    assert result["quietAt"] is not None, f"still audible 5 s after interrupt: {result}"
    assert result["quietAt"] < 1000, f"audible for {result['quietAt']:.0f} ms: {result}"
    assert max(result["after"]) < SILENCE_LEVEL, f"sound came back after interrupt: {result}"

    evs = (await events(ap))[start_index:]
    i_started = event_index(evs, "speech.started", uid)
    i_ended = event_index(evs, "speech.ended", uid)
    assert i_started < i_ended, evs
    assert evs[i_ended]["interrupted"] is True, evs[i_ended]
    item = await transcript_item(ap, uid)
    assert item is not None and item["status"] == "interrupted", item

    # The session goes on: the next sentence is spoken in full.
    next_index = await say_in_ui(ap, "still here")
    probe = await probe_speech(ap, next_index, timeout_s=10)
    evs = (await events(ap))[next_index:]
    assert evs[event_index(evs, "speech.ended", probe["id"])]["interrupted"] is False, evs
    assert not ap.page_errors(), ap.context()


async def test_unknown_type_shows_error_and_session_lives_on(agent_page: AgentPage) -> None:
    ap = agent_page
    await connect(ap)

    before = await ap.page.evaluate("() => window.voiceAgent.events.length")
    await ap.page.evaluate("() => window.voiceAgent.channel.send(JSON.stringify({type: 'nope'}))")
    await ap.page.wait_for_function(
        "(n) => window.voiceAgent.events.slice(n).some((e) => e.type === 'error')",
        arg=before,
        timeout=5_000,
    )
    errors = [e for e in (await events(ap))[before:] if e.get("type") == "error"]
    assert errors[0]["code"] == "unknown_type", errors
    assert isinstance(errors[0].get("message"), str) and errors[0]["message"], errors

    # Shown to the user: an alert and a row in the transcript.
    assert await ap.page.is_visible("#alert")
    assert "unknown_type" in (await ap.page.text_content("#alert") or "")
    assert await ap.page.is_visible('#transcript li[data-code="unknown_type"]')
    assert await ap.page.get_attribute("#state", "data-state") == "connected"

    # And the agent still speaks.
    sentence = "still speaking after an error"
    start_index = await say_in_ui(ap, sentence)
    probe = await probe_speech(ap, start_index, timeout_s=10)
    evs = (await events(ap))[start_index:]
    assert evs[event_index(evs, "speech.ended", probe["id"])]["interrupted"] is False, evs
    levels = [s.get("audioLevel") or 0.0 for s in speaking_window(probe, trim_ms=200)]
    assert any(level > SILENCE_LEVEL for level in levels), levels
    item = await transcript_item(ap, probe["id"])
    assert item == {"text": sentence, "status": "done"}, item
    assert not ap.page_errors(), ap.context()


async def wait_for_no_session(live_server: Any, timeout_s: float = 3.0) -> None:
    """The server's session table empties within `timeout_s` (well before its own 20 s
    connect timeout would drop a session nobody connected to)."""
    import asyncio

    from signaling.keys import SESSIONS

    registry = live_server.app[SESSIONS]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(registry) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert len(registry) == 0, f"{len(registry)} session(s) left on the server"


async def test_a_failed_offer_is_shown_and_leaves_no_session_behind(
    agent_page: AgentPage, live_server: Any
) -> None:
    """A JSON error from POST /offer reaches the user (a route answers for the server), with
    its Retry-After as when to try again (server_full and the like said only "full"). A
    call that ends or fails after the server made its session (Hang up while the answer is
    on its way; an answer the browser cannot apply) deletes that session: it used to hold
    a seat, counted against --max-sessions, until the server's connect timeout."""
    import asyncio

    ap = agent_page
    body = {"error": {"code": "server_full", "message": "the server is full"}}

    async def refuse(route: Any) -> None:
        await route.fulfill(
            status=503,
            content_type="application/json",
            body=json.dumps(body),
            headers={"Retry-After": "7"},
        )

    await ap.page.route("**/offer", refuse)
    await ap.page.set_checked("#mic", False)
    await ap.page.click("#connect")
    await ap.page.wait_for_selector('#state[data-state="failed"]')
    alert = await ap.page.text_content("#alert") or ""
    assert "server_full" in alert and "the server is full" in alert, alert
    assert "retry in 7 s" in alert, alert  # from Retry-After (the message did not say when)
    assert await ap.page.is_enabled("#connect")
    assert await ap.page.evaluate("() => window.voiceAgent.pc === null")
    await ap.page.unroute("**/offer")

    # Hang up while the server's answer is on its way: the page never learnt the session's
    # id, so the answer itself must end it.
    answered = asyncio.Event()
    release = asyncio.Event()

    async def hold_answer(route: Any) -> None:
        response = await route.fetch()  # the server made the session
        answered.set()
        await release.wait()
        await route.fulfill(response=response)

    await ap.page.route("**/offer", hold_answer)
    await ap.page.click("#connect")
    await asyncio.wait_for(answered.wait(), 10)
    await ap.page.click("#hangup")
    release.set()
    await ap.page.wait_for_selector('#state[data-state="closed"]')
    await wait_for_no_session(live_server)
    await ap.page.unroute("**/offer")

    # An answer the browser refuses (the connection never comes up; the page's own connect
    # timeout ends the same way): the call fails and its session goes.
    async def unusable_answer(route: Any) -> None:
        response = await route.fetch()
        answer = {**await response.json(), "sdp": "v=0\r\nnot an answer\r\n"}
        await route.fulfill(response=response, body=json.dumps(answer))

    await ap.page.route("**/offer", unusable_answer)
    await ap.page.click("#connect")
    await ap.page.wait_for_selector('#state[data-state="failed"]')
    await wait_for_no_session(live_server)

    # A retry against the real server works.
    await ap.page.unroute("**/offer")
    await connect(ap)
    assert not ap.page_errors(), ap.context()


async def test_text_said_over_http_appears_in_transcript(
    agent_page: AgentPage, live_server: Any
) -> None:
    """POST /sessions/{id}/say: the page never saw the text; captions fill the transcript."""
    ap = agent_page
    await connect(ap)
    session_id = await ap.page.evaluate("() => window.voiceAgent.sessionId")
    before = int(await ap.page.evaluate("() => window.voiceAgent.events.length"))

    text = "Spoken on behalf of the server. Two sentences."
    response = await ap.page.request.post(
        f"{live_server.url}/sessions/{session_id}/say", data={"text": text}
    )
    assert response.status == 202, (response.status, await response.text())
    uid = (await response.json())["id"]

    probe = await probe_speech(ap, before, timeout_s=10)
    assert probe["id"] == uid, (probe["id"], uid)
    evs = (await events(ap))[before:]
    assert evs[event_index(evs, "speech.ended", uid)]["interrupted"] is False, evs
    captions = [e["text"] for e in evs if e.get("type") == "speech.segment" and e["id"] == uid]
    # The page knew no text for this id: the transcript is built from the captions.
    item = await transcript_item(ap, uid)
    assert item is not None and item["status"] == "done", item
    assert captions, f"no speech.segment captions: {evs}"
    assert " ".join(item["text"].split()) == text, (item, captions)
    assert not ap.page_errors(), ap.context()


async def test_ask_puts_a_question_to_the_brain_and_shows_both_sides(
    agent_page: AgentPage,
) -> None:
    """Ask sends `chat` (the page had only Say, which speaks the text as it is): the typed
    question is the user's item, the brain's spoken answer (the echo brain here: the
    question back) the agent's, built from its captions."""
    ap = agent_page
    await connect(ap)
    before = int(await ap.page.evaluate("() => window.voiceAgent.events.length"))
    question = "What is the capital of France?"
    await ap.page.fill("#text", question)
    await ap.page.click("#ask")
    assert await ap.page.input_value("#text") == ""
    probe = await probe_speech(ap, before, timeout_s=10)
    reply_id = probe["id"]
    assert str(reply_id).startswith("reply-"), probe
    await ap.page.wait_for_function(
        "(id) => document.querySelector(`#transcript li[data-id='${id}']`)?.dataset.status"
        " === 'done'",
        arg=reply_id,
    )
    items = await ap.page.evaluate(
        "() => [...document.querySelectorAll('#transcript li')].map((li) => ({"
        " role: li.dataset.role ?? 'agent', text: li.querySelector('.text').textContent }))"
    )
    assert items[-2:] == [
        {"role": "user", "text": question},
        {"role": "agent", "text": question},
    ], items
    assert not ap.page_errors(), ap.context()


def unreachable_llm_config() -> Any:
    from agent.config import Config, ServiceSettings

    # Nothing listens on the discard port of loopback: every reply fails at once (llm_failed).
    services = ServiceSettings(llm_base_url="http://127.0.0.1:9/v1", llm_timeout_s=5.0)
    return Config(host="127.0.0.1", port=0, services=services)


@pytest.mark.parametrize("server_config", [unreachable_llm_config()], ids=["no_llm"])
async def test_an_ask_whose_reply_fails_marks_its_question(agent_page: AgentPage) -> None:
    """A reply's error carried only the reply's id, which the page had never seen (the reply
    failed before it spoke): the question stood as if an answer were coming. The error now
    names what it answers (``reply_to``: the chat's id), and the page marks the question."""
    ap = agent_page
    await connect(ap)
    await ap.page.fill("#text", "is anyone there?")
    await ap.page.click("#ask")
    await ap.page.wait_for_function(
        "() => window.voiceAgent.events.some((e) => e.type === 'error')", timeout=10_000
    )
    (failed,) = [e for e in await events(ap) if e.get("type") == "error"]
    assert failed["code"] == "llm_failed" and failed["id"].startswith("reply-"), failed
    assert failed["reply_to"].startswith("asked-"), failed
    item = await transcript_item(ap, failed["reply_to"])
    assert item == {"text": "is anyone there?", "status": "error"}, item
    badge = f'#transcript li[data-id="{failed["reply_to"]}"] .badge'
    assert await ap.page.text_content(badge) == "llm_failed"
    assert not ap.page_errors(), ap.context()


async def test_page_passes_its_url_token_to_an_auth_server(browser: Browser) -> None:
    """`/?token=...`: the page sends the token with every request; without one, 401 is shown."""
    import jwt

    from agent.config import Config, SecuritySettings
    from tests.conftest import serve
    from tests.doubles import ToneEngine

    secret = "browser-test-secret-0123456789abcdef"
    config = Config(host="127.0.0.1", security=SecuritySettings(auth_secret=secret))
    token = jwt.encode({"exp": 2**31 - 1, "room": "lobby"}, secret, algorithm="HS256")
    async with serve(config, ToneEngine()) as server:
        context = await browser.new_context()
        try:
            page = await context.new_page()
            page.set_default_timeout(15_000)
            ap = AgentPage(page)
            page.on("console", lambda m: ap.log.append(f"console.{m.type}: {m.text}"))
            page.on("pageerror", lambda e: ap.log.append(f"pageerror: {e}"))

            await page.goto(server.url + "/")
            await page.click("#connect")
            await page.wait_for_selector('#state[data-state="failed"]')
            alert = await page.text_content("#alert") or ""
            assert "unauthorized" in alert, alert

            await page.goto(f"{server.url}/?token={token}")
            await page.wait_for_function("() => window.voiceAgent !== undefined")
            await connect(ap)
            before = await say_in_ui(ap, "Token accepted.")
            probe = await probe_speech(ap, before, timeout_s=10)
            assert probe["endedAt"] is not None, probe
            session_id = await page.evaluate("() => window.voiceAgent.sessionId")
            async with page.expect_response(lambda r: r.request.method == "DELETE") as deleted:
                await page.click("#hangup")
            response = await deleted.value
            assert response.url.endswith(f"/sessions/{session_id}"), response.url
            assert response.status == 204, (response.status, await response.text())
            assert not ap.page_errors(), ap.context()
        finally:
            await context.close()


def no_barge_in_config() -> Any:
    from agent.config import Config
    from agent.conversation_config import ListenSettings

    return Config(host="127.0.0.1", port=0, listen=ListenSettings(barge_in=False))


async def wait_for_barge_in(peer: Any, expected: bool, timeout_s: float = 3.0) -> None:
    """The session's barge-in setting becomes `expected` (a `config` on its way)."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while peer.session.conversation.barge_in is not expected and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert peer.session.conversation.barge_in is expected, "the Barge-in box is not the session's"


# On a --no-barge-in server: the page's ticked Barge-in box is what counts, also after a resume.
@pytest.mark.parametrize("server_config", [no_barge_in_config()], ids=["no_barge_in"])
async def test_the_page_resumes_its_session_and_its_settings_and_gives_up_once_it_is_gone(
    agent_page: AgentPage, live_server: Any
) -> None:
    """The server loses the page's connection (as its RTCP check does for a client that went
    quiet): the page resumes the same session on a new connection by itself, with the
    Barge-in box as it is now (ticked while the call was down: it used to be sent only while
    the channel was open, and only when unticked, so the server's default stood). Once the
    session is gone for good, the page gives up and what was being said is cut off, not left
    "speaking"."""
    import asyncio

    from signaling.keys import SESSIONS

    ap = agent_page
    await connect(ap)
    session_id = await ap.page.evaluate("() => window.voiceAgent.sessionId")
    registry = live_server.app[SESSIONS]
    peer = registry.get(session_id)
    assert await ap.page.is_checked("#barge-in")
    await wait_for_barge_in(peer, True)  # the box, not the server's default
    await ap.page.set_checked("#barge-in", False)  # sent at once: the channel is open
    await wait_for_barge_in(peer, False)

    ticked = asyncio.Event()

    async def resume_once_ticked(route: Any) -> None:
        await ticked.wait()
        await route.continue_()

    await ap.page.route("**/offer", resume_once_ticked)
    old_pc = peer.pc
    await registry._lose(peer, old_pc)  # the connection is closed, the session detached
    await ap.page.wait_for_function("() => window.voiceAgent.state !== 'connected'")
    await ap.page.set_checked("#barge-in", True)  # while the call is down
    ticked.set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while not (peer.pc is not old_pc and peer.pc.connectionState == "connected"):
        assert loop.time() < deadline, f"the page did not resume{ap.context()}"
        await asyncio.sleep(0.1)
    await ap.page.wait_for_selector('#state[data-state="connected"]', timeout=20_000)
    await ap.page.unroute("**/offer")
    assert await ap.page.evaluate("() => window.voiceAgent.sessionId") == session_id
    assert len(registry) == 1
    await wait_for_barge_in(peer, True)
    before = await say_in_ui(ap, "Back on a new connection.")
    probe = await probe_speech(ap, before, timeout_s=10)
    assert probe["endedAt"] is not None, probe

    # The session goes (e.g. the server restarted) mid-sentence: the resume gets 404.
    await say_in_ui(ap, "one two three four five six seven eight nine ten eleven twelve")
    await ap.page.wait_for_selector('#transcript li[data-status="speaking"]')
    await registry.close(session_id)
    await ap.page.wait_for_selector('#state[data-state="failed"]', timeout=20_000)
    statuses = await ap.page.evaluate(
        "() => [...document.querySelectorAll('#transcript li')]"
        ".map((li) => [li.dataset.status, li.querySelector('.badge').textContent])"
    )
    assert statuses[-1] == ["interrupted", "cut off"], statuses
    assert not ap.page_errors(), ap.context()


async def test_a_resume_refused_for_its_token_is_not_tried_again(
    agent_page: AgentPage, live_server: Any
) -> None:
    """A resume refused 401 (the page's token expired during the call) or 403 was tried
    twice more, seconds apart, though no try could succeed (found by review): only a
    session gone (404/410) stopped the tries. The page now gives up at the first, and says
    why."""
    from signaling.keys import SESSIONS

    ap = agent_page
    await connect(ap)
    registry = live_server.app[SESSIONS]
    peer = registry.get(await ap.page.evaluate("() => window.voiceAgent.sessionId"))
    tries: list[str] = []
    body = {"error": {"code": "unauthorized", "message": "the token has expired"}}

    async def expired(route: Any) -> None:
        tries.append(route.request.method)
        await route.fulfill(status=401, json=body, headers={"WWW-Authenticate": "Bearer"})

    await ap.page.route("**/offer", expired)
    await registry._lose(peer, peer.pc)  # the connection is lost: the page resumes
    await ap.page.wait_for_selector('#state[data-state="failed"]', timeout=20_000)
    assert tries == ["POST"], tries
    assert "expired" in (await ap.page.text_content("#alert") or "")
    assert not ap.page_errors(), ap.context()


# The user takes a while to answer the browser's microphone prompt: getUserMedia resolves
# late. Every stream it hands out is kept so a test can see whether it was stopped.
SLOW_MIC_JS = """
window.__streams = [];
const getUserMedia = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
navigator.mediaDevices.getUserMedia = async (constraints) => {
  await new Promise((r) => setTimeout(r, 800));
  const stream = await getUserMedia(constraints);
  window.__streams.push(stream);
  return stream;
};
"""


async def test_hang_up_during_the_microphone_prompt_turns_the_microphone_off(
    agent_page: AgentPage,
) -> None:
    ap = agent_page
    await ap.page.add_init_script(SLOW_MIC_JS)
    await ap.page.reload()
    await ap.page.set_checked("#mic", True)
    await ap.page.click("#connect")
    await ap.page.wait_for_timeout(200)  # the prompt is up
    await ap.page.click("#hangup")
    await ap.page.wait_for_function("() => window.__streams.length === 1")
    await ap.page.wait_for_timeout(100)
    tracks = await ap.page.evaluate(
        "() => window.__streams.flatMap((s) => s.getTracks().map((t) => t.readyState))"
    )
    assert tracks == ["ended"], f"the microphone is still on after Hang up: {tracks}"
    assert await ap.page.evaluate("() => window.voiceAgent.micTrack === null")
    assert await ap.page.get_attribute("#state", "data-state") == "closed"
    assert not [line for line in ap.log if "connect failed" in line], ap.context()
    assert not ap.page_errors(), ap.context()


# The browser reports ICE failure, as it does when the network drops.
FAIL_ICE_JS = """
() => {
  const pc = window.voiceAgent.pc;
  Object.defineProperty(pc, 'connectionState', {get: () => 'failed'});
  pc.dispatchEvent(new Event('connectionstatechange'));
}
"""


async def test_hang_up_while_resuming_ends_the_call_for_good(
    agent_page: AgentPage, live_server: Any
) -> None:
    """The connection fails, the page resumes; the user hangs up while the first try is in
    flight and that try then fails: no further try, the call stays closed."""
    import asyncio

    from signaling.keys import SESSIONS

    ap = agent_page
    await connect(ap)
    resumes: list[bool] = []

    async def slow_then_fail(route: Any) -> None:
        resumes.append("resume" in (route.request.post_data_json or {}))
        await asyncio.sleep(1.0)
        await route.abort("connectionreset")

    await ap.page.route("**/offer", slow_then_fail)
    await ap.page.evaluate(FAIL_ICE_JS)
    await ap.page.wait_for_function("() => window.voiceAgent.state === 'connecting'")
    for _ in range(100):
        if resumes:
            break
        await asyncio.sleep(0.05)
    assert resumes == [True], resumes
    deletes: list[int] = []
    ap.page.on("response", lambda r: r.request.method == "DELETE" and deletes.append(r.status))
    await ap.page.click("#hangup")
    # The failed try would have been followed by another 1 s later.
    await ap.page.wait_for_timeout(2500)
    assert resumes == [True], f"the page tried again after Hang up: {resumes}"
    assert deletes == [204], deletes  # the detached session ends on the server too
    assert await ap.page.get_attribute("#state", "data-state") == "closed"
    assert await ap.page.evaluate("() => window.voiceAgent.pc === null")
    assert await ap.page.is_enabled("#connect")
    assert await ap.page.is_disabled("#hangup")
    assert len(live_server.app[SESSIONS]) == 0
    assert not ap.page_errors(), ap.context()


async def test_hang_up_whose_delete_outlasts_a_failing_resume_still_closes(
    agent_page: AgentPage,
) -> None:
    """The same, but the resume try fails while the DELETE is still on its way: that try
    tears its connection down as "reconnecting", and the page stayed there (Hang up
    disabled, nothing pending) instead of closing."""
    import asyncio

    ap = agent_page
    await connect(ap)
    resumes: list[bool] = []

    async def fail_soon(route: Any) -> None:
        resumes.append("resume" in (route.request.post_data_json or {}))
        await asyncio.sleep(0.5)
        await route.abort("connectionreset")

    async def slow_delete(route: Any) -> None:
        await asyncio.sleep(1.5)  # past the resume's failure (the page waits 1 s at most)
        await route.continue_()

    await ap.page.route("**/offer", fail_soon)
    await ap.page.route("**/sessions/*", slow_delete)
    await ap.page.evaluate(FAIL_ICE_JS)
    for _ in range(100):
        if resumes:
            break
        await asyncio.sleep(0.05)
    assert resumes == [True], resumes
    await ap.page.click("#hangup")
    await ap.page.wait_for_function(
        "() => document.querySelector('#state').dataset.state === 'closed'", timeout=5000
    )
    await ap.page.wait_for_timeout(1500)  # a further try would come within this
    assert resumes == [True], resumes
    assert await ap.page.get_attribute("#state", "data-state") == "closed"
    assert await ap.page.is_enabled("#connect")
    assert not ap.page_errors(), ap.context()


async def test_connect_between_resume_tries_ends_the_old_session(
    agent_page: AgentPage, live_server: Any
) -> None:
    """Connect pressed while a lost call waits for its next resume try starts a new call;
    the old session used to stay on the server, detached, until its grace period ended."""
    import asyncio

    from signaling.keys import SESSIONS

    ap = agent_page
    await connect(ap)
    old_id = await ap.page.evaluate("() => window.voiceAgent.sessionId")
    resumes: list[bool] = []

    async def refuse_resumes(route: Any) -> None:
        resume = "resume" in (route.request.post_data_json or {})
        resumes.append(resume)
        if resume:
            await route.abort("connectionreset")
        else:
            await route.continue_()

    await ap.page.route("**/offer", refuse_resumes)
    await ap.page.evaluate(FAIL_ICE_JS)
    for _ in range(100):  # the first try fails at once; the next waits 1 s
        if resumes:
            break
        await asyncio.sleep(0.05)
    assert resumes == [True], resumes
    await ap.page.wait_for_function("() => window.voiceAgent.state === 'reconnecting'")
    await ap.page.click("#connect")
    await ap.page.wait_for_function("() => window.voiceAgent.state === 'connected'", timeout=15000)
    new_id = await ap.page.evaluate("() => window.voiceAgent.sessionId")
    await ap.page.wait_for_timeout(1500)  # a further resume try of the old call: none
    assert resumes == [True, False], resumes
    registry = live_server.app[SESSIONS]
    assert new_id != old_id and len(registry) == 1 and registry.get(new_id)
    assert await ap.page.evaluate("() => window.voiceAgent.state") == "connected"
    assert not ap.page_errors(), ap.context()


def short_idle_config() -> Any:
    from agent.config import Config, LifecycleSettings

    return Config(host="127.0.0.1", port=0, lifecycle=LifecycleSettings(idle_timeout_s=2.0))


@pytest.mark.parametrize("server_config", [short_idle_config()], ids=["idle_2s"])
async def test_a_session_the_server_closes_is_not_resumed(agent_page: AgentPage) -> None:
    """`session.closed` (idle_timeout): the page says why and does not try to resume."""
    ap = agent_page
    offers: list[str] = []
    ap.page.on("request", lambda r: r.url.endswith("/offer") and offers.append(r.method))
    await ap.page.set_checked("#mic", False)
    await ap.page.click("#connect")
    await ap.page.wait_for_selector("#alert:not([hidden])", timeout=10_000)
    await ap.page.wait_for_timeout(1000)  # a resume would start 0.5 s after the close
    closed = [e for e in await events(ap) if e.get("type") == "session.closed"]
    assert closed == [{"type": "session.closed", "reason": "idle_timeout"}], await events(ap)
    alert = await ap.page.text_content("#alert") or ""
    assert "idle_timeout" in alert, alert
    assert await ap.page.get_attribute("#alert", "data-kind") == "info"
    assert offers == ["POST"], f"the page tried to resume a closed session: {offers}"
    assert await ap.page.get_attribute("#state", "data-state") == "closed"
    assert await ap.page.is_enabled("#connect")
    assert not ap.page_errors(), ap.context()


# Data-channel events as the server sends them, delivered to the page's own handler; the
# last stats sample says the jitter buffer holds audio for 300 ms, so captions wait that long.
FEED_JS = """
(msgs) => {
  window.voiceAgent.stats.push({t: Date.now(), jitterBufferMs: 300});
  const channel = window.voiceAgent.channel;
  for (const m of msgs) {
    channel.dispatchEvent(new MessageEvent('message', {data: JSON.stringify(m)}));
  }
}
"""


def utterance(id_: str, caption: str | None = None, interrupted: bool = False) -> list[Any]:
    segment = [{"type": "speech.segment", "id": id_, "text": caption}] if caption else []
    ended = [{"type": "speech.ended", "id": id_, "interrupted": interrupted}]
    return [{"type": "speech.started", "id": id_}, *segment, *ended]


BOUNDS_JS = """
() => ({
  events: window.voiceAgent.events.length,
  li: document.querySelectorAll('#transcript li').length,
  first: document.querySelector('#transcript li').dataset.id,
  items: window.voiceAgent.items?.size,
  texts: window.voiceAgent.texts?.size,
})
"""


async def test_captions_end_with_their_speech_and_a_long_call_stays_bounded(
    agent_page: AgentPage,
) -> None:
    """A caption waiting for the jitter buffer never shows after its utterance ended (an
    interrupt) or after Hang up. A long call keeps the newest 500 transcript items (and
    their texts) and 1000 events."""
    ap = agent_page
    await connect(ap)
    said = await ap.page.evaluate("() => window.voiceAgent.say('hello')")
    await ap.page.wait_for_function(
        "(id) => window.voiceAgent.events.some((e) => e.type === 'speech.ended' && e.id === id)",
        arg=said,
    )
    await ap.page.evaluate(FEED_JS, utterance("cut-short", "never heard", interrupted=True))
    await ap.page.wait_for_timeout(400)
    assert await ap.page.text_content("#caption") == "", "a caption after speech.ended"

    await ap.page.evaluate(FEED_JS, [m for i in range(600) for m in utterance(f"u{i}")])
    bounds = await ap.page.evaluate(BOUNDS_JS)
    assert bounds == {"events": 1000, "li": 500, "first": "u100", "items": 500, "texts": 0}

    await ap.page.evaluate(FEED_JS, utterance("hung-up", "never heard")[:2])
    await ap.page.evaluate("() => window.voiceAgent.hangup()")
    await ap.page.wait_for_timeout(400)
    assert await ap.page.get_attribute("#state", "data-state") == "closed"
    assert await ap.page.text_content("#caption") == "", "a caption after Hang up"
    assert (await ap.page.evaluate(BOUNDS_JS))["li"] == 500  # kept after Hang up, bounded
    assert not ap.page_errors(), ap.context()


async def test_audio_that_stops_while_the_server_has_the_session_resumes_it_at_once(
    agent_page: AgentPage, live_server: Any
) -> None:
    """The media path breaks while the server and HTTP are fine (a network switch, a NAT
    rebinding; here the server's sending simply stops): ICE said "disconnected" only ~7 s
    later, and with ICE still up (as here) never, so the call stayed silent for good. The
    page now notices that its audio stopped, asks the server (the session is there) and
    resumes it on a new connection at once; speech plays again."""
    import asyncio

    from signaling.keys import SESSIONS

    ap = agent_page
    await connect(ap)
    session_id = await ap.page.evaluate("() => window.voiceAgent.sessionId")
    peer = live_server.app[SESSIONS].get(session_id)
    old_pc = peer.pc
    for sender in old_pc.getSenders():
        if sender.track is not None:
            sender.track.stop()  # no more audio to the page; ICE and the session stay up
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not (peer.pc is not old_pc and peer.pc.connectionState == "connected"):
        assert loop.time() - start < 8, f"the page did not resume{ap.context()}"
        await asyncio.sleep(0.1)
    await ap.page.wait_for_selector('#state[data-state="connected"]')
    assert await ap.page.evaluate("() => window.voiceAgent.sessionId") == session_id
    assert "resuming it" in ap.context()
    before = await say_in_ui(ap, "Back on a new connection.")
    probe = await probe_speech(ap, before, timeout_s=10)
    assert probe["endedAt"] is not None, probe
    assert not ap.page_errors(), ap.context()


async def test_a_session_gone_with_its_server_ends_the_call_in_seconds(browser: Browser) -> None:
    """The server was killed (no data-channel close) and a new one took its address, with
    no such session: the page waited for ICE ("disconnected" after ~7 s, then 4 s, then a
    resume that got 404), ~12 s of a call that looked alive. Now its audio stopping has the
    page ask, and the 404 ends the call within a few seconds, saying why."""
    import time

    from tests.server_process import ServerProcess

    first = ServerProcess(["tests.serve_tone"], ["--no-listen"])
    second = None
    context = await browser.new_context()
    try:
        await first.ready()
        ap = await open_agent_page(context, first.url)
        page = ap.page
        await connect(ap)
        first.proc.kill()
        first.proc.wait()
        start = time.monotonic()
        second = ServerProcess(["tests.serve_tone"], ["--no-listen"], port=first.port)
        await second.ready()
        await page.wait_for_selector("#alert:not([hidden])", timeout=10_000)
        took = time.monotonic() - start
        assert "gone on the server" in (await page.text_content("#alert") or ""), ap.context()
        assert await page.get_attribute("#state", "data-state") == "closed"
        assert not await page.is_disabled("#connect")
        assert took < 6, took  # ~3 s: 2 s of no audio, the stats tick, one request
    finally:
        await context.close()
        for server in (first, second):
            if server is not None and server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait()


async def test_the_main_page_in_a_room_waits_out_a_short_audio_gap(
    browser: Browser, live_server: Any
) -> None:
    """The main page joins a room with ?room=. Its seat cannot be resumed, so a gap in the
    audio while the server has the seat must not start a resume (found by review: the page
    tore down a working call after a 3 s gap and ended "failed"); it waits, as the room page
    does, and the call goes on on the same connection."""
    import asyncio

    from signaling.keys import SESSIONS

    context = await browser.new_context()
    try:
        ap = AgentPage(await context.new_page())
        ap.page.on("console", lambda m: ap.log.append(f"console.{m.type}: {m.text}"))
        await ap.page.goto(live_server.url + "/?room=r")
        await ap.page.wait_for_function("() => window.voiceAgent !== undefined")
        await connect(ap)
        session_id = await ap.page.evaluate("() => window.voiceAgent.sessionId")
        peer = live_server.app[SESSIONS].get(session_id)
        pc = peer.pc
        source = peer.session.room.agent  # the agent's audio, published to every seat
        publish = source.publish
        source.publish = lambda payload: None  # a 3.5 s gap: no packet reaches the page
        await asyncio.sleep(3.5)
        source.publish = publish
        await asyncio.sleep(1)
        state = await ap.page.get_attribute("#state", "data-state")
        assert peer.pc is pc and state == "connected", f"state={state}{ap.context()}"
        assert not any("resuming it" in line for line in ap.log), ap.context()
    finally:
        await context.close()


async def live_settings(page: Page, selector: str) -> list[str | None]:
    """The `live` setting Chromium's accessibility tree gives each element matching
    `selector` (what a screen reader goes by: "polite" is announced on every change)."""
    cdp = await page.context.new_cdp_session(page)
    count = await page.evaluate(
        "(sel) => (window.__liveProbe = [...document.querySelectorAll(sel)]).length", selector
    )
    settings: list[str | None] = []
    for i in range(count):
        element = await cdp.send("Runtime.evaluate", {"expression": f"window.__liveProbe[{i}]"})
        tree = await cdp.send(
            "Accessibility.getPartialAXTree",
            {"objectId": element["result"]["objectId"], "fetchRelatives": False},
        )
        props = tree["nodes"][0].get("properties", [])
        settings.append(next((p["value"]["value"] for p in props if p["name"] == "live"), None))
    await cdp.detach()
    return settings


async def test_the_stats_figures_are_not_read_out_every_second(agent_page: AgentPage) -> None:
    """The twelve figures under Connection change once a second while a call is up. Each was
    an `<output>`, which browsers expose as a polite live region (role status): a screen
    reader read every figure out every second, drowning the transcript and the state."""
    values = await live_settings(agent_page.page, "#stats .value")
    assert len(values) == 12, values
    assert all(v in (None, "off") for v in values), values
    # The page's real live regions stay: the call's state and the transcript.
    assert await live_settings(agent_page.page, "#state, #transcript") == ["polite", "polite"]


# Ends a track the way an unplugged device does: stopped, and `ended` fired (stop() alone
# fires nothing). The argument is an expression for the track.
END_TRACK_JS = "(expr) => { const t = eval(expr); t.stop(); t.dispatchEvent(new Event('ended')); }"


async def test_a_microphone_that_stops_mid_call_is_shown(agent_page: AgentPage) -> None:
    """A microphone unplugged (or its permission withdrawn) mid-call ends its track: the
    call goes on listen-only, and the page said nothing, so the user talked to no one."""
    ap = agent_page
    await connect(ap, mic=True)
    assert await ap.page.is_hidden("#alert")
    # What the browser does when the device goes: the track ends and fires `ended`.
    await ap.page.evaluate(END_TRACK_JS, "window.voiceAgent.micTrack")
    await ap.page.wait_for_selector("#alert:not([hidden])", timeout=2_000)
    assert "microphone" in (await ap.page.text_content("#alert") or "").lower()
    assert await ap.page.get_attribute("#state", "data-state") == "connected"
    assert await ap.page.is_enabled("#say")
    # A microphone stopped by Hang up itself is no news.
    await ap.page.click("#hangup")
    await ap.page.wait_for_selector('#state[data-state="closed"]')
    await connect(ap, mic=True)
    await ap.page.click("#hangup")
    await ap.page.wait_for_selector('#state[data-state="closed"]')
    assert await ap.page.is_hidden("#alert")
    assert not ap.page_errors(), ap.context()


def one_speech_request_config() -> Any:
    from agent.config import Config, LimitSettings

    return Config(host="127.0.0.1", port=0, limits=LimitSettings(speech_burst=1, speech_rate=0.01))


@pytest.mark.parametrize("server_config", [one_speech_request_config()], ids=["speech_burst_1"])
async def test_a_say_the_server_refuses_keeps_its_text_in_the_transcript(
    agent_page: AgentPage,
) -> None:
    """A say the server refuses (here rate_limited; also empty_text, queue_full...) gets an
    `error` with the say's id. The box had emptied as the say went out, and the transcript
    showed only the error: what the user had typed was gone. An Ask (``chat``) refused
    likewise marks its question's item."""
    ap = agent_page
    await connect(ap)
    await say_in_ui(ap, "first one")
    await say_in_ui(ap, "second one")
    await ap.page.wait_for_function(
        "() => window.voiceAgent.events.some((e) => e.type === 'error')", timeout=5_000
    )
    refused = [e for e in await events(ap) if e.get("type") == "error"]
    assert refused[0]["code"] == "rate_limited" and refused[0].get("id"), refused
    item = await transcript_item(ap, refused[0]["id"])
    assert item == {"text": "second one", "status": "error"}, item
    badge = f'#transcript li[data-id="{refused[0]["id"]}"] .badge'
    assert await ap.page.text_content(badge) == "rate_limited"
    assert "rate_limited" in (await ap.page.text_content("#alert") or "")
    # An Ask refused the same way marks its question (chat had no id to match it by).
    await ap.page.fill("#text", "a question")
    await ap.page.click("#ask")
    await ap.page.wait_for_function(
        "() => window.voiceAgent.events.filter((e) => e.type === 'error').length > 1",
        timeout=5_000,
    )
    asked = [e for e in await events(ap) if e.get("type") == "error"][1]
    assert asked["code"] == "rate_limited" and asked["id"].startswith("asked-"), asked
    item = await transcript_item(ap, asked["id"])
    assert item == {"text": "a question", "status": "error"}, item
    assert not ap.page_errors(), ap.context()
