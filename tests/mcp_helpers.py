"""The MCP servers the tests run: two nobody here wrote (mcp-server-time, mcp-server-git, from
the package registry) and tests/mcp_servers/hostile.py (built with the SDK), all from the
environment `make mcp-servers` installs (.venv/mcp-servers; MDCLAW_MCP_SERVERS_BIN names
another bin folder). Without it the tests fail under CI=true and skip elsewhere."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOSTILE = REPO / "tests" / "mcp_servers" / "hostile.py"


def servers_bin() -> Path:
    """The bin folder of the MCP servers' environment (never resolved: its python is a
    symlink whose target is another environment's)."""
    found = Path(os.environ.get("MDCLAW_MCP_SERVERS_BIN") or REPO / ".venv" / "mcp-servers"
                 / "bin")
    if not (found / "mcp-server-time").exists():
        reason = f"no MCP servers in {found} (run `make mcp-servers`)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
    return found


def git_repo(path: Path) -> Path:
    """A git repository with one commit, for mcp-server-git."""
    path.mkdir(parents=True)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "add", "notes.txt"],
                ["git", "commit", "-q", "-m", "first notes"]):
        if cmd[1] == "add":
            (path / "notes.txt").write_text("plant the beans\n")
        subprocess.run(cmd, cwd=path, check=True, env=env, timeout=30)
    (path / "notes.txt").write_text("plant the beans\nwater them\n")
    return path


def servers_yaml(bin_dir: Path, tmp: Path, *, hostile_timeout: str = "60s",
                 secret_file: Path | None = None, repo: Path | None = None) -> str:
    """The `mcp_servers:` section: time, hostile (stdio), stuck (the same server with a
    timeout of 3 s, for its `hang` tool: the other tools get a timeout a loaded machine
    cannot reach, a 50 MB answer taking the SDK's server seconds to write) and, given a
    repository, git."""
    work = tmp / "mcp-work"
    work.mkdir(exist_ok=True)
    lines = [
        "mcp_servers:",
        f"  time: {{command: \"{bin_dir / 'mcp-server-time'}\", "
        "args: [--local-timezone, UTC]}",
        f"  hostile: {{command: \"{bin_dir / 'python'}\", args: [\"{HOSTILE}\"], "
        f"timeout: {hostile_timeout}, max_result_bytes: 1MiB, cwd: \"{work}\""
        + (f", env_files: {{SECRET_TOKEN: \"{secret_file}\"}}" if secret_file else "")
        + ", env: {PLAIN: visible}}",
        f"  stuck: {{command: \"{bin_dir / 'python'}\", args: [\"{HOSTILE}\"], "
        f"timeout: 3s, cwd: \"{work}\"}}",
    ]
    if repo is not None:
        lines.append(f"  git: {{command: \"{bin_dir / 'mcp-server-git'}\", "
                     f"args: [--repository, \"{repo}\"]}}")
    return "\n".join(lines) + "\n"
