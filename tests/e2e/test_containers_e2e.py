"""The runner, mount rules and queue against a real engine (Podman or dockerd).

Every container here runs tests/e2e/fake_agent.py in a small image built on the debootstrap
base; nothing is mocked. Each test uses its own install label, and cleans up by it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mdclaw.config import Config
from mdclaw.queue import GroupQueue, Job
from mdclaw.runner import ContainerInput, ContainerRunner
from mdclaw.runtime import (
    GROUP_LABEL,
    INSTALL_LABEL,
    LABEL,
    RunSpec,
    install_labels,
    wait_for_engine,
)
from mdclaw.runtime.docker_engine import DockerRuntime
from waiting import wait_until_async

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def make_config(tmp_path: Path, install_id: str, image: str, *, limits: dict | None = None,
                groups: dict | None = None, mount_policy: dict | None = None) -> Config:
    base_groups = {
        "main": {"name": "Admin", "jid": "tg:1", "main": True},
        "family": {"name": "Family", "jid": "tg:2"},
    }
    return Config(
        data_dir=tmp_path / "data",
        groups=groups or base_groups,
        limits={"container_timeout": "60s", "idle_timeout": "30s", "memory": "256m",
                "cpus": 1.0, "pids": 64, **(limits or {})},
        runtime={"image": image, "install_id": install_id},
        mount_policy=mount_policy or {},
    )


def inp(folder: str, prompt: str = "hello", **kw: Any) -> ContainerInput:
    return ContainerInput(prompt=prompt, group_folder=folder, chat_jid="tg:2", **kw)


@pytest.fixture
def setup(tmp_path, engine, agent_image, install_id, reap):
    """setup(**config overrides) -> (cfg, runner)."""

    def make(**kw: Any) -> tuple[Config, ContainerRunner]:
        cfg = make_config(tmp_path, install_id, agent_image, **kw)
        reap(install_labels(cfg))
        return cfg, ContainerRunner(cfg, engine)

    return make


def run(coro):
    return asyncio.run(coro)


# --------------------------------------------------------------------------- streaming


def test_blocks_arrive_while_the_container_still_runs(setup, engine):
    cfg, runner = setup()
    seen: list[tuple[dict, bool, float]] = []

    async def go():
        async def on_output(text: str) -> None:
            at = time.monotonic()
            block = json.loads(text)
            running = None
            if block["i"] < 2:
                # The last block is the container's final write: it may be exiting while we
                # ask, and the engine can fail an inspect of a process that is going away.
                handle = runner.active("family")
                state = await asyncio.to_thread(engine.inspect, handle.container_id)
                running = state["State"]["Running"]
            seen.append((block, running, at))

        res = await runner.run("family", inp("family"), on_output=on_output,
                               command=["blocks", "3", "0.8"])
        await runner.aclose()
        return res

    res = run(go())
    assert res.status == "success" and res.exit_code == 0
    assert [b["i"] for b, _, _ in seen] == [0, 1, 2]
    assert seen[0][1] is True and seen[1][1] is True  # delivered while it was running
    assert seen[2][2] - seen[0][2] > 1.2  # spread over time, not all at exit
    assert json.loads(res.output)["i"] == 2  # parse_container_output: the last block
    assert [json.loads(o)["i"] for o in res.outputs] == [0, 1, 2]
    assert json.loads(res.outputs[0])["stdin_len"] > 0
    # the container is removed after the result
    assert engine.list({INSTALL_LABEL: cfg.runtime.install_id}) == []


def test_hard_timeout_stops_the_container_and_reports(setup, engine):
    cfg, runner = setup()
    t0 = time.monotonic()

    async def go():
        res = await runner.run("family", inp("family"), command=["sleep", "120"], timeout=2)
        await runner.aclose()
        return res

    res = run(go())
    took = time.monotonic() - t0
    assert res.timed_out and res.status == "timeout", res
    assert res.exit_code != 0, res
    assert took < 30, (took, res)
    assert engine.list({INSTALL_LABEL: cfg.runtime.install_id}) == []


def test_each_output_block_resets_the_hard_timeout(setup):
    _, runner = setup()
    # 4 blocks 1 s apart: 3 s in all, but never more than 1 s without output.
    res = run(runner.run("family", inp("family"), command=["blocks", "4", "1.0"], timeout=2.5))
    assert res.status == "success" and not res.timed_out
    assert len(res.outputs) == 4


def test_idle_timeout_writes_close_and_the_container_exits(setup, tmp_path):
    cfg, runner = setup(limits={"idle_timeout": "1500ms", "container_timeout": "60s"})
    t0 = time.monotonic()
    res = run(runner.run("family", inp("family"), command=["idle"]))
    took = time.monotonic() - t0
    assert res.status == "success" and not res.timed_out
    assert res.closed_idle
    assert [json.loads(o)["result"] for o in res.outputs] == ["first", "closed"]
    assert (cfg.data_dir / "ipc" / "family" / "input" / "_close").exists()
    assert 1.4 < took < 20


def test_a_stale_close_sentinel_is_removed_before_a_run(setup):
    cfg, runner = setup(limits={"idle_timeout": "1s", "container_timeout": "60s"})
    close = cfg.data_dir / "ipc" / "family" / "input" / "_close"
    close.parent.mkdir(parents=True)
    close.touch()
    t0 = time.monotonic()
    res = run(runner.run("family", inp("family"), command=["idle"]))
    assert time.monotonic() - t0 > 0.9  # it waited for the idle timer, not the stale file
    assert res.closed_idle


def test_output_cap_holds_against_a_flood(setup, caplog):
    cap = 256 * 1024
    cfg, runner = setup(limits={"max_output_bytes": cap})
    flood = 40 * 1024 * 1024
    res = run(runner.run("family", inp("family"), command=["flood", str(flood)]))
    assert res.status == "success"
    assert res.stdout_bytes > flood
    assert res.dropped_bytes == res.stdout_bytes - cap
    # what came after the cap (the block) was not parsed
    assert res.outputs == []
    assert any("output cap" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- isolation


def test_network_none_really_has_no_network(setup):
    _, runner = setup()
    res = run(runner.run("family", inp("family"), command=["net"]))
    body = json.loads(res.output)
    assert body["ifaces"] == ["lo"]
    for key in ("1.1.1.1:53", "10.0.2.2:80", "8.8.8.8:443"):
        assert body[key].startswith("error"), body
    assert body["dns"].startswith("error")


def test_runs_as_uid_1000_with_a_read_only_root_and_no_privileges(setup):
    cfg, runner = setup()
    res = run(runner.run("family", inp("family", session_id="s1"), command=["whoami"]))
    body = json.loads(res.output)
    assert body["uid"] == 1000 and body["gid"] == 1000
    assert os.getgid() in body["groups"]  # the daemon's group: it can write its IPC folder
    assert body["root_writable"] is False and body["etc_writable"] is False
    assert body["tmp_writable"] is True
    assert body["group_writable"] and body["ipc_writable"] and body["claude_writable"]
    assert body["global_writable"] is False  # non-main: global memory is read-only
    assert body["settings"] is True
    assert int(body["cap_eff"], 16) == 0
    assert body["no_new_privs"] == "1"
    stdin = body["stdin"]
    assert stdin["groupFolder"] == "family" and stdin["sessionId"] == "s1"
    assert "secrets" not in stdin
    assert body["env"]["HOME"] == "/home/node"
    settings = json.loads((cfg.data_dir / "sessions" / "family" / ".claude" /
                           "settings.json").read_text())
    assert settings["settings"]["autoApprove"] is True


def test_main_group_may_write_global_memory(setup):
    _, runner = setup()
    res = run(runner.run("main", inp("main", is_main=True), command=["whoami"]))
    assert json.loads(res.output)["global_writable"] is True


def test_a_mount_outside_the_allowed_roots_never_reaches_the_container(setup, tmp_path,
                                                                       engine):
    allowed = tmp_path / "allowed"
    (allowed / "notes").mkdir(parents=True)
    (allowed / "notes" / "todo.txt").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "private.txt").write_text("secret-ish")
    (allowed / "sneaky").symlink_to(outside)  # a link out of the root is resolved first
    groups = {
        "main": {"name": "Admin", "jid": "tg:1", "main": True},
        "family": {"name": "Family", "jid": "tg:2", "mounts": [
            {"host": str(allowed / "notes"), "container": "notes", "readonly": False},
            {"host": str(outside), "container": "outside"},
            {"host": str(allowed / "sneaky"), "container": "sneaky"},
        ]},
    }
    cfg, runner = setup(groups=groups, mount_policy={"allowed_roots": [
        {"path": str(allowed), "allow_read_write": True}]})
    seen_mounts: list[list[str]] = []

    async def go():
        async def on_output(_text: str) -> None:
            # The container waits for _close after its output: an inspect of a container
            # that is exiting can fail on Podman ('read /proc/N/cgroup: no such process').
            handle = runner.active("family")
            try:
                state = await asyncio.to_thread(engine.inspect, handle.container_id)
            finally:
                (cfg.data_dir / "ipc" / "family" / "input" / "_close").write_text("")
            seen_mounts.append([m.get("Source", "") for m in state.get("Mounts", [])])

        return await runner.run("family", inp("family"), command=["whoami", "until-close"],
                                on_output=on_output)

    res = run(go())
    body = json.loads(res.output)
    assert body["extra"] == {"notes": ["todo.txt"]}
    # non-main and non_main_read_only (the default): read-only although requested rw
    assert body["extra_writable"] == {"notes": False}
    sources = seen_mounts[0]
    assert not any(str(outside) in s for s in sources), sources
    assert any(s.endswith("/allowed/notes") for s in sources)


# --------------------------------------------------------------------------- queue


def test_queue_concurrency_cap_holds_with_real_containers(setup, engine):
    cfg, runner = setup(limits={"max_concurrent_containers": 2})
    labels = install_labels(cfg)
    groups = ["g1", "g2", "g3", "g4"]
    samples: list[int] = []
    per_group_overlap: list[str] = []
    running_groups: set[str] = set()
    results = []

    async def run_job(job: Job) -> None:
        if job.group in running_groups:
            per_group_overlap.append(job.group)
        running_groups.add(job.group)
        try:
            results.append(await runner.run(job.group, inp(job.group),
                                             command=["blocks", "2", "1.0"]))
        finally:
            running_groups.discard(job.group)

    async def sample(stop: asyncio.Event) -> None:
        while not stop.is_set():
            rows = await asyncio.to_thread(engine.list, labels, all=False)
            samples.append(len([r for r in rows if r.state == "running"]))
            await asyncio.sleep(0.2)

    async def go():
        q = GroupQueue(run_job, max_concurrent=cfg.limits.max_concurrent_containers)
        for g in groups:
            q.enqueue_message(g)
            q.enqueue_message(g)  # a second job per group: must wait for the first
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(stop))
        await asyncio.wait_for(q.join(), 120)
        stop.set()
        await sampler
        await runner.aclose()
        return q

    q = run(go())
    assert len(results) == 8 and all(r.status == "success" for r in results)
    assert q.peak_running == 2
    assert max(samples) <= 2 and max(samples) >= 1
    assert per_group_overlap == []


# --------------------------------------------------------------------------- orphans


def test_orphans_are_cleaned_by_label_only(setup, engine, agent_image, install_id, reap):
    cfg, runner = setup()
    other = {LABEL: "true", INSTALL_LABEL: f"{install_id}-other"}
    reap(other)
    unlabelled = {"mdclaw-e2e-unlabelled": install_id}
    reap(unlabelled)

    def start(name: str, labels: dict[str, str]):
        spec = RunSpec(name=name, image=agent_image, labels=labels, command=["sleep", "60"],
                       memory="64m", pids=32)
        return engine.start(spec)

    ours = start(f"mdclaw-family-{install_id}", {**install_labels(cfg), GROUP_LABEL: "family"})
    theirs = start(f"mdclaw-family-{install_id}-other", {**other, GROUP_LABEL: "family"})
    plain = start(f"plain-{install_id}", unlabelled)
    async def with_a_live_run():
        # a container this runner is running right now is not an orphan
        task = asyncio.create_task(runner.run("main", inp("main"), command=["blocks", "2", "1"]))
        await wait_until_async(lambda: (h := runner.active("main")) and h.container_id, 60,
                               what="main's container to start")
        removed = await runner.cleanup_orphans()
        res = await task
        await runner.aclose()
        return removed, res

    try:
        removed, live = run(with_a_live_run())
        assert removed == [ours.name]
        assert live.status == "success" and len(live.outputs) == 2
        assert engine.list(install_labels(cfg)) == []
        assert [c.name for c in engine.list(other)] == [theirs.name]
        assert [c.name for c in engine.list(unlabelled)] == [plain.name]
    finally:
        for r in (ours, theirs, plain):
            r.close()


# --------------------------------------------------------------------------- CLI


def _cli(*args: str, config: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "mdclaw", *args, "--config", str(config)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_cli_image_status_build_and_containers_list(tmp_path, engine, agent_image, install_id,
                                                    reap):
    cfg_path = tmp_path / "config.yaml"
    sock = engine.base_url
    cfg_path.write_text(
        f"data_dir: {tmp_path / 'data'}\n"
        f"runtime: {{image: '{agent_image}', install_id: {install_id}, socket: '{sock}'}}\n")
    p = _cli("image", "status", "--json", config=cfg_path)
    assert p.returncode == 0, p.stderr
    status = json.loads(p.stdout)
    assert status["reachable"] and status["present"]

    ctx = tmp_path / "ctx"
    (ctx / "container").mkdir(parents=True)
    (ctx / "container" / "Dockerfile").write_text(
        "ARG BASE_IMAGE=no-such-image\nFROM ${BASE_IMAGE}\nARG FLAVOUR=plain\n"
        "LABEL mdclaw.test=cli-build mdclaw.flavour=${FLAVOUR}\n")
    tag = f"mdclaw-e2e-cli:{install_id}"
    p = _cli("image", "build", "--file", str(ctx / "container" / "Dockerfile"),
             "--context", str(ctx), "--tag", tag, "--build-arg", f"BASE_IMAGE={agent_image}",
             "--build-arg", "FLAVOUR=spicy", config=cfg_path)
    assert p.returncode == 0, p.stderr
    assert "STEP" in p.stdout.upper() or "Step" in p.stdout  # progress was shown
    assert engine.image_info(tag) is not None
    labels = engine._api().inspect_image(tag)["Config"]["Labels"]
    assert labels["mdclaw.flavour"] == "spicy"
    bad = _cli("image", "build", "--build-arg", "NOEQUALS", config=cfg_path)
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr

    labels = {LABEL: "true", INSTALL_LABEL: install_id}
    reap(labels)
    running = engine.start(RunSpec(name=f"mdclaw-family-{install_id}", image=agent_image,
                                   labels={**labels, GROUP_LABEL: "family"},
                                   command=["sleep", "30"]))
    try:
        p = _cli("containers", "list", "--json", config=cfg_path)
        assert p.returncode == 0, p.stderr
        rows = json.loads(p.stdout)
        assert [(r["name"], r["group"]) for r in rows] == [(running.name, "family")]
    finally:
        running.close()
        engine.remove(running.id)

    # save the small image and load it back through the CLI
    tarball = tmp_path / "image.tar"
    api = engine._api()
    with open(tarball, "wb") as f:
        for chunk in api.get_image(tag):
            f.write(chunk)
    api.remove_image(tag)
    p = _cli("image", "load", str(tarball), config=cfg_path)
    assert p.returncode == 0, p.stderr
    assert engine.image_info(tag) is not None
    api.remove_image(tag)


def test_cli_image_status_reports_an_unreachable_engine(tmp_path):
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(f"data_dir: {tmp_path / 'data'}\n"
                        f"runtime: {{socket: '{tmp_path / 'nothing.sock'}'}}\n")
    p = _cli("image", "status", config=cfg_path)
    assert p.returncode == 1
    assert "unreachable" in p.stdout


# --------------------------------------------------------------------------- engine start-up


@pytest.mark.skipif(shutil.which("podman") is None, reason="needs podman to start an engine late")
def test_an_engine_that_comes_up_late_is_waited_for_not_crashed_on(tmp_path, engine):
    sock = tmp_path / "late.sock"
    rt = DockerRuntime(f"unix://{sock}", engine="podman")
    lines: list[str] = []
    procs: list[subprocess.Popen] = []

    async def go():
        async def start_late() -> None:
            await asyncio.sleep(1.0)
            procs.append(subprocess.Popen(
                ["podman", "system", "service", "--time=0", f"unix://{sock}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))

        starter = asyncio.create_task(start_late())
        desc = await asyncio.wait_for(
            wait_for_engine(rt, status=lines.append, first_delay=0.2, max_delay=0.5), 60)
        await starter
        return desc

    try:
        desc = run(go())
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    assert "Podman" in desc or "Engine" in desc
    assert lines and all("unreachable" in line for line in lines)


def test_a_cancelled_run_leaves_no_container_behind(setup, engine):
    cfg, runner = setup()

    async def go():
        task = asyncio.create_task(runner.run("family", inp("family"), command=["sleep", "60"]))
        await asyncio.sleep(0.05)  # still starting
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        task = asyncio.create_task(runner.run("family", inp("family"), command=["sleep", "60"]))
        await wait_until_async(lambda: (h := runner.active("family")) and h.container_id, 60,
                               what="family's container to start")
        task.cancel()  # running
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            await runner.aclose()
            if not engine.list(install_labels(cfg)):
                break
            await asyncio.sleep(0.1)

    run(go())
    assert engine.list(install_labels(cfg)) == []
