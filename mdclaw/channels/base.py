"""The one interface every chat channel implements, and the message it hands inbound.

A channel owns a JID prefix (`hl:` for the local HTTP channel, `tg:` for Telegram). The
outbox worker finds the channel that owns a row's JID and calls `send_message`, `send_file`
or `react`; the orchestrator calls `set_typing` and receives inbound messages through the
callback given to the channel. Channels never import each other.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import hashlib
import inspect
import json
import logging
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mdclaw.errors import ChannelError
from mdclaw.markup import split_text
from mdclaw.state import Database
from mdclaw.state.conversations import get_router_value, set_router_value

log = logging.getLogger("mdclaw.channels")

# Which outbox delivery the send in progress belongs to: "<row id>.<part>" for a part of a
# text row, "<row id>.card" / "<row id>.file" for a card or a file row; None for a send the
# outbox did not start. The outbox sets it around each call (`delivering`); a channel whose
# service takes a client-chosen key that makes a repeated request return the first result
# (Discord's message nonce) derives the key from it (`delivery_key`), so the retry of a row
# whose answer was lost does not post it twice.
_DELIVERY: ContextVar[str | None] = ContextVar("mdclaw_outbox_delivery", default=None)


@contextlib.contextmanager
def delivering(key: str) -> Iterator[None]:
    """Within this block, sends belong to the outbox delivery `key` (see `delivery_key`)."""
    token = _DELIVERY.set(key)
    try:
        yield
    finally:
        _DELIVERY.reset(token)


def delivery_key(jid: str, what: str, *, size: int = 24) -> str | None:
    """A key (hex, `size` characters) the same on every retry of the outbox delivery in
    progress and different for anything else: the delivery, the chat and what is sent (`what`:
    the text of the part, a file's name) go into it, so two parts of one card differ.
    None outside an outbox delivery."""
    key = _DELIVERY.get()
    if key is None:
        return None
    h = hashlib.blake2b(f"{jid}\0{key}\0{what}".encode(), digest_size=(size + 1) // 2)
    return h.hexdigest()[:size]


@dataclass(frozen=True)
class Attachment:
    """A photo, document, audio file or voice note that came with an inbound message.

    Everything here is what the sender claims (untrusted): the name is sanitised and the size
    enforced by whoever saves the file. `fetch(limit)` downloads the content and raises
    ChannelError when it is larger than `limit` bytes, so nothing big is ever held.
    """

    kind: str                       # "image" | "document" | "audio" | "voice" | "video"
    name: str | None
    mime: str | None
    size: int | None                # as announced by the service, if it says
    fetch: Callable[[int], Awaitable[bytes]]
    caption: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "mime": self.mime, "size": self.size,
                "caption": self.caption}


def kind_for_mime(mime: str | None) -> str:
    """The attachment kind a MIME type suggests, for channels whose uploads do not say."""
    top = (mime or "").split("/", 1)[0].lower()
    return {"image": "image", "audio": "audio", "video": "video"}.get(top, "document")


@dataclass(frozen=True)
class InboundMessage:
    """One message a person wrote in a chat, as every channel reports it.

    `id` is unique across all chats (channels prefix it where the chat's own ids are not);
    `timestamp` is ISO-8601 UTC with a trailing Z.
    """

    id: str
    chat_jid: str
    sender: str
    sender_name: str
    content: str
    timestamp: str
    chat_name: str | None = None
    is_group: bool = False
    channel: str = ""
    #: The person addressed the assistant by the chat service's own means (a @mention of
    #: the bot, a reply to one of its messages): treat it as triggered.
    addressed: bool = False
    #: Files that came with the message (the content is then the caption, or empty).
    attachments: tuple[Attachment, ...] = ()
    #: The id (as above) of the message this one replies to, when the service says.
    reply_to: str | None = None
    #: What the sender wrote themselves, where the content holds more (an email's quoted
    #: original and signature): what a reply code ("approve 7KQ2") is read from. None: the
    #: content.
    own_words: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "attachments"}
        d["attachments"] = [a.as_dict() for a in self.attachments]
        return d


@dataclass(frozen=True)
class CardChoice:
    """A button on a card: what it says, and the data the press hands back (at most 64
    bytes)."""

    label: str
    data: str


@dataclass(frozen=True)
class Card:
    """A message that asks a person something (mdclaw.approvals): plain text (never
    Markdown), buttons where the chat service has them, and the text for a channel without
    buttons (it says which words to reply)."""

    text: str
    choices: tuple[CardChoice, ...] = ()
    fallback: str = ""

    @classmethod
    def from_json(cls, raw: str) -> Card:
        """The card of an outbox row's `card` column. Raises ValueError if it is none."""
        d = json.loads(raw)
        if not isinstance(d, dict) or not isinstance(d.get("text"), str):
            raise ValueError("not a card")
        choices = tuple(CardChoice(str(c["label"]), str(c["data"]))
                        for c in d.get("choices") or [] if isinstance(c, dict))
        return cls(d["text"], choices, str(d.get("fallback") or d["text"]))


@dataclass(frozen=True)
class CardPress:
    """A person pressed a card's button: who (the sender the chat service authenticated),
    where, which card message, and the button's data."""

    channel: str
    sender: str
    sender_name: str
    chat_jid: str
    message_id: str | None
    data: str


InboundCallback = Callable[[InboundMessage], "Awaitable[None] | None"]
#: Takes a button press; returns the short answer the person is shown (None: nothing).
PressCallback = Callable[[CardPress], "Awaitable[str | None]"]
#: Queues a channel's own answer: (jid, Markdown text, message id it answers or None).
ServiceReply = Callable[[str, str, "str | None"], "Awaitable[None] | None"]


@dataclass(frozen=True)
class LocalText:
    """A text a channel that writes locally delivers (Channel.write_texts)."""

    text: str
    reply_to: str | None = None
    sender: str | None = None  # a sub-agent's name, shown as the sender


class Channel(abc.ABC):
    """A chat service mdclaw talks through.

    Subclasses set `name`, `jid_prefix` and `max_message_length`, and implement the
    abstract methods. Inbound messages go to the callback set with `on_inbound` (or given
    to the constructor); a callback that raises is logged and the error re-raised to the
    channel, which decides whether the chat service should redeliver.
    """

    name: str = ""
    jid_prefix: str = ""
    #: Longest text one `send_message` call may carry, measured with `measure`.
    max_message_length: int = 4096
    #: The chat service shows a card's choices as buttons (and reports presses).
    buttons: bool = False
    #: Delivering a text is writing a row of mdclaw's own database (the local chat page):
    #: the channel implements `write_texts`, and the outbox writes those rows and the
    #: message's `sent` mark in one transaction.
    writes_locally: bool = False

    def __init__(self, on_inbound: InboundCallback | None = None) -> None:
        self._on_inbound = on_inbound
        self._service_reply: ServiceReply | None = None
        self._on_press: PressCallback | None = None

    # ------------------------------------------------------------------ inbound
    def on_inbound(self, callback: InboundCallback | None) -> None:
        """Set (or clear, with None) the function that receives inbound messages."""
        self._on_inbound = callback

    async def deliver_inbound(self, msg: InboundMessage) -> bool:
        """Hand `msg` to the callback. False if no callback is set; raises what it raises."""
        cb = self._on_inbound
        if cb is None:
            log.warning("%s: inbound message %s dropped: no handler is set", self.name, msg.id)
            return False
        result = cb(msg)
        if inspect.isawaitable(result):
            await result
        return True

    def on_press(self, callback: PressCallback | None) -> None:
        """Set the function that takes button presses on cards (mdclaw.decisions)."""
        self._on_press = callback

    async def deliver_press(self, press: CardPress) -> str | None:
        """Hand a button press to the host; returns what to show the person (None when no
        handler is set: the press is ignored)."""
        cb = getattr(self, "_on_press", None)
        if cb is None:
            log.warning("%s: a card's button press was ignored: no handler is set", self.name)
            return None
        return await cb(press)

    # ------------------------------------------------------------------ lifecycle
    @abc.abstractmethod
    async def connect(self) -> None:
        """Start receiving and be ready to send. Raises ChannelError if it cannot start."""

    @abc.abstractmethod
    async def disconnect(self) -> None:
        """Stop receiving and release every resource; safe to call twice."""

    @abc.abstractmethod
    def is_connected(self) -> bool:
        """True while the channel can send."""

    def status_info(self) -> dict[str, Any]:
        """What the operator sees of this channel (status, doctor, the operator page): at
        least {"connected": bool}. A channel that must be paired adds "link_state"
        ("linked" | "unlinked" | "logged_out") and, while unlinked, "qr" (the text to show
        as a QR code)."""
        return {"connected": self.is_connected()}

    def owns_jid(self, jid: str) -> bool:
        """True if `jid` is a chat of this channel (by prefix)."""
        return bool(self.jid_prefix) and jid.startswith(self.jid_prefix)

    # ------------------------------------------------------------------ outbound
    @abc.abstractmethod
    async def send_message(self, jid: str, text: str, *, reply_to: str | None = None,
                           sender: str | None = None) -> str | None:
        """Send `text` (at most max_message_length) to `jid`; return the new message id
        if the service gives one. Raises ChannelError."""

    def write_texts(self, conn: sqlite3.Connection, jid: str,
                    texts: Sequence[LocalText]) -> Callable[[], None]:
        """For a channel that `writes_locally`: deliver `texts` (in order, each one message
        of at most max_message_length) to `jid` as rows written through `conn`, in the
        caller's open transaction, and return what is to be done once it has committed
        (wake the pages that wait, say); nothing of it is done if the transaction rolls
        back. Raises ChannelError, before writing anything, if they cannot be delivered."""
        raise NotImplementedError(f"the {self.name} channel does not write locally")

    @abc.abstractmethod
    async def send_file(self, jid: str, path: Path, *, file_name: str | None = None,
                        caption: str | None = None) -> str | None:
        """Send the file at `path` (a host path) to `jid`. Raises ChannelError."""

    @abc.abstractmethod
    async def react(self, jid: str, message_id: str, emoji: str) -> None:
        """React to `message_id` in `jid` with `emoji`. Raises ChannelError."""

    @abc.abstractmethod
    async def set_typing(self, jid: str, typing: bool) -> None:
        """Show (or stop showing) that the assistant is writing. Never raises for
        delivery problems: typing is a hint."""

    # ------------------------------------------------------------------ cards
    async def send_card(self, jid: str, card: Card) -> str | None:
        """Send `card` to `jid`; return the new message's id. Without buttons (the
        default): its fallback text (with the words to reply), shown literally. Raises
        ChannelError."""
        last = None
        for part in self.message_parts(markdown_literal(card.fallback or card.text)):
            last = await self.send_part(jid, part)
        return last

    async def edit_card(self, jid: str, message_id: str, card: Card) -> None:
        """Show `card` in place of the card message `message_id` (its outcome, without
        buttons). The default, for services that cannot edit: a new message."""
        await self.send_card(jid, card)

    # ------------------------------------------------------------------ helpers
    def redact(self, text: str) -> str:
        """`text` with this channel's secrets masked, for logs and stored errors."""
        return text

    def measure(self, text: str) -> int:
        """Length of `text` as the service counts it (code points unless overridden)."""
        return len(text)

    def split_text(self, text: str) -> list[str]:
        """`text` in pieces of at most max_message_length (see split_text)."""
        return split_text(text, self.max_message_length, measure=self.measure)

    def message_parts(self, text: str) -> Sequence[Any]:
        """The assistant's Markdown `text` as the messages this channel sends, in order:
        what `send_part` takes. The outbox sends them one by one and remembers how many
        went, so the result must be the same every time for the same text. By default the
        text in pieces (`split_text`); a channel that formats (Telegram's entities) renders
        first and cuts the rendered form."""
        return self.split_text(text)

    async def send_part(self, jid: str, part: Any, *, reply_to: str | None = None,
                        sender: str | None = None) -> str | None:
        """Send one of `message_parts`' results. Raises ChannelError."""
        return await self.send_message(jid, part, reply_to=reply_to, sender=sender)

    # ------------------------------------------------------------------ service answers
    def on_service_reply(self, callback: ServiceReply | None) -> None:
        """Set the function that queues the channel's own answers (`/chatid`) in the outbox,
        so they are retried like any reply (None: the channel sends them itself)."""
        self._service_reply = callback

    async def service_reply(self, jid: str, text: str, *, reply_to: str | None = None) -> None:
        """Answer in `jid` on the channel's own account: through the outbox when the host
        gave a callback, else sent at once (errors logged)."""
        cb = getattr(self, "_service_reply", None)
        if cb is not None:
            result = cb(jid, text, reply_to)
            if inspect.isawaitable(result):
                await result
            return
        try:
            for part in self.message_parts(text):
                await self.send_part(jid, part, reply_to=reply_to)
        except ChannelError as e:
            log.warning("%s: could not answer in %s: %s", self.name, jid, self.redact(str(e)))


class SavedPosition:
    """Where a channel is in its service's stream (Telegram's getUpdates offset, a Matrix sync
    token, a mailbox's last UID, Discord's message cursors), kept in the state database's
    router_state under `key()` so a restart neither loses nor repeats what came in.

    Reads and writes run on a worker thread, never on the event loop. Writes are numbered in
    the order the loop asked for them; one that finds a later one written already is dropped,
    so an older position never overwrites a newer one (a poller's write and disconnect's can
    overlap). A failure is logged (`what` names it), never raised: the position stays in the
    channel's memory and is written with the next save. Without a database nothing is kept."""

    def __init__(self, db: Database | None, key: Callable[[], str], *, channel: str,
                 what: str) -> None:
        self.db = db
        self.key = key
        self.channel = channel
        self.what = what
        self.saved: str | None = None  # the value last read or written
        self._asks = 0
        self._written = 0
        self._lock = threading.Lock()

    async def load(self) -> str | None:
        """The saved value (None: nothing saved, no database, or the database failed)."""
        if self.db is None:
            return None
        try:
            value = await asyncio.to_thread(get_router_value, self.db, self.key())
        except sqlite3.Error as e:
            log.warning("%s: could not read the saved %s: %s", self.channel, self.what, e)
            return None
        if value is not None:
            self.saved = value
        return value

    async def save(self, value: str) -> None:
        """Keep `value` (nothing happens when it is what was saved last)."""
        if self.db is None or value == self.saved:
            return
        self._asks += 1
        try:
            await asyncio.to_thread(self._write, self._asks, value)
        except sqlite3.Error as e:  # kept in memory; saved with the next one
            log.warning("%s: could not save the %s: %s", self.channel, self.what, e)

    def _write(self, ask: int, value: str) -> None:
        assert self.db is not None
        with self._lock:
            if ask <= self._written:
                return
            set_router_value(self.db, self.key(), value)
            self._written, self.saved = ask, value


def read_upload(path: Path, limit: int, whose: str) -> bytes:
    """The content of the host's file `path` that a channel is to send (call it off the
    event loop). Raises a permanent ChannelError when it is missing, not a regular file or
    over `limit` bytes (`whose` ends that message: "bots may upload at most" and the like).
    """
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ChannelError(f"{path.name!r} is not a regular file", permanent=True)
    except OSError:
        raise ChannelError(f"file {path.name!r} to send does not exist",
                           permanent=True) from None
    if size > limit:
        raise ChannelError(f"file {path.name!r} is {size} bytes; {whose} {limit}",
                           permanent=True)
    return path.read_bytes()


_MD_PUNCT = frozenset("\\`*_{}[]()#+-.!|<>~=")


def markdown_literal(text: str) -> str:
    """`text` with every Markdown punctuation character backslash-escaped, so a channel that
    renders the assistant's Markdown shows it as written (a card is plain text)."""
    return "".join(f"\\{c}" if c in _MD_PUNCT else c for c in text)


def channel_for(channels: Iterable[Channel], jid: str) -> Channel | None:
    """The first channel in `channels` that owns `jid`, or None."""
    for ch in channels:
        if ch.owns_jid(jid):
            return ch
    return None
