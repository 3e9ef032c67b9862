"""One door into container-writable folders: no module but mdclaw/agentfs.py touches the
file system there.

Two rules, checked on the source (AST) of every module in mdclaw/:

1. Outside `agentfs.py` and a short list of modules that only touch the host's own files
   (each with its reason), no module calls the file system at all: no `open`, `os.*` path
   call, `shutil.*`, or `Path` method that reads, writes, lists, stats or changes a file.
2. No module but `agentfs.py`, listed or not, makes such a call on an expression that names a
   container-writable tree (`layout.group_dir(...)`, `ipc_dir`, `sessions_dir`, ...).

The planted-violation tests show the checker fails on each kind of call it is meant to catch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mdclaw"
DOOR = "mdclaw/agentfs.py"

# Modules that touch only the host's own files, and why that is not a container's tree.
HOST_ONLY: dict[str, str] = {
    "mdclaw/config/load.py": "reads config.yaml",
    "mdclaw/config/secrets.py": "looks at and reads the secret files config.yaml names; "
                                "writes the generated HTTP token in data_dir",
    "mdclaw/config/extras.py": "looks for the programs config.yaml names on PATH "
                               "(integrations.home_assistant.chromium)",
    "mdclaw/state/db.py": "the state database file and its folder",
    "mdclaw/daemon/core.py": "the daemon's status file in data_dir",
    "mdclaw/ops/status.py": "reads the daemon's status file in data_dir",
    "mdclaw/ops/doctor.py": "doctor's checks: data_dir writable (a temp file, removed), the "
                            "WhatsApp session file's and the Matrix login's modes",
    "mdclaw/commands/channels.py": "the CLI checks the database path exists",
    "mdclaw/commands/core.py": "check-config reads the config file it checks (for line numbers)",
    "mdclaw/commands/containers.py": "the CLI checks files the operator names (image tarballs)",
    "mdclaw/backup.py": "the archive it writes or reads, its spool and staging folders, the "
                        "database and WhatsApp session files (SQLite), config.yaml, "
                        "backup-status.json; group and session trees only through agentfs",
    "mdclaw/nanoclaw.py": "looks for the NanoClaw store file it reads (read-only); group "
                          "folders only through agentfs",
    "mdclaw/runtime/__init__.py": "looks for the engine's API socket",
    "mdclaw/runtime/docker_engine.py": "reads an image tarball the operator names",
    "mdclaw/runtime/apple.py": "the Apple runtime's private secrets folder",
    "mdclaw/outbox.py": "removes the host's spool copies once a file row is final",
    "mdclaw/channels/base.py": "reads the host's spool copy of a file a channel uploads",
    "mdclaw/channels/http.py": "the host's spool copies and its own copies of sent files "
                               "(data_dir/http/files)",
    "mdclaw/channels/whatsapp.py": "the WhatsApp session file and link state in data_dir, "
                                   "and the host's spool copy of a file to upload",
    "mdclaw/channels/matrix.py": "the Matrix login's session file in data_dir/matrix, and "
                                 "the host's spool copy of a file to upload",
    "mdclaw/mounts.py": "resolves the host paths config.yaml names (opens nothing)",
    "mdclaw/webassets.py": "the web pages' packaged files (HTML, JavaScript, CSS)",
    "mdclaw/channels/webpush.py": "the web chat's VAPID key and push subscriptions in "
                                  "data_dir/http (host-owned, never mounted)",
    "mdclaw/proxy.py": "looks at the model key file's inode to notice a rotated key",
    "mdclaw/integrations/ha_dashboards.py": "the operator's Home Assistant dashboards_dir "
                                            "(host-owned, never mounted into a container; "
                                            "config refuses one inside a container tree)",
    "mdclaw/integrations/ha_screenshot.py": "finds the Chromium binary and removes the "
                                            "private profile folder it made in the host's "
                                            "temp dir",
}

OS_CALLS = {
    "open", "chmod", "lchmod", "chown", "lchown", "mkdir", "makedirs", "listdir", "scandir",
    "walk", "fwalk", "rename", "renames", "replace", "unlink", "remove", "removedirs", "rmdir",
    "symlink", "link", "stat", "lstat", "truncate", "utime", "mkfifo", "mknod", "access",
    "readlink", "statvfs", "chdir", "chroot",
}
OS_PATH_CALLS = {"exists", "lexists", "isdir", "isfile", "islink", "ismount", "getsize",
                 "getmtime", "realpath", "samefile"}
PATH_METHODS = {
    "mkdir", "chmod", "lchmod", "unlink", "rmdir", "write_text", "write_bytes", "read_text",
    "read_bytes", "iterdir", "glob", "rglob", "symlink_to", "hardlink_to",
    "is_dir", "is_file", "is_symlink", "is_socket", "is_fifo", "exists", "lstat", "stat",
    "rename", "resolve", "readlink", "owner", "samefile",
}
CONTAINER_TREES = ("group_dir", "group_ipc_dir", "ipc_dir", "sessions_dir", "groups_dir",
                   "global_dir", "/workspace", '"groups"', '"ipc"', '"sessions"',
                   "'groups'", "'ipc'", "'sessions'")


def _fs_call(node: ast.Call, aliases: dict[str, str]) -> str | None:
    """The name of the file-system call `node` makes, or None."""
    f = node.func
    if isinstance(f, ast.Name):
        if f.id == "open":
            return "open"
        if f.id in aliases:
            return aliases[f.id]
        return None
    if not isinstance(f, ast.Attribute):
        return None
    target = ast.unparse(f.value)
    if target == "os" and f.attr in OS_CALLS:
        return f"os.{f.attr}"
    if target == "os.path" and f.attr in OS_PATH_CALLS:
        return f"os.path.{f.attr}"
    if target == "shutil":
        return f"shutil.{f.attr}"
    if target in ("io", "builtins") and f.attr == "open":
        return f"{target}.open"
    if f.attr in PATH_METHODS and target not in ("os", "os.path", "self", "cls", "agentfs"):
        return f".{f.attr}()"
    return None


def violations(source: str, module: str) -> list[str]:
    """Every breach of the two rules in `source`, as 'module:line: why'."""
    if module == DOOR:
        return []
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "os.path", "shutil"):
            for a in node.names:
                if (node.module == "shutil" or a.name in OS_CALLS
                        or a.name in OS_PATH_CALLS):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _fs_call(node, aliases)
        if name is None:
            continue
        text = ast.unparse(node)
        tree_word = next((w for w in CONTAINER_TREES if w in text), None)
        if tree_word is not None:
            out.append(f"{module}:{node.lineno}: {name} on a container-writable folder "
                       f"({tree_word}); go through mdclaw.agentfs")
        elif module not in HOST_ONLY:
            out.append(f"{module}:{node.lineno}: {name} outside mdclaw.agentfs (the one door "
                       "into container-writable folders)")
    return out


def _modules() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))
            for p in sorted(PACKAGE.rglob("*.py"))]


def test_no_module_but_the_door_touches_the_file_system() -> None:
    found = [v for module, src in _modules() for v in violations(src, module)]
    assert found == [], "\n".join(found)


def test_the_host_only_list_names_real_modules() -> None:
    modules = {m for m, _ in _modules()}
    assert set(HOST_ONLY) <= modules, set(HOST_ONLY) - modules


@pytest.mark.parametrize(("module", "source", "expect"), [
    ("mdclaw/runner.py", "import os\nos.chmod(path, 0o700)\n", "os.chmod outside"),
    ("mdclaw/runner.py", "from os import chmod as c\nc(p, 0o700)\n", "os.chmod outside"),
    ("mdclaw/runner.py", "fd = os.open(d / '_close', os.O_WRONLY)\n", "os.open outside"),
    ("mdclaw/runner.py", "with open(tmp, 'w') as f:\n    pass\n", "open outside"),
    ("mdclaw/ipc/apply.py", "path.mkdir(mode=0o700)\n", ".mkdir() outside"),
    ("mdclaw/ipc/apply.py", "shutil.copyfileobj(a, b)\n", "shutil.copyfileobj outside"),
    ("mdclaw/ipc/apply.py", "names = os.listdir(fd)\n", "os.listdir outside"),
    ("mdclaw/queue.py", "os.unlink(name, dir_fd=fd)\n", "os.unlink outside"),
    ("mdclaw/reconcile.py", "st = path.lstat()\n", ".lstat() outside"),
    # Listed host-only modules still may not reach into a container's tree.
    ("mdclaw/daemon/core.py", "self.layout.group_dir(f).mkdir()\n", "container-writable"),
    ("mdclaw/config/secrets.py", "open(layout.ipc_dir / f / 'x')\n", "container-writable"),
    ("mdclaw/outbox.py", "os.chmod(layout.sessions_dir / f, 0o777)\n", "container-writable"),
])
def test_a_planted_violation_fails_the_check(module: str, source: str, expect: str) -> None:
    found = violations(source, module)
    assert found and expect in found[0], found


def test_the_door_itself_and_fd_calls_elsewhere_pass() -> None:
    assert violations("os.chmod(p, 0o700)\n", DOOR) == []
    assert violations("os.close(fd)\nos.fstat(fd)\nos.dup(fd)\n", "mdclaw/runner.py") == []
    assert violations("s = name.replace('a', 'b')\n", "mdclaw/runner.py") == []


def test_the_code_cites_no_document_outside_the_repository() -> None:
    """Comments and docstrings say what they mean in place, or point into docs/; no module
    names the documents the project grew from (the design lives in docs/architecture.md)."""
    outside = re.compile(r"\bseeds? ?\d{3}\b|\bDESIGN\b|\bNovaBot\b|\bFarmFriend\b|\bseed 00\d",
                         re.IGNORECASE)
    sources = list(PACKAGE.rglob("*.py")) + list((ROOT / "container").rglob("*.py"))
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in sources
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if outside.search(line)]
    assert found == [], "\n".join(found)
    assert outside.search("What a run does (seed 004's runContainer)")  # the check bites
