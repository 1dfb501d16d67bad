"""CORS: only allow-listed origins get CORS headers; without a list, same-origin only."""

from __future__ import annotations

import aiohttp
import pytest

from agent.config import Config, SecuritySettings
from tests.conftest import LiveServer

ALLOWED = "https://app.example"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


class TestAllowList:
    @pytest.fixture
    def server_config(self) -> Config:
        return Config(
            host="127.0.0.1",
            security=SecuritySettings(
                # Written otherwise than browsers send it: still that origin.
                cors_origins=(ALLOWED, "HTTPS://Other.Example:443/"),
                auth_secret="s" * 32,
            ),
        )

    async def test_preflight_is_answered_for_allowed_origins_only(
        self, live_server: LiveServer
    ) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.options(
                live_server.url + "/offer", headers={"Origin": ALLOWED, **PREFLIGHT}
            ) as resp:
                assert resp.status == 204
                assert resp.headers["Access-Control-Allow-Origin"] == ALLOWED
                assert "POST" in resp.headers["Access-Control-Allow-Methods"]
                assert "Authorization" in resp.headers["Access-Control-Allow-Headers"]
                # A WHEP resume sends its session token in this header.
                assert "X-Session-Token" in resp.headers["Access-Control-Allow-Headers"]
                assert "Origin" in resp.headers.getall("Vary")
            async with http.options(
                live_server.url + "/offer", headers={"Origin": "https://evil.example", **PREFLIGHT}
            ) as resp:
                assert resp.status == 403
                assert (await resp.json())["error"]["code"] == "forbidden"
                assert "Access-Control-Allow-Origin" not in resp.headers

    async def test_an_origin_is_allowed_however_the_list_spells_it(
        self, live_server: LiveServer
    ) -> None:
        """Browsers send Origin serialized (lower case, no default port). An entry written
        with capitals or :443 was compared as a raw string and never matched."""
        other = "https://other.example"
        async with (
            aiohttp.ClientSession() as http,
            http.options(
                live_server.url + "/offer", headers={"Origin": other, **PREFLIGHT}
            ) as resp,
        ):
            assert resp.status == 204
            assert resp.headers["Access-Control-Allow-Origin"] == other

    async def test_answers_echo_only_allowed_origins_errors_included(
        self, live_server: LiveServer
    ) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.get(live_server.url + "/healthz", headers={"Origin": ALLOWED}) as r:
                assert r.headers["Access-Control-Allow-Origin"] == ALLOWED
                assert "Retry-After" in r.headers["Access-Control-Expose-Headers"]
                # WHEP's 201 carries the session token a resume needs: the page must read it.
                assert "X-Session-Token" in r.headers["Access-Control-Expose-Headers"]
            # A page on an allowed origin can read why it was refused.
            async with http.post(
                live_server.url + "/offer", json={}, headers={"Origin": ALLOWED}
            ) as resp:
                assert resp.status == 401
                assert resp.headers["Access-Control-Allow-Origin"] == ALLOWED
            for origin in ("https://evil.example", "null", ALLOWED + ".evil.example"):
                async with http.get(
                    live_server.url + "/healthz", headers={"Origin": origin}
                ) as resp:
                    assert resp.status == 200
                    assert "Access-Control-Allow-Origin" not in resp.headers

    async def test_a_whep_players_patch_gets_a_405_it_can_read(
        self, live_server: LiveServer
    ) -> None:
        """WHEP's 201 carries an ETag, which tells a player it may PATCH the resource
        (trickle ICE, ICE restart). The server does neither and answers 405 with Allow; but
        PATCH was not among the preflight's methods, so a cross-origin player's PATCH failed
        as a network error before it could see the 405 (found by review)."""
        # An ICE restart's PATCH must carry If-Match (RFC 9725 4.3): not among the allowed
        # headers, the preflight failed it all the same (found by review).
        patch = {
            "Access-Control-Request-Method": "PATCH",
            "Access-Control-Request-Headers": "authorization, content-type, if-match",
        }
        async with aiohttp.ClientSession() as http:
            async with http.options(
                live_server.url + "/whep/abc", headers={"Origin": ALLOWED, **patch}
            ) as resp:
                assert resp.status == 204
                methods = resp.headers["Access-Control-Allow-Methods"].split(", ")
                assert "PATCH" in methods
                allowed = resp.headers["Access-Control-Allow-Headers"].lower().split(", ")
                assert {"authorization", "content-type", "if-match"} <= set(allowed)
            async with http.patch(
                live_server.url + "/whep/abc",
                data="a=end-of-candidates\r\n",
                headers={"Origin": ALLOWED, "Content-Type": "application/trickle-ice-sdpfrag"},
            ) as resp:
                assert resp.status == 405
                assert resp.headers["Access-Control-Allow-Origin"] == ALLOWED
                assert "PATCH" not in resp.headers["Allow"]


async def test_no_allow_list_means_same_origin_only(live_server: LiveServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(live_server.url + "/healthz", headers={"Origin": ALLOWED}) as resp:
            assert "Access-Control-Allow-Origin" not in resp.headers
        async with http.options(
            live_server.url + "/offer", headers={"Origin": ALLOWED, **PREFLIGHT}
        ) as resp:
            assert resp.status == 403
            assert "Access-Control-Allow-Origin" not in resp.headers


@pytest.mark.parametrize("entry", ["*", "app.example", "https://app.example/path", "https://"])
def test_an_entry_that_is_no_origin_is_refused(entry: str) -> None:
    """ "*" (or a bare host, a path) allowed nothing, silently: now the config says so."""
    with pytest.raises(ValueError, match="not an origin"):
        SecuritySettings(cors_origins=(entry,))


def test_origins_are_kept_as_browsers_send_them() -> None:
    """Browsers send the host in lower case, an IDN host in punycode, an IPv6 host
    compressed, and no default port: an entry written otherwise never matched."""
    settings = SecuritySettings(
        cors_origins=(
            "HTTPS://App.Example:443",
            "http://[0:0:0:0:0:0:0:1]:8080/",
            "capacitor://localhost",
            "https://Bücher.example",
            "http://Web_UI:3000",  # a docker-compose name: IDNA refuses "_", browsers do not
            "https://👍.example",
        )
    )
    assert settings.cors_origins == (
        "https://app.example",
        "http://[::1]:8080",
        "capacitor://localhost",
        "https://xn--bcher-kva.example",
        "http://web_ui:3000",
        "https://xn--yp8h.example",
    )


def test_the_null_origin_is_refused_with_its_reason() -> None:
    """``Origin: null`` comes from file:// pages and any site's sandboxed iframes: listing
    it would allow them all."""
    with pytest.raises(ValueError, match="any site can send it"):
        SecuritySettings(cors_origins=("null",))
