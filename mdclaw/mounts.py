"""Mount security: which extra host folders a group's container may see, and how.

A group's `mounts` in config.yaml are requests. Each one is granted only when:

* the host path exists and, with every symlink resolved, lies under one of
  `mount_policy.allowed_roots` (no roots configured: no extra mounts at all);
* neither the path as written nor the resolved path has a component matching a blocked
  pattern (`BLOCKED_PATTERNS` plus `mount_policy.blocked_patterns`), and the folder itself
  holds no entry with a blocked name (mounting a home folder would expose its `.ssh`);
* the container name is a relative path without `..`, `:` or `,` (it lands under
  /workspace/extra/<name>, and those characters would break the engines' mount syntax).

Read-write is granted only when the mount asks for it, its root allows it, and the group is
main or `non_main_read_only` is off; otherwise the mount is read-only. A refused mount is
reported by `mdclaw check-config` and skipped, with a warning, when the container starts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mdclaw import agentfs
from mdclaw.config import Config, GroupMount, MountPolicy

log = logging.getLogger("mdclaw.mounts")

EXTRA_ROOT = "/workspace/extra"
GROUP_ROOT = "/workspace/group"

BLOCKED_PATTERNS: tuple[str, ...] = (
    ".ssh", ".gnupg", ".gpg", ".aws", ".azure", ".gcloud", ".kube", ".docker", "credentials",
    ".env", ".netrc", ".npmrc", ".pypirc", "id_rsa", "id_ed25519", "private_key", ".secret",
)


@dataclass(frozen=True)
class MountDecision:
    """The verdict on one requested mount. `reason` is None when it is granted."""

    request: GroupMount
    host: str | None  # resolved host path (when it could be resolved)
    container: str  # absolute path inside the container
    readonly: bool
    reason: str | None = None
    note: str | None = None  # e.g. "read-write requested but granted read-only: ..."

    @property
    def allowed(self) -> bool:
        return self.reason is None


def blocked_patterns(policy: MountPolicy) -> tuple[str, ...]:
    extra = tuple(p for p in policy.blocked_patterns if p)
    return BLOCKED_PATTERNS + tuple(p for p in extra if p not in BLOCKED_PATTERNS)


def _blocked_part(path: str, patterns: tuple[str, ...]) -> str | None:
    """The first (component, pattern) hit, rendered for a message, or None."""
    for part in PurePosixPath(path).parts:
        low = part.lower()
        for pat in patterns:
            if pat.lower() in low:
                return f"{part!r} matches blocked pattern {pat!r}"
    return None


def check_container_path(name: str) -> str | None:
    """Why `name` cannot be a container path under /workspace/extra, or None if it can."""
    if not name or not name.strip():
        return "container path is empty"
    if name.startswith("/"):
        return f"container path {name!r} must be relative (it goes under {EXTRA_ROOT}/)"
    if ":" in name or "," in name:
        return f"container path {name!r} must not contain ':' or ','"
    if any(c in name for c in "\0\n\r"):
        return f"container path {name!r} contains a control character"
    parts = name.split("/")
    if ".." in parts:
        return f"container path {name!r} must not contain '..'"
    if any(p in ("", ".") for p in parts):
        return f"container path {name!r} has an empty or '.' component"
    return None


def validate_mount(m: GroupMount, policy: MountPolicy, *, is_main: bool) -> MountDecision:
    """Decide one requested mount for a (main or non-main) group. Never raises."""
    container = f"{EXTRA_ROOT}/{m.container}"
    patterns = blocked_patterns(policy)

    def refuse(reason: str, host: str | None = None) -> MountDecision:
        return MountDecision(m, host, container, True, reason)

    bad = check_container_path(m.container)
    if bad:
        return refuse(bad)
    raw = os.path.expanduser(m.host)
    if not os.path.isabs(raw):
        return refuse(f"host path {m.host!r} must be absolute")
    hit = _blocked_part(raw, patterns)
    if hit:
        return refuse(f"host path {m.host!r}: {hit}")
    try:
        real = str(Path(raw).resolve(strict=True))
    except FileNotFoundError:
        return refuse(f"host path {m.host!r} does not exist")
    except (OSError, RuntimeError) as e:  # symlink loop, permission denied
        return refuse(f"host path {m.host!r} cannot be resolved: {e}")
    hit = _blocked_part(real, patterns)
    if hit:
        return refuse(f"host path {m.host!r} resolves to {real!r}: {hit}", real)
    if not os.path.isdir(real):
        return refuse(f"host path {m.host!r} is not a directory", real)
    try:
        with agentfs.opened(Path(real)) as fd:
            children = agentfs.listdir(fd)
    except (OSError, agentfs.UnsafePath) as e:
        return refuse(f"host path {m.host!r} cannot be listed: {e}", real)
    for child in children:
        low = child.lower()
        pat = next((p for p in patterns if p.lower() in low), None)
        if pat:
            return refuse(f"host path {m.host!r} contains {child!r} (blocked pattern {pat!r}); "
                          "mount a folder that holds no secrets", real)
    if not policy.allowed_roots:
        return refuse("no mount_policy.allowed_roots are configured, so no extra mounts are "
                      "allowed", real)
    root = None
    for r in policy.allowed_roots:
        root_real = os.path.realpath(os.path.expanduser(r.path))
        if real == root_real or real.startswith(root_real.rstrip("/") + "/"):
            root = r
            break
    if root is None:
        roots = ", ".join(r.path for r in policy.allowed_roots)
        return refuse(f"host path {m.host!r} (resolved {real!r}) is not under an allowed root "
                      f"({roots})", real)
    readonly = True
    note = None
    if not m.readonly:
        if not root.allow_read_write:
            note = f"read-write requested but root {root.path!r} allows read-only"
        elif not is_main and policy.non_main_read_only:
            note = "read-write requested but non-main groups get read-only mounts " \
                   "(mount_policy.non_main_read_only)"
        else:
            readonly = False
    return MountDecision(m, real, container, readonly, None, note)


def group_mounts(cfg: Config, folder: str) -> list[MountDecision]:
    """Decisions for every mount the group `folder` asks for (duplicates refused)."""
    group = cfg.groups.get(folder)
    if group is None:
        return []
    out: list[MountDecision] = []
    seen: set[str] = set()
    for m in group.mounts:
        d = validate_mount(m, cfg.mount_policy, is_main=group.main)
        if d.allowed and d.container in seen:
            d = MountDecision(m, d.host, d.container, True,
                              f"container path {m.container!r} is used twice")
        seen.add(d.container)
        out.append(d)
    return out


def granted_mounts(cfg: Config, folder: str) -> list[MountDecision]:
    """The extra mounts group `folder`'s container gets: the allowed decisions of
    `group_mounts`. The runner mounts exactly these, and every host action that resolves a
    /workspace/extra/... path (send_file) uses exactly these: a refused mount is not read."""
    return [d for d in group_mounts(cfg, folder) if d.allowed]


def resolve_container_path(cfg: Config, folder: str, path: str,
                           groups_dir: Path) -> tuple[Path, list[str], bool]:
    """Where the container path `path` of group `folder` lives on the host.

    Returns (trusted host root, components below it, read-only). For /workspace/group/...
    (or a relative path) the root is `groups_dir` and the components start with `folder`;
    under /workspace/extra/ it is the resolved host folder of the granted mount that holds
    `path` (the longest match). Raises ValueError saying why for a path outside those, under
    a refused mount, with `..`, a NUL byte or no file name.
    """
    if "\0" in path:
        raise ValueError("path contains a NUL byte")
    if not path.startswith("/"):
        path = f"{GROUP_ROOT}/{path}"
    roots: list[tuple[str, Path, list[str], bool]] = [(GROUP_ROOT, groups_dir, [folder], False)]
    roots += [(d.container, Path(d.host), [], d.readonly) for d in granted_mounts(cfg, folder)
              if d.host is not None]
    best = None
    for root in roots:
        prefix = root[0]
        if (path == prefix or path.startswith(prefix + "/")) and (
                best is None or len(prefix) > len(best[0])):
            best = root
    if best is None:
        if path.startswith(EXTRA_ROOT + "/"):
            raise ValueError(f"{path} is not under a mount this group's container has")
        raise ValueError(f"{path} is outside {GROUP_ROOT} and the group's extra mounts")
    prefix, host, lead, readonly = best
    parts = [p for p in path[len(prefix):].split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"{path}: '..' is not allowed")
    if not parts:
        raise ValueError(f"{path} names a folder, not a file")
    return host, lead + parts, readonly


def check_config(cfg: Config) -> Iterator[str]:
    """Problem lines for `mdclaw check-config`: every refused mount, with its reason."""
    for folder in cfg.groups:
        for i, d in enumerate(group_mounts(cfg, folder)):
            if not d.allowed:
                yield f"groups.{folder}.mounts.{i}: mount refused: {d.reason}"


__all__ = ["BLOCKED_PATTERNS", "EXTRA_ROOT", "GROUP_ROOT", "MountDecision",
           "blocked_patterns", "check_config", "check_container_path", "granted_mounts",
           "group_mounts", "resolve_container_path", "validate_mount"]
