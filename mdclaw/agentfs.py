"""The one door into folders an agent container can write.

A container writes `groups/<g>/`, `groups/global/` (main), `ipc/<g>/`, `sessions/<g>/.claude/`
and its read-write extra mounts, and everything there may be hostile: a symlink where the
host expects a file or a folder, a FIFO, a directory named like a file, a hard link to
something else, a file that grows while it is read, a folder swapped between two calls.
Every host operation on those trees goes through this module, and only through it (a test
fails when another module of mdclaw calls the file system itself):

* a tree is entered from a trusted root (a host-owned folder under `data_dir`, or the
  resolved host path of a mount) opened as a directory fd; folders below are reached with
  `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` where the kernel has it, else one
  `O_NOFOLLOW` open per component, so a symlink anywhere on the way is refused, never followed;
* files are opened relative to those fds with `O_NOFOLLOW | O_NONBLOCK` (a FIFO cannot block
  the host), must be regular, and are size-checked before and while reading;
* writes are atomic: a random `O_EXCL | O_NOFOLLOW` temp name in the same folder, `fchmod`,
  write, `fsync`, rename over the final name (a symlink there is replaced, never followed);
* modes are set with `fchmod` on an fd, never `chmod` on a path;
* copies out of a tree read at most limit + 1 bytes.

Errors: `UnsafePath` (refused: says why), `Rejected` (a command file to quarantine),
`Vanished` (gone before it could be read); anything else is an OSError.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import secrets
import shutil
import socket
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from mdclaw.errors import IpcError
from mdclaw.paths import (
    GLOBAL_DIR_MODE,
    GROUP_DIR_MODE,
    IPC_DIR_MODE,
    IPC_SUBDIRS,
    PRIVATE_DIR_MODE,
    PROXY_DIR_MODE,
    Layout,
)

log = logging.getLogger("mdclaw.agentfs")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
COPY_CHUNK = 1 << 20
COPY_SYNC_EVERY = 4 << 20  # bytes between flushes of a large copy (see copy_bounded)


class UnsafePath(IpcError):
    """A path the host refuses to use; str(e) is the reason."""


class Rejected(IpcError):
    """A file that must not be used (and, for a command file, is quarantined).

    `generation` identifies the directory entry (see `generation()`).
    """

    def __init__(self, reason: str, generation: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.generation = generation


class Vanished(IpcError):
    """The file disappeared before it could be read (someone else processed it)."""


def kind_of(mode: int) -> str:
    """What a mode is, for messages: 'a directory', 'a symlink', 'a FIFO'..."""
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
    if stat.S_ISREG(mode):
        return "a regular file"
    return "not a regular file"


def generation(st: os.stat_result) -> str:
    """A token that changes whenever a different file takes a name (inode + ctime)."""
    return f"{st.st_ino}.{st.st_ctime_ns}"


def check_name(name: str) -> str:
    """Return `name` if it is one plain path component; raise UnsafePath otherwise."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise UnsafePath(f"{name!r} is not a plain file or folder name")
    return name


# --------------------------------------------------------------------------- openat2

_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "armv7l": 437, "riscv64": 437, "ppc64le": 437,
                "s390x": 437, "i686": 437}


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


class _Openat2:
    """openat2(2) through libc's syscall(); `available` is False where the kernel or the
    platform lacks it (then the per-component walk is used)."""

    def __init__(self) -> None:
        self.available = False
        self._nr = _SYS_OPENAT2.get(os.uname().machine)
        self._libc: ctypes.CDLL | None = None
        if self._nr is None:
            return
        try:
            self._libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return
        try:
            fd = self.open(os.open("/", _DIR_FLAGS), ".", _DIR_FLAGS, close_dir=True)
        except OSError:
            return
        os.close(fd)
        self.available = True

    def open(self, dir_fd: int, path: str, flags: int, *, close_dir: bool = False) -> int:
        how = _OpenHow(flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS
                       | _RESOLVE_NO_MAGICLINKS)
        try:
            assert self._libc is not None and self._nr is not None
            fd = self._libc.syscall(ctypes.c_long(self._nr), ctypes.c_int(dir_fd),
                                    ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                                    ctypes.c_size_t(ctypes.sizeof(how)))
            err = ctypes.get_errno()
        finally:
            if close_dir:
                os.close(dir_fd)
        if fd < 0:
            raise OSError(err, os.strerror(err), path)
        return int(fd)


_openat2 = _Openat2()


def openat2_available() -> bool:
    """True when folders are reached with openat2 (else a per-component O_NOFOLLOW walk)."""
    return _openat2.available


# --------------------------------------------------------------------------- folders


def _refusal(name: str, dir_fd: int | None, err: OSError) -> UnsafePath:
    if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
        try:
            what = kind_of(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except (OSError, ValueError):
            what = "not a directory"
        return UnsafePath(f"{name} is {what}, not a directory; refused")
    return UnsafePath(f"cannot open {name}: {err.strerror}")


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
        raise _refusal(str(name), dir_fd, e) from None


def open_root(path: Path) -> int:
    """Open a host-owned folder as the trusted root of a tree: `data_dir` and the host's
    folders in it (`groups`, `ipc`, `sessions`, ...), or the resolved host path of a mount.
    No container can write where these names stand, so the path is opened as the host
    configured it (a symlinked `data_dir` works); everything below it is reached with
    `walk`. Raises FileNotFoundError, or UnsafePath if it is not a folder."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise UnsafePath(f"{path} is not a directory") from None


def walk(root_fd: int, parts: Sequence[str], *, create: int | None = None) -> int:
    """Open the folder root/parts[0]/.../parts[-1] as an fd, following no symlink.

    With `create` (a mode), missing folders are made and given that mode. Returns a new fd
    (a dup of `root_fd` for no parts). Raises FileNotFoundError (a folder is missing and
    `create` is None) or UnsafePath (a symlink or non-folder on the way, a bad name).
    """
    for p in parts:
        check_name(p)
    if not parts:
        return os.dup(root_fd)
    if create is None and _openat2.available:
        try:
            return _openat2.open(root_fd, "/".join(parts), _DIR_FLAGS)
        except FileNotFoundError:
            raise
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV, errno.EAGAIN):
                raise UnsafePath(f"cannot open {'/'.join(parts)}: {e.strerror}") from None
            # Fall through: the walk below names the component that was refused.
    fd = os.dup(root_fd)
    try:
        for p in parts:
            nfd = ensure_dir(fd, p, create) if create is not None else open_dir(p, fd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def opened(root: Path | int, *parts: str, create: int | None = None) -> Iterator[int]:
    """`walk` as a context manager; `root` is a trusted host path or an open fd."""
    if isinstance(root, int):
        fd = walk(root, parts, create=create)
    else:
        rfd = open_root(root)
        try:
            fd = walk(rfd, parts, create=create)
        finally:
            os.close(rfd)
    try:
        yield fd
    finally:
        os.close(fd)


def ensure_dir(dir_fd: int, name: str, mode: int, *, fix_mode: bool = False) -> int:
    """Open folder `name` in `dir_fd`, making it with `mode` when absent; returns its fd.

    The mode is set with fchmod on the new folder's fd (mkdir's own mode is masked by the
    umask and drops setgid); with `fix_mode`, an existing folder's mode is corrected too.
    Raises UnsafePath if `name` is a symlink or not a folder (also when one is swapped in
    between the mkdir and the open).
    """
    check_name(name)
    created = False
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
        created = True
    except FileExistsError:
        pass
    fd = open_dir(name, dir_fd)
    try:
        if created or fix_mode:
            if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
                os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dirs(path: Path, mode: int) -> None:
    """Make the host-owned folder `path` (and missing parents) and give the last one `mode`
    by fchmod. For `data_dir` and the host's own folders in it, never for a container's."""
    path = Path(path)
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for p in reversed(missing):
        with opened(p.parent) as parent:
            os.close(ensure_dir(parent, p.name, mode if p == missing[0] else 0o755))


def set_mode(dir_fd: int, name: str, mode: int) -> None:
    """Give folder `name` in `dir_fd` the `mode` (fchmod on its fd; a symlink is refused)."""
    fd = open_dir(name, dir_fd)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def lstat(dir_fd: int, name: str) -> os.stat_result | None:
    """The entry `name` in `dir_fd` itself (a symlink is not followed); None if absent."""
    try:
        return os.stat(check_name(name), dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def lstat_generation(dir_fd: int, name: str) -> str:
    """The generation of entry `name` without following it ('' if it is gone)."""
    try:
        return generation(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    except OSError:
        return ""


def listdir(dir_fd: int) -> list[str]:
    """The names in the open folder `dir_fd` (any order)."""
    return os.listdir(dir_fd)


def unlink(dir_fd: int, name: str, *, if_generation: str | None = None) -> bool:
    """Remove the non-folder entry `name` (a symlink itself, never its target).

    With `if_generation`, only while it is still that file. Returns True if removed; False
    if it was absent, another file, or a folder (folders are left alone).
    """
    check_name(name)
    if if_generation is not None and lstat_generation(dir_fd, name) != if_generation:
        return False
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except (FileNotFoundError, IsADirectoryError):
        return False
    except PermissionError:
        st = lstat(dir_fd, name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            return False
        raise


def remove_entry(dir_fd: int, name: str) -> None:
    """Remove `name` whatever it is; a folder with everything below it, walked by fds (a
    symlink inside is removed, never followed)."""
    st = lstat(dir_fd, name)
    if st is None:
        return
    try:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def move(src_dir_fd: int, name: str, dst_dir_fd: int, new_name: str) -> None:
    """Rename entry `name` of one open folder to `new_name` in another (same file system).
    The entry itself moves; nothing is followed. Raises OSError."""
    os.rename(check_name(name), check_name(new_name), src_dir_fd=src_dir_fd,
              dst_dir_fd=dst_dir_fd)


def ensure_group_dirs(layout: Layout, folder: str) -> None:
    """Make (or check) every folder a run of group `folder` mounts: groups/<folder>,
    groups/global, ipc/<folder> and its sub-folders, sessions/<folder>/.claude and the
    host's own proxy/<folder>, with their modes. Raises UnsafePath when one of them was
    swapped for a symlink or a file."""
    for root, mode in ((layout.groups_dir, 0o751), (layout.ipc_dir, 0o751),
                       (layout.sessions_dir, PRIVATE_DIR_MODE)):
        make_dirs(root, mode)
    with opened(layout.groups_dir) as groups:
        os.close(ensure_dir(groups, check_name(folder), GROUP_DIR_MODE))
        os.close(ensure_dir(groups, "global", GLOBAL_DIR_MODE))
    with opened(layout.ipc_dir) as ipc, opened(ipc, folder, create=IPC_DIR_MODE) as gfd:
        for sub in IPC_SUBDIRS:
            os.close(ensure_dir(gfd, sub, IPC_DIR_MODE))
    with opened(layout.sessions_dir, folder, ".claude", create=GROUP_DIR_MODE):
        pass
    make_dirs(layout.proxy_root, PROXY_DIR_MODE)
    with opened(layout.proxy_root) as proxy:
        os.close(ensure_dir(proxy, folder, PROXY_DIR_MODE, fix_mode=True))


# --------------------------------------------------------------------------- writing


def atomic_write(dir_fd: int, name: str, data: bytes, mode: int = 0o640, *,
                 durable: bool = True) -> None:
    """Write `data` to `name` in the open folder `dir_fd` atomically.

    A random `O_EXCL|O_NOFOLLOW` temp file is written, fchmod-ed to `mode`, fsynced (unless
    `durable=False`, for files rebuilt at every start) and renamed over `name`: readers see
    the old or the new file, never a part, and whatever stood at `name` (a symlink, a FIFO,
    a hard link) is replaced, not written through. Raises OSError if the folder cannot be
    written or `name` is a folder.
    """
    check_name(name)
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, _NEW_FILE_FLAGS, mode, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, mode)  # the umask must not take the group's read bit away
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def _numbered(name: str, n: int) -> str:
    """`name` with ` (n)` before its extension: photo.jpg -> photo (2).jpg."""
    stem, dot, ext = name.rpartition(".")
    if not dot or not stem:
        return f"{name} ({n})"
    return f"{stem} ({n}).{ext}"


def write_new_file(root: Path | int, parts: Sequence[str], name: str,
                   data: bytes | Iterable[bytes], limit: int, *, mode: int = 0o660,
                   dir_mode: int = GROUP_DIR_MODE, max_names: int = 1000) -> str:
    """Write `data` (bytes, or chunks of them) as a new file in root/parts[0]/.../parts[-1].

    Missing folders are made with `dir_mode`; a symlink or a non-folder on the way is refused
    (UnsafePath), never followed. The bytes go to a random `O_EXCL|O_NOFOLLOW` temp file
    (at most `limit` bytes: one more and the write stops with UnsafePath, nothing is left
    behind), fsynced, then hard-linked under `name`, or `name (2)`, `name (3)`... when that
    is taken by anything at all (a file, a symlink, a hard link, a folder): an existing entry
    is never replaced or written through. Returns the name used.
    """
    check_name(name)
    chunks: Iterable[bytes] = (data,) if isinstance(data, bytes | bytearray) else data
    with opened(root, *parts, create=dir_mode) as dfd:
        tmp = f".{secrets.token_hex(6)}.part.tmp"
        fd = os.open(tmp, _NEW_FILE_FLAGS, mode, dir_fd=dfd)
        try:
            try:
                os.fchmod(fd, mode)
                total = 0
                for chunk in chunks:
                    total += len(chunk)
                    if total > limit:
                        raise UnsafePath(f"larger than the limit of {limit} bytes")
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            for n in range(1, max_names + 1):
                candidate = name if n == 1 else _numbered(name, n)
                try:
                    os.link(tmp, candidate, src_dir_fd=dfd, dst_dir_fd=dfd,
                            follow_symlinks=False)
                except FileExistsError:
                    continue
                return candidate
            raise UnsafePath(f"no free name for {name!r} after {max_names} tries")
        finally:
            with suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)


def write_sentinel(dir_fd: int, name: str, mode: int = 0o660) -> None:
    """Make `name` an empty file in `dir_fd` (atomically, like `atomic_write`)."""
    atomic_write(dir_fd, name, b"", mode, durable=False)


def is_our_temp(name: str) -> bool:
    """True for the temp names `atomic_write` makes (`.<name>.<12 hex>.tmp`)."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return False
    token = name[:-4].rsplit(".", 1)[-1]
    return len(token) == 12 and all(c in "0123456789abcdef" for c in token)


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class FileData:
    data: bytes
    sha256: str
    generation: str
    mtime_ns: int = 0

    @property
    def ledger_key(self) -> str:
        return f"{self.sha256}@{self.generation}"


def open_regular(dir_fd: int, name: str, max_bytes: int, *,
                 allow_links: bool = False) -> tuple[int, os.stat_result]:
    """Open `name` in `dir_fd` for reading: returns (fd, fstat) of a regular file of at most
    `max_bytes` (with one link, unless `allow_links`). Raises Vanished if it is gone,
    Rejected with the reason otherwise. The caller closes the fd."""
    try:
        fd = os.open(check_name(name), _FILE_FLAGS, dir_fd=dir_fd)
    except UnsafePath as e:
        raise Rejected(str(e)) from None
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
            raise Rejected(f"{kind_of(st.st_mode)}, not a regular file; refused", gen)
        if st.st_nlink != 1 and not allow_links:
            raise Rejected(f"a file with {st.st_nlink} hard links; refused", gen)
        if st.st_size > max_bytes:
            raise Rejected(f"too large: {st.st_size} bytes (limit {max_bytes})", gen)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_fd_bounded(fd: int, max_bytes: int, size: int | None = None) -> bytes | None:
    """Read `fd` to its end, at most `max_bytes`; None when there is more (it grew).

    `size` (a regular file's size as fstat gave it) is asked for first, one byte more: a
    read of a regular file comes back short only at its end, so a file that did not grow
    is read in that one call, without a buffer of COPY_CHUNK and a second read for the end.
    One that grew goes on being read."""
    chunks = []
    left = max_bytes + 1
    if size is not None and size < max_bytes:
        chunk = os.read(fd, size + 1)
        if len(chunk) <= size:
            return chunk  # short: the end
        chunks.append(chunk)
        left -= len(chunk)
    while left > 0:
        chunk = os.read(fd, min(left, COPY_CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    data = b"".join(chunks)
    return None if len(data) > max_bytes else data


def read_file(dir_fd: int, name: str, max_bytes: int) -> FileData:
    """Read file `name` from the open folder `dir_fd`: its bytes, hash and generation.

    Raises Vanished if it is gone, Rejected (with the reason and generation) if it is not a
    regular single-link file within `max_bytes`, also when it grows while being read.
    """
    fd, st = open_regular(dir_fd, name, max_bytes)
    try:
        data = read_fd_bounded(fd, max_bytes, st.st_size)
    finally:
        os.close(fd)
    gen = generation(st)
    if data is None:
        raise Rejected(f"too large: grew beyond {max_bytes} bytes while being read", gen)
    return FileData(data, hashlib.sha256(data).hexdigest(), gen, st.st_mtime_ns)


def read_head(dir_fd: int, name: str, limit: int) -> tuple[bytes, bool] | None:
    """The first `limit` bytes of regular single-link file `name` and whether there was
    more; None if it is absent or not such a file. Never reads past `limit` + 1 bytes."""
    try:
        fd, _ = open_regular(dir_fd, name, 1 << 62)
    except (Vanished, Rejected):
        return None
    try:
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    return data[:limit], len(data) > limit


def read_text(dir_fd: int, name: str, max_bytes: int) -> str | None:
    """The text of regular file `name` (UTF-8, bad bytes replaced), or None if it is absent,
    not a regular single-link file, or larger than `max_bytes`."""
    try:
        return read_file(dir_fd, name, max_bytes).data.decode("utf-8", errors="replace")
    except (Vanished, Rejected, OSError):
        return None


def open_beneath(base_fd: int, parts: Sequence[str], max_bytes: int, *,
                 allow_links: bool = False) -> tuple[int, os.stat_result]:
    """Open the regular file base/parts[0]/.../parts[-1] without following any symlink on
    the way. Returns (fd, fstat). A file with more than one hard link is refused unless
    `allow_links` (a link may be a name for a file the container should not reach).
    Raises UnsafePath with the reason."""
    if not parts:
        raise UnsafePath("no file named")
    try:
        fd = walk(base_fd, parts[:-1])
    except FileNotFoundError:
        raise UnsafePath("a folder on the way does not exist") from None
    try:
        return open_regular(fd, parts[-1], max_bytes, allow_links=allow_links)
    except Vanished:
        raise UnsafePath(f"file {parts[-1]!r} does not exist") from None
    except Rejected as e:
        raise UnsafePath(f"{parts[-1]!r}: {e.reason}") from None
    finally:
        os.close(fd)


def copy_bounded(src_fd: int, dst_fd: int, limit: int, *, sync_every: int = 0) -> int:
    """Copy from `src_fd` to `dst_fd`, reading at most `limit` + 1 bytes. Returns the bytes
    copied. With `sync_every`, the copy is flushed to disk after each that many bytes, so a
    large copy never holds a long flush that other writers on the disk would wait behind.
    Raises UnsafePath when the source holds more than `limit` (it grew)."""
    total = unsynced = 0
    in_kernel = True  # copy_file_range: no round trip through this process's memory
    while True:
        want = min(COPY_CHUNK, limit + 1 - total)
        n = 0
        if in_kernel:
            try:
                n = os.copy_file_range(src_fd, dst_fd, want)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP,
                                   errno.EBADF):
                    raise
                in_kernel = False
        if not in_kernel:
            chunk = os.read(src_fd, want)
            view = memoryview(chunk)
            while view:
                view = view[os.write(dst_fd, view):]
            n = len(chunk)
        if not n:
            return total
        total += n
        if total > limit:
            raise UnsafePath(f"grew beyond the limit of {limit} bytes while being copied")
        unsynced += n
        if sync_every and unsynced >= sync_every:
            os.fdatasync(dst_fd)
            unsynced = 0


def copy_into(src_fd: int, dst_dir_fd: int, name: str, limit: int, mode: int = 0o600) -> int:
    """Copy `src_fd` into a new file `name` (O_EXCL|O_NOFOLLOW) in the host's folder
    `dst_dir_fd`, reading at most `limit` + 1 bytes, and fsync it. Returns the bytes copied.
    Raises UnsafePath when the source holds more than `limit` (nothing is left behind)."""
    dfd = os.open(check_name(name), _NEW_FILE_FLAGS, mode, dir_fd=dst_dir_fd)
    try:
        try:
            n = copy_bounded(src_fd, dfd, limit, sync_every=COPY_SYNC_EVERY)
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        with suppress(OSError):
            os.unlink(name, dir_fd=dst_dir_fd)
        raise
    return n


# --------------------------------------------------------------------------- measuring


@dataclass
class Usage:
    bytes: int = 0  # disk space used (allocated blocks: a sparse file counts what it holds)
    entries: int = 0
    complete: bool = True  # False when the walk stopped at its entry budget
    unreadable: int = 0  # folders that could not be opened: what is in them is not counted
    first_unreadable: str = ""  # the first of them, relative to the root, for messages


USAGE_MAX_FDS = 32  # folder fds `tree_usage` holds at once, whatever the tree's shape


def tree_usage(root_fd: int, *, max_entries: int = 200_000) -> Usage:
    """Disk space used below the open folder `root_fd`, walked by fds without following any
    symlink, reading no file. Stops after `max_entries` entries (then `complete` is False).

    A file with several hard links is counted once. At most `USAGE_MAX_FDS` folders are held
    open at a time: a folder with thousands of subfolders (or a very deep one) cannot make
    the host run out of file descriptors; subfolders beyond that are reopened from the root
    by their path (`walk`) when their turn comes. A folder that cannot be opened (its mode
    shuts mdclaw out, or its path is too long to reopen) is counted in `unreadable`; one
    that vanished or turned into a symlink meanwhile is skipped.
    """
    use = Usage()
    linked: set[tuple[int, int]] = set()
    # (an open fd, or None to reopen by path later; the path below the root)
    stack: list[tuple[int | None, tuple[str, ...]]] = [(os.dup(root_fd), ())]
    held = 1

    def unreadable(parts: tuple[str, ...]) -> None:
        use.unreadable += 1
        if not use.first_unreadable:
            use.first_unreadable = "/".join(parts)

    try:
        while stack:
            fd, parts = stack.pop()
            if fd is None:
                try:
                    fd = walk(root_fd, parts)
                except FileNotFoundError:
                    continue
                except UnsafePath as e:
                    if "not a directory" not in str(e):  # else: swapped meanwhile
                        unreadable(parts)
                    continue
                except OSError:
                    unreadable(parts)
                    continue
            else:
                held -= 1
            try:
                with os.scandir(fd) as it:
                    for entry in it:
                        use.entries += 1
                        if use.entries > max_entries:
                            use.complete = False
                            return use
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                            key = (st.st_dev, st.st_ino)
                            if key in linked:
                                continue
                            linked.add(key)
                        use.bytes += st.st_blocks * 512
                        if not stat.S_ISDIR(st.st_mode):
                            continue
                        child = parts + (entry.name,)
                        if held >= USAGE_MAX_FDS:
                            stack.append((None, child))
                            continue
                        try:
                            stack.append((open_dir(entry.name, fd), child))
                            held += 1
                        except FileNotFoundError:
                            continue
                        except UnsafePath as e:
                            if "not a directory" not in str(e):
                                unreadable(child)
                        except OSError:
                            unreadable(child)
            except OSError:
                unreadable(parts)
            finally:
                os.close(fd)
    finally:
        for fd, _ in stack:
            if fd is not None:
                os.close(fd)
    return use


@dataclass(frozen=True)
class FreeSpace:
    total: int  # bytes the file system holds
    free: int  # bytes an unprivileged user may still write (statvfs f_bavail)
    files_free: int  # inodes an unprivileged user may still use (0 where not counted)


def free_space(path: Path) -> FreeSpace:
    """Size and free space of the file system holding the host-owned folder `path`
    (`data_dir`), by fstatvfs on its fd. Raises FileNotFoundError, UnsafePath or OSError."""
    fd = open_root(path)
    try:
        st = os.fstatvfs(fd)
    finally:
        os.close(fd)
    return FreeSpace(total=st.f_blocks * st.f_frsize, free=st.f_bavail * st.f_frsize,
                     files_free=st.f_favail)


# --------------------------------------------------------------------------- sockets


def bind_socket(dir_fd: int, name: str, mode: int) -> socket.socket:
    """A listening unix socket at `name` in the host-owned folder `dir_fd`, with `mode`.

    The folder is reached through its fd (`/proc/self/fd/N/name`, so a long data_dir does
    not matter); a stale entry there is removed first. The mode is set on the new socket's
    own inode, through an O_PATH fd of it (checked to be the socket this process just bound),
    never with chmod on a path. Raises OSError or UnsafePath.
    """
    check_name(name)
    st = lstat(dir_fd, name)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise UnsafePath(f"{name} is a directory; refused")
        os.unlink(name, dir_fd=dir_fd)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"/proc/self/fd/{dir_fd}/{name}")
        pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            st = os.fstat(pfd)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
                raise UnsafePath(f"{name} was replaced while it was being bound; refused")
            os.chmod(f"/proc/self/fd/{pfd}", mode)
        finally:
            os.close(pfd)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


__all__ = [
    "COPY_CHUNK", "FileData", "FreeSpace", "Rejected", "USAGE_MAX_FDS", "UnsafePath", "Usage",
    "Vanished", "atomic_write", "bind_socket", "check_name", "copy_bounded", "copy_into",
    "ensure_dir", "ensure_group_dirs", "free_space", "generation", "is_our_temp", "kind_of",
    "listdir", "lstat", "lstat_generation", "make_dirs", "move", "open_beneath", "open_dir",
    "open_regular", "open_root", "openat2_available", "opened", "read_fd_bounded", "read_file",
    "read_text", "remove_entry", "set_mode", "tree_usage", "unlink", "walk", "write_new_file",
    "write_sentinel",
]


# --------------------------------------------------------------------------- whole trees
# (backup and restore: every file of a tree, read or written without following a symlink)


@dataclass(frozen=True)
class TreeEntry:
    parts: tuple[str, ...]  # the path below the root
    kind: str  # kind_of(mode): "folder", "file", "a symlink"...
    mode: int  # permission bits (with setgid/sticky)
    mtime: float
    uid: int
    gid: int


def iter_tree(root_fd: int, *, max_entries: int = 5_000_000) -> Iterator[TreeEntry]:
    """Every entry below the open folder `root_fd`, names sorted, a folder before what is in
    it, without following any symlink (a symlink, FIFO or socket is reported with its kind,
    never entered). A folder that vanished or turned into something else meanwhile is
    skipped. Raises UnsafePath after `max_entries` entries."""
    pending: list[tuple[str, ...]] = [()]
    seen = 0
    while pending:
        parts = pending.pop()
        try:
            fd = walk(root_fd, parts)
        except (FileNotFoundError, UnsafePath):
            continue
        try:
            names = sorted(os.listdir(fd))
            children = []
            for name in names:
                seen += 1
                if seen > max_entries:
                    raise UnsafePath(f"more than {max_entries} entries; refused")
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                entry = TreeEntry(parts + (name,), kind_of(st.st_mode),
                                  stat.S_IMODE(st.st_mode), st.st_mtime, st.st_uid, st.st_gid)
                yield entry
                if stat.S_ISDIR(st.st_mode):
                    children.append(entry.parts)
            pending.extend(reversed(children))
        finally:
            os.close(fd)


def open_tree_file(root_fd: int, parts: Sequence[str]) -> tuple[int, os.stat_result]:
    """Open the regular file root/parts for reading (no symlink followed on the way or at
    the end; hard links allowed). Raises Vanished, Rejected or UnsafePath."""
    dfd = walk(root_fd, parts[:-1])
    try:
        return open_regular(dfd, parts[-1], 1 << 62, allow_links=True)
    finally:
        os.close(dfd)


def make_tree_dir(root_fd: int, parts: Sequence[str], mode: int) -> None:
    """Make the folder root/parts (and missing folders on the way, 0o700) with `mode`;
    a symlink anywhere on the way is refused."""
    fd = walk(root_fd, parts, create=0o700)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def write_tree_file(root_fd: int, parts: Sequence[str], chunks: Iterable[bytes],
                    mode: int, *, dir_mode: int = 0o700) -> None:
    """Write a new file root/parts (O_EXCL|O_NOFOLLOW: an existing name or a symlink there
    is refused) from `chunks`, fchmod it to `mode` and fsync it. Missing folders on the way
    are made with `dir_mode`."""
    dfd = walk(root_fd, parts[:-1], create=dir_mode)
    try:
        fd = os.open(check_name(parts[-1]), _NEW_FILE_FLAGS, 0o600, dir_fd=dfd)
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


def chown_tree_entry(root_fd: int, parts: Sequence[str], uid: int, gid: int) -> None:
    """Give root/parts (a file or folder, never followed if a symlink) the owner uid:gid."""
    dfd = walk(root_fd, parts[:-1])
    try:
        os.chown(check_name(parts[-1]), uid, gid, dir_fd=dfd, follow_symlinks=False)
    finally:
        os.close(dfd)
