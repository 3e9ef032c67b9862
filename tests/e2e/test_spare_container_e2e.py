"""A group's next container, created ahead of time (`runtime.keep_created`), on a real engine:
used by the next run, discarded when the group's settings changed, removed at shutdown and by
a later daemon's orphan cleanup. Each test uses its own install label and cleans up by it."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from mdclaw.config import Config, LiveConfig
from mdclaw.runner import ContainerInput, ContainerResult, ContainerRunner
from mdclaw.runtime import install_labels
from mdclaw.runtime.docker_engine import DockerRuntime
from waiting import wait_until, wait_until_async

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def plain_image(engine: DockerRuntime, agent_image: str,
                tmp_path_factory: pytest.TempPathFactory) -> str:
    """The fake agent with a default command, as the real image runs without one."""
    ctx = tmp_path_factory.mktemp("plain-image")
    (ctx / "Dockerfile").write_text(f'FROM {agent_image}\nCMD ["blocks", "1", "0"]\n')
    tag = f"{agent_image}-plain"  # named after its base, like the base is after its content
    engine.build_image(tag, ctx / "Dockerfile", ctx)
    return tag


def config(tmp_path: Path, install_id: str, image: str, **runtime: Any) -> Config:
    return Config(
        data_dir=tmp_path / "data",
        groups={"main": {"name": "Admin", "jid": "tg:1", "main": True},
                "family": {"name": "Family", "jid": "tg:2"}},
        limits={"container_timeout": "60s", "idle_timeout": "30s", "memory": "256m",
                "cpus": 1.0, "pids": 64},
        runtime={"image": image, "install_id": install_id, **runtime},
    )


def inp(prompt: str = "hello") -> ContainerInput:
    return ContainerInput(prompt=prompt, group_folder="family", chat_jid="tg:2")


async def spare_of(runner: ContainerRunner, folder: str, timeout: float = 60) -> str:
    return await wait_until_async(lambda: runner.spare(folder), timeout, interval=0.02,
                                  what="a container created ahead of time")


async def gone(engine: DockerRuntime, labels: dict[str, str], name: str,
               timeout: float = 60) -> None:
    async def removed() -> bool:
        return not any(c.name == name for c in await asyncio.to_thread(engine.list, labels))

    await wait_until_async(removed, timeout, interval=0.05, what=f"{name} to be removed")


async def run_after_settings_change(runner: ContainerRunner, engine: DockerRuntime,
                                    labels: dict[str, str], new: Config) -> ContainerResult:
    """A run makes a spare; `new` settings come (a reload); the next run must not use the
    spare made from the old ones, and the spare is removed."""
    await runner.run("family", inp())
    stale = await spare_of(runner, "family")
    runner.live.replace(new)
    res = await runner.run("family", inp())
    assert res.status == "success" and res.name != stale, res
    await gone(engine, labels, stale)
    return res


def test_the_next_run_starts_the_container_created_for_it(tmp_path, engine, plain_image,
                                                          install_id, reap) -> None:
    cfg = config(tmp_path, install_id, plain_image)
    labels = install_labels(cfg)
    reap(labels)

    async def go() -> None:
        runner = ContainerRunner(cfg, engine)
        first = await runner.run("family", inp("one"))
        assert first.status == "success", first
        name = await spare_of(runner, "family")
        assert name != first.name
        states = {c.name: c.state for c in await asyncio.to_thread(engine.list, labels)}
        assert states.get(name) in ("created", "configured"), states  # made, not started

        second = await runner.run("family", inp("a longer prompt"))
        assert second.status == "success", second
        assert second.name == name  # the created container ran this turn
        # It got this run's prompt on stdin, not the first one's.
        assert json.loads(second.output)["stdin_len"] == len(inp("a longer prompt").to_json())
        third_spare = await spare_of(runner, "family")
        assert third_spare not in (first.name, second.name)

        # A daemon that died without shutting down leaves it; the next one's orphan
        # cleanup removes it (it carries the old runner's boot label).
        later = ContainerRunner(cfg, engine)
        assert third_spare in await later.cleanup_orphans()
        await gone(engine, labels, third_spare)
        await runner.aclose()
        await later.aclose()

    asyncio.run(go())
    assert engine.list(labels) == []


class _SlowCreate:
    """The real engine, but the creation of a container ahead of time (the only caller of
    `create` outside the engine's own `start`) waits for `gate`."""

    def __init__(self, engine: DockerRuntime) -> None:
        self.engine = engine
        self.gate = threading.Event()
        self.creating: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def create(self, spec: Any) -> str:
        self.creating.append(spec.name)
        assert self.gate.wait(60), "the test never opened the gate"
        return self.engine.create(spec)


def test_a_run_that_comes_while_its_container_is_being_created_starts_that_one(
        tmp_path, engine, plain_image, install_id, reap, caplog) -> None:
    """A message right after a turn: the next run claims the container while the engine is
    still creating it. The run must wait for it and start it; the creation must not remove
    what the run is starting (it did: the run was killed with 137, lost its output, or fell
    back to a new container)."""
    cfg = config(tmp_path, install_id, plain_image)
    labels = install_labels(cfg)
    reap(labels)
    slow = _SlowCreate(engine)
    caplog.set_level(logging.INFO, logger="mdclaw.runner")

    async def go() -> None:
        runner = ContainerRunner(cfg, slow)  # type: ignore[arg-type]
        first = await runner.run("family", inp("one"))
        assert first.status == "success", first
        # The spare's creation is under way, held at the gate.
        await wait_until_async(lambda: slow.creating, 60,
                               what="a container being created ahead")
        second = asyncio.ensure_future(runner.run("family", inp("a longer prompt")))

        def claimed() -> bool:  # wait for the claim itself
            assert not second.done(), "the run ended without claiming the spare"
            return "family" not in runner._spares  # noqa: SLF001

        await wait_until_async(claimed, 60, what="the run to claim the spare")
        slow.gate.set()
        res = await asyncio.wait_for(second, 60)
        assert res.status == "success" and res.exit_code == 0, res
        assert res.name == slow.creating[0]  # the container created for it ran this turn
        assert json.loads(res.output)["stdin_len"] == len(inp("a longer prompt").to_json())
        await runner.aclose()

    asyncio.run(go())
    assert "did not start" not in caplog.text and "removing" not in caplog.text, caplog.text
    wait_until(lambda: not engine.list(labels), 60, interval=0.05,
               what="every container to be removed")


def test_a_created_container_from_other_settings_is_discarded(tmp_path, engine, plain_image,
                                                              install_id, reap) -> None:
    cfg = config(tmp_path, install_id, plain_image)
    labels = install_labels(cfg)
    reap(labels)

    async def go() -> None:
        runner = ContainerRunner(LiveConfig(cfg), engine)
        # A reload hands the runner a config with other limits: the container made from
        # the old settings must not run.
        await run_after_settings_change(runner, engine, labels, cfg.model_copy(update={
            "limits": cfg.limits.model_copy(update={"memory": "300m"})}))
        info = await spare_of(runner, "family")
        created = next(c for c in await asyncio.to_thread(engine.list, labels)
                       if c.name == info)
        memory = (await asyncio.to_thread(engine.inspect, created.id))["HostConfig"]["Memory"]
        assert memory == 300 * 1024 * 1024  # the new one follows the new settings
        await runner.aclose()  # shutdown removes it

    asyncio.run(go())
    assert engine.list(labels) == []


def test_keep_created_off_creates_nothing_ahead(tmp_path, engine, plain_image, install_id,
                                                reap) -> None:
    cfg = config(tmp_path, install_id, plain_image, keep_created=False)
    labels = install_labels(cfg)
    reap(labels)

    async def go() -> None:
        runner = ContainerRunner(cfg, engine)
        res = await runner.run("family", inp())
        assert res.status == "success", res
        # Checked before aclose(), which drops every spare: a run that keeps one registers
        # it before it returns (its creation goes on in the background).
        assert "family" not in runner._spares
        await runner.aclose()

    asyncio.run(go())
    assert engine.list(labels) == []


def test_keep_created_turned_off_by_a_reload_discards_the_spare(tmp_path, engine, plain_image,
                                                                install_id, reap) -> None:
    cfg = config(tmp_path, install_id, plain_image)
    labels = install_labels(cfg)
    reap(labels)

    async def go() -> None:
        runner = ContainerRunner(LiveConfig(cfg), engine)
        await run_after_settings_change(runner, engine, labels, cfg.model_copy(update={
            "runtime": cfg.runtime.model_copy(update={"keep_created": False})}))
        # and none is made for the next run: a run that keeps one registers it before it
        # returns (its creation goes on in the background)
        assert "family" not in runner._spares
        await runner.aclose()

    asyncio.run(go())
    assert engine.list(labels) == []

