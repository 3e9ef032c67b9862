"""Reading the command files untrusted containers wrote, without being fooled by them.

Everything under ipc/<folder>/ is written by an agent that may be hostile. Every file
operation goes through `mdclaw.agentfs` (folders opened without following symlinks, files
opened O_NOFOLLOW|O_NONBLOCK, regular with one link, size-checked before a byte is read);
this module adds what is particular to commands: which names are commands, the group's
command folders kept open and re-checked, JSON decoding with bounded nesting (no duplicate
keys, no NaN), and the mapping of a container path to the folder it lives in.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from mdclaw import agentfs
from mdclaw.agentfs import FileData, Rejected, UnsafePath, Vanished, open_dir
from mdclaw.ipc.protocol import SEND_FILE_MAX_BYTES

log = logging.getLogger("mdclaw.ipc")

COMMAND_MAX_BYTES = 1024 * 1024
MAX_JSON_DEPTH = 32
COMMAND_DIRS = ("messages", "tasks", "groups", "actions")

__all__ = ["COMMAND_DIRS", "COMMAND_MAX_BYTES", "GroupDirs", "MAX_JSON_DEPTH", "Rejected",
           "SEND_FILE_MAX_BYTES", "UnsafePath", "Vanished", "decode_json", "is_candidate",
           "read_command_file"]


def is_candidate(name: str) -> bool:
    """True for names the host reads as commands: `*.json`, not dot-files, not `*.tmp`."""
    return name.endswith(".json") and not name.startswith(".") and not name.endswith(".tmp")


def read_command_file(dir_fd: int, name: str, max_bytes: int = COMMAND_MAX_BYTES) -> FileData:
    """Read command file `name` from the open directory `dir_fd`.

    Returns its bytes, hash and generation. Raises Vanished if it is gone, Rejected (with
    the reason and generation) if it is not a regular single-link file within `max_bytes`.
    """
    return agentfs.read_file(dir_fd, name, max_bytes)


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(rb"[\[\]{}]")


def json_depth_exceeds(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if the JSON text nests arrays/objects deeper than `limit` (strings ignored)."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub(b'""', data)):
        if m.group() in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


# One decoder for every command: json.loads with hooks builds a new one each call.
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_no_constants)


def decode_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode UTF-8 JSON with bounded depth. Raises Rejected saying what is wrong."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Rejected(f"not valid UTF-8 (byte {e.start})") from None
    if json_depth_exceeds(data, max_depth):
        raise Rejected(f"JSON nested deeper than {max_depth} levels")
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError) as e:
        raise Rejected(f"invalid JSON: {e}") from None


# --------------------------------------------------------------------------- group folders


@dataclass
class _DirState:
    fd: int
    ino: int
    listed_mtime: int = -1  # mtime_ns of the last listing that found nothing (and was safe)
    # Names known to be waiting, sorted: the last listing plus what inotify reported since,
    # less what was finished. While it is not empty, inotify-driven rounds take from it
    # instead of listing the folder again (a flooded folder is listed once per drain, not
    # once per batch).
    queue: list[str] = field(default_factory=list)
    # The queue is all there is: the folder was listed while inotify watched it (its watch
    # was placed before that listing, and not replaced since). A round that brings names
    # then takes them from the queue even when it is empty, without a listing.
    known: bool = False


@dataclass
class GroupDirs:
    """The open command folders of one group, re-checked before every listing and before
    every round that takes files from them, except one that takes the names inotify just
    reported in a folder listed under its watch (see `pending`).

    A folder swapped for a symlink (or a file) is closed, refused and logged once; a folder
    replaced by another real directory is reopened.
    """

    ipc_root_fd: int
    folder: str
    dirs: dict[str, _DirState] = field(default_factory=dict)
    group_fd: int | None = None
    group_ino: int | None = None
    refused: dict[str, str] = field(default_factory=dict)

    def close(self) -> None:
        for st in self.dirs.values():
            os.close(st.fd)
        self.dirs.clear()
        if self.group_fd is not None:
            os.close(self.group_fd)
            self.group_fd = None

    def _refuse(self, sub: str, reason: str) -> None:
        if self.refused.get(sub) != reason:
            log.warning("ipc: group %s: %s", self.folder, reason)
        self.refused[sub] = reason

    def _ensure_group(self) -> int | None:
        st = agentfs.lstat(self.ipc_root_fd, self.folder)
        if st is None:
            self.close()
            return None
        if self.group_fd is not None and st.st_ino == self.group_ino and stat.S_ISDIR(st.st_mode):
            return self.group_fd
        self.close()
        try:
            self.group_fd = open_dir(self.folder, self.ipc_root_fd)
        except (UnsafePath, FileNotFoundError) as e:
            self._refuse("", f"ipc/{self.folder}: {e}")
            return None
        self.group_ino = os.fstat(self.group_fd).st_ino
        self.refused.pop("", None)
        return self.group_fd

    def dir_fd(self, sub: str) -> int | None:
        """The open fd of command folder `sub`, reopened if it was replaced; None if it is
        absent or refused (a symlink or not a directory)."""
        gfd = self._ensure_group()
        if gfd is None:
            return None
        cur = self.dirs.get(sub)
        st = agentfs.lstat(gfd, sub)
        if st is None:
            if cur:
                os.close(cur.fd)
                del self.dirs[sub]
            return None
        if cur is not None and stat.S_ISDIR(st.st_mode) and st.st_ino == cur.ino:
            return cur.fd
        if cur is not None:
            os.close(cur.fd)
            del self.dirs[sub]
        if not stat.S_ISDIR(st.st_mode):
            self._refuse(sub, f"ipc/{self.folder}/{sub} is {agentfs.kind_of(st.st_mode)}, not a "
                              "directory; refused and not followed")
            return None
        try:
            fd = open_dir(sub, gfd)
        except (UnsafePath, FileNotFoundError) as e:
            self._refuse(sub, f"ipc/{self.folder}/{sub}: {e}")
            return None
        self.refused.pop(sub, None)
        self.dirs[sub] = _DirState(fd, os.fstat(fd).st_ino)
        return fd

    def checked_fd(self, sub: str) -> int | None:
        """The fd of command folder `sub` as dir_fd last checked it (the listing of this
        round did), without checking again; dir_fd's answer if it has none."""
        st = self.dirs.get(sub)
        return st.fd if st is not None else self.dir_fd(sub)

    def pending(self, subs: tuple[str, ...] = COMMAND_DIRS, *, cheap: bool = False,
                names: dict[str, set[str]] | None = None, limit: int | None = None
                ) -> list[tuple[str, str]]:
        """Pending command files as (name, sub) sorted by name, then folder (the first
        `limit` of them if given).

        With `cheap`, a folder whose mtime has not changed since a listing that found
        nothing (and was taken well after that mtime) is not listed again. `names` (only
        from inotify, which reports every file arriving in a watched folder) are the names
        that arrived per folder since the last call: a folder whose queue of known names is
        not empty, or that was listed under its watch and has new names, is then served
        from its queue, without a listing.
        """
        out: list[tuple[str, str]] = []
        for sub in subs:
            new = None if names is None else names.get(sub)
            st_dir = self.dirs.get(sub) if new else None
            if st_dir is None or not st_dir.known:
                # Looked up again (by inode, the group's folder first), unless inotify just
                # named files in it and it was listed under its watch: the folder's watch
                # and its group's report it being swapped, moved or deleted, and the
                # watcher re-checks such a folder (sync_watches) before its next round.
                fd = self.dir_fd(sub)
                if fd is None:
                    continue
                st_dir = self.dirs[sub]
            else:
                fd = st_dir.fd
            if names is not None and (st_dir.queue or (new and st_dir.known)):
                q = st_dir.queue
                for n in new or ():
                    i = bisect.bisect_left(q, n)
                    if i == len(q) or q[i] != n:
                        q.insert(i, n)
                out.extend((n, sub) for n in (q if limit is None else q[:limit]))
                continue
            mtime = os.fstat(fd).st_mtime_ns
            if cheap and mtime == st_dir.listed_mtime:
                continue
            listed = sorted(n for n in agentfs.listdir(fd) if is_candidate(n))
            st_dir.queue = listed
            st_dir.known = True
            # A listing is "clean" only if the folder was last changed well before it, so a
            # file created in the same timestamp tick cannot hide behind an unchanged mtime.
            clean = not listed and time.time_ns() - mtime > 50_000_000
            st_dir.listed_mtime = mtime if clean else -1
            out.extend((n, sub) for n in (listed if limit is None else listed[:limit]))
        out.sort()
        return out if limit is None else out[:limit]

    def watched(self, sub: str) -> None:
        """A watch was just placed on command folder `sub`: names it did not see may be
        waiting, so the next round lists the folder before its queue is trusted alone."""
        st_dir = self.dirs.get(sub)
        if st_dir is not None:
            st_dir.known = False

    def finished(self, sub: str, names: set[str]) -> None:
        """Forget `names` (applied, rejected, gone) from the folder's queue of known names."""
        st_dir = self.dirs.get(sub)
        if st_dir is None or not st_dir.queue:
            return
        q = st_dir.queue
        # They were taken from the head of the queue: look there first.
        head = len(names) + 64
        kept = [n for n in q[:head] if n not in names]
        if len(kept) + len(names) == min(head, len(q)):
            q[:head] = kept
        else:
            st_dir.queue = [n for n in q if n not in names]
