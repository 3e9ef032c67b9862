"""A PNG of a Home Assistant page, taken by headless Chromium on the host.

Chromium runs as a child process of the daemon with a private, throw-away profile folder
(0700, removed afterwards), driven over the DevTools protocol on 127.0.0.1. Home Assistant's
frontend keeps its login in localStorage (`hassTokens`); before the page loads, a script put
there over DevTools stores the long-lived token for the page's origin only, so the frontend
starts logged in. The token therefore stays on the host: in the Chromium child and its
profile folder, never in a container, a log line or a result.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from mdclaw.errors import IpcError

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--hide-scrollbars", "--mute-audio", "--remote-debugging-address=127.0.0.1",
          "--remote-debugging-port=0"]
_LISTENING = re.compile(rb"DevTools listening on (ws://\S+)")


class ScreenshotError(IpcError):
    """The screenshot could not be taken; str(e) says why (never with the token)."""


@dataclass(frozen=True)
class Shot:
    png: bytes
    width: int
    height: int


def find_chromium(configured: str | None = None) -> str:
    """The Chromium binary to run: `configured`, else the first known name on PATH."""
    for name in ((configured,) if configured else CHROMIUM_NAMES):
        path = shutil.which(name)
        if path:
            return path
    raise ScreenshotError(
        f"no Chromium found ({configured or ', '.join(CHROMIUM_NAMES)} on PATH); install "
        "chromium or set integrations.home_assistant.chromium")


class _DevTools:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        my_id = self.next_id
        await self.ws.send_json({"id": my_id, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json()
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise ScreenshotError(f"{method}: {msg['error'].get('message')}")
                result: dict[str, Any] = msg.get("result", {})
                return result
            if "method" in msg:
                self.events.append(msg)

    async def wait_event(self, method: str) -> None:
        while not any(e.get("method") == method for e in self.events):
            msg = await self.ws.receive_json()
            if "method" in msg:
                self.events.append(msg)

    async def js(self, expression: str) -> Any:
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return r.get("result", {}).get("value")


def _token_script(origin: str, token: str) -> str:
    tokens = {"access_token": token, "token_type": "Bearer", "expires_in": 315360000,
              "refresh_token": "", "hassUrl": origin, "clientId": origin + "/",
              "expires": 4102444800000}
    return ("try { if (location.origin === ORIGIN) { localStorage.setItem('hassTokens', "
            "TOKENS); } } catch (e) {}").replace("ORIGIN", json.dumps(origin)).replace(
                "TOKENS", json.dumps(json.dumps(tokens)))


async def capture(url: str, token: str, *, chromium: str, width: int, height: int,
                  zoom: float, wait_ms: int, selector: str | None,
                  timeout: float) -> Shot:
    """Load `url` logged in with `token` and return a PNG of the viewport (or of the
    element `selector` names, once it exists). ScreenshotError on any failure."""
    parts = urlsplit(url)
    origin = f"{parts.scheme}://{parts.netloc}"
    profile = tempfile.mkdtemp(prefix="mdclaw-ha-shot-")
    proc: asyncio.subprocess.Process | None = None
    try:
        # Started inside the try: a binary that cannot run is a ScreenshotError too, and
        # the profile folder is removed all the same.
        proc = await asyncio.create_subprocess_exec(
            chromium, *_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
            "about:blank", stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        async with asyncio.timeout(timeout):
            return await _drive(proc, url, origin, token, width, height, zoom, wait_ms,
                                selector)
    except TimeoutError:
        raise ScreenshotError(f"the screenshot took longer than {timeout:g} s") from None
    except (aiohttp.ClientError, OSError, ValueError) as e:
        raise ScreenshotError(f"Chromium failed: {type(e).__name__}: "
                              f"{str(e).replace(token, '***')[:200]}") from None
    finally:
        if proc is not None:
            if proc.returncode is None:
                proc.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 10)
        shutil.rmtree(profile, ignore_errors=True)


async def _drive(proc: asyncio.subprocess.Process, url: str, origin: str, token: str,
                 width: int, height: int, zoom: float, wait_ms: int,
                 selector: str | None) -> Shot:
    assert proc.stderr is not None
    ws_url = None
    while ws_url is None:
        line = await proc.stderr.readline()
        if not line:
            raise ScreenshotError("Chromium exited before it opened DevTools")
        m = _LISTENING.search(line)
        if m:
            ws_url = m.group(1).decode()
    http_base = "http://" + urlsplit(ws_url).netloc
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{http_base}/json/list") as r:
            pages = [p for p in await r.json() if p.get("type") == "page"]
        if not pages:
            raise ScreenshotError("Chromium has no page to drive")
        async with session.ws_connect(pages[0]["webSocketDebuggerUrl"],
                                      max_msg_size=64 * 1024 * 1024) as ws:
            dt = _DevTools(ws)
            await dt.call("Page.enable")
            await dt.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                          deviceScaleFactor=zoom, mobile=False)
            await dt.call("Page.addScriptToEvaluateOnNewDocument",
                          source=_token_script(origin, token))
            dt.events.clear()
            nav = await dt.call("Page.navigate", url=url)
            if nav.get("errorText"):
                raise ScreenshotError(f"cannot load the page: {nav['errorText']}")
            await dt.wait_event("Page.loadEventFired")
            params: dict[str, Any] = {"format": "png"}
            if selector:
                # Wait (within the overall timeout) for the element, then clip to it.
                probe = ("(() => { const e = document.querySelector(SEL); if (!e) return "
                         "null; const r = e.getBoundingClientRect(); return [r.x, r.y, "
                         "r.width, r.height]; })()").replace("SEL", json.dumps(selector))
                box = None
                while not box or box[2] <= 0 or box[3] <= 0:
                    box = await dt.js(probe)
                    if not box:
                        await asyncio.sleep(0.1)
            # The frontend renders after load; give it the time asked for (the action's
            # documented waitMs), then take the picture.
            await asyncio.sleep(wait_ms / 1000)
            if selector:
                box = await dt.js(probe) or box
                assert box is not None
                params["clip"] = {"x": box[0], "y": box[1], "width": box[2],
                                  "height": box[3], "scale": 1}
            shot = await dt.call("Page.captureScreenshot", **params)
    png = base64.b64decode(shot["data"])
    w, h = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    return Shot(png, w, h)
