"""Files people send the assistant: saved in the group's folder, described in the prompt.

Every channel puts what came with a message on `InboundMessage.attachments` (see
`mdclaw.channels.base.Attachment`); the orchestrator stores the message with its files
announced and hands it to `FileIntake`, which fetches them off the channel's path, in the
chat's order (see the class). Each attachment is downloaded (`fetch`, async, at most
`media.max_bytes`), written through the one door into `groups/<g>/inbox/<YYYY-MM-DD>/<name>`
(a thread does the file work; folders are walked without following symlinks; an existing
entry is never replaced, the new file gets `name (2).ext`), and voice notes are transcribed
when `transcription:` is configured. The result (`Saved.as_dict`) is kept beside the
message's text, in the messages table's `attachments` column, and the prompt shows it as an
element the person's own text cannot produce (mdclaw.formatting): the agent reads where the
file is (`/workspace/group/inbox/...`), its type, size and caption, and the transcript; a
file that was too large or could not be fetched is named with the reason, never silently
dropped.

Names are the sender's, so they are sanitised: one plain component (no `/`, `\\`, `..`,
control or format characters, no leading dot), at most NAME_MAX characters with the
extension kept; a name with nothing left gets one made from the kind and type.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import re
import unicodedata
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from mdclaw import agentfs, schedule
from mdclaw.agentfs import UnsafePath
from mdclaw.aio import wait_all
from mdclaw.channels.base import Attachment, ChannelError, InboundMessage, kind_for_mime
from mdclaw.config import Config, format_size
from mdclaw.mounts import GROUP_ROOT
from mdclaw.paths import GROUP_DIR_MODE, Layout
from mdclaw.state import Database
from mdclaw.state.conversations import StoredMessage, pending_files, settle_files
from mdclaw.state.groups import GroupRow, get_group_by_jid
from mdclaw.transcribe import Transcriber, TranscriptionError

log = logging.getLogger("mdclaw.media")

INBOX = "inbox"
NAME_MAX = 100  # characters of a saved file's name
EXT_MAX = 12  # characters of an extension kept as it is
FILE_MODE = 0o660  # the agent (the group's gid) reads it, and may tidy it away
KINDS = ("image", "document", "audio", "voice", "video")
KIND_WORDS = {"image": "image", "document": "document", "audio": "audio file",
              "voice": "voice note", "video": "video"}
_DEFAULT_STEM = {"image": "photo", "document": "document", "audio": "audio", "voice": "voice",
                 "video": "video"}
_DEFAULT_EXT = {"image": ".jpg", "voice": ".ogg", "audio": ".mp3", "video": ".mp4",
                "document": ".bin"}
_EXT_RE = re.compile(r"^\.[A-Za-z0-9]{1," + str(EXT_MAX) + r"}\Z")


def safe_name(name: str | None, kind: str = "document", mime: str | None = None) -> str:
    """`name` as one safe file name (see the module's notes); never empty."""
    text = unicodedata.normalize("NFC", name or "")
    text = text.replace("\\", "/").rsplit("/", 1)[-1]  # a path: its last part
    text = "".join("_" if unicodedata.category(c)[0] == "C" else c for c in text)
    text = " ".join(text.split()).lstrip(". ").rstrip(" .")
    stem, dot, ext = text.rpartition(".")
    if not dot or not stem or not _EXT_RE.match("." + ext):
        stem, ext = text, ""
    else:
        ext = "." + ext.lower()
    if not ext:
        guessed = mimetypes.guess_extension(mime or "", strict=False) if mime else None
        ext = guessed if guessed and _EXT_RE.match(guessed) else _DEFAULT_EXT.get(kind, ".bin")
    stem = stem[:NAME_MAX - len(ext)].rstrip(" .")
    while len((stem + ext).encode()) > 200:  # file systems count bytes (255 at most)
        stem = stem[:-1]
    if not stem or stem in (".", ".."):
        stem = _DEFAULT_STEM.get(kind, "file")
    return stem + ext


@dataclass(frozen=True)
class Saved:
    """What became of one attachment."""

    kind: str
    name: str  # the saved file's name, or the sanitised name of what was not saved
    mime: str | None
    size: int | None
    caption: str | None = None
    container_path: str | None = None  # None: not saved
    error: str | None = None  # why it was not saved (for the agent and the chat)
    transcript: str | None = None
    transcript_note: str | None = None  # why there is no transcript (voice notes)

    def as_dict(self) -> dict[str, Any]:
        """What the messages table keeps (its `attachments` column) and the prompt shows
        (mdclaw.formatting renders it as an <attachment> element); empty facts left out."""
        d: dict[str, Any] = {"kind": self.kind, "name": self.name, "mime": self.mime,
                             "size": self.size, "caption": self.caption,
                             "path": self.container_path, "error": self.error,
                             "transcript": self.transcript,
                             "transcript_note": self.transcript_note}
        return {k: v for k, v in d.items() if v is not None}


def inbox_date(cfg: Config, now: datetime | None = None) -> str:
    """Today in the assistant's timezone, the name of the day's inbox folder."""
    when = now or schedule.utc_now()
    try:
        when = when.astimezone(schedule.get_zone(cfg.assistant.timezone))
    except schedule.ScheduleError:
        pass
    return when.strftime("%Y-%m-%d")


def write_inbox(layout: Layout, folder: str, day: str, name: str, data: bytes,
                limit: int) -> str:
    """Write `data` as groups/<folder>/inbox/<day>/<name> (or a free variant of the name);
    returns the name used. Raises UnsafePath or OSError. Blocking: call on a thread."""
    return agentfs.write_new_file(layout.groups_dir, (folder, INBOX, day), name, data, limit,
                                  mode=FILE_MODE, dir_mode=GROUP_DIR_MODE)


async def save_attachment(cfg: Config, folder: str, att: Attachment, *,
                          transcriber: Transcriber | None, day: str) -> Saved:
    """Fetch `att` (bounded), save it in the group's inbox, transcribe a voice note."""
    kind = att.kind if att.kind in KINDS else kind_for_mime(att.mime)
    name = safe_name(att.name, kind, att.mime)
    mime = att.mime or mimetypes.guess_type(name)[0]
    limit = cfg.media.limit
    base = Saved(kind=kind, name=name, mime=mime, size=att.size, caption=att.caption)
    if att.size is not None and att.size > limit:
        return replace(base, error=f"it is {format_size(att.size)}, over the "
                                    f"{format_size(limit)} limit for files sent here")
    try:
        data = await att.fetch(limit)
    except ChannelError as e:
        return replace(base, error=str(e))
    except Exception as e:  # noqa: BLE001 - a channel's download failed in some other way
        log.warning("group %s: downloading %s failed", folder, name, exc_info=True)
        return replace(base, error=f"the download failed ({type(e).__name__})")
    if len(data) > limit:
        return replace(base, size=len(data),
                        error=f"it is over the {format_size(limit)} limit for files sent "
                              "here")
    try:
        saved = await asyncio.to_thread(write_inbox, Layout(cfg.data_dir), folder, day, name,
                                        data, limit)
    except (UnsafePath, OSError) as e:
        log.warning("group %s: cannot save %s in inbox/%s: %s", folder, name, day, e)
        return replace(base, size=len(data), error=f"it could not be saved in the group's "
                                                    f"folder ({e})")
    out = replace(base, name=saved, size=len(data),
                   container_path=f"{GROUP_ROOT}/{INBOX}/{day}/{saved}")
    log.info("group %s: %s saved as inbox/%s/%s (%d bytes)", folder, kind, day, saved,
             len(data))
    if kind != "voice":
        return out
    if transcriber is None:
        return replace(out, transcript_note="no transcription is configured (the operator "
                                             "can set transcription: in config.yaml)")
    try:
        text = await transcriber.transcribe(data, saved, mime)
    except TranscriptionError as e:
        log.warning("group %s: transcribing %s failed: %s", folder, saved, e)
        return replace(out, transcript_note=f"transcription failed: {e}")
    return replace(out, transcript=text)


async def save_all(cfg: Config, folder: str, attachments: tuple[Attachment, ...], *,
                   transcriber: Transcriber | None = None,
                   now: datetime | None = None) -> list[Saved]:
    """Save every attachment of one message (one after the other); never raises for one
    that fails: its Saved says why."""
    day = inbox_date(cfg, now)
    return [await save_attachment(cfg, folder, a, transcriber=transcriber, day=day)
            for a in attachments]


def not_saved_note(attachments: tuple[Attachment, ...], why: str) -> list[Saved]:
    """Attachments that are not fetched at all (`why`), described like the rest."""
    return [Saved(kind=a.kind if a.kind in KINDS else "document",
                  name=safe_name(a.name, a.kind, a.mime), mime=a.mime, size=a.size,
                  caption=a.caption, error=why) for a in attachments]


def announced(attachments: tuple[Attachment, ...]) -> list[dict[str, Any]]:
    """What the sender says of `attachments` (names sanitised), kept with a message while
    its files are downloaded, so a restart can say which files were lost."""
    return [{k: v for k, v in s.as_dict().items() if k != "error"}
            for s in not_saved_note(attachments, "")]


# --------------------------------------------------------------------------- intake

MAX_PARALLEL_DOWNLOADS = 4  # files of inbound messages fetched at once
# Logged under the name these lines had before they moved here, so that journal filters
# and log readers keep working.
intake_log = logging.getLogger("mdclaw.orchestrator")


class FileIntake:
    """Fetches the files of inbound messages off the channel's path, one message after the
    other within a chat (their names in the inbox and their release follow the chat's order),
    chats in parallel, at most MAX_PARALLEL_DOWNLOADS at once.

    The message is stored first with its files announced and `files_pending` set: until its
    files are settled the message, and every later one of its chat, is held back from the
    agent (mdclaw.state.conversations), so the agent reads the chat in order. `take` returns
    at once; the task saves the files (`save_all`), tells the chat about files that could not
    be kept (`send_text(jid, folder, text)`), records what became of them with the message and
    hands the settled message to `on_saved(group, message, t0)`.

    `config` and `transcriber` are asked when a download starts (a reload may change them).
    """

    def __init__(self, db: Database, *, config: Callable[[], Config],
                 transcriber: Callable[[], Transcriber | None],
                 send_text: Callable[[str, str, str], None],
                 on_saved: Callable[[GroupRow, StoredMessage, float], Awaitable[None]]) -> None:
        self.db = db
        self._config = config
        self._transcriber = transcriber
        self._send_text = send_text
        self._on_saved = on_saved
        # Messages whose files are being downloaded (message id -> its task), and each
        # chat's newest such task.
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._chats: dict[str, asyncio.Task[None]] = {}
        self._downloads = asyncio.Semaphore(MAX_PARALLEL_DOWNLOADS)

    def take(self, group: GroupRow, msg: InboundMessage, t0: float) -> None:
        """Save the files of `msg` (stored with files_pending) in a task of their own."""
        before = self._chats.get(msg.chat_jid)
        task = asyncio.create_task(self._take(group, msg, t0, before), name=f"files:{msg.id}")
        self._tasks[msg.id] = task
        self._chats[msg.chat_jid] = task
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        for mid, t in list(self._tasks.items()):
            if t is task:
                del self._tasks[mid]
        for jid, t in list(self._chats.items()):
            if t is task:
                del self._chats[jid]

    async def _take(self, group: GroupRow, msg: InboundMessage, t0: float,
                    before: asyncio.Task[None] | None = None) -> None:
        """Save `msg`'s files in its group's inbox, record what became of them with the
        message and release it to the agent. Files that could not be kept are named with the
        reason, and the chat is told."""
        if before is not None:
            await asyncio.wait([before])
        try:
            async with self._downloads:
                saved = await save_all(self._config(), group.folder, msg.attachments,
                                       transcriber=self._transcriber())
        except Exception:  # noqa: BLE001 - never leave the chat held back
            intake_log.exception("group %s: saving the files of message %s failed",
                                 group.folder, msg.id)
            saved = not_saved_note(msg.attachments, "saving it failed (see the log)")
        lost = [s for s in saved if s.container_path is None]
        if lost:
            self._send_text(msg.chat_jid, group.folder, "\n".join(
                f"I could not keep {s.name!r}: {s.error}" for s in lost))
        files = tuple(s.as_dict() for s in saved)
        await asyncio.to_thread(settle_files, self.db, msg.id, files)
        stored = StoredMessage(msg.id, msg.chat_jid, msg.sender, msg.sender_name, msg.content,
                               msg.timestamp, False, False, attachments=files)
        await self._on_saved(group, stored, t0)

    async def settled(self) -> None:
        """Wait until every file download under way has been settled (tests, shutdown)."""
        await wait_all(self._tasks.values())

    def settle_stale(self) -> int:
        """Messages whose files were being downloaded when mdclaw stopped: record that the
        files were not saved (the agent is told, the chat too) and release them."""
        n = 0
        for m in pending_files(self.db):
            if m.id in self._tasks:
                continue
            group = get_group_by_jid(self.db, m.chat_jid)
            files = tuple({**{k: v for k, v in f.items() if k != "path"},
                           "error": "mdclaw stopped before it was saved; please send it again"}
                          for f in m.attachments)
            settle_files(self.db, m.id, files)
            if group is not None:
                self._send_text(m.chat_jid, group.folder, "\n".join(
                    f"I could not keep {f.get('name')!r}: mdclaw stopped before it was "
                    "saved; please send it again" for f in files))
            n += 1
        if n:
            intake_log.warning("%d message(s) whose files were downloading when mdclaw "
                               "stopped: their files are lost, the chats were told", n)
        return n
