"""The chat page as an app, in headless Chromium: installable (manifest, icons, a service
worker that serves the page offline), notifications by Web Push to a push service of the
test's own while no page is open, each message's state (sending, delivered, failed with
retry), and accessible (axe-core, keyboard) at 1280x800 and 390x844, light and dark.

DOCS_SCREENSHOTS=<folder> keeps the screenshots (docs/images holds the ones docs/web.md
shows: `DOCS_SCREENSHOTS=docs/images pytest tests/test_chat_app_browser.py -k looks`)."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from browser import browse, check_accessible, chromium
from http_helpers import chat_on_server, start_chat, stop_chat
from mdclaw.channels.base import ChannelError, InboundMessage
from mdclaw.channels.http import PAGE_FILES, HttpChannel
from mdclaw.channels.webpush import WebPush
from mdclaw.markup import to_html
from mdclaw.outbox import OutboxWorker, RetryPolicy
from mdclaw.state import Database
from mdclaw.state.groups import GroupRow, upsert_group
from mdclaw.state.outbox import enqueue, list_outbox
from mdclaw.webassets import PageAssets
from mdclaw.webserver import SECURITY_HEADERS, TokenGate, WebServer
from waiting import wait_until_async

CONNECTED = "document.getElementById('status').textContent === 'connected'"


def groups(db: Database) -> None:
    upsert_group(db, GroupRow("main", "Admin chat", "hl:main", "@Andy", False, True, "config"))
    upsert_group(db, GroupRow("family", "Family", "hl:family", "@Andy", True, False,
                              "config"))


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# ---------------------------------------------------------------------------- installable
def test_manifest_service_worker_and_the_page_offline(tmp_path: Path) -> None:
    chromium()

    async def main() -> None:
        db = Database(tmp_path / "state.db")
        groups(db)
        ch = chat_on_server(db, on_inbound=lambda m: None)
        await start_chat(ch)
        stopped = False
        try:
            async with browse(f"{ch.url}/", tmp_path / "chromium-profile") as page:
                await page.wait_for(CONNECTED)
                # the manifest parses (Chromium's own reading of it) and says what installs
                found = await page.call("Page.getAppManifest")
                assert found["errors"] == [], found["errors"]
                manifest = json.loads(found["data"])
                assert manifest["display"] == "standalone"
                assert manifest["start_url"] == "/" and manifest["name"]
                assert manifest["theme_color"].startswith("#")
                icons = {(i["sizes"], i.get("purpose", "any")) for i in manifest["icons"]}
                assert {("192x192", "any"), ("512x512", "any"), ("512x512", "maskable")} <= icons
                # every icon, and the apple-touch-icon the page names, loads as a PNG its size
                srcs = json.dumps([i["src"] for i in manifest["icons"]])
                sizes = await page.js("Promise.all([...document.querySelectorAll("
                                      "'link[rel=apple-touch-icon], link[rel=icon]')]"
                                      f".map(l => l.href).concat({srcs})" + """
                    .map(src => new Promise((ok, bad) => { const i = new Image();
                    i.onload = () => ok([src.replace(location.origin, ''), i.naturalWidth]);
                    i.onerror = () => bad(src); i.src = src; })))""")
                assert dict(sizes) == {"/apple-touch-icon.png": 180, "/icon-192.png": 192,
                                       "/icon-512.png": 512, "/icon-maskable-512.png": 512}
                # the service worker registers at the root and takes the page
                await page.wait_for("navigator.serviceWorker.controller !== null")
                scope = await page.js("navigator.serviceWorker.getRegistration()"
                                      ".then(r => r.scope)")
                assert scope == f"{ch.url}/"
                kept = await page.wait_for(
                    "caches.open('mdclaw-shell-v1').then(c => c.keys()).then(k => k.length "
                    ">= 6 ? k.map(r => new URL(r.url).pathname).sort() : null)")
                assert {"/", "/chat.js", "/chat.css", "/mdclaw.css"} <= set(kept)
                # the server goes away: the page still opens, and says it is offline
                await stop_chat(ch)
                stopped = True
                await page.js("location.reload()")
                await page.wait_for("document.readyState === 'complete' && "
                                    "!document.getElementById('offline').hidden")
                assert await page.js("document.getElementById('status').textContent") == (
                    "offline")
                assert "offline" in await page.js("document.getElementById('offline')"
                                                  ".textContent")
                # the shell is the real one: its script ran and its style sheets apply
                assert await page.js("getComputedStyle(document.body).display") == "flex"
                assert await page.js("getComputedStyle(document.querySelector('.column'))"
                                     ".maxWidth") == "800px"
        finally:
            if not stopped:
                await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_service_worker_and_manifest_are_served_with_the_page_headers(tmp_path: Path) -> None:
    async def main() -> None:
        db = Database(tmp_path / "state.db")
        ch = chat_on_server(db, secret="tok", on_inbound=lambda m: None)
        await start_chat(ch)
        try:
            async with aiohttp.ClientSession(ch.url) as http:
                async with http.get("/") as r:
                    csp = dict(d.strip().split(" ", 1) for d in
                               r.headers["Content-Security-Policy"].split(";"))
                assert csp["worker-src"] == "'self'" and csp["manifest-src"] == "'self'"
                assert "unsafe-inline" not in str(csp)
                for path, ctype in (("/sw.js", "text/javascript"),
                                    ("/manifest.webmanifest", "application/manifest+json"),
                                    ("/icon-192.png", "image/png"),
                                    ("/apple-touch-icon.png", "image/png")):
                    async with http.get(path) as r:  # public, like the page: no token
                        assert r.status == 200, path
                        assert r.headers["Content-Type"].split(";")[0] == ctype, path
                        assert r.headers["X-Content-Type-Options"] == "nosniff"
                        body = await r.read()
                    if ctype == "image/png":
                        assert body[:8] == b"\x89PNG\r\n\x1a\n"
                        assert "charset" not in r.headers["Content-Type"]
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_the_chat_page_weighs_under_150_kb_compressed() -> None:
    """Every file the chat page loads (HTML, script, both style sheets, the service worker,
    manifest and icons), gzip-compressed, no bundler."""
    assets = PageAssets("mdclaw.channels", PAGE_FILES, headers=SECURITY_HEADERS,
                        page_csp="default-src 'none'")
    sizes = {route or "/": len(gzip.compress(assets.body(route), 9))
             for route in set(PAGE_FILES) if PAGE_FILES[route] != "chat.html" or route == ""}
    total = sum(sizes.values())
    assert total < 150 * 1024, sizes
    assert set(sizes) >= {"/", "chat.js", "chat.css", "mdclaw.css", "sw.js",
                          "manifest.webmanifest", "icon-512.png"}
    html = assets.body("").decode()
    assert "<script>" not in html and "<style" not in html and " style=" not in html
    print(f"chat page: {total} bytes compressed: {sizes}")


# ---------------------------------------------------------------------------- states
class FlakyChat(HttpChannel):
    """The local chat whose deliveries fail while `broken` (as a service that is down)."""

    # Delivered through send_message, as a chat service's (the outbox would otherwise
    # write the page's rows itself, in its own transaction, and never call it).
    writes_locally = False
    broken = False
    seen: asyncio.Event  # a broken delivery waits for it: the page sees "sending" first

    async def send_message(self, jid: str, text: str, *, reply_to: str | None = None,
                           sender: str | None = None) -> str | None:
        if self.broken:
            await self.seen.wait()
            raise ChannelError("the chat is unreachable (test)")
        return await super().send_message(jid, text, reply_to=reply_to, sender=sender)


STATE_LOG = """(() => {
  window.__states = [];
  const note = (e) => { if (e.classList && e.classList.contains('msg') && e.dataset.state)
    window.__states.push([e.dataset.outbox ? 'reply' : e.classList.contains('in') ? 'mine'
                          : 'out', e.querySelector('.body').textContent, e.dataset.state]); };
  new MutationObserver((records) => { for (const r of records) {
    if (r.type === 'attributes') note(r.target);
    else for (const n of r.addedNodes) note(n); } })
    .observe(document.getElementById('log'), {subtree: true, childList: true,
                                               attributes: true,
                                               attributeFilter: ['data-state']});
})()"""


def states_of(log: list[list[str]], who: str, text: str) -> list[str]:
    out: list[str] = []
    for w, t, s in log:
        if w == who and t == text and (not out or out[-1] != s):
            out.append(s)
    return out


def test_message_states_sending_delivered_and_failed_with_retry(tmp_path: Path) -> None:
    chromium()

    async def main() -> None:
        db = Database(tmp_path / "state.db")
        groups(db)
        worker: OutboxWorker
        got: list[InboundMessage] = []
        ch = FlakyChat(db, WebServer("127.0.0.1:0", TokenGate(None)), on_inbound=got.append,
                       assistant_name="Andy")
        await start_chat(ch)
        worker = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=2, base_delay=0.2))
        ch.wake_outbox = worker.wake
        with db.transaction() as c:  # a reply that failed before the page was opened
            old = enqueue(c, chat_jid="hl:main", kind="text", text="from yesterday",
                          source_group="main")
            c.execute("UPDATE outbox SET status = 'failed', last_error = 'gave up after 5 "
                      "attempt(s): bot was blocked' WHERE id = ?", (old,))
        await worker.start()
        try:
            async with browse(f"{ch.url}/", tmp_path / "chromium-profile") as page:
                await page.wait_for(CONNECTED)
                # shown at once (not after the first long poll's 25 s)
                await page.wait_for(f"!!document.querySelector('[data-outbox=\"{old}\"]"
                                    "[data-state=failed]')", timeout=8)
                await page.js(STATE_LOG)
                # a person's message: sending, then delivered once the server took it
                await page.type_into("text", "hello there")
                await page.press("Enter")
                await page.wait_for("!!document.querySelector('.msg.in[data-state=delivered]')")
                log = await page.js("window.__states")
                assert states_of(log, "mine", "hello there") == ["sending", "delivered"], log
                assert [m.content for m in got] == ["hello there"]
                assert "Delivered" in await page.js("document.querySelector('.msg.in .meta')"
                                                    ".textContent")

                # a reply the outbox gives up on: sending, then failed with the reason
                ch.broken = True
                with db.transaction() as c:
                    row = enqueue(c, chat_jid="hl:main", kind="text", text="the answer is 42",
                                  source_group="main")
                ch.seen = asyncio.Event()
                worker.wake()
                await page.wait_for(f"!!document.querySelector('[data-outbox=\"{row}\"]"
                                    "[data-state=sending]')")
                ch.seen.set()
                failed = f"document.querySelector('[data-outbox=\"{row}\"][data-state=failed]')"
                await page.wait_for("!!" + failed, timeout=30)
                assert [r.status for r in list_outbox(db) if r.id == row] == ["failed"]
                log = await page.js("window.__states")
                assert states_of(log, "reply", "the answer is 42") == ["sending", "failed"], log
                note = await page.js(f"{failed}.querySelector('.state').textContent")
                assert "gave up after 2 attempt(s)" in note and "unreachable" in note, note
                await check_accessible(page)  # the failed state and its Retry, both modes
                # Retry, from the keyboard: the reply goes out and shows as delivered
                ch.broken = False
                await page.js(f"{failed}.querySelector('button.retry').focus()")
                await page.press("Enter")
                await page.wait_for(
                    "[...document.querySelectorAll('.msg.out[data-seq]')].some(e => "
                    "e.querySelector('.body').textContent.includes('the answer is 42') && "
                    "e.dataset.state === 'delivered') && "
                    f"!document.querySelector('[data-outbox=\"{row}\"]')", timeout=30)
                assert [r.status for r in list_outbox(db) if r.id == row] == ["sent"]
                log = await page.js("window.__states")
                assert states_of(log, "reply", "the answer is 42")[-1] == "sending", log
        finally:
            await worker.stop()
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


# ---------------------------------------------------------------------------- push
class PushService:
    """A push service of the test's own: records what is posted to /push/<name>; /push/gone
    answers 410 (the device unsubscribed)."""

    def __init__(self) -> None:
        self.got: list[tuple[str, dict[str, str], bytes]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        async def take(request: web.Request) -> web.Response:
            self.got.append((request.match_info["name"],
                             {k.lower(): v for k, v in request.headers.items()},
                             await request.read()))
            return web.Response(status=410 if request.match_info["name"] == "gone" else 201)

        app = web.Application()
        app.router.add_post("/push/{name}", take)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def device() -> tuple[Any, bytes, dict[str, str]]:
    """A subscribing browser's keys: (private key, auth secret, keys as the browser sends)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    auth = os.urandom(16)
    public = key.public_key().public_bytes(serialization.Encoding.X962,
                                           serialization.PublicFormat.UncompressedPoint)
    return key, auth, {"p256dh": b64url(public), "auth": b64url(auth)}


def check_vapid(headers: dict[str, str], server_key: str, audience: str) -> dict[str, Any]:
    """The VAPID token of a push (RFC 8292): signed (ES256) by the server's key, for the push
    service's origin, not expired; returns its claims."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

    auth = headers["authorization"]
    assert auth.startswith("vapid "), auth
    parts = dict(p.strip().split("=", 1) for p in auth[len("vapid "):].split(","))
    assert parts["k"] == server_key
    head, claims, sig = parts["t"].split(".")
    assert json.loads(unb64url(head))["alg"] == "ES256"
    raw = unb64url(sig)
    public = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), unb64url(server_key))
    public.verify(encode_dss_signature(int.from_bytes(raw[:32], "big"),
                                       int.from_bytes(raw[32:], "big")),
                  f"{head}.{claims}".encode(), ec.ECDSA(hashes.SHA256()))  # raises if forged
    found: dict[str, Any] = json.loads(unb64url(claims))
    assert found["aud"] == audience and found["exp"] > time.time()
    assert found["sub"].startswith("mailto:")
    return found


def test_a_reply_is_pushed_to_subscribed_devices_when_no_page_is_open(tmp_path: Path) -> None:
    chromium()
    import http_ece

    async def main() -> None:
        db = Database(tmp_path / "state.db")
        groups(db)
        push = WebPush(tmp_path / "data" / "http")
        ch = chat_on_server(db, secret="tok", on_inbound=lambda m: None, push=push)
        ch.watch_grace = 0.5
        service = PushService()
        await service.start()
        await start_chat(ch)
        key, auth, keys = device()
        try:
            async with browse(f"{ch.url}/", tmp_path / "chromium-profile") as page:
                await page.wait_for("document.getElementById('auth').classList"
                                    ".contains('shown')")
                assert await page.axe() == []  # the token prompt too
                await page.type_into("token", "tok")
                await page.click("save-token")
                await page.wait_for(CONNECTED)
                # the page offers notifications; it subscribes a device as a browser does
                # (Chromium's own subscription needs Google's push service: the test's stands
                # in), through the chat's endpoints and with its token
                await page.wait_for("!document.getElementById('notify').hidden")
                server_key = await page.js("""fetch('/push/key', {headers: {Authorization:
                    'Bearer tok'}}).then(r => r.json()).then(d => d.key)""")
                for name in ("phone", "gone"):
                    status = await page.js(f"""fetch('/push/subscribe', {{method: 'POST',
                        headers: {{Authorization: 'Bearer tok', 'Content-Type':
                        'application/json'}}, body: JSON.stringify({{jid: 'hl:main',
                        subscription: {{endpoint: '{service.url}/push/{name}',
                        keys: {json.dumps(keys)}}}}})}}).then(r => r.status)""")
                    assert status == 200
                assert len(push.subscriptions("hl:main")) == 2
                # while the page has the chat open, a reply is not pushed
                await ch.send_message("hl:main", "you see this already")
                await page.wait_for("document.body.innerText.includes('you see this already')")
                await push.drain()
                assert service.got == []
            # no page now
            await wait_until_async(lambda: not ch.is_watched("hl:main"), 10,
                                   what="the chat to have no page")
            await ch.send_message("hl:main", "the secret recipe is butter")
            await wait_until_async(lambda: len(service.got) == 2, 20, what="two pushes")
            await push.drain()
            (name, headers, body), = [g for g in service.got if g[0] == "phone"]
            check_vapid(headers, server_key, service.url)
            assert headers["content-encoding"] == "aes128gcm" and int(headers["ttl"]) > 0
            plain = http_ece.decrypt(body, private_key=key, auth_secret=auth,
                                     version="aes128gcm")
            payload = json.loads(plain)
            assert payload == {"jid": "hl:main", "title": "Admin chat"}  # no message text
            assert b"secret" not in plain and b"butter" not in body
            # the push service said the other device is gone: it is removed
            assert [s["endpoint"] for s in push.subscriptions("hl:main")] == [
                f"{service.url}/push/phone"]
            assert json.loads((tmp_path / "data" / "http" / "push.json").read_text())[0][
                "endpoint"].endswith("/push/phone")
            assert (tmp_path / "data" / "http" / "vapid.pem").stat().st_mode & 0o777 == 0o600
            # another chat's reply goes to that chat's devices only: none
            service.got.clear()
            await ch.send_message("hl:family", "not for the phone")
            await push.drain()
            assert service.got == []
            # unsubscribed: no more pushes
            async with aiohttp.ClientSession(ch.url, headers={"Authorization": "Bearer tok"}
                                             ) as http:
                async with http.post("/push/unsubscribe", json={
                        "jid": "hl:main", "endpoint": f"{service.url}/push/phone"}) as r:
                    assert (await r.json())["removed"] is True
                async with http.post("/push/subscribe", json={
                        "jid": "hl:main", "subscription": {
                            "endpoint": "http://evil.example/push", "keys": keys}}) as r:
                    assert r.status == 400  # plain http only to a loopback push service
            async with aiohttp.ClientSession(ch.url) as http, http.post(
                    "/push/subscribe", json={"jid": "hl:main", "subscription": {}}) as r:
                assert r.status == 401  # behind the chat's token
            await ch.send_message("hl:main", "nobody hears this")
            await push.drain()
            assert service.got == []
        finally:
            await stop_chat(ch)
            await service.stop()
            db.close()

    asyncio.run(main())


def test_the_push_payload_holds_the_text_only_when_the_config_allows_it(
        tmp_path: Path) -> None:
    off = WebPush(tmp_path / "a")
    on = WebPush(tmp_path / "b", include_text=True)
    assert json.loads(off.payload("hl:x", "Family", "milk")) == {"jid": "hl:x",
                                                                   "title": "Family"}
    assert json.loads(on.payload("hl:x", "Family", "milk" * 100))["text"] == ("milk" * 50)
    # one key, made once, kept
    first = off.public_key()
    assert WebPush(tmp_path / "a").public_key() == first != on.public_key()
    assert len(unb64url(first)) == 65


# ---------------------------------------------------------------------------- looks, a11y
REPLY = """Here is the **shopping** plan:

| item | qty | price |
|:-----|----:|------:|
| milk | 2 | 1.20 |
| eggs | 12 | 3.50 |

```python
total = sum(prices)  # this first line must not be covered by any button
print(total)
```
"""


def seed_transcript(ch: HttpChannel) -> None:
    for direction, who, text in (("in", "Ana", "What do we need for the weekend?"),
                                 ("in", "Ana", "And can you check the budget?"),
                                 ("out", "Andy", REPLY),
                                 ("out", "Andy", "Anything else?")):
        ch._record("hl:main", direction, "text", content=text, sender=who, sender_name=who)


def test_the_chat_page_looks_right_and_axe_finds_nothing_serious(tmp_path: Path) -> None:
    chromium()
    keep = os.environ.get("DOCS_SCREENSHOTS")
    shots = Path(keep) if keep else tmp_path / "shots"
    shots.mkdir(parents=True, exist_ok=True)

    async def main() -> None:
        db = Database(tmp_path / "state.db")
        groups(db)
        ch = chat_on_server(db, on_inbound=lambda m: None, assistant_name="Andy")
        await start_chat(ch)
        seed_transcript(ch)
        await ch.set_typing("hl:main", True)
        try:
            async with browse(f"{ch.url}/", tmp_path / "chromium-profile") as page:
                await page.viewport(1280, 800)
                await page.wait_for(CONNECTED + " && document.querySelectorAll('.msg')"
                                    ".length === 4 && document.getElementById('typing')"
                                    ".textContent === 'Andy is writing'")
                assert await page.js("document.getElementById('chat-name').textContent") == (
                    "Admin chat")
                # a centred column of at most 800 px at 1280
                xs = await page.js("[...document.querySelectorAll('.msg')].map(e => {"
                                   " const r = e.getBoundingClientRect(); return [r.left,"
                                   " r.right] })")
                assert min(x[0] for x in xs) >= 230 and max(x[1] for x in xs) <= 1050, xs
                # consecutive bubbles grouped (the name once), one day separator
                assert await page.js("[...document.querySelectorAll('.msg')]"
                                     ".map(e => e.classList.contains('cont'))") == [
                    False, True, False, True]
                assert await page.js("[...document.querySelectorAll('.day')]"
                                     ".map(e => e.textContent)") == ["Today"]
                # numeric columns right-aligned, as the Markdown's |--:| says
                aligns = await page.js("[...document.querySelectorAll('.md tr:nth-child(1)"
                                       " td')].map(e => getComputedStyle(e).textAlign)")
                assert aligns == ["left", "right", "right"], aligns
                # icon buttons with names for screen readers
                for b in ("attach", "send", "mic"):
                    label = await page.js(f"document.getElementById('{b}')"
                                          ".getAttribute('aria-label')")
                    assert label, b
                await check_accessible(page, shots, "chat")
                for size, (w, h) in (("desktop", (1280, 800)), ("phone", (390, 844))):
                    await page.viewport(w, h)
                    # nothing scrolls sideways; the Copy button is beside the code, not on it
                    widths = await page.js("[document.documentElement.scrollWidth,"
                                           " window.innerWidth]")
                    assert widths[0] <= widths[1], (size, widths)
                    overlap = await page.js("""(() => {
                        const b = document.querySelector('.copy').getBoundingClientRect();
                        const c = document.querySelector('.md pre').getBoundingClientRect();
                        return !(b.bottom <= c.top || b.top >= c.bottom || b.right <= c.left
                                 || b.left >= c.right); })()""")
                    assert overlap is False, size
                    header = await page.js("document.querySelector('.bar')"
                                           ".getBoundingClientRect().height")
                    assert header < 64, (size, header)  # one line, also on a phone
                await page.call("Emulation.clearDeviceMetricsOverride")
                # keyboard only: Tab goes header -> messages -> the code -> message box ->
                # send; every stop shows where focus is
                await page.js("document.activeElement.blur()")
                order: list[str] = []
                for _ in range(14):
                    await page.press("Tab")
                    order.append(await page.js(
                        "(() => { const e = document.activeElement; const o ="
                        " getComputedStyle(e).outlineStyle; return (e.id || e.className ||"
                        " e.tagName) + (o === 'none' ? ' NO-FOCUS-RING' : '') })()"))
                    if order[-1].startswith("send"):
                        break
                assert not [o for o in order if "NO-FOCUS-RING" in o], order
                pos = {name: order.index(name) for name in
                       ("chat", "log", "attach", "text", "mic", "send") if name in order}
                assert list(pos) == ["chat", "log", "attach", "text", "mic", "send"], order
                assert pos["chat"] < pos["log"] < pos["text"] < pos["send"], order
                assert any(o.startswith("copy") for o in order[pos["log"]:pos["attach"]])
                # the menu (your name, the operator page) opens with Enter, closes with Escape
                await page.js("document.querySelector('#settings summary').focus()")
                await page.press("Enter")
                await page.wait_for("document.getElementById('settings').open")
                assert await page.axe() == []
                await page.press("Escape")
                await page.wait_for("!document.getElementById('settings').open && "
                                    "document.activeElement.tagName === 'SUMMARY'")
                # and typing + Enter sends
                await page.js("document.getElementById('text').focus()")
                await page.call("Input.insertText", text="from the keyboard")
                await page.press("Enter")
                await page.wait_for("[...document.querySelectorAll('.msg.in')].some(e =>"
                                    " e.querySelector('.body').textContent === 'from the "
                                    "keyboard' && e.dataset.state === 'delivered')")
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())
    if keep:
        shrink(shots)


def shrink(folder: Path) -> None:
    """Screenshots for the docs: a 64-colour palette keeps them small."""
    PIL = pytest.importorskip("PIL.Image")
    for png in folder.glob("chat-*.png"):
        img = PIL.open(png).convert("RGB").quantize(colors=64)
        img.save(png, optimize=True)


def test_dark_mode_follows_the_system_and_no_bell_without_push(tmp_path: Path) -> None:
    chromium()

    async def main() -> None:
        db = Database(tmp_path / "state.db")
        groups(db)
        ch = chat_on_server(db, on_inbound=lambda m: None)
        await start_chat(ch)
        try:
            async with browse(f"{ch.url}/", tmp_path / "chromium-profile") as page:
                await page.wait_for(CONNECTED)
                await page.color_scheme("light")
                light = await page.js("getComputedStyle(document.body).backgroundColor")
                await page.color_scheme("dark")
                dark = await page.js("getComputedStyle(document.body).backgroundColor")
                assert light == "rgb(255, 255, 255)" and dark == "rgb(17, 19, 22)"
                # this chat has no push: no bell (hidden stays hidden under the style sheets)
                assert await page.js("getComputedStyle(document.getElementById('notify'))"
                                     ".display") == "none"
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())



def test_retry_takes_only_a_failed_reply_of_the_same_chat(tmp_path: Path) -> None:
    async def main() -> None:
        db = Database(tmp_path / "state.db")
        groups(db)
        ch = chat_on_server(db, on_inbound=lambda m: None)
        woken: list[int] = []
        ch.wake_outbox = lambda: woken.append(1)
        await start_chat(ch)
        with db.transaction() as c:
            mine = enqueue(c, chat_jid="hl:main", kind="text", text="a", source_group="main")
            other = enqueue(c, chat_jid="hl:family", kind="text", text="b",
                            source_group="family")
            c.execute("UPDATE outbox SET status = 'failed', last_error = 'gave up' "
                      "WHERE id IN (?, ?)", (mine, other))
            waiting = enqueue(c, chat_jid="hl:main", kind="text", text="**c** <b>x</b>",
                              source_group="main")
        try:
            async with aiohttp.ClientSession(ch.url) as http:
                async with http.get("/messages", params={"jid": "hl:main"}) as r:
                    shown = (await r.json())["outbox"]
                assert [(p["id"], p["state"], p["error"]) for p in shown] == [
                    (mine, "failed", "gave up"), (waiting, "sending", None)]
                # a waiting reply comes rendered, as it will be once delivered
                assert [p["html"] for p in shown] == [
                    to_html("a"), to_html("**c** <b>x</b>")]
                assert "<strong>c</strong>" in shown[1]["html"] and "<b>" not in shown[1]["html"]
                for jid, row, status in (("hl:main", other, 404), ("hl:main", waiting, 409),
                                         ("hl:main", "1", 400), ("hl:main", mine, 200)):
                    async with http.post("/retry", json={"jid": jid, "id": row}) as r:
                        assert r.status == status, (row, await r.text())
            assert {r.id: r.status for r in list_outbox(db)} == {
                mine: "pending", other: "failed", waiting: "pending"}
            assert woken == [1]
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


PASTE_AND_DROP = """(() => {
  const png = Uint8Array.from(atob('%s'), c => c.charCodeAt(0));
  const pasted = new DataTransfer();
  pasted.items.add(new File([png], 'pasted.png', {type: 'image/png'}));
  const text = document.getElementById('text');
  text.value = 'look at this';
  text.dispatchEvent(new ClipboardEvent('paste', {clipboardData: pasted, bubbles: true,
                                                  cancelable: true}));
  const dropped = new DataTransfer();
  dropped.items.add(new File(['a,b\\n1,2\\n'], 'dropped.csv', {type: 'text/csv'}));
  document.getElementById('log').dispatchEvent(new DragEvent('dragenter',
    {dataTransfer: dropped, bubbles: true}));
  const shown = document.body.classList.contains('dragging');
  document.getElementById('log').dispatchEvent(new DragEvent('drop',
    {dataTransfer: dropped, bubbles: true, cancelable: true}));
  return shown;
})()"""


def test_paste_drop_and_a_voice_note_recorded_in_the_page(tmp_path: Path) -> None:
    """An image pasted into the message box (the text as its caption), a file dropped on the
    page, and a voice note recorded with the microphone button (Chromium's fake microphone)
    reach the host as attachments; the voice note as a voice note, which the host
    transcribes as any channel's."""
    chromium()
    from test_chat_page_browser import _png

    async def main() -> None:
        db = Database(tmp_path / "state.db")
        groups(db)
        got: list[InboundMessage] = []
        files: dict[str, tuple[str, bytes]] = {}

        def host(msg: InboundMessage) -> None:
            got.append(msg)

        ch = chat_on_server(db, on_inbound=host)
        await start_chat(ch)
        try:
            async with browse(f"{ch.url}/", tmp_path / "chromium-profile") as page:
                await page.wait_for(CONNECTED)
                image = _png(8, 8, (10, 200, 30))
                assert await page.js(PASTE_AND_DROP % base64.b64encode(image).decode())
                await wait_until_async(lambda: len(got) == 2, 20, what="the two files")
                assert await page.js("document.body.classList.contains('dragging')") is False
                for m in got:
                    att = m.attachments[0]
                    files[att.name or ""] = (att.kind, await att.fetch(1 << 20))
                assert files["pasted.png"] == ("image", image)
                assert files["dropped.csv"] == ("document", b"a,b\n1,2\n")
                assert {m.content for m in got} == {"look at this", ""}
                # a voice note: press the microphone, then press it again to send
                await page.click("mic")
                await page.wait_for("document.getElementById('mic')"
                                    ".getAttribute('aria-pressed') === 'true'")
                await page.wait_for("Number(document.getElementById('mic').dataset.recorded)"
                                    " > 4000")
                await page.click("mic")
                await wait_until_async(lambda: len(got) == 3, 20, what="the voice note")
                voice = got[2].attachments[0]
                assert voice.kind == "voice" and (voice.mime or "").startswith("audio/")
                data = await voice.fetch(1 << 22)
                assert len(data) > 1000 and data[:4] in (b"\x1aE\xdf\xa3", b"OggS")
                assert await page.js("document.getElementById('mic')"
                                     ".getAttribute('aria-pressed')") == "false"
                await page.wait_for("document.querySelectorAll('.msg.in[data-state=delivered]')"
                                    ".length === 3")
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_the_daemons_chat_gets_push_as_the_config_says(tmp_path: Path) -> None:
    from mdclaw.channels.registry import build_channels
    from mdclaw.config import ConfigError, load_config

    db = Database(tmp_path / "state.db")
    try:
        for push, expect in (("", True), ("push: {enabled: false}", False),
                             ("push: {include_text: true, contact: 'https://example.org'}",
                              True)):
            text = (f"data_dir: {tmp_path / 'data'}\n"
                    "groups:\n  main: {name: Admin, jid: \"hl:main\", main: true}\n"
                    f"channels:\n  http: {{{push}}}\n")
            cfg = load_config(tmp_path / "c.yaml", text=text)
            server = WebServer("127.0.0.1:0", TokenGate(None))
            (ch,) = build_channels(cfg, db, server)
            assert isinstance(ch, HttpChannel)
            assert (ch.push is not None) is expect, push
            if ch.push is not None:
                assert ch.push.folder == tmp_path / "data" / "http"
                assert ch.push.include_text is ("include_text" in push)
        with pytest.raises(ConfigError, match="contact"):
            load_config(tmp_path / "c.yaml", text=text.replace("https://example.org",
                                                                "example.org"))
    finally:
        db.close()
