"""The browser client through a call's rough edges (headless Chromium, the real server):
engine failures, a server with no speech-to-text, ids said again, hang-ups mid-turn, a
server slow to answer, a room seat lost, and the figures after the call."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from agent.config import Config, LimitSettings, SecuritySettings
from signaling.auth import mint_token
from signaling.keys import SESSIONS
from tests import test_browser
from tests.conftest import serve
from tests.doubles import FailingEngine, ToneEngine
from tests.test_browser import (
    FAIL_ICE_JS,
    AgentPage,
    connect,
    say_in_ui,
    transcript_item,
)

# test_browser's fixtures, used here by name.
browser = test_browser.browser
agent_page = test_browser.agent_page

pytestmark = [pytest.mark.browser, pytest.mark.timeout(90)]

SECRET = "browser-client-secret-0123456789abcdef"

# Events fed to the page as if they came from the server (its own channel's listener).
FEED_JS = """
(msgs) => {
  const channel = window.voiceAgent.channel;
  for (const m of msgs) {
    channel.dispatchEvent(new MessageEvent('message', {data: JSON.stringify(m)}));
  }
}
"""
ITEMS_JS = """
() => [...document.querySelectorAll('#transcript li')].map((li) => ({
  id: li.dataset.id, status: li.dataset.status, role: li.dataset.role ?? 'agent',
  text: li.querySelector('.text').textContent, badge: li.querySelector('.badge').textContent,
}))
"""
VALUES_JS = """
() => Object.fromEntries([...document.querySelectorAll('#stats .value')]
  .map((v) => [v.id.replace('stat-', ''), v.textContent]))
"""


@pytest.fixture
def tone_engine(request: Any) -> ToneEngine:
    engine = FailingEngine()
    engine.mode = getattr(request, "param", "ok")
    return engine


@pytest.mark.parametrize("tone_engine", ["start", "midway"], indirect=True)
async def test_a_say_the_engine_fails_stays_marked_as_failed(agent_page: AgentPage) -> None:
    """The utterance the engine failed on was struck through as if the user had
    interrupted it: its ``speech.ended`` (``interrupted``) replaced the error mark."""
    ap = agent_page
    await connect(ap)
    await say_in_ui(ap, "this will fail at some point")
    await ap.page.wait_for_function(
        "() => window.voiceAgent.events.some((e) => e.type === 'speech.ended')", timeout=10_000
    )
    kinds = await ap.page.evaluate("() => window.voiceAgent.events.map((e) => e.type)")
    assert kinds[-2:] == ["error", "speech.ended"], kinds  # the failure comes with the end
    said = await ap.page.evaluate("() => [...window.voiceAgent.texts.keys()].pop()")
    item = await transcript_item(ap, said)
    assert item is not None and item["status"] == "error", (kinds, item, ap.context())
    items = await ap.page.evaluate(ITEMS_JS)
    assert [i["badge"] for i in items] == ["tts_failed"], items  # one item, no extra one


async def test_a_connect_whose_peer_connection_cannot_be_built_says_so(
    agent_page: AgentPage,
) -> None:
    """Chromium's RTCPeerConnection throws on a TURN URL without credentials: Connect did
    nothing at all (the page stayed "idle", no alert, the error only in the console). The
    server refuses such a list at start now; a proxy could still hand one out."""
    ap = agent_page
    body = json.dumps({"iceServers": [{"urls": "turn:127.0.0.1:3478"}]})
    await ap.page.route(
        "**/ice-servers",
        lambda route: route.fulfill(status=200, content_type="application/json", body=body),
    )
    await ap.page.set_checked("#mic", False)
    await ap.page.click("#connect")
    await ap.page.wait_for_selector('#state[data-state="failed"]')
    assert await ap.page.is_visible("#alert"), ap.context()
    assert await ap.page.is_enabled("#connect")


async def test_connect_shows_at_once_and_hang_up_cancels_a_server_slow_to_answer(
    agent_page: AgentPage,
) -> None:
    """While /ice-servers went unanswered the page said "idle", Hang up was disabled, and
    Connect clicks did nothing. An offer never answered left every later Connect waiting
    on it, after Hang up too."""
    ap = agent_page
    held: list[Any] = []

    async def hang(route: Any) -> None:
        held.append(route)  # never answered: a server whose event loop is stuck

    await ap.page.set_checked("#mic", False)
    for path in ("**/ice-servers", "**/offer"):
        await ap.page.route(path, hang)
        await ap.page.click("#connect")
        await ap.page.wait_for_timeout(300 if path.endswith("servers") else 6000)
        assert await ap.page.get_attribute("#state", "data-state") == "connecting", path
        assert await ap.page.is_disabled("#connect") and await ap.page.is_enabled("#hangup")
        await ap.page.click("#hangup")
        await ap.page.wait_for_selector('#state[data-state="closed"]')
        assert await ap.page.is_enabled("#connect"), path
        await ap.page.unroute(path)
    assert len(held) == 2, held
    await connect(ap)  # not stuck behind the tries still waiting on their answers


@pytest_asyncio.fixture
async def two_turn_page(tmp_path: Path) -> AsyncIterator[AgentPage]:
    """The main page of a server with no --stt-url (the default), Chromium's microphone
    playing two spoken turns."""
    from signaling.keys import SESSIONS
    from tests.clips import SPEECH_WAV, read_wav, write_wav
    from tests.conftest import serve

    speech, rate = read_wav(SPEECH_WAV)
    lead = np.zeros(int(2.5 * rate), dtype=np.float32)
    gap = np.zeros(int(1.5 * rate), dtype=np.float32)
    wav = tmp_path / "mic.wav"
    write_wav(wav, np.concatenate([lead, speech, gap, speech, gap, gap]), rate)
    async with serve(Config(host="127.0.0.1"), ToneEngine()) as server:
        await server.app[SESSIONS].vad_pool.load()
        async with test_browser.page_hearing(server.url, wav) as ap:
            yield ap


@pytest.mark.timeout(120)
async def test_turns_on_a_server_without_speech_to_text_do_not_wait_for_a_transcript(
    two_turn_page: AgentPage,
) -> None:
    """The server says ``stt_unavailable`` once, on the first turn: every later turn stayed
    "transcribing" for good, waiting for a transcript that never comes."""
    ap = two_turn_page
    await connect(ap, mic=True)
    await ap.page.wait_for_function(
        "() => window.voiceAgent.events.filter((e) => e.type === 'user.speech.ended').length >= 2",
        timeout=30_000,
    )
    turns = [i for i in await ap.page.evaluate(ITEMS_JS) if i["role"] == "user"]
    assert [(t["status"], t["badge"]) for t in turns] == [
        ("error", "stt_unavailable"),
        ("empty", "not transcribed"),
    ], turns


async def test_a_user_turn_cut_by_hang_up_does_not_stay_under_way(agent_page: AgentPage) -> None:
    """Hang up marked the agent's utterance cut off, but left the user's turn "speaking"
    or "transcribing" for good."""
    ap = agent_page
    await connect(ap)
    await ap.page.evaluate("() => window.voiceAgent.say('kept in the map while the call lasts')")
    await ap.page.evaluate(
        FEED_JS,
        [
            {"type": "user.speech.started", "id": "turn-a"},
            {"type": "user.speech.ended", "id": "turn-a", "duration_ms": 900},
            {"type": "user.speech.started", "id": "turn-b"},
        ],
    )
    await ap.page.click("#hangup")
    await ap.page.wait_for_selector('#state[data-state="closed"]')
    items = await ap.page.evaluate(ITEMS_JS)
    turns = {i["id"]: (i["status"], i["badge"]) for i in items if i["role"] == "user"}
    assert turns == {"turn-a": ("empty", "cut off"), "turn-b": ("empty", "cut off")}, turns
    # The items stay on show; the page's maps hold nothing of a call that is over.
    sizes = "() => [window.voiceAgent.items.size, window.voiceAgent.texts.size]"
    assert await ap.page.evaluate(sizes) == [0, 0]


async def _http_say(ap: AgentPage, url: str, text: str, id_: str) -> None:
    session_id = await ap.page.evaluate("() => window.voiceAgent.sessionId")
    resp = await ap.page.request.post(
        f"{url}/sessions/{session_id}/say", data={"text": text, "id": id_}
    )
    assert resp.status == 202, await resp.text()
    await ap.page.wait_for_function(
        "(id) => window.voiceAgent.events.filter((e) => e.type === 'speech.ended' && e.id === id)"
        ".length > 0",
        arg=id_,
        timeout=10_000,
    )


async def test_an_id_said_again_gets_an_item_of_its_own(
    agent_page: AgentPage, live_server: Any
) -> None:
    """A server's greeting said with the same id in each call (HTTP say) was appended to
    the first call's item: "Welcome back. Welcome back." So was one said twice in a call."""
    ap = agent_page
    await connect(ap)
    await _http_say(ap, live_server.url, "Welcome back.", "greeting")
    await ap.page.evaluate("() => { window.voiceAgent.events.length = 0; }")
    await _http_say(ap, live_server.url, "Welcome back.", "greeting")  # again, same call
    await ap.page.click("#hangup")
    await ap.page.wait_for_selector('#state[data-state="closed"]')
    await connect(ap)
    await _http_say(ap, live_server.url, "Welcome back.", "greeting")
    items = await ap.page.evaluate(ITEMS_JS)
    assert [(i["text"], i["status"]) for i in items] == [("Welcome back.", "done")] * 3, items


async def test_a_room_seat_lost_on_the_main_page_is_not_resumed(
    browser: Any,
    live_server: Any,
) -> None:
    """The main page in a room (?room=) took a lost seat for a resumable call: it sent
    resume offers the server refuses (not_resumable, a 400, tried again), then "failed"."""
    context = await browser.new_context()
    try:
        page = await context.new_page()
        ap = AgentPage(page)
        page.on("console", lambda m: ap.log.append(f"console.{m.type}: {m.text}"))
        resumes: list[str] = []
        page.on(
            "request",
            lambda r: (
                resumes.append(r.url)
                if r.url.endswith("/offer") and "resume" in (r.post_data or "")
                else None
            ),
        )
        await page.goto(live_server.url + "/?room=r")
        await page.wait_for_function("() => window.voiceAgent !== undefined")
        await connect(ap)
        # The connection lost on the client's side, as a network drop would.
        await page.evaluate("() => window.voiceAgent.channel.close()")
        await page.wait_for_selector('#state[data-state="closed"]')
        await page.wait_for_timeout(2000)  # a resume would have been tried by now
        assert not resumes, resumes
        assert "room was lost" in (await page.text_content("#alert") or ""), ap.context()
    finally:
        await context.close()


async def test_the_figures_do_not_read_as_live_after_hang_up(agent_page: AgentPage) -> None:
    """Two seconds after Hang up the page still showed "32.2 kbps", "50 /s" and an audio
    level as current figures. Now they show "—"; the plots keep the call's history."""
    ap = agent_page
    await connect(ap)
    await say_in_ui(ap, "one two three four five six seven eight nine ten")
    await ap.page.wait_for_function(
        "() => document.getElementById('stat-packetsPerSecond').textContent !== '—'"
    )
    await ap.page.click("#hangup")
    await ap.page.wait_for_selector('#state[data-state="closed"]')
    values = await ap.page.evaluate(VALUES_JS)
    assert set(values.values()) == {"—"}, values
    assert await ap.page.evaluate("() => window.voiceAgent.stats.length") > 0


async def test_the_last_caption_stays_until_its_audio_is_heard(agent_page: AgentPage) -> None:
    """``speech.ended`` leaves the server with the last packet, which the jitter buffer
    holds a while yet: the page cleared the caption then, so the last caption went before
    its sound, and a sentence shorter than the buffer's delay was never shown at all."""
    ap = agent_page
    await connect(ap)
    # Each feed first says the jitter buffer holds 300 ms (test_browser.FEED_JS).
    await ap.page.evaluate(
        test_browser.FEED_JS,
        [
            {"type": "speech.started", "id": "short"},
            {"type": "speech.segment", "id": "short", "text": "Yes."},
        ],
    )
    await ap.page.wait_for_timeout(150)  # a sentence of 150 ms: it ends before it is heard
    ended = [{"type": "speech.ended", "id": "short", "interrupted": False}]
    await ap.page.evaluate(test_browser.FEED_JS, ended)
    await ap.page.wait_for_function("() => document.getElementById('caption').textContent")
    assert await ap.page.text_content("#caption") == "Yes."
    await ap.page.wait_for_function(
        "() => document.getElementById('caption').textContent === ''", timeout=2000
    )


async def test_an_id_said_again_right_after_itself_shows_its_caption(
    agent_page: AgentPage,
) -> None:
    """One id said twice in a row (a greeting sent twice over HTTP with its id): the first
    run's end clears its caption once the jitter buffer played it, and that clear cancelled
    every caption timer of the id, the second run's first one included: the second
    sentence was never shown (found by review). Captions are kept per run."""
    ap = agent_page
    await connect(ap)
    await ap.page.evaluate(
        """() => {
          window.__captions = [];
          const el = document.getElementById('caption');
          new MutationObserver(() => window.__captions.push(el.textContent))
            .observe(el, {childList: true, characterData: true, subtree: true});
        }"""
    )
    # Each feed first says the jitter buffer holds 300 ms (test_browser.FEED_JS).
    await ap.page.evaluate(test_browser.FEED_JS, test_browser.utterance("greeting", "Hello there."))
    await ap.page.wait_for_timeout(20)  # the second run's first packet, right behind
    second = test_browser.utterance("greeting", "Welcome back.")
    await ap.page.evaluate(test_browser.FEED_JS, second[:2])
    await ap.page.wait_for_function(
        "() => window.__captions.includes('Welcome back.')", timeout=2000
    )
    assert "Hello there." in await ap.page.evaluate("() => window.__captions")
    await ap.page.evaluate(test_browser.FEED_JS, second[2:])
    await ap.page.wait_for_function(
        "() => document.getElementById('caption').textContent === ''", timeout=2000
    )
    assert not ap.page_errors(), ap.context()


async def test_events_while_hang_up_waits_for_its_delete_make_no_new_items(
    agent_page: AgentPage,
) -> None:
    """Hang up ends the call (its items cut off) and then waits up to 1 s for its DELETE,
    the channel still open: what the server said meanwhile made a second item for the
    same utterance."""
    ap = agent_page
    await connect(ap)
    await ap.page.evaluate(FEED_JS, [{"type": "speech.started", "id": "u1"}])

    async def slow_delete(route: Any) -> None:
        await ap.page.evaluate(FEED_JS, [{"type": "speech.segment", "id": "u1", "text": "Hi."}])
        await route.continue_()

    await ap.page.route("**/sessions/*", slow_delete)
    await ap.page.click("#hangup")
    await ap.page.wait_for_selector('#state[data-state="closed"]')
    items = await ap.page.evaluate(ITEMS_JS)
    assert [(i["id"], i["status"]) for i in items] == [("u1", "interrupted")], items


async def test_hang_up_during_a_resume_try_shows_no_error_for_the_call_it_ended(
    agent_page: AgentPage, live_server: Any
) -> None:
    """The connection fails, the page resumes; the user hangs up while the resume's offer
    is on its way, over a network slow to bring back the DELETE's answer (the server has
    already ended the session). The resume's answer (404: the session is gone, because the
    user hung up) comes back first: doConnect's catch did not know the call was hung up
    (Hang up bumps session.call, not session.generation, which is all stale() reads), so it
    tore down as "reconnecting" and showed the refusal as an error. Hang up then closed the
    call, and the red alert stayed: the user was told the call failed after ending it
    themselves (the channel closing during Hang up, and events arriving then, are ignored
    on purpose: nothing after Hang up is news; found by review)."""
    ap = agent_page
    await connect(ap)
    hung_up = asyncio.Event()
    resumes: list[int] = []

    async def offer(route: Any) -> None:
        if "resume" in (route.request.post_data_json or {}):
            await hung_up.wait()  # answered once the DELETE reached the server
            resp = await route.fetch()
            resumes.append(resp.status)
            await route.fulfill(response=resp)
        else:
            await route.continue_()

    async def slow_delete_answer(route: Any) -> None:
        resp = await route.fetch()  # the server ends the session now
        hung_up.set()
        await asyncio.sleep(0.7)  # its answer takes a while to come back (< HANGUP_WAIT_MS)
        await route.fulfill(response=resp)

    await ap.page.route("**/offer", offer)
    await ap.page.route("**/sessions/*", slow_delete_answer)
    await ap.page.evaluate(FAIL_ICE_JS)  # ICE failed: the page resumes
    await ap.page.wait_for_function("() => window.voiceAgent.pc !== null", timeout=5000)
    await ap.page.wait_for_function("() => window.voiceAgent.state === 'connecting'", timeout=5000)
    assert await ap.page.is_hidden("#alert"), await ap.page.text_content("#alert")
    await ap.page.click("#hangup")
    await ap.page.wait_for_selector('#state[data-state="closed"]', timeout=5000)
    await ap.page.wait_for_timeout(300)
    assert resumes and resumes[0] in (404, 410), resumes
    assert len(live_server.app[SESSIONS]) == 0
    alert = await ap.page.text_content("#alert")
    assert await ap.page.is_hidden("#alert"), f"an error shown after Hang up: {alert!r}"


async def test_ice_failing_while_hang_up_waits_for_its_delete_ends_as_a_hang_up(
    agent_page: AgentPage,
) -> None:
    """Same root as above, through refreshState: the browser reports ICE failed while Hang
    up waits (up to 1 s) for its DELETE. The channel closing then is ignored as expected
    (its listener reads session.hangingUp), but the "failed" branch was not: lostConnection
    declined (hanging up), so refreshState tore down as "failed" and showed "The connection
    failed (ICE could not reach the server)". That teardown's endCall bumped session.call
    again, so Hang up, once its DELETE returned, no longer took the call for its own and
    never tore down as "closed": the page ended "failed", with the error on show, for a
    call the user hung up (found by review)."""
    ap = agent_page
    await connect(ap)

    async def slow_delete(route: Any) -> None:
        await asyncio.sleep(0.6)  # a slow network (Hang up waits up to 1 s)
        await route.continue_()

    await ap.page.route("**/sessions/*", slow_delete)
    await ap.page.click("#hangup")
    await ap.page.wait_for_timeout(100)
    await ap.page.evaluate(FAIL_ICE_JS)  # the network gives out while the DELETE is on its way
    await ap.page.wait_for_timeout(1500)  # past the DELETE (and HANGUP_WAIT_MS)
    state = await ap.page.get_attribute("#state", "data-state")
    alert = await ap.page.text_content("#alert") if await ap.page.is_visible("#alert") else None
    assert (state, alert) == ("closed", None), "after Hang up"


async def test_an_event_from_a_connection_already_closed_makes_no_item(
    agent_page: AgentPage,
) -> None:
    """A message an earlier connection's channel delivers after the call ended (queued as
    it closed) is not this page's news: it made a transcript item after Hang up."""
    ap = agent_page
    await connect(ap)
    await ap.page.evaluate("() => { window.__oldChannel = window.voiceAgent.channel; }")
    await ap.page.click("#hangup")
    await ap.page.wait_for_selector('#state[data-state="closed"]')
    before = await ap.page.evaluate(ITEMS_JS)
    await ap.page.evaluate(
        """() => window.__oldChannel.dispatchEvent(new MessageEvent('message', {data:
             JSON.stringify({type: 'speech.started', id: 'late', text: 'Late.'})}))"""
    )
    assert await ap.page.evaluate(ITEMS_JS) == before
    assert not ap.page_errors(), ap.context()


async def test_a_media_check_answered_404_while_hang_up_waits_shows_no_error(
    agent_page: AgentPage,
) -> None:
    """The audio stalls, so the page asks the server about its session (GET); the user hangs
    up meanwhile, and the GET's answer (404: Hang up's DELETE ended the session) comes back
    while Hang up still waits for its DELETE's answer, before the connection's close. It is
    Hang up's 404, not news (mutation: the session.hangingUp check in checkSession dropped:
    the page showed "The session is gone on the server" after the user hung up)."""
    ap = agent_page
    await connect(ap)
    checking = asyncio.Event()
    deleting = asyncio.Event()

    async def sessions(route: Any) -> None:
        if route.request.method == "GET":
            checking.set()
            await asyncio.wait_for(deleting.wait(), 1.5)  # within the check's 2 s timeout
            # What the server answers once Hang up's DELETE ended the session, back before
            # the connection's close reaches the page (its SCTP abort late, or lost).
            await route.fulfill(status=404, body="")
        elif route.request.method == "DELETE":
            deleting.set()
            await asyncio.sleep(0.3)  # a slow network (Hang up waits up to 1 s)
            await route.continue_()
        else:
            await route.continue_()

    await ap.page.route("**/sessions/*", sessions)
    await ap.page.evaluate(
        """() => {
          const pc = window.voiceAgent.pc;
          const getStats = pc.getStats.bind(pc);
          let frozen = null;  // the audio stops: the packet count stands still
          pc.getStats = async () => (frozen ??= await getStats());
        }"""
    )
    await asyncio.wait_for(checking.wait(), 10)
    await ap.page.click("#hangup")
    await ap.page.wait_for_selector('#state[data-state="closed"]', timeout=5000)
    await ap.page.wait_for_timeout(1200)  # past the DELETE's answer
    alert = await ap.page.text_content("#alert")
    assert await ap.page.is_hidden("#alert"), f"an error shown after Hang up: {alert!r}"
    assert await ap.page.get_attribute("#state", "data-state") == "closed"


async def test_an_id_said_again_after_its_failure_gets_an_item_of_its_own(
    agent_page: AgentPage,
) -> None:
    ap = agent_page
    await connect(ap)
    failed = [
        {"type": "speech.started", "id": "g"},
        {"type": "error", "code": "tts_failed", "message": "engine failed", "id": "g"},
        {"type": "speech.ended", "id": "g", "interrupted": True},
    ]
    again = [
        {"type": "speech.started", "id": "g"},
        {"type": "speech.segment", "id": "g", "text": "Hello."},
        {"type": "speech.ended", "id": "g", "interrupted": False},
    ]
    await ap.page.evaluate(FEED_JS, failed + again)
    items = await ap.page.evaluate(ITEMS_JS)
    assert [(i["id"], i["status"]) for i in items] == [("g", "error"), ("g", "done")], items


def _break_dtls(sdp: str) -> str:
    """The answer with every DTLS fingerprint wrong: ICE connects, then the DTLS handshake
    fails and Chromium calls the connection "failed" at once (any connection that fails
    before its data channel opens, in under CONNECT_TIMEOUT_MS, does the same)."""
    return re.sub(
        r"(a=fingerprint:\S+ )(\S+)",
        lambda m: m.group(1) + re.sub("[0-9A-Fa-f]{2}", "AB", m.group(2)),
        sdp,
    )


async def _route_offers(ap: AgentPage, *, break_new: bool, break_resume: bool) -> list[str]:
    """POST /offer through the real server, the answer's DTLS broken as asked; returns the
    list the kinds of the posts ("new" or "resume") are appended to."""
    posts: list[str] = []

    async def handle(route: Any) -> None:
        resuming = "resume" in (route.request.post_data or "")
        posts.append("resume" if resuming else "new")
        resp = await route.fetch()
        data = await resp.json()
        if resp.status == 200 and (break_resume if resuming else break_new):
            data["sdp"] = _break_dtls(data["sdp"])
        await route.fulfill(
            status=resp.status, content_type="application/json", body=json.dumps(data)
        )

    await ap.page.route("**/offer", handle)
    return posts


async def test_resume_tries_that_fail_before_their_channel_opens_stop_after_three(
    agent_page: AgentPage, live_server: Any
) -> None:
    """Bug: a resume try whose connection failed before its data channel opened was taken
    for a lost call (refreshState's "failed", the channel's close), which started another
    resume loop with tries of its own: ~15 resume offers in 5 s, until the server's rate
    limit ended it with "rate_limited". Giving up now also deletes the session on the
    server (it waited out its connect timeout and grace, holding a seat)."""
    ap = agent_page
    posts = await _route_offers(ap, break_new=False, break_resume=True)
    await connect(ap)
    # The connection lost on the client's side (a network drop would do the same).
    await ap.page.evaluate("() => window.voiceAgent.pc.close()")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if await ap.page.get_attribute("#state", "data-state") == "failed":
            break
        await ap.page.wait_for_timeout(250)
    resumes = posts.count("resume")
    alert = await ap.page.text_content("#alert")
    assert resumes == 3, f"{resumes} resume offers posted; alert={alert!r}{ap.context()}"
    assert await ap.page.get_attribute("#state", "data-state") == "failed"
    assert "rate_limited" not in (alert or ""), alert
    sessions = live_server.app[SESSIONS]
    for _ in range(40):  # the DELETE is sent without waiting for it
        if len(sessions) == 0:
            break
        await ap.page.wait_for_timeout(50)
    assert len(sessions) == 0, "the page gave up but left its session on the server"


async def test_a_first_connection_that_fails_before_its_channel_opens_is_not_resumed(
    agent_page: AgentPage,
) -> None:
    """Bug: a new call whose connection failed before its channel opened was "resumed" (a
    session token is known from the answer): the server refused it, and the page told the
    user "session_expired" for a call that never started, not that the connection failed."""
    ap = agent_page
    posts = await _route_offers(ap, break_new=True, break_resume=False)
    await ap.page.set_checked("#mic", False)
    await ap.page.click("#connect")
    await ap.page.wait_for_selector('#state[data-state="failed"]', timeout=20_000)
    await ap.page.wait_for_timeout(1500)  # a resume try would have been posted by now
    alert = await ap.page.text_content("#alert") or ""
    assert posts == ["new"], (posts, alert, ap.context())
    assert "before the data channel opened" in alert, alert


# A pagehide dispatched to the page: the requests it makes, and whether the call was still
# up (its peer connection not yet torn down) when each was made.
PAGEHIDE_JS = """
() => {
  const calls = [];
  const fetchBefore = window.fetch;
  window.fetch = (url, init = {}) => {
    calls.push({url: String(url), method: init.method || 'GET', keepalive: !!init.keepalive,
                callUp: window.voiceAgent.pc !== null});
    return fetchBefore(url, init);
  };
  window.dispatchEvent(new PageTransitionEvent('pagehide', {persisted: false}));
  return calls;
}
"""


async def test_a_page_going_away_tells_the_server_before_anything_else(
    agent_page: AgentPage, live_server: Any
) -> None:
    """Bug: the pagehide handler tore the whole call down (plots redrawn, microphone,
    channel, connection) before its DELETE. Firefox cuts a closing page's handler off
    part-way: the DELETE never went (a tab closed or left for another site: 0 of 3), and the
    session waited out its resume grace on the server, holding a seat. It goes first now,
    and alone."""
    ap = agent_page
    await connect(ap)
    session_id = await ap.page.evaluate("() => window.voiceAgent.sessionId")
    calls = await ap.page.evaluate(PAGEHIDE_JS)
    assert calls == [
        {"url": f"/sessions/{session_id}", "method": "DELETE", "keepalive": True, "callUp": True}
    ], calls
    sessions = live_server.app[SESSIONS]
    for _ in range(40):
        if len(sessions) == 0:
            break
        await ap.page.wait_for_timeout(50)
    assert len(sessions) == 0


async def test_a_page_back_from_the_cache_after_going_away_shows_the_call_over(
    agent_page: AgentPage,
) -> None:
    """Going away only sends the DELETE (see above): a page the browser kept in its back/
    forward cache and shows again must not look live with its session deleted."""
    ap = agent_page
    await connect(ap)

    async def lost(route: Any) -> None:  # the server never hears of it: its call stays up
        await route.abort() if route.request.method == "DELETE" else await route.continue_()

    await ap.page.route("**/sessions/*", lost)
    await ap.page.evaluate(
        "() => window.dispatchEvent(new PageTransitionEvent('pagehide', {persisted: true}))"
    )
    await ap.page.wait_for_timeout(300)
    assert await ap.page.get_attribute("#state", "data-state") == "connected"
    await ap.page.evaluate(
        "() => window.dispatchEvent(new PageTransitionEvent('pageshow', {persisted: true}))"
    )
    await ap.page.wait_for_selector('#state[data-state="closed"]')
    assert await ap.page.evaluate("() => window.voiceAgent.pc === null")


async def test_the_rooms_link_keeps_the_pages_access_token(browser: Any) -> None:
    """README: on a server with an auth secret the client is opened as ``/?token=<token>``.
    The page's own "Rooms" link dropped the token: the room page it opened had none, and
    Join was refused 401 ``unauthorized`` (found by review). The way back keeps it too."""
    token = mint_token(SECRET, ttl_s=600)
    config = Config(host="127.0.0.1", security=SecuritySettings(auth_secret=SECRET))
    async with serve(config, ToneEngine()) as server:
        context = await browser.new_context()
        try:
            page = await context.new_page()
            page.set_default_timeout(15_000)
            await page.goto(f"{server.url}/?token={token}")
            await page.wait_for_function("() => window.voiceAgent !== undefined")
            await page.click("text=Rooms")
            await page.wait_for_function("() => window.voiceRoom !== undefined")
            assert await page.get_attribute("#call-link", "href") is not None
            back = await page.evaluate("() => document.getElementById('call-link').search")
            assert back == f"?token={token}"
            await page.set_checked("#speak", False)
            await page.click("#join")
            await page.wait_for_function(
                "() => document.getElementById('state').dataset.state === 'connected'"
                " || !document.getElementById('alert').hidden"
            )
            alert = await page.text_content("#alert") if await page.is_visible("#alert") else None
            state = await page.get_attribute("#state", "data-state")
            assert (state, alert) == ("connected", None), page.url
        finally:
            await context.close()


@pytest.mark.parametrize(
    "server_config",
    [Config(host="127.0.0.1", port=0, limits=LimitSettings(speech_burst=1, speech_rate=0.01))],
    ids=["speech_burst_1"],
)
async def test_an_ask_the_server_refuses_shows_once_in_the_transcript(
    agent_page: AgentPage,
) -> None:
    """A refused Say marks its own item and adds nothing (the message in its title). A
    refused Ask marked its question's item and appended a second error item for the same
    refusal: the one refused question showed twice (found by review)."""
    ap = agent_page
    await connect(ap)
    await ap.page.evaluate("() => window.voiceAgent.say('use up the one speech request')")
    await ap.page.fill("#text", "a question")
    await ap.page.click("#ask")
    await ap.page.wait_for_function(
        "() => window.voiceAgent.events.some((e) => e.type === 'error')", timeout=5_000
    )
    (refused,) = [e for e in await test_browser.events(ap) if e.get("type") == "error"]
    assert refused["code"] == "rate_limited" and refused["id"].startswith("asked-"), refused
    items = [i for i in await ap.page.evaluate(ITEMS_JS) if i["status"] == "error"]
    assert [(i.get("id"), i["text"]) for i in items] == [(refused["id"], "a question")], items
    title = await ap.page.get_attribute(f'#transcript li[data-id="{refused["id"]}"]', "title")
    assert title == refused["message"]
