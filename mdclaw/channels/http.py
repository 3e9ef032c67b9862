"""The local HTTP channel (`hl:<channel id>`): mdclaw's embedded default chat.

Endpoints (JSON unless noted):

- `POST /message` — a person (or a script) writes in chat `jid` (`{"text"|"content": ...,
  "sender"?, "sender_name"?, "jid"|"channel"?}`; without a chat it goes to the main group's
  `hl:` chat). 202 `{"id", "message_id", "jid", "seq"}`; 400 bad JSON or fields, 401 missing
  or wrong bearer token, 413 body over the limit, 503 before the host takes messages.
- `GET /messages?jid=hl:x&after=SEQ[&wait=S][&limit=N]` — the chat's transcript after cursor
  SEQ: what was posted (`direction: "in"`) and what the assistant sent (`"out"`: text, files
  by name, reactions), oldest first, plus `cursor` for the next call and `typing`. With `wait`
  it long-polls up to S seconds (at most 30) for something new. With `before=SEQ` instead it
  answers at once with the newest `limit` rows before SEQ and `older` (whether more remain):
  the page's "load older". What the assistant wrote also comes as `html`: its Markdown
  rendered and sanitised (mdclaw.markup.to_html); people's text has none.
- `POST /upload` — multipart (`jid`, `sender_name`?, `text`? as the caption, `voice`? = 1
  for a voice note recorded in the page: an audio file then goes to the transcription like
  any channel's voice note, one `file`): a person sends a file; it reaches the host as the
  message's attachment (saved in the group's inbox like any channel's). 413 when the file
  is over the upload limit (checked while the body streams in), else as `/message`. Any
  file name becomes safe text (`upload_file_name`: bytes that are not UTF-8 replaced,
  control and format characters "_", the last part of a path); a part whose headers are
  not valid HTTP (NUL or CR in the name, a line over 8 KB) or whose `filename*` cannot be
  decoded is a 400 that says so.
- `GET /file?jid=hl:x&id=<message id>` — a file the assistant sent to that chat (its
  transcript row carries this link as `download`): images the page shows inline (PNG, JPEG,
  GIF, WebP), anything else as a download (`Content-Disposition: attachment`, octet-stream),
  never rendered as a page (`nosniff`, a sandboxing CSP).
- `POST /card` — a person presses a card's button (`{"jid", "id": the card's message id,
  "data": the button's data, "sender"?, "sender_name"?}`): handed to the host, whose answer
  comes back as `{"answer"}`. Who pressed is the sender, as for a message: the page's name,
  behind the web server's token. Cards come in the transcript as `text` rows with `card:
  {choices: [{label, data}], state}` (state `open`, or `closed` once decided); a decided
  card's outcome follows as a row of its own.
- `GET /groups` — the registered groups that answer in this channel.
- `POST /retry` — `{"jid", "id"}`: a reply to the chat the outbox gave up on (it comes in
  `/messages` as `outbox: [{id, state: "failed", error, ...}]`, beside the replies still
  `sending`) gets a fresh set of tries, as `mdclaw outbox retry` does.
- `GET /push/key`, `POST /push/subscribe` (`{"jid", "subscription"}`), `POST
  /push/unsubscribe` (`{"jid", "endpoint"}`) — Web Push (mdclaw.channels.webpush): a reply
  to a chat no page has open is announced on the devices subscribed to it.
- `GET /health` — liveness, no auth.
- `GET /` — a single-page chat (HTML, `GET /chat.js`, `/chat.css` and the shared
  `/mdclaw.css` beside it; no build step), installable (`/manifest.webmanifest`, icons, and
  the service worker `/sw.js`, which keeps the page's shell for offline). The page's CSP runs
  only those files, never inline script or style.

The channel owns no listener: it adds these routes to the daemon's web server
(mdclaw.webserver.WebServer, on `server.listen`), beside the operator page and /metrics, and
answers while it is connected. The server's host and origin checks come first; the bearer
check of the endpoints below is the server's `gate` (`TokenGate`: the one secret, compared
the same way, wrong tokens counted against the one lockout).

The transcript lives in the `http_messages` table (its `seq` is the cursor), apart from the
`messages` table the orchestrator keeps, so replies never show up as prompt context. Each
chat keeps its newest `keep_per_chat` rows.

Files the assistant sends are copied into `files_dir` (host-owned, under data_dir) and removed
with their transcript rows.

Security: the server binds 127.0.0.1 by default; with a secret (`server.secret_file` or the
generated one) every endpoint but `/health` and the page's files (`/`, `/chat.js`,
`/chat.css`: they hold no data) needs `Authorization: Bearer <secret>` (compared in constant
time; after 10 wrong tokens within 5 minutes an address gets 429 for 5 minutes,
mdclaw.throttle). Cross-site requests are refused by the server: a request with an `Origin`
other than its own `Host` gets 403, and on a loopback address only loopback host names are
answered (no DNS rebinding).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import mimetypes
import re
import shutil
import sqlite3
import time
import unicodedata
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from aiohttp import BodyPartReader, hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from mdclaw.channels.base import (
    Attachment,
    Card,
    CardPress,
    Channel,
    ChannelError,
    InboundCallback,
    InboundMessage,
    LocalText,
    kind_for_mime,
)
from mdclaw.channels.webpush import WebPush, valid_subscription
from mdclaw.markup import to_html
from mdclaw.state import Database, now_iso
from mdclaw.state.groups import get_group_by_jid, list_groups, main_group
from mdclaw.state.outbox import OutboxError, retry_failed
from mdclaw.webassets import SHARED_STYLE, PageAssets
from mdclaw.webserver import SECURITY_HEADERS, Handler, WebServer, is_loopback, json_error

log = logging.getLogger("mdclaw.channels.http")

JID_RE = re.compile(r"^hl:[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}\Z")
MAX_WAIT_SECONDS = 30.0
MAX_FIELD = 200
TYPING_SECONDS = 30.0
# The page runs only its own script and style sheet (chat.js, chat.css), never inline code:
# what the assistant writes is sanitised HTML, and even markup that slipped through could
# run nothing.
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; "
            "connect-src 'self'; img-src 'self' data: blob:; media-src 'self' blob:; "
            "manifest-src 'self'; worker-src 'self'; base-uri 'none'; "
            "form-action 'none'; frame-ancestors 'none'")
# The page's files (mdclaw/channels/static/): like the page, served without the token.
# The service worker (sw.js) is served at the root, the scope it caches the page's shell in;
# the manifest and icons make the page installable ("Add to home screen").
PAGE_FILES = {"": "chat.html", "chat.js": "chat.js", "chat.css": "chat.css",
              "mdclaw.css": SHARED_STYLE, "sw.js": "sw.js",
              "manifest.webmanifest": "manifest.webmanifest",
              "icon-192.png": "icon-192.png", "icon-512.png": "icon-512.png",
              "icon-maskable-512.png": "icon-maskable-512.png",
              "apple-touch-icon.png": "apple-touch-icon.png"}
# A chat counts as open in a page while a long poll of it is under way, or one ended this
# recently (the page asks again at once): replies then are not pushed.
WATCH_GRACE_SECONDS = 5.0
OUTBOX_RECHECK_SECONDS = 1.0
MAX_PENDING_SHOWN = 20
# The chat's replies not delivered yet: the rows waiting and failed (ranges of the index by
# state), not the chat's history of sent ones; every long poll of an open page asks. Named,
# as with statistics the planner would walk the table in id order for the LIMIT
# (tests/test_chat_history_cost.py).
PENDING_SQL = (
    "SELECT id, kind, text, file_name, status, attempts, last_error, created_at "
    "FROM outbox INDEXED BY idx_outbox_status_time WHERE status IN ('pending', 'sending', "
    "'failed') AND chat_jid = ? AND kind != 'reaction' AND card IS NULL ORDER BY id LIMIT ?")
# A served file is never a page: no script, no plugin, a sandbox of its own.
_FILE_CSP = "default-src 'none'; img-src 'self'; sandbox"
INLINE_IMAGES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
FILE_KEY_RE = re.compile(r"^[0-9a-f]{32}\Z")
_MIME_PART = r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}"
MIME_RE = re.compile(rf"^{_MIME_PART}/{_MIME_PART}\Z")


def normalize_jid(value: str) -> str:
    """`hl:x` or a bare channel id `x` as `hl:x`. Raises ValueError for anything else."""
    jid = value if value.startswith("hl:") else f"hl:{value}"
    if not JID_RE.match(jid):
        raise ValueError(f"chat {value!r} is not a local chat: use hl:<id> with letters, "
                         "digits, '_', '.', '@' or '-'")
    return jid


def _card(raw: str | None) -> dict[str, Any] | None:
    """A transcript row's card ({choices, state, outcome?}); None for a plain row."""
    if not raw:
        return None
    try:
        card = json.loads(raw)
    except ValueError:
        return None
    return card if isinstance(card, dict) and isinstance(card.get("choices"), list) else None


def _error(status: int, message: str, **headers: str) -> web.Response:
    return json_error(status, message, **headers)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, headers=SECURITY_HEADERS)


async def _read_at_most(request: web.Request, limit: int) -> bytes | None:
    """The request's body, or None when it is longer than `limit` bytes (reading stops
    there: nothing more is held)."""
    buf = bytearray()
    while chunk := await request.content.read(64 * 1024):
        buf += chunk
        if len(buf) > limit:
            return None
    return bytes(buf)


def upload_file_name(raw: str) -> str:
    """The name an upload gives its file, as safe text whatever bytes the client sent: bytes
    that are not UTF-8 (aiohttp keeps them as surrogates) become U+FFFD, a path its last
    part, control and format characters (NUL, an RTL override...) "_", and it is at most
    MAX_FIELD characters. May be empty: the inbox then names the file itself (the saved
    name is made safe once more, mdclaw.media.safe_name)."""
    text = raw.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    text = unicodedata.normalize("NFC", text).replace("\\", "/").rsplit("/", 1)[-1]
    text = "".join("_" if unicodedata.category(c)[0] == "C" else c for c in text)
    return text.strip()[:MAX_FIELD]


def upload_mime(raw: str | None) -> str | None:
    """A part's Content-Type as `type/subtype` (parameters dropped), or None when it is not
    one."""
    mime = (raw or "").split(";", 1)[0].strip().lower()
    return mime if MIME_RE.match(mime) else None


@dataclass(frozen=True)
class Row:
    """A transcript row to write (HttpChannel._write)."""

    content: str
    sender: str
    sender_name: str
    file_name: str | None = None
    reply_to: str | None = None
    message_id: str | None = None
    card: str | None = None


class HttpChannel(Channel):
    """The local HTTP channel: serves `hl:` chats on the daemon's web server `server`, adding
    its routes now (before the server starts); they answer while the channel is connected."""

    name = "http"
    jid_prefix = "hl:"
    max_message_length = 32_000
    buttons = True
    writes_locally = True

    def __init__(self, db: Database, server: WebServer, *,
                 on_inbound: InboundCallback | None = None, assistant_name: str = "Andy",
                 max_body_bytes: int = 64 * 1024, keep_per_chat: int = 1000,
                 max_upload_bytes: int = 20 * 1024 * 1024,
                 files_dir: Path | None = None, push: WebPush | None = None) -> None:
        super().__init__(on_inbound)
        self.db = db
        self.server = server
        # The server's token as a door, shared with the operator page and /metrics.
        self.gate = server.gate
        self.assistant_name = assistant_name
        self.max_body_bytes = max_body_bytes
        self.keep_per_chat = keep_per_chat
        # Per chat, the seqs of its kept rows, oldest first: learned from the table once a
        # chat, then kept in step with each row written, so a new row drops the oldest by a
        # seek of its seq instead of a walk of the chat's keep_per_chat newest rows (three
        # walks a message, each direction). With the message ids of the kept files the
        # assistant sent, by seq (their copies go with their rows).
        self._kept: dict[str, collections.deque[int]] = {}
        self._kept_files: dict[int, str] = {}
        self.max_upload_bytes = max_upload_bytes
        # Where copies of files the assistant sends are kept for the page (None: not kept,
        # the transcript names them only).
        self.files_dir = files_dir
        self._connected = False
        self._closing = False
        self._new = asyncio.Event()
        self._typing: dict[str, float] = {}
        # Web Push of replies to chats no page has open (None: off).
        self.push = push
        self._watchers: dict[str, int] = {}
        self._last_watched: dict[str, float] = {}
        self.watch_grace = WATCH_GRACE_SECONDS
        # Wakes the outbox worker after a person retries a failed reply (set by the daemon).
        self.wake_outbox: Callable[[], None] | None = None
        self._page = PageAssets("mdclaw.channels", PAGE_FILES, headers=SECURITY_HEADERS,
                                page_csp=PAGE_CSP)
        for name in self._page.routes:
            server.add_route("GET", f"/{name}", self._serving(self._page_handler))
        server.add_route("GET", "/health", self._health)
        for method, path, handler in (
                ("GET", "/groups", self._groups), ("POST", "/message", self._post_message),
                ("POST", "/card", self._press),
                ("POST", "/upload", self._upload), ("GET", "/file", self._get_file),
                ("GET", "/messages", self._get_messages), ("POST", "/retry", self._retry),
                ("GET", "/push/key", self._push_key),
                ("POST", "/push/subscribe", self._push_subscribe),
                ("POST", "/push/unsubscribe", self._push_unsubscribe)):
            server.add_route(method, path, self._serving(self._private(handler)))

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def has_secret(self) -> bool:
        """True when the web server has a bearer token (server.secret_file, or generated)."""
        return self.gate.has_secret

    # ------------------------------------------------------------------ access
    def _serving(self, handler: Handler) -> Handler:
        """`handler` while the channel is connected; 503 before it connects and after."""
        async def serve(request: web.Request) -> web.StreamResponse:
            if not self._connected:
                return _error(503, "the local HTTP channel is not running")
            return await handler(request)
        return serve

    def _private(self, handler: Handler) -> Handler:
        """`handler` behind the bearer token, when the server has one."""
        async def guarded(request: web.Request) -> web.StreamResponse:
            if self.gate.has_secret:
                refused = self.gate.bearer_refusal(request)
                if refused is not None:
                    return refused
            return await handler(request)
        return guarded

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> None:
        """Answer on the web server, which must be listening already."""
        if not self.server.running:
            raise ChannelError(f"the web server does not listen on {self.server.host}:"
                               f"{self.server.port} (server.listen), so the local HTTP chat "
                               "cannot answer")
        self._closing = False
        self._connected = True
        if not is_loopback(self.server.host) and not self.gate.has_secret:
            log.warning("local HTTP channel listens on %s without a secret_file: anyone who "
                        "can reach it can write to the assistant", self.server.host)
        log.info("local HTTP channel answering on %s", self.url)

    async def disconnect(self) -> None:
        self._connected = False
        self._closing = True
        self._notify()

    def is_connected(self) -> bool:
        return self._connected

    # ------------------------------------------------------------------ outbound
    async def send_message(self, jid: str, text: str, *, reply_to: str | None = None,
                           sender: str | None = None) -> str | None:
        self._check_jid(jid)
        with self.db.transaction() as c:
            _, mids, after = self._write_texts(c, jid, [LocalText(text, reply_to, sender)])
        after()
        return mids[0]

    def write_texts(self, conn: sqlite3.Connection, jid: str,
                    texts: Sequence[LocalText]) -> Callable[[], None]:
        """The replies' transcript rows, in the caller's transaction (the outbox's, with
        the messages' `sent` marks): see Channel.write_texts."""
        self._check_jid(jid)
        return self._write_texts(conn, jid, texts)[2]

    def _write_texts(self, conn: sqlite3.Connection, jid: str, texts: Sequence[LocalText]
                     ) -> tuple[list[int], list[str], Callable[[], None]]:
        seqs, mids, kept = self._write(conn, jid, "out", "text", [
            Row(content=t.text, sender="assistant",
                sender_name=t.sender or self.assistant_name, reply_to=t.reply_to)
            for t in texts])

        def after() -> None:
            kept()
            self._typing.pop(jid, None)
            for t in texts:
                self._announce(jid, t.text)
        return seqs, mids, after

    async def send_file(self, jid: str, path: Path, *, file_name: str | None = None,
                        caption: str | None = None) -> str | None:
        self._check_jid(jid)
        if not await asyncio.to_thread(Path(path).is_file):
            raise ChannelError(f"file {Path(path).name!r} to send does not exist",
                               permanent=True)
        key = uuid.uuid4().hex
        if self.files_dir is not None:
            try:
                await asyncio.to_thread(self._keep_file, Path(path), key)
            except OSError as e:
                raise ChannelError(f"file {Path(path).name!r} could not be kept for the "
                                   f"chat page: {e.strerror or e}") from None
        mid = self._record(jid, "out", "file", content=caption or "", sender="assistant",
                           sender_name=self.assistant_name,
                           file_name=file_name or Path(path).name,
                           message_id=f"{jid}:{key}")[1]
        self._announce(jid, f"\U0001F4CE {file_name or Path(path).name}")
        return mid

    def _keep_file(self, src: Path, key: str) -> None:
        """Copy the host's spool file `src` to files_dir/<key> (temp name, then rename)."""
        assert self.files_dir is not None
        self.files_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.files_dir / f".{key}.tmp"
        try:
            shutil.copyfile(src, tmp)
            tmp.rename(self.files_dir / key)
        finally:
            tmp.unlink(missing_ok=True)

    def _drop_files(self, message_ids: list[str]) -> None:
        """Remove the kept copies of pruned file rows."""
        if self.files_dir is None:
            return
        for mid in message_ids:
            key = mid.rsplit(":", 1)[-1]
            if FILE_KEY_RE.match(key):
                try:
                    (self.files_dir / key).unlink(missing_ok=True)
                except OSError as e:
                    log.warning("local HTTP channel: cannot remove a kept file: %s", e)

    async def send_card(self, jid: str, card: Card) -> str | None:
        """The card as a transcript row with its choices (the page shows them as buttons);
        its text plain (the page shows it as text, never as Markdown)."""
        self._check_jid(jid)
        self._typing.pop(jid, None)
        state = {"choices": [{"label": c.label, "data": c.data} for c in card.choices],
                 "state": "open" if card.choices else "closed"}
        mid = self._record(jid, "out", "text", content=card.text, sender="mdclaw",
                           sender_name="mdclaw", card=json.dumps(state))[1]
        self._announce(jid, card.text)
        return mid

    async def edit_card(self, jid: str, message_id: str, card: Card) -> None:
        """Close the card `message_id` (its buttons go) and show the outcome after it."""
        self._check_jid(jid)
        with self.db.transaction() as c:
            c.execute("UPDATE http_messages SET card = ? WHERE chat_jid = ? AND message_id = ?"
                      " AND card IS NOT NULL", (json.dumps({"choices": [], "state": "closed",
                                                            "outcome": card.text}),
                                                jid, message_id))
        await self.send_card(jid, card)

    async def react(self, jid: str, message_id: str, emoji: str) -> None:
        self._check_jid(jid)
        self._record(jid, "out", "reaction", content=emoji, sender="assistant",
                     sender_name=self.assistant_name, reply_to=message_id)

    async def set_typing(self, jid: str, typing: bool) -> None:
        if not self.owns_jid(jid):
            return
        if typing:
            self._typing[jid] = time.monotonic() + TYPING_SECONDS
        else:
            self._typing.pop(jid, None)
        self._notify()

    # ------------------------------------------------------------------ push
    def is_watched(self, jid: str) -> bool:
        """Whether a page has chat `jid` open (a long poll under way, or just ended)."""
        if self._watchers.get(jid):
            return True
        last = self._last_watched.get(jid)
        return last is not None and time.monotonic() - last < self.watch_grace

    def _announce(self, jid: str, text: str) -> None:
        """Push a reply in `jid` to its subscribed devices when no page has it open."""
        if self.push is None or self.is_watched(jid):
            return
        g = get_group_by_jid(self.db, jid)
        self.push.announce(jid, g.name if g is not None else self.assistant_name, text)

    def is_typing(self, jid: str) -> bool:
        until = self._typing.get(jid)
        return until is not None and until > time.monotonic()

    # ------------------------------------------------------------------ transcript
    def _check_jid(self, jid: str) -> None:
        if not JID_RE.match(jid):
            raise ChannelError(f"{jid!r} is not a local HTTP chat", permanent=True)
        if not self._connected:
            raise ChannelError("the local HTTP channel is not running")

    def _notify(self) -> None:
        ev, self._new = self._new, asyncio.Event()
        ev.set()

    def _record(self, jid: str, direction: str, kind: str, *, content: str, sender: str,
                sender_name: str, file_name: str | None = None, reply_to: str | None = None,
                message_id: str | None = None, card: str | None = None) -> tuple[int, str]:
        """Append one transcript row in a transaction of its own; return (seq, message
        id)."""
        with self.db.transaction() as c:
            seqs, mids, kept = self._write(c, jid, direction, kind, [Row(
                content=content, sender=sender, sender_name=sender_name,
                file_name=file_name, reply_to=reply_to, message_id=message_id, card=card)])
        kept()
        return seqs[0], mids[0]

    def _write(self, c: sqlite3.Connection, jid: str, direction: str, kind: str,
               rows: Sequence[Row]) -> tuple[list[int], list[str], Callable[[], None]]:
        """Append transcript rows of one chat in the caller's transaction `c` (and cut the
        chat to its newest keep_per_chat rows); return (their seqs, their message ids, what
        to do once it has committed: the kept rows brought in step, the copies of the files
        cut dropped, the pages woken). The kept rows are learned before the transaction:
        one call a chat and transaction."""
        pruned: list[str] = []
        kept = self._kept.get(jid)
        fresh: list[tuple[int, str | None]] | None = None
        drop = 0
        out_file = kind == "file" and direction == "out"
        now = now_iso()
        seqs: list[int] = []
        mids: list[str] = []
        for r in rows:
            mid = r.message_id or f"{jid}:{uuid.uuid4().hex}"
            seqs.append(int(c.execute(
                """INSERT INTO http_messages (chat_jid, direction, kind, message_id, sender,
                       sender_name, content, file_name, reply_to, created_at, card)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                (jid, direction, kind, mid, r.sender, r.sender_name, r.content, r.file_name,
                 r.reply_to, now, r.card)).lastrowid or 0))
            mids.append(mid)
        if kept is not None:
            drop = len(kept) + len(rows) - self.keep_per_chat
            if drop > len(kept):  # more new rows than the chat keeps: learn them afresh
                kept = None
        if kept is None:
            # The chat's first rows this process writes (or more than it keeps): every row
            # past its newest keep_per_chat goes (the limit may have been lowered), and
            # those are kept.
            oldest_kept = """COALESCE((SELECT seq FROM http_messages WHERE chat_jid = ?
                                ORDER BY seq DESC LIMIT 1 OFFSET ?), -1)"""
            pruned = [r[0] for r in c.execute(
                f"""SELECT message_id FROM http_messages WHERE chat_jid = ? AND kind = 'file'
                       AND direction = 'out' AND seq <= {oldest_kept}""",  # noqa: S608 - constant
                (jid, jid, self.keep_per_chat))]
            c.execute(
                f"DELETE FROM http_messages WHERE chat_jid = ? AND seq <= {oldest_kept}",  # noqa: S608 - constant
                (jid, jid, self.keep_per_chat))
            fresh = [(int(r[0]), r[1]) for r in c.execute(
                "SELECT seq, CASE WHEN kind = 'file' AND direction = 'out' THEN message_id "
                "END FROM http_messages WHERE chat_jid = ? ORDER BY seq",
                (jid,))]
        elif drop > 0:
            c.execute("DELETE FROM http_messages WHERE chat_jid = ? AND seq <= ?",
                      (jid, kept[drop - 1]))
            pruned = [self._kept_files[kept[i]] for i in range(drop)
                      if kept[i] in self._kept_files]

        def committed() -> None:
            # The kept rows as the table now has them.
            if fresh is not None:
                old = self._kept.get(jid)
                for q in old or ():
                    self._kept_files.pop(q, None)
                self._kept[jid] = collections.deque(q for q, _ in fresh)
                self._kept_files.update((q, m) for q, m in fresh if m is not None)
            elif kept is not None:
                for _ in range(max(0, drop)):
                    self._kept_files.pop(kept.popleft(), None)
                kept.extend(seqs)
                if out_file:
                    self._kept_files.update(zip(seqs, mids, strict=True))
            if pruned:
                self._drop_files(pruned)
            self._notify()
        return seqs, mids, committed

    def transcript(self, jid: str, after: int = 0, limit: int = 200) -> list[dict[str, Any]]:
        """Transcript rows of `jid` with seq > `after`, oldest first (at most `limit`)."""
        rows = self.db.query(
            "SELECT * FROM http_messages WHERE chat_jid = ? AND seq > ? ORDER BY seq LIMIT ?",
            (jid, after, limit))
        return [self._row(r) for r in rows]

    def transcript_before(self, jid: str, before: int, limit: int = 50
                          ) -> tuple[list[dict[str, Any]], bool]:
        """The newest `limit` rows of `jid` with seq < `before`, oldest first, and whether
        older ones remain."""
        rows = self.db.query(
            "SELECT * FROM http_messages WHERE chat_jid = ? AND seq < ? ORDER BY seq DESC "
            "LIMIT ?", (jid, before, limit))
        rows = list(reversed(rows))
        older = bool(rows) and self.db.query_one(
            "SELECT 1 FROM http_messages WHERE chat_jid = ? AND seq < ? LIMIT 1",
            (jid, rows[0]["seq"])) is not None
        return [self._row(r) for r in rows], older

    def _row(self, r: Any) -> dict[str, Any]:
        # What the assistant wrote is Markdown: the page shows it as sanitised HTML
        # (mdclaw.markup.to_html); what people write stays text.
        card = _card(r["card"])
        html = (to_html(r["content"]) if r["direction"] == "out" and card is None
                and r["kind"] in ("text", "file") and r["content"] else None)
        return {"seq": r["seq"], "id": r["message_id"], "direction": r["direction"],
                "kind": r["kind"], "sender": r["sender"], "sender_name": r["sender_name"],
                "content": r["content"], "html": html, "file_name": r["file_name"],
                "reply_to": r["reply_to"], "timestamp": r["created_at"],
                "download": self._download_link(r), "card": card}

    def pending(self, jid: str) -> list[dict[str, Any]]:
        """The replies to `jid` the outbox has not delivered yet: `sending` (waiting, being
        sent or to be tried again) or `failed` (the outbox gave up: its reason in `error`;
        POST /retry tries it again). Reactions and cards are left out."""
        rows = self.db.query(PENDING_SQL, (jid, MAX_PENDING_SHOWN))
        # A reply waiting to go out is shown as it will be once delivered (its Markdown
        # rendered as _row renders it), not as raw text.
        return [{"id": r["id"], "kind": r["kind"], "text": r["text"] or "",
                 "html": to_html(r["text"]) if r["kind"] == "text" and r["text"] else None,
                 "file_name": r["file_name"],
                 "state": "failed" if r["status"] == "failed" else "sending",
                 "attempts": r["attempts"],
                 "error": r["last_error"] if r["status"] == "failed" else None,
                 "timestamp": r["created_at"]} for r in rows]

    @staticmethod
    def pending_mark(rows: list[dict[str, Any]]) -> str:
        """What the page passes back (`outbox=`) to hear of a change in `pending`."""
        return ",".join(f"{r['id']}{r['state'][0]}" for r in rows)

    def _download_link(self, row: Any) -> str | None:
        """The `/file` link of a file the assistant sent (None for any other row)."""
        if (row["kind"] != "file" or row["direction"] != "out" or self.files_dir is None
                or not FILE_KEY_RE.match(str(row["message_id"]).rsplit(":", 1)[-1])):
            return None
        return "/file?" + urlencode({"jid": row["chat_jid"], "id": row["message_id"]})

    # ------------------------------------------------------------------ HTTP
    async def _page_handler(self, request: web.Request) -> web.Response:
        return self._page.response(request.path[1:])

    async def _health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "channel": self.name, "connected": self._connected})

    async def _groups(self, request: web.Request) -> web.Response:
        # A group with several chats is listed by its web chat(s).
        groups = [{"jid": jid, "name": g.name, "folder": g.folder, "is_main": g.is_main,
                   "trigger": g.trigger, "requires_trigger": g.requires_trigger}
                  for g in list_groups(self.db) for jid in g.all_chats if self.owns_jid(jid)]
        groups.sort(key=lambda g: (not g["is_main"], g["folder"]))
        return _json({"groups": groups})

    def _default_jid(self) -> str | None:
        g = main_group(self.db)
        return next((c for c in g.all_chats if self.owns_jid(c)), None) if g else None

    def _jid_from(self, data: Any) -> str:
        """The chat named by `jid`/`chatJid`/`chat_jid` or `channel`, else the main group's."""
        for key in ("jid", "chatJid", "chat_jid", "channel"):
            value = data.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise ValueError(f"field {key!r} must be a string")
                return normalize_jid(value)
        jid = self._default_jid()
        if jid is None:
            raise ValueError("name the chat with 'jid' (hl:<id>) or 'channel': the main group "
                             "does not answer in the local HTTP channel")
        return jid

    async def _post_message(self, request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            return _error(413, f"body over {self.max_body_bytes} bytes")
        data = await self._json_body(request)
        if isinstance(data, web.Response):
            return data
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:  # "\ud800": JSON may spell it, no text holds it
            return _error(400, "body holds a lone surrogate escape (\\ud800-\\udfff), "
                               "which is not a character")
        text = data.get("text", data.get("content"))
        if not isinstance(text, str) or not text.strip():
            return _error(400, "field 'text' (or 'content') is missing or empty")
        fields: dict[str, str] = {}
        for key in ("sender", "sender_name"):
            value = data.get(key, data.get("senderName") if key == "sender_name" else None)
            if value is not None and (not isinstance(value, str) or len(value) > MAX_FIELD):
                return _error(400, f"field {key!r} must be a string of at most {MAX_FIELD} "
                                   "characters")
            if value:
                fields[key] = value
        try:
            jid = self._jid_from(data)
        except ValueError as e:
            return _error(400, str(e))
        if self._on_inbound is None:
            return _error(503, "mdclaw is starting and not taking messages yet")
        return await self._accept(jid, fields, text)

    async def _press(self, request: web.Request) -> web.Response:
        """A press of a card's button; the presser is the sender, as for a message."""
        data = await self._json_body(request)
        if isinstance(data, web.Response):
            return data
        fields: dict[str, str] = {}
        for key in ("id", "data", "sender", "sender_name"):
            value = data.get(key)
            if value is not None and (not isinstance(value, str) or len(value) > MAX_FIELD):
                return _error(400, f"field {key!r} must be a string of at most {MAX_FIELD} "
                                   "characters")
            if value:
                fields[key] = value
        if "id" not in fields or "data" not in fields:
            return _error(400, "fields 'id' (the card's message id) and 'data' are needed")
        try:
            jid = self._jid_from(data)
        except ValueError as e:
            return _error(400, str(e))
        row = self.db.query_one("SELECT card FROM http_messages WHERE chat_jid = ? AND "
                                "message_id = ? AND card IS NOT NULL", (jid, fields["id"]))
        card = _card(row["card"]) if row is not None else None
        if card is None or fields["data"] not in {c["data"] for c in card["choices"]}:
            return _error(404, "no such card, or no such choice on it")
        sender = fields.get("sender") or fields.get("sender_name") or "local"
        answer = await self.deliver_press(CardPress(
            channel=self.name, sender=sender, sender_name=fields.get("sender_name") or sender,
            chat_jid=jid, message_id=fields["id"], data=fields["data"]))
        return _json({"answer": answer})

    async def _get_messages(self, request: web.Request) -> web.Response:
        q = request.query
        raw_jid = q.get("jid") or q.get("channel")
        try:
            jid = normalize_jid(raw_jid) if raw_jid else self._default_jid()
        except ValueError as e:
            return _error(400, str(e))
        if jid is None:
            return _error(400, "query parameter 'jid' is missing")
        try:
            after = int(q.get("after") or 0)
            limit = max(1, min(int(q.get("limit") or 200), 1000))
            wait = max(0.0, min(float(q.get("wait") or 0), MAX_WAIT_SECONDS))
        except ValueError:
            return _error(400, "after and limit must be integers, wait a number of seconds")
        if q.get("before") is not None:  # "load older": no waiting
            try:
                before = int(q.get("before") or 0)
            except ValueError:
                return _error(400, "before must be an integer")
            rows, older = self.transcript_before(jid, before, limit)
            cursor = max((r["seq"] for r in rows), default=0)
            return _json({"jid": jid, "messages": rows, "cursor": cursor, "older": older,
                          "typing": self.is_typing(jid)})
        # typing=0/1: the typing state the caller shows; outbox=<mark>: the undelivered
        # replies it shows (pending_mark); a change of either ends a long poll early.
        seen_typing = q.get("typing")
        seen_outbox = q.get("outbox")
        deadline = time.monotonic() + wait
        self._watchers[jid] = self._watchers.get(jid, 0) + 1
        try:
            while True:
                changed = self._new
                rows = self.transcript(jid, after, limit)
                typing = self.is_typing(jid)
                pending = self.pending(jid)
                remaining = deadline - time.monotonic()
                gone = request.transport is None or request.transport.is_closing()
                if (rows or remaining <= 0 or self._closing or gone  # the page was closed
                        or (seen_typing is not None and typing != (seen_typing == "1"))
                        or (seen_outbox is not None
                            and seen_outbox != self.pending_mark(pending))):
                    break
                try:  # the outbox marks its rows without telling: look again now and then
                    await asyncio.wait_for(changed.wait(),
                                           min(remaining, OUTBOX_RECHECK_SECONDS))
                except TimeoutError:
                    pass
        finally:
            self._watchers[jid] -= 1
            self._last_watched[jid] = time.monotonic()
        cursor = rows[-1]["seq"] if rows else after
        return _json({"jid": jid, "messages": rows, "cursor": cursor, "typing": typing,
                      "outbox": pending, "outbox_mark": self.pending_mark(pending)})

    async def _json_body(self, request: web.Request) -> dict[str, Any] | web.Response:
        raw = await _read_at_most(request, self.max_body_bytes)
        if raw is None:
            return _error(413, f"body over {self.max_body_bytes} bytes")
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return _error(400, "body is not valid JSON")
        if not isinstance(data, dict):
            return _error(400, "body must be a JSON object")
        return data

    async def _retry(self, request: web.Request) -> web.Response:
        """A person retries a reply the outbox gave up on (`{"jid", "id": its outbox id}`):
        a fresh set of tries, due now, as `mdclaw outbox retry` does."""
        data = await self._json_body(request)
        if isinstance(data, web.Response):
            return data
        try:
            jid = self._jid_from(data)
        except ValueError as e:
            return _error(400, str(e))
        row_id = data.get("id")
        if not isinstance(row_id, int) or isinstance(row_id, bool):
            return _error(400, "field 'id' (the reply's outbox id) must be an integer")
        try:
            with self.db.transaction() as c:
                owner = c.execute("SELECT chat_jid FROM outbox WHERE id = ?",
                                  (row_id,)).fetchone()
                if owner is None or owner[0] != jid:
                    return _error(404, "no such reply in this chat")
                retry_failed(c, row_id)
        except OutboxError as e:
            return _error(409, str(e))
        if self.wake_outbox is not None:
            self.wake_outbox()
        self._notify()
        return _json({"id": row_id, "state": "sending"})

    async def _push_key(self, request: web.Request) -> web.Response:
        if self.push is None:
            return _error(404, "notifications are off (channels.http.push.enabled)")
        return _json({"key": await asyncio.to_thread(self.push.public_key)})

    async def _push_subscribe(self, request: web.Request) -> web.Response:
        """`{"jid", "subscription": PushSubscription.toJSON()}`: notify this device of
        replies in the chat while no page has it open."""
        got = await self._push_body(request)
        if isinstance(got, web.Response):
            return got
        push, data, jid = got
        sub = valid_subscription(data.get("subscription"))
        if sub is None:
            return _error(400, "field 'subscription' is not a push subscription (an https "
                               "endpoint and keys p256dh, auth)")
        await asyncio.to_thread(push.subscribe, jid, sub)
        return _json({"jid": jid, "subscribed": True})

    async def _push_body(self, request: web.Request
                         ) -> tuple[WebPush, dict[str, Any], str] | web.Response:
        """The push service, a push request's JSON body and the chat it names; or the answer
        refusing the request."""
        push = self.push
        if push is None:
            return _error(404, "notifications are off (channels.http.push.enabled)")
        data = await self._json_body(request)
        if isinstance(data, web.Response):
            return data
        try:
            return push, data, self._jid_from(data)
        except ValueError as e:
            return _error(400, str(e))

    async def _push_unsubscribe(self, request: web.Request) -> web.Response:
        got = await self._push_body(request)
        if isinstance(got, web.Response):
            return got
        push, data, jid = got
        endpoint = data.get("endpoint")
        if not isinstance(endpoint, str):
            return _error(400, "field 'endpoint' is missing")
        removed = await asyncio.to_thread(push.unsubscribe, jid, endpoint)
        return _json({"jid": jid, "subscribed": False, "removed": removed})

    async def _upload(self, request: web.Request) -> web.Response:
        limit = self.max_upload_bytes
        too_large = _error(413, f"file over {limit} bytes")
        if (request.content_length is not None
                and request.content_length > limit + self.max_body_bytes):
            return too_large
        if request.content_type != "multipart/form-data":
            return _error(400, "send the file as multipart/form-data with a 'file' field")
        fields: dict[str, str] = {}
        data: bytes | None = None
        file_name = mime = None
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    return _error(400, "nested multipart bodies are not taken")
                if part.name in ("file", None) and part.filename is None and "filename" in (
                        part.headers.get(hdrs.CONTENT_DISPOSITION, "").lower()):
                    # aiohttp drops a filename* it cannot decode (RFC 5987), or the whole
                    # header when it cannot parse it
                    return _error(400, "the file's name cannot be read: send it as "
                                       "filename=\"...\" or as filename*=UTF-8''<the name's "
                                       "UTF-8 bytes, percent-encoded>")
                if part.name == "file" and part.filename is not None:
                    if data is not None:
                        return _error(400, "send one file per upload")
                    buf = bytearray()
                    while chunk := await part.read_chunk(64 * 1024):
                        buf += chunk
                        if len(buf) > limit:  # stop reading: nothing more is held
                            return too_large
                    data, file_name = bytes(buf), upload_file_name(part.filename)
                    mime = upload_mime(part.headers.get(hdrs.CONTENT_TYPE))
                elif part.name in ("jid", "text", "sender", "sender_name", "voice"):
                    raw = bytearray()
                    while chunk := await part.read_chunk(8192):
                        raw += chunk
                        if len(raw) > self.max_body_bytes:
                            return _error(413, f"field {part.name!r} over "
                                               f"{self.max_body_bytes} bytes")
                    fields[part.name] = bytes(raw).decode("utf-8", errors="replace")
                else:
                    await part.release()
        except ValueError as e:
            return _error(400, f"malformed multipart body: {e}")
        except HttpProcessingError as e:
            # A part's head aiohttp refuses: a control character (NUL, CR...) in a header,
            # a header line over 8190 bytes (a 10 KB file name)...
            return _error(400, "malformed multipart body: a part's headers are not valid "
                               f"HTTP ({(e.message or type(e).__name__)[:200]!s}); send the "
                               "file name percent-encoded (filename*=UTF-8''...) and under "
                               "8 KB")
        if data is None or file_name is None:
            return _error(400, "field 'file' (a file) is missing")
        for key in ("sender", "sender_name"):
            if len(fields.get(key, "")) > MAX_FIELD:
                return _error(400, f"field {key!r} must be at most {MAX_FIELD} characters")
        try:
            jid = self._jid_from(fields)
        except ValueError as e:
            return _error(400, str(e))
        if self._on_inbound is None:
            return _error(503, "mdclaw is starting and not taking messages yet")
        caption = fields.get("text", "")
        mime = mime if mime and mime != "application/octet-stream" else (
            mimetypes.guess_type(file_name)[0] or mime)
        content = data

        async def fetch(max_bytes: int) -> bytes:
            if len(content) > max_bytes:
                raise ChannelError(f"it is {len(content)} bytes, over the {max_bytes} bytes "
                                   "a file may have here")
            return content

        return await self._accept(
            jid, fields, caption, file_name=file_name,
            # voice=1: a voice note recorded in the page, transcribed like any channel's
            attachment=Attachment(kind="voice" if fields.get("voice") == "1"
                                  and kind_for_mime(mime) == "audio" else kind_for_mime(mime),
                                  name=file_name or None, mime=mime,
                                  size=len(data), fetch=fetch, caption=caption or None))

    async def _accept(self, jid: str, fields: dict[str, str], text: str, *,
                      file_name: str | None = None,
                      attachment: Attachment | None = None) -> web.Response:
        """Record what a person posted (`text`, and the uploaded file) in the transcript
        and hand it to the host: 202 with its ids, or 500 (the row taken back) when the
        host did not take it."""
        sender = fields.get("sender") or fields.get("sender_name") or "local"
        sender_name = fields.get("sender_name") or sender
        request_id = uuid.uuid4().hex
        message_id = f"{jid}:{request_id}"
        seq, _ = self._record(jid, "in", "text" if attachment is None else "file",
                              content=text, sender=sender, sender_name=sender_name,
                              message_id=message_id,
                              file_name=file_name[:MAX_FIELD] if file_name else None)
        group = get_group_by_jid(self.db, jid)
        msg = InboundMessage(
            id=message_id, chat_jid=jid, sender=sender, sender_name=sender_name,
            content=text, timestamp=now_iso(),
            chat_name=group.name if group else jid[3:], is_group=False, channel=self.name,
            attachments=(attachment,) if attachment is not None else ())
        what = "message" if attachment is None else "file"
        try:
            await self.deliver_inbound(msg)
        except Exception:  # noqa: BLE001 - the host's callback: the sender is told to retry
            log.exception("local HTTP channel: the host did not take %s %s", what, message_id)
            with self.db.transaction() as c:
                c.execute("DELETE FROM http_messages WHERE seq = ?", (seq,))
            kept = self._kept.get(jid)
            if kept is not None and seq in kept:
                kept.remove(seq)
            return _error(500, f"the {what} could not be accepted; try again")
        body: dict[str, Any] = {"id": request_id, "message_id": message_id, "jid": jid,
                                "seq": seq, "status": "accepted"}
        if attachment is not None:
            body["size"] = attachment.size
        return _json(body, status=202)

    async def _get_file(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        try:
            jid = normalize_jid(q.get("jid") or "")
        except ValueError as e:
            return _error(400, str(e))
        mid = q.get("id") or ""
        key = mid.rsplit(":", 1)[-1]
        row = self.db.query_one(
            "SELECT file_name FROM http_messages WHERE chat_jid = ? AND message_id = ? "
            "AND kind = 'file' AND direction = 'out'", (jid, mid))
        if row is None or self.files_dir is None or not FILE_KEY_RE.match(key):
            return _error(404, "no such file in this chat")
        path = self.files_dir / key
        if not await asyncio.to_thread(path.is_file):
            return _error(404, "the file is no longer kept")
        name = row["file_name"] or "file"
        mime = mimetypes.guess_type(name)[0]
        inline = mime in INLINE_IMAGES
        disposition = "inline" if inline else "attachment"
        return web.FileResponse(path, headers={
            **SECURITY_HEADERS,
            "Content-Type": mime if inline and mime else "application/octet-stream",
            "Content-Disposition": f"{disposition}; filename*=UTF-8''{quote(name, safe='')}",
            "Content-Security-Policy": _FILE_CSP,
            "Cross-Origin-Resource-Policy": "same-origin",
            "Cache-Control": "private, no-store"})
