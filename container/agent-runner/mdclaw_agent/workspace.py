"""The workspace tools' file access: which paths a tool may read or write, and how.

Roots: the group folder (read-write; relative paths start there), each extra mount under the
extra folder (`/workspace/extra/<name>`; read-write unless mounted read-only) and the global
folder (read-write for the main group only, and only if its mount is writable). A path is
resolved with every symlink followed, and must still lie inside one of the roots; a symlink
that leads out is refused. Writes are refused on a read-only mount (`statvfs` ST_RDONLY, the
flag the kernel reports for a read-only bind mount) and on the global folder for other
groups. A write goes to a temporary file made with O_EXCL|O_NOFOLLOW in the resolved folder,
then renamed over the name: a symlink put there in the meantime is replaced, never followed.

Only the standard library is used.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class PathRefused(Exception):
    """The path is outside the roots, or not writable there; the message says why."""


@dataclass(frozen=True)
class Root:
    """One folder the tools may reach, as the container names it and as it really is."""

    label: str        # the container's name for it, e.g. /workspace/group
    path: Path        # where it is for this process (tests move it)
    real: Path        # `path` with symlinks resolved
    writable: bool    # policy: False for the global folder of a non-main group


@dataclass(frozen=True)
class Target:
    """A resolved path inside a root."""

    given: str
    real: Path
    root: Root

    @property
    def shown(self) -> str:
        """The path as the agent should see it: under the root's container name."""
        rel = self.real.relative_to(self.root.real)
        return self.root.label if rel == Path(".") else f"{self.root.label}/{rel.as_posix()}"


def make_roots(group_dir: Path, extra_dir: Path, global_dir: Path, *,
               is_main: bool) -> list[Root]:
    """The roots of this container: group folder, each folder under `extra_dir`, global."""
    roots = [_root("/workspace/group", group_dir, True)]
    try:
        names = sorted(os.listdir(extra_dir))
    except OSError:
        names = []
    for name in names:
        p = extra_dir / name
        if p.is_dir() and not p.is_symlink():
            roots.append(_root(f"/workspace/extra/{name}", p, True))
    if global_dir.is_dir():
        roots.append(_root("/workspace/global", global_dir, is_main))
    return roots


def _root(label: str, path: Path, writable: bool) -> Root:
    return Root(label, path, Path(os.path.realpath(path)), writable)


def mounted_readonly(path: Path) -> bool:
    """Whether the file system holding `path` (a folder) is mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _container_to_local(given: str, roots: list[Root]) -> Path:
    """A container path (`/workspace/group/x`) as this process reaches it (they are the same
    inside the container; tests put the roots elsewhere)."""
    for r in roots:
        if given == r.label or given.startswith(r.label + "/"):
            return r.path / given[len(r.label):].lstrip("/")
    return Path(given)


def real_path(local: Path) -> Path:
    """`local` with every symlink resolved, as the kernel would follow it: the longest part
    that exists is resolved strictly (a symlink loop or a file used as a folder is refused,
    never left half-resolved), and the names after it, which do not exist, are appended (they
    may not contain `..`)."""
    head = os.path.abspath(os.fspath(local)) if not local.is_absolute() else os.fspath(local)
    tail: list[str] = []
    while True:
        try:
            base = os.path.realpath(head, strict=True)
            break
        except FileNotFoundError:
            head, name = os.path.split(head)
            if not name:
                raise PathRefused(f"{local} does not exist") from None
            tail.insert(0, name)
        except OSError as e:
            raise PathRefused(f"{local} cannot be resolved: {e.strerror or e} (a symlink "
                              "loop, or a file used as a folder)") from None
    tail = [n for n in tail if n not in ("", ".")]
    if ".." in tail:
        raise PathRefused(f"{local} goes up (..) out of a folder that does not exist")
    return Path(base).joinpath(*tail)


def resolve(given: str, roots: list[Root], *, write: bool = False) -> Target:
    """The real path `given` names, checked to lie inside a root (and, for a write, in a
    writable one). Relative paths are relative to the group folder. Raises PathRefused."""
    if not given or "\0" in given:
        raise PathRefused("an empty path or one with a NUL byte names nothing")
    p = Path(given)
    local = _container_to_local(given, roots) if p.is_absolute() else roots[0].path / p
    real = real_path(local)
    for root in roots:
        if real == root.real or root.real in real.parents:
            break
    else:
        names = ", ".join(r.label for r in roots)
        if os.path.islink(local) or real != Path(os.path.abspath(local)):
            raise PathRefused(f"{given} leads through a symlink to {real}, outside the "
                              f"folders the tools may use ({names})")
        raise PathRefused(f"{given} is outside the folders the tools may use ({names})")
    target = Target(given, real, root)
    if write:
        if not root.writable:
            raise PathRefused(f"{root.label} is read-only for this group")
        folder = real if real == root.real else real.parent
        probe = folder
        while not probe.exists() and probe != root.real:
            probe = probe.parent
        if mounted_readonly(probe):
            raise PathRefused(f"{target.shown}: {root.label} is mounted read-only")
        if real == root.real:
            raise PathRefused(f"{target.shown} is a folder")
    return target


def atomic_write(target: Target, data: bytes) -> None:
    """Write `data` to the target: a temporary file beside it (O_EXCL|O_NOFOLLOW), fsync,
    rename. Missing parent folders are made (each checked to stay inside the root)."""
    parent = target.real.parent
    _make_parents(parent, target.root)
    mode = 0o644
    try:
        st = os.lstat(target.real)
        if stat.S_ISDIR(st.st_mode):
            raise PathRefused(f"{target.shown} is a folder")
        if stat.S_ISREG(st.st_mode):
            mode = stat.S_IMODE(st.st_mode)
    except FileNotFoundError:
        pass
    tmp = parent / f".{target.real.name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, target.real)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _make_parents(folder: Path, root: Root) -> None:
    missing: list[Path] = []
    p = folder
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        os.mkdir(d)
        real = Path(os.path.realpath(d))
        if real != root.real and root.real not in real.parents:
            raise PathRefused(f"{d} left {root.label} while it was being made")


# --------------------------------------------------------------------------- globbing


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A regular expression for a glob over '/'-separated relative paths: `*` and `?` stay
    within one path segment, `**` spans segments (`**/` also matches no folder at all),
    `[...]` is a character class."""
    out: list[str] = []
    i = 0
    n = len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = pattern.find("]", i + 2 if pattern[i + 1:i + 2] in ("!", "]") else i + 1)
            if j < 0:
                out.append(re.escape(c))
                i += 1
                continue
            body = pattern[i + 1:j]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL)


def walk_files(top: Path, *, limit: int) -> Iterator[tuple[Path, str]]:
    """(path, path relative to `top`) of the files under `top`, at most `limit` looked at;
    symlinked folders are not entered and hidden `.mdclaw` state is skipped."""
    seen = 0
    for folder, dirs, files in os.walk(top, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d != ".mdclaw")
        for name in sorted(files):
            seen += 1
            if seen > limit:
                return
            p = Path(folder) / name
            yield p, p.relative_to(top).as_posix()
