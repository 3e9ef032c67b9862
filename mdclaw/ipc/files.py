"""Reading what untrusted containers wrote, without being fooled by it.

Everything under ipc/<folder>/ is written by an agent that may be hostile. Folders are
opened relative to a trusted parent with O_NOFOLLOW, so a folder swapped for a symlink is
refused instead of followed; files are opened with O_NOFOLLOW|O_NONBLOCK, must be regular
files with one link, and are size-checked before a byte is read. Decoding bounds the JSON
nesting depth and refuses duplicate keys and NaN.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("mdclaw.ipc")

COMMAND_MAX_BYTES = 1024 * 1024
SEND_FILE_MAX_BYTES = 64 * 1024 * 1024
MAX_JSON_DEPTH = 32
COMMAND_DIRS = ("messages", "tasks", "groups", "actions")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class UnsafePath(Exception):
    """A path the host refuses to use; str(e) is the reason."""


class Rejected(Exception):
    """A command file that must be quarantined. `generation` identifies the entry."""

    def __init__(self, reason: str, generation: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.generation = generation


class Vanished(Exception):
    """The file disappeared before it could be read (someone else processed it)."""


def is_candidate(name: str) -> bool:
    """True for names the host reads as commands: `*.json`, not dot-files, not `*.tmp`."""
    return name.endswith(".json") and not name.startswith(".") and not name.endswith(".tmp")


def generation(st: os.stat_result) -> str:
    """A token that changes whenever a different file takes the name (inode + ctime)."""
    return f"{st.st_ino}.{st.st_ctime_ns}"


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def open_dir(name: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """Open directory `name` (relative to `dir_fd`) without following a symlink there.

    Returns the fd. Raises FileNotFoundError if it is absent, UnsafePath if it is a symlink
    or not a directory.
    """
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                what = _kind(st.st_mode)
            except OSError:
                what = "not a directory"
            raise UnsafePath(f"{name} is {what}, not a directory; refused") from None
        raise UnsafePath(f"cannot open {name}: {e.strerror}") from None


def open_dir_path(path: Path) -> int:
    """Open an absolute host directory; only its last component is checked for symlinks
    (the parents are the host's own, under data_dir). Raises like open_dir."""
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return open_dir(path.name, parent)
    finally:
        os.close(parent)


@dataclass(frozen=True)
class FileData:
    data: bytes
    sha256: str
    generation: str
    mtime_ns: int = 0

    @property
    def ledger_key(self) -> str:
        return f"{self.sha256}@{self.generation}"


def lstat_generation(dir_fd: int, name: str) -> str:
    """The generation of entry `name` without following it ('' if it is gone)."""
    try:
        return generation(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    except OSError:
        return ""


def open_regular(dir_fd: int, name: str, max_bytes: int) -> tuple[int, os.stat_result]:
    """Open `name` in `dir_fd` safely: returns (fd, fstat) of a regular file of at most
    `max_bytes`. Raises Vanished if it is gone, Rejected with the reason otherwise."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise Vanished(name) from None
    except OSError as e:
        gen = lstat_generation(dir_fd, name)
        if e.errno == errno.ELOOP:
            raise Rejected("a symlink; refused without following it", gen) from None
        if e.errno == errno.ENXIO:
            raise Rejected("a socket or device; refused", gen) from None
        raise Rejected(f"cannot open: {e.strerror}", gen) from None
    try:
        st = os.fstat(fd)
        gen = generation(st)
        if not stat.S_ISREG(st.st_mode):
            raise Rejected(f"{_kind(st.st_mode)}, not a regular file; refused", gen)
        if st.st_nlink != 1:
            raise Rejected(f"a file with {st.st_nlink} hard links; refused", gen)
        if st.st_size > max_bytes:
            raise Rejected(f"too large: {st.st_size} bytes (limit {max_bytes})", gen)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_command_file(dir_fd: int, name: str, max_bytes: int = COMMAND_MAX_BYTES) -> FileData:
    """Read command file `name` from the open directory `dir_fd`.

    Returns its bytes, hash and generation. Raises Vanished if it is gone, Rejected (with
    the reason and generation) if it is not a regular single-link file within `max_bytes`.
    """
    fd, st = open_regular(dir_fd, name, max_bytes)
    try:
        chunks = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    gen = generation(st)
    if len(data) > max_bytes:
        raise Rejected(f"too large: grew beyond {max_bytes} bytes while being read", gen)
    return FileData(data, hashlib.sha256(data).hexdigest(), gen, st.st_mtime_ns)


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


def decode_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode UTF-8 JSON with bounded depth. Raises Rejected saying what is wrong."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Rejected(f"not valid UTF-8 (byte {e.start})") from None
    if json_depth_exceeds(data, max_depth):
        raise Rejected(f"JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise Rejected(f"invalid JSON: {e}") from None


# --------------------------------------------------------------------------- group folders


@dataclass
class _DirState:
    fd: int
    ino: int
    listed_mtime: int = -1  # mtime_ns of the last listing that found nothing (and was safe)


@dataclass
class GroupDirs:
    """The open command folders of one group, re-checked before every listing.

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
        try:
            st = os.stat(self.folder, dir_fd=self.ipc_root_fd, follow_symlinks=False)
        except FileNotFoundError:
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
        try:
            st = os.stat(sub, dir_fd=gfd, follow_symlinks=False)
        except FileNotFoundError:
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
            self._refuse(sub, f"ipc/{self.folder}/{sub} is {_kind(st.st_mode)}, not a "
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

    def pending(self, subs: tuple[str, ...] = COMMAND_DIRS, *, cheap: bool = False
                ) -> list[tuple[str, str]]:
        """Pending command files as (name, sub) sorted by name, then folder.

        With `cheap`, a folder whose mtime has not changed since a listing that found
        nothing (and was taken well after that mtime) is not listed again.
        """
        out: list[tuple[str, str]] = []
        for sub in subs:
            fd = self.dir_fd(sub)
            if fd is None:
                continue
            st_dir = self.dirs[sub]
            mtime = os.fstat(fd).st_mtime_ns
            if cheap and mtime == st_dir.listed_mtime:
                continue
            found = [(n, sub) for n in os.listdir(fd) if is_candidate(n)]
            # A listing is "clean" only if the folder was last changed well before it, so a
            # file created in the same timestamp tick cannot hide behind an unchanged mtime.
            clean = not found and time.time_ns() - mtime > 50_000_000
            st_dir.listed_mtime = mtime if clean else -1
            out.extend(found)
        out.sort()
        return out


# --------------------------------------------------------------------------- send_file paths

CONTAINER_GROUP = "/workspace/group"
CONTAINER_EXTRA = "/workspace/extra"


def split_container_path(path: str, extra_mounts: dict[str, str]) -> tuple[str, list[str]]:
    """Map a container path to (host base directory key, relative components).

    The key is "group" or "extra:<name>". Raises UnsafePath for anything outside
    /workspace/group and the group's configured /workspace/extra/<name> mounts, for `..`,
    empty or NUL-containing components.
    """
    if "\0" in path:
        raise UnsafePath("path contains a NUL byte")
    if path.startswith("/"):
        if path == CONTAINER_GROUP or path.startswith(CONTAINER_GROUP + "/"):
            base, rest = "group", path[len(CONTAINER_GROUP) + 1:]
        elif path.startswith(CONTAINER_EXTRA + "/"):
            name, _, rest = path[len(CONTAINER_EXTRA) + 1:].partition("/")
            if name not in extra_mounts:
                raise UnsafePath(f"{path}: /workspace/extra/{name} is not a mount of this group")
            base = f"extra:{name}"
        else:
            raise UnsafePath(f"{path} is outside /workspace/group and the group's extra mounts")
    else:
        base, rest = "group", path
    parts = [p for p in rest.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise UnsafePath(f"{path}: '..' is not allowed")
    if not parts:
        raise UnsafePath(f"{path} names a directory, not a file")
    return base, parts


def open_beneath(base_fd: int, parts: list[str], max_bytes: int) -> tuple[int, os.stat_result]:
    """Open the regular file base/parts[0]/.../parts[-1] without following any symlink on
    the way. Returns (fd, fstat). Raises UnsafePath with the reason."""
    fd = os.dup(base_fd)
    try:
        for comp in parts[:-1]:
            try:
                nfd = open_dir(comp, fd)
            except FileNotFoundError:
                raise UnsafePath(f"folder {comp!r} does not exist") from None
            os.close(fd)
            fd = nfd
        try:
            ffd, st = open_regular(fd, parts[-1], max_bytes)
        except Vanished:
            raise UnsafePath(f"file {parts[-1]!r} does not exist") from None
        except Rejected as e:
            if e.reason.startswith("a file with"):  # hard links are fine for files sent
                ffd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
                st = os.fstat(ffd)
                if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
                    os.close(ffd)
                    raise UnsafePath(f"{parts[-1]!r}: {e.reason}") from None
            else:
                raise UnsafePath(f"{parts[-1]!r}: {e.reason}") from None
        return ffd, st
    finally:
        os.close(fd)
