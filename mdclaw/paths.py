"""Where things live under data_dir, and the modes they get.

Group and IPC folders are setgid and group-writable: the agent container runs as uid 1000
with the daemon's group added, so it can write its own IPC folder and nothing else. Which of
these folders a container can write, and so which go through `mdclaw.agentfs` only:
groups/<g>/, groups/global/, ipc/<g>/ and sessions/<g>/.claude/.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

IPC_SUBDIRS = ("messages", "tasks", "input", "actions", "action_results")
GROUP_DIR_MODE = 0o2770
IPC_DIR_MODE = 0o2770
GLOBAL_DIR_MODE = 0o2770
PRIVATE_DIR_MODE = 0o700
DATA_DIR_MODE = 0o751
# The credential proxy's socket folders: the host's own, readable (not writable) by the
# daemon's group, which the agent container runs with; mounted read-only into the container.
PROXY_DIR_MODE = 0o750
PROXY_SOCKET_NAME = "proxy.sock"


@dataclass(frozen=True)
class Layout:
    data_dir: Path

    @property
    def db_path(self) -> Path:
        return self.data_dir / "state.db"

    @property
    def groups_dir(self) -> Path:
        return self.data_dir / "groups"

    @property
    def global_dir(self) -> Path:
        return self.groups_dir / "global"

    @property
    def ipc_dir(self) -> Path:
        return self.data_dir / "ipc"

    @property
    def errors_dir(self) -> Path:
        return self.ipc_dir / "errors"

    @property
    def sessions_dir(self) -> Path:
        return self.data_dir / "sessions"

    def group_dir(self, folder: str) -> Path:
        return self.groups_dir / folder

    def group_ipc_dir(self, folder: str) -> Path:
        return self.ipc_dir / folder

    @property
    def proxy_root(self) -> Path:
        return self.data_dir / "proxy"

    def proxy_dir(self, folder: str) -> Path:
        return self.proxy_root / folder

    def proxy_socket(self, folder: str) -> Path:
        return self.proxy_dir(folder) / PROXY_SOCKET_NAME
