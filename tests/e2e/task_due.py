"""Due → task's container started, while the group's conversation idles, on the real engine.

Shared by tests/e2e/test_tasks_on_time_e2e.py (asserts it) and bench/task_due_latency.py
(reports it). A real `mdclaw run` subprocess, the real agent image, and a scripted
OpenAI-compatible model server: each round opens a conversation (a message and its reply;
the container then waits for follow-ups, `idle_timeout` is 10 minutes), then adds a one-shot
task due 2 s later straight into the state database, and reads when the engine says the
task's container started (`State.StartedAt`).
"""

from __future__ import annotations

import re
import textwrap
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from test_daemon_e2e import free_port, wait_until
from test_failures_e2e import Daemon, healthy, replies, send

from fake_models import FakeOpenAI, say

TASK_PROMPT = "TASK: water the plants"
DUE_IN = 2.0  # seconds from adding a task to its due time (the scheduler sees it first)


def _model(body: dict[str, Any]):  # noqa: ANN202 - a fake model's Step
    users = [str(m.get("content")) for m in body.get("messages", []) if m.get("role") == "user"]
    if users and "TASK:" in users[-1]:
        # Slow enough that the task's container is seen running by the watcher below.
        return say("task done", delay=1.5)
    return say("chat answer")


def started_at(doc: dict[str, Any]) -> datetime | None:
    """The engine's State.StartedAt as an aware datetime (nanoseconds cut to micro)."""
    raw = str((doc.get("State") or {}).get("StartedAt") or "")
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)?", raw)
    if not m or raw.startswith("0001"):
        return None
    frac = (m.group(2) or ".0")[:7]
    zone = m.group(3) or "Z"
    return datetime.fromisoformat(m.group(1) + frac + ("+00:00" if zone == "Z" else zone))


@dataclass
class Watcher:
    """Polls the engine for containers of one install; keeps each one's start time."""

    engine: Any
    labels: dict[str, str]
    starts: dict[str, datetime] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                for c in self.engine.list(self.labels):
                    if c.id not in self.starts and c.state in ("running", "exited"):
                        when = started_at(self.engine.inspect(c.id))
                        if when is not None:
                            self.starts[c.id] = when
            except Exception:  # noqa: BLE001 - a container removed between list and inspect
                pass
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Round:
    due: datetime
    container_started: datetime
    start_note: str | None

    @property
    def late_s(self) -> float:
        return (self.container_started - self.due).total_seconds()


def run_rounds(engine: Any, image: str, tmp: Path, install: str, rounds: int,
               reap: Any = None) -> list[Round]:
    """`rounds` times: open an idle conversation, then a task comes due; one Round each."""
    from mdclaw import schedule
    from mdclaw.config import load_config
    from mdclaw.runtime import install_labels
    from mdclaw.state import Database
    from mdclaw.state.tasks import insert_task, list_runs

    model = FakeOpenAI([], fallback=_model).start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cfg_path = tmp / "config.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        data_dir: {tmp / 'data'}
        assistant: {{name: Andy, timezone: UTC, model: local}}
        models:
          local: {{backend: openai, model: fake-model, base_url: "{model.url}/v1"}}
        groups:
          main: {{name: Admin, jid: "hl:main", main: true}}
        limits: {{container_timeout: 30m, idle_timeout: 10m, memory: 256m, cpus: 1.0,
                 pids: 128}}
        runtime: {{image: "{image}", install_id: {install}, socket: "{engine.base_url}"}}
        channels: {{http: {{listen: "127.0.0.1:{port}"}}}}
        """))
    cfg = load_config(cfg_path)
    labels = install_labels(cfg)
    if reap is not None:
        reap(labels)
    daemon = Daemon(cfg_path, tmp / "daemon.log")
    watcher = Watcher(engine, labels)
    out: list[Round] = []
    try:
        wait_until(lambda: healthy(base), 60, what="the daemon")
        db = Database(cfg.db_path)
        for i in range(rounds):
            n = len(replies(base, "hl:main"))
            send(base, "hl:main", f"hello {i}")
            wait_until(lambda n=n: len(replies(base, "hl:main")) > n, 90,
                       what="the chat's answer")
            # The conversation's container is open and idle now (waiting for follow-ups).
            conversation = {c.id for c in engine.list(labels) if c.state == "running"}
            assert conversation, "the conversation's container is not running"
            seen = set(watcher.starts)
            due = schedule.utc_now() + timedelta(seconds=DUE_IN)
            tid = f"due-{i}"
            with db.transaction() as c:
                insert_task(c, group_folder="main", chat_jid="hl:main", prompt=TASK_PROMPT,
                            schedule_type="once", schedule_value=schedule.to_iso(due),
                            timezone="UTC", task_id=tid)
            seen |= conversation
            new = wait_until(lambda seen=seen: [cid for cid in watcher.starts if cid not in seen],
                             60, what="the task's container")
            wait_until(lambda i=i: replies(base, "hl:main").count("task done") > i, 90,
                       what="the task's answer")
            run = wait_until(lambda tid=tid: [r for r in list_runs(db, tid)
                                              if r.status != "running"], 30,
                             what="the run's end")[0]
            out.append(Round(due.astimezone(UTC), watcher.starts[new[0]], run.start_note))
        db.close()
    finally:
        watcher.stop()
        daemon.stop()
        model.stop()
    return out
