"""Headless Chromium for the browser tests of the chat page and the operator page, driven
over the DevTools protocol: start it on a URL, evaluate script in the page, set the viewport
(desktop 1280x800, phone 390x844), emulate dark mode, take screenshots and run axe-core.

Chromium comes from Debian (/usr/bin/chromium), axe-core from the npm registry (MPL-2.0):
.ci/setup-tools installs both, axe-core into /var/cache/mdclaw-ci/axe; `MDCLAW_AXE_CORE`
names another axe.min.js. Without them a test is skipped, except in CI, where it fails.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from waiting import wait_until_async

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]

DESKTOP = (1280, 800)
PHONE = (390, 844)
SIZES = {"desktop": DESKTOP, "phone": PHONE}
AXE_DEFAULT = Path("/var/cache/mdclaw-ci/axe/node_modules/axe-core/axe.min.js")


def _missing(what: str, how: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is missing; .ci/setup-tools installs it")
    pytest.skip(f"{what} is not installed ({how})")


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    _missing("chromium", "apt-get install chromium")
    raise AssertionError("unreachable")


def axe_core() -> str:
    """axe-core's source (axe.min.js): from MDCLAW_AXE_CORE or the CI cache."""
    path = Path(os.environ.get("MDCLAW_AXE_CORE") or AXE_DEFAULT)
    if not path.is_file():
        _missing(f"axe-core ({path})",
                 "npm install --prefix /var/cache/mdclaw-ci/axe axe-core@4.14.1")
    return path.read_text()


class DevTools:
    """The DevTools protocol calls the tests need, over one page's websocket. Events that
    arrive while a call waits for its answer are kept in `events` (method, params)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.next_id = 0
        self.events: list[tuple[str, dict[str, Any]]] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        my_id = self.next_id
        await self.ws.send_json({"id": my_id, "method": method, "params": params})
        deadline = time.monotonic() + 60  # events may come first, but not for ever
        while True:
            msg = await self.ws.receive_json(timeout=max(deadline - time.monotonic(), 0.1))
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return dict(msg["result"])
            if "method" in msg:
                self.events.append((msg["method"], msg.get("params", {})))

    async def js(self, expression: str) -> Any:
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                            awaitPromise=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression[:200]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        guarded = f"(() => {{ try {{ return ({expression}); }} catch (e) {{ return null; }} }})()"
        try:  # the page may still be loading
            return await wait_until_async(lambda: self.js(guarded), timeout, interval=0.1,
                                          what=f"the page to satisfy {expression!r}")
        except AssertionError as e:
            body = await self.js("document.body ? document.body.innerText : ''")
            raise AssertionError(f"{e}; page shows:\n{body}") from None

    async def type_into(self, element_id: str, text: str) -> None:
        await self.js(f"document.getElementById({json.dumps(element_id)}).focus()")
        await self.call("Input.insertText", text=text)

    async def click(self, element_id: str) -> None:
        await self.js(f"document.getElementById({json.dumps(element_id)}).click()")

    async def press(self, key: str, *, shift: bool = False) -> None:
        """A real key press (Tab, Enter, Space...) as the keyboard sends it."""
        codes = {"Tab": 9, "Enter": 13, " ": 32, "Escape": 27}
        text = {"Enter": "\r", " ": " "}.get(key, "")
        base = {"key": key, "code": "Space" if key == " " else key,
                "windowsVirtualKeyCode": codes.get(key, 0), "modifiers": 8 if shift else 0}
        await self.call("Input.dispatchKeyEvent", type="keyDown", text=text, **base)
        await self.call("Input.dispatchKeyEvent", type="keyUp", **base)

    async def viewport(self, width: int, height: int) -> None:
        """Emulate a screen of `width` x `height` CSS pixels (a phone below 600 px)."""
        await self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                        deviceScaleFactor=1, mobile=width < 600)
        await self.wait_for(f"window.innerWidth === {width}")

    async def color_scheme(self, scheme: str) -> None:
        """prefers-color-scheme: 'light' or 'dark'."""
        await self.call("Emulation.setEmulatedMedia", features=[
            {"name": "prefers-color-scheme", "value": scheme}])
        await self.wait_for(f"matchMedia('(prefers-color-scheme: {scheme})').matches")

    async def screenshot(self, path: Path | None = None) -> bytes:
        shot = await self.call("Page.captureScreenshot", format="png")
        png = base64.b64decode(shot["data"])
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        if path is not None:
            path.write_bytes(png)
        return png

    async def axe(self, *, exclude: list[str] | None = None) -> list[dict[str, Any]]:
        """axe-core's serious and critical violations on the page as it is now (each: id,
        impact, help and the failing nodes' selectors and summaries)."""
        if not await self.js("typeof window.axe === 'object'"):
            # evaluated by DevTools, not by the page: the page's CSP stays as it is
            await self.call("Runtime.evaluate", expression=axe_core())
        context = json.dumps({"exclude": [[s] for s in exclude or []]})
        found = await self.js(f"""axe.run({context}, {{resultTypes: ['violations']}})
            .then(r => r.violations.filter(v => ['serious', 'critical'].includes(v.impact))
              .map(v => ({{id: v.id, impact: v.impact, help: v.help,
                          nodes: v.nodes.slice(0, 8).map(n => [n.target.join(' '),
                                                              n.failureSummary])}})))""")
        return list(found)


async def open_page(url: str, user_data: Path) -> tuple[asyncio.subprocess.Process, str]:
    """Start Chromium on `url`; return the process and the page's DevTools websocket URL."""
    proc = await asyncio.create_subprocess_exec(
        chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={user_data}", url,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True)
    port_file = user_data / "DevToolsActivePort"
    deadline = time.monotonic() + 60

    def port_written() -> str | bool:
        assert proc.returncode is None, "chromium exited"
        return port_file.exists() and port_file.read_text().strip()

    port = int(str(await wait_until_async(port_written, 60, interval=0.1,
                                          what="chromium's DevTools port")).split()[0])
    async with aiohttp.ClientSession() as http:
        pages: list[dict[str, Any]] = []

        async def listed() -> bool:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                pages[:] = [t for t in await r.json()
                            if t.get("type") == "page" and t.get("url", "").startswith(url)]
            return bool(pages)

        await wait_until_async(listed, max(deadline - time.monotonic(), 1), interval=0.1,
                               what="chromium to open the page")
        return proc, pages[0]["webSocketDebuggerUrl"]


async def close_browser(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


@asynccontextmanager
async def browse(url: str, user_data: Path) -> AsyncIterator[DevTools]:
    """Chromium on `url`, driven over its page's DevTools websocket; closed on the way out."""
    proc, ws_url = await open_page(url, user_data)
    try:
        async with aiohttp.ClientSession() as http, http.ws_connect(
                ws_url, max_msg_size=0) as ws:
            yield DevTools(ws)
    finally:
        await close_browser(proc)


async def check_accessible(page: DevTools, shots: Path | None = None, name: str = "page",
                           *, exclude: list[str] | None = None) -> None:
    """No serious or critical axe-core violation at each size (desktop, phone), light and
    dark; a screenshot of each into `shots` when given. Leaves the page light, unsized."""
    found: dict[str, list[dict[str, Any]]] = {}
    for scheme in ("light", "dark"):
        await page.color_scheme(scheme)
        for size, (w, h) in SIZES.items():
            await page.viewport(w, h)
            await page.js("new Promise(r => requestAnimationFrame(() => r(1)))")
            v = await page.axe(exclude=exclude)
            if v:
                found[f"{size} {scheme}"] = v
            if shots is not None:
                await page.screenshot(shots / f"{name}-{size}-{scheme}.png")
    await page.color_scheme("light")
    await page.call("Emulation.clearDeviceMetricsOverride")
    assert not found, json.dumps(found, indent=1)
