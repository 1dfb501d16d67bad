"""A speech engine that fails to load: the server says why and keeps serving."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from agent.engine import EngineLoadError
from tests.conftest import LiveServer
from tests.doubles import ToneEngine

AUDIO_OFFER = "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n"


class BrokenEngine(ToneEngine):
    async def start(self) -> None:
        raise EngineLoadError("could not download the model: pass --model-dir")


class CrashedEngine(ToneEngine):
    """Loaded fine, then its worker died (a device error, say)."""

    @property
    def ready(self) -> bool:
        return False

    @property
    def failure(self) -> str | None:
        return "worker crashed: CUDA error"


@pytest.fixture
def tone_engine(request: pytest.FixtureRequest) -> ToneEngine:
    engine_class: type[ToneEngine] = getattr(request, "param", BrokenEngine)
    return engine_class()


async def test_engine_load_failure_is_reported_not_hidden(live_server: LiveServer) -> None:
    await asyncio.sleep(0.05)  # the load runs in the background
    async with aiohttp.ClientSession() as http:
        async with http.get(live_server.url + "/readyz") as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
            assert error["code"] == "engine_failed"
            assert "failed to load" in error["message"] and "--model-dir" in error["message"]
        async with http.get(live_server.url + "/healthz") as resp:
            assert resp.status == 200  # the process still serves
        offer = {"type": "offer", "sdp": AUDIO_OFFER}
        async with http.post(live_server.url + "/offer", json=offer) as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
            assert error["code"] == "engine_failed" and "--model-dir" in error["message"]


@pytest.mark.parametrize("tone_engine", [CrashedEngine], indirect=True)
async def test_an_engine_that_dies_after_start_is_reported(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(live_server.url + "/readyz") as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
            assert error == {
                "code": "engine_failed",
                "message": "the speech engine failed: worker crashed: CUDA error",
            }
        offer = {"type": "offer", "sdp": AUDIO_OFFER}
        async with http.post(live_server.url + "/offer", json=offer) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "engine_failed"
