"""Web Push for the local web chat: a reply that comes while no page has the chat open is
announced on the devices that asked for it (the page's bell button).

- The server's VAPID key pair is made on first use in `data_dir/http/vapid.pem` (mode 0600,
  P-256); the page gets the public key (`GET /push/key`) to subscribe with.
- Subscriptions are per chat, kept in `data_dir/http/push.json` (endpoint, keys, the chat),
  written whole to a temporary file and renamed. A push service that answers 404 or 410
  says the subscription is gone: it is removed.
- The payload is encrypted for the subscription (RFC 8291, aes128gcm, by `pywebpush`) and
  holds the chat and its name; the message's text only when `channels.http.push.include_text`
  is true (a push service sees when, and to whom, never what).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from mdclaw.aio import wait_all

log = logging.getLogger("mdclaw.channels.webpush")

MAX_SUBSCRIPTIONS_PER_CHAT = 20
MAX_ENDPOINT = 2048
PUSH_TIMEOUT = 15.0
TEXT_PREVIEW = 200


def valid_subscription(data: Any) -> dict[str, Any] | None:
    """The subscription a page sent (PushSubscription.toJSON()), reduced to what is used, or
    None when it is not one (an https endpoint, or http on a loopback address for tests)."""
    if not isinstance(data, Mapping):
        return None
    endpoint, keys = data.get("endpoint"), data.get("keys")
    if (not isinstance(endpoint, str) or len(endpoint) > MAX_ENDPOINT
            or not isinstance(keys, Mapping)):
        return None
    url = urlsplit(endpoint)
    if not (url.scheme == "https" or (url.scheme == "http" and url.hostname in (
            "127.0.0.1", "localhost", "::1"))) or not url.netloc:
        return None
    p256dh, auth = keys.get("p256dh"), keys.get("auth")
    if not (isinstance(p256dh, str) and isinstance(auth, str)
            and 0 < len(p256dh) <= 200 and 0 < len(auth) <= 100):
        return None
    return {"endpoint": endpoint, "keys": {"p256dh": p256dh, "auth": auth}}


def available() -> bool:
    """Whether pywebpush (the `push` extra) is installed."""
    import importlib.util

    return importlib.util.find_spec("pywebpush") is not None


class WebPush:
    """The server's VAPID key and the chats' subscriptions in `folder`."""

    def __init__(self, folder: Path, *, contact: str = "mailto:mdclaw@localhost",
                 include_text: bool = False) -> None:
        self.folder = folder
        self.contact = contact
        self.include_text = include_text
        self._lock = threading.Lock()
        self._vapid: Any = None
        self._subs: list[dict[str, Any]] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ---------------------------------------------------------------- the key
    @property
    def key_path(self) -> Path:
        return self.folder / "vapid.pem"

    def vapid(self) -> Any:
        """The VAPID key (py_vapid.Vapid), made and saved on first use."""
        from py_vapid import Vapid  # imported when push is first used

        with self._lock:
            if self._vapid is None:
                if self.key_path.exists():
                    self._vapid = Vapid.from_file(str(self.key_path))
                else:
                    self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                    v = Vapid()
                    v.generate_keys()
                    tmp = self.key_path.with_suffix(".tmp")
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "wb") as f:
                        f.write(v.private_pem())
                    tmp.rename(self.key_path)
                    self._vapid = v
            return self._vapid

    def public_key(self) -> str:
        """The application server key for PushManager.subscribe (base64url, uncompressed)."""
        from cryptography.hazmat.primitives import serialization
        from py_vapid.utils import b64urlencode

        raw = self.vapid().public_key.public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
        return str(b64urlencode(raw))

    # ---------------------------------------------------------------- subscriptions
    @property
    def subs_path(self) -> Path:
        return self.folder / "push.json"

    def _load(self) -> list[dict[str, Any]]:
        if self._subs is None:
            try:
                data = json.loads(self.subs_path.read_text())
                self._subs = [s for s in data if isinstance(s, dict)
                              and isinstance(s.get("jid"), str)
                              and valid_subscription(s) is not None]
            except FileNotFoundError:
                self._subs = []
            except (OSError, ValueError) as e:
                log.warning("web push: %s unreadable (%s); starting with no subscriptions",
                            self.subs_path, e)
                self._subs = []
        return self._subs

    def _save(self) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.subs_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self._subs or [], f)
        tmp.rename(self.subs_path)

    def subscribe(self, jid: str, sub: dict[str, Any]) -> None:
        """Notify `sub` of replies in `jid` (again: replaces the same endpoint's entry)."""
        with self._lock:
            subs = self._load()
            subs[:] = [s for s in subs
                       if not (s["jid"] == jid and s["endpoint"] == sub["endpoint"])]
            mine = [s for s in subs if s["jid"] == jid]
            if len(mine) >= MAX_SUBSCRIPTIONS_PER_CHAT:
                subs.remove(mine[0])  # the oldest device of the chat makes room
            subs.append({"jid": jid, **sub})
            self._save()

    def unsubscribe(self, jid: str, endpoint: str) -> bool:
        with self._lock:
            subs = self._load()
            kept = [s for s in subs if not (s["jid"] == jid and s["endpoint"] == endpoint)]
            if len(kept) == len(subs):
                return False
            subs[:] = kept
            self._save()
            return True

    def _drop(self, endpoint: str) -> None:
        with self._lock:
            subs = self._load()
            subs[:] = [s for s in subs if s["endpoint"] != endpoint]
            self._save()

    def subscriptions(self, jid: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(s) for s in self._load() if jid is None or s["jid"] == jid]

    # ---------------------------------------------------------------- sending
    def payload(self, jid: str, title: str, text: str | None) -> str:
        body: dict[str, Any] = {"jid": jid, "title": title}
        if self.include_text and text:
            body["text"] = text[:TEXT_PREVIEW]
        return json.dumps(body)

    def announce(self, jid: str, title: str, text: str | None) -> None:
        """Push to every device subscribed to `jid`, in the background (the caller, the
        outbox's delivery, never waits on a push service)."""
        subs = self.subscriptions(jid)
        if not subs:
            return
        data = self.payload(jid, title, text)
        for sub in subs:
            task = asyncio.get_running_loop().create_task(self._send(sub, data))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, sub: dict[str, Any], data: str) -> None:
        from pywebpush import WebPushException, webpush_async

        info = {"endpoint": sub["endpoint"], "keys": sub["keys"]}
        try:
            vapid = await asyncio.to_thread(self.vapid)
            await webpush_async(info, data=data, vapid_private_key=vapid,
                                vapid_claims={"sub": self.contact}, ttl=24 * 3600,
                                timeout=aiohttp.ClientTimeout(total=PUSH_TIMEOUT))
        except WebPushException as e:
            status = getattr(e.response, "status", None) or getattr(
                e.response, "status_code", None)
            if status in (404, 410):
                log.info("web push: a subscription of %s is gone (HTTP %s): removed",
                         sub["jid"], status)
                await asyncio.to_thread(self._drop, sub["endpoint"])
            else:
                log.warning("web push to %s failed: HTTP %s", urlsplit(sub["endpoint"]).netloc,
                            status)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            log.warning("web push to %s failed: %s", urlsplit(sub["endpoint"]).netloc,
                        type(e).__name__)

    async def drain(self) -> None:
        """Wait for the pushes under way (at a stop, and in tests)."""
        await wait_all(self._tasks)
