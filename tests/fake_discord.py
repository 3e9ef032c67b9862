"""A fake of Discord on loopback, written from Discord's public API documentation: the REST
endpoints the Discord channel uses (with X-RateLimit-* headers and scripted 429s carrying
`retry_after`) and the gateway (HELLO, IDENTIFY, READY, GUILD_CREATE, heartbeat/ACK,
dispatches with sequence numbers, RESUME/RESUMED with the missed events replayed,
INVALID_SESSION), zlib-stream or zstd-stream compressed as the client asks.

Messages people write go into the fake channel's history (GET /channels/{id}/messages) and
are dispatched to the connected session; a session without a connection keeps them for a
RESUME, the way Discord does.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import WSMsgType, web

TOKEN = "MTIzNDU2Nzg5MDEyMzQ1Njc4.GfAke.secret-token-value"
BOT_ID = 4242
APP_ID = 4343
GUILD_ID = 500
CHANNEL_ID = 600
THREAD_ID = 700
DISCORD_EPOCH_MS = 1420070400000
_ACK = {"op": 11}


def snowflake(seq: int) -> int:
    """An id that grows with `seq` (and with time), like Discord's."""
    return ((int(time.time() * 1000) - DISCORD_EPOCH_MS) << 22) + seq


def user(uid: int, name: str, *, bot: bool = False) -> dict[str, Any]:
    return {"id": str(uid), "username": name, "discriminator": "0", "global_name": name,
            "avatar": None, "bot": bot}


@dataclass
class Session:
    id: str
    events: list[dict[str, Any]] = field(default_factory=list)  # sent dispatches, by seq
    seq: int = 0
    ws: web.WebSocketResponse | None = None
    compress: Any = None
    resumable: bool = True


class _ZlibStream:
    """zlib-stream: one deflate stream, each message ending in a sync flush."""

    def __init__(self) -> None:
        self._c = zlib.compressobj()

    def message(self, data: bytes) -> bytes:
        return self._c.compress(data) + self._c.flush(zlib.Z_SYNC_FLUSH)


class _ZstdStream:
    """zstd-stream: one zstd stream, each message ending in a flushed block."""

    def __init__(self) -> None:
        import zstandard

        self._flush = zstandard.COMPRESSOBJ_FLUSH_BLOCK
        self._c = zstandard.ZstdCompressor().compressobj()

    def message(self, data: bytes) -> bytes:
        return self._c.compress(data) + self._c.flush(self._flush)


class FakeDiscord:
    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.runner: web.AppRunner | None = None
        self.base = ""
        self.api = ""
        self.sessions: dict[str, Session] = {}
        self.current: Session | None = None
        self.identifies: list[dict[str, Any]] = []
        self.resumes: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str, float]] = []  # (method, path, monotonic time)
        self.sent: list[dict[str, Any]] = []  # messages the bot created
        self.files: list[tuple[str, bytes]] = []  # (file name, content) the bot uploaded
        self.reactions: list[tuple[int, int, str]] = []
        self.typing: list[int] = []
        self.commands: list[dict[str, Any]] = []
        self.interaction_replies: list[dict[str, Any]] = []
        self.history: dict[int, list[dict[str, Any]]] = {}
        self.attachments: dict[str, bytes] = {}
        self.fail: dict[str, list[tuple[int, dict[str, Any]]]] = {}  # "METHOD path-kind"
        self.invalidate_next_resume = False
        self.app_flags = 1 << 19  # GATEWAY_MESSAGE_CONTENT: the intent is on
        # kind -> seconds: the next answer of that route says its bucket is empty for that long
        self.exhaust: dict[str, float] = {}
        self.changed = asyncio.Event()
        self._seq = 0
        self.threads = {THREAD_ID: CHANNEL_ID}
        # Create Message's `nonce` with `enforce_nonce: true`: a repeat by the same author
        # within a few minutes gets the message the first one created, and nothing is posted.
        self.nonces: dict[tuple[int, str], tuple[float, dict[str, Any]]] = {}
        self.nonce_window = 300.0
        self.nonce_repeats = 0  # requests answered with an earlier message
        # The next N messages are created, but the connection is cut before the answer.
        self.lose_answers = 0
        self.guild_lists_threads = True  # GUILD_CREATE's `threads` (active ones it shows)

    # ------------------------------------------------------------------ server
    async def start(self, port: int = 0) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_get("/gateway", self.gateway)
        p = "/api/v10"
        r.add_get(p + "/users/@me", self.me)
        r.add_get(p + "/oauth2/applications/@me", self.app_info)
        r.add_get(p + "/gateway/bot", self.gateway_bot)
        r.add_put(p + "/applications/{app}/commands", self.put_commands)
        r.add_post(p + "/channels/{cid}/messages", self.create_message)
        r.add_get(p + "/channels/{cid}/messages", self.list_messages)
        r.add_get(p + "/channels/{cid}", self.get_channel)
        r.add_put(p + "/channels/{cid}/messages/{mid}/reactions/{emoji}/@me", self.react)
        r.add_post(p + "/channels/{cid}/typing", self.typing_)
        r.add_post(p + "/interactions/{iid}/{itoken}/callback", self.interaction_callback)
        r.add_get("/attachments/{name}", self.attachment)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base = f"http://127.0.0.1:{port}"
        self.api = self.base + p

    async def stop(self) -> None:
        for s in self.sessions.values():
            if s.ws is not None:
                await s.ws.close()
        if self.runner is not None:
            await self.runner.cleanup()

    def _bump(self) -> None:
        self.changed.set()

    async def wait(self, predicate: Any, timeout: float = 15.0) -> None:
        """Wait until `predicate()` holds, woken by every request and gateway event."""
        async with asyncio.timeout(timeout):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

    # ------------------------------------------------------------------ REST helpers
    def _headers(self, bucket: str) -> dict[str, str]:
        return {"X-RateLimit-Limit": "5", "X-RateLimit-Remaining": "4",
                "X-RateLimit-Reset-After": "1.0", "X-RateLimit-Reset": f"{time.time() + 1:.3f}",
                "X-RateLimit-Bucket": bucket}

    def _authorised(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bot {self.token}"

    async def _gate(self, request: web.Request, kind: str) -> web.Response | None:
        """Record the request; the scripted failure for `kind`, or a 401 without the token."""
        self.requests.append((request.method, kind, time.monotonic()))
        self._bump()
        if not self._authorised(request):
            return self._json({"message": "401: Unauthorized", "code": 0}, kind, 401)
        queue = self.fail.get(kind)
        if queue:
            status, body = queue.pop(0)
            headers = self._headers(kind)
            if status == 429:
                headers.update({"Retry-After": str(int(body["retry_after"]) + 1),
                                "X-RateLimit-Remaining": "0",
                                "X-RateLimit-Scope": "global" if body.get("global") else "user",
                                "Via": "1.1 google"})
                if body.get("global"):
                    headers["X-RateLimit-Global"] = "true"
            return self._json(body, kind, status, headers)
        return None

    def _json(self, body: Any, kind: str, status: int = 200,
              headers: dict[str, str] | None = None) -> web.Response:
        wait = self.exhaust.pop(kind, None)
        if wait is not None and status < 400:
            headers = {**(headers or {}), "X-RateLimit-Remaining": "0",
                       "X-RateLimit-Reset-After": f"{wait:.3f}",
                       "X-RateLimit-Reset": f"{time.time() + wait:.3f}"}
        # Discord's Content-Type is exactly application/json (no charset).
        return web.Response(body=json.dumps(body).encode(), status=status,
                            headers={**self._headers(kind), **(headers or {}),
                                     "Content-Type": "application/json"})

    # ------------------------------------------------------------------ REST endpoints
    async def me(self, request: web.Request) -> web.Response:
        return await self._gate(request, "me") or self._json(user(BOT_ID, "mdclaw", bot=True),
                                                              "me")

    async def app_info(self, request: web.Request) -> web.Response:
        return await self._gate(request, "app") or self._json({
            "id": str(APP_ID), "name": "mdclaw", "description": "", "icon": None,
            "bot_public": False, "bot_require_code_grant": False,
            "owner": user(1, "owner"), "verify_key": "00", "flags": self.app_flags,
            "interactions_endpoint_url": None, "summary": "", "team": None}, "app")

    async def gateway_bot(self, request: web.Request) -> web.Response:
        return await self._gate(request, "gateway") or self._json({
            "url": self.base.replace("http://", "ws://") + "/gateway", "shards": 1,
            "session_start_limit": {"total": 1000, "remaining": 999, "reset_after": 0,
                                    "max_concurrency": 1}}, "gateway")

    async def put_commands(self, request: web.Request) -> web.Response:
        fail = await self._gate(request, "commands")
        if fail:
            return fail
        body = await request.json()
        self.commands = [{**c, "id": str(900 + i), "application_id": str(APP_ID),
                          "version": "1", "type": c.get("type", 1)}
                         for i, c in enumerate(body)]
        return self._json(self.commands, "commands")

    def _message(self, cid: int, author: dict[str, Any], content: str, *,
                 attachments: list[dict[str, Any]] | None = None,
                 reference: dict[str, Any] | None = None,
                 mentions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        self._seq += 1
        msg: dict[str, Any] = {
            "id": str(snowflake(self._seq)), "channel_id": str(cid), "author": author,
            "content": content, "timestamp": datetime.now(UTC).isoformat(),
            "edited_timestamp": None, "tts": False, "mention_everyone": False,
            "mentions": mentions or [], "mention_roles": [], "attachments": attachments or [],
            "embeds": [], "pinned": False, "type": 0 if reference is None else 19, "flags": 0}
        if cid == CHANNEL_ID or cid in self.threads:
            msg["guild_id"] = str(GUILD_ID)
        if reference is not None:
            msg["message_reference"] = {"message_id": reference["id"],
                                        "channel_id": reference["channel_id"],
                                        "guild_id": str(GUILD_ID)}
            msg["referenced_message"] = reference
        return msg

    async def create_message(self, request: web.Request) -> web.Response:
        fail = await self._gate(request, "create_message")
        if fail:
            return fail
        cid = int(request.match_info["cid"])
        files: list[tuple[str, bytes]] = []
        if request.content_type.startswith("multipart/"):
            payload: dict[str, Any] = {}
            reader = await request.multipart()
            async for part in reader:
                if part.name == "payload_json":
                    payload = json.loads(await part.text())
                else:
                    files.append((part.filename or "", await part.read()))  # type: ignore[union-attr]
        else:
            payload = await request.json()
        content = payload.get("content") or ""
        if len(content) > 2000:
            return self._json({"message": "Invalid Form Body", "code": 50035}, "create_message",
                              400)
        nonce = payload.get("nonce")
        if nonce is not None and len(str(nonce)) > 25:
            return self._json({"message": "Invalid Form Body", "code": 50035}, "create_message",
                              400)
        if nonce is not None and payload.get("enforce_nonce"):
            seen = self.nonces.get((BOT_ID, str(nonce)))
            if seen is not None and time.monotonic() - seen[0] < self.nonce_window:
                self.nonce_repeats += 1
                self._bump()
                return self._json(seen[1], "create_message")
        msg = self._message(cid, user(BOT_ID, "mdclaw", bot=True), content, attachments=[
            {"id": str(800 + i), "filename": n, "size": len(b), "url": "", "proxy_url": ""}
            for i, (n, b) in enumerate(files)])
        if payload.get("message_reference"):
            msg["message_reference"] = payload["message_reference"]
        if nonce is not None:
            msg["nonce"] = str(nonce)
            if payload.get("enforce_nonce"):
                self.nonces[(BOT_ID, str(nonce))] = (time.monotonic(), msg)
        self.files.extend(files)
        self.sent.append({**msg, "allowed_mentions": payload.get("allowed_mentions")})
        self.history.setdefault(cid, []).append(msg)
        self._bump()
        if self.lose_answers > 0:
            self.lose_answers -= 1
            if request.transport is not None:
                request.transport.close()  # created, but the answer never arrives
        return self._json(msg, "create_message")

    async def list_messages(self, request: web.Request) -> web.Response:
        fail = await self._gate(request, "list_messages")
        if fail:
            return fail
        cid = int(request.match_info["cid"])
        after = int(request.query.get("after", "0"))
        limit = int(request.query.get("limit", "50"))
        newer = [m for m in self.history.get(cid, []) if int(m["id"]) > after][:limit]
        # A message object of the REST API has no guild_id: only the gateway's
        # MESSAGE_CREATE adds it (with member).
        rest = [{k: v for k, v in m.items() if k not in ("guild_id", "member")}
                for m in reversed(newer)]  # newest first
        return self._json(rest, "list_messages")

    async def get_channel(self, request: web.Request) -> web.Response:
        fail = await self._gate(request, "get_channel")
        if fail:
            return fail
        cid = int(request.match_info["cid"])
        if cid in self.threads:
            return self._json(self._thread(cid), "get_channel")
        return self._json(self._text_channel(cid), "get_channel")

    async def react(self, request: web.Request) -> web.Response:
        fail = await self._gate(request, "react")
        if fail:
            return fail
        self.reactions.append((int(request.match_info["cid"]), int(request.match_info["mid"]),
                               request.match_info["emoji"]))
        self._bump()
        return web.Response(status=204, headers=self._headers("react"))


    async def typing_(self, request: web.Request) -> web.Response:
        fail = await self._gate(request, "typing")
        if fail:
            return fail
        self.typing.append(int(request.match_info["cid"]))
        self._bump()
        return web.Response(status=204, headers=self._headers("typing"))

    async def interaction_callback(self, request: web.Request) -> web.Response:
        self.requests.append(("POST", "interaction", time.monotonic()))
        body: dict[str, Any] = {}
        if request.content_type.startswith("multipart/"):
            reader = await request.multipart()
            async for part in reader:
                if part.name == "payload_json":
                    body = json.loads(await part.text())  # type: ignore[union-attr]
        else:
            body = await request.json()
        self.interaction_replies.append(body)
        self._bump()
        if request.query.get("with_response", "").lower() != "true":
            return web.Response(status=204)
        iid = request.match_info["iid"]
        data = body.get("data") or {}
        return self._json({"interaction": {
            "id": iid, "type": 2, "response_message_id": str(snowflake(0)),
            "response_message_loading": False,
            "response_message_ephemeral": bool((data.get("flags") or 0) & 64)},
            "resource": {"type": body.get("type", 4)}}, "interaction")

    async def attachment(self, request: web.Request) -> web.Response:
        data = self.attachments.get(request.match_info["name"])
        if data is None:
            return web.Response(status=404)
        return web.Response(body=data, content_type="application/octet-stream")

    # ------------------------------------------------------------------ the guild
    def _text_channel(self, cid: int) -> dict[str, Any]:
        return {"id": str(cid), "type": 0, "name": f"general-{cid}", "guild_id": str(GUILD_ID),
                "position": 0, "permission_overwrites": [], "nsfw": False, "parent_id": None,
                "topic": None, "last_message_id": None, "rate_limit_per_user": 0}

    def _thread(self, tid: int) -> dict[str, Any]:
        return {"id": str(tid), "type": 11, "name": f"thread-{tid}",
                "guild_id": str(GUILD_ID), "parent_id": str(self.threads[tid]),
                "owner_id": "1", "message_count": 1, "member_count": 1,
                "rate_limit_per_user": 0, "flags": 0, "last_message_id": None,
                "thread_metadata": {"archived": False, "auto_archive_duration": 1440,
                                    "archive_timestamp": datetime.now(UTC).isoformat(),
                                    "locked": False}}

    def guild(self, *, with_thread: bool = True) -> dict[str, Any]:
        return {
            "id": str(GUILD_ID), "name": "Home", "icon": None, "owner_id": "1",
            "afk_channel_id": None, "afk_timeout": 300, "verification_level": 0,
            "default_message_notifications": 0, "explicit_content_filter": 0,
            "roles": [{"id": str(GUILD_ID), "name": "@everyone", "permissions": "0",
                       "position": 0, "color": 0, "hoist": False, "managed": False,
                       "mentionable": False, "flags": 0}],
            "emojis": [], "stickers": [], "features": [], "mfa_level": 0,
            "system_channel_id": None, "system_channel_flags": 0, "rules_channel_id": None,
            "vanity_url_code": None, "description": None, "banner": None,
            "premium_tier": 0, "preferred_locale": "en-US", "public_updates_channel_id": None,
            "nsfw_level": 0, "premium_progress_bar_enabled": False, "member_count": 2,
            "large": False, "unavailable": False, "joined_at": datetime.now(UTC).isoformat(),
            "members": [], "voice_states": [], "presences": [],
            "channels": [self._text_channel(CHANNEL_ID)],
            "threads": [self._thread(THREAD_ID)] if with_thread else [],
            "stage_instances": [], "guild_scheduled_events": [], "soundboard_sounds": []}

    # ------------------------------------------------------------------ gateway
    async def gateway(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        # The transport compressions the gateway offers: one stream per connection, each
        # message flushed so it can be read on its own. discord.py asks for zstd-stream when
        # a zstd module is installed (mdclaw's backups install zstandard), else zlib-stream.
        asked = request.query.get("compress")
        compress: Any = None
        if asked == "zlib-stream":
            compress = _ZlibStream()
        elif asked == "zstd-stream":
            compress = _ZstdStream()
        elif asked is not None:
            await ws.close(code=4000, message=b"unknown compression")
            return ws
        conn: dict[str, Any] = {"ws": ws, "compress": compress, "session": None}
        await self._send(conn, {"op": 10, "s": None, "t": None,
                                "d": {"heartbeat_interval": 41250}})
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                continue
            payload = json.loads(msg.data)
            op = payload.get("op")
            if op == 1:
                await self._send(conn, {**_ACK, "s": None, "t": None, "d": None})
            elif op == 2:
                await self._identify(conn, payload["d"])
            elif op == 6:
                await self._resume(conn, payload["d"])
            self._bump()
        s = conn["session"]
        if s is not None and s.ws is ws:
            s.ws = None
        self._bump()
        return ws

    async def _send(self, conn: dict[str, Any], payload: dict[str, Any]) -> None:
        ws: web.WebSocketResponse = conn["ws"]
        data = json.dumps(payload)
        if conn["compress"] is not None:
            await ws.send_bytes(conn["compress"].message(data.encode()))
        else:
            await ws.send_str(data)

    async def _identify(self, conn: dict[str, Any], d: dict[str, Any]) -> None:
        self.identifies.append(d)
        if d.get("token") != self.token:
            await conn["ws"].close(code=4004, message=b"Authentication failed.")
            return
        if d.get("intents", 0) & (1 << 15) and not self.app_flags & ((1 << 18) | (1 << 19)):
            await conn["ws"].close(code=4014, message=b"Disallowed intent(s).")
            return
        sid = f"session-{len(self.sessions) + 1}"
        s = Session(sid)
        self.sessions[sid] = s
        self.current = s
        conn["session"] = s
        s.ws = conn["ws"]
        s.compress = conn
        await self._dispatch(s, "READY", {
            "v": 10, "user": user(BOT_ID, "mdclaw", bot=True),
            "guilds": [{"id": str(GUILD_ID), "unavailable": True}], "session_id": sid,
            "resume_gateway_url": self.base.replace("http://", "ws://") + "/gateway",
            "application": {"id": str(APP_ID), "flags": 0}, "private_channels": [],
            "relationships": []})
        await self._dispatch(s, "GUILD_CREATE", self.guild(with_thread=self.guild_lists_threads))

    async def _resume(self, conn: dict[str, Any], d: dict[str, Any]) -> None:
        self.resumes.append(d)
        s = self.sessions.get(d.get("session_id", ""))
        if s is None or not s.resumable or self.invalidate_next_resume \
                or d.get("token") != self.token:
            self.invalidate_next_resume = False
            if s is not None:
                s.resumable = False
            await self._send(conn, {"op": 9, "s": None, "t": None, "d": False})
            return
        conn["session"] = s
        s.ws = conn["ws"]
        s.compress = conn
        for event in s.events:
            if event["s"] > (d.get("seq") or 0):
                await self._send(conn, event)
        await self._dispatch(s, "RESUMED", {})

    async def _dispatch(self, s: Session, t: str, d: dict[str, Any]) -> None:
        s.seq += 1
        event = {"op": 0, "s": s.seq, "t": t, "d": d}
        s.events.append(event)
        if s.ws is not None and not s.ws.closed:
            try:
                await self._send(s.compress, event)
            except ConnectionError:
                pass
        self._bump()

    async def dispatch(self, t: str, d: dict[str, Any]) -> None:
        """Send event `t` to the current session (kept for a RESUME if it has no socket)."""
        assert self.current is not None, "no session yet"
        await self._dispatch(self.current, t, d)

    async def post(self, cid: int, content: str, *, author: dict[str, Any] | None = None,
                   dispatch: bool = True, **kw: Any) -> dict[str, Any]:
        """A person writes in channel `cid`: the history has it, the session gets it."""
        msg = self._message(cid, author or user(77, "alice"), content, **kw)
        self.history.setdefault(cid, []).append(msg)
        if dispatch and self.current is not None:
            await self.dispatch("MESSAGE_CREATE", msg)
        return msg

    def add_attachment(self, name: str, data: bytes, mime: str) -> dict[str, Any]:
        self.attachments[name] = data
        self._seq += 1
        return {"id": str(snowflake(self._seq)), "filename": name, "size": len(data),
                "url": f"{self.base}/attachments/{name}",
                "proxy_url": f"{self.base}/attachments/{name}", "content_type": mime}

    async def drop(self) -> None:
        """The connection breaks (Discord closes with 4000, a resumable code)."""
        s = self.current
        assert s is not None and s.ws is not None
        ws, s.ws = s.ws, None
        await ws.close(code=4000, message=b"Unknown error")
        self._bump()

    def connected(self) -> bool:
        return self.current is not None and self.current.ws is not None
