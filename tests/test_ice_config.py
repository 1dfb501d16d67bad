"""The browser gets the server's STUN/TURN list (TURN with its credentials)."""

from __future__ import annotations

import aiohttp
import pytest

from agent.config import Config
from tests.conftest import LiveServer


@pytest.fixture
def server_config() -> Config:
    return Config(
        host="127.0.0.1",
        ice_servers=("stun:stun.example.org:3478", "turn:turn.example.org:3478"),
        ice_username="alice",
        ice_credential="secret",
    )


async def test_ice_servers_are_served(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http, http.get(live_server.url + "/ice-servers") as resp:
        assert await resp.json() == {
            "iceServers": [
                {"urls": "stun:stun.example.org:3478"},
                {
                    "urls": "turn:turn.example.org:3478",
                    "username": "alice",
                    "credential": "secret",
                },
            ]
        }
