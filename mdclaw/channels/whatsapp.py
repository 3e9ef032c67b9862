"""WhatsApp (`wa:<jid>`) as a linked device of the operator's own account, through neonize.

neonize wraps whatsmeow (Go, shipped in the wheel as a native library); its async client runs
every blocking call in a worker thread and hands events to the daemon's loop, so nothing here
blocks the loop. The linked device's keys live in an SQLite file under data_dir
(`whatsapp/session.sqlite3`, 0600 in a 0700 folder): whoever reads it can act as the account.

Pairing is a small state machine (`Pairing`): unlinked → qr (a code to scan is showing) →
linked; linked → logged_out when the phone removes the device; from logged_out (or unlinked)
a new QR code starts pairing again. `mdclaw whatsapp link` runs the same channel in the
foreground and prints the QR code (or a pairing code for `--phone`); the operator page shows
`status_info()["qr"]`. `link_state(path)` answers linked/unlinked/logged_out from the files
alone, for `mdclaw status` and `mdclaw doctor` (one rule, whoever asks).

In: text, extended text (replies: the quoted message becomes `reply_to` and a line of
context; mentions: WhatsApp writes `@<number>` in the text and the jid beside it, and a
mention of this account becomes the trigger, so "@Andy" groups answer), images, documents,
audio, voice notes and videos as Attachments (downloaded only when fetched, bounded). The
account's own messages, status updates and channels (newsletters) are ignored. Group names go
into the chats table (on connect, on joining, on a rename), so the main agent sees WhatsApp
groups in available_groups.json.

Out: the assistant's Markdown becomes WhatsApp formatting in `split_text` (the outbox splits
before it sends, so `send_message` gets text already converted), files by type (image,
audio, document), reactions, typing ("composing", then "paused"). Sends are spaced by
`send_interval`; WhatsApp's "rate-overlimit" is a retry later. A session that ends (network
gone, WhatsApp restarting) is started again with backoff; meanwhile `is_connected()` is False
and the outbox keeps messages queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mimetypes
import os
import re
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mdclaw.channels.base import (
    Attachment,
    Channel,
    ChannelError,
    InboundCallback,
    InboundMessage,
    read_upload,
)
from mdclaw.config import EXTRAS, MissingExtra
from mdclaw.markup import split_message, to_whatsapp
from mdclaw.retry import Backoff
from mdclaw.retry import wait as backoff_wait
from mdclaw.state import Database, now_iso
from mdclaw.state.conversations import upsert_chat

log = logging.getLogger("mdclaw.channels.whatsapp")

LINKED = "linked"
UNLINKED = "unlinked"
LOGGED_OUT = "logged_out"
LINK_FIX = {
    UNLINKED: "pair it: run `mdclaw whatsapp link` and scan the code with the phone "
              "(WhatsApp → Settings → Linked devices → Link a device)",
    LOGGED_OUT: "the phone removed this linked device; run `mdclaw whatsapp link` to pair "
                "it again",
}
STATE_FILE = "link-state.json"  # beside the session: remembers a logout (the keys are gone)

JID_RE = re.compile(r"^wa:([0-9A-Za-z._-]{1,64})@(s\.whatsapp\.net|g\.us|lid)\Z")
MAX_UPLOAD_BYTES = 100 * 1024 * 1024
IMAGE_MIMES = frozenset({"image/jpeg", "image/png", "image/webp"})
TYPING_REPEAT_SECONDS = 10.0
TYPING_MAX_SECONDS = 300.0
QUOTE_EXCERPT = 200
REMEMBERED_MESSAGES = 2048  # senders of recent messages, for reactions and replies


# ---------------------------------------------------------------------- pairing


@dataclass
class Pairing:
    """Where pairing stands. `state` is one of unlinked, qr, linked, logged_out; `link_state`
    is what the operator is told (a QR code showing is still unlinked)."""

    state: str = UNLINKED
    qr: str | None = None
    jid: str | None = None
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def link_state(self) -> str:
        return UNLINKED if self.state == "qr" else self.state

    def _set(self, state: str) -> None:
        self.state = state
        self.changed.set()

    def qr_code(self, code: str) -> None:
        """WhatsApp offered a code to scan: the device is not linked (any more)."""
        if self.state == LINKED:
            # A linked session never asks for a QR code: the keys are gone.
            self.jid = None
        self.qr = code
        self.error = None
        self._set("qr")

    def paired(self, jid: str) -> None:
        self.qr = None
        self.jid = jid
        self.error = None
        self._set(LINKED)

    def pair_failed(self, reason: str) -> None:
        self.qr = None
        self.error = reason
        self._set(UNLINKED)

    def connected(self, jid: str | None) -> None:
        """A session with stored keys is up."""
        self.qr = None
        self.jid = jid or self.jid
        self._set(LINKED)

    def logged_out(self, reason: str | None = None) -> None:
        self.qr = None
        self.error = reason
        self._set(LOGGED_OUT)


# ---------------------------------------------------------------------- session files


def prepare_session(path: Path) -> None:
    """Make the session's folder (0700) and file (0600) before whatsmeow opens it, so the
    keys are never readable by others, not even for a moment. SQLite takes an empty file
    as a new database."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for extra in ("-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(f"{path}{extra}", 0o600)


def _state_path(session: Path) -> Path:
    return session.parent / STATE_FILE


def _write_state(session: Path, state: str, jid: str | None = None) -> None:
    try:
        tmp = _state_path(session).with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"state": state, "jid": jid, "at": now_iso()}, f)
        os.replace(tmp, _state_path(session))
    except OSError as e:
        log.warning("whatsapp: cannot record the link state: %s", e)


def session_jid(path: Path) -> str | None:
    """The linked account's jid stored in the session file, or None (no file, no device)."""
    if not path.is_file():
        return None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2)
        try:
            row = conn.execute("SELECT jid FROM whatsmeow_device LIMIT 1").fetchone()
        finally:
            conn.close()
    except sqlite3.Error:  # an empty file (never paired) has no table yet
        return None
    return str(row[0]) if row else None


def link_state(path: Path) -> tuple[str, str | None]:
    """(linked | unlinked | logged_out, the account's jid) from the session files alone."""
    jid = session_jid(path)
    if jid:
        return LINKED, jid
    try:
        recorded = json.loads(_state_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        recorded = {}
    if isinstance(recorded, dict) and recorded.get("state") == LOGGED_OUT:
        return LOGGED_OUT, recorded.get("jid")
    return UNLINKED, None


# ---------------------------------------------------------------------- neonize glue


def _neonize() -> Any:
    """neonize's modules, imported on first use (it is an optional dependency)."""
    try:
        from neonize.aioze import client as aclient
        from neonize.aioze import events
        from neonize.proto import Neonize_pb2 as types
        from neonize.proto.waCommon import WACommon_pb2 as common
        from neonize.proto.waE2E import WAWebProtobufsE2E_pb2 as e2e
        from neonize.utils import enum
    except ImportError as e:
        missing = MissingExtra("channels.whatsapp", EXTRAS["whatsapp"],
                               f"cannot be imported ({e})")
        raise ChannelError(missing.message, permanent=True) from None

    return SimpleNamespace(client=aclient, events=events, types=types, common=common, e2e=e2e,
                           enum=enum)


def real_client(session_path: Path) -> Any:
    """A neonize async client on the session file `session_path`."""
    nz = _neonize()
    return nz.client.NewAClient(str(session_path), uuid="mdclaw")


def jid_of(jid: Any) -> str:
    """A neonize JID as `user@server` (without device)."""
    return f"{jid.User}@{jid.Server}" if jid.User else ""


def message_time(ts: int) -> str:
    """A message's time as WhatsApp gave it, in the database's form: seconds since the epoch,
    or milliseconds (neonize versions differ), kept to the millisecond (integer arithmetic:
    no float rounds a millisecond away). Now when it has none."""
    if ts <= 0:
        return now_iso()
    ms = ts if ts > 10**12 else ts * 1000
    return now_iso(datetime.fromtimestamp(ms // 1000, UTC) + timedelta(milliseconds=ms % 1000))


def user_of(jid_text: str) -> str:
    return jid_text.split("@", 1)[0].split(":", 1)[0]


_MEDIA = (("imageMessage", "image"), ("videoMessage", "video"), ("ptvMessage", "video"),
          ("audioMessage", "audio"), ("documentMessage", "document"))
_WRAPPERS = ("ephemeralMessage", "viewOnceMessage", "viewOnceMessageV2",
             "viewOnceMessageV2Extension", "documentWithCaptionMessage")


def unwrap(message: Any) -> Any:
    """The message inside ephemeral / view-once / document-with-caption envelopes."""
    for _ in range(4):
        for w in _WRAPPERS:
            if message.HasField(w):
                message = getattr(message, w).message
                break
        else:
            return message
    return message


# ---------------------------------------------------------------------- the channel


class WhatsAppChannel(Channel):
    """A WhatsApp linked device. `client_factory(channel)` makes the neonize client (a fake
    in tests); everything past it is WhatsApp's network."""

    name = "whatsapp"
    jid_prefix = "wa:"
    # WhatsApp takes 65536 characters; a chat reads better in pieces of a screen or two.
    max_message_length = 4000
    reconnect_backoff = Backoff(base=2.0, factor=2.0, cap=300.0)

    def __init__(self, session_path: Path, *, on_inbound: InboundCallback | None = None,
                 trigger: str | None = None, db: Database | None = None,
                 send_interval: float = 1.0,
                 client_factory: Callable[[WhatsAppChannel], Any] | None = None,
                 on_qr: Callable[[str], None] | None = None) -> None:
        super().__init__(on_inbound)
        self.session_path = Path(session_path)
        self.trigger = trigger
        self.db = db
        self.send_interval = send_interval
        self.client_factory = client_factory or (lambda ch: real_client(ch.session_path))
        self.on_qr = on_qr  # `mdclaw whatsapp link` prints each code
        self.pairing = Pairing()
        self.client: Any = None
        self._runner: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._running = False
        self._connected = False
        self._own_users: set[str] = set()
        self._senders: OrderedDict[str, tuple[str, bool]] = OrderedDict()  # id → (sender, mine)
        self._group_names: dict[str, str] = {}
        self._send_lock = asyncio.Lock()
        self._last_send = 0.0
        self._typing: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.sessions_started = 0
        self.groups_synced = 0  # times the group list was read

    @classmethod
    def from_config(cls, section: Any, session_path: Path, *,
                    on_inbound: InboundCallback | None = None, trigger: str | None = None,
                    db: Database | None = None) -> WhatsAppChannel:
        return cls(session_path, on_inbound=on_inbound, trigger=trigger, db=db,
                   send_interval=section.send_interval)

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> None:
        """Start the session in the background. Not connected until WhatsApp says so (or,
        unpaired, until a phone scans the code); sends wait in the outbox meanwhile."""
        if self._runner is not None:
            return
        # Without neonize the channel does not start (ChannelError with the fix): the
        # daemon logs it and runs its other channels; `mdclaw doctor` says the same.
        _neonize()
        try:
            await asyncio.to_thread(prepare_session, self.session_path)
        except OSError as e:
            raise ChannelError(f"cannot prepare the WhatsApp session file "
                               f"{self.session_path}: {e.strerror}") from None
        state, jid = await asyncio.to_thread(link_state, self.session_path)
        if state == LOGGED_OUT:
            self.pairing.logged_out()
        self.pairing.jid = jid
        self._running = True
        self._stop.clear()
        self._runner = asyncio.create_task(self._run(), name="whatsapp-session")

    async def _run(self) -> None:
        failures = 0
        while self._running:
            client = self.client_factory(self)
            self.client = client
            self._bind(client)
            self.sessions_started += 1
            was_up = False
            try:
                task = await client.connect()
                # The task lasts as long as the session; it ends on an error or a stop.
                await self._watch(task)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - neonize raises plain Exceptions too
                log.warning("whatsapp: the session ended: %s", e)
            finally:
                was_up = self._connected or self.pairing.state == LINKED
                self._connected = False
            if not self._running:
                break
            failures = 1 if was_up else failures + 1
            delay = self.reconnect_backoff.delay(failures)
            log.info("whatsapp: connecting again in %.0f s", delay)
            if await backoff_wait(delay, self._stop):
                break

    async def _watch(self, task: Any) -> None:
        """Wait for the session task, or for a stop."""
        stop = asyncio.ensure_future(self._stop.wait())
        # Stopped first: the session's own ending (an error, often) is read, never left over.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task in done:
            task.result()

    async def disconnect(self) -> None:
        """End the session and every task of the channel; safe to call twice."""
        self._running = False
        self._connected = False
        self._stop.set()
        for t in list(self._typing.values()):
            t.cancel()
        self._typing.clear()
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.disconnect()
            with contextlib.suppress(Exception):
                await client.stop()
        runner, self._runner = self._runner, None
        tasks = [t for t in (runner, *self._tasks) if t is not None]
        for t in tasks:
            if t is not runner:
                t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        for t in tasks:
            if not t.done():
                t.cancel()

    def is_connected(self) -> bool:
        return self._connected and self.client is not None

    def status_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"connected": self.is_connected(),
                                "link_state": self.pairing.link_state}
        if self.pairing.jid:
            info["account"] = self.pairing.jid
        if self.pairing.state == "qr" and self.pairing.qr:
            info["qr"] = self.pairing.qr
        if self.pairing.link_state != LINKED:
            info["fix"] = LINK_FIX[self.pairing.link_state]
        return info

    def _spawn(self, coro: Awaitable[Any], name: str) -> None:
        t = asyncio.ensure_future(coro)
        t.set_name(name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ events
    def _bind(self, client: Any) -> None:
        ev = _neonize().events
        client.event.qr(self._on_qr)
        client.event(ev.PairStatusEv)(self._on_pair_status)
        client.event(ev.ConnectedEv)(self._on_connected)
        client.event(ev.DisconnectedEv)(self._on_disconnected)
        client.event(ev.LoggedOutEv)(self._on_logged_out)
        client.event(ev.ConnectFailureEv)(self._on_connect_failure)
        client.event(ev.StreamReplacedEv)(self._on_stream_replaced)
        client.event(ev.TemporaryBanEv)(self._on_temporary_ban)
        client.event(ev.MessageEv)(self._on_message)
        client.event(ev.JoinedGroupEv)(self._on_joined_group)
        client.event(ev.GroupInfoEv)(self._on_group_info)

    async def _on_qr(self, client: Any, data: bytes) -> None:
        code = data.decode() if isinstance(data, bytes) else str(data)
        self.pairing.qr_code(code)
        log.warning("whatsapp: not linked; scan the code (`mdclaw whatsapp link` or the "
                    "operator page) with WhatsApp → Settings → Linked devices")
        if self.on_qr is not None:
            self.on_qr(code)

    async def _on_pair_status(self, client: Any, ev: Any) -> None:
        nz = _neonize()
        if ev.Status == nz.types.PairStatus.SUCCESS:
            jid = jid_of(ev.ID)
            self.pairing.paired(jid)
            self._own_users.add(user_of(jid))
            await asyncio.to_thread(_write_state, self.session_path, LINKED, jid)
            await asyncio.to_thread(prepare_session, self.session_path)
            log.info("whatsapp: linked to %s", jid)
        else:
            self.pairing.pair_failed(ev.Error or "pairing failed")
            log.warning("whatsapp: pairing failed: %s", ev.Error)

    async def _on_connected(self, client: Any, ev: Any) -> None:
        own: str | None = None
        try:
            me = await client.get_me()
            own = jid_of(me.JID) or None
            self._own_users = {u for u in (user_of(jid_of(me.JID)), user_of(jid_of(me.LID)))
                               if u}
        except Exception as e:  # noqa: BLE001 - without it, mentions of us go unnoticed
            log.warning("whatsapp: could not read the account's own jid: %s", e)
        self.pairing.connected(own)
        self._connected = True
        log.info("whatsapp: connected as %s", own or "?")
        await asyncio.to_thread(_write_state, self.session_path, LINKED, own)
        self._spawn(self.sync_groups(), "whatsapp-groups")

    async def _on_disconnected(self, client: Any, ev: Any) -> None:
        self._connected = False
        log.warning("whatsapp: disconnected; whatsmeow reconnects")

    async def _on_logged_out(self, client: Any, ev: Any) -> None:
        self._connected = False
        reason = (_neonize().types.ConnectFailureReason.Name(ev.Reason) if ev.Reason
                  else None)
        self.pairing.logged_out(reason)
        await asyncio.to_thread(_write_state, self.session_path, LOGGED_OUT, self.pairing.jid)
        log.error("whatsapp: logged out by the phone (%s); %s", reason or "no reason",
                  LINK_FIX[LOGGED_OUT])

    async def _on_connect_failure(self, client: Any, ev: Any) -> None:
        self._connected = False
        log.warning("whatsapp: connection refused: %s", ev.Message or ev.Reason)

    async def _on_stream_replaced(self, client: Any, ev: Any) -> None:
        self._connected = False
        log.error("whatsapp: another program uses this session now (is `mdclaw whatsapp "
                  "link` or a second daemon running?)")

    async def _on_temporary_ban(self, client: Any, ev: Any) -> None:
        self._connected = False
        log.error("whatsapp: the account is temporarily banned (code %s, %s s)", ev.Code,
                  ev.Expire)

    async def _on_message(self, client: Any, ev: Any) -> None:
        try:
            msg = self.parse_message(ev)
        except Exception:  # noqa: BLE001 - one odd message must not stop the others
            log.exception("whatsapp: could not read message %s", ev.Info.ID)
            return
        if msg is None:
            return
        try:
            await self.deliver_inbound(msg)
        except Exception:  # noqa: BLE001 - the host's callback; WhatsApp does not redeliver
            log.exception("whatsapp: the host did not take message %s", msg.id)

    async def _on_joined_group(self, client: Any, ev: Any) -> None:
        await self._record_groups([ev.GroupInfo])

    async def _on_group_info(self, client: Any, ev: Any) -> None:
        if ev.Name.Name:
            jid = f"wa:{jid_of(ev.JID)}"
            self._group_names[jid] = ev.Name.Name
            if self.db is not None:
                await asyncio.to_thread(self._upsert_groups, [(jid, ev.Name.Name, None)])

    # ------------------------------------------------------------------ groups
    async def sync_groups(self) -> int:
        """Put the groups the account is in into the chats table; return how many."""
        client = self.client
        if client is None:
            return 0
        try:
            groups = await client.get_joined_groups()
        except Exception as e:  # noqa: BLE001 - a later connect tries again
            log.warning("whatsapp: could not list the groups: %s", e)
            return 0
        n = await self._record_groups(list(groups))
        self.groups_synced += 1
        return n

    async def _record_groups(self, groups: list[Any]) -> int:
        rows = []
        for g in groups:
            jid = f"wa:{jid_of(g.JID)}"
            name = g.GroupName.Name or None
            if name:
                self._group_names[jid] = name
            created = (now_iso(datetime.fromtimestamp(g.GroupCreated, UTC))
                       if g.GroupCreated else None)
            rows.append((jid, name, created))
        if self.db is not None and rows:
            await asyncio.to_thread(self._upsert_groups, rows)
        return len(rows)

    def _upsert_groups(self, rows: list[tuple[str, str | None, str | None]]) -> None:
        assert self.db is not None
        with self.db.transaction() as c:
            for jid, name, created in rows:
                upsert_chat(c, jid, name, self.name, True, created)

    # ------------------------------------------------------------------ inbound
    def _remember(self, msg_id: str, sender: str, mine: bool) -> None:
        self._senders[msg_id] = (sender, mine)
        self._senders.move_to_end(msg_id)
        while len(self._senders) > REMEMBERED_MESSAGES:
            self._senders.popitem(last=False)

    def parse_message(self, ev: Any) -> InboundMessage | None:
        """A neonize Message event as an InboundMessage; None for the account's own
        messages, status updates, channels and messages without text or media."""
        info = ev.Info
        src = info.MessageSource
        chat = jid_of(src.Chat)
        if (src.IsFromMe or not chat or src.Chat.Server in ("broadcast", "newsletter")
                or chat == "status@broadcast"):
            return None
        message = unwrap(ev.Message)
        text, ctx = "", None
        if message.conversation:
            text = message.conversation
        elif message.HasField("extendedTextMessage"):
            text = message.extendedTextMessage.text
            ctx = message.extendedTextMessage.contextInfo
        attachments = []
        for field_name, kind in _MEDIA:
            if not message.HasField(field_name):
                continue
            media = getattr(message, field_name)
            if field_name == "audioMessage" and media.PTT:
                kind = "voice"
            caption = getattr(media, "caption", "") or None
            text = text or (caption or "")
            ctx = ctx or media.contextInfo
            only = type(message)()
            getattr(only, field_name).CopyFrom(media)
            attachments.append(Attachment(
                kind=kind, name=getattr(media, "fileName", "") or None,
                mime=media.mimetype or None, size=media.fileLength or None,
                fetch=partial(self._fetch, only), caption=caption))
        if not text and not attachments:
            return None
        jid = f"wa:{chat}"
        sender = jid_of(src.Sender) or chat
        msg_id = f"{jid}:{info.ID}"
        self._remember(msg_id, sender, False)
        addressed = False
        reply_to = None
        if ctx is not None:
            for mentioned in ctx.mentionedJID:
                if user_of(mentioned) in self._own_users:
                    addressed = True
                    if self.trigger:
                        text = re.sub(rf"@{re.escape(user_of(mentioned))}(?!\d)", self.trigger,
                                      text)
            if ctx.stanzaID:
                reply_to = f"{jid}:{ctx.stanzaID}"
                quoted_sender = ctx.participant or ""
                to_me = user_of(quoted_sender) in self._own_users if quoted_sender else False
                addressed = addressed or to_me
                if quoted_sender:
                    self._remember(reply_to, quoted_sender, to_me)
                excerpt = self._excerpt(ctx.quotedMessage) if ctx.HasField(
                    "quotedMessage") else ""
                if excerpt:
                    who = "you" if to_me else user_of(quoted_sender) or "someone"
                    text = f"{text}\n(replying to {who}: \"{excerpt}\")"
        if addressed and self.trigger and not re.search(
                rf"(?<!\w){re.escape(self.trigger)}(?!\w)", text, re.IGNORECASE):
            text = f"{self.trigger} {text}"
        timestamp = message_time(int(info.Timestamp))
        is_group = src.IsGroup or src.Chat.Server == "g.us"
        chat_name = self._group_names.get(jid) if is_group else (info.Pushname or None)
        return InboundMessage(
            id=msg_id, chat_jid=jid, sender=sender,
            sender_name=info.Pushname or user_of(sender), content=text, timestamp=timestamp,
            chat_name=chat_name, is_group=is_group, channel=self.name, addressed=addressed,
            attachments=tuple(attachments), reply_to=reply_to)

    @staticmethod
    def _excerpt(quoted: Any) -> str:
        quoted = unwrap(quoted)
        text = (quoted.conversation or quoted.extendedTextMessage.text
                or quoted.imageMessage.caption or quoted.videoMessage.caption
                or quoted.documentMessage.caption or quoted.documentMessage.fileName)
        text = " ".join(text.split())
        return text if len(text) <= QUOTE_EXCERPT else text[:QUOTE_EXCERPT - 1] + "…"

    async def _fetch(self, message: Any, limit: int) -> bytes:
        """Download the media of `message`; ChannelError when larger than `limit` bytes."""
        media = next(getattr(message, f) for f, _ in _MEDIA if message.HasField(f))
        if media.fileLength and media.fileLength > limit:
            raise ChannelError(f"the file is {media.fileLength} bytes, more than {limit}",
                               permanent=True)
        client = self.client
        if client is None or not self.is_connected():
            raise ChannelError("the WhatsApp channel is not connected")
        try:
            data = await client.download_any(message)
        except Exception as e:  # noqa: BLE001 - neonize's DownloadError and plain errors
            raise ChannelError(f"whatsapp download: {e}") from None
        data = bytes(data or b"")
        if len(data) > limit:
            raise ChannelError(f"the file is {len(data)} bytes, more than {limit}",
                               permanent=True)
        return data

    # ------------------------------------------------------------------ outbound
    def split_text(self, text: str) -> list[str]:
        """The assistant's Markdown in WhatsApp's formatting, in pieces that keep code
        blocks closed. (Text given to `send_message` is sent as it is.)"""
        return split_message(to_whatsapp(text), self.max_message_length, measure=self.measure)

    def _jid(self, jid: str) -> Any:
        m = JID_RE.match(jid)
        if not m:
            raise ChannelError(f"{jid!r} is not a WhatsApp chat", permanent=True)
        return _neonize().types.JID(User=m.group(1), Server=m.group(2), RawAgent=0, Device=0,
                                    Integrator=0, IsEmpty=False)

    def _client(self) -> Any:
        if self.client is None or not self.is_connected():
            raise ChannelError("the WhatsApp channel is not connected")
        return self.client

    async def _throttle(self) -> None:
        """Keep `send_interval` between two sends (call with the send lock held)."""
        wait = self._last_send + self.send_interval - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)

    async def _send(self, jid: str, message: Any) -> str | None:
        target = self._jid(jid)
        async with self._send_lock:
            client = self._client()
            await self._throttle()
            try:
                resp = await client.send_message(target, message)
            except Exception as e:  # noqa: BLE001 - SendMessageError and plain errors
                raise self._error("send", e) from None
            finally:
                self._last_send = time.monotonic()
        mid = getattr(resp, "ID", "") or None
        if mid:
            self._remember(f"{jid}:{mid}", "", True)
        return f"{jid}:{mid}" if mid else None

    @staticmethod
    def _error(what: str, e: Exception) -> ChannelError:
        text = str(e)
        low = text.lower()
        if "rate-overlimit" in low or "429" in low:
            return ChannelError(f"whatsapp {what}: rate limited ({text})", retry_after=60.0)
        if "not-authorized" in low or "forbidden" in low or "403" in low or \
                "item-not-found" in low or "404" in low:
            return ChannelError(f"whatsapp {what}: {text}", permanent=True)
        return ChannelError(f"whatsapp {what}: {text}")

    def _quote(self, jid: str, reply_to: str | None) -> Any:
        """ContextInfo quoting `reply_to` (our id of a message in `jid`), or None."""
        if not reply_to or not reply_to.startswith(f"{jid}:"):
            return None
        e2e = _neonize().e2e
        stanza = reply_to[len(jid) + 1:]
        sender, mine = self._senders.get(reply_to, ("", False))
        stored_sender, content = self._stored(reply_to)
        sender = sender or stored_sender
        if mine:
            sender = self.pairing.jid or sender
        ctx = e2e.ContextInfo(stanzaID=stanza)
        if sender:
            ctx.participant = sender
        # WhatsApp shows the quoted text from here (the stored text, when there is one).
        ctx.quotedMessage.CopyFrom(e2e.Message(conversation=content))
        return ctx

    def _stored(self, message_id: str) -> tuple[str, str]:
        """(sender, text) of an inbound message the host stored, or empty strings."""
        if self.db is None:
            return "", ""
        try:
            r = self.db.query_one("SELECT sender, content FROM messages WHERE id = ?",
                                  (message_id,))
        except sqlite3.Error:
            return "", ""
        return (str(r[0] or ""), str(r[1] or "")) if r else ("", "")

    def _stop_typing(self, jid: str) -> None:
        t = self._typing.pop(jid, None)
        if t is not None:
            t.cancel()

    async def send_message(self, jid: str, text: str, *, reply_to: str | None = None,
                           sender: str | None = None) -> str | None:
        """Send `text` (already in WhatsApp's formatting: `split_text` converts) to `jid`."""
        self._jid(jid)
        self._stop_typing(jid)
        e2e = _neonize().e2e
        ctx = self._quote(jid, reply_to)
        if ctx is None:
            message = e2e.Message(conversation=text)
        else:
            message = e2e.Message(extendedTextMessage=e2e.ExtendedTextMessage(
                text=text, contextInfo=ctx))
        return await self._send(jid, message)

    async def send_file(self, jid: str, path: Path, *, file_name: str | None = None,
                        caption: str | None = None) -> str | None:
        self._jid(jid)
        path = Path(path)
        data = await asyncio.to_thread(read_upload, path, MAX_UPLOAD_BYTES,
                                       "through WhatsApp mdclaw sends at most")
        name = file_name or path.name
        mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
        nz = _neonize()
        e2e, media_type = nz.e2e, nz.enum.MediaType
        rendered = to_whatsapp(caption) if caption else None
        if mime in IMAGE_MIMES:
            kind, mtype = "imageMessage", media_type.MediaImage
        elif mime.startswith("audio/"):
            kind, mtype = "audioMessage", media_type.MediaAudio
        else:
            kind, mtype = "documentMessage", media_type.MediaDocument
        client = self._client()
        try:
            up = await client.upload(data, mtype)
        except Exception as e:  # noqa: BLE001 - UploadError and plain errors
            raise self._error("upload", e) from None
        common = {"URL": up.url, "directPath": up.DirectPath, "mediaKey": up.MediaKey,
                  "fileEncSHA256": up.FileEncSHA256, "fileSHA256": up.FileSHA256,
                  "fileLength": up.FileLength, "mimetype": mime}
        if kind == "imageMessage":
            message = e2e.Message(imageMessage=e2e.ImageMessage(caption=rendered, **common))
        elif kind == "audioMessage":
            message = e2e.Message(audioMessage=e2e.AudioMessage(**common))
        else:
            message = e2e.Message(documentMessage=e2e.DocumentMessage(
                fileName=name, title=name, caption=rendered, **common))
        self._stop_typing(jid)
        mid = await self._send(jid, message)
        if kind == "audioMessage" and rendered:  # audio has no caption: it follows as text
            await self._send(jid, e2e.Message(conversation=rendered))
        return mid

    async def react(self, jid: str, message_id: str, emoji: str) -> None:
        target = self._jid(jid)
        if not message_id.startswith(f"{jid}:"):
            raise ChannelError(f"message id {message_id!r} is not a message of {jid}",
                               permanent=True)
        nz = _neonize()
        sender, mine = self._senders.get(message_id, ("", False))
        sender = sender or self._stored(message_id)[0]
        key = nz.common.MessageKey(remoteJID=jid_of(target), fromMe=mine,
                                   ID=message_id[len(jid) + 1:])
        if sender and not mine and target.Server == "g.us":
            key.participant = sender
        message = nz.e2e.Message(reactionMessage=nz.e2e.ReactionMessage(
            key=key, text=emoji, senderTimestampMS=int(time.time() * 1000)))
        await self._send(jid, message)

    async def set_typing(self, jid: str, typing: bool) -> None:
        if not JID_RE.match(jid):
            return
        self._stop_typing(jid)
        if typing and self._running:
            self._typing[jid] = asyncio.create_task(self._typing_loop(jid),
                                                    name=f"whatsapp-typing-{jid}")
        else:
            await self._presence(jid, composing=False)

    async def _presence(self, jid: str, *, composing: bool) -> None:
        client = self.client
        if client is None or not self.is_connected():
            return
        enum = _neonize().enum
        state = (enum.ChatPresence.CHAT_PRESENCE_COMPOSING if composing
                 else enum.ChatPresence.CHAT_PRESENCE_PAUSED)
        try:
            await client.send_chat_presence(self._jid(jid), state,
                                            enum.ChatPresenceMedia.CHAT_PRESENCE_MEDIA_TEXT)
        except Exception as e:  # noqa: BLE001 - typing is a hint
            log.debug("whatsapp: presence in %s: %s", jid, e)

    async def _typing_loop(self, jid: str) -> None:
        # WhatsApp shows "typing…" for about 25 s per update; repeat until stopped (bounded).
        loop = asyncio.get_running_loop()
        until = loop.time() + TYPING_MAX_SECONDS
        try:
            while loop.time() < until:
                await self._presence(jid, composing=True)
                await asyncio.sleep(TYPING_REPEAT_SECONDS)
        finally:
            if self._typing.get(jid) is asyncio.current_task():
                self._typing.pop(jid, None)

    # ------------------------------------------------------------------ pairing by phone
    async def pair_code(self, phone: str) -> str:
        """Ask WhatsApp for a pairing code for `phone` (digits with country code), to type
        into the phone instead of scanning. Needs the session up and not linked."""
        client = self.client
        if client is None:
            raise ChannelError("the WhatsApp session is not started")
        digits = re.sub(r"[^\d]", "", phone)
        if not 7 <= len(digits) <= 15:
            raise ChannelError(f"{phone!r} is not a phone number with country code",
                               permanent=True)
        try:
            return str(await client.PairPhone(digits, True))
        except Exception as e:  # noqa: BLE001 - PairPhoneError and plain errors
            raise ChannelError(f"whatsapp pairing code: {e}") from None


__all__ = ["LINKED", "LINK_FIX", "LOGGED_OUT", "UNLINKED", "Pairing", "WhatsAppChannel",
           "link_state", "message_time", "prepare_session", "session_jid"]
