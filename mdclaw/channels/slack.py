"""Slack (`slack:<channel id>`) as a Slack app in Socket Mode, with slack-bolt and slack-sdk.

In: Bolt's async app receives the Events API over a Socket Mode websocket (slack-sdk's aiohttp
client; no public URL). The app runs with `process_before_response`, so an envelope is acked
only after its listener returned, and the listener returns only after the host stored the
message (the orchestrator's callback writes it to SQLite first); a listener that fails is not
acked and Slack sends the envelope again. Copies (Slack's retries, a `message` and an
`app_mention` of the same message, an envelope sent again on a new connection) are dropped by
event id and message id here, and by message id in the host. `message` events (text, files,
thread replies) become InboundMessages with id `slack:<channel>:<ts>`, or
`slack:<channel>:<thread ts>/<ts>` in a thread, sender the Slack user id; `addressed` for a
mention of the bot (`<@bot>`, also `app_mention`), a direct message, and a reply in a thread
the bot started or wrote in. Files are Attachments downloaded on demand with the bot token
(`url_private_download`, streamed and capped). The `/chatid` slash command is answered in the
command's own response (only the person who typed it sees it).

Out: the assistant's Markdown as mrkdwn (mdclaw.markup.to_slack), cut at 4,000 characters
without cutting a code block (split_slack); `chat.postMessage` into the thread the question
was asked in (the chat's answer thread is kept in the state database, so a restart between
question and answer does not move the answer); files by files upload v2
(`files.getUploadURLExternal`, the upload, `files.completeUploadExternal`), `reactions.add`
(Unicode emoji mapped to Slack's names). Slack has no typing indicator for apps outside its
assistant threads (the old RTM `typing` message is gone for new apps), so `set_typing` does
nothing. A 429 (Slack's tier rate limits) becomes ChannelError(retry_after=Retry-After): the
outbox waits and sends once; slack-sdk's own retry handlers are switched off so nothing is
sent twice behind the outbox's back.

Reconnects: when the websocket closes or fails, a new URL is asked with
`apps.connections.open` after the shared backoff (mdclaw.retry), the SDK's own reconnect loop
being switched off; envelopes not acked on the old connection come again on the new one.
Slack gives up on an envelope after a few minutes, so after every connect `catch_up` reads
`conversations.history` of each chat seen before, after the newest message handed over (kept
per chat in router_state, written off the loop), and `conversations.replies` (after the same
mark) of the threads the chat is known to be active in: those a reply was handed over from or
the bot wrote in (the THREADS_KEPT most recently active per chat, in router_state), and those
whose parent the history just read shows with replies newer than the mark (`reply_count`,
`latest_reply`). A daemon stopped for longer so loses nothing written at a channel's top level
or in those threads (a reply in an older thread nobody had written in since the bot heard
from it last is not looked for), and the host's dedupe by id drops what came twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from mdclaw.channels.base import (
    Attachment,
    Channel,
    ChannelError,
    InboundCallback,
    InboundMessage,
    kind_for_mime,
    read_upload,
)
from mdclaw.config import EXTRAS, MissingExtra, read_secret
from mdclaw.markup import SLACK_LIMIT, split_slack, to_slack
from mdclaw.retry import Backoff
from mdclaw.retry import wait as backoff_wait
from mdclaw.state import Database, now_iso
from mdclaw.state.conversations import get_router_value, set_router_value

log = logging.getLogger("mdclaw.channels.slack")
sdk_log = logging.getLogger("mdclaw.channels.slack.sdk")  # slack-bolt's and slack-sdk's own

JID_RE = re.compile(r"^slack:([A-Z0-9]{2,32})\Z")
TS_RE = re.compile(r"^\d{1,12}\.\d{1,9}\Z")
# Slack takes files up to 1 GB; a file is read into memory to send, so mdclaw sends less.
MAX_UPLOAD_BYTES = 100 * 1024 * 1024
REMEMBERED = 4096  # event and message ids kept against copies; the bot's own message ts
CONNECT_TIMEOUT = 60.0
SEEN_KEY = "slack_seen:"  # router_state: the newest message ts handed over, per chat
CATCH_UP_MAX = 1000  # messages fetched per chat when catching up
CATCH_UP_WAIT = 30.0  # the longest rate-limit wait catching up sits out (3 times at most)
THREADS_KEY = "slack_threads:"  # router_state: {thread ts: newest ts there}, per chat
THREADS_KEPT = 20  # threads per chat whose replies are caught up (the most recently active)
# Errors that say a thread is gone (its parent deleted): forget it rather than retry.
GONE_THREAD_ERRORS = ("thread_not_found", "message_not_found")
AUTH_ERRORS = frozenset({"invalid_auth", "not_authed", "account_inactive", "token_revoked",
                         "token_expired", "not_allowed_token_type"})
# Errors sending again cannot fix (the chat, the message or the text is wrong).
PERMANENT_ERRORS = frozenset({
    "channel_not_found", "not_in_channel", "is_archived", "msg_too_long", "no_text",
    "invalid_blocks", "restricted_action", "too_many_attachments", "message_not_found",
    "cant_reply", "invalid_arguments", "invalid_name", "file_not_found", "bad_timestamp",
    "thread_not_found", "user_not_in_channel", "posting_to_general_channel_denied",
    "restricted_action_read_only_channel", "restricted_action_thread_only_channel",
    "duplicate_channel_not_found", "invalid_thread_ts"})
MESSAGE_SUBTYPES = frozenset({None, "file_share", "thread_broadcast"})
# Unicode emoji the assistant reacts with, as Slack's names (others: write the name).
EMOJI_NAMES = {
    "👍": "+1", "👎": "-1", "❤️": "heart", "❤": "heart", "😂": "joy", "😊": "blush",
    "😀": "grinning", "😄": "smile", "😉": "wink", "😍": "heart_eyes", "🤔": "thinking_face",
    "😢": "cry", "😮": "open_mouth", "😡": "rage", "🙏": "pray", "👏": "clap", "🎉": "tada",
    "🔥": "fire", "✅": "white_check_mark", "✔️": "heavy_check_mark", "❌": "x", "⚠️": "warning",
    "👀": "eyes", "💯": "100", "🚀": "rocket", "⭐": "star", "✨": "sparkles", "👌": "ok_hand",
    "🙌": "raised_hands", "💪": "muscle", "🤝": "handshake", "👋": "wave",
    "⏳": "hourglass_flowing_sand", "⌛": "hourglass", "📌": "pushpin", "📝": "memo",
    "💡": "bulb", "🐛": "bug", "🆗": "ok",
    "😅": "sweat_smile", "🙂": "slightly_smiling_face", "🤖": "robot_face",
}
EMOJI_NAME_RE = re.compile(r"^:?([a-z0-9_+'-]{1,64}):?\Z")


def _slack() -> Any:
    """slack-bolt's and slack-sdk's parts, imported on first use (an optional dependency).
    Raises a permanent ChannelError with the extra to install when they are missing."""
    try:
        from slack_bolt.adapter.socket_mode.async_handler import AsyncSocketModeHandler
        from slack_bolt.async_app import AsyncApp
        from slack_sdk.errors import SlackApiError, SlackClientError
        from slack_sdk.web.async_client import AsyncWebClient
    except ImportError as e:
        missing = MissingExtra("channels.slack", EXTRAS["slack"], f"cannot be imported ({e})")
        raise ChannelError(missing.message, permanent=True) from None
    return SimpleNamespace(App=AsyncApp, Handler=AsyncSocketModeHandler, Web=AsyncWebClient,
                           ApiError=SlackApiError, ClientError=SlackClientError)


def _remember(seen: OrderedDict[str, None], key: str) -> None:
    seen[key] = None
    seen.move_to_end(key)
    while len(seen) > REMEMBERED:
        seen.popitem(last=False)


def _header(headers: Any, name: str) -> str | None:
    """A response header by name, whatever its case."""
    for k, v in dict(headers or {}).items():
        if str(k).lower() == name.lower():
            return str(v[0] if isinstance(v, list | tuple) and v else v)
    return None


def slack_time(ts: str) -> str:
    """A Slack message ts ("1700000000.000100") in the database's form (now when odd)."""
    try:
        return now_iso(datetime.fromtimestamp(float(ts), UTC))
    except (TypeError, ValueError, OverflowError):
        return now_iso()


def split_id(message_id: str) -> tuple[str, str | None, str]:
    """Our message id as (channel, thread ts or None, ts). Raises a permanent ChannelError
    for an id that is no Slack message."""
    parts = str(message_id).split(":")
    if len(parts) != 3 or parts[0] != "slack":
        raise ChannelError(f"message id {message_id!r} is not a Slack message", permanent=True)
    thread, _, ts = parts[2].rpartition("/")
    if not TS_RE.match(ts) or (thread and not TS_RE.match(thread)):
        raise ChannelError(f"message id {message_id!r} is not a Slack message", permanent=True)
    return parts[1], thread or None, ts


class SlackChannel(Channel):
    """A Slack app: `bot_token` (xoxb-) for the Web API, `app_token` (xapp-) for Socket
    Mode. `api_base` is the Web API root (a fake server in tests)."""

    name = "slack"
    jid_prefix = "slack:"
    max_message_length = SLACK_LIMIT
    # Waits before asking for a new websocket after a failed one: 1 s doubling to 2 min,
    # equal jitter (after an outage of Slack's, its apps do not all come back at once).
    reconnect_backoff = Backoff(base=1.0, factor=2.0, cap=120.0)

    def __init__(self, bot_token: str, app_token: str, *,
                 api_base: str = "https://slack.com/api/",
                 on_inbound: InboundCallback | None = None, trigger: str | None = None,
                 db: Database | None = None, ping_interval: float = 10.0,
                 request_timeout: int = 30) -> None:
        super().__init__(on_inbound)
        for what, token, prefix in (("bot", bot_token, "xoxb-"), ("app", app_token, "xapp-")):
            if not token or any(c.isspace() for c in token) or not token.startswith(prefix):
                raise ChannelError(f"the Slack {what} token is empty or malformed (it starts "
                                   f"with {prefix})")
        self._bot_token = bot_token
        self._app_token = app_token
        self.api_base = api_base.rstrip("/") + "/"
        self.trigger = trigger
        self.db = db
        self.ping_interval = ping_interval
        self.request_timeout = request_timeout
        self.web: Any = None  # slack-sdk AsyncWebClient with the bot token
        self.app: Any = None  # the Bolt app
        self.socket: Any = None  # slack-sdk's Socket Mode client
        self._handler: Any = None
        self._session: aiohttp.ClientSession | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._session_ended = asyncio.Event()
        self._running = False
        self._socket_up = False
        self.sessions_started = 0
        self.bot_user_id: str | None = None
        self.bot_id: str | None = None
        self.team: str | None = None
        self.bot_name: str | None = None
        self._events: OrderedDict[str, None] = OrderedDict()  # event ids handed over
        self._messages: OrderedDict[str, None] = OrderedDict()  # message ids handed over
        self._own: OrderedDict[str, None] = OrderedDict()  # ts of the bot's messages
        self._users: dict[str, str] = {}  # user id -> name
        self._chats: dict[str, str | None] = {}  # channel id -> name
        # The thread each chat's next answer goes to (None: the channel itself), and whether
        # it was set by a question not yet answered (then plain chatter does not move it).
        self._threads: dict[str, str | None] = {}
        self._asked: dict[str, bool] = {}
        self._inbound_lock = asyncio.Lock()
        self._seen: dict[str, str] = {}  # chat -> newest message ts handed over
        # chat -> {thread ts: newest ts handed over or posted there}, loaded from router_state
        self._active: dict[str, dict[str, str]] = {}

    @classmethod
    def from_config(cls, section: Any, *, on_inbound: InboundCallback | None = None,
                    trigger: str | None = None, db: Database | None = None) -> SlackChannel:
        """Build from the `channels.slack` section; reads both token files now. Raises
        ChannelError naming the file (never its content) if one cannot be read."""
        tokens = []
        for key in ("bot_token_file", "app_token_file"):
            path = getattr(section, key)
            try:
                tokens.append(read_secret(path))
            except OSError as e:
                raise ChannelError(f"cannot read channels.slack.{key} {path}: "
                                   f"{e.strerror}") from None
        return cls(tokens[0], tokens[1], api_base=section.api_base, on_inbound=on_inbound,
                   trigger=trigger, db=db)

    def redact(self, text: str) -> str:
        return text.replace(self._bot_token, "***").replace(self._app_token, "***")

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> None:
        """Check the bot token with auth.test, then open Socket Mode in the background.

        Raises ChannelError if Slack rejects the bot token, or slack-bolt is not installed.
        When Slack cannot be reached the channel starts anyway, not connected, and connects
        as soon as it can (sends wait in the outbox meanwhile)."""
        if self._supervisor is not None:
            return
        sl = _slack()
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self.web = sl.Web(token=self._bot_token, base_url=self.api_base, session=self._session,
                          timeout=self.request_timeout, retry_handlers=[], logger=sdk_log)
        try:
            await self._who_am_i()
        except ChannelError as e:
            if e.code == 401:
                await self._close_session()
                raise ChannelError(f"Slack rejected the bot token ({e}); check "
                                   "channels.slack.bot_token_file") from None
            log.warning("slack: %s; will keep trying", e)
        self.app = sl.App(client=self.web, process_before_response=True,
                          request_verification_enabled=False, logger=sdk_log)
        self.app.event("message")(self._on_event)
        self.app.event("app_mention")(self._on_event)
        self.app.event(re.compile(".*"))(self._on_other_event)
        self.app.command("/chatid")(self._on_chatid)
        self.app.error(self._on_error)
        self._handler = sl.Handler(
            self.app, self._app_token, logger=sdk_log, ping_interval=self.ping_interval,
            web_client=sl.Web(base_url=self.api_base, session=self._session,
                              timeout=self.request_timeout, retry_handlers=[], logger=sdk_log))
        self.socket = self._handler.client
        # The reconnects are this channel's (with the shared backoff), not the SDK's own.
        self.socket.default_auto_reconnect_enabled = False
        self.socket.auto_reconnect_enabled = False
        self.socket.on_close_listeners.append(self._socket_closed)
        self.socket.on_error_listeners.append(self._socket_closed)
        self._running = True
        self._stop.clear()
        self._supervisor = asyncio.create_task(self._supervise(), name="slack-socket")

    async def _who_am_i(self) -> None:
        """Learn the bot's own ids with auth.test (mentions of it, its own messages). Raises
        ChannelError, with code 401 when Slack rejects the bot token."""
        sl = _slack()
        try:
            me = await self.web.auth_test()
        except sl.ApiError as e:
            err = e.response.get("error")
            if err in AUTH_ERRORS:
                raise ChannelError(str(err), code=401) from None
            raise ChannelError(f"auth.test: {self._api_error(e)}") from None
        except (aiohttp.ClientError, TimeoutError, sl.ClientError) as e:
            raise ChannelError(self.redact(f"cannot reach Slack ({type(e).__name__}: "
                                           f"{e})")) from None
        self.bot_user_id, self.bot_id = me.get("user_id"), me.get("bot_id")
        self.team, self.bot_name = me.get("team"), me.get("user")
        log.info("slack: connected to %s as @%s", self.team or "?", self.bot_name or "?")

    async def _socket_closed(self, message: Any) -> None:
        self._socket_up = False
        self._session_ended.set()

    async def _supervise(self) -> None:
        """Keep one Socket Mode connection open: open it, wait for it to end, open a new one
        after the backoff (failures in a row make the wait grow)."""
        failures = 0
        while self._running:
            up = await self.socket.is_connected()
            if up:
                self._socket_up = True
                self._session_ended.clear()
                with contextlib.suppress(TimeoutError):
                    # The close/error listeners end this wait; the timeout is the backstop
                    # for a connection that ended without a word.
                    await asyncio.wait_for(self._session_ended.wait(), self.ping_interval * 2)
                continue
            self._socket_up = False
            if failures and await backoff_wait(self.reconnect_backoff.delay(failures),
                                               self._stop):
                break
            try:
                await asyncio.wait_for(self.socket.connect_to_new_endpoint(),
                                       CONNECT_TIMEOUT)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - SlackApiError, network errors, timeouts
                failures += 1
                log.warning("slack: Socket Mode did not connect: %s",
                            self._describe(e, "app"))
                continue
            if await self.socket.is_connected():
                self.sessions_started += 1
                failures = 0
                log.info("slack: Socket Mode connected")
                if self.bot_user_id is None:  # Slack was not reachable at the start
                    try:
                        await self._who_am_i()
                    except ChannelError as e:
                        log.warning("slack: auth.test: %s", e)
                self._socket_up = True
                await self.catch_up()
            else:
                failures += 1

    def _describe(self, e: BaseException, which: str = "bot") -> str:
        """An error of slack-sdk in a line, token-free; a rejected token (`which`: "bot" or "app")
        with its fix."""
        resp = getattr(e, "response", None)
        if resp is not None and hasattr(resp, "get"):
            err = resp.get("error")
            if err in AUTH_ERRORS and which == "app":
                return (f"Slack rejected the app token ({err}); check "
                        "channels.slack.app_token_file (an xapp- token with connections:write)")
            if err in AUTH_ERRORS:
                return (f"Slack rejected the bot token ({err}); check "
                        "channels.slack.bot_token_file")
        return self.redact(f"{type(e).__name__}: {e}")[:300]

    async def disconnect(self) -> None:
        """Close Socket Mode and the HTTP session; safe to call twice."""
        self._running = False
        self._socket_up = False
        self._stop.set()
        self._session_ended.set()
        sup, self._supervisor = self._supervisor, None
        if sup is not None:
            sup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sup
        socket, self.socket = self.socket, None
        if socket is not None:
            try:
                await socket.close()
            except Exception as e:  # noqa: BLE001 - shutting down
                log.warning("slack: Socket Mode did not close cleanly: %s",
                            self._describe(e, "app"))
        self._handler = None
        await self._close_session()

    async def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def is_connected(self) -> bool:
        return self._running and self._socket_up

    def status_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"connected": self.is_connected()}
        if self.team:
            info["team"] = self.team
        if self.bot_name:
            info["account"] = f"@{self.bot_name}"
        if self._running and not self._socket_up:
            info["fix"] = ("Socket Mode is not connected: check the app token "
                           "(channels.slack.app_token_file) and that Socket Mode is on")
        return info

    # ------------------------------------------------------------------ inbound
    async def _on_error(self, error: Exception, body: dict[str, Any]) -> None:
        # Bolt answers 500 and the envelope is not acked: Slack sends it again.
        log.warning("slack: event %s not taken: %s", (body or {}).get("event_id", "?"),
                    self.redact(f"{type(error).__name__}: {error}"))

    async def _on_other_event(self, body: dict[str, Any]) -> None:
        """Events the app did not ask for: acked, so Slack does not send them again."""

    async def _on_chatid(self, ack: Callable[..., Awaitable[Any]],
                         command: dict[str, Any]) -> None:
        """`/chatid`: the chat's JID (what a group's `jid` in config.yaml needs), in the
        command's response, seen only by whoever asked."""
        channel = str(command.get("channel_id") or "")
        if not JID_RE.match(f"slack:{channel}"):
            await ack()
            return
        await ack(text=f"This chat is `slack:{channel}`")

    async def _on_event(self, body: dict[str, Any], event: dict[str, Any]) -> None:
        """A message (or a mention of the bot): handed to the host once. Returns after the
        host took it (then Bolt acks); raises when it did not (no ack: Slack sends again)."""
        event_id = str(body.get("event_id") or "")
        async with self._inbound_lock:  # one message after the other, in arrival order
            if event_id and event_id in self._events:
                return
            await self._take(event)
            if event_id:
                _remember(self._events, event_id)

    async def _take(self, event: dict[str, Any]) -> None:
        """Hand the message of `event` to the host unless it was handed over already; then
        note it as the chat's newest (call with the inbound lock held)."""
        msg = await self.parse_event(event)
        if msg is None or msg.id in self._messages:
            return
        await self._note_thread(msg, event)
        await self.deliver_inbound(msg)
        _remember(self._messages, msg.id)
        _channel, thread, ts = split_id(msg.id)
        await self._mark_seen(msg.chat_jid, ts)
        if thread:
            await self._note_active(msg.chat_jid, thread, ts)

    # ------------------------------------------------------------------ catching up
    async def _mark_seen(self, jid: str, ts: str) -> None:
        """Keep the newest message ts handed over per chat (in router_state, off the loop):
        where catching up starts after a restart."""
        if self.db is None or float(ts) <= float(self._seen.get(jid, "0")):
            return
        self._seen[jid] = ts
        try:
            await asyncio.to_thread(set_router_value, self.db, f"{SEEN_KEY}{jid}", ts)
        except Exception as e:  # noqa: BLE001 - sqlite3.Error; the next message writes it
            log.warning("slack: could not save the last message of %s: %s", jid, e)

    def _seen_marks(self) -> dict[str, str]:
        assert self.db is not None
        rows = self.db.query("SELECT key, value FROM router_state WHERE substr(key, 1, ?) = ?",
                             (len(SEEN_KEY), SEEN_KEY))
        return {str(r[0])[len(SEEN_KEY):]: str(r[1]) for r in rows
                if r[1] is not None and TS_RE.match(str(r[1]))}

    async def _load_active(self, jid: str) -> dict[str, str]:
        """The threads `jid` is known to be active in: {thread ts: newest ts there}."""
        if jid not in self._active:
            value = None
            if self.db is not None:
                try:
                    value = await asyncio.to_thread(get_router_value, self.db,
                                                    f"{THREADS_KEY}{jid}")
                except Exception as e:  # noqa: BLE001 - sqlite3.Error; starts empty
                    log.warning("slack: could not read the active threads of %s: %s", jid, e)
            try:
                loaded = json.loads(value) if value else {}
            except ValueError:
                loaded = {}
            known = {str(k): str(v) for k, v in (loaded if isinstance(loaded, dict) else {})
                     .items() if TS_RE.match(str(k)) and TS_RE.match(str(v))}
            self._active[jid] = self._active.get(jid, {}) | known
        return self._active[jid]

    async def _note_active(self, jid: str, thread: str, ts: str) -> None:
        """`thread` of `jid` saw `ts` (a reply handed over, or the bot's own message): its
        replies are caught up after a reconnect. The THREADS_KEPT most recently active are
        kept (in router_state, off the loop)."""
        active = await self._load_active(jid)
        if float(ts) <= float(active.get(thread, "0")):
            return
        active[thread] = ts
        for old in sorted(active, key=lambda t: float(active[t]))[:-THREADS_KEPT]:
            del active[old]
        await self._save_active(jid)

    async def _save_active(self, jid: str) -> None:
        if self.db is None:
            return
        try:
            await asyncio.to_thread(set_router_value, self.db, f"{THREADS_KEY}{jid}",
                                    json.dumps(self._active.get(jid, {}), sort_keys=True))
        except Exception as e:  # noqa: BLE001 - sqlite3.Error; the next message writes it
            log.warning("slack: could not save the active threads of %s: %s", jid, e)

    async def _fetch(self, method: str, call: Callable[..., Awaitable[Any]],
                     budget: int, **kwargs: Any) -> list[dict[str, Any]]:
        """Every message `method` (conversations.history or .replies) returns for `kwargs`,
        page after page, at most about `budget`. Raises ChannelError."""
        found: list[dict[str, Any]] = []
        cursor = None
        waited = 0
        while len(found) < budget:
            page = {**kwargs, "limit": 200}
            if cursor:
                page["cursor"] = cursor
            try:
                resp = await self._call(method, functools.partial(call, **page))
            except ChannelError as e:
                # A short rate limit (Slack's tiers) is waited out a few times: a chat whose
                # catch-up fails is left for the next connect.
                if e.retry_after is None or e.retry_after > CATCH_UP_WAIT or waited >= 3:
                    raise
                waited += 1
                if await backoff_wait(e.retry_after, self._stop):
                    raise
                continue
            found += [m for m in resp.get("messages") or [] if isinstance(m, dict)]
            cursor = (resp.get("response_metadata") or {}).get("next_cursor")
            if not cursor or not resp.get("has_more"):
                break
        return [m for m in found if isinstance(m.get("ts"), str) and TS_RE.match(m["ts"])]

    async def _missed(self, jid: str, oldest: str) -> list[dict[str, Any]]:
        """What was written in `jid` after `oldest`: the channel's history, and the replies of
        the threads it is known to be active in and of those the history shows with replies
        newer than `oldest`. Raises ChannelError when some of it could not be read (then
        nothing is handed over, so the mark does not move past what was not read)."""
        channel = jid[len(self.jid_prefix):]
        top = await self._fetch("conversations.history", self.web.conversations_history,
                                CATCH_UP_MAX, channel=channel, oldest=oldest, inclusive=False)
        found = [{**m, "channel": channel} for m in top]
        active = await self._load_active(jid)
        threads = dict.fromkeys(sorted(active, key=lambda t: -float(active[t])))
        for m in top:
            latest = m.get("latest_reply")
            if (m.get("reply_count") and isinstance(latest, str) and TS_RE.match(latest)
                    and float(latest) > float(oldest)):
                threads[m["ts"]] = None
        forgotten = False
        for thread in threads:
            if len(found) >= CATCH_UP_MAX:
                break
            try:
                replies = await self._fetch(
                    "conversations.replies", self.web.conversations_replies,
                    CATCH_UP_MAX - len(found), channel=channel, ts=thread, oldest=oldest,
                    inclusive=False)
            except ChannelError as e:
                if e.permanent and any(code in str(e) for code in GONE_THREAD_ERRORS):
                    forgotten = active.pop(thread, None) is not None or forgotten
                    continue
                raise
            found += [{**m, "channel": channel} for m in replies
                      if m["ts"] != thread and float(m["ts"]) > float(oldest)]
        if forgotten:
            await self._save_active(jid)
        found.sort(key=lambda m: float(m["ts"]))
        return found

    async def catch_up(self) -> int:
        """Hand over what was written in the chats seen before while no connection was
        open (Slack sends an event it could not deliver again only for a few minutes):
        each chat's history and replies in its active threads after its newest handed-over
        message (`_missed`), oldest first. Returns how many messages were new to the host."""
        if self.db is None or self.web is None:
            return 0
        try:
            marks = await asyncio.to_thread(self._seen_marks)
        except Exception as e:  # noqa: BLE001 - sqlite3.Error
            log.warning("slack: could not read where to catch up: %s", e)
            return 0
        for jid, ts in marks.items():  # an old envelope sent again never moves a mark back
            if float(ts) > float(self._seen.get(jid, "0")):
                self._seen[jid] = ts
        taken = 0
        for jid, oldest in marks.items():
            if not JID_RE.match(jid):
                continue
            try:
                found = await self._missed(jid, oldest)
            except ChannelError as e:
                log.warning("slack: could not catch up in %s: %s", jid, e)
                continue
            async with self._inbound_lock:
                for m in found:
                    before = len(self._messages)
                    try:
                        await self._take({**m, "type": "message"})
                    except Exception:  # noqa: BLE001 - the host's callback; next time again
                        log.exception("slack: the host did not take message %s of %s",
                                      m["ts"], jid)
                        break
                    taken += len(self._messages) > before
        if taken:
            log.info("slack: %d message(s) written while disconnected handed over", taken)
        return taken

    async def parse_event(self, event: dict[str, Any]) -> InboundMessage | None:
        """A `message` or `app_mention` event as an InboundMessage; None for edits,
        deletions, joins, the bot's own messages and messages without text or files."""
        if event.get("type") not in ("message", "app_mention"):
            return None
        if event.get("subtype") not in MESSAGE_SUBTYPES:
            return None
        channel, user, ts = event.get("channel"), event.get("user"), event.get("ts")
        if not (isinstance(channel, str) and isinstance(user, str) and isinstance(ts, str)
                and JID_RE.match(f"slack:{channel}") and TS_RE.match(ts)):
            return None
        if user == self.bot_user_id or (self.bot_id and event.get("bot_id") == self.bot_id):
            return None
        raw = event.get("text")
        text = raw if isinstance(raw, str) else ""
        attachments = self.attachments_of(event)
        if not text and not attachments:
            return None
        jid = f"slack:{channel}"
        thread = event.get("thread_ts")
        thread = thread if isinstance(thread, str) and TS_RE.match(thread) and thread != ts \
            else None
        dm = event.get("channel_type") == "im" or channel.startswith("D")
        mentioned = bool(self.bot_user_id and f"<@{self.bot_user_id}" in text)
        addressed = (event.get("type") == "app_mention" or mentioned or dm
                     or (thread is not None and (
                         event.get("parent_user_id") == self.bot_user_id
                         or thread in self._own)))
        content = await self.plain_text(text)
        if addressed and self.trigger and not re.search(
                rf"(?<!\w){re.escape(self.trigger)}(?!\w)", content, re.IGNORECASE):
            content = f"{self.trigger} {content}".rstrip()
        sender_name = await self._user_name(user)
        chat_name = sender_name if dm else await self._chat_name(channel)
        return InboundMessage(
            id=f"{jid}:{thread}/{ts}" if thread else f"{jid}:{ts}", chat_jid=jid, sender=user,
            sender_name=sender_name, content=content, timestamp=slack_time(ts),
            chat_name=chat_name, is_group=not dm, channel=self.name, addressed=addressed,
            attachments=attachments, reply_to=f"{jid}:{thread}" if thread else None)

    async def plain_text(self, text: str) -> str:
        """Slack's message text as a person reads it: mentions as @name (the bot's as the
        trigger), channels as #name, links as "text (url)", escapes undone."""
        out: list[str] = []
        pos = 0
        for m in re.finditer(r"<([^<>]*)>", text):
            out.append(text[pos:m.start()])
            pos = m.end()
            inner = m.group(1)
            target, _, label = inner.partition("|")
            if target.startswith("@"):
                uid = target[1:]
                if uid == self.bot_user_id:
                    out.append(self.trigger or f"@{self.bot_name or 'assistant'}")
                else:
                    out.append("@" + (label or await self._user_name(uid)))
            elif target.startswith("#"):
                out.append("#" + (label or target[1:]))
            elif target.startswith("!"):
                word = target[1:].split("^", 1)[0]
                out.append(label if label else f"@{word}")
            elif label and label != target:
                out.append(f"{label} ({target})")
            else:
                out.append(target)
        out.append(text[pos:])
        return "".join(out).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")

    async def _user_name(self, user: str) -> str:
        if user in self._users:
            return self._users[user]
        name = user
        try:
            info = (await self.web.users_info(user=user)).get("user") or {}
            prof = info.get("profile") or {}
            name = (prof.get("display_name") or prof.get("real_name") or info.get("real_name")
                    or info.get("name") or user)
        except Exception as e:  # noqa: BLE001 - a name is a nicety; the id stands in
            log.debug("slack: users.info %s: %s", user, self._describe(e))
            return name
        self._users[user] = name
        return name

    async def _chat_name(self, channel: str) -> str | None:
        if channel in self._chats:
            return self._chats[channel]
        try:
            info = (await self.web.conversations_info(channel=channel)).get("channel") or {}
        except Exception as e:  # noqa: BLE001 - a name is a nicety
            log.debug("slack: conversations.info %s: %s", channel, self._describe(e))
            return None
        name = info.get("name")
        self._chats[channel] = f"#{name}" if isinstance(name, str) and name else None
        return self._chats[channel]

    def attachments_of(self, event: dict[str, Any]) -> tuple[Attachment, ...]:
        """The files a message carries, each fetched with the bot token when the host asks."""
        out = []
        for f in event.get("files") or []:
            if not isinstance(f, dict) or not isinstance(f.get("id"), str) \
                    or f.get("mode") == "tombstone":
                continue
            mime = f.get("mimetype") if isinstance(f.get("mimetype"), str) else None
            size = f.get("size") if isinstance(f.get("size"), int) else None
            name = f.get("name") if isinstance(f.get("name"), str) else None
            kind = "voice" if f.get("subtype") == "slack_audio" else kind_for_mime(mime)

            async def fetch(limit: int, f: dict[str, Any] = f) -> bytes:
                return await self.download(f, limit)

            out.append(Attachment(kind=kind, name=name, mime=mime, size=size, fetch=fetch))
        return tuple(out)

    def _may_get_token(self, url: str) -> bool:
        """The bot token goes only to Slack (or to the configured API host)."""
        host = (urlsplit(url).hostname or "").lower()
        api_host = (urlsplit(self.api_base).hostname or "").lower()
        return host == api_host or host == "slack.com" or host.endswith(".slack.com")

    async def download(self, file: dict[str, Any], limit: int) -> bytes:
        """A Slack file's content (with the bot token), at most `limit` bytes. Raises
        ChannelError (token-free) when it is larger or cannot be fetched."""
        size = file.get("size")
        if isinstance(size, int) and size > limit:
            raise ChannelError(f"it is {size} bytes, over the {limit} bytes a file may have "
                               "here", permanent=True)
        url = file.get("url_private_download") or file.get("url_private")
        if not isinstance(url, str):  # e.g. file_access: check_file_info
            try:
                info = (await self.web.files_info(file=file["id"])).get("file") or {}
            except Exception as e:  # noqa: BLE001 - SlackApiError, network
                raise ChannelError(f"slack files.info: {self._describe(e)}") from None
            url = info.get("url_private_download") or info.get("url_private")
        if not isinstance(url, str) or not self._may_get_token(url):
            raise ChannelError("slack: the file has no download address on Slack",
                               permanent=True)
        if self._session is None:
            raise ChannelError("the Slack channel is not connected")
        chunks: list[bytes] = []
        total = 0
        try:
            async with self._session.get(
                    url, headers={"Authorization": f"Bearer {self._bot_token}"},
                    timeout=aiohttp.ClientTimeout(total=max(self.request_timeout, 120))) as r:
                if r.status != 200:
                    raise ChannelError(f"slack file download: HTTP {r.status}", code=r.status,
                                       permanent=r.status in (403, 404))
                if r.content_type == "text/html":
                    raise ChannelError("slack file download: Slack answered with a web page "
                                       "(the app lacks the files:read scope)", permanent=True)
                async for chunk in r.content.iter_chunked(64 * 1024):
                    total += len(chunk)
                    if total > limit:
                        raise ChannelError(f"larger than the {limit} bytes a file may have "
                                           "here", permanent=True)
                    chunks.append(chunk)
        except TimeoutError:
            raise ChannelError("slack file download: no answer in time") from None
        except aiohttp.ClientError as e:
            raise ChannelError(self.redact(f"slack file download: {type(e).__name__}: "
                                           f"{e}")) from None
        return b"".join(chunks)

    # ------------------------------------------------------------------ answer threads
    def _thread_key(self, jid: str) -> str:
        return f"slack_thread:{jid}"

    async def _note_thread(self, msg: InboundMessage, event: dict[str, Any]) -> None:
        """Remember where `msg` was written, as where the chat's next answer goes: a question
        (the bot addressed, or the trigger named) always moves it; other chatter only once the
        last question was answered. Kept in the database (off the loop) before the host
        stores the message, so a restart does not move the answer."""
        jid = msg.chat_jid
        thread = split_id(msg.id)[1]
        asked = msg.addressed or bool(self.trigger and re.search(
            rf"(?<!\w){re.escape(self.trigger)}(?!\w)", msg.content, re.IGNORECASE))
        await self._load_thread(jid)
        if not asked and self._asked.get(jid):
            return
        self._asked[jid] = asked
        if jid in self._threads and self._threads[jid] == thread:
            return
        self._threads[jid] = thread
        if self.db is not None:
            try:
                await asyncio.to_thread(set_router_value, self.db, self._thread_key(jid),
                                        thread or "")
            except Exception as e:  # noqa: BLE001 - sqlite3.Error; kept in memory
                log.warning("slack: could not save the answer thread of %s: %s", jid, e)

    async def _load_thread(self, jid: str) -> None:
        if jid in self._threads or self.db is None:
            return
        try:
            value = await asyncio.to_thread(get_router_value, self.db, self._thread_key(jid))
        except Exception as e:  # noqa: BLE001 - sqlite3.Error
            log.warning("slack: could not read the answer thread of %s: %s", jid, e)
            return
        if jid not in self._threads and value is not None:
            self._threads[jid] = value if TS_RE.match(value) else None
            self._asked[jid] = True  # a question may wait for its answer

    async def answer_thread(self, jid: str, reply_to: str | None) -> str | None:
        """The thread ts a message to `jid` goes to: the thread of `reply_to` (or a new one
        under it), else the thread the chat's last question was asked in."""
        if reply_to:
            try:
                channel, thread, ts = split_id(reply_to)
            except ChannelError:
                channel, thread, ts = "", None, ""
            if f"slack:{channel}" == jid:
                return thread or ts
        await self._load_thread(jid)
        return self._threads.get(jid)

    # ------------------------------------------------------------------ Web API
    def _api_error(self, e: Any) -> ChannelError:
        """A SlackApiError as a ChannelError: a 429 with Retry-After to wait, errors sending
        again cannot fix as permanent."""
        resp = e.response
        status = getattr(resp, "status_code", None)
        err = resp.get("error") if hasattr(resp, "get") else None
        if status == 429 or err == "ratelimited":
            raw = _header(getattr(resp, "headers", None), "Retry-After")
            try:
                wait = max(1.0, float(raw)) if raw is not None else 30.0
            except ValueError:
                wait = 30.0
            return ChannelError(f"slack: rate limited, retry after {wait:g} s",
                                retry_after=wait, code=429)
        text = f"slack: {status} {err or 'unexpected answer'}"
        if err == "missing_scope":
            needed = resp.get("needed") if hasattr(resp, "get") else None
            text += f" (the app needs the scope {needed}; add it and reinstall the app)"
        return ChannelError(self.redact(text), permanent=err in PERMANENT_ERRORS,
                            code=status if isinstance(status, int) else None)

    async def _call(self, what: str, call: Callable[[], Awaitable[Any]]) -> Any:
        if self.web is None:
            raise ChannelError("the Slack channel is not connected")
        sl = _slack()
        try:
            return await call()
        except sl.ApiError as e:
            err = self._api_error(e)
            raise ChannelError(f"{what}: {err}", permanent=err.permanent,
                               retry_after=err.retry_after, code=err.code) from None
        except TimeoutError:
            raise ChannelError(f"slack {what}: no answer in time") from None
        except (aiohttp.ClientError, sl.ClientError, OSError) as e:
            raise ChannelError(self.redact(f"slack {what}: {type(e).__name__}: {e}")) from None

    # ------------------------------------------------------------------ outbound
    @staticmethod
    def _channel(jid: str) -> str:
        m = JID_RE.match(jid)
        if not m:
            raise ChannelError(f"{jid!r} is not a Slack chat", permanent=True)
        return m.group(1)

    def message_parts(self, text: str) -> list[str]:
        """The Markdown `text` as mrkdwn messages of at most 4,000 characters."""
        return split_slack(to_slack(text), self.max_message_length)

    async def send_message(self, jid: str, text: str, *, reply_to: str | None = None,
                           sender: str | None = None) -> str | None:
        """Send the Markdown `text` as mrkdwn, split; returns the last piece's id."""
        last = None
        for i, part in enumerate(self.message_parts(text)):
            last = await self.send_part(jid, part, reply_to=reply_to if i == 0 else None)
        return last

    async def send_part(self, jid: str, part: Any, *, reply_to: str | None = None,
                        sender: str | None = None) -> str | None:
        """Post one mrkdwn piece into the answer thread."""
        channel = self._channel(jid)
        thread = await self.answer_thread(jid, reply_to)
        kwargs: dict[str, Any] = {"channel": channel, "text": str(part),
                                  "unfurl_links": False}
        if thread:
            kwargs["thread_ts"] = thread
        resp = await self._call("chat.postMessage",
                                lambda: self.web.chat_postMessage(**kwargs))
        self._answered(jid)
        ts = resp.get("ts")
        if not isinstance(ts, str):
            return None
        _remember(self._own, ts)
        if thread:
            _remember(self._own, thread)
            if TS_RE.match(ts):
                await self._note_active(jid, thread, ts)
        return f"{jid}:{thread}/{ts}" if thread else f"{jid}:{ts}"

    def _answered(self, jid: str) -> None:
        self._asked[jid] = False

    async def send_file(self, jid: str, path: Path, *, file_name: str | None = None,
                        caption: str | None = None) -> str | None:
        """Upload the file (files upload v2) into the answer thread, the caption as its
        comment (mrkdwn)."""
        channel = self._channel(jid)
        path = Path(path)
        content = await asyncio.to_thread(read_upload, path, MAX_UPLOAD_BYTES,
                                          "through Slack mdclaw sends at most")
        name = file_name or path.name
        thread = await self.answer_thread(jid, None)
        comment = to_slack(caption) if caption else None
        if comment and len(comment) > self.max_message_length:
            comment = None  # too long for a comment: it follows as messages
        kwargs: dict[str, Any] = {"channel": channel, "file": content, "filename": name,
                                  "title": name, "request_file_info": False}
        if comment:
            kwargs["initial_comment"] = comment
        if thread:
            kwargs["thread_ts"] = thread
        await self._call("files upload", lambda: self.web.files_upload_v2(**kwargs))
        self._answered(jid)
        if caption and not comment:
            await self.send_message(jid, caption)
        return None

    async def react(self, jid: str, message_id: str, emoji: str) -> None:
        channel = self._channel(jid)
        ch, _thread, ts = split_id(message_id)
        if ch != channel:
            raise ChannelError(f"message id {message_id!r} is not a message of {jid}",
                               permanent=True)
        name = EMOJI_NAMES.get(emoji) or EMOJI_NAMES.get(emoji.replace("\ufe0f", ""))
        if name is None:
            m = EMOJI_NAME_RE.match(emoji.strip())
            if not m:
                raise ChannelError(f"slack: no Slack name known for the emoji {emoji!r}",
                                   permanent=True)
            name = m.group(1)
        try:
            await self._call("reactions.add", lambda: self.web.reactions_add(
                channel=channel, timestamp=ts, name=name))
        except ChannelError as e:
            if "already_reacted" not in str(e):
                raise

    async def set_typing(self, jid: str, typing: bool) -> None:
        """Nothing: Slack offers apps no typing indicator (outside its assistant threads)."""
        return None


__all__ = ["EMOJI_NAMES", "SlackChannel", "slack_time", "split_id"]
