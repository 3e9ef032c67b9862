"""The disk rule against a real engine: a container that keeps writing into its group folder
is stopped soon after it crosses the group's limit, its chat is told once, and the next run is
refused until files are deleted.

The container runs fake_agent.py's `sleep` mode (the test image is shared with other tests and
is not changed here); the writing is done inside it by a process started with the engine's
exec API, as an agent's shell command would.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import docker
import pytest

from mdclaw.channels.base import InboundMessage
from mdclaw.config import Config
from mdclaw.diskguard import GROUP_FULL, DiskGuard
from mdclaw.orchestrator import Orchestrator
from mdclaw.reconcile import reconcile
from mdclaw.runner import ContainerRunner
from mdclaw.runtime import install_labels
from mdclaw.state import Database
from mdclaw.state.outbox import list_outbox
from waiting import wait_until_async

pytestmark = pytest.mark.e2e

LIMIT = "4MiB"
INTERVAL = 0.5  # limits.disk_check_interval for this test
# Writes 256 KiB of random bytes (nothing sparse, nothing to compress) every 20 ms into the
# group folder, at most 64 MiB, and notes when the total is about to reach the limit.
WRITER = """\
import os, sys, time
limit, total, i, crossed = int(sys.argv[1]), 0, 0, False
chunk = os.urandom(256 * 1024)
while total < 64 << 20:
    if not crossed and total + len(chunk) >= limit:
        # Noted just before the write that reaches the limit: the guard counts this
        # folder's blocks and the other trees' too, so it may see the limit reached by
        # this very write and stop the container before a note written after it.
        crossed = True
        with open("/workspace/group/crossed-at", "w") as f:
            f.write(repr(time.time()))
    with open(f"/workspace/group/fill-{i:04d}", "wb") as f:
        f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    total += len(chunk)
    i += 1
    time.sleep(0.02)
"""


class SleepingRunner(ContainerRunner):
    """The real runner; every run's container sleeps (an agent busy with a long tool call)."""

    starts = 0

    async def run(self, folder: str, input: Any, **kw: Any):  # noqa: A002, ANN201
        self.starts += 1
        kw.setdefault("command", ["sleep", "300"])
        return await super().run(folder, input, **kw)


def msg(i: int) -> InboundMessage:
    return InboundMessage(id=f"hl:family:{i}", chat_jid="hl:family", sender="u1",
                          sender_name="Alice", content=f"please work {i}",
                          timestamp=f"2026-01-01T00:00:{i:02d}.000Z", channel="http")


def test_a_container_filling_its_folder_is_stopped_and_refused(tmp_path: Path, engine,
                                                                agent_image, install_id,
                                                                reap) -> None:
    cfg = Config(
        data_dir=tmp_path / "data",
        groups={"main": {"name": "A", "jid": "hl:main", "main": True},
                "family": {"name": "F", "jid": "hl:family", "requires_trigger": False,
                           "disk": LIMIT}},
        limits={"container_timeout": "120s", "idle_timeout": "60s", "memory": "256m",
                "cpus": 1.0, "pids": 64, "run_attempts": 1, "min_free_disk": "1M",
                "disk_check_interval": f"{int(INTERVAL * 1000)}ms"},
        runtime={"image": agent_image, "install_id": install_id},
    )
    reap(install_labels(cfg))
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    runner = SleepingRunner(cfg, engine)
    guard = DiskGuard(cfg, runner)
    client = docker.DockerClient(base_url=engine.base_url)
    group_dir = cfg.data_dir / "groups" / "family"
    out: dict[str, Any] = {}

    async def main() -> None:
        orch = Orchestrator(cfg, db, runner=runner, diskguard=guard)
        orch.engine_ready.set()
        stop = asyncio.Event()
        guard_task = asyncio.create_task(guard.run(stop))
        await orch.on_inbound(msg(1))
        handle = await wait_until_async(
            lambda: (h := runner.active("family")) and h.container_id and h, 60,
            interval=0.05, what="the container to start")
        exec_id = client.api.exec_create(handle.container_id,
                                         ["python3", "-c", WRITER, str(4 << 20)])
        client.api.exec_start(exec_id, detach=True)
        await wait_until_async(lambda: guard.stopped, 60, interval=0.05,
                               what="the guard to stop the container")
        out["stopped_at"] = guard.stopped[0][2]
        await asyncio.wait_for(orch.queue.join(), 60)  # the run ended
        out["ended_at"] = time.time()
        out["running_after"] = engine.list(install_labels(cfg), all=False)
        # The next message: refused without a container, and the chat is not told twice.
        starts = runner.starts
        await orch.on_inbound(msg(2))
        await asyncio.wait_for(orch.queue.join(), 30)
        out["starts_after"] = runner.starts - starts
        out["blocked"] = guard.blocked("family")
        # Files deleted on the host: runs are allowed again.
        for p in group_dir.glob("fill-*"):
            p.unlink()
        out["after_delete"] = await guard.admit("family")
        stop.set()
        await guard_task
        await runner.aclose()

    asyncio.run(main())
    crossed_at = float((group_dir / "crossed-at").read_text())
    took = out["stopped_at"] - crossed_at
    print(f"\ncrossed the limit -> stopped: {took:.2f} s; run ended "
          f"{out['ended_at'] - out['stopped_at']:.2f} s later")
    # Stopped within about one measuring interval (plus the measuring itself). The writer notes
    # the time after its write returns, so a guard that measures at once can come out a few
    # milliseconds "before" it.
    assert -0.5 <= took < INTERVAL + 3, took
    assert out["running_after"] == []
    assert out["starts_after"] == 0
    assert out["blocked"] is not None and out["blocked"].state == GROUP_FULL
    assert out["after_delete"].ok, out["after_delete"]
    texts = [r.text for r in list_outbox(db) if r.chat_jid == "hl:family"]
    assert len(texts) == 1, texts
    assert "my folder is full" in texts[0] and "of 4 MiB" in texts[0], texts
    assert "groups.family.disk" in texts[0]
    db.close()
