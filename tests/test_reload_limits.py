"""A reload never lies: every `limits.*` key reaches the component that uses it, or is named
as restart-only and the log says so.

One real Daemon runs in this process (no container engine: runs are not needed to see what
a run would get). For each key of `Limits.model_fields` the config file on disk is rewritten
with that key changed and `Daemon.reload()` is called; the component that uses the key must
then use the new value (its behaviour, or the effective setting read through its public
surface), and the next reload, which changes another key, must bring the old value back. A
key added to `Limits` without a check here (and without being named in RESTART_ONLY) fails
`test_every_limit_has_a_decision`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from mdclaw.config import (
    RESTART_ONLY,
    Config,
    Limits,
    floor_bytes,
    load_config,
    reload_config,
)
from mdclaw.daemon.core import Daemon
from mdclaw.diskguard import GROUP_FULL, TOO_MANY_FILES
from mdclaw.integrations.agents import AskFailed
from mdclaw.runner import ContainerInput

BASE = """\
data_dir: {data_dir}
assistant: {{name: Andy, timezone: UTC}}
groups:
  main: {{name: Admin, jid: "hl:main", main: true}}
runtime: {{socket: "unix://{tmp}/no-engine.sock", image: "mdclaw-agent:reload-test"}}
server: {{listen: "127.0.0.1:0"}}
channels: {{http: {{enabled: true}}}}
metrics: {{enabled: false}}
limits:
{limits}"""
# Long intervals at first, so the checks of the short ones see the reload at work.
BASE_LIMITS = {"ipc_poll_interval": "1h", "disk_check_interval": "1h"}

Check = Callable[[Daemon, bool], Awaitable[None]]
# key -> (the value the reload writes, check(daemon, changed)): with changed=True the
# component must use the new value, with False the default (or BASE's) one.
LIVE: dict[str, tuple[str, Check]] = {}
# key -> the value a reload writes, for each limits key named in RESTART_ONLY (none today).
RESTART_VALUES: dict[str, str] = {}


def live(key: str, value: str) -> Callable[[Check], Check]:
    def register(check: Check) -> Check:
        LIVE[key] = (value, check)
        return check
    return register


async def until(cond: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def spec(d: Daemon) -> Any:
    assert d.runner is not None
    return d.runner.build_spec("main", ContainerInput(prompt="hi", group_folder="main",
                                                      chat_jid="hl:main", is_main=True))


# --------------------------------------------------------------------------- the queue

@live("max_concurrent_containers", "7")
async def _slots(d: Daemon, changed: bool) -> None:
    assert d.orch.queue.status()["max_concurrent"] == (7 if changed else 5)


@live("run_attempts", "2")
async def _run_attempts(d: Daemon, changed: bool) -> None:
    assert d.orch.queue.max_attempts == (2 if changed else 5)


@live("run_retry_base", "1s")
async def _run_retry_base(d: Daemon, changed: bool) -> None:
    # the wait after the first failed try, before jitter
    assert d.orch.queue.backoff.nominal(1) == (1.0 if changed else 5.0)


# --------------------------------------------------------------------------- the runner

@live("container_timeout", "45m")
async def _container_timeout(d: Daemon, changed: bool) -> None:
    assert d.runner is not None
    assert d.runner.run_limits("main").hard_timeout == (2700 if changed else 1800)


@live("idle_timeout", "5m")
async def _idle_timeout(d: Daemon, changed: bool) -> None:
    assert d.runner is not None
    assert d.runner.run_limits("main").idle_timeout == (300 if changed else 600)


@live("max_output_bytes", "2048")
async def _max_output(d: Daemon, changed: bool) -> None:
    assert d.runner is not None
    assert d.runner.run_limits("main").max_output_bytes == (2048 if changed else 10 << 20)


@live("tool_timeout", "3m")
async def _tool_timeout(d: Daemon, changed: bool) -> None:
    assert spec(d).env["MDCLAW_TOOL_TIMEOUT_MAX"] == ("180" if changed else "600")


@live("memory", "1g")
async def _memory(d: Daemon, changed: bool) -> None:
    assert spec(d).memory == ("1g" if changed else "2g")


@live("cpus", "1.5")
async def _cpus(d: Daemon, changed: bool) -> None:
    assert spec(d).cpus == (1.5 if changed else 2.0)


@live("pids", "256")
async def _pids(d: Daemon, changed: bool) -> None:
    assert spec(d).pids == (256 if changed else 512)


# --------------------------------------------------------------------------- IPC

@live("ipc_poll_interval", "50ms")
async def _ipc_poll(d: Daemon, changed: bool) -> None:
    assert d.watcher.poll_interval == (0.05 if changed else 3600)
    if changed:  # the loop ticks at the new interval now, not an hour after the last tick
        ticks = d.poll_ticks  # type: ignore[attr-defined]
        await until(lambda: d.poll_ticks >= ticks + 3,  # type: ignore[attr-defined]
                    "IPC poll ticks at the new interval")


@live("errors_max_files", "10")
async def _errors_files(d: Daemon, changed: bool) -> None:
    assert d.watcher.engine.quarantine.max_files == (10 if changed else 1000)


@live("errors_max_bytes", "4096")
async def _errors_bytes(d: Daemon, changed: bool) -> None:
    assert d.watcher.engine.quarantine.max_bytes == (4096 if changed else 64 << 20)


@live("action_jobs", "3")
async def _action_jobs(d: Daemon, changed: bool) -> None:
    assert d.watcher.actions.max_concurrent == (3 if changed else 8)


@live("action_jobs_per_group", "1")
async def _action_jobs_per_group(d: Daemon, changed: bool) -> None:
    assert d.watcher.actions.per_group == (1 if changed else 2)


# --------------------------------------------------------------------------- ask_agent

@live("ask_depth", "1")
async def _ask_depth(d: Daemon, changed: bool) -> None:
    # main's agent answers a question of x's now, and asks in turn: 2 deep.
    d.orch.asks._chains["main"] = ("x",)
    try:
        with pytest.raises(AskFailed) as e:
            await d.orch.asks.ask("main", "nosuch", "hi", request_id="r", timeout=5)
    finally:
        d.orch.asks._chains.pop("main", None)
    if changed:
        assert "limits.ask_depth is 1" in str(e.value)
    else:
        assert "'nosuch' is not registered" in str(e.value)


# --------------------------------------------------------------------------- the outbox

@live("delivery_attempts", "9")
async def _delivery_attempts(d: Daemon, changed: bool) -> None:
    assert d.outbox.policy.max_attempts == (9 if changed else 5)


@live("delivery_retry_base", "2s")
async def _delivery_retry_base(d: Daemon, changed: bool) -> None:
    assert d.outbox.policy.base_delay == (2.0 if changed else 5.0)


# --------------------------------------------------------------------------- disk

@live("disk", "1")
async def _disk(d: Daemon, changed: bool) -> None:
    # the group's folders hold more than one byte: refused once the limit is one byte (and
    # over its limit comes before over its file count: disk_files, the next key, says so)
    state = (await d.diskguard.admit("main")).state
    assert state == GROUP_FULL if changed else state != GROUP_FULL


@live("disk_files", "1000")
async def _disk_files(d: Daemon, changed: bool) -> None:
    state = (await d.diskguard.admit("main")).state
    assert state == TOO_MANY_FILES if changed else state != TOO_MANY_FILES


@live("min_free_disk", "99.99%")
async def _min_free(d: Daemon, changed: bool) -> None:
    space = d.diskguard.space
    assert space is not None
    floor = d.diskguard.status()["floor"]
    assert floor == (floor_bytes("99.99%", space.total) if changed else 1 << 30)


@live("disk_check_interval", "100ms")
async def _disk_interval(d: Daemon, changed: bool) -> None:
    if changed:  # rounds every 100 ms now (with the old hour, one round after the wake)
        rounds = d.diskguard.rounds
        await until(lambda: d.diskguard.rounds >= rounds + 3, "disk rounds at the new interval")


# --------------------------------------------------------------------------- the proxy

async def _caps(d: Daemon) -> list[dict[str, int]]:
    """The caps of the group the proxy serves now (set at its start, before the reload) and
    of the one its next run gets."""
    running = d.proxy.caps("main")
    await d.proxy.start_for_config(d.orch.cfg, "other")
    try:
        return [running, d.proxy.caps("other")]
    finally:
        await d.proxy.stop_group("other")


@live("proxy_connections", "3")
async def _proxy_connections(d: Daemon, changed: bool) -> None:
    assert [c["max_connections"] for c in await _caps(d)] == [3 if changed else 32] * 2


@live("proxy_requests_per_minute", "30")
async def _proxy_rate(d: Daemon, changed: bool) -> None:
    assert [c["requests_per_minute"] for c in await _caps(d)] == [30 if changed else 300] * 2


@live("tokens_per_day", "1000")
async def _tokens(d: Daemon, changed: bool) -> None:
    assert [c["tokens_per_day"] for c in await _caps(d)] == [1000 if changed else 0] * 2


@live("answer_tokens_estimate", "1000")
async def _answer_estimate(d: Daemon, changed: bool) -> None:
    assert [c["answer_tokens_estimate"] for c in await _caps(d)] == \
        [1000 if changed else 4096] * 2


# --------------------------------------------------------------------------- the tests

def test_every_limit_has_a_decision() -> None:
    """Each limits key is checked live here or named restart-only, never both."""
    restart = {k.split(".", 1)[1] for k in RESTART_ONLY if k.startswith("limits.")}
    keys = set(Limits.model_fields)
    undecided = keys - set(LIVE) - restart
    assert not undecided, (f"limits keys with no reload decision: {sorted(undecided)}: make "
                           "each live (and check it here) or name it in "
                           "mdclaw.config.live.RESTART_ONLY")
    assert set(LIVE) <= keys and restart <= keys
    assert not set(LIVE) & restart
    assert set(RESTART_VALUES) == restart, "give each restart-only key a value to reload"


def _tagged(model: type[BaseModel], prefix: str = "") -> set[str]:
    """The keys of `model` (and its sections) whose description says "(restart to apply)"."""
    out = set()
    for name, info in model.model_fields.items():
        if "(restart to apply)" in (info.description or ""):
            out.add(prefix + name)
        for sub in (info.annotation, *get_args(info.annotation)):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                out |= _tagged(sub, f"{prefix}{name}.")
    return out


def test_restart_only_keys_say_so_in_the_reference() -> None:
    """docs/configuration.md and the NixOS options show each field's description: the keys
    named in RESTART_ONLY, and only they, say "(restart to apply)"."""
    assert _tagged(Config) == set(RESTART_ONLY)


def write(path: Path, tmp: Path, **limits: str) -> None:
    text = "".join(f"  {k}: {v}\n" for k, v in {**BASE_LIMITS, **limits}.items())
    path.write_text(BASE.format(data_dir=tmp / "data", tmp=tmp, limits=text))


async def running_daemon(path: Path) -> tuple[Daemon, asyncio.Task[int]]:
    d = Daemon(load_config(path), str(path), drain_timeout=1)
    ready = asyncio.Event()
    d.notifier.ready = lambda status=None: ready.set()  # type: ignore[method-assign]
    task = asyncio.create_task(d.run())
    await asyncio.wait_for(ready.wait(), 30)
    return d, task


def test_a_reload_reaches_every_limit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "config.yaml"
    write(path, tmp_path)
    caplog.set_level(logging.INFO)
    keys = list(Limits.model_fields)

    async def go() -> None:
        d, task = await running_daemon(path)
        try:
            assert d.runner is not None, "the runner is made without an engine"
            d.poll_ticks = 0  # type: ignore[attr-defined]
            after_poll = d.watcher.on_poll

            def count(changed: bool) -> None:
                d.poll_ticks += 1  # type: ignore[attr-defined]
                after_poll(changed)

            d.watcher.on_poll = count
            await until(lambda: d.diskguard.rounds >= 1, "the disk guard's first round")
            await d.proxy.start_for_config(d.orch.cfg, "main")  # a run under way
            for n in range(0, 1001):  # files of the group, for disk_files' 1000
                (d.cfg.data_dir / "groups" / "main" / f"f{n}").write_text("x")
            for key in keys:
                if key in LIVE:
                    await LIVE[key][1](d, False)
            previous: str | None = None
            for key in keys:
                caplog.clear()
                value = LIVE[key][0] if key in LIVE else RESTART_VALUES[key]
                write(path, tmp_path, **{key: value})
                assert await d.reload(), d.reload_error
                if f"limits.{key}" in RESTART_ONLY:
                    assert f"reload: limits.{key} changed; restart mdclaw to apply it" \
                        in caplog.text
                else:
                    await LIVE[key][1](d, True)
                if previous in LIVE:  # this reload put the previous key back
                    await LIVE[previous][1](d, False)
                previous = key
        finally:
            d.stop_event.set()
            assert await task == 0

    asyncio.run(go())


def test_restart_only_sections_keep_their_running_value(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    """server, channels, runtime, data_dir and metrics: the running daemon keeps them and
    says to restart; the other sections of the same file are applied (here the assistant's name,
    which the local chat shows, and transcription, which gets a transcriber)."""
    path = tmp_path / "config.yaml"
    write(path, tmp_path)
    caplog.set_level(logging.INFO)

    async def go() -> None:
        d, task = await running_daemon(path)
        try:
            before = d.cfg
            http = next(ch for ch in d.channels if ch.name == "http")
            assert d.orch.transcriber is None and http.assistant_name == "Andy"  # type: ignore[attr-defined]
            text = path.read_text().replace(
                '"127.0.0.1:0"', '"127.0.0.1:1"').replace(
                "{http: {enabled: true}}", "{http: null}").replace(
                "reload-test", "other").replace(
                "enabled: false", "enabled: true").replace(
                f"data_dir: {tmp_path / 'data'}", f"data_dir: {tmp_path / 'elsewhere'}").replace(
                "name: Andy", "name: Bob")
            path.write_text(text + "transcription: {provider: openai}\n")
            assert await d.reload(), d.reload_error
            for key in RESTART_ONLY:
                assert f"reload: {key} changed; restart mdclaw to apply it" in caplog.text
                assert getattr(d.cfg, key.split(".")[0]) == getattr(before, key.split(".")[0])
            assert d.cfg.assistant.name == "Bob" and http.assistant_name == "Bob"  # type: ignore[attr-defined]
            assert d.orch.transcriber is not None
        finally:
            d.stop_event.set()
            assert await task == 0

    asyncio.run(go())


def test_a_restart_only_limit_keeps_its_running_value(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The rule a limits key would follow if it were named restart-only: the running value
    stays, the log says so, and the other keys of the reload apply."""
    path = tmp_path / "config.yaml"
    write(path, tmp_path)
    old = load_config(path)
    write(path, tmp_path, cpus="1.5", pids="256")
    new = load_config(path)
    caplog.set_level(logging.INFO)
    kept, changed = reload_config(old, new, keys=("channels", "limits.cpus"))
    assert changed == ["limits.cpus"]
    assert "reload: limits.cpus changed; restart mdclaw to apply it" in caplog.text
    assert kept.limits.cpus == 2.0 and kept.limits.pids == 256
    assert reload_config(old, new, keys=RESTART_ONLY) == (new, [])
