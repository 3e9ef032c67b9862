"""A fake Slack on loopback, written from Slack's public API documentation: the Web API
methods the channel calls and Socket Mode, on one aiohttp app.

Web API (`POST|GET /api/<method>`): the token comes as `Authorization: Bearer`; a missing
one answers `not_authed`, a wrong one `invalid_auth` (HTTP 200 with `ok: false`, as Slack
does); `apps.connections.open` wants the app-level token, every other method the bot token.
Scripted failures per method (`fail[method]`: status, body, headers), e.g. a 429 with
`Retry-After`. files upload v2: `files.getUploadURLExternal` hands out an upload URL on this
server, the upload is a POST of the bytes to it, `files.completeUploadExternal` shares the
file. Files people send are served at /files/<id> to the bot token only.

Socket Mode: `apps.connections.open` returns `ws://.../link/?ticket=<n>`; the websocket sends
`hello`, then every envelope not acked yet (again, with `retry_attempt`), then new ones as they
are pushed; an ack is `{"envelope_id": ...}` (with a `payload` for slash commands). `drop()`
cuts the connection without a word; `send_disconnect()` sends Slack's `disconnect` message.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import WSMsgType, web

BOT_TOKEN = "xoxb-1111-2222-botsecret"
APP_TOKEN = "xapp-1-A1-3333-appsecret"
BOT_USER = "UBOT"
BOT_ID = "BBOT"


class FakeSlack:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any], float]] = []
        self.fail: dict[str, list[tuple[int, dict[str, Any], dict[str, str]]]] = {}
        self.users = {"U1": "Ann", "U2": "Bob"}
        self.channels = {"C1": "general", "C2": "random"}
        self.files: dict[str, bytes] = {}  # file id -> content people sent
        self.downloads: list[tuple[str, str | None]] = []  # (file id, Authorization)
        self.uploads: dict[str, dict[str, Any]] = {}  # file id -> {name, length, data}
        self.shared: list[dict[str, Any]] = []  # completed uploads
        self.reactions: list[dict[str, Any]] = []
        self.posted: list[dict[str, Any]] = []
        self.history: dict[str, list[dict[str, Any]]] = {}  # channel -> top-level messages
        # (channel, thread ts) -> the thread's replies, oldest first
        self.replies: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.envelopes: dict[str, dict[str, Any]] = {}  # envelope id -> envelope, in order
        self.acks: dict[str, dict[str, Any]] = {}  # envelope id -> the ack
        self.ack_event = asyncio.Event()
        self.sent_to: dict[str, int] = {}  # envelope id -> times sent
        self.connections = 0  # websockets opened
        self.connected = asyncio.Event()
        self.ws: web.WebSocketResponse | None = None
        self._ws_request: web.Request | None = None
        self.runner: web.AppRunner | None = None
        self.base = ""
        self._ts = 1_767_225_600

    # ------------------------------------------------------------------ server
    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/api/{method}", self.api)
        app.router.add_get("/link/", self.socket)
        app.router.add_post("/upload/{file_id}", self.upload)
        app.router.add_get("/files/{file_id}", self.download)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.base = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @property
    def api_base(self) -> str:
        return f"{self.base}/api/"

    def of(self, method: str) -> list[dict[str, Any]]:
        return [p for m, p, _t in self.calls if m == method]

    def times(self, method: str) -> list[float]:
        return [t for m, _p, t in self.calls if m == method]

    def next_ts(self) -> str:
        self._ts += 1
        return f"{self._ts}.000100"

    # ------------------------------------------------------------------ Web API
    async def api(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        params: dict[str, Any] = dict(request.query)
        if request.method == "POST" and request.can_read_body:
            if request.content_type == "application/json":
                params.update(await request.json())
            else:
                params.update(dict(await request.post()))
        self.calls.append((method, params, time.monotonic()))
        auth = request.headers.get("Authorization", "")
        want = APP_TOKEN if method == "apps.connections.open" else BOT_TOKEN
        if not auth:
            return web.json_response({"ok": False, "error": "not_authed"})
        if auth != f"Bearer {want}":
            return web.json_response({"ok": False, "error": "invalid_auth"})
        scripted = self.fail.get(method)
        if scripted:
            status, body, headers = scripted.pop(0)
            return web.json_response(body, status=status, headers=headers)
        handler = getattr(self, "m_" + method.replace(".", "_"), None)
        if handler is None:
            return web.json_response({"ok": False, "error": "unknown_method"}, status=404)
        result = handler(params)
        return web.json_response({"ok": True, **result} if "error" not in result
                                 else {"ok": False, **result})

    def m_auth_test(self, p: dict[str, Any]) -> dict[str, Any]:
        return {"url": "https://fake.slack.com/", "team": "Fake Team", "user": "andy",
                "team_id": "T1", "user_id": BOT_USER, "bot_id": BOT_ID}

    def m_apps_connections_open(self, p: dict[str, Any]) -> dict[str, Any]:
        return {"url": f"ws{self.base[4:]}/link/?ticket={uuid.uuid4().hex}"}

    def m_users_info(self, p: dict[str, Any]) -> dict[str, Any]:
        name = self.users.get(p.get("user", ""))
        if name is None:
            return {"error": "user_not_found"}
        return {"user": {"id": p["user"], "name": name.lower(), "real_name": name,
                         "profile": {"display_name": name, "real_name": name}}}

    def m_conversations_info(self, p: dict[str, Any]) -> dict[str, Any]:
        name = self.channels.get(p.get("channel", ""))
        if name is None:
            return {"error": "channel_not_found"}
        return {"channel": {"id": p["channel"], "name": name, "is_channel": True}}

    def m_chat_postMessage(self, p: dict[str, Any]) -> dict[str, Any]:
        if p.get("channel") not in self.channels and not str(p.get("channel")).startswith("D"):
            return {"error": "channel_not_found"}
        if not p.get("text"):
            return {"error": "no_text"}
        ts = self.next_ts()
        self.posted.append({**p, "ts": ts})
        return {"channel": p["channel"], "ts": ts,
                "message": {"text": p["text"], "user": BOT_USER, "ts": ts}}

    def m_conversations_history(self, p: dict[str, Any]) -> dict[str, Any]:
        """Newest first, after `oldest` (exclusive unless inclusive), pages of `limit` with a
        cursor (the offset, here)."""
        if p.get("channel") not in self.history and p.get("channel") not in self.channels:
            return {"error": "channel_not_found"}
        oldest = float(p.get("oldest") or 0)
        inclusive = str(p.get("inclusive")).lower() in ("1", "true")
        found = [m for m in self.history.get(p["channel"], [])
                 if float(m["ts"]) > oldest or (inclusive and float(m["ts"]) == oldest)]
        found.sort(key=lambda m: -float(m["ts"]))
        start = int(p.get("cursor") or 0)
        limit = int(p.get("limit") or 100)
        page = found[start:start + limit]
        more = start + limit < len(found)
        return {"messages": page, "has_more": more,
                "response_metadata": {"next_cursor": str(start + limit) if more else ""}}

    def m_conversations_replies(self, p: dict[str, Any]) -> dict[str, Any]:
        """A thread: its parent first, then its replies oldest first, those after `oldest`
        (exclusive unless inclusive) and up to `latest`; `ts` may name the parent or a reply.
        Pages of `limit` with a cursor (the offset, here)."""
        channel, ts = p.get("channel"), str(p.get("ts") or "")
        if channel not in self.history and channel not in self.channels:
            return {"error": "channel_not_found"}
        parent = next((m for m in self.history.get(str(channel), []) if m["ts"] == ts), None)
        if parent is None:
            thread = next((t for (c, t), rs in self.replies.items()
                           if c == channel and any(r["ts"] == ts for r in rs)), None)
            parent = next((m for m in self.history.get(str(channel), [])
                           if m["ts"] == thread), None)
        if parent is None:
            return {"error": "thread_not_found"}
        oldest = float(p.get("oldest") or 0)
        latest = float(p.get("latest") or "inf")
        inclusive = str(p.get("inclusive")).lower() in ("1", "true")

        def within(m: dict[str, Any]) -> bool:
            t = float(m["ts"])
            return (t > oldest or (inclusive and t == oldest)) and (
                t < latest or (inclusive and t == latest))

        found = [parent] + [r for r in self.replies.get((str(channel), parent["ts"]), [])
                            if within(r)]
        start = int(p.get("cursor") or 0)
        limit = int(p.get("limit") or 100)
        page = found[start:start + limit]
        more = start + limit < len(found)
        return {"messages": page, "has_more": more,
                "response_metadata": {"next_cursor": str(start + limit) if more else ""}}

    def m_reactions_add(self, p: dict[str, Any]) -> dict[str, Any]:
        if any(r["timestamp"] == p.get("timestamp") and r["name"] == p.get("name")
               for r in self.reactions):
            return {"error": "already_reacted"}
        self.reactions.append(p)
        return {}

    def m_files_getUploadURLExternal(self, p: dict[str, Any]) -> dict[str, Any]:
        if not p.get("filename") or not str(p.get("length", "")).isdigit():
            return {"error": "invalid_arguments"}
        fid = f"F{len(self.uploads) + 100}"
        self.uploads[fid] = {"name": p["filename"], "length": int(p["length"]), "data": None}
        return {"upload_url": f"{self.base}/upload/{fid}", "file_id": fid}

    def m_files_completeUploadExternal(self, p: dict[str, Any]) -> dict[str, Any]:
        files = json.loads(p["files"]) if isinstance(p.get("files"), str) else p.get("files")
        out = []
        for f in files or []:
            up = self.uploads.get(f.get("id"))
            if up is None or up["data"] is None:
                return {"error": "file_not_found"}
            out.append({"id": f["id"], "name": up["name"], "title": f.get("title")})
        self.shared.append({**p, "files": files})
        return {"files": out}

    def m_files_info(self, p: dict[str, Any]) -> dict[str, Any]:
        fid = p.get("file", "")
        if fid not in self.files:
            return {"error": "file_not_found"}
        return {"file": {"id": fid, "url_private_download": f"{self.base}/files/{fid}"}}

    async def upload(self, request: web.Request) -> web.Response:
        fid = request.match_info["file_id"]
        if fid not in self.uploads:
            return web.Response(status=404)
        self.uploads[fid]["data"] = await request.read()
        return web.Response(text=f"OK - {len(self.uploads[fid]['data'])}")

    async def download(self, request: web.Request) -> web.StreamResponse:
        fid = request.match_info["file_id"]
        auth = request.headers.get("Authorization")
        self.downloads.append((fid, auth))
        if auth != f"Bearer {BOT_TOKEN}":  # Slack sends its sign-in page
            return web.Response(text="<html>sign in</html>", content_type="text/html")
        if fid not in self.files:
            return web.Response(status=404)
        return web.Response(body=self.files[fid], content_type="application/octet-stream")

    # ------------------------------------------------------------------ Socket Mode
    async def socket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        self.ws, self._ws_request = ws, request
        self.connections += 1
        await ws.send_json({"type": "hello", "num_connections": 1,
                            "debug_info": {"host": "fake", "approximate_connection_time": 3600},
                            "connection_info": {"app_id": "A1"}})
        for eid in list(self.envelopes):  # what was not acked comes again
            if eid not in self.acks:
                await self._send(eid)
        self.connected.set()
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                data = json.loads(msg.data)
                eid = data.get("envelope_id")
                if eid in self.envelopes:
                    self.acks.setdefault(eid, data)
                    self.ack_event.set()
        if self.ws is ws:
            self.ws = None
            self.connected.clear()
        return ws

    async def _send(self, eid: str) -> None:
        env = dict(self.envelopes[eid])
        n = self.sent_to.get(eid, 0)
        self.sent_to[eid] = n + 1
        if n:
            env["retry_attempt"], env["retry_reason"] = n, "timeout"
        if self.ws is not None and not self.ws.closed:
            await self.ws.send_json(env)

    def record(self, event: dict[str, Any]) -> None:
        """Keep a message where Slack keeps it: a top-level one in its channel's history
        (what conversations.history returns), a reply in its thread (conversations.replies),
        the parent then showing `thread_ts`, `reply_count`, `reply_users` and `latest_reply`;
        a reply also sent to the channel (`thread_broadcast`) is in both."""
        if event.get("type") != "message":
            return
        m = {k: v for k, v in event.items() if k not in ("channel", "channel_type")}
        channel, thread = event["channel"], event.get("thread_ts", event["ts"])
        if thread == event["ts"] or event.get("subtype") == "thread_broadcast":
            self.history.setdefault(channel, []).append(m)
        if thread != event["ts"]:
            self.replies.setdefault((channel, thread), []).append(m)
            parent = next((h for h in self.history.get(channel, []) if h["ts"] == thread),
                          None)
            if parent is not None:
                parent["thread_ts"] = thread
                parent["reply_count"] = parent.get("reply_count", 0) + 1
                users = parent.setdefault("reply_users", [])
                if event.get("user") not in users:
                    users.append(event.get("user"))
                parent["reply_users_count"] = len(users)
                parent["latest_reply"] = max(parent.get("latest_reply", "0"), event["ts"],
                                             key=float)

    async def push_event(self, event: dict[str, Any], *, event_id: str | None = None) -> str:
        """An events_api envelope carrying `event`; returns its envelope id."""
        self.record(event)
        eid = uuid.uuid4().hex
        event_id = event_id or f"Ev{len(self.envelopes) + 1:04d}"
        self.envelopes[eid] = {
            "envelope_id": eid, "type": "events_api", "accepts_response_payload": False,
            "retry_attempt": 0, "retry_reason": "",
            "payload": {"token": "verification", "team_id": "T1", "api_app_id": "A1",
                        "event": {"event_ts": event.get("ts"), **event},
                        "type": "event_callback", "event_id": event_id,
                        "event_time": self._ts,
                        "authorizations": [{"team_id": "T1", "user_id": BOT_USER,
                                            "is_bot": True}]}}
        await self._send(eid)
        return eid

    async def push_command(self, command: str, channel: str, user: str = "U1") -> str:
        eid = uuid.uuid4().hex
        self.envelopes[eid] = {
            "envelope_id": eid, "type": "slash_commands", "accepts_response_payload": True,
            "payload": {"token": "verification", "team_id": "T1", "team_domain": "fake",
                        "channel_id": channel, "channel_name": self.channels.get(channel, ""),
                        "user_id": user, "user_name": self.users.get(user, user).lower(),
                        "command": command, "text": "", "api_app_id": "A1",
                        "response_url": f"{self.base}/respond", "trigger_id": "1.2.3"}}
        await self._send(eid)
        return eid

    async def redeliver(self) -> None:
        """Send again what was not acked (Slack does after a few seconds)."""
        for eid in list(self.envelopes):
            if eid not in self.acks:
                await self._send(eid)

    async def drop(self) -> None:
        """Cut the websocket without a closing handshake."""
        req, self.ws = self._ws_request, None
        self.connected.clear()
        if req is not None and req.transport is not None:
            req.transport.close()

    async def send_disconnect(self, reason: str = "refresh_requested") -> None:
        if self.ws is not None:
            await self.ws.send_json({"type": "disconnect", "reason": reason,
                                     "debug_info": {"host": "fake"}})

    def message(self, text: str, *, channel: str = "C1", user: str = "U1",
                **extra: Any) -> dict[str, Any]:
        """A `message` event as Slack sends it for a channel message."""
        return {"type": "message", "channel": channel, "user": user, "text": text,
                "ts": self.next_ts(), "channel_type": "channel", "team": "T1", **extra}
