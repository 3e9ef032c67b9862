"""Wrong tokens are throttled per client address, on a real server: the operator page's login
and the chat's bearer header are one door (mdclaw.webserver.TokenGate), so guesses made at
either count together and a lockout holds at both. The window's clock is injected: nothing
waits for it to pass."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import pytest

from http_helpers import chat_on_server, start_chat, stop_chat
from mdclaw.channels.http import HttpChannel
from mdclaw.operator.access import COOKIE, Access
from mdclaw.operator.web import PREFIX, build_app
from mdclaw.state import Database
from mdclaw.state.groups import GroupRow, upsert_group
from mdclaw.throttle import TokenThrottle, client_key

SECRET = "the-right-token-0123456789"
OTHER_ADDRESS = "127.0.0.2"  # all of 127/8 is loopback on Linux


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def serve(tmp_path: Path, throttle: TokenThrottle) -> tuple[HttpChannel, Database]:
    db = Database(tmp_path / "state.db")
    upsert_group(db, GroupRow("main", "Admin", "hl:main", "@Andy", False, True, "config"))
    ch = chat_on_server(db, secret=SECRET, on_inbound=lambda m: None, throttle=throttle)
    # the login, session and static routes need nothing of the daemon
    ch.server.mount(PREFIX, build_app(None, Access(ch.gate)))
    await start_chat(ch)
    return ch, db


def session(ch: HttpChannel, local: str = "127.0.0.1") -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        ch.url, connector=aiohttp.TCPConnector(local_addr=(local, 0)),
        headers={"Origin": ch.url}, cookie_jar=aiohttp.CookieJar(unsafe=True))


async def login(http: aiohttp.ClientSession, token: str) -> tuple[int, dict[str, str]]:
    async with http.post(f"{PREFIX}/login", json={"token": token}) as r:
        await r.read()
        return r.status, dict(r.headers)


def test_wrong_logins_lock_the_address_out_until_the_window_passes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    throttle = TokenThrottle(max_failures=5, window=60.0, clock=clock)

    async def main() -> None:
        ch, db = await serve(tmp_path, throttle)
        try:
            async with session(ch) as http, session(ch, OTHER_ADDRESS) as other:
                for i in range(4):
                    status, _ = await login(http, f"guess-{i}")
                    assert status == 401
                    clock.now += 1
                # the fifth wrong token within the window starts the lockout
                status, headers = await login(http, "guess-4")
                assert status == 429
                assert 1 <= int(headers["Retry-After"]) <= 60
                # the right token is refused too while it lasts: guessing cannot go on
                clock.now += 30
                status, headers = await login(http, SECRET)
                assert status == 429
                assert int(headers["Retry-After"]) == 30
                assert COOKIE not in {c.key for c in http.cookie_jar}
                # and the same door is shut for the chat's bearer header and the API
                async with http.get("/groups",
                                    headers={"Authorization": f"Bearer {SECRET}"}) as r:
                    assert r.status == 429 and "Retry-After" in r.headers
                async with http.get(f"{PREFIX}/api/session",
                                    headers={"Authorization": f"Bearer {SECRET}"}) as r:
                    assert r.status == 429
                # another address is not affected
                status, _ = await login(other, SECRET)
                assert status == 200
                async with other.get(f"{PREFIX}/api/session") as r:
                    assert r.status == 200 and (await r.json())["auth"] == "cookie"
                # once the window has passed, the right token logs in
                clock.now += 31
                status, _ = await login(http, SECRET)
                assert status == 200
                async with http.get(f"{PREFIX}/api/session") as r:
                    assert r.status == 200
                # a right token cleared the count: four more wrong ones are only 401s
                for i in range(4):
                    assert (await login(http, f"again-{i}"))[0] == 401
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())
    started = [r.getMessage() for r in caplog.records if "wrong tokens" in r.getMessage()]
    assert len(started) == 1, started
    assert "127.0.0.1" in started[0]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "guess-" not in logged and SECRET not in logged


def test_guesses_at_the_chat_and_at_the_login_count_together(tmp_path: Path) -> None:
    clock = Clock()
    throttle = TokenThrottle(max_failures=4, window=60.0, clock=clock)

    async def main() -> None:
        ch, db = await serve(tmp_path, throttle)
        try:
            async with session(ch) as http:
                for i in range(2):
                    async with http.get("/messages", params={"jid": "hl:main"},
                                        headers={"Authorization": f"Bearer g{i}"}) as r:
                        assert r.status == 401
                # no token at all is not a guess
                for _ in range(5):
                    async with http.get("/groups") as r:
                        assert r.status == 401
                assert (await login(http, "g2"))[0] == 401
                async with http.get(f"{PREFIX}/api/overview",
                                    headers={"Authorization": "Bearer g3"}) as r:
                    assert r.status == 429
                async with http.post("/message", json={"text": "hi"},
                                     headers={"Authorization": f"Bearer {SECRET}"}) as r:
                    assert r.status == 429
                # the page's own files hold no data and stay served
                async with http.get("/chat.js") as r:
                    assert r.status == 200
                clock.now += 61
                async with http.get("/groups",
                                    headers={"Authorization": f"Bearer {SECRET}"}) as r:
                    assert r.status == 200
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_the_throttle_keeps_a_bounded_number_of_addresses() -> None:
    clock = Clock()
    t = TokenThrottle(max_failures=3, window=60.0, max_clients=100, clock=clock)
    for _ in range(2):
        assert t.failed("10.0.0.1") is None
    assert t.failed("10.0.0.1") == 60.0  # locked out
    for i in range(10_000):
        t.failed(f"10.1.{i // 256}.{i % 256}")
        assert len(t) <= 100
    # a flood of other addresses pushes older entries out, never past the cap
    assert len(t) == 100
    # entries whose window has passed are dropped before recent ones
    clock.now += 61
    t.failed("10.9.9.9")
    assert len(t) == 1
    with pytest.raises(ValueError, match="positive"):
        TokenThrottle(max_failures=0)


def test_an_ipv6_client_is_counted_by_its_64_network() -> None:
    # One host holds a whole /64: changing the address within it must not start a new count.
    a, b = "2001:db8:1:2::1", "2001:db8:1:2:ffff:ffff:ffff:fffe"
    assert client_key(a) == client_key(b) == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key(a)
    assert client_key("::ffff:192.0.2.7") == client_key("192.0.2.7") == "192.0.2.7"
    assert client_key(None) == client_key("") == "unknown"
    assert client_key("not an address") == "not an address"
    clock = Clock()
    t = TokenThrottle(max_failures=3, window=60.0, clock=clock)
    for i in range(2):
        assert t.failed(client_key(f"2001:db8:1:2::{i + 1:x}")) is None
    assert t.failed(client_key("2001:db8:1:2::abcd")) == 60.0
    assert t.locked(client_key(b)) is not None
    assert t.locked(client_key("2001:db8:1:3::1")) is None
