"""The container side of the IPC folder: command files out, follow-up messages in.

Command files are written atomically (a dot-prefixed temp file in the same directory, fsync,
rename to `<ms>-<random>.json`), so the host never sees half a file: its reader ignores
dot-files and `*.tmp`.

Follow-ups arrive in `input/` as `<name>.json` files written by the host, plus the empty
`_close` sentinel. The watcher wakes on inotify when it can and scans the directory at least
every poll interval, so a missed event costs at most one interval.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import select
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLOSE_SENTINEL = "_close"
MAX_INPUT_BYTES = 1024 * 1024


_name_lock = threading.Lock()
_last_ms = 0


def new_name() -> str:
    """`<epoch ms>-<random>.json`. The host runs a group's files in name order, so the
    millisecond part strictly increases within this process (two commands written in the same
    millisecond still run in the order they were written); the random part keeps writers in
    different processes apart."""
    global _last_ms
    with _name_lock:
        ms = max(int(time.time() * 1000), _last_ms + 1)
        _last_ms = ms
    return f"{ms}-{secrets.token_hex(4)}.json"


def write_json_atomic(directory: Path, body: Any, name: str | None = None) -> Path:
    """Write `body` as JSON into `directory` atomically; return the final path.

    Raises OSError when the directory cannot be written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / (name or new_name())
    tmp = directory / f".{final.name}.{secrets.token_hex(4)}.tmp"
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o660)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.rename(tmp, final)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return final


def read_json_file(path: Path, limit: int = MAX_INPUT_BYTES) -> Any:
    """Read a JSON file without following symlinks; raises OSError/ValueError when it is not a
    regular file, too large, or not JSON."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{path.name} is larger than {limit} bytes")
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return json.loads(b"".join(chunks).decode("utf-8"))


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass(frozen=True)
class FollowUp:
    """One message the host delivered while the conversation was open."""

    name: str
    text: str
    sender_name: str | None = None
    # The chat it came from (a group with several chats): the tools answer there by default.
    chat_jid: str | None = None


def follow_up_text(body: Any) -> tuple[str, str | None]:
    """The user-turn text of an input file: `{content, sender_name...}` or `{text}`.

    Raises ValueError for anything else.
    """
    if not isinstance(body, dict):
        raise ValueError("follow-up must be a JSON object")
    for key in ("content", "text"):
        value = body.get(key)
        if isinstance(value, str):
            name = body.get("sender_name") or body.get("senderName") or body.get("sender")
            return value, name if isinstance(name, str) else None
    raise ValueError("follow-up has neither 'content' nor 'text'")


class InputWatcher:
    """Yields follow-ups from `input/` in file-name order, each exactly once.

    A file is read, then removed, then handed out; a file that cannot be parsed is moved to
    `input/.rejected/` so it is neither retried forever nor silently lost.
    """

    def __init__(self, input_dir: Path, poll_seconds: float = 0.5, *,
                 use_inotify: bool = True) -> None:
        self.input_dir = input_dir
        self.poll_seconds = poll_seconds
        self.closed = False
        self._pending: list[FollowUp] = []
        self._inotify = None
        self.input_dir.mkdir(parents=True, exist_ok=True)
        if not use_inotify:
            return
        try:
            import inotify_simple  # optional: without it the watcher only polls

            ino = inotify_simple.INotify()
            f = inotify_simple.flags
            ino.add_watch(str(self.input_dir), f.CLOSE_WRITE | f.MOVED_TO | f.CREATE)
            self._inotify = ino
        except (ImportError, OSError):
            self._inotify = None

    @property
    def uses_inotify(self) -> bool:
        return self._inotify is not None

    def close(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    def scan(self) -> list[FollowUp]:
        """Take every complete follow-up present now; set `closed` if `_close` is there.

        Follow-ups present in the same scan as `_close` are still returned (none is lost).
        """
        found: list[FollowUp] = []
        saw_close = self._take(found)
        if saw_close:
            # A directory listing made while files were being renamed in may show `_close`
            # but miss a follow-up renamed in just before it; a listing started after
            # `_close` was seen shows every such file.
            self._take(found)
            _unlink_quietly(self.input_dir / CLOSE_SENTINEL)
            self.closed = True
        found.sort(key=lambda f: f.name)
        return found

    def _take(self, found: list[FollowUp]) -> bool:
        """Read and remove the follow-ups listed now, appending to `found`; return whether
        `_close` was listed."""
        try:
            names = sorted(os.listdir(self.input_dir))
        except FileNotFoundError:
            return False
        saw_close = False
        for name in names:
            if name == CLOSE_SENTINEL:
                saw_close = True
                continue
            if name.startswith(".") or not name.endswith(".json"):
                continue
            path = self.input_dir / name
            try:
                body = read_json_file(path)
                text, sender = follow_up_text(body)
            except FileNotFoundError:
                continue
            except (OSError, ValueError, UnicodeDecodeError):
                self._reject(path)
                continue
            _unlink_quietly(path)
            chat = body.get("chat_jid") if isinstance(body, dict) else None
            found.append(FollowUp(name=name, text=text, sender_name=sender,
                                  chat_jid=chat if isinstance(chat, str) and chat else None))
        return saw_close

    def _reject(self, path: Path) -> None:
        rejected = self.input_dir / ".rejected"
        try:
            rejected.mkdir(exist_ok=True)
            os.rename(path, rejected / path.name)
        except OSError:
            _unlink_quietly(path)

    def _wait(self, timeout: float) -> None:
        if self._inotify is None:
            time.sleep(timeout)
            return
        try:
            r, _, _ = select.select([self._inotify.fileno()], [], [], timeout)
        except OSError as e:
            if e.errno != errno.EINTR:
                raise
            return
        if r:
            self._inotify.read(timeout=0)

    def next(self, timeout: float | None = None) -> FollowUp | None:
        """The next follow-up, waiting for one; None once `_close` was seen (and nothing is
        left) or when `timeout` seconds pass."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._pending:
                return self._pending.pop(0)
            self._pending.extend(self.scan())
            if self._pending:
                continue
            if self.closed:
                return None
            wait = self.poll_seconds
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                wait = min(wait, left)
            self._wait(wait)

    def __iter__(self) -> Iterator[FollowUp]:
        while True:
            item = self.next()
            if item is None:
                return
            yield item
