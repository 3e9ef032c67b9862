"""The IPC error quarantine: ipc/errors/<group>.<sub>.<name>.error and .error.json beside it.

The name cannot collide between groups or folders: a group folder has no `.`
(`[A-Za-z0-9][A-Za-z0-9_-]*`) and neither has `sub` (messages, tasks...), so the first two
dots delimit them. (Before, `<group>-<name>` made group `a-b`'s `c.json` and group `a`'s
`b-c.json` the same entry.) Entries of the old naming are renamed at start from what their
`.error.json` says.

A rejected file is moved (not copied) out of the container's reach. Only a regular
single-link file small enough is kept as the `.error` payload; anything else (a directory,
FIFO, socket, symlink, hard link, a huge file) is removed and an empty `.error` stands in,
so a container cannot fill the host's disk through the quarantine. The folder is capped by
entry count and bytes; the oldest entries go first and the log says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mdclaw import agentfs
from mdclaw.errors import IpcError
from mdclaw.schedule import to_iso, utc_now

log = logging.getLogger("mdclaw.ipc")

META_SUFFIX = ".error.json"
PAYLOAD_SUFFIX = ".error"
_MAX_NAME = 255  # bytes in a file name


def entry_base(group: str, sub: str, name: str) -> str:
    """The quarantine entry's name (without suffix) for `sub/name` of `group`'s IPC folder:
    `<group>.<sub>.<name>`; a name too long for the file system is cut and given a hash of
    the whole name."""
    base = f"{group}.{sub}.{name}"
    if len((base + META_SUFFIX).encode()) <= _MAX_NAME:
        return base
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    head = name.encode("utf-8", "surrogateescape")[:96].decode("utf-8", "ignore")
    return f"{group}.{sub}.{head}~{digest}"


@dataclass(frozen=True)
class ErrorEntry:
    name: str  # <group>.<sub>.<file>.error
    original_file: str
    source_group: str
    error: str
    processed_at: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "original_file": self.original_file,
                "source_group": self.source_group, "error": self.error,
                "processed_at": self.processed_at}


class Quarantine:
    """ipc/errors/ with its caps. Not thread-safe; one per IPC engine."""

    def __init__(self, errors_dir: Path, max_files: int, max_bytes: int) -> None:
        self.errors_dir = errors_dir
        self.set_caps(max_files, max_bytes)
        agentfs.make_dirs(errors_dir, 0o700)
        self.fd = agentfs.open_root(errors_dir)
        self._sizes: OrderedDict[str, int] = OrderedDict()  # base -> bytes, oldest first
        self._bytes = 0
        self._load()

    def set_caps(self, max_files: int, max_bytes: int) -> None:
        """The caps from now on; the next entry put in prunes down to them."""
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.keep_limit = max(1024, max_bytes // 16)  # largest payload kept

    def close(self) -> None:
        os.close(self.fd)

    def _load(self) -> None:
        entries = []
        for name in agentfs.listdir(self.fd):
            if not name.endswith(META_SUFFIX):
                continue
            base = self._rename_old(name[: -len(META_SUFFIX)])
            st = agentfs.lstat(self.fd, base + META_SUFFIX)
            if st is not None:
                entries.append((st.st_mtime_ns, base))
        for _, base in sorted(entries):
            self._sizes[base] = self._entry_bytes(base)
            self._bytes += self._sizes[base]

    def _rename_old(self, base: str) -> str:
        """An entry of the old naming (`<group>-<name>`) under its name of today, read from
        its `.error.json`; the base it has now (unchanged when it cannot be told)."""
        text = agentfs.read_text(self.fd, base + META_SUFFIX, 1024 * 1024)
        try:
            meta = json.loads(text or "")
            group, (sub, _, name) = meta["source_group"], meta["original_file"].partition("/")
        except (ValueError, TypeError, KeyError, AttributeError):
            return base
        if not (isinstance(group, str) and sub and name):
            return base
        new = entry_base(group, sub, name)
        if new == base or agentfs.lstat(self.fd, new + META_SUFFIX) is not None:
            return base
        try:
            for suffix in (PAYLOAD_SUFFIX, META_SUFFIX):  # the meta last: it marks the entry
                if agentfs.lstat(self.fd, base + suffix) is not None:
                    agentfs.move(self.fd, base + suffix, self.fd, new + suffix)
        except (OSError, agentfs.UnsafePath) as e:
            log.warning("ipc: could not rename quarantine entry %s: %s", base, e)
            return base
        return new

    def _entry_bytes(self, base: str) -> int:
        total = 0
        for suffix in (PAYLOAD_SUFFIX, META_SUFFIX):
            st = agentfs.lstat(self.fd, base + suffix)
            total += st.st_size if st is not None else 0
        return total

    def _remove_entry_files(self, base: str) -> None:
        for suffix in (PAYLOAD_SUFFIX, META_SUFFIX):
            agentfs.remove_entry(self.fd, base + suffix)

    def put(self, group: str, src_dir_fd: int, sub: str, name: str, reason: str,
            processed_at: str | None = None) -> str:
        """Move `name` out of the open folder `src_dir_fd` into the quarantine with its
        reason. Returns the `.error` name. Never raises for a vanished source; raises
        OSError only if the errors folder itself cannot be written."""
        base = entry_base(group, sub, name)
        processed_at = processed_at or to_iso(utc_now())
        meta = {"original_file": f"{sub}/{name}", "source_group": group, "error": reason,
                "processed_at": processed_at}
        if base in self._sizes:
            self._bytes -= self._sizes.pop(base)
        agentfs.atomic_write(self.fd, base + META_SUFFIX,
                             (json.dumps(meta, ensure_ascii=False) + "\n").encode(), 0o600)
        agentfs.remove_entry(self.fd, base + PAYLOAD_SUFFIX)
        kept = False
        st = agentfs.lstat(src_dir_fd, name)
        if st is not None:
            if (stat.S_ISREG(st.st_mode) and st.st_nlink == 1
                    and st.st_size <= self.keep_limit):
                try:
                    agentfs.move(src_dir_fd, name, self.fd, base + PAYLOAD_SUFFIX)
                    kept = True
                except OSError:
                    kept = False
            if not kept:
                agentfs.remove_entry(src_dir_fd, name)
        if not kept:
            agentfs.write_sentinel(self.fd, base + PAYLOAD_SUFFIX, 0o600)
        log.warning("ipc: quarantined %s/%s/%s: %s", group, sub, name, reason)
        size = self._entry_bytes(base)
        self._sizes[base] = size
        self._bytes += size
        self._prune()
        return base + PAYLOAD_SUFFIX

    def _prune(self) -> None:
        pruned = 0
        while self._sizes and (len(self._sizes) > self.max_files
                               or self._bytes > self.max_bytes):
            base, size = self._sizes.popitem(last=False)
            self._bytes -= size
            self._remove_entry_files(base)
            pruned += 1
        if pruned:
            log.warning("ipc: errors/ over its cap (%d files, %d bytes): pruned the %d oldest "
                        "entr%s", self.max_files, self.max_bytes, pruned,
                        "y" if pruned == 1 else "ies")

    @property
    def count(self) -> int:
        return len(self._sizes)

    @property
    def total_bytes(self) -> int:
        return self._bytes


def list_errors(errors_dir: Path) -> list[ErrorEntry]:
    """Every quarantined file with its reason, oldest first (unreadable entries skipped)."""
    out = []
    try:
        fd = agentfs.open_root(errors_dir)
    except (FileNotFoundError, agentfs.UnsafePath):
        return []
    try:
        for name in agentfs.listdir(fd):
            if not name.endswith(META_SUFFIX):
                continue
            text = agentfs.read_text(fd, name, 1024 * 1024)
            try:
                meta = json.loads(text or "")
            except ValueError:
                continue
            if not isinstance(meta, dict):
                continue
            out.append(ErrorEntry(name[: -len(META_SUFFIX)] + PAYLOAD_SUFFIX,
                                  str(meta.get("original_file")), str(meta.get("source_group")),
                                  str(meta.get("error")), str(meta.get("processed_at"))))
    finally:
        os.close(fd)
    out.sort(key=lambda e: (e.processed_at, e.name))
    return out


def count_errors(errors_dir: Path) -> int:
    """How many files are quarantined (their reason files counted; none read)."""
    try:
        fd = agentfs.open_root(errors_dir)
    except (FileNotFoundError, agentfs.UnsafePath):
        return 0
    try:
        return sum(1 for name in agentfs.listdir(fd) if name.endswith(META_SUFFIX))
    finally:
        os.close(fd)


class QuarantineError(IpcError, ValueError):
    """An operator's request about a quarantine entry that cannot be met (a bad or unknown
    name). The message is safe to show."""


def _entry_base(name: str) -> str:
    """The entry's base (without suffix) from its `.error` name, checked to be one plain
    name in the folder."""
    if not name.endswith(PAYLOAD_SUFFIX) or name.endswith(META_SUFFIX):
        raise QuarantineError(f"{name!r} is not a quarantine entry (<group>.<sub>.<file>.error)")
    try:
        agentfs.check_name(name)
    except agentfs.UnsafePath:
        raise QuarantineError(f"{name!r} is not a quarantine entry") from None
    return name[: -len(PAYLOAD_SUFFIX)]


def read_error_payload(errors_dir: Path, name: str, limit: int = 64 * 1024) -> tuple[str, bool]:
    """The quarantined file's content as text (bad UTF-8 replaced) and whether it was cut at
    `limit` bytes; ("", False) when only the empty stand-in was kept. Raises QuarantineError
    for an unknown entry."""
    base = _entry_base(name)
    try:
        fd = agentfs.open_root(errors_dir)
    except (FileNotFoundError, agentfs.UnsafePath):
        raise QuarantineError(f"no quarantine entry {name!r}") from None
    try:
        if agentfs.lstat(fd, base + META_SUFFIX) is None:
            raise QuarantineError(f"no quarantine entry {name!r}")
        head = agentfs.read_head(fd, name, limit)
    finally:
        os.close(fd)
    if head is None:
        return "", False
    data, cut = head
    return data.decode("utf-8", errors="replace"), cut


def delete_error(errors_dir: Path, name: str) -> bool:
    """Remove quarantine entry `name` (its `.error` payload and `.error.json` reason).
    False when there was no such entry. Raises QuarantineError for a bad name. A running
    daemon's count of the folder catches up at its next start (its cap only ever errs on
    the side of keeping fewer entries)."""
    base = _entry_base(name)
    try:
        fd = agentfs.open_root(errors_dir)
    except (FileNotFoundError, agentfs.UnsafePath):
        return False
    try:
        found = agentfs.lstat(fd, base + META_SUFFIX) is not None
        for suffix in (META_SUFFIX, PAYLOAD_SUFFIX):  # the reason first: it marks the entry
            agentfs.remove_entry(fd, base + suffix)
    finally:
        os.close(fd)
    return found
