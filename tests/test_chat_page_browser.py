"""The chat page in headless Chromium, driven over the DevTools protocol: a person types a
message, the host receives it, the reply goes through the outbox and appears on the page."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from aiohttp import web

from browser import browse, chromium
from http_helpers import chat_on_server, start_chat, stop_chat
from mdclaw.channels.base import InboundMessage
from mdclaw.outbox import OutboxWorker, RetryPolicy
from mdclaw.state import Database
from mdclaw.state.groups import GroupRow, upsert_group
from mdclaw.state.outbox import enqueue


def test_a_person_chats_with_the_main_group_from_the_browser(tmp_path: Path) -> None:
    chromium()

    async def main() -> None:
        db = Database(tmp_path / "state.db")
        upsert_group(db, GroupRow("main", "Admin chat", "hl:main", "@Andy", False, True,
                                  "config"))
        upsert_group(db, GroupRow("family", "Family", "hl:family", "@Andy", True, False,
                                  "config"))
        worker: OutboxWorker
        got: list[InboundMessage] = []

        def host(msg: InboundMessage) -> None:
            # what the orchestrator will do, in short: take the message, answer via outbox
            got.append(msg)
            with db.transaction() as c:
                enqueue(c, chat_jid=msg.chat_jid, kind="text",
                        text=f"echo: {msg.content} **bold** <b>not bold</b>",
                        source_group="main")
            worker.wake()

        ch = chat_on_server(db, secret="page-token", on_inbound=host,
                         assistant_name="Andy")
        await start_chat(ch)
        worker = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=3, base_delay=0.1))
        await worker.start()
        try:
            async with browse(f"{ch.url}/", tmp_path / "chromium-profile") as page:
                # the channel has a secret: the page asks for it
                await page.wait_for("document.getElementById('auth').classList"
                                    ".contains('shown')")
                await page.type_into("token", "page-token")
                await page.click("save-token")
                await page.wait_for("document.getElementById('chat').value === 'hl:main' && "
                                    "document.getElementById('status').textContent === "
                                    "'connected'")
                options = await page.js("[...document.querySelectorAll('#chat option')]"
                                        ".map(o => o.value)")
                assert options == ["hl:main", "hl:family"]

                await page.type_into("text", "hello from chromium")
                await page.click("send")
                replies = await page.wait_for(
                    "(() => { const r = [...document.querySelectorAll('.msg.out .body')]"
                    ".map(e => e.textContent); return r.length ? r : null })()")
                # the assistant's Markdown is rendered; HTML it writes is shown as text
                assert replies == ["echo: hello from chromium bold <b>not bold</b>"]
                assert await page.js("[...document.querySelectorAll('.msg.out strong')]"
                                     ".map(e => e.textContent)") == ["bold"]
                assert await page.js("document.querySelectorAll('.msg.out b').length") == 0
                mine = await page.js("[...document.querySelectorAll('.msg.in .body')]"
                                     ".map(e => e.textContent)")
                assert mine == ["hello from chromium"]
                assert await page.js("document.getElementById('text').value") == ""
                assert [(m.chat_jid, m.sender_name, m.content) for m in got] == [
                    ("hl:main", "me", "hello from chromium")]

                # typing shows while the assistant works, and goes with its reply
                await ch.set_typing("hl:main", True)
                await page.wait_for("document.getElementById('typing').textContent !== ''")
                await ch.send_message("hl:main", "done thinking")
                await page.wait_for("[...document.querySelectorAll('.msg.out .body')]"
                                    ".some(e => e.textContent === 'done thinking')")
                await page.wait_for("document.getElementById('typing').textContent === ''")
        finally:
            await worker.stop()
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def _png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A plain-colour RGB PNG."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    raw = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG (what Chromium's
    screenshots are)."""
    import struct
    import zlib

    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6)
            bpp = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line) if bpp == 3 else bytes(
            v for k, v in enumerate(line) if k % 4 != 3))
        prev = line
    return width, height, rows


def test_a_person_uploads_a_file_and_sees_the_image_the_agent_sends(tmp_path: Path,
                                                                     write_config) -> None:
    """Upload through the page's Attach button: the file lands in the group's folder; the
    agent's image comes back through the outbox and is shown inline (checked on a
    screenshot); another file comes as a download link."""
    import base64

    from mdclaw.config import load_config
    from mdclaw.media import save_all

    chromium()
    cfg = load_config(write_config())
    (cfg.data_dir / "groups" / "main").mkdir(parents=True)
    upload = tmp_path / "shopping list.txt"
    upload.write_bytes(b"milk\neggs\n")
    spool = tmp_path / "spool"
    spool.mkdir()
    red = _png(120, 80, (220, 20, 30))

    async def main() -> None:
        db = Database(tmp_path / "state.db")
        upsert_group(db, GroupRow("main", "Admin chat", "hl:main", "@Andy", False, True,
                                  "config"))
        worker: OutboxWorker
        saved_paths: list[str] = []

        async def host(msg: InboundMessage) -> None:
            # what the orchestrator does with a file: save it in the group's inbox
            for s in await save_all(cfg, "main", msg.attachments):
                saved_paths.append(s.container_path or f"not saved: {s.error}")
            (spool / "1-chart.png").write_bytes(red)
            (spool / "2-report.csv").write_bytes(b"a,b\n1,2\n")
            with db.transaction() as c:
                enqueue(c, chat_jid=msg.chat_jid, kind="file", file_path=str(spool / "1-chart.png"),
                        file_name="chart.png", text="here is the chart", source_group="main")
                enqueue(c, chat_jid=msg.chat_jid, kind="file",
                        file_path=str(spool / "2-report.csv"), file_name="report.csv",
                        source_group="main")
            worker.wake()

        ch = chat_on_server(db, secret="page-token", on_inbound=host,
                         files_dir=tmp_path / "http-files")
        await start_chat(ch)
        worker = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=3, base_delay=0.1))
        await worker.start()
        try:
            async with browse(f"{ch.url}/", tmp_path / "chromium-profile") as page:
                await page.wait_for("document.getElementById('auth').classList"
                                    ".contains('shown')")
                await page.type_into("token", "page-token")
                await page.click("save-token")
                await page.wait_for("document.getElementById('status').textContent === "
                                    "'connected'")
                await page.type_into("text", "my list")
                # what choosing a file in the Attach dialog does
                doc = await page.call("Runtime.evaluate",
                                      expression="document.getElementById('file')")
                await page.call("DOM.setFileInputFiles", files=[str(upload)],
                                objectId=doc["result"]["objectId"])
                await page.wait_for("document.querySelectorAll('img.inline').length === 1 && "
                                    "document.querySelector('img.inline').complete && "
                                    "document.querySelector('img.inline').naturalWidth > 0")
                day = saved_paths[0].split("/")[-2] if saved_paths else ""
                assert saved_paths == [f"/workspace/group/inbox/{day}/shopping list.txt"]
                inbox = cfg.data_dir / "groups" / "main" / "inbox" / day
                assert (inbox / "shopping list.txt").read_bytes() == b"milk\neggs\n"
                mine = await page.js("[...document.querySelectorAll('.msg.in .body')]"
                                     ".map(e => e.textContent)")
                assert mine == ["\U0001F4CE shopping list.txt\nmy list"]
                assert await page.js("document.querySelector('img.inline').naturalWidth") == 120
                link = await page.wait_for(
                    "(() => { const a = document.querySelector('a.download');"
                    " return a ? [a.download, a.href.slice(0, 5)] : null })()")
                assert link == ["report.csv", "blob:"]

                rect = await page.js("(() => { const r = document.querySelector('img.inline')"
                                     ".getBoundingClientRect(); return [r.x, r.y, r.width,"
                                     " r.height] })()")
                shot = await page.call("Page.captureScreenshot", format="png")
                png = base64.b64decode(shot["data"])
                (tmp_path / "chat.png").write_bytes(png)
                width, height, rows = _decode_png(png)
                colours = {row[i:i + 3] for row in rows[::7] for i in range(0, width * 3, 21)}
                assert len(colours) > 3, "the screenshot is blank"
                dpr = width / await page.js("window.innerWidth")
                cx, cy = int((rect[0] + rect[2] / 2) * dpr), int((rect[1] + rect[3] / 2) * dpr)
                r, g, b = rows[cy][cx * 3:cx * 3 + 3]
                assert r > 180 and g < 70 and b < 80, (r, g, b)  # the agent's red image
        finally:
            await worker.stop()
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_injected_inline_script_and_style_do_not_run_under_the_pages_csp(
        tmp_path: Path) -> None:
    """The page's own script and style sheet run; inline code that got into the page (an
    extra `<script>` in its HTML, an event-handler attribute in HTML put into the page, an
    inline `<style>`) does not, under the CSP the channel serves."""
    chromium()

    async def main() -> None:
        db = Database(tmp_path / "state.db")
        upsert_group(db, GroupRow("main", "Admin chat", "hl:main", "@Andy", False, True,
                                  "config"))
        ch = chat_on_server(db, on_inbound=lambda m: None)

        async def injected(request: web.Request) -> web.Response:
            # the real page with the real headers, plus inline code an attacker wants to run
            async with aiohttp.ClientSession() as http, http.get(f"{ch.url}/") as r:
                html = await r.text()
                headers = {k: v for k, v in r.headers.items()
                           if k in ("Content-Security-Policy", "X-Content-Type-Options",
                                    "Cache-Control", "X-Frame-Options")}
            assert "Content-Security-Policy" in headers
            evil = ("<script>window.injectedRan = true; document.title = 'pwned';</script>"
                    "<style>body { background-color: rgb(255, 0, 0) !important; }</style>")
            return web.Response(text=html.replace("</head>", evil + "</head>"),
                                        content_type="text/html", headers=headers)

        ch.server.add_route("GET", "/injected", injected)
        await start_chat(ch)
        try:
            async with browse(f"{ch.url}/injected", tmp_path / "chromium-profile") as page:
                # the page's own script runs (it loads the chats) and its style sheet applies
                await page.wait_for("document.getElementById('status').textContent === "
                                    "'connected'")
                assert await page.js("getComputedStyle(document.body).display") == "flex"
                # the injected script did not run, the injected style does not apply
                assert await page.js("window.injectedRan === undefined")
                assert await page.js("document.title") == "mdclaw"
                assert await page.js("getComputedStyle(document.body).backgroundColor") != (
                    "rgb(255, 0, 0)")
                # HTML put into the page (as a reply's html is) cannot run a handler either:
                # the image fails to load, its onerror attribute is refused
                await page.js("""(() => {
                    const log = document.getElementById('log');
                    log.insertAdjacentHTML('beforeend',
                        '<img id="evil" src="data:," onerror="window.handlerRan = true">');
                    document.getElementById('evil').addEventListener(
                        'error', () => { window.errorSeen = true; });
                })()""")
                await page.wait_for("window.errorSeen === true")
                assert await page.js("window.handlerRan === undefined")
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())
