"""A full turn in headless Chromium: the page's microphone (a WAV played by Chromium's fake
capture device) -> the real server's VAD -> STT -> LLM stream -> the spoken reply.

Chromium plays ``--use-file-for-fake-audio-capture=<wav>%noloop`` as the microphone from the
moment the page opens it (measured here with /usr/bin/chromium 156, headless). The WAV is
written by the test: 2.5 s of silence (the call connects meanwhile), the espeak-ng clip, then
silence. The STT and LLM services are real HTTP servers (tests/services.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from agent.config import Config
from agent.conversation_config import ServiceSettings
from signaling.keys import SESSIONS
from tests.clips import SPEECH_WAV, read_wav, write_wav
from tests.conftest import serve
from tests.doubles import ToneEngine
from tests.services import FakeLLM, FakeSTT
from tests.test_browser import (
    CHROMIUM,
    HAVE_CHROMIUM,
    INBOUND_JS,
    REQUIRE_BROWSER,
    AgentPage,
    connect,
    page_hearing,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

# (tests.test_browser skips this module too when playwright is not installed.)

LEAD_SILENCE_S = 2.5
WAIT_EVENT_JS = """
async ({type, timeoutMs}) => {
  const t0 = performance.now();
  while (performance.now() - t0 < timeoutMs) {
    const e = window.voiceAgent.events.find((x) => x.type === type);
    if (e) return e;
    await new Promise((r) => setTimeout(r, 20));
  }
  return null;
}
"""


def mic_wav(path: Path) -> Path:
    speech, rate = read_wav(SPEECH_WAV)
    silence = np.zeros(int(LEAD_SILENCE_S * rate), dtype=np.float32)
    write_wav(path, np.concatenate([silence, speech, silence, silence]), rate)
    return path


@pytest_asyncio.fixture
async def mic_page(tmp_path: Path) -> AsyncIterator[tuple[AgentPage, FakeSTT, FakeLLM]]:
    if not HAVE_CHROMIUM:
        if REQUIRE_BROWSER:
            pytest.fail(f"Chromium not found at {CHROMIUM}")
        pytest.skip(f"Chromium not found at {CHROMIUM}")
    wav = mic_wav(tmp_path / "mic.wav")
    async with FakeSTT() as stt, FakeLLM() as llm:
        assert isinstance(stt, FakeSTT) and isinstance(llm, FakeLLM)
        config = Config(
            host="127.0.0.1",
            services=ServiceSettings(stt_base_url=stt.url, llm_base_url=llm.url),
        )
        async with serve(config, ToneEngine()) as server:
            # The clip plays 2.5 s after the call starts: the model must be loaded by then.
            await server.app[SESSIONS].vad_pool.load()
            async with page_hearing(server.url, wav) as ap:
                yield ap, stt, llm


async def wait_event(ap: AgentPage, type_: str, timeout_s: float = 10) -> dict[str, Any]:
    event = await ap.page.evaluate(WAIT_EVENT_JS, {"type": type_, "timeoutMs": timeout_s * 1000})
    events = await ap.page.evaluate("() => window.voiceAgent.events")
    assert event is not None, f"no {type_}: {json.dumps(events)}{ap.context()}"
    return dict(event)


async def test_full_turn_from_the_browser_microphone(
    mic_page: tuple[AgentPage, FakeSTT, FakeLLM],
) -> None:
    ap, stt, llm = mic_page
    stt.transcripts.append("what time is it")
    llm.replies.append(["It is", " noon", ".", " Anything", " else", "?"])
    llm.token_delay_s = 0.1
    await connect(ap, mic=True)
    assert await ap.page.evaluate("() => window.voiceAgent.micTrack !== null"), ap.context()
    started = await wait_event(ap, "user.speech.started", 15)
    assert await ap.page.is_visible("#listening")
    ended = await wait_event(ap, "user.speech.ended")
    transcript = await wait_event(ap, "user.transcript")
    assert started["id"] == ended["id"] == transcript["id"]
    assert transcript["text"] == "what time is it"
    reply_end = await wait_event(ap, "speech.ended", 15)
    assert reply_end["interrupted"] is False
    # The upload held the clip's speech (Chromium's capture, echo cancellation and all).
    speech, rate = read_wav(SPEECH_WAV)
    assert abs(stt.uploads[0].duration_s() - speech.size / rate) < 1.0, stt.uploads[0]
    assert llm.requests[0]["messages"][-1] == {"role": "user", "content": "what time is it"}
    events = await ap.page.evaluate("() => window.voiceAgent.events")
    captions = [e["text"] for e in events if e["type"] == "speech.segment"]
    assert captions == ["It is noon.", "Anything else?"], events
    # The page shows the user's words beside the agent's reply.
    user_item = ap.page.locator(f'#transcript li[data-id="{transcript["id"]}"]')
    assert await user_item.get_attribute("data-role") == "user"
    assert await user_item.get_attribute("data-status") == "heard"
    assert (await user_item.locator(".text").text_content()) == "what time is it"
    reply_item = ap.page.locator(f'#transcript li[data-id="{reply_end["id"]}"]')
    assert (await reply_item.locator(".text").text_content()) == "It is noon. Anything else?"
    assert await reply_item.get_attribute("data-status") == "done"
    # And the reply was heard: the inbound audio level rose while it played.
    stats = await ap.page.evaluate(INBOUND_JS)
    assert stats and stats["totalAudioEnergy"] > 0, stats
    assert not ap.page_errors(), ap.context()
