"""The chat page in headless Chromium: the assistant's Markdown rendered as HTML (and nothing
unsafe running), multi-line messages, times in the viewer's zone, "load older", and a layout
that fits a 390 px phone as well as a desktop."""

from __future__ import annotations

import asyncio
import base64
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from browser import DevTools, browse, chromium
from http_helpers import chat_on_server, start_chat, stop_chat
from mdclaw.channels.base import InboundMessage
from mdclaw.channels.http import HttpChannel
from mdclaw.state import Database
from mdclaw.state.groups import GroupRow, upsert_group
from test_chat_page_browser import _decode_png
from waiting import wait_until_async

RICH = """## Shopping plan

Buy **three** things:

- milk
- eggs
- bread

| item | price |
|------|-------|
| milk | 1.20 |
| eggs | 2.50 |

```python
total = 1.20 + 2.50  # a long line that is wider than any phone screen could ever show at once
```

See [the shop](https://shop.example.org/list) or [mail us](mailto:shop@example.org)."""

XSS = """<img src=x onerror="window.__xss = 'img'">

[click me](javascript:window.__xss='link') and [data](data:text/html,<script>x</script>)

<script>window.__xss = 'script'</script>

![pic](javascript:window.__xss='image') <a href="javascript:window.__xss='a'">raw</a>

<svg onload="window.__xss='svg'"></svg>"""


async def _session(tmp_path: Path, got: list[InboundMessage]) -> tuple[Database, HttpChannel]:
    db = Database(tmp_path / "state.db")
    upsert_group(db, GroupRow("main", "Admin chat", "hl:main", "@Andy", False, True, "config"))
    ch = chat_on_server(db, on_inbound=got.append, assistant_name="Andy")
    await start_chat(ch)
    return db, ch


async def _key(page: DevTools, key: str, *, shift: bool = False) -> None:
    mods = 8 if shift else 0
    await page.call("Input.dispatchKeyEvent", type="rawKeyDown", key=key, code=key,
                    windowsVirtualKeyCode=13, modifiers=mods)
    await page.call("Input.dispatchKeyEvent", type="char", key=key, code=key, text="\r",
                    modifiers=mods)
    await page.call("Input.dispatchKeyEvent", type="keyUp", key=key, code=key,
                    windowsVirtualKeyCode=13, modifiers=mods)


def test_markdown_renders_unsafe_markup_stays_inert_and_newlines_arrive(tmp_path: Path) -> None:
    chromium()

    async def main() -> None:
        got: list[InboundMessage] = []
        db, ch = await _session(tmp_path, got)
        try:
            async with browse(f"{ch.url}/", tmp_path / "profile") as page:
                # the viewer is in India, reading British English
                await page.call("Emulation.setTimezoneOverride", timezoneId="Asia/Kolkata")
                await page.call("Emulation.setLocaleOverride", locale="en-GB")
                await page.wait_for("document.getElementById('status').textContent === "
                                    "'connected'")
                await ch.send_message("hl:main", RICH)
                await ch.send_message("hl:main", XSS)
                await page.wait_for("document.querySelectorAll('.msg.out').length === 2")
                shape = await page.js("""(() => {
                    const b = document.querySelectorAll('.msg.out .body')[0];
                    const a = b.querySelector('a[href^="https:"]');
                    return {
                      h2: b.querySelector('h2').textContent,
                      strong: b.querySelector('p strong').textContent,
                      items: [...b.querySelectorAll('ul > li')].map(e => e.textContent),
                      th: [...b.querySelectorAll('table th')].map(e => e.textContent),
                      td: [...b.querySelectorAll('table td')].map(e => e.textContent),
                      code: b.querySelector('pre code').textContent,
                      lang: b.querySelector('pre code').className,
                      copy: b.querySelectorAll('.code > .code-bar > button.copy').length
                        * b.querySelectorAll('.code > .code-bar + pre').length,
                      link: [a.href, a.target, a.rel, a.textContent],
                      mail: b.querySelector('a[href^="mailto:"]').getAttribute('href'),
                    }; })()""")
                assert shape == {
                    "h2": "Shopping plan", "strong": "three",
                    "items": ["milk", "eggs", "bread"], "th": ["item", "price"],
                    "td": ["milk", "1.20", "eggs", "2.50"],
                    "code": "total = 1.20 + 2.50  # a long line that is wider than any phone "
                            "screen could ever show at once\n",
                    "lang": "language-python", "copy": 1,
                    "link": ["https://shop.example.org/list", "_blank",
                             "noopener noreferrer", "the shop"],
                    "mail": "mailto:shop@example.org"}

                # the XSS reply: shown as text, nothing of it runs or exists as markup
                xss = await page.js("""(() => {
                    const b = document.querySelectorAll('.msg.out .body')[1];
                    const bad = [...document.querySelectorAll('#log *')].filter(e =>
                        [...e.attributes].some(a => a.name.startsWith('on')
                            || /^\\s*(javascript|data):/i.test(a.value)));
                    return { flag: window.__xss === undefined ? null : window.__xss,
                             scripts: document.querySelectorAll('#log script').length,
                             imgs: b.querySelectorAll('img, svg').length,
                             bad: bad.length,
                             links: [...b.querySelectorAll('a')].map(a => a.getAttribute('href')),
                             text: b.textContent }; })()""")
                assert xss["flag"] is None and xss["scripts"] == 0 and xss["imgs"] == 0
                assert xss["bad"] == 0
                assert all(h is None or h.startswith(("http:", "https:", "mailto:"))
                           for h in xss["links"]), xss["links"]
                assert "<img src=x onerror=" in xss["text"]
                assert "<script>window.__xss = 'script'</script>" in xss["text"]

                # times in the viewer's zone
                row = db.query_one("SELECT created_at FROM http_messages ORDER BY seq LIMIT 1")
                local = datetime.fromisoformat(row[0].replace("Z", "+00:00")).astimezone(
                    ZoneInfo("Asia/Kolkata"))
                shown = await page.js("document.querySelector('.msg.out time').textContent")
                assert shown == local.strftime("%H:%M"), shown

                # a person's text is text, even when it looks like markup
                await page.type_into("text", "<img src=x onerror=\"window.__xss='mine'\"> "
                                             "**not bold**")
                await _key(page, "Enter")
                await page.wait_for("document.querySelectorAll('.msg.in').length === 1")
                assert await page.js("document.querySelector('.msg.in .body').innerHTML") == (
                    "&lt;img src=x onerror=\"window.__xss='mine'\"&gt; **not bold**")

                # multi-line: Shift+Enter makes a new line, pasted newlines stay, Enter sends
                await page.type_into("text", "first line")
                await _key(page, "Enter", shift=True)
                await page.call("Input.insertText", text="pasted\ncode()")
                assert await page.js("document.getElementById('text').value") == (
                    "first line\npasted\ncode()")
                await _key(page, "Enter")
                await page.wait_for("document.querySelectorAll('.msg.in').length === 2")
                # the bubble is drawn as the page posts; the server's hand-off is its own event
                await wait_until_async(lambda: len(got) == 2)
                assert got[-1].content == "first line\npasted\ncode()"
                shown_in = await page.js("document.querySelectorAll('.msg.in .body')[1]"
                                         ".innerText")
                assert shown_in == "first line\npasted\ncode()"
                assert await page.js("document.getElementById('text').value") == ""
                assert await page.js("window.__xss === undefined")
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


async def _layout(page: DevTools, width: int, height: int, mobile: bool) -> dict[str, Any]:
    await page.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                    deviceScaleFactor=1, mobile=mobile)
    await page.wait_for(f"window.innerWidth === {width}")
    return await page.js("""(() => {
        const s = document.getElementById('status'), r = s.getBoundingClientRect();
        return { scroll: document.scrollingElement.scrollWidth, inner: window.innerWidth,
                 statusFits: s.scrollWidth <= s.clientWidth && r.right <= window.innerWidth
                             && r.left >= 0,
                 status: s.textContent,
                 sendRight: document.getElementById('send').getBoundingClientRect().right,
                 bodies: document.querySelectorAll('.msg .body').length }; })()""")


def _check_screenshot(png: bytes, width: int) -> None:
    w, h, rows = _decode_png(png)
    assert w == width
    colours = {row[i:i + 3] for row in rows[::5] for i in range(0, w * 3, 15)}
    assert len(colours) > 5, "the screenshot is blank"


def test_layout_fits_a_phone_and_a_desktop_and_older_messages_load(tmp_path: Path) -> None:
    chromium()

    async def main() -> None:
        got: list[InboundMessage] = []
        db, ch = await _session(tmp_path, got)
        for i in range(120):
            if i % 2:
                await ch.send_message("hl:main", f"answer **{i}**")
            else:
                ch._record("hl:main", "in", "text", content=f"question {i}", sender="me",
                           sender_name="me")
        await ch.send_message("hl:main", RICH)
        try:
            async with browse(f"{ch.url}/", tmp_path / "profile") as page:
                await page.wait_for("document.getElementById('status').textContent === "
                                    "'connected' && document.querySelectorAll('.msg').length")
                seqs = "[...document.querySelectorAll('.msg')].map(e => +e.dataset.seq)"
                assert await page.js(seqs) == list(range(72, 122))  # the newest 50
                assert await page.js("document.getElementById('older').offsetParent !== null")

                for width, height, mobile in ((1280, 800, False), (390, 844, True)):
                    lay = await _layout(page, width, height, mobile)
                    assert lay["scroll"] <= lay["inner"] == width, lay
                    assert lay["statusFits"] and lay["status"] == "connected", lay
                    assert lay["sendRight"] <= width, lay
                    shot = await page.call("Page.captureScreenshot", format="png")
                    png = base64.b64decode(shot["data"])
                    (tmp_path / f"chat-{width}.png").write_bytes(png)
                    _check_screenshot(png, width)

                # load older, twice: all 121 rows, in order, and the button goes
                await page.click("older")
                await page.wait_for(f"{seqs}.length === 100")
                assert await page.js(seqs) == list(range(22, 122))
                await page.click("older")
                await page.wait_for(f"{seqs}.length === 121")
                assert await page.js(seqs) == list(range(1, 122))
                assert await page.js("document.getElementById('older').offsetParent === null")
                texts = await page.js("[...document.querySelectorAll('.msg .body')]"
                                      ".slice(0, 2).map(e => e.textContent)")
                assert texts == ["question 0", "answer 1"]
                lay = await _layout(page, 390, 844, True)
                assert lay["scroll"] <= 390, lay
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())
