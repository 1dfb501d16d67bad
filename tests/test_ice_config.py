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
            ],
            "roomSlots": 4,
        }


@pytest.mark.parametrize(
    "url", ["stun.l.google.com:19302", "https://turn.example", "stun:a.example?transport=udp"]
)
def test_a_url_aiortc_cannot_parse_is_refused_at_start(url: str) -> None:
    """aiortc parses the list for every new peer connection: one URL it refuses (here
    without its stun: scheme) made every offer fail with 400 bad_sdp, and the server ran
    on. The Config refuses it now, whoever builds it (the CLI: a usage error)."""
    with pytest.raises(ValueError, match="is not a STUN or TURN URL"):
        Config(ice_servers=("stun:stun.example.org", url))


@pytest.mark.parametrize(
    "url",
    ["turn:relay.example?transport=sctp", "turns:relay.example?transport=udp", "stuns:a.example"],
)
def test_a_url_aiortc_parses_but_skips_is_refused_at_start(url: str) -> None:
    """aiortc parses these, then leaves them out of every peer connection without a word:
    no TURN relay, nothing logged. The check is what aiortc uses, not what it parses."""
    with pytest.raises(ValueError, match="is not a STUN or TURN URL aiortc uses"):
        Config(ice_servers=(url,))


@pytest.mark.parametrize(
    "url",
    [
        "stun:a.example",
        "stun:a.example:3478",
        "turn:relay.example",
        "turn:relay.example:3478?transport=tcp",
        "turns:relay.example:5349?transport=tcp",
    ],
)
def test_every_url_form_the_readme_lists_is_accepted(url: str) -> None:
    config = Config(ice_servers=(url,), ice_username="u", ice_credential="c")
    assert config.ice_servers == (url,)


@pytest.mark.parametrize(("username", "credential"), [(None, None), ("u", None), (None, "c")])
def test_a_turn_server_without_credentials_is_refused_at_start(
    username: str | None, credential: str | None
) -> None:
    """Chromium's RTCPeerConnection throws on a TURN entry without credentials: every
    Connect failed, while the server ran on. STUN needs none."""
    with pytest.raises(ValueError, match="needs --ice-username and --ice-credential"):
        Config(
            ice_servers=("stun:a.example", "turn:relay.example"),
            ice_username=username,
            ice_credential=credential,
        )
    assert Config(ice_servers=("stun:a.example",)).ice_servers == ("stun:a.example",)


@pytest.mark.parametrize(
    "url",
    ["stun:stun.example.com:99999", "stun:192.0.2.1:70000", "turn:turn.example.com:65536"],
)
def test_an_ice_server_whose_port_no_socket_can_use_is_refused_at_start(url: str) -> None:
    """aiortc parses any digits as a port: the server started, then every offer's ICE
    gathering failed to send to it (an OverflowError traceback per session, no reflexive
    or relayed candidate) where ``--port 70000`` is a usage error (found by review)."""
    with pytest.raises(ValueError, match="is not 1-65535"):
        Config(ice_servers=(url,), ice_username="u", ice_credential="c")
