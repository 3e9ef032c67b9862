"""Telegram (`tg:<chat id>`) over the Bot API, with aiohttp.

In: long polling with `getUpdates` (the offset confirms what was handed over; a crash before
that means Telegram sends the update again and the host's dedupe by id drops the copy). The
offset is kept in the state database (`router_state`, per bot) after every batch and at
disconnect, written on a thread (never on the event loop) in the order asked, so a restart
asks for what came after it instead of the last day's updates all over again. Text
becomes InboundMessages with id `tg:<chat>:<message id>`; a photo (its largest size), document,
audio file, voice note or video comes as an Attachment (with the caption as text) that the host
downloads on demand: `getFile`, then the file URL, streamed and capped (the Bot API lets bots
download at most 20 MB);
`/chatid` is answered with the chat's JID (through the outbox, like any reply), to help
writing the config.
Out: `sendMessage` with the assistant's Markdown as plain text plus `entities`
(mdclaw.markup.to_telegram; a 400 on them sends the text plain), cut at 4096 UTF-16 units
without cutting an entity; `sendPhoto`/`sendDocument` (multipart, the caption with
`caption_entities`), `setMessageReaction`, `sendChatAction` (repeated every 4 s while typing
is on).

Cards (mdclaw.approvals): `sendMessage` with an inline keyboard (`reply_markup`), the text
plain; a press comes as a `callback_query` update, whose `from.id` (the user Telegram
authenticated, whoever else is in the chat) and `data` are handed to the host, answered with
`answerCallbackQuery` (the host's short answer shown to that user); a decided card is edited
with `editMessageText` to show the outcome, its keyboard removed.

Swarm identities (`channels.telegram.pool_token_files`): a message an agent sends with a
`sender` name ("Researcher") goes through a pool bot renamed to that name (`setMyName`), so
sub-agents speak under their own names. A (group, name) keeps its bot: the assignment is kept
in router_state (`telegram_pool:<main bot id>`) across restarts, with each bot's name, and a
bot is renamed only when it is given to a new name (a bot's name is the same in every chat,
so a bot already named so is shared by the groups that use the name, and a bot holding
another name is never taken from it). The main bot posts instead, the name in bold before
the text, when every pool bot holds another name, the rename is refused
(Telegram rate-limits setMyName: its retry_after is kept, the rename tried again after it)
or the pool bot cannot post in the chat (not a member, blocked, failing). Without a pool,
`sender` is ignored, as on every other channel (the assistant speaks as itself).

The token is part of every Bot API URL, so no URL is ever logged or put in an error: errors
name the method and what the API said, with the tokens masked wherever they could appear.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mimetypes
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from mdclaw.channels.base import (
    Attachment,
    Card,
    CardPress,
    Channel,
    ChannelError,
    InboundCallback,
    InboundMessage,
    SavedPosition,
    read_upload,
)
from mdclaw.config import read_secret
from mdclaw.markup import split_telegram, to_telegram, utf16_len
from mdclaw.retry import Backoff
from mdclaw.state import Database, now_iso
from mdclaw.state.groups import get_group_by_jid

log = logging.getLogger("mdclaw.channels.telegram")

JID_RE = re.compile(r"^tg:(-?\d{1,20})\Z")
PHOTO_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp"})
MAX_PHOTO_BYTES = 10 * 1024 * 1024
MAX_UPLOAD_BYTES = 50 * 1024 * 1024
MAX_DOWNLOAD_BYTES = 20 * 1024 * 1024  # the Bot API's getFile limit
MAX_CAPTION = 1024
TYPING_REPEAT_SECONDS = 4.0
TYPING_MAX_SECONDS = 300.0


MAX_BOT_NAME = 64  # setMyName's limit


@dataclass
class PoolBot:
    """One bot of the pool: its token, its id (the token's public first part), the name it
    was last given, and until when (time.monotonic()) Telegram asked not to rename it."""

    token: str
    id: str
    name: str | None = None
    rename_after: float = 0.0


class TelegramChannel(Channel):
    """A Telegram bot. `api_base` is the Bot API root (a fake server in tests)."""

    name = "telegram"
    jid_prefix = "tg:"
    max_message_length = 4096
    buttons = True
    # Waits after a failed getUpdates, and after an update the host did not take: 1 s
    # doubling to 60 s, equal jitter (after an outage of Telegram's, the bots it serves do
    # not all come back in the same second).
    poll_backoff = Backoff(base=1.0, factor=2.0, cap=60.0)

    def __init__(self, token: str, *, api_base: str = "https://api.telegram.org",
                 on_inbound: InboundCallback | None = None, poll_timeout: int = 25,
                 request_timeout: float = 30.0, trigger: str | None = None,
                 db: Database | None = None, pool_tokens: tuple[str, ...] = ()) -> None:
        super().__init__(on_inbound)
        for t in (token, *pool_tokens):
            if not t or "/" in t or any(c.isspace() for c in t):
                raise ChannelError("a Telegram bot token is empty or malformed")
        self._token = token
        # Swarm identities: the pool bots, and (group, name) -> bot id (see the module doc).
        self.pool = [PoolBot(t, t.split(":", 1)[0]) for t in pool_tokens]
        self._assigned: dict[tuple[str, str], str] = {}
        self._saved_pool = SavedPosition(
            db, lambda: f"telegram_pool:{self._token.split(':', 1)[0]}", channel="telegram",
            what="pool bots' names")
        self.api_base = api_base.rstrip("/")
        self.poll_timeout = poll_timeout
        self.request_timeout = request_timeout
        self._session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self._typing: dict[str, asyncio.Task[None]] = {}
        self._offset: int | None = None
        self.db = db  # where the getUpdates offset is kept across restarts (None: nowhere)
        self._saved_offset = SavedPosition(db, lambda: self._offset_key, channel="telegram",
                                           what="getUpdates offset")
        self._running = False  # between connect() and disconnect()
        self._connected = False  # running, and the last call reached Telegram
        self.bot_username: str | None = None
        self.bot_id: int | None = None
        # A message that @mentions the bot (or replies to it) but not the trigger gets the
        # trigger put in front, so "@mdclaw_bot hi" reaches a group that needs "@Andy".
        self.trigger = trigger

    @classmethod
    def from_config(cls, section: Any, *,
                    on_inbound: InboundCallback | None = None,
                    trigger: str | None = None,
                    db: Database | None = None) -> TelegramChannel:
        """Build from the `channels.telegram` config section; reads the token file now.

        Raises ChannelError naming the file (never its content) if it cannot be read.
        """
        try:
            token = read_secret(section.token_file)
        except OSError as e:
            raise ChannelError(f"cannot read channels.telegram.token_file "
                               f"{section.token_file}: {e.strerror}") from None
        pool = []
        for n, path in enumerate(getattr(section, "pool_token_files", ())):
            try:
                pool.append(read_secret(path))
            except OSError as e:
                raise ChannelError(f"cannot read channels.telegram.pool_token_files.{n} "
                                   f"{path}: {e.strerror}") from None
        return cls(token, api_base=section.api_base, on_inbound=on_inbound, trigger=trigger,
                   db=db, pool_tokens=tuple(pool))

    @property
    def _offset_key(self) -> str:
        # Update ids are per bot; the token's first part is the bot's (public) id.
        return f"telegram_offset:{self._token.split(':', 1)[0]}"

    async def _load_offset(self) -> None:
        if self._offset is not None:
            return
        value = await self._saved_offset.load()
        if value is not None and value.lstrip("-").isdigit() and self._offset is None:
            self._offset = int(value)

    async def _save_offset(self) -> None:
        """Write the current offset to the database on a thread (never on the loop)."""
        if self._offset is not None:
            await self._saved_offset.save(str(self._offset))

    def redact(self, text: str) -> str:
        """`text` with the tokens (the main bot's, the pool's) replaced by ***."""
        for bot in self.pool:
            text = text.replace(bot.token, "***")
        return text.replace(self._token, "***")

    def measure(self, text: str) -> int:
        return utf16_len(text)

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> None:
        """Check the token with getMe, then start long polling.

        Raises ChannelError if Telegram rejects the token. When Telegram cannot be reached
        the channel starts anyway, not connected, and connects as soon as a poll succeeds
        (sends wait in the outbox meanwhile).
        """
        if self._session is not None:
            return
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self._running = True
        await self._load_offset()
        await self._load_pool()
        try:
            me = await self.call("getMe")
            if isinstance(me, dict):
                self.bot_username = me.get("username")
                self.bot_id = me.get("id") if isinstance(me.get("id"), int) else None
            log.info("telegram: connected as @%s", self.bot_username or "?")
        except ChannelError as e:
            if e.code in (401, 403, 404):  # the token is wrong or revoked
                self._running = self._connected = False
                await self._session.close()
                self._session = None
                raise ChannelError(f"Telegram rejected the bot token ({e}); check "
                                   "channels.telegram.token_file") from None
            log.warning("%s; will keep trying", e)
        self._poller = asyncio.create_task(self._poll_loop(), name="telegram-poll")

    async def disconnect(self) -> None:
        """Stop polling and typing, then close the HTTP session. A task of the channel that
        had ended with an error is logged; if the caller is cancelled meanwhile, the cancel
        is passed on (the session is closed all the same)."""
        self._running = False
        self._connected = False
        tasks = [t for t in (self._poller, *self._typing.values()) if t is not None]
        self._poller = None
        self._typing.clear()
        for t in tasks:
            t.cancel()
        try:
            # Their CancelledError (the cancel just sent) comes back as a result; a cancel of
            # this task itself still raises here.
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            session, self._session = self._session, None
            if session is not None:
                await session.close()
            # What was handed over before the poller stopped (it may have been cut short
            # in a batch or in its own write) is kept for the next start.
            await self._save_offset()
        for t, r in zip(tasks, results, strict=True):
            if isinstance(r, Exception):
                log.warning("telegram: %s had ended with an error", t.get_name(), exc_info=r)

    def is_connected(self) -> bool:
        return self._connected

    # ------------------------------------------------------------------ Bot API
    async def call(self, method: str, params: dict[str, Any] | None = None, *,
                   data: aiohttp.FormData | None = None,
                   timeout: float | None = None, token: str | None = None) -> Any:
        """Call Bot API `method` (as the main bot, or the pool bot of `token`); return its
        `result`. Raises ChannelError (token-free)."""
        if self._session is None:
            raise ChannelError("the Telegram channel is not connected")
        url = f"{self.api_base}/bot{token or self._token}/{method}"
        try:
            async with self._session.post(
                    url, json=params if data is None else None, data=data,
                    timeout=aiohttp.ClientTimeout(total=timeout or self.request_timeout)) as r:
                status = r.status
                try:
                    body = await r.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    body = None
        except TimeoutError:
            self._connected = False
            raise ChannelError(f"telegram {method}: no answer in time") from None
        except aiohttp.ClientError as e:
            self._connected = False
            raise ChannelError(self.redact(f"telegram {method}: {type(e).__name__}: {e}")) from None
        self._connected = self._running  # any HTTP answer: Telegram is reachable
        if isinstance(body, dict) and body.get("ok") is True:
            return body.get("result")
        desc = body.get("description") if isinstance(body, dict) else None
        params_ = body.get("parameters") if isinstance(body, dict) else None
        retry_after = None
        if isinstance(params_, dict) and isinstance(params_.get("retry_after"), int | float):
            retry_after = float(params_["retry_after"])
        code = body.get("error_code", status) if isinstance(body, dict) else status
        text = self.redact(f"telegram {method}: {code} {desc or 'unexpected answer'}")
        # 400 (bad chat, bad message), 403 (blocked, kicked) and 404 do not heal by retrying;
        # 401 (token revoked) is left retryable so a fixed token lets the backlog through.
        permanent = status in (400, 403, 404) or code in (400, 403, 404)
        raise ChannelError(text, permanent=permanent and retry_after is None,
                           retry_after=retry_after, code=code if isinstance(code, int) else None)

    # ------------------------------------------------------------------ inbound
    async def _poll_loop(self) -> None:
        polls_failed = 0  # getUpdates failures in a row
        refused = 0  # updates in a row the host did not take
        while self._running:
            try:
                params: dict[str, Any] = {"timeout": self.poll_timeout,
                                          "allowed_updates": ["message", "callback_query"]}
                if self._offset is not None:
                    params["offset"] = self._offset
                updates = await self.call("getUpdates", params,
                                          timeout=self.poll_timeout + 15)
                polls_failed = 0
            except ChannelError as e:
                polls_failed += 1
                # Telegram's own retry_after (flood control) wins when longer.
                wait = max(self.poll_backoff.delay(polls_failed), e.retry_after or 0.0)
                log.warning("%s; retrying in %.0f s", e, wait)
                await asyncio.sleep(wait)
                continue
            for update in updates or []:
                if not isinstance(update, dict) or not isinstance(update.get("update_id"), int):
                    continue
                try:
                    await self._handle_update(update)
                except Exception:  # noqa: BLE001 - the host's callback, any failure
                    # Not confirmed: Telegram redelivers it on the next poll after a pause
                    # that grows while the host keeps refusing.
                    refused += 1
                    log.exception("telegram: the host did not take update %s",
                                  update["update_id"])
                    await asyncio.sleep(self.poll_backoff.delay(refused))
                    break
                refused = 0
                self._offset = update["update_id"] + 1
            await self._save_offset()

    async def _handle_update(self, update: dict[str, Any]) -> None:
        query = update.get("callback_query")
        if isinstance(query, dict):
            await self._handle_press(query)
            return
        msg = update.get("message")
        if not isinstance(msg, dict):
            return
        if await self._answer_chatid(msg):
            return
        msg_in = self.parse_message(msg)
        if msg_in is not None:
            await self.deliver_inbound(msg_in)

    async def _handle_press(self, query: dict[str, Any]) -> None:
        """A button press (CallbackQuery): the presser is `from.id`, as Telegram reports it;
        the host's answer is shown to them (answerCallbackQuery, which Telegram wants for
        every query: the button stops spinning)."""
        qid = query.get("id")
        user = query.get("from") or {}
        msg = query.get("message") or {}
        chat = msg.get("chat") or {}
        data = query.get("data")
        if not isinstance(qid, str) or not isinstance(user.get("id"), int):
            return
        answer = None
        if isinstance(data, str) and isinstance(chat.get("id"), int):
            name = " ".join(p for p in (user.get("first_name"), user.get("last_name")) if p)
            jid = f"tg:{chat['id']}"
            mid = msg.get("message_id")
            answer = await self.deliver_press(CardPress(
                channel=self.name, sender=str(user["id"]),
                sender_name=name or user.get("username") or str(user["id"]), chat_jid=jid,
                message_id=f"{jid}:{mid}" if isinstance(mid, int) else None, data=data))
        params: dict[str, Any] = {"callback_query_id": qid}
        if answer:
            params["text"] = answer[:200]
        try:
            await self.call("answerCallbackQuery", params)
        except ChannelError as e:  # the press was recorded; only the spinner keeps turning
            log.warning("telegram: %s", e)

    async def _answer_chatid(self, msg: dict[str, Any]) -> bool:
        """Answer `/chatid` with the chat's JID (what a group's `jid` in config.yaml needs).
        True if `msg` was that command; it is not passed on to the host."""
        text = (msg.get("text") or "").strip()
        command, _, bot = text.partition("@")
        if command != "/chatid" or (bot and self.bot_username
                                    and bot.lower() != self.bot_username.lower()):
            return False
        chat_id = (msg.get("chat") or {}).get("id")
        if not isinstance(chat_id, int):
            return False
        # Through the outbox (when the host gave a way): a 429 delays the answer, it is
        # not lost.
        mid = msg.get("message_id")
        await self.service_reply(f"tg:{chat_id}", f"This chat is `tg:{chat_id}`",
                                 reply_to=f"tg:{chat_id}:{mid}" if isinstance(mid, int) else None)
        return True

    def attachments_of(self, msg: dict[str, Any]) -> tuple[Attachment, ...]:
        """The file a Bot API Message carries (photo: its largest size), as an Attachment
        fetched with getFile when the host asks for it."""
        caption = msg.get("caption") if isinstance(msg.get("caption"), str) else None
        photos = msg.get("photo")
        if isinstance(photos, list) and photos:
            sizes = [p for p in photos if isinstance(p, dict) and p.get("file_id")]
            if sizes:
                best = max(sizes, key=lambda p: (p.get("file_size") or 0,
                                                 (p.get("width") or 0) * (p.get("height") or 0)))
                return (self._attachment("image", best, "photo.jpg", "image/jpeg", caption),)
        for key, kind in (("document", "document"), ("audio", "audio"), ("voice", "voice"),
                          ("video", "video"), ("video_note", "video")):
            obj = msg.get(key)
            if isinstance(obj, dict) and obj.get("file_id"):
                return (self._attachment(kind, obj, None, None, caption),)
        return ()

    def _attachment(self, kind: str, obj: dict[str, Any], name: str | None,
                    mime: str | None, caption: str | None) -> Attachment:
        file_id = str(obj["file_id"])
        size = obj.get("file_size") if isinstance(obj.get("file_size"), int) else None
        file_name = obj.get("file_name") if isinstance(obj.get("file_name"), str) else name
        mime_type = obj.get("mime_type") if isinstance(obj.get("mime_type"), str) else mime

        async def fetch(limit: int) -> bytes:
            return await self.download(file_id, limit)

        return Attachment(kind=kind, name=file_name, mime=mime_type, size=size, fetch=fetch,
                          caption=caption)

    async def download(self, file_id: str, limit: int) -> bytes:
        """The content of Telegram file `file_id` (getFile, then the file URL), at most
        `limit` bytes and never more than the Bot API's 20 MB. Raises ChannelError
        (token-free) when it is larger or cannot be fetched."""
        limit = min(limit, MAX_DOWNLOAD_BYTES)
        info = await self.call("getFile", {"file_id": file_id})
        if not isinstance(info, dict) or not isinstance(info.get("file_path"), str):
            raise ChannelError("telegram getFile: no file path in the answer (files over "
                               "20 MB cannot be downloaded by bots)")
        size = info.get("file_size")
        if isinstance(size, int) and size > limit:
            raise ChannelError(f"it is {size} bytes, over the {limit} bytes a file may have "
                               "here")
        if self._session is None:
            raise ChannelError("the Telegram channel is not connected")
        path = info["file_path"].lstrip("/")
        url = f"{self.api_base}/file/bot{self._token}/{path}"
        chunks: list[bytes] = []
        total = 0
        try:
            async with self._session.get(
                    url, timeout=aiohttp.ClientTimeout(total=max(self.request_timeout, 120))
            ) as r:
                if r.status != 200:
                    raise ChannelError(f"telegram file download: HTTP {r.status}",
                                       code=r.status, permanent=r.status in (400, 403, 404))
                async for chunk in r.content.iter_chunked(64 * 1024):
                    total += len(chunk)
                    if total > limit:
                        raise ChannelError(f"larger than the {limit} bytes a file may have "
                                           "here")
                    chunks.append(chunk)
        except TimeoutError:
            raise ChannelError("telegram file download: no answer in time") from None
        except aiohttp.ClientError as e:
            raise ChannelError(self.redact(f"telegram file download: {type(e).__name__}: "
                                           f"{e}")) from None
        return b"".join(chunks)

    def parse_message(self, msg: dict[str, Any]) -> InboundMessage | None:
        """A Bot API Message as an InboundMessage; None if it holds no text, caption or
        file."""
        chat = msg.get("chat") or {}
        text = msg.get("text") or msg.get("caption")
        attachments = self.attachments_of(msg)
        if attachments and not isinstance(text, str):
            text = ""
        if not isinstance(text, str) or not isinstance(chat.get("id"), int):
            return None
        sender = msg.get("from") or msg.get("sender_chat") or {}
        name = " ".join(p for p in (sender.get("first_name"), sender.get("last_name")) if p)
        name = name or sender.get("title") or sender.get("username") or str(sender.get("id", "?"))
        chat_name = chat.get("title") or " ".join(
            p for p in (chat.get("first_name"), chat.get("last_name")) if p) or None
        date = msg.get("date")
        ts = (now_iso(datetime.fromtimestamp(date, UTC)) if isinstance(date, int)
              else now_iso())
        jid = f"tg:{chat['id']}"
        addressed = self._addresses_bot(msg, text)
        if addressed and self.trigger and not re.search(
                rf"(?<!\w){re.escape(self.trigger)}(?!\w)", text, re.IGNORECASE):
            text = f"{self.trigger} {text}"
        return InboundMessage(
            id=f"{jid}:{msg.get('message_id')}", chat_jid=jid,
            sender=str(sender.get("id", "")), sender_name=name, content=text, timestamp=ts,
            chat_name=chat_name, is_group=chat.get("type") in ("group", "supergroup"),
            channel=self.name, addressed=addressed, attachments=attachments)

    def _addresses_bot(self, msg: dict[str, Any], text: str) -> bool:
        """True if `msg` @mentions this bot or replies to one of its messages."""
        replied = msg.get("reply_to_message")
        if (self.bot_id is not None and isinstance(replied, dict)
                and (replied.get("from") or {}).get("id") == self.bot_id):
            return True
        if not self.bot_username:
            return False
        mention = rf"(?<!\w)@{re.escape(self.bot_username)}\b"
        return re.search(mention, text, re.IGNORECASE) is not None

    # ------------------------------------------------------------------ outbound
    def _chat_id(self, jid: str) -> int:
        m = JID_RE.match(jid)
        if not m:
            raise ChannelError(f"{jid!r} is not a Telegram chat", permanent=True)
        return int(m.group(1))

    @staticmethod
    def _message_id(message_id: str) -> int:
        """Our `tg:<chat>:<id>` (or a bare id) as Telegram's message id."""
        tail = str(message_id).rsplit(":", 1)[-1]
        if not tail.isdigit():
            raise ChannelError(f"message id {message_id!r} is not a Telegram message",
                               permanent=True)
        return int(tail)

    def _stop_typing(self, jid: str) -> None:
        t = self._typing.pop(jid, None)
        if t is not None:
            t.cancel()

    def message_parts(self, text: str) -> list[tuple[str, list[dict[str, Any]]]]:
        """The Markdown `text` as (plain text, entities) messages of at most 4096 UTF-16
        units (mdclaw.markup.to_telegram, split_telegram)."""
        return split_telegram(*to_telegram(text), limit=self.max_message_length)

    async def send_message(self, jid: str, text: str, *, reply_to: str | None = None,
                           sender: str | None = None) -> str | None:
        """Send the Markdown `text` formatted (entities), split at 4096 UTF-16 units;
        returns the last piece's message id."""
        last = None
        for i, part in enumerate(self.message_parts(text)):
            last = await self.send_part(jid, part, reply_to=reply_to if i == 0 else None,
                                        sender=sender)
        return last

    async def send_part(self, jid: str, part: Any, *, reply_to: str | None = None,
                        sender: str | None = None) -> str | None:
        """Send one (text, entities) piece. If Telegram refuses the entities (a 400), the
        same text goes again without them: plain, but delivered. With a `sender` name: through
        the pool bot of that name, else by the main bot with the name before the text."""
        chat_id = self._chat_id(jid)
        self._stop_typing(jid)
        text, entities = part if isinstance(part, tuple) else (str(part), [])
        name = (sender or "").strip()
        if name and self.pool:  # without a pool the name is ignored, as on other channels
            bot = await self._pool_bot(jid, name)
            if bot is not None:
                try:
                    return await self._send_text(jid, chat_id, text, entities, reply_to,
                                                 token=bot.token)
                except ChannelError as e:
                    log.warning("telegram: pool bot %s (%s) could not post in %s (%s); the "
                                "main bot posts instead", bot.id, name, jid, e)
            text, entities = _with_name(name, text, entities, self.max_message_length)
        return await self._send_text(jid, chat_id, text, entities, reply_to)

    async def _send_text(self, jid: str, chat_id: int, text: str,
                         entities: list[dict[str, Any]], reply_to: str | None, *,
                         token: str | None = None) -> str | None:
        params: dict[str, Any] = {"chat_id": chat_id, "text": text}
        if entities:
            params["entities"] = entities
        if reply_to:
            try:
                params["reply_parameters"] = {"message_id": self._message_id(reply_to),
                                              "allow_sending_without_reply": True}
            except ChannelError:
                pass
        try:
            result = await self.call("sendMessage", params, token=token)
        except ChannelError as e:
            if not (entities and e.code == 400):
                raise
            log.warning("telegram: formatting refused (%s); sending the text plain", e)
            params.pop("entities")
            result = await self.call("sendMessage", params, token=token)
        last = result.get("message_id") if isinstance(result, dict) else None
        return f"{jid}:{last}" if last is not None else None

    # ------------------------------------------------------------------ pool bots
    async def _load_pool(self) -> None:
        """The pool's assignments and names as saved (an unknown or gone bot is dropped)."""
        if not self.pool:
            return
        raw = await self._saved_pool.load()
        try:
            saved = json.loads(raw) if raw else {}
        except ValueError:
            saved = {}
        bots = {b.id: b for b in self.pool}
        names = saved.get("names") if isinstance(saved, dict) else None
        for bot_id, name in (names or {}).items():
            if bot_id in bots and isinstance(name, str):
                bots[bot_id].name = name
        for entry in (saved.get("assigned") or []) if isinstance(saved, dict) else []:
            if (isinstance(entry, list) and len(entry) == 3
                    and all(isinstance(x, str) for x in entry) and entry[2] in bots):
                self._assigned[(entry[0], entry[1])] = entry[2]

    async def _save_pool(self) -> None:
        await self._saved_pool.save(json.dumps({
            "names": {b.id: b.name for b in self.pool if b.name is not None},
            "assigned": sorted([g, n, b] for (g, n), b in self._assigned.items())},
            sort_keys=True))

    async def _group(self, jid: str) -> str:
        """The group whose chat `jid` is now (the chat itself when none is known). Read from
        the database each time, not kept: a reload may move a chat to another group, and
        the read (about 0.2 ms with the thread hop, at 1,000 groups) is small beside the
        Bot API calls of the post it is for."""
        row = (await asyncio.to_thread(get_group_by_jid, self.db, jid)
               if self.db is not None else None)
        return row.folder if row is not None else jid

    async def _pool_bot(self, jid: str, name: str) -> PoolBot | None:
        """The pool bot that speaks as `name` for `jid`'s group, renamed if it must be;
        None: the main bot posts (no pool, none free, a refused rename)."""
        if not self.pool or len(name) > MAX_BOT_NAME:
            return None
        key = (await self._group(jid), name)
        bots = {b.id: b for b in self.pool}
        taken = set(self._assigned.values())
        bot = bots.get(self._assigned.get(key, ""))
        if bot is None:
            # A bot already named so (shared: a name is a bot's in every chat), else a free one.
            now = time.monotonic()
            bot = next((b for b in self.pool if b.name == name), None) or next(
                (b for b in self.pool if b.id not in taken and now >= b.rename_after), None)
            if bot is None:
                log.info("telegram: every pool bot speaks as another name; %r is posted by "
                         "the main bot", name)
                return None
        if bot.name != name:
            if time.monotonic() < bot.rename_after:
                return None
            try:
                await self.call("setMyName", {"name": name}, token=bot.token)
            except ChannelError as e:
                if e.retry_after is not None:
                    bot.rename_after = time.monotonic() + e.retry_after
                log.warning("telegram: pool bot %s could not be renamed to %r (%s); the main "
                            "bot posts", bot.id, name, e)
                return None
            log.info("telegram: pool bot %s now speaks as %r", bot.id, name)
            # The names it had before are no longer its own.
            for k in [k for k, b in self._assigned.items() if b == bot.id and k[1] != name]:
                del self._assigned[k]
            bot.name = name
        self._assigned[key] = bot.id
        await self._save_pool()  # written only when it changed (SavedPosition)
        return bot

    @staticmethod
    def _keyboard(card: Card) -> dict[str, Any]:
        """The card's choices as an inline keyboard: short ones side by side in the first
        row, longer ones (a question's long options, "Show all") a row each."""
        first: list[dict[str, str]] = []
        rows: list[list[dict[str, str]]] = []
        for c in card.choices:
            button = {"text": c.label, "callback_data": c.data}
            if len(c.label) <= 12 and not c.data.endswith(":show"):
                first.append(button)
            else:
                rows.append([button])
        return {"inline_keyboard": ([first] if first else []) + rows}

    async def send_card(self, jid: str, card: Card) -> str | None:
        """The card's text, plain (no entities: what an agent wrote shows as written), with
        its choices as an inline keyboard on the last piece."""
        chat_id = self._chat_id(jid)
        self._stop_typing(jid)
        parts = self.split_text(card.text) or [card.text]
        last = None
        for i, part in enumerate(parts):
            params: dict[str, Any] = {"chat_id": chat_id, "text": part}
            if i == len(parts) - 1 and card.choices:
                params["reply_markup"] = self._keyboard(card)
            result = await self.call("sendMessage", params)
            last = result.get("message_id") if isinstance(result, dict) else None
        return f"{jid}:{last}" if last is not None else None

    async def edit_card(self, jid: str, message_id: str, card: Card) -> None:
        """Edit the card message to `card` (the outcome), its keyboard removed. A message
        Telegram will not edit any more gets the outcome as a new message."""
        params: dict[str, Any] = {
            "chat_id": self._chat_id(jid), "message_id": self._message_id(message_id),
            "text": card.text[:self.max_message_length],
            "reply_markup": self._keyboard(card) if card.choices else {"inline_keyboard": []}}
        try:
            await self.call("editMessageText", params)
        except ChannelError as e:
            if e.code != 400:
                raise
            if "not modified" in str(e):
                return
            log.info("telegram: card %s cannot be edited (%s); sending the outcome", message_id,
                     e)
            await self.send_card(jid, card)

    async def send_file(self, jid: str, path: Path, *, file_name: str | None = None,
                        caption: str | None = None) -> str | None:
        chat_id = self._chat_id(jid)
        path = Path(path)
        content = await asyncio.to_thread(read_upload, path, MAX_UPLOAD_BYTES,
                                          "bots may upload at most")
        name = file_name or path.name
        as_photo = (Path(name).suffix.lower() in PHOTO_SUFFIXES
                    and len(content) <= MAX_PHOTO_BYTES)
        field, method = ("photo", "sendPhoto") if as_photo else ("document", "sendDocument")
        cap_text, cap_entities = to_telegram(caption) if caption else ("", [])
        long_caption = utf16_len(cap_text) > MAX_CAPTION
        if long_caption:
            cap_text, cap_entities = "", []
        self._stop_typing(jid)
        try:
            result = await self._upload(method, field, chat_id, name, content, cap_text,
                                        cap_entities)
        except ChannelError as e:
            if not (as_photo and e.code == 400):
                raise
            # Telegram refuses some images as photos (size, ratio): send them as documents.
            result = await self._upload("sendDocument", "document", chat_id, name, content,
                                        cap_text, cap_entities)
        mid = result.get("message_id") if isinstance(result, dict) else None
        if long_caption and caption:  # too long for a caption: it follows as text
            await self.send_message(jid, caption)
        return f"{jid}:{mid}" if mid is not None else None

    async def _upload(self, method: str, field: str, chat_id: int, name: str, content: bytes,
                      caption: str, entities: list[dict[str, Any]]) -> Any:
        """One multipart send of a file; a caption whose entities Telegram refuses (400)
        goes again plain."""

        def form(with_entities: bool) -> aiohttp.FormData:
            f = aiohttp.FormData()
            f.add_field("chat_id", str(chat_id))
            if caption:
                f.add_field("caption", caption)
                if entities and with_entities:
                    f.add_field("caption_entities", json.dumps(entities))
            f.add_field(field, content, filename=name,
                        content_type=mimetypes.guess_type(name)[0] or "application/octet-stream")
            return f

        timeout = max(self.request_timeout, 120)
        try:
            return await self.call(method, data=form(True), timeout=timeout)
        except ChannelError as e:
            if not (entities and e.code == 400):
                raise
            log.warning("telegram: caption formatting refused (%s); sending it plain", e)
            return await self.call(method, data=form(False), timeout=timeout)

    async def react(self, jid: str, message_id: str, emoji: str) -> None:
        await self.call("setMessageReaction", {
            "chat_id": self._chat_id(jid), "message_id": self._message_id(message_id),
            "reaction": [{"type": "emoji", "emoji": emoji}]})

    async def set_typing(self, jid: str, typing: bool) -> None:
        if not self.owns_jid(jid) or not JID_RE.match(jid):
            return
        self._stop_typing(jid)
        if typing and self._running:
            self._typing[jid] = asyncio.create_task(self._typing_loop(jid),
                                                    name=f"telegram-typing-{jid}")

    async def _typing_loop(self, jid: str) -> None:
        # Telegram shows "typing" for about 5 s per action; repeat until stopped (bounded).
        chat_id = self._chat_id(jid)
        loop = asyncio.get_running_loop()
        until = loop.time() + TYPING_MAX_SECONDS
        try:
            while loop.time() < until:
                try:
                    await self.call("sendChatAction", {"chat_id": chat_id, "action": "typing"})
                except ChannelError as e:
                    log.debug("%s", e)
                await asyncio.sleep(TYPING_REPEAT_SECONDS)
        finally:
            if self._typing.get(jid) is asyncio.current_task():
                self._typing.pop(jid, None)


def _with_name(name: str, text: str, entities: list[dict[str, Any]],
               limit: int) -> tuple[str, list[dict[str, Any]]]:
    """`text` with `name` in bold before it ("Researcher: ..."), the entities moved along;
    unchanged when that would pass `limit` UTF-16 units."""
    prefix = f"{name}: "
    shift = utf16_len(prefix)
    if utf16_len(text) + shift > limit:
        return text, entities
    moved = [{**e, "offset": e["offset"] + shift} for e in entities]
    return prefix + text, [{"type": "bold", "offset": 0, "length": utf16_len(name)}, *moved]
