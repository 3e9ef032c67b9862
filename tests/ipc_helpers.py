"""Shared set-up for the IPC tests: a reconciled data dir with three groups, real files."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import textwrap
from pathlib import Path
from typing import Any

from mdclaw.config import load_config
from mdclaw.ipc.apply import IpcEngine
from mdclaw.ipc.worker import ActionWorker
from mdclaw.reconcile import reconcile
from mdclaw.state import Database

MAIN_JID, FAMILY_JID, WORK_JID = "tg:1", "tg:2", "tg:3"
JIDS = {"main": MAIN_JID, "family": FAMILY_JID, "work": WORK_JID}

CONFIG = """\
data_dir: {data_dir}
assistant:
  name: Andy
  timezone: Europe/Berlin
groups:
  main:
    name: Admin
    jid: "tg:1"
    main: true
  family:
    name: Family
    jid: "tg:2"
  work:
    name: Work
    jid: "tg:3"
limits:
  errors_max_files: {max_files}
  errors_max_bytes: {max_bytes}
"""

_seq = itertools.count()


def make_config(tmp_path: Path, *, extra_groups: int = 0, max_files: int = 1000,
                max_bytes: int = 64 * 1024 * 1024, extra: str = "", family: str = "") -> Path:
    """Write a config with main, family, work (and `extra_groups` more: g000, g001...).
    `family` is YAML added to the family group (indented by the caller's 4 spaces)."""
    text = CONFIG.format(data_dir=tmp_path / "data", max_files=max_files, max_bytes=max_bytes)
    text = text.replace('    jid: "tg:2"\n', '    jid: "tg:2"\n' + family)
    if extra_groups:
        lines = []
        for i in range(extra_groups):
            lines.append(f"  g{i:03d}:\n    name: G{i}\n    jid: \"tg:g{i}\"\n")
        text = text.replace("limits:", "".join(lines) + "limits:")
    text += textwrap.dedent(extra)
    p = tmp_path / "config.yaml"
    p.write_text(text)
    return p


class Env:
    """A reconciled data dir plus an engine over it."""

    def __init__(self, tmp_path: Path, **kw: Any) -> None:
        self.config_path = make_config(tmp_path, **kw)
        self.cfg = load_config(self.config_path)
        self.db = Database(self.cfg.db_path)
        reconcile(self.cfg, self.db)
        self.data = self.cfg.data_dir
        self.ipc = self.data / "ipc"
        self.errors = self.ipc / "errors"
        self._engine: IpcEngine | None = None

    @property
    def engine(self) -> IpcEngine:
        if self._engine is None:
            self._engine = IpcEngine(self.cfg, self.db)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self.db.close()

    def write(self, group: str, body: Any, sub: str = "tasks", name: str | None = None,
              raw: bytes | None = None) -> str:
        """Atomically write a command file (temp + rename); returns its name."""
        name = name or f"{1700000000000 + next(_seq):013d}-{os.getpid()}.json"
        d = self.ipc / group / sub
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{name}.tmp"
        tmp.write_bytes(raw if raw is not None else json.dumps(body).encode())
        os.rename(tmp, d / name)
        return name

    def drain(self):  # noqa: ANN201
        return self.engine.drain()

    def run_jobs(self, timeout: float = 30.0) -> int:
        """Run the real action worker until every queued off-loop job (memory_search,
        web_fetch...) has its result written, as the daemon's worker would; returns how many
        it finished."""
        worker = ActionWorker(self.cfg)
        try:
            return asyncio.run(worker.run_until_idle(timeout))
        finally:
            worker.close()

    def drain_and_run(self):  # noqa: ANN201
        """Apply the pending commands, then run the off-loop actions they queued."""
        res = self.drain()
        self.run_jobs()
        return res

    def errors_for(self, group: str, name: str) -> dict[str, Any] | None:
        found = list(self.errors.glob(f"{group}.*.{name}.error.json"))
        return json.loads(found[0].read_text()) if found else None

    def pending(self, group: str, sub: str = "tasks") -> list[str]:
        return sorted(n for n in os.listdir(self.ipc / group / sub) if n.endswith(".json"))

    def outbox(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.db.query("SELECT * FROM outbox ORDER BY id")]

    def task(self, task_id: str) -> dict[str, Any] | None:
        r = self.db.query_one("SELECT * FROM scheduled_tasks WHERE id = ?", (task_id,))
        return dict(r) if r else None

    def tasks(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.db.query("SELECT * FROM scheduled_tasks ORDER BY id")]


def schedule_body(task_id: str | None = None, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "schedule_task", "prompt": "water the plants",
                            "schedule_type": "cron", "schedule_value": "0 8 * * *"}
    if task_id:
        body["taskId"] = task_id
    body.update(kw)
    return body
