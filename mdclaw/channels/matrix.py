"""Matrix (`mx:<room id>`) as a bot account on the user's own homeserver, through matrix-nio.

Room ids are opaque: `!abc:example.org` in rooms before version 12, `!<hash>` without any
`:server` part from version 12 on (Synapse's default). Nothing here splits one on `:`; a
message id is `mx:<room id>:<event id>` and is taken apart by the chat's jid as a prefix.

Login: an access token from `access_token_file`, or the password from `password_file`, used
once: the token the homeserver gives is kept in `data_dir/matrix/session.json` (0600 in a
0700 folder) with its device id, and the password is used again only when the homeserver
stops accepting that token.

In: `/sync` long polls. The sync token (what was handed over to the host) is kept in the state
database (`router_state`, per account), written on a thread after every batch, in the order
asked, so a restart goes on after it; a crash before it was written means the batch comes
again and the host's dedupe by message id drops the copies (the channel's own notices, the
welcome and `!chatid`'s answer, keep the event they answer, so they are said once too). A
timeline the homeserver cut short (`limited`, many events since the last sync) is filled from
`/messages` back to the previous token, so nothing in between is skipped. The first start
takes no history. Text, emotes, images, files, audio, voice notes and videos become
InboundMessages (files as Attachments fetched from the content repository, authenticated,
streamed and capped); replies, threads, mentions of the bot (`m.mentions`, or its user id in
the text) and replies to its messages (`addressed`). Notices (`m.notice`, what other bots
send) are not handed on. `!chatid` (or `/chatid`) is answered with the room's jid.

Invites: from the people `invite_allowed` accepts (channels.matrix.allow_invites_from), joined;
from anyone else, ignored (the invite stays pending; nothing is said to a stranger).

End-to-end encryption is refused: a room that is (or becomes) encrypted is told so in a
plain notice and left; `mdclaw doctor` names a configured group's encrypted room with the
fix. (The host keeps every message in plain text in its database and hands it to the model,
so the bot would end the encryption anyway; an unverified bot device with a key store that
must never be lost would make messages silently unreadable instead.)

Out: the assistant's Markdown as `formatted_body` (org.matrix.custom.html, mdclaw.markup) with
the Markdown as the plain `body`, cut at 8000 characters without cutting a code block; an
answer goes to the thread the latest message of the room was written in (a reply to a message
in a thread stays in that thread); files through the content repository (`m.image`, `m.audio`,
`m.video`, `m.file`, captions as Matrix 1.10 has them); reactions (`m.reaction`); typing. The
homeserver's rate limit (`M_LIMIT_EXCEEDED`, `retry_after_ms`) becomes
ChannelError(retry_after), for the outbox to wait. A send whose outcome is unknown keeps its
transaction id (router_state), so the outbox's next try cannot post it twice. A failed sync is
tried again with the shared backoff; meanwhile `is_connected()` is False and the outbox keeps
messages.

The access token is never logged: it is masked wherever an error could show it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import logging
import mimetypes
import os
import re
import sqlite3
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

import aiohttp

from mdclaw.channels.base import (
    Attachment,
    Channel,
    ChannelError,
    InboundCallback,
    InboundMessage,
    SavedPosition,
    kind_for_mime,
    read_upload,
)
from mdclaw.config import EXTRAS, MissingExtra, read_secret
from mdclaw.markup import is_plain_html, split_message, to_matrix_html
from mdclaw.retry import Backoff
from mdclaw.retry import wait as backoff_wait
from mdclaw.state import Database, now_iso
from mdclaw.state.conversations import get_router_value, set_router_value, upsert_chat

log = logging.getLogger("mdclaw.channels.matrix")

SESSION_FILE = "session.json"
HTML_FORMAT = "org.matrix.custom.html"
ROOM_ID_RE = re.compile(r"^![\x21-\x7e]{1,255}\Z")  # opaque; no `:server` from version 12
EVENT_ID_RE = re.compile(r"^\$[\x21-\x7e]{1,255}\Z")
MAX_UPLOAD_DEFAULT = 50 * 1024 * 1024  # when the homeserver does not say its own
MAX_CAPTION = 4000
SYNC_TIMEOUT_MS = 30_000
TIMELINE_LIMIT = 50
GAP_MAX_EVENTS = 1000  # events fetched to fill one room's gap in one sync
TYPING_REPEAT_SECONDS = 20.0
TYPING_TIMEOUT_MS = 30_000
TYPING_MAX_SECONDS = 300.0
# A send of unknown outcome keeps its transaction id this long (homeserver's keep theirs for
# at least as long: Synapse 30 minutes in memory, a day in its database).
TXN_KEEP_SECONDS = 1800
REMEMBERED_EVENTS = 4096  # events of recent messages: sender and thread, for replies
MEDIA_KINDS = {"m.image": "image", "m.file": "document", "m.audio": "audio", "m.video": "video"}
PERMANENT_ERRORS = frozenset({"M_FORBIDDEN", "M_NOT_FOUND", "M_TOO_LARGE", "M_BAD_JSON",
                              "M_NOT_JSON", "M_INVALID_PARAM", "M_UNKNOWN", "M_INVALID_ROOM_STATE",
                              "M_GUEST_ACCESS_FORBIDDEN", "M_UNSUPPORTED_ROOM_VERSION"})
TOKEN_ERRORS = frozenset({"M_UNKNOWN_TOKEN", "M_MISSING_TOKEN"})
ENCRYPTED_NOTICE = (
    "This room is end-to-end encrypted, and {bot} does not take part in encrypted rooms "
    "(mdclaw keeps the messages it handles in plain text, so encryption would end here "
    "anyway). I am leaving it. Create a room with encryption off (it cannot be turned off "
    "later) and invite {bot} there.")
JOINED_NOTICE = ("Hello! This room is `{jid}`: to have the assistant answer here, register it "
                 "as a group (ask in the main chat, or put it as a group's `jid` in mdclaw's "
                 "config).")
# The sync filter: what the channel reads (the timeline with enough events to rarely need
# filling, the state it names senders and rooms by); no presence, no account data.
SYNC_FILTER: dict[str, Any] = {
    "presence": {"types": []},
    "account_data": {"types": []},
    "room": {
        "timeline": {"limit": TIMELINE_LIMIT},
        "state": {"lazy_load_members": True},
        "ephemeral": {"types": []},
        "account_data": {"types": []},
    },
}


# ---------------------------------------------------------------------- the login's file


def session_path(data_dir: Path) -> Path:
    """Where a password login keeps its access token: data_dir/matrix/session.json."""
    return Path(data_dir) / "matrix" / SESSION_FILE


def read_session(path: Path) -> dict[str, str] | None:
    """The stored login {homeserver, user_id, device_id, access_token}, or None."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not all(
            isinstance(data.get(k), str) and data.get(k)
            for k in ("user_id", "device_id", "access_token")):
        return None
    return {k: str(v) for k, v in data.items() if isinstance(v, str)}


def write_session(path: Path, data: dict[str, str]) -> None:
    """Store the login in `path` (0600 in a 0700 folder), atomically: a temp file written
    with mode 0600 from its creation, fsynced, renamed over the old one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, json.dumps(data).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


# ---------------------------------------------------------------------- matrix-nio


def nio_module() -> Any:
    """matrix-nio, imported on first use (an optional dependency)."""
    try:
        import nio
    except ImportError as e:
        missing = MissingExtra("channels.matrix", EXTRAS["matrix"], f"cannot be imported ({e})")
        raise ChannelError(missing.message, permanent=True) from None
    return nio


def _dict(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else an empty one (events are the sender's to shape)."""
    return value if isinstance(value, dict) else {}


def _stripped(event: Any) -> dict[str, Any]:
    """A nio event of an invite's state as its JSON (nio takes the content of a member
    event out of its source: it is put back)."""
    source = dict(event.source)
    if not isinstance(source.get("content"), dict) and isinstance(
            getattr(event, "content", None), dict):
        source["content"] = event.content
    return source


def _relation(content: dict[str, Any]) -> tuple[str | None, str | None]:
    """(thread root, event replied to) of a message's content. A thread's fallback reply
    (`is_falling_back`: what older clients show) is no reply."""
    rel = content.get("m.relates_to")
    if not isinstance(rel, dict):
        return None, None
    root = rel.get("event_id") if rel.get("rel_type") == "m.thread" else None
    reply = rel.get("m.in_reply_to")
    target = reply.get("event_id") if isinstance(reply, dict) else None
    if root is not None and rel.get("is_falling_back") is True:
        target = None
    return (root if isinstance(root, str) else None,
            target if isinstance(target, str) else None)


def _strip_reply_fallback(body: str) -> str:
    """A reply's body without the quote older clients put before it ("> <@a:b> text")."""
    lines = body.split("\n")
    if not lines or not lines[0].startswith("> <"):
        return body
    i = 0
    while i < len(lines) and lines[i].startswith(">"):
        i += 1
    if i < len(lines) and lines[i] == "":
        i += 1
    return "\n".join(lines[i:])


def _event_digest(etype: str, content: dict[str, Any]) -> str:
    """What identifies an event to send across tries: its type and content, without the
    content address of a file (each try uploads the file anew)."""
    same = {k: v for k, v in content.items() if k != "url"}
    text = json.dumps([etype, same], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _mxc_parts(mxc: str) -> tuple[str, str]:
    """(server name, media id) of an `mxc://server/media` URI. Raises a permanent
    ChannelError for anything else."""
    url = urlparse(mxc)
    media = url.path.lstrip("/")
    if url.scheme != "mxc" or not url.netloc or not media or "/" in media:
        raise ChannelError(f"{mxc[:100]!r} is not a content repository address",
                           permanent=True)
    return url.netloc, media


# ---------------------------------------------------------------------- the channel


class MatrixChannel(Channel):
    """A Matrix bot account. `client_factory(homeserver, user_id)` makes the nio client (the
    default: a real AsyncClient)."""

    name = "matrix"
    jid_prefix = "mx:"
    # An event may hold 64 KiB of JSON; the body and its HTML both count.
    max_message_length = 8000
    # Waits after a failed sync (and after a batch the host did not take): 1 s doubling to
    # 60 s, equal jitter (mdclaw.retry, as the Telegram poll).
    sync_backoff = Backoff(base=1.0, factor=2.0, cap=60.0)

    def __init__(self, homeserver: str, user_id: str, *, access_token: str | None = None,
                 password: str | None = None, session_file: Path | None = None,
                 device_name: str = "mdclaw",
                 invite_allowed: Callable[[str], bool] | None = None,
                 on_inbound: InboundCallback | None = None, trigger: str | None = None,
                 db: Database | None = None, sync_timeout_ms: int = SYNC_TIMEOUT_MS,
                 request_timeout: float = 30.0,
                 client_factory: Callable[[str, str], Any] | None = None) -> None:
        super().__init__(on_inbound)
        if (access_token is None) == (password is None):
            raise ChannelError("the Matrix channel needs an access token or a password")
        if password is not None and session_file is None:
            raise ChannelError("a Matrix password login needs a session file")
        self.homeserver = homeserver.rstrip("/")
        self.user_id = user_id
        self._access_token = access_token
        self._password = password
        self.session_file = session_file
        self.device_name = device_name
        self.invite_allowed = invite_allowed or (lambda _user: False)
        self.trigger = trigger
        self.db = db
        self.sync_timeout_ms = sync_timeout_ms
        self.request_timeout = request_timeout
        self.client_factory = client_factory
        self.client: Any = None
        self.device_id: str | None = None
        self._token: str | None = access_token  # the one in use (to mask, and for media)
        self._logged_in = False
        self._http: aiohttp.ClientSession | None = None
        self._syncer: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._running = False
        self._connected = False
        self._since: str | None = None
        self._saved_since = SavedPosition(db, lambda: self._since_key, channel="matrix",
                                          what="sync token")
        # event id -> (room id, sender, thread root): whose a message was and where it is
        self._events: OrderedDict[str, tuple[str, str, str | None]] = OrderedDict()
        # room id -> (thread root, latest event of the thread) or None: where the room's
        # latest message was written, so the answer goes there too.
        self._threads: dict[str, tuple[str, str] | None] = {}
        self._refused: set[str] = set()  # encrypted rooms told and left
        # room id -> {event digest: [transaction id, time]}: sends of unknown outcome
        self._pending_txns: dict[str, dict[str, list[Any]]] = {}
        self._typing: dict[str, asyncio.Task[None]] = {}
        self.max_upload = MAX_UPLOAD_DEFAULT
        self.syncs = 0  # successful syncs, for tests and the operator
        self.last_error: str | None = None

    @classmethod
    def from_config(cls, section: Any, data_dir: Path, *,
                    invite_allowed: Callable[[str], bool] | None = None,
                    on_inbound: InboundCallback | None = None, trigger: str | None = None,
                    db: Database | None = None) -> MatrixChannel:
        """Build from the `channels.matrix` section; reads the secret file now. Raises
        ChannelError naming the file (never its content) if it cannot be read."""
        key = "access_token_file" if section.access_token_file is not None else "password_file"
        path = getattr(section, key)
        try:
            secret = read_secret(path)
        except OSError as e:
            raise ChannelError(f"cannot read channels.matrix.{key} {path}: "
                               f"{e.strerror}") from None
        if not secret:
            raise ChannelError(f"channels.matrix.{key} {path} is empty")
        return cls(section.homeserver, section.user_id,
                   access_token=secret if key == "access_token_file" else None,
                   password=secret if key == "password_file" else None,
                   session_file=session_path(data_dir), device_name=section.device_name,
                   invite_allowed=invite_allowed, on_inbound=on_inbound, trigger=trigger,
                   db=db)

    # ------------------------------------------------------------------ helpers
    def redact(self, text: str) -> str:
        for secret in (self._token, self._access_token, self._password):
            if secret:
                text = text.replace(secret, "***")
        return text

    def _jid(self, room_id: str) -> str:
        return f"{self.jid_prefix}{room_id}"

    def _room_id(self, jid: str) -> str:
        room = jid[len(self.jid_prefix):] if jid.startswith(self.jid_prefix) else ""
        if not ROOM_ID_RE.match(room):
            raise ChannelError(f"{jid!r} is not a Matrix room", permanent=True)
        return room

    def _event_id(self, jid: str, message_id: str) -> str:
        """Our `mx:<room>:<event>` as the event id (the jid is the prefix: a room id may
        hold `:` or not, so it is never split)."""
        prefix = f"{jid}:"
        event = message_id[len(prefix):] if message_id.startswith(prefix) else ""
        if not EVENT_ID_RE.match(event):
            raise ChannelError(f"message id {message_id!r} is not a message of {jid}",
                               permanent=True)
        return event

    def _remember(self, event_id: str, room_id: str, sender: str, root: str | None) -> None:
        self._events[event_id] = (room_id, sender, root)
        self._events.move_to_end(event_id)
        while len(self._events) > REMEMBERED_EVENTS:
            self._events.popitem(last=False)

    @property
    def _since_key(self) -> str:
        return f"matrix_since:{self.user_id}"

    def _thread_key(self, room_id: str) -> str:
        return f"matrix_thread:{self.user_id}:{room_id}"

    def status_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"connected": self.is_connected(), "account": self.user_id,
                                "homeserver": self.homeserver}
        if self.device_id:
            info["device"] = self.device_id
        if self.last_error and not self.is_connected():
            info["error"] = self.last_error
        return info

    # ------------------------------------------------------------------ calls
    def _new_client(self) -> Any:
        if self.client_factory is not None:
            return self.client_factory(self.homeserver, self.user_id)
        nio = nio_module()
        # No retries inside nio: a rate limit goes back to the outbox with its wait, a
        # network error to the syncer's backoff.
        config = nio.AsyncClientConfig(max_limit_exceeded=0, max_timeouts=0,
                                       request_timeout=self.request_timeout,
                                       store_sync_tokens=False, encryption_enabled=False)
        return nio.AsyncClient(self.homeserver, self.user_id, config=config)

    async def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run the nio call `fn()`; its answer, or ChannelError (token-free) for an error
        answer or a network failure."""
        try:
            resp = await fn()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self._connected = False
            self.last_error = self.redact(f"matrix {what}: {type(e).__name__}: {e}")
            raise ChannelError(self.last_error) from None
        except ChannelError:
            raise
        except Exception as e:  # noqa: BLE001 - nio's own errors (a body it cannot read...)
            raise ChannelError(self.redact(f"matrix {what}: {type(e).__name__}: {e}")
                               ) from None
        nio = nio_module()
        if isinstance(resp, nio.ErrorResponse):
            raise self._error(what, resp)
        return resp

    def _error(self, what: str, resp: Any) -> ChannelError:
        code = resp.status_code if isinstance(resp.status_code, str) else None
        transport = getattr(resp, "transport_response", None)
        status = getattr(transport, "status", None)
        text = self.redact(f"matrix {what}: {code or status or ''} {resp.message or ''}".strip())
        if code == "M_LIMIT_EXCEEDED" or status == 429:
            wait = (resp.retry_after_ms or 5000) / 1000
            return ChannelError(f"{text} (rate limited: retry in {wait:g} s)",
                                retry_after=wait, code=429)
        if code in TOKEN_ERRORS or status == 401:
            # Retryable: a password login gets a new token; a fixed token file lets the
            # backlog through after a restart.
            self._logged_in = False
            self._connected = False
            fix = ("put a new one into channels.matrix.access_token_file"
                   if self._access_token is not None
                   else "logging in again with channels.matrix.password_file")
            return ChannelError(f"{text}; the homeserver no longer accepts the bot's access "
                                f"token ({fix})", code=401)
        permanent = code in PERMANENT_ERRORS or status in (400, 403, 404, 413)
        return ChannelError(text, permanent=permanent,
                            code=status if isinstance(status, int) else None)

    # ------------------------------------------------------------------ login
    async def _login(self) -> None:
        """Log in (or take up the stored login) and learn the device. Raises ChannelError:
        code 401/403 when the homeserver refuses the credentials."""
        client = self.client
        nio = nio_module()
        if self._access_token is not None:
            client.restore_login(self.user_id, "", self._access_token)
            self._token = self._access_token
            await self._whoami()
            return
        stored = await asyncio.to_thread(read_session, self.session_file) \
            if self.session_file else None
        if stored and stored.get("user_id") == self.user_id and \
                stored.get("homeserver", self.homeserver) == self.homeserver:
            client.restore_login(self.user_id, stored["device_id"], stored["access_token"])
            self._token = stored["access_token"]
            try:
                await self._whoami()
                return
            except ChannelError as e:
                if e.code != 401:
                    raise
                log.warning("matrix: the stored access token is no longer accepted; logging "
                            "in again with channels.matrix.password_file")
        # The same device again (its sessions list stays clean); a new one the first time.
        client.device_id = stored.get("device_id", "") if stored else ""
        client.access_token = ""
        try:
            resp = await client.login(self._password, device_name=self.device_name)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self._connected = False
            self.last_error = self.redact(f"matrix login: {type(e).__name__}: {e}")
            raise ChannelError(self.last_error) from None
        if isinstance(resp, nio.ErrorResponse):
            code = resp.status_code
            if code in ("M_FORBIDDEN", "M_USER_DEACTIVATED", "M_INVALID_USERNAME"):
                raise ChannelError(
                    self.redact(f"the homeserver refused the password of {self.user_id} "
                                f"({code}: {resp.message}); check channels.matrix."
                                "password_file and channels.matrix.user_id"), code=403)
            raise self._error("login", resp)
        self._token = resp.access_token
        self.device_id = resp.device_id
        if self.session_file is not None:
            await asyncio.to_thread(write_session, self.session_file, {
                "homeserver": self.homeserver, "user_id": resp.user_id,
                "device_id": resp.device_id, "access_token": resp.access_token})
        self._logged_in = True
        log.info("matrix: logged in as %s (device %s); the access token is kept in %s",
                 resp.user_id, resp.device_id, self.session_file)

    async def _whoami(self) -> None:
        resp = await self._call("whoami", self.client.whoami)
        if resp.user_id != self.user_id:
            raise ChannelError(f"the access token is {resp.user_id}'s, not "
                               f"{self.user_id}'s: check channels.matrix.user_id", code=403)
        self.device_id = resp.device_id or self.device_id
        self._logged_in = True

    async def _media_limit(self) -> None:
        """The largest upload the homeserver takes (its media config), if it says."""
        for path in ("/_matrix/client/v1/media/config", "/_matrix/media/v3/config"):
            try:
                body = await self._media_get(path)
            except ChannelError:
                continue
            size = body.get("m.upload.size") if isinstance(body, dict) else None
            if isinstance(size, int) and size > 0:
                self.max_upload = size
            return

    async def _media_get(self, path: str) -> Any:
        if self._http is None:
            raise ChannelError("the Matrix channel is not connected")
        try:
            async with self._http.get(f"{self.homeserver}{path}", headers=self._auth(),
                                      timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status != 200:
                    raise ChannelError(f"matrix {path}: HTTP {r.status}", code=r.status)
                return await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise ChannelError(self.redact(f"matrix {path}: {type(e).__name__}")) from None

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> None:
        """Log in, then start syncing.

        Raises ChannelError if the homeserver refuses the credentials. When it cannot be
        reached the channel starts anyway, not connected, and logs in and syncs as soon as
        it answers (sends wait in the outbox meanwhile)."""
        if self._syncer is not None:
            return
        if self.client_factory is None:
            nio_module()  # without it: a ChannelError with the fix
        self.client = self._new_client()
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self._running = True
        self._stop.clear()
        await self._load_since()
        try:
            await self._login()
            await self._media_limit()
            log.info("matrix: connected as %s (device %s)", self.user_id, self.device_id)
        except ChannelError as e:
            # Credentials refused (a password, a token file's token, a token of another
            # account): the channel does not start. Anything else (the homeserver is not
            # reachable): it keeps trying.
            rejected = e.code == 403 or (e.code == 401 and self._access_token is not None)
            if rejected:
                await self._close()
                fix = ("channels.matrix.access_token_file" if self._access_token is not None
                       else "channels.matrix.password_file")
                raise ChannelError(str(e) if fix in str(e) else f"{e}; check {fix}",
                                   code=e.code) from None
            log.warning("%s; will keep trying", e)
        self._syncer = asyncio.create_task(self._sync_loop(), name="matrix-sync")

    async def _close(self) -> None:
        self._running = self._connected = False
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
        http, self._http = self._http, None
        if http is not None:
            await http.close()

    async def disconnect(self) -> None:
        """Stop syncing and typing, close the connections, keep the sync token."""
        self._running = False
        self._connected = False
        self._stop.set()
        tasks = [t for t in (self._syncer, *self._typing.values()) if t is not None]
        self._syncer = None
        self._typing.clear()
        for t in tasks:
            t.cancel()
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await self._close()
            await self._save_since()
        for t, r in zip(tasks, results, strict=True):
            if isinstance(r, Exception):
                log.warning("matrix: %s had ended with an error: %s", t.get_name(),
                            self.redact(f"{type(r).__name__}: {r}"))

    def is_connected(self) -> bool:
        return self._connected and self._logged_in and self.client is not None

    # ------------------------------------------------------------------ the sync token
    async def _load_since(self) -> None:
        if self._since is not None:
            return
        value = await self._saved_since.load()
        if value and self._since is None:
            self._since = value

    async def _save_since(self) -> None:
        """Write the sync token to the database on a thread (never on the loop)."""
        if self._since is not None:
            await self._saved_since.save(self._since)

    # ------------------------------------------------------------------ inbound
    async def _sync_loop(self) -> None:
        failures = 0  # syncs (or logins) failed in a row
        refused = 0  # batches in a row the host did not take
        while self._running:
            try:
                if not self._logged_in:
                    await self._login()
                    await self._media_limit()
                # The first sync of a start, and the first after a failure, do not wait:
                # what came meanwhile is read at once, and the channel is up (the outbox
                # sends) as soon as the homeserver answers.
                timeout = self.sync_timeout_ms if self.syncs and not failures else 0
                resp = await self._call("sync", partial(
                    self.client.sync, timeout=timeout, sync_filter=SYNC_FILTER,
                    since=self._since, full_state=False))
            except ChannelError as e:
                failures += 1
                self.last_error = str(e)
                wait = max(self.sync_backoff.delay(failures), e.retry_after or 0.0)
                log.warning("%s; trying again in %.0f s", e, wait)
                if await backoff_wait(wait, self._stop):
                    return
                continue
            if failures:
                log.info("matrix: the homeserver answers again")
            failures = 0
            self._connected = True
            self.last_error = None
            try:
                await self._handle_sync(resp)
            except Exception as e:  # noqa: BLE001 - the host's callback or a call of ours
                # Not confirmed: the same batch comes again (the host drops what it has)
                # after a pause that grows while it keeps failing.
                refused += 1
                if isinstance(e, ChannelError):
                    log.warning("matrix: a batch was not handled (%s); it comes again", e)
                else:
                    log.exception("matrix: the host did not take a batch; it comes again")
                if await backoff_wait(self.sync_backoff.delay(refused), self._stop):
                    return
                continue
            refused = 0
            self.syncs += 1
            self._since = resp.next_batch
            await self._save_since()

    async def _handle_sync(self, resp: Any) -> None:
        first = self._since is None  # no history on the very first start
        for room_id, info in resp.rooms.invite.items():
            await self._invited(room_id, [_stripped(e) for e in info.invite_state
                                          if isinstance(getattr(e, "source", None), dict)])
        for room_id, info in resp.rooms.join.items():
            if not ROOM_ID_RE.match(room_id):
                continue
            room = self.client.rooms.get(room_id)
            if room is not None and room.encrypted:
                await self._refuse_encrypted(room_id)
                continue
            if first:
                continue
            events = [e.source for e in info.timeline.events
                      if isinstance(getattr(e, "source", None), dict)]
            joined = self._joined_in(events)
            if joined is not None:
                # Said here rather than when joining: a stop between the two means this
                # batch comes again, so the room is told all the same (once: _welcome).
                await self._welcome(room_id, room, joined)
            if info.timeline.limited and info.timeline.prev_batch and self._since and \
                    joined is None:
                events = await self._gap(room_id, info.timeline.prev_batch,
                                         self._since) + events
            for ev in events:
                if await self._event(room_id, ev):
                    break  # the room is refused: the rest is not read

    def _joined_in(self, events: list[dict[str, Any]]) -> str | None:
        """The event id of the bot's join if it joined the room within `events` (what came
        before is not for it: no gap to fill), else None. A change of its own name or avatar
        (a join after a join) is no join."""
        for e in events:
            content = _dict(e.get("content"))
            before = _dict(_dict(e.get("unsigned")).get("prev_content")).get("membership")
            if e.get("type") == "m.room.member" and e.get("state_key") == self.user_id and \
                    content.get("membership") == "join" and before != "join":
                event_id = e.get("event_id")
                return event_id if isinstance(event_id, str) else ""
        return None

    async def _gap(self, room_id: str, prev_batch: str, since: str) -> list[dict[str, Any]]:
        """The events of `room_id` between the previous sync (`since`) and the timeline this
        one gave (`prev_batch`), oldest first."""
        nio = nio_module()
        got: list[dict[str, Any]] = []
        start = prev_batch
        while len(got) < GAP_MAX_EVENTS:
            resp = await self._call("messages", partial(
                self.client.room_messages, room_id, start=start, end=since,
                direction=nio.MessageDirection.back, limit=100))
            chunk = [e.source for e in resp.chunk
                     if isinstance(getattr(e, "source", None), dict)]
            got.extend(chunk)
            if not chunk or not resp.end or resp.end == start:
                break
            start = resp.end
        if len(got) >= GAP_MAX_EVENTS:
            log.warning("matrix: more than %d events in %s since the last sync; the oldest "
                        "are not read", GAP_MAX_EVENTS, room_id)
        got.reverse()
        log.info("matrix: %d earlier event(s) of %s read to fill a gap", len(got), room_id)
        return got

    async def _event(self, room_id: str, ev: dict[str, Any]) -> bool:
        """Handle one timeline event; True when the room was refused (encrypted)."""
        etype, sender, event_id = ev.get("type"), ev.get("sender"), ev.get("event_id")
        if etype in ("m.room.encryption", "m.room.encrypted") and sender != self.user_id:
            await self._refuse_encrypted(room_id)
            return True
        if etype != "m.room.message" or not isinstance(sender, str) or \
                not isinstance(event_id, str):
            return False
        content = ev.get("content")
        if not isinstance(content, dict):
            return False
        root, _ = _relation(content)
        self._remember(event_id, room_id, sender, root)
        if sender == self.user_id:
            return False
        if await self._answer_chatid(room_id, event_id, content):
            return False
        msg = await self.parse_event(room_id, ev)
        if msg is None:
            return False
        await self._note_thread(room_id, (root, event_id) if root else None)
        await self.deliver_inbound(msg)
        return False

    async def _note_thread(self, room_id: str, where: tuple[str, str] | None) -> None:
        """Remember (in memory and in the database) where the room's latest message was
        written: the next answer goes there."""
        if room_id in self._threads and self._threads[room_id] == where:
            return
        self._threads[room_id] = where
        if self.db is not None:
            value = json.dumps(list(where)) if where else None
            try:
                await asyncio.to_thread(set_router_value, self.db, self._thread_key(room_id),
                                        value)
            except sqlite3.Error as e:
                log.warning("matrix: could not save the thread of %s: %s", room_id, e)

    async def _thread_now(self, room_id: str) -> tuple[str, str] | None:
        if room_id not in self._threads and self.db is not None:
            try:
                value = await asyncio.to_thread(get_router_value, self.db,
                                                self._thread_key(room_id))
            except sqlite3.Error:
                value = None
            where = None
            with contextlib.suppress(ValueError, TypeError):
                pair = json.loads(value) if value else None
                if isinstance(pair, list) and len(pair) == 2 and all(
                        isinstance(x, str) for x in pair):
                    where = (pair[0], pair[1])
            self._threads.setdefault(room_id, where)
        return self._threads.get(room_id)

    async def _answer_chatid(self, room_id: str, event_id: str,
                             content: dict[str, Any]) -> bool:
        """Answer `!chatid` (or `/chatid`) with the room's jid; it is not passed on."""
        body = content.get("body")
        if content.get("msgtype") != "m.text" or not isinstance(body, str) or \
                body.strip().lower() not in ("!chatid", "/chatid"):
            return False
        jid = self._jid(room_id)
        await self._say_once(f"matrix_chatid:{self.user_id}:{room_id}", event_id, jid,
                             f"This chat is `{jid}`", reply_to=f"{jid}:{event_id}")
        return True

    async def _say_once(self, key: str, event_id: str, jid: str, text: str, *,
                        reply_to: str | None = None) -> None:
        """The channel's own answer to the event `event_id`, queued once: the event id is
        kept under `key` (router_state) once the answer is queued, so a batch that comes
        again after a stop (its sync token not yet kept) does not say it twice."""
        if self.db is not None and event_id and await asyncio.to_thread(
                get_router_value, self.db, key) == event_id:
            return
        await self.service_reply(jid, text, reply_to=reply_to)
        if self.db is not None and event_id:
            await asyncio.to_thread(set_router_value, self.db, key, event_id)

    async def _about(self, room_id: str, event_id: str) -> tuple[str, str | None] | None:
        """(sender, thread root) of an event of `room_id`: remembered, else asked."""
        known = self._events.get(event_id)
        if known is not None:
            return known[1], known[2]
        try:
            resp = await self._call("event", lambda: self.client.room_get_event(room_id,
                                                                                  event_id))
        except ChannelError as e:
            log.debug("%s", e)
            return None
        source = _dict(getattr(resp.event, "source", None))
        sender = source.get("sender")
        content = _dict(source.get("content"))
        if not isinstance(sender, str):
            return None
        root, _ = _relation(content)
        self._remember(event_id, room_id, sender, root)
        return sender, root

    async def parse_event(self, room_id: str, ev: dict[str, Any]) -> InboundMessage | None:
        """An `m.room.message` event of a person as an InboundMessage; None for notices and
        what holds neither text nor a file."""
        content = ev["content"]
        msgtype = content.get("msgtype")
        body = content.get("body") if isinstance(content.get("body"), str) else ""
        if "m.new_content" in content:
            return None  # an edit: the host keeps what was first written
        sender: str = ev["sender"]
        room = self.client.rooms.get(room_id) if self.client is not None else None
        name = (room.user_name(sender) if room is not None else None) or \
            sender[1:].split(":", 1)[0]
        root, reply_target = _relation(content)
        attachments: tuple[Attachment, ...] = ()
        if msgtype == "m.notice":
            return None  # what bots send: never answered (the spec asks it)
        if isinstance(msgtype, str) and msgtype in MEDIA_KINDS:
            attachment = self._attachment(msgtype, content)
            if attachment is None:
                return None
            attachments = (attachment,)
            text = attachment.caption or ""
        elif msgtype == "m.emote":
            text = f"* {name} {body}"
        elif body:  # m.text, and the text of types this does not know
            text = _strip_reply_fallback(body) if reply_target else body
        else:
            return None
        addressed = await self._addresses_bot(room_id, content, text, root, reply_target)
        if addressed and self.trigger and not re.search(
                rf"(?<!\w){re.escape(self.trigger)}(?!\w)", text, re.IGNORECASE):
            text = f"{self.trigger} {text}"
        ts = ev.get("origin_server_ts")
        timestamp = (now_iso(datetime.fromtimestamp(ts / 1000, UTC))
                     if isinstance(ts, int) and ts > 0 else now_iso())
        jid = self._jid(room_id)
        members = room.member_count if room is not None else 0
        chat_name = (room.name or room.canonical_alias) if room is not None else None
        return InboundMessage(
            id=f"{jid}:{ev['event_id']}", chat_jid=jid, sender=sender, sender_name=name,
            content=text, timestamp=timestamp, chat_name=chat_name, is_group=members > 2,
            channel=self.name, addressed=addressed, attachments=attachments,
            reply_to=f"{jid}:{reply_target}" if reply_target else None)

    async def _addresses_bot(self, room_id: str, content: dict[str, Any], text: str,
                             root: str | None, reply_target: str | None) -> bool:
        """True if the message mentions the bot, or replies to (or continues the thread of)
        one of its messages."""
        mentions = content.get("m.mentions")
        if isinstance(mentions, dict) and self.user_id in (mentions.get("user_ids") or []):
            return True
        html = content.get("formatted_body")
        if self.user_id in text or (isinstance(html, str) and (
                f"matrix.to/#/{self.user_id}" in html
                or f"matrix.to/#/{quote(self.user_id)}" in html)):
            return True
        for target in (reply_target, root):
            if target:
                about = await self._about(room_id, target)
                if about is not None and about[0] == self.user_id:
                    return True
        return False

    def _attachment(self, msgtype: str, content: dict[str, Any]) -> Attachment | None:
        url = content.get("url")
        if not isinstance(url, str):
            return None  # an encrypted file (`file`): not in the rooms the bot is in
        info = _dict(content.get("info"))
        body = content.get("body") if isinstance(content.get("body"), str) else None
        filename = content.get("filename") if isinstance(content.get("filename"), str) else None
        # Matrix 1.10: with a `filename`, a different `body` is the caption.
        caption = body if filename and body and body != filename else None
        name = filename or body
        mime = info.get("mimetype") if isinstance(info.get("mimetype"), str) else None
        size = info.get("size") if isinstance(info.get("size"), int) else None
        kind = MEDIA_KINDS[msgtype]
        if kind == "audio" and ("org.matrix.msc3245.voice" in content or "m.voice" in content):
            kind = "voice"

        async def fetch(limit: int) -> bytes:
            return await self.download(url, limit)

        return Attachment(kind=kind, name=name, mime=mime, size=size, fetch=fetch,
                          caption=caption)

    async def download(self, mxc: str, limit: int) -> bytes:
        """The content of `mxc` from the content repository (authenticated, Matrix 1.11),
        at most `limit` bytes. Raises ChannelError when larger or not to be had."""
        server, media = _mxc_parts(mxc)
        if self._http is None:
            raise ChannelError("the Matrix channel is not connected")
        tail = f"download/{quote(server, safe='')}/{quote(media, safe='')}"
        for base in ("/_matrix/client/v1/media/", "/_matrix/media/v3/"):
            chunks: list[bytes] = []
            total = 0
            try:
                async with self._http.get(
                        f"{self.homeserver}{base}{tail}", headers=self._auth(),
                        timeout=aiohttp.ClientTimeout(total=max(self.request_timeout, 120))
                ) as r:
                    if r.status == 404 and base.startswith("/_matrix/client"):
                        body = await r.json(content_type=None)
                        if isinstance(body, dict) and body.get("errcode") == "M_UNRECOGNIZED":
                            continue  # a homeserver older than authenticated media
                    if r.status != 200:
                        raise ChannelError(f"matrix download: HTTP {r.status}", code=r.status,
                                           permanent=r.status in (400, 403, 404))
                    length = r.content_length
                    if length is not None and length > limit:
                        raise ChannelError(f"it is {length} bytes, over the {limit} bytes a "
                                           "file may have here")
                    async for chunk in r.content.iter_chunked(64 * 1024):
                        total += len(chunk)
                        if total > limit:
                            raise ChannelError(f"larger than the {limit} bytes a file may "
                                               "have here")
                        chunks.append(chunk)
            except (TimeoutError, aiohttp.ClientError, ValueError) as e:
                raise ChannelError(self.redact(f"matrix download: {type(e).__name__}: {e}")
                                   ) from None
            return b"".join(chunks)
        raise ChannelError("matrix download: the homeserver serves no media", permanent=True)

    # ------------------------------------------------------------------ rooms
    async def _invited(self, room_id: str, state: list[dict[str, Any]]) -> None:
        """An invite: joined when an allowed person sent it, ignored otherwise."""
        if not ROOM_ID_RE.match(room_id):
            return
        inviter = None
        encrypted = False
        for ev in state:
            etype = ev.get("type")
            content = _dict(ev.get("content"))
            if etype == "m.room.member" and ev.get("state_key") == self.user_id and \
                    content.get("membership") == "invite":
                inviter = ev.get("sender")
            elif etype == "m.room.encryption":
                encrypted = True
        if not isinstance(inviter, str) or not self.invite_allowed(inviter):
            log.info("matrix: invite to %s from %s ignored (not in channels.matrix."
                     "allow_invites_from)", room_id, inviter or "?")
            return
        try:
            await self._call("join", lambda: self.client.join(room_id))
        except ChannelError as e:
            if e.permanent:
                log.warning("matrix: could not join %s: %s", room_id, e)
                return
            raise  # the batch comes again
        log.info("matrix: joined %s on %s's invite", room_id, inviter)
        if encrypted or await self._is_encrypted(room_id):
            await self._refuse_encrypted(room_id)

    async def _welcome(self, room_id: str, room: Any, join_event: str) -> None:
        """A room the bot has just joined: into the chats table (the main agent sees it),
        and told its jid, once per join."""
        jid = self._jid(room_id)
        name = (room.name or room.canonical_alias) if room is not None else None
        if self.db is not None:
            await asyncio.to_thread(self._record_chat, jid, name)
        await self._say_once(f"matrix_welcomed:{self.user_id}:{room_id}", join_event, jid,
                             JOINED_NOTICE.format(jid=jid))

    async def _is_encrypted(self, room_id: str) -> bool:
        """Whether the room has end-to-end encryption on (its m.room.encryption state)."""
        try:
            await self._call("state", lambda: self.client.room_get_state_event(
                room_id, "m.room.encryption"))
        except ChannelError as e:
            if e.permanent:  # M_NOT_FOUND: no encryption
                return False
            raise
        return True

    def _record_chat(self, jid: str, name: str | None) -> None:
        assert self.db is not None
        with self.db.transaction() as c:
            upsert_chat(c, jid, name, self.name, True)

    async def _refuse_encrypted(self, room_id: str) -> None:
        """Say in the room that encrypted rooms are not taken part in, and leave it."""
        if room_id in self._refused:
            return
        self._refused.add(room_id)
        log.warning("matrix: %s is end-to-end encrypted: telling the room and leaving it "
                    "(encrypted rooms are not supported)", room_id)
        text = ENCRYPTED_NOTICE.format(bot=self.user_id)
        try:
            await self._send_event(room_id, "m.room.message",
                                   {"msgtype": "m.notice", "body": text, "m.mentions": {}})
        except ChannelError as e:
            log.warning("matrix: could not tell %s why the bot leaves: %s", room_id, e)
        try:
            await self._call("leave", lambda: self.client.room_leave(room_id))
        except ChannelError as e:
            log.warning("matrix: could not leave %s: %s", room_id, e)

    # ------------------------------------------------------------------ outbound
    def _logged_in_client(self) -> Any:
        if self.client is None or not self.is_connected():
            raise ChannelError("the Matrix channel is not connected")
        return self.client

    async def _send_event(self, room_id: str, etype: str, content: dict[str, Any]) -> str:
        """Send an event; its id. A send whose outcome is unknown (the connection lost, a
        timeout, a 5xx, a stop in the middle) keeps its transaction id in router_state, and
        the same event tried again (the outbox's next try, also after a restart) goes with
        the same id: a homeserver that took the first one answers with that event instead
        of making a second (the client API's transaction ids)."""
        client = self._logged_in_client()
        digest = _event_digest(etype, content)
        txns = await self._txns(room_id)
        txn = txns.get(digest, [None])[0] or f"mdclaw-{uuid.uuid4().hex}"
        if digest not in txns:
            txns[digest] = [txn, time.time()]
            await self._save_txns(room_id, txns)
        try:
            resp = await self._call("send", lambda: client.room_send(
                room_id, etype, content, tx_id=txn, ignore_unverified_devices=True))
        except ChannelError as e:
            if e.code is not None and e.code < 500:  # the homeserver said no: nothing made
                txns.pop(digest, None)
                await self._save_txns(room_id, txns)
            raise
        txns.pop(digest, None)
        await self._save_txns(room_id, txns)
        event_id = str(resp.event_id)
        rel = _dict(content.get("m.relates_to"))
        root = rel.get("event_id") if rel.get("rel_type") == "m.thread" else None
        self._remember(event_id, room_id, self.user_id, root)
        return event_id

    async def _txns(self, room_id: str) -> dict[str, list[Any]]:
        """The transaction ids of `room_id`'s sends of unknown outcome: {event digest: [txn
        id, time]}, those younger than TXN_KEEP_SECONDS."""
        if room_id not in self._pending_txns:
            value = None
            if self.db is not None:
                with contextlib.suppress(sqlite3.Error):
                    value = await asyncio.to_thread(get_router_value, self.db,
                                                    self._txn_key(room_id))
            data: Any = None
            with contextlib.suppress(ValueError, TypeError):
                data = json.loads(value) if value else None
            self._pending_txns[room_id] = {
                k: v for k, v in (data.items() if isinstance(data, dict) else ())
                if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
                and isinstance(v[1], int | float)}
        now = time.time()
        txns = self._pending_txns[room_id]
        for k in [k for k, v in txns.items() if now - v[1] > TXN_KEEP_SECONDS]:
            del txns[k]
        return txns

    async def _save_txns(self, room_id: str, txns: dict[str, list[Any]]) -> None:
        if self.db is None:
            return
        value = json.dumps(txns) if txns else None
        try:
            await asyncio.to_thread(set_router_value, self.db, self._txn_key(room_id), value)
        except sqlite3.Error as e:  # kept in memory: a retry in this run still reuses it
            log.warning("matrix: could not keep a transaction id for %s: %s", room_id, e)

    def _txn_key(self, room_id: str) -> str:
        return f"matrix_txn:{self.user_id}:{room_id}"

    def message_parts(self, text: str) -> list[tuple[str, str | None]]:
        """The Markdown `text` as (body, formatted_body or None) messages: the Markdown cut
        at 8000 characters keeping code blocks closed, each piece rendered to HTML (None
        when it has no formatting)."""
        parts = []
        for piece in split_message(text, self.max_message_length, measure=self.measure):
            html = to_matrix_html(piece)
            parts.append((piece, None if is_plain_html(piece, html) else html))
        return parts

    async def send_message(self, jid: str, text: str, *, reply_to: str | None = None,
                           sender: str | None = None) -> str | None:
        last = None
        for i, part in enumerate(self.message_parts(text)):
            last = await self.send_part(jid, part, reply_to=reply_to if i == 0 else None)
        return last

    async def _relates(self, room_id: str, jid: str,
                       reply_to: str | None) -> dict[str, Any] | None:
        """`m.relates_to` for a message: a reply to `reply_to` (in its thread, if it is in
        one); without one, the thread the room's latest message was written in."""
        if reply_to:
            try:
                target = self._event_id(jid, reply_to)
            except ChannelError:
                target = None
            if target is not None:
                about = await self._about(room_id, target)
                root = about[1] if about is not None else None
                if root:
                    return {"rel_type": "m.thread", "event_id": root, "is_falling_back": False,
                            "m.in_reply_to": {"event_id": target}}
                return {"m.in_reply_to": {"event_id": target}}
        where = await self._thread_now(room_id)
        if where is not None:
            return {"rel_type": "m.thread", "event_id": where[0], "is_falling_back": True,
                    "m.in_reply_to": {"event_id": where[1]}}
        return None

    async def send_part(self, jid: str, part: Any, *, reply_to: str | None = None,
                        sender: str | None = None) -> str | None:
        """Send one (body, formatted_body) piece as `m.text`."""
        room_id = self._room_id(jid)
        await self._typing_done(jid, room_id)
        body, html = part if isinstance(part, tuple) else (str(part), None)
        content: dict[str, Any] = {"msgtype": "m.text", "body": body, "m.mentions": {}}
        if html:
            content["format"] = HTML_FORMAT
            content["formatted_body"] = html
        rel = await self._relates(room_id, jid, reply_to)
        if rel:
            content["m.relates_to"] = rel
        event_id = await self._send_event(room_id, "m.room.message", content)
        return f"{jid}:{event_id}"

    async def send_file(self, jid: str, path: Path, *, file_name: str | None = None,
                        caption: str | None = None) -> str | None:
        room_id = self._room_id(jid)
        path = Path(path)
        data = await asyncio.to_thread(read_upload, path, self.max_upload,
                                       "the homeserver takes at most")
        name = file_name or path.name
        mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
        client = self._logged_in_client()
        upload = await self._call("upload", lambda: client.upload(
            io.BytesIO(data), content_type=mime, filename=name, filesize=len(data)))
        resp = upload[0] if isinstance(upload, tuple) else upload
        if not hasattr(resp, "content_uri"):
            nio = nio_module()
            if isinstance(resp, nio.ErrorResponse):
                raise self._error("upload", resp)
            raise ChannelError("matrix upload: no content address in the answer")
        kind = kind_for_mime(mime)
        msgtype = {"image": "m.image", "audio": "m.audio", "video": "m.video"}.get(kind,
                                                                                   "m.file")
        content: dict[str, Any] = {"msgtype": msgtype, "body": name, "filename": name,
                                   "url": resp.content_uri, "m.mentions": {},
                                   "info": {"mimetype": mime, "size": len(data)}}
        follow = None
        if caption:
            if len(caption) <= MAX_CAPTION:
                content["body"] = caption
                html = to_matrix_html(caption)
                if not is_plain_html(caption, html):
                    content["format"] = HTML_FORMAT
                    content["formatted_body"] = html
            else:
                follow = caption  # too long for a caption: it follows as a message
        rel = await self._relates(room_id, jid, None)
        if rel:
            content["m.relates_to"] = rel
        await self._typing_done(jid, room_id)
        event_id = await self._send_event(room_id, "m.room.message", content)
        if follow:
            await self.send_message(jid, follow)
        return f"{jid}:{event_id}"

    async def react(self, jid: str, message_id: str, emoji: str) -> None:
        room_id = self._room_id(jid)
        event_id = self._event_id(jid, message_id)
        await self._send_event(room_id, "m.reaction", {"m.relates_to": {
            "rel_type": "m.annotation", "event_id": event_id, "key": emoji}})

    def _stop_typing(self, jid: str) -> bool:
        """Stop repeating the typing notice in `jid`; True if it was being repeated."""
        t = self._typing.pop(jid, None)
        if t is not None:
            t.cancel()
        return t is not None

    async def _typing_done(self, jid: str, room_id: str) -> None:
        """A message goes out: the typing notice ends with it (Matrix clients keep showing
        it until told, or until its timeout runs out, while the agent may be idle)."""
        if self._stop_typing(jid):
            await self._typing_call(room_id, False)

    async def set_typing(self, jid: str, typing: bool) -> None:
        try:
            room_id = self._room_id(jid)
        except ChannelError:
            return
        self._stop_typing(jid)
        if typing and self._running:
            self._typing[jid] = asyncio.create_task(self._typing_loop(room_id, jid),
                                                    name=f"matrix-typing-{jid}")
        elif self.is_connected():
            await self._typing_call(room_id, False)

    async def _typing_call(self, room_id: str, on: bool) -> None:
        client = self.client
        if client is None or not self.is_connected():
            return
        try:
            await self._call("typing", lambda: client.room_typing(
                room_id, typing_state=on, timeout=TYPING_TIMEOUT_MS))
        except ChannelError as e:  # typing is a hint
            log.debug("%s", e)

    async def _typing_loop(self, room_id: str, jid: str) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + TYPING_MAX_SECONDS
        try:
            while loop.time() < until:
                await self._typing_call(room_id, True)
                await asyncio.sleep(TYPING_REPEAT_SECONDS)
        finally:
            if self._typing.get(jid) is asyncio.current_task():
                self._typing.pop(jid, None)


__all__ = ["ENCRYPTED_NOTICE", "MatrixChannel", "nio_module", "read_session", "session_path",
           "write_session"]
