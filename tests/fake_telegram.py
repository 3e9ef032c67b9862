"""A fake Telegram Bot API (an aiohttp app on loopback), written from the Bot API's public
documentation (core.telegram.org/bots/api): enough for the Telegram channel's tests and for
a real daemon's.

- getMe; getUpdates with `offset` (updates before it are confirmed) and a short long poll;
  updates are `message` or `callback_query` (push, push_press);
- sendMessage (text 1-4096 characters; `reply_markup` an InlineKeyboardMarkup: an array of
  rows of InlineKeyboardButton, each with `text` and `callback_data` of 1-64 bytes, else
  400 "BUTTON_DATA_INVALID"), sendPhoto, sendDocument (multipart), setMessageReaction,
  sendChatAction: recorded, the sent messages kept per chat with their keyboard;
- answerCallbackQuery (`callback_query_id` of a query this server sent, once; `text` up to
  200 characters): recorded;
- editMessageText / editMessageReplyMarkup (`chat_id` + `message_id` of a message the bot
  sent, else 400 "message to edit not found"; the same text and markup again: 400 "message
  is not modified"): the kept message changes;
- getFile and the file download URL (files put in `files`);
- scripted failures per method (`fail`);
- pool bots (`add_bot`): other tokens the same server answers, each its own bot with its own
  name, which `setMyName` changes (`name` 0-64 characters, else 400; getMe's first_name and
  getMyName show it) and which posts only in the chats it was added to (elsewhere
  sendMessage is 403 "Forbidden: bot is not a member of the group chat"); every call and
  sent message records which bot made it (`calls_by`, a message's `bot` and `bot_name`).

`ThreadedFake` runs one (and any other aiohttp app) on a loop of its own thread, for tests
whose daemon is another process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from aiohttp import web

TOKEN = "123456:SECRET-token_value"
BOT_ID = 1
BOT_USERNAME = "mdclaw_test_bot"


def _bad(description: str) -> web.Response:
    return web.json_response({"ok": False, "error_code": 400,
                              "description": f"Bad Request: {description}"}, status=400)


def keyboard_problem(markup: Any) -> str | None:
    """Why `markup` is not an InlineKeyboardMarkup Telegram takes (None: it is)."""
    if not isinstance(markup, dict) or not isinstance(markup.get("inline_keyboard"), list):
        return "field \"inline_keyboard\" of the InlineKeyboardMarkup must be an Array"
    for row in markup["inline_keyboard"]:
        if not isinstance(row, list):
            return ("field \"inline_keyboard\" of the InlineKeyboardMarkup must be an Array "
                    "of Arrays")
        for b in row:
            if not isinstance(b, dict) or not isinstance(b.get("text"), str) or not b["text"]:
                return "can't parse inline keyboard button: Text buttons are unallowed in " \
                    "the inline keyboard"
            data = b.get("callback_data")
            if data is not None and (not isinstance(data, str)
                                     or not 1 <= len(data.encode()) <= 64):
                return "BUTTON_DATA_INVALID"
    return None


class FakeBotApi:
    """Just enough of the Bot API (see the module doc). `messages[(chat_id, message_id)]`
    is every message the bot sent, as it stands now ({"text", "reply_markup", "edits"})."""

    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.updates: list[dict[str, Any]] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.offsets: list[int | None] = []
        self.fail: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self.new_update = asyncio.Event()
        self.next_message_id = 1000
        self.runner: web.AppRunner | None = None
        self.base = ""
        # file_id -> (file_path, content, file_size getFile announces or None)
        self.files: dict[str, tuple[str, bytes, int | None]] = {}
        self.downloads: list[str] = []
        # file_path -> event: the download sends its first chunk, then waits for the event
        self.gates: dict[str, asyncio.Event] = {}
        self.download_started = asyncio.Event()
        self.messages: dict[tuple[int, int], dict[str, Any]] = {}
        self.queries: dict[str, dict[str, Any]] = {}  # callback_query id -> the query
        self.answered: dict[str, dict[str, Any]] = {}  # callback_query id -> the answer
        self._query_seq = 0
        self._lock = threading.Lock()  # tests on another thread push and read
        # Pool bots: token -> {"id", "name", "chats" (None: every chat)}.
        self.bots: dict[str, dict[str, Any]] = {}
        self.calls_by: list[tuple[int, str, dict[str, Any]]] = []  # (bot id, method, params)

    def add_bot(self, token: str, name: str, chats: set[int] | None = None) -> int:
        """Another bot this server answers for (a pool bot); its id (the token's first
        part). `chats`: where it is a member (None: everywhere)."""
        bot_id = int(token.split(":", 1)[0])
        self.bots[token] = {"id": bot_id, "name": name, "chats": chats}
        return bot_id

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/bot{token}/{method}", self.handle)
        app.router.add_get("/file/bot{token}/{path:.+}", self.download)
        return app

    async def start(self, port: int = 0) -> None:
        self.runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        self.base = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()
            self.runner = None

    def _add(self, update: dict[str, Any]) -> None:
        with self._lock:
            update["update_id"] = 500 + len(self.updates)
            self.updates.append(update)
        self.new_update.set()

    def push(self, message: dict[str, Any]) -> None:
        """A `message` update (call on the fake's loop, or through ThreadedFake.call)."""
        self._add({"message": message})

    def push_press(self, *, from_id: int, chat_id: int, message_id: int, data: str,
                   first_name: str = "Alex") -> str:
        """A `callback_query` update: user `from_id` pressed the button with `data` on the
        bot's message `message_id` in chat `chat_id`; returns the query's id."""
        with self._lock:
            self._query_seq += 1
            qid = f"cq{self._query_seq}"
        message = self.messages.get((chat_id, message_id), {})
        query = {"id": qid, "from": {"id": from_id, "is_bot": False, "first_name": first_name},
                 "message": {"message_id": message_id, "date": int(time.time()),
                             "chat": {"id": chat_id, "type": "private" if chat_id > 0
                                      else "group"},
                             "text": message.get("text", "")},
                 "chat_instance": str(chat_id), "data": data}
        self.queries[qid] = query
        self._add({"callback_query": query})
        return qid

    def of(self, method: str) -> list[dict[str, Any]]:
        return [p for m, p in list(self.calls) if m == method]  # list(): a snapshot

    def sent(self) -> list[tuple[tuple[int, int], dict[str, Any]]]:
        """Every message the bot sent, as it stands now, in order (a snapshot: the fake's
        own thread may be adding to them)."""
        with self._lock:
            return sorted(self.messages.items())

    def keyboards(self, chat_id: int) -> list[tuple[int, dict[str, Any]]]:
        """(message id, message) of the bot's messages in `chat_id` that show a keyboard."""
        return [(mid, m) for (cid, mid), m in self.sent()
                if cid == chat_id and (m.get("reply_markup") or {}).get("inline_keyboard")]

    async def handle(self, request: web.Request) -> web.Response:
        token = request.match_info["token"]
        if token != self.token and token not in self.bots:
            return web.json_response({"ok": False, "error_code": 401,
                                      "description": "Unauthorized"}, status=401)
        method = request.match_info["method"]
        pool = self.bots.get(token)
        if request.content_type.startswith("multipart/"):
            params: dict[str, Any] = {}
            reader = await request.multipart()
            async for part in reader:
                if part.filename:
                    params[part.name] = (part.filename, bytes(await part.read()))
                else:
                    params[part.name] = await part.text()
        else:
            params = await request.json() if request.can_read_body else {}
        if method == "getUpdates":
            offset = params.get("offset")
            self.offsets.append(offset)
            allowed = params.get("allowed_updates")
            deadline = time.monotonic() + min(params.get("timeout", 0), 0.5)
            while True:
                with self._lock:
                    pending = [u for u in self.updates
                               if (offset is None or u["update_id"] >= offset)
                               and (allowed is None or any(k in u for k in allowed))]
                if pending or time.monotonic() >= deadline:
                    return web.json_response({"ok": True, "result": pending})
                self.new_update.clear()
                try:
                    await asyncio.wait_for(self.new_update.wait(), deadline - time.monotonic())
                except TimeoutError:
                    pass
        if pool is None:
            self.calls.append((method, params))
        self.calls_by.append((pool["id"] if pool else BOT_ID, method, params))
        script = self.fail.get(method)
        if script:
            status, body = script.pop(0)
            return web.json_response(body, status=status)
        if pool is not None:
            return self._pool_call(pool, method, params)
        if method == "getMe":
            return web.json_response({"ok": True, "result": {"id": BOT_ID, "is_bot": True,
                                                             "username": BOT_USERNAME}})
        if method == "getFile":
            entry = self.files.get(params.get("file_id", ""))
            if entry is None:
                return _bad("invalid file_id")
            path, content, announced = entry
            return web.json_response({"ok": True, "result": {
                "file_id": params["file_id"], "file_unique_id": "u" + params["file_id"],
                "file_size": len(content) if announced is None else announced,
                "file_path": path}})
        if method == "sendMessage":
            text = params.get("text")
            if not isinstance(text, str) or not 1 <= len(text) <= 4096:
                return _bad("message text is empty" if not text else "message is too long")
            markup = params.get("reply_markup")
            if markup is not None and (why := keyboard_problem(markup)):
                return _bad(why)
            with self._lock:
                self.next_message_id += 1
                self.messages[(int(params["chat_id"]), self.next_message_id)] = {
                    "text": text, "reply_markup": markup, "edits": 0, "bot": BOT_ID,
                    "bot_name": BOT_USERNAME, "entities": params.get("entities")}
            return web.json_response({"ok": True, "result": {
                "message_id": self.next_message_id, "date": int(time.time()),
                "chat": {"id": int(params["chat_id"])}, "text": text}})
        if method in ("sendDocument", "sendPhoto"):
            self.next_message_id += 1
            return web.json_response({"ok": True, "result": {"message_id": self.next_message_id}})
        if method in ("editMessageText", "editMessageReplyMarkup"):
            return self._edit(method, params)
        if method == "answerCallbackQuery":
            qid = params.get("callback_query_id")
            if qid not in self.queries:
                return _bad("query is too old and response timeout expired or query ID is "
                            "invalid")
            if qid in self.answered:
                return _bad("query is too old and response timeout expired or query ID is "
                            "invalid")
            text = params.get("text")
            if text is not None and (not isinstance(text, str) or len(text) > 200):
                return _bad("MESSAGE_TOO_LONG")
            self.answered[qid] = params
            return web.json_response({"ok": True, "result": True})
        return web.json_response({"ok": True, "result": True})

    def _pool_call(self, bot: dict[str, Any], method: str,
                   params: dict[str, Any]) -> web.Response:
        if method == "getMe":
            return web.json_response({"ok": True, "result": {
                "id": bot["id"], "is_bot": True, "first_name": bot["name"],
                "username": f"pool{bot['id']}_bot"}})
        if method == "getMyName":
            return web.json_response({"ok": True, "result": {"name": bot["name"]}})
        if method == "setMyName":
            name = params.get("name", "")
            if not isinstance(name, str) or len(name) > 64:
                return _bad("bot name is too long")
            bot["name"] = name
            return web.json_response({"ok": True, "result": True})
        if method == "sendMessage":
            chat = int(params["chat_id"])
            if bot["chats"] is not None and chat not in bot["chats"]:
                return web.json_response({"ok": False, "error_code": 403, "description":
                                          "Forbidden: bot is not a member of the group chat"},
                                         status=403)
            text = params.get("text")
            if not isinstance(text, str) or not 1 <= len(text) <= 4096:
                return _bad("message text is empty" if not text else "message is too long")
            with self._lock:
                self.next_message_id += 1
                self.messages[(chat, self.next_message_id)] = {
                    "text": text, "reply_markup": None, "edits": 0, "bot": bot["id"],
                    "bot_name": bot["name"], "entities": params.get("entities")}
            return web.json_response({"ok": True, "result": {
                "message_id": self.next_message_id, "date": int(time.time()),
                "chat": {"id": chat}, "text": text}})
        return web.json_response({"ok": True, "result": True})

    def _edit(self, method: str, params: dict[str, Any]) -> web.Response:
        try:
            key = (int(params["chat_id"]), int(params["message_id"]))
        except (KeyError, TypeError, ValueError):
            return _bad("message identifier is not specified")
        message = self.messages.get(key)
        if message is None:
            return _bad("message to edit not found")
        markup = params.get("reply_markup")
        if markup is not None and (why := keyboard_problem(markup)):
            return _bad(why)
        new = dict(message)
        if method == "editMessageText":
            text = params.get("text")
            if not isinstance(text, str) or not 1 <= len(text) <= 4096:
                return _bad("message text is empty")
            new["text"] = text
        new["reply_markup"] = markup if markup and markup.get("inline_keyboard") else None
        if (new["text"], new["reply_markup"]) == (message["text"], message["reply_markup"]):
            return _bad("message is not modified: specified new message content and reply "
                        "markup are exactly the same as a current content and reply markup "
                        "of the message")
        new["edits"] = message["edits"] + 1
        with self._lock:
            self.messages[key] = new
        return web.json_response({"ok": True, "result": {
            "message_id": key[1], "chat": {"id": key[0]}, "text": new["text"]}})

    async def download(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["token"] != self.token:
            return web.Response(status=401)
        path = request.match_info["path"]
        self.downloads.append(path)
        for fpath, content, _ in self.files.values():
            if fpath == path:
                resp = web.StreamResponse()  # chunked: no Content-Length to trust
                await resp.prepare(request)
                self.download_started.set()
                for i in range(0, len(content), 4096):
                    await resp.write(content[i:i + 4096])
                    if path in self.gates:
                        await self.gates[path].wait()
                await resp.write_eof()
                return resp
        return web.Response(status=404)


class ThreadedFake:
    """aiohttp apps served on 127.0.0.1 from a loop of their own thread (for a daemon in
    another process): `url(name)` is each one's base URL; `call(fn, ...)` runs a function
    on that loop (to push updates into a FakeBotApi, whose events belong to it)."""

    def __init__(self, **apps: Any) -> None:
        self.apps = apps  # name -> a FakeBotApi, or a callable making an aiohttp app
        self.urls: dict[str, str] = {}
        self.loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedFake:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    async def _start(self) -> None:
        for name, app in self.apps.items():
            if isinstance(app, FakeBotApi):
                app.new_update = asyncio.Event()  # belongs to this loop
                await app.start()
                self.urls[name] = app.base
                continue
            runner = web.AppRunner(app(), access_log=None, shutdown_timeout=0.1)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self._runners.append(runner)
            self.urls[name] = f"http://127.0.0.1:{runner.addresses[0][1]}"

    def call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        async def run() -> Any:
            return fn(*args, **kw)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            for app in self.apps.values():
                if isinstance(app, FakeBotApi):
                    await app.stop()
            for runner in self._runners:
                await runner.cleanup()
            # a long poll the daemon left open ends with the loop, not destroyed pending
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
