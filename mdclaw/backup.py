"""Backup and restore of one install: one archive, made while the daemon runs.

An archive is a tar stream compressed with zstd (frame checksums on), optionally encrypted
to an age recipient. Its members, in order:

    data/state.db             the state database, copied by SQLite's online backup API
    data/whatsapp/...         the WhatsApp session (a SQLite file: copied the same way)
    data/groups/...           every group folder and groups/global
    data/sessions/...         the agents' session folders
    data/http/...             the web chat's own copies of sent files
    config/config.yaml        the config file in force (restored beside the data, not over it)
    manifest.json             format, mdclaw and schema versions, every file's size and sha256

Left out on purpose: the IPC spool (`ipc/`: commands in flight belong to the running
daemon), the proxy's sockets, the daemon's status file, temp files, symlinks, FIFOs and
sockets (a container may plant them: they are listed in the manifest as skipped).

The database copy is one step of the backup API (`pages=-1`): one read transaction on a WAL
database, so it is the state of one commit while the daemon goes on writing (a stepped copy
would restart on every write of a busy daemon).

Restore reads the archive twice: first every member's checksum, name and type is checked
against the manifest and nothing is written; then it is unpacked into a new folder beside the
target (every file made with O_EXCL|O_NOFOLLOW through mdclaw.agentfs), the database is
migrated forward, and the folder is moved into place (an existing data_dir is kept, renamed
`<name>.before-restore-<time>`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import sqlite3
import stat
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import IO, Any

import zstandard

from mdclaw import __version__, agentfs
from mdclaw.config import Config
from mdclaw.config.types import format_size, validate_folder
from mdclaw.errors import StateError
from mdclaw.paths import DATA_DIR_MODE, Layout
from mdclaw.schedule import from_iso, to_iso, utc_now
from mdclaw.state import Database
from mdclaw.state.groups import get_group
from mdclaw.state.migrations import LATEST_VERSION

FORMAT = 1
MANIFEST = "manifest.json"
PREFIX = "mdclaw-backup-"
SUFFIX = ".tar.zst"
AGE_SUFFIX = ".age"
AGE_MAGIC = b"age-encryption.org/v1"
STATUS_FILE = "backup-status.json"  # in data_dir: the last successful backup
DAEMON_STATUS_FILE = "daemon-status.json"  # mdclaw.ops.status.STATUS_FILE
DAEMON_STALE_AFTER = 30.0  # mdclaw.ops.status.STALE_AFTER
CHUNK = 1 << 20
SPOOL_IN_MEMORY = 8 << 20  # a file up to this size is held in memory while archived
ZSTD_LEVEL = 10
# Top-level folders of data_dir copied as trees (container-writable or the host's own).
TREES = ("groups", "sessions", "http")
_ARCHIVE_NAME = re.compile(re.escape(PREFIX) + r"(\d{8}T\d{6}Z)(?:-(\d+))?"
                           + re.escape(SUFFIX) + r"(?:" + re.escape(AGE_SUFFIX) + r")?$")

Progress = Callable[[str], None]


class BackupError(StateError):
    """A backup could not be made, or an archive cannot be restored (the message says why
    and what to do)."""


@dataclass
class BackupResult:
    archive: Path
    size: int
    files: int
    bytes: int
    schema_version: int
    skipped: list[dict[str, str]]
    removed: list[str]
    encrypted: bool
    created_at: str

    def as_json(self) -> dict[str, Any]:
        return {"archive": str(self.archive), "size": self.size, "files": self.files,
                "bytes": self.bytes, "schema_version": self.schema_version,
                "skipped": self.skipped, "removed": self.removed,
                "encrypted": self.encrypted, "created_at": self.created_at}


@dataclass
class RestoreResult:
    data_dir: Path
    files: int
    schema_version: int  # the archive's
    migrated: list[int]  # migrations applied after unpacking
    previous: Path | None  # where the data_dir that was there went
    config: Path | None  # where the archive's config file was written
    manifest: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"data_dir": str(self.data_dir), "files": self.files,
                "schema_version": self.schema_version, "migrated": self.migrated,
                "previous": str(self.previous) if self.previous else None,
                "config": str(self.config) if self.config else None,
                "mdclaw_version": self.manifest.get("mdclaw_version")}


def _quiet(_: str) -> None:
    pass


# --------------------------------------------------------------------------- daemon


def daemon_pid(data_dir: Path) -> int | None:
    """The pid of a daemon running on `data_dir`, or None: the daemon publishes its status
    to data_dir/daemon-status.json every few seconds (mdclaw.ops.status); a fresh file whose
    pid is alive means it runs."""
    try:
        live = json.loads((data_dir / DAEMON_STATUS_FILE).read_text())
        pid = int(live["pid"])
        age = (utc_now() - from_iso(live["updated_at"])).total_seconds()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if age >= DAEMON_STALE_AFTER:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


# --------------------------------------------------------------------------- backup


class _Hashing(io.RawIOBase):
    """Read from `fd` into the archive, hashing what passes."""

    def __init__(self, src: IO[bytes]) -> None:
        self.src = src
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.src.read(len(b))
        self.sha.update(data)
        b[:len(data)] = data
        return len(data)


class _Writer:
    """The tar stream being written, with the manifest's file list."""

    def __init__(self, tar: tarfile.TarFile, progress: Progress) -> None:
        self.tar = tar
        self.files: list[dict[str, Any]] = []
        self.skipped: list[dict[str, str]] = []
        self.bytes = 0
        self.progress = progress

    def add_dir(self, name: str, mode: int, mtime: float, uid: int, gid: int) -> None:
        info = tarfile.TarInfo(name)
        info.type = tarfile.DIRTYPE
        info.mode, info.mtime, info.uid, info.gid = mode, int(mtime), uid, gid
        self.tar.addfile(info)

    def add_file(self, name: str, src: IO[bytes], size: int, *, mode: int, mtime: float,
                 uid: int = 0, gid: int = 0) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime, info.uid, info.gid = size, mode, int(mtime), uid, gid
        hashing = _Hashing(src)
        self.tar.addfile(info, io.BufferedReader(hashing, CHUNK))
        self.files.append({"path": name, "size": size, "sha256": hashing.sha.hexdigest(),
                           "mode": mode})
        self.bytes += size
        if len(self.files) % 200 == 0:
            self.progress(f"{len(self.files)} files, {format_size(self.bytes)}")

    def add_spooled(self, name: str, fd: int, st: os.stat_result, spool_dir: Path) -> None:
        """Copy the open file `fd` to a spool first (it may change while the daemon runs: the
        archive gets one size and one content), then into the archive."""
        with tempfile.SpooledTemporaryFile(SPOOL_IN_MEMORY, dir=str(spool_dir)) as spool:
            while chunk := os.read(fd, CHUNK):
                spool.write(chunk)
            size = spool.tell()
            spool.seek(0)
            self.add_file(name, spool, size, mode=stat.S_IMODE(st.st_mode),
                          mtime=st.st_mtime, uid=st.st_uid, gid=st.st_gid)


def _sqlite_copy(src: Path, dst: Path) -> None:
    """Copy the SQLite database `src` to the new file `dst` in one step of the online backup
    API: one read transaction, so one commit's state, whatever writers do meanwhile."""
    source = sqlite3.connect(f"file:{src}?mode=ro", uri=True, timeout=60)
    try:
        target = sqlite3.connect(dst)
        try:
            source.backup(target, pages=-1)
        finally:
            target.close()
    finally:
        source.close()


def _add_sqlite(w: _Writer, name: str, src: Path, spool_dir: Path) -> int | None:
    """Add a SQLite file's snapshot; returns its user_version."""
    snap = spool_dir / f"snap-{secrets.token_hex(4)}.db"
    try:
        _sqlite_copy(src, snap)
        conn = sqlite3.connect(snap)
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            conn.execute("PRAGMA journal_mode=DELETE")
        finally:
            conn.close()
        st = snap.stat()
        with snap.open("rb") as f:
            w.add_file(name, f, st.st_size, mode=0o600, mtime=st.st_mtime,
                       uid=os.getuid(), gid=os.getgid())
        return version
    finally:
        with suppress(FileNotFoundError):
            snap.unlink()


def _add_tree(w: _Writer, root: Path, arcname: str, spool_dir: Path) -> None:
    try:
        root_fd = agentfs.open_root(root)
    except FileNotFoundError:
        return
    try:
        st = os.fstat(root_fd)
        w.add_dir(arcname, stat.S_IMODE(st.st_mode), st.st_mtime, st.st_uid, st.st_gid)
        for entry in agentfs.iter_tree(root_fd):
            name = "/".join((arcname, *entry.parts))
            if entry.kind == "a directory":
                w.add_dir(name, entry.mode, entry.mtime, entry.uid, entry.gid)
                continue
            if entry.kind != "a regular file":
                w.skipped.append({"path": name, "reason": entry.kind})
                continue
            if agentfs.is_our_temp(entry.parts[-1]):
                continue
            try:
                fd, fst = agentfs.open_tree_file(root_fd, entry.parts)
            except agentfs.Vanished:
                continue
            except (agentfs.Rejected, agentfs.UnsafePath) as e:
                w.skipped.append({"path": name, "reason": str(e)})
                continue
            try:
                w.add_spooled(name, fd, fst, spool_dir)
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)


def archive_name(now: datetime, directory: Path, encrypted: bool) -> Path:
    stem = PREFIX + now.strftime("%Y%m%dT%H%M%SZ")
    suffix = SUFFIX + (AGE_SUFFIX if encrypted else "")
    path, n = directory / (stem + suffix), 1
    while path.exists():
        path, n = directory / f"{stem}-{n}{suffix}", n + 1
    return path


def list_archives(directory: Path) -> list[Path]:
    """The archives `mdclaw backup` made in `directory`, oldest first."""
    try:
        found = [(m, p) for p in directory.iterdir() if (m := _ARCHIVE_NAME.match(p.name))]
    except FileNotFoundError:
        return []
    # By time, then by the number a second archive of the same second got (-1, -2...).
    found.sort(key=lambda mp: (mp[0].group(1), int(mp[0].group(2) or 0)))
    return [p for _m, p in found]


def _recipients(recipient_file: Path | None) -> list[Any]:
    if recipient_file is None:
        return []
    pyrage = _pyrage()
    out = []
    for line in recipient_file.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            out.append(pyrage.ssh.Recipient.from_str(line) if line.startswith("ssh-")
                       else pyrage.x25519.Recipient.from_str(line))
        except pyrage.RecipientError as e:
            raise BackupError(f"{recipient_file}: not an age recipient: {line[:20]}...: "
                              f"{e}") from None
    if not out:
        raise BackupError(f"{recipient_file} names no age recipient")
    return out


def _pyrage() -> Any:
    try:
        import pyrage  # type: ignore[import-untyped]  # optional: the `age` extra
    except ImportError:
        raise BackupError("encryption needs the `age` extra: pip install 'mdclaw[age]'"
                          ) from None
    return pyrage


def make_backup(cfg: Config, config_path: Path | None, directory: Path, *,
                keep: int | None = None, recipient_file: Path | None = None,
                every: float | None = None, progress: Progress = _quiet) -> BackupResult:
    """Write one archive of `cfg`'s install into `directory`, then keep the newest `keep`
    archives there (None: all). Records the success in data_dir/backup-status.json."""
    data_dir = cfg.data_dir
    layout = Layout(data_dir)
    if not layout.db_path.exists():
        raise BackupError(f"no state database at {layout.db_path}: nothing to back up")
    recipients = _recipients(recipient_file)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = utc_now()
    final = archive_name(now, directory, bool(recipients))
    tmp = directory / f".{final.name}.{secrets.token_hex(4)}.tmp"
    with ExitStack() as stack:
        spool_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix=".mdclaw-backup-", dir=directory)))
        try:
            out = stack.enter_context(open(tmp, "x+b"))  # noqa: SIM115 - closed by the stack
            os.fchmod(out.fileno(), 0o600)
            cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True,
                                            threads=0)
            zout = stack.enter_context(cctx.stream_writer(out, closefd=False))
            tar = stack.enter_context(tarfile.open(fileobj=zout, mode="w|",
                                                   format=tarfile.PAX_FORMAT))
            w = _Writer(tar, progress)
            w.add_dir("data", DATA_DIR_MODE, now.timestamp(), os.getuid(), os.getgid())
            progress("copying the state database")
            schema = _add_sqlite(w, "data/state.db", layout.db_path, spool_dir)
            wa = cfg.whatsapp_session_path
            if wa.exists() and wa.is_relative_to(data_dir):
                _add_sqlite(w, "data/" + wa.relative_to(data_dir).as_posix(), wa, spool_dir)
            for tree in TREES:
                progress(f"copying {tree}/")
                _add_tree(w, data_dir / tree, f"data/{tree}", spool_dir)
            if config_path is not None and config_path.is_file():
                with config_path.open("rb") as f:
                    st = os.fstat(f.fileno())
                    w.add_file("config/config.yaml", f, st.st_size, mode=0o600,
                               mtime=st.st_mtime)
            manifest = {
                "format": FORMAT, "mdclaw_version": __version__, "schema_version": schema,
                "created_at": to_iso(now), "data_dir": str(data_dir),
                "files": w.files, "skipped": w.skipped,
            }
            files, total, skipped = len(w.files), w.bytes, w.skipped
            body = json.dumps(manifest, indent=1).encode()
            w.add_file(MANIFEST, io.BytesIO(body), len(body), mode=0o600,
                       mtime=now.timestamp())
            tar.close()
            zout.close()
            if recipients:
                progress("encrypting")
                out.flush()
                out.seek(0)
                enc_tmp = tmp.with_name(tmp.name + ".age")
                with open(enc_tmp, "xb") as enc:
                    os.fchmod(enc.fileno(), 0o600)
                    _pyrage().encrypt_io(out, enc, recipients)
                    enc.flush()
                    os.fsync(enc.fileno())
                out.close()
                os.replace(enc_tmp, tmp)
            else:
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, final)
        finally:
            with suppress(FileNotFoundError):
                tmp.unlink()
            with suppress(FileNotFoundError):
                tmp.with_name(tmp.name + ".age").unlink()
    removed = prune(directory, keep) if keep else []
    size = final.stat().st_size
    record_success(data_dir, final, size, every=every, at=now)
    return BackupResult(final, size, files, total, schema or 0, skipped,
                        [str(p) for p in removed], bool(recipients), to_iso(now))


def prune(directory: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` archives in `directory`; returns those removed."""
    if keep < 1:
        raise BackupError("--keep must be at least 1")
    old = list_archives(directory)[:-keep]
    for p in old:
        p.unlink()
    return old


# --------------------------------------------------------------------------- last backup


def record_success(data_dir: Path, archive: Path, size: int, *, every: float | None,
                   at: datetime) -> None:
    """data_dir/backup-status.json: when the last backup succeeded, and how often one is
    expected (`every` seconds; None: not scheduled), for doctor, the page and /metrics."""
    path = data_dir / STATUS_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"last_success": to_iso(at), "archive": str(archive),
                               "size": size, "every_seconds": every}))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


@dataclass(frozen=True)
class LastBackup:
    at: datetime | None  # None: never
    every: float | None  # seconds between scheduled backups, when known
    archive: str | None
    age: float | None  # seconds since `at`

    @property
    def missed(self) -> int:
        """Scheduled backups missed since the last success (0 when not scheduled)."""
        if self.every is None or self.age is None or self.every <= 0:
            return 0
        # A run may start late (the timer's random delay) and take a while: some grace.
        grace = min(self.every * 0.1, 3600.0)
        return max(0, int((self.age - grace) // self.every))

    @property
    def overdue(self) -> bool:
        """Two or more scheduled backups missed."""
        return self.missed >= 2

    def as_json(self) -> dict[str, Any]:
        return {"last_success": to_iso(self.at) if self.at else None,
                "age_seconds": self.age, "every_seconds": self.every,
                "archive": self.archive, "missed": self.missed, "overdue": self.overdue}


def last_backup(data_dir: Path, now: datetime | None = None) -> LastBackup | None:
    """What data_dir/backup-status.json says, or None when no backup was ever recorded."""
    try:
        data = json.loads((data_dir / STATUS_FILE).read_text())
        at = from_iso(data["last_success"])
        every = data.get("every_seconds")
        every = float(every) if every else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return LastBackup(None, None, None, None)
    age = ((now or utc_now()) - at).total_seconds()
    return LastBackup(at, every, data.get("archive"), age)


# --------------------------------------------------------------------------- restore


def _safe_member(m: tarfile.TarInfo) -> tuple[str, ...]:
    """The member's path as parts, or BackupError when it is not a plain relative path of a
    file or folder under data/ or config/ (or the manifest)."""
    name = m.name
    if not (m.isreg() or m.isdir()):
        kind = ("a symlink" if m.issym() else "a hard link" if m.islnk()
                else "a device or FIFO")
        target = f" -> {m.linkname!r}" if m.linkname else ""
        raise BackupError(f"the archive holds {kind} {name!r}{target}: refused (an mdclaw "
                          f"archive holds only files and folders)")
    pure = PurePosixPath(name)
    parts = pure.parts
    if (pure.is_absolute() or not parts or any(p in ("", ".", "..") for p in parts)
            or "\\" in name or "\0" in name):
        raise BackupError(f"the archive holds a path that leaves the target: {name!r}: "
                          f"refused")
    if name != MANIFEST and parts[0] not in ("data", "config"):
        raise BackupError(f"the archive holds an unexpected path {name!r}: refused")
    if m.isreg() and name == MANIFEST:
        return parts
    if parts[0] == "config" and name != "config/config.yaml":
        raise BackupError(f"the archive holds an unexpected path {name!r}: refused")
    return parts


@contextmanager
def _open_archive(archive: Path, identity_file: Path | None,
                  work_dir: Path) -> Iterator[IO[bytes]]:
    """The archive's zstd stream, decrypted first (to a private temp file) if it is
    age-encrypted."""
    with open(archive, "rb") as f:
        head = f.read(len(AGE_MAGIC))
        f.seek(0)
        if head != AGE_MAGIC:
            yield f
            return
        if identity_file is None:
            raise BackupError(f"{archive} is encrypted: pass --identity FILE (the age "
                              f"identity whose recipient it was made for)")
        pyrage = _pyrage()
        identities = []
        for line in identity_file.read_text().splitlines():
            if line.startswith("AGE-SECRET-KEY-"):
                identities.append(pyrage.x25519.Identity.from_str(line.strip()))
        if not identities:
            raise BackupError(f"{identity_file} holds no age identity (AGE-SECRET-KEY-...)")
        with tempfile.TemporaryFile(dir=work_dir) as plain:
            try:
                pyrage.decrypt_io(f, plain, identities)
            except pyrage.DecryptError as e:
                raise BackupError(f"cannot decrypt {archive}: {e}") from None
            plain.seek(0)
            yield plain


def _members(stream: IO[bytes]) -> Iterator[tuple[tarfile.TarInfo, tuple[str, ...],
                                                   IO[bytes] | None]]:
    dctx = zstandard.ZstdDecompressor()
    reader = dctx.stream_reader(stream, read_across_frames=True)
    with tarfile.open(fileobj=reader, mode="r|") as tar:
        for m in tar:
            parts = _safe_member(m)
            yield m, parts, tar.extractfile(m) if m.isreg() else None


def _corrupt(archive: Path, e: Exception) -> BackupError:
    return BackupError(f"{archive} is damaged or not an mdclaw backup ({e}); nothing was "
                       f"restored: use another archive")


def verify_archive(archive: Path, identity_file: Path | None = None, *,
                   work_dir: Path | None = None) -> dict[str, Any]:
    """Check every member of `archive` against its manifest (sha256 and size, nothing
    missing, nothing extra, only files and folders with safe names) and that this mdclaw can
    read its schema. Returns the manifest; raises BackupError, having written nothing."""
    work = work_dir or archive.parent
    seen: dict[str, tuple[int, str]] = {}
    manifest: dict[str, Any] | None = None
    try:
        with _open_archive(archive, identity_file, work) as stream:
            for m, _parts, f in _members(stream):
                if f is None:
                    continue
                if m.name in seen:
                    raise BackupError(f"the archive holds {m.name!r} twice: refused")
                sha = hashlib.sha256()
                n = 0
                body = b""
                while chunk := f.read(CHUNK):
                    sha.update(chunk)
                    n += len(chunk)
                    if m.name == MANIFEST:
                        body += chunk
                if m.name == MANIFEST:
                    manifest = json.loads(body)
                else:
                    seen[m.name] = (n, sha.hexdigest())
    except (zstandard.ZstdError, tarfile.TarError, EOFError, json.JSONDecodeError,
            UnicodeDecodeError) as e:
        raise _corrupt(archive, e) from None
    if manifest is None or not isinstance(manifest.get("files"), list):
        raise _corrupt(archive, ValueError("no manifest"))
    if manifest.get("format") != FORMAT:
        raise BackupError(f"{archive} has archive format {manifest.get('format')}; this "
                          f"mdclaw {__version__} reads format {FORMAT}: use the mdclaw "
                          f"{manifest.get('mdclaw_version')} that made it, or newer")
    listed = {e["path"]: (e["size"], e["sha256"]) for e in manifest["files"]}
    for name, (size, sha) in listed.items():
        if name == MANIFEST:
            continue
        if name not in seen:
            raise BackupError(f"{archive}: {name} is in the manifest but not in the "
                              f"archive: damaged; nothing was restored")
        if seen[name] != (size, sha):
            raise BackupError(f"{archive}: checksum mismatch for {name}: damaged; nothing "
                              f"was restored")
    extra = sorted(set(seen) - set(listed))
    if extra:
        raise BackupError(f"{archive}: {extra[0]} is not in the manifest: refused")
    version = int(manifest.get("schema_version") or 0)
    if version > LATEST_VERSION:
        raise BackupError(
            f"{archive} holds a database of schema version {version}, made by mdclaw "
            f"{manifest.get('mdclaw_version')}; this mdclaw {__version__} understands up to "
            f"schema version {LATEST_VERSION}: install mdclaw "
            f"{manifest.get('mdclaw_version')} or newer to restore it")
    return manifest


def restore(archive: Path, data_dir: Path, *, identity_file: Path | None = None,
            progress: Progress = _quiet) -> RestoreResult:
    """Restore `archive` into `data_dir` (see the module's doc). Refuses while a daemon runs
    on `data_dir`; verifies the whole archive before anything is written."""
    data_dir = Path(os.path.abspath(data_dir))
    pid = daemon_pid(data_dir)
    if pid is not None:
        raise BackupError(f"the mdclaw daemon (pid {pid}) is running on {data_dir}: stop it "
                          f"first (systemctl stop mdclaw), then restore")
    parent = data_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    progress("verifying every checksum")
    manifest = verify_archive(archive, identity_file, work_dir=parent)
    staging = parent / f".{data_dir.name}.restore-{secrets.token_hex(4)}"
    os.mkdir(staging, 0o700)
    config_text: bytes | None = None
    files = 0
    as_root = os.geteuid() == 0
    try:
        root_fd = agentfs.open_root(staging)
        try:
            listed = {e["path"]: e["sha256"] for e in manifest["files"]}
            progress("unpacking")
            with _open_archive(archive, identity_file, parent) as stream:
                for m, parts, f in _members(stream):
                    if m.name == MANIFEST:
                        continue
                    if parts == ("config", "config.yaml"):
                        assert f is not None
                        config_text = f.read()
                        if hashlib.sha256(config_text).hexdigest() != listed.get(m.name):
                            raise BackupError(f"{archive} changed while it was restored")
                        continue
                    rel = parts[1:]  # below data/
                    if f is None:
                        if rel:
                            agentfs.make_tree_dir(root_fd, rel, m.mode & 0o3777)
                        else:
                            os.fchmod(root_fd, m.mode & 0o777)
                    else:
                        sha = hashlib.sha256()

                        def chunks(src: IO[bytes] = f, h: Any = sha) -> Iterator[bytes]:
                            while chunk := src.read(CHUNK):
                                h.update(chunk)
                                yield chunk

                        agentfs.write_tree_file(root_fd, rel, chunks(), m.mode & 0o777)
                        if sha.hexdigest() != listed.get(m.name):
                            raise BackupError(f"{archive} changed while it was restored: "
                                              f"nothing was restored")
                        files += 1
                    if as_root:  # the owners of the backup (the service's user)
                        if rel:
                            agentfs.chown_tree_entry(root_fd, rel, m.uid, m.gid)
                        else:
                            os.fchown(root_fd, m.uid, m.gid)
        finally:
            os.close(root_fd)
        progress("migrating the database")
        with Database(staging / "state.db", migrate=False) as db:
            migrated = db.migrate()
        for leftover in ("state.db-wal", "state.db-shm"):
            with suppress(FileNotFoundError):
                (staging / leftover).unlink()
        previous = None
        if data_dir.exists():
            if data_dir.is_symlink() or not data_dir.is_dir():
                raise BackupError(f"{data_dir} is not a folder: refused")
            stamp = utc_now().strftime("%Y%m%dT%H%M%SZ")
            previous = data_dir.with_name(f"{data_dir.name}.before-restore-{stamp}")
            if daemon_pid(data_dir) is not None:
                raise BackupError(f"the mdclaw daemon started on {data_dir} meanwhile: "
                                  f"stop it, then restore")
            os.rename(data_dir, previous)
        os.rename(staging, data_dir)
    except BaseException:
        if staging.exists():
            _remove_tree(staging)
        raise
    config_out = None
    if config_text is not None:
        config_out = data_dir / "config.restored.yaml"
        fd = os.open(config_out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(config_text)
    return RestoreResult(data_dir, files, int(manifest.get("schema_version") or 0), migrated,
                         previous, config_out, manifest)


def _remove_tree(path: Path) -> None:
    """Remove the staging folder this restore made (its own files: no symlink in it)."""
    import shutil  # noqa: PLC0415 - only on a failed restore

    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- export


def _rows(db: Database, sql: str, params: tuple) -> list[dict[str, Any]]:
    return [dict(r) for r in db.query(sql, params)]


def export_group(cfg: Config, folder: str, out: Path) -> dict[str, Any]:
    """Everything of group `folder` as a zip: group.json, messages.json (what came in from
    its chat), transcript.json (what it said and heard, task runs too), tasks.json (its
    scheduled tasks with their runs), outbox.json, and its folder under files/. For a person
    who asks for their data. Returns counts."""
    try:
        validate_folder(folder)
    except ValueError as e:
        raise BackupError(str(e)) from None
    if not cfg.db_path.exists():
        raise BackupError(f"no state database at {cfg.db_path}: nothing to export")
    try:
        return _export(cfg, folder, out)
    except sqlite3.Error as e:
        raise BackupError(f"cannot read {cfg.db_path}: {e}") from None


def _export(cfg: Config, folder: str, out: Path) -> dict[str, Any]:
    import zipfile  # noqa: PLC0415 - only this command

    with Database(cfg.db_path, readonly=True) as db:
        g = get_group(db, folder)
        if g is None:
            raise BackupError(f"no group {folder!r} (see `mdclaw groups list`)")
        group = dict(db.query_one("SELECT * FROM registered_groups WHERE folder = ?",
                                  (folder,)) or {})
        chats = list(g.all_chats)
        marks = ", ".join("?" * len(chats))
        sql = ("SELECT id, chat_jid, sender, sender_name, content, timestamp, is_from_me, "  # noqa: S608 - only placeholders
               "is_bot_message, attachments FROM messages "
               f"WHERE chat_jid IN ({marks}) ORDER BY seq")
        messages = _rows(db, sql, tuple(chats)) if chats else []
        # The rows written so far, then the replies whose rows the indexer has not written
        # yet (read from the view that defines them: this connection may not write).
        transcript = _rows(db, "SELECT kind, direction, chat_jid, sender, task_id, ts, body "
                               "FROM (SELECT kind, direction, chat_jid, sender, task_id, ts, "
                               "body, 0 AS queued, id FROM transcript WHERE group_folder = ? "
                               "UNION ALL SELECT 'reply', 'out', chat_jid, sender, NULL, ts, "
                               "body, 1, id FROM transcript_queued_reply_rows "
                               "WHERE group_folder = ?) ORDER BY ts, queued, id",
                           (folder, folder))
        tasks = _rows(db, "SELECT * FROM scheduled_tasks WHERE group_folder = ? ORDER BY "
                          "created_at", (folder,))
        for t in tasks:
            t["runs"] = _rows(db, "SELECT run_at, status, result, error, duration_ms FROM "
                                  "task_run_logs WHERE task_id = ? ORDER BY id", (t["id"],))
        outbox = _rows(db, "SELECT kind, chat_jid, text, file_name, status, created_at, "
                           "sent_at FROM outbox WHERE source_group = ? OR chat_jid = ? "
                           "ORDER BY id", (folder, g.jid or ""))
    files = 0
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    try:
        with zipfile.ZipFile(tmp, "x", zipfile.ZIP_DEFLATED) as z:
            for name, obj in (("group.json", group), ("messages.json", messages),
                              ("transcript.json", transcript), ("tasks.json", tasks),
                              ("outbox.json", outbox)):
                z.writestr(name, json.dumps(obj, indent=1, ensure_ascii=False, default=str))
            try:
                root_fd = agentfs.open_root(Layout(cfg.data_dir).group_dir(folder))
            except FileNotFoundError:
                root_fd = -1
            if root_fd >= 0:
                try:
                    for entry in agentfs.iter_tree(root_fd):
                        if entry.kind != "a regular file":
                            continue
                        try:
                            fd, _ = agentfs.open_tree_file(root_fd, entry.parts)
                        except (agentfs.Vanished, agentfs.Rejected, agentfs.UnsafePath):
                            continue
                        with os.fdopen(fd, "rb") as f, \
                                z.open("files/" + "/".join(entry.parts), "w") as zf:
                            while chunk := f.read(CHUNK):
                                zf.write(chunk)
                        files += 1
                finally:
                    os.close(root_fd)
        os.replace(tmp, out)
    finally:
        with suppress(FileNotFoundError):
            tmp.unlink()
    return {"group": folder, "out": str(out), "messages": len(messages),
            "transcript": len(transcript), "tasks": len(tasks), "files": files}
