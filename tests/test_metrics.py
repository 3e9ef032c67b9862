"""Prometheus metrics against a real daemon: `/metrics` on the HTTP channel's listener and on
a listener of its own, behind the operator page's access rule, and the series moving when
IPC commands are applied. Also: the Grafana dashboard only asks for series mdclaw exports."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from operator_helpers import REPO, free_ports, running_daemon
from test_operator_access import non_loopback_address
from waiting import wait_until

TOKEN = "metrics-test-token"

CONFIG = """\
data_dir: {data_dir}
assistant: {{name: Andy, timezone: UTC}}
limits: {{tokens_per_day: 50000}}
groups:
  main: {{name: Admin, jid: "hl:main", main: true}}
  side: {{name: Side, jid: "hl:side"}}
channels:
  http: {{listen: "{listen}"{secret}{enabled}}}
metrics: {{listen: "{metrics_listen}"}}
"""


def write_config(tmp_path: Path, *, listen: str, metrics_listen: str, secret: bool,
                 http: bool = True) -> Path:
    extra = ""
    if secret:
        sf = tmp_path / "http.token"
        sf.write_text(TOKEN + "\n")
        sf.chmod(0o600)
        extra = f", secret_file: {sf}"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(data_dir=tmp_path / "data", listen=listen, secret=extra,
                                 enabled="" if http else ", enabled: false",
                                 metrics_listen=metrics_listen))
    return cfg


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition text."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(got: dict, name: str, **labels: str) -> float:
    return got.get((name, tuple(sorted(labels.items()))), 0.0)


def write_command(data_dir: Path, group: str, sub: str, body: dict | bytes, n: int) -> Path:
    d = data_dir / "ipc" / group / sub
    name = f"{time.time_ns()}-{n}.json"
    tmp = d / f".{name}.tmp"
    tmp.write_bytes(body if isinstance(body, bytes) else json.dumps(body).encode())
    os.rename(tmp, d / name)
    return d / name


def test_series_move_when_commands_are_applied(tmp_path: Path) -> None:
    port, mport = free_ports(2)
    cfg = write_config(tmp_path, listen=f"127.0.0.1:{port}",
                       metrics_listen=f"127.0.0.1:{mport}", secret=True)
    data = tmp_path / "data"
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    url = f"http://127.0.0.1:{port}/metrics"
    with running_daemon(cfg, port):
        # the access rule: a token is configured, so nothing without it
        status, body = get(url)
        assert status == 401, body
        assert get(url, {"Authorization": "Bearer wrong"})[0] == 401
        status, text = get(url, bearer)
        assert status == 200, text
        before = samples(text)
        assert value(before, "mdclaw_outbox_rows", status="pending") == 0
        assert value(before, "mdclaw_budget_tokens_per_day", group="main") == 50000
        assert ("mdclaw_budget_tokens_used", (("group", "side"),)) in before
        assert value(before, "mdclaw_channel_connected", channel="http") == 1
        assert ("mdclaw_queue_jobs", (("state", "pending"),)) in before

        files = [
            write_command(data, "main", "messages", {"type": "message", "chatJid": "hl:main",
                                                     "text": "hello from the agent"}, 1),
            write_command(data, "main", "tasks", {"type": "schedule_task", "taskId": "tick",
                                                  "prompt": "p", "schedule_type": "interval",
                                                  "schedule_value": "1000"}, 2),
            write_command(data, "side", "tasks", b'{"type": "no_such_command"}', 3),
            write_command(data, "side", "messages", {"type": "message", "chatJid": "hl:side",
                                                     "text": "from side"}, 4),
        ]
        wait_until(lambda: not any(f.exists() for f in files), 30,
                   what="the command files to be finished")

        def moved() -> dict | None:
            got = samples(get(url, bearer)[1])
            ok = (value(got, "mdclaw_ipc_commit_seconds_count")
                  >= value(before, "mdclaw_ipc_commit_seconds_count") + 4
                  and value(got, "mdclaw_outbox_delivery_seconds_count", channel="http") >= 2
                  and value(got, "mdclaw_scheduler_lateness_seconds_count") >= 1)
            return got if ok else None

        after = wait_until(moved, 30, what="the series to move")
        applied = "mdclaw_ipc_commands_total"
        assert value(after, applied, type="message", group="main", outcome="applied") == 1
        assert value(after, applied, type="message", group="side", outcome="applied") == 1
        assert value(after, applied, type="schedule_task", group="main",
                     outcome="applied") == 1
        assert value(after, applied, type="invalid", group="side", outcome="quarantined") == 1
        assert (value(after, "mdclaw_ipc_commit_seconds_sum")
                > value(before, "mdclaw_ipc_commit_seconds_sum"))
        assert value(after, "mdclaw_outbox_attempts_total", channel="http", outcome="sent") == 2
        assert value(after, "mdclaw_outbox_rows", status="pending") == 0
        assert ("mdclaw_queue_max_concurrent", ()) in after

        # the listener of its own: the same series, the same rule
        murl = f"http://127.0.0.1:{mport}/metrics"
        assert get(murl)[0] == 401
        status, text = get(murl, bearer)
        assert status == 200
        assert value(samples(text), applied, type="message", group="main",
                     outcome="applied") == 1
        # it serves nothing else
        assert get(f"http://127.0.0.1:{mport}/operator/", bearer)[0] == 404


def test_without_a_token_only_loopback_clients_may_scrape(tmp_path: Path) -> None:
    addr = non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback address to connect from")
    port, mport = free_ports(2)
    cfg = write_config(tmp_path, listen=f"0.0.0.0:{port}", metrics_listen=f"0.0.0.0:{mport}",
                       secret=False)
    with running_daemon(cfg, port):
        for p in (port, mport):
            status, text = get(f"http://127.0.0.1:{p}/metrics")
            assert status == 200 and "mdclaw_ipc_commit_seconds" in text
            # another address of this machine is not loopback, whatever the headers say
            status, _ = get(f"http://{addr}:{p}/metrics",
                            {"Host": f"127.0.0.1:{p}", "X-Forwarded-For": "127.0.0.1"})
            assert status == 403
            # a loopback peer under another host name (DNS rebinding)
            assert get(f"http://127.0.0.1:{p}/metrics", {"Host": f"evil.example:{p}"})[0] == 403


def test_separate_listener_without_the_http_channel(tmp_path: Path) -> None:
    port, mport = free_ports(2)
    cfg = write_config(tmp_path, listen=f"127.0.0.1:{port}",
                       metrics_listen=f"127.0.0.1:{mport}", secret=True, http=False)
    murl = f"http://127.0.0.1:{mport}/metrics"
    ready = urllib.request.Request(murl, headers={"Authorization": f"Bearer {TOKEN}"})
    with running_daemon(cfg, port, ready=ready):
        # the token file of channels.http still guards it
        assert get(murl)[0] == 401
        status, text = get(murl, {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200
        got = samples(text)
        assert value(got, "mdclaw_budget_tokens_per_day", group="side") == 50000
        assert not any(k[0] == "mdclaw_channel_connected" and dict(k[1]).get("channel") == "http"
                       for k in got)
        # the chat is not there; the web server (channels.http.listen, the old name of
        # server.listen) is, with /metrics behind the same token
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert get(f"http://127.0.0.1:{port}/health", bearer)[0] == 404
        assert get(f"http://127.0.0.1:{port}/metrics")[0] == 401
        assert get(f"http://127.0.0.1:{port}/metrics", bearer)[0] == 200


# --------------------------------------------------------------------------- dashboard

def exported_names(tmp_path: Path) -> set[str]:
    """Every sample and family name a scrape of a daemon's state gives (also the empty
    families), rendered by the real code over a real database."""
    from mdclaw import metrics
    from mdclaw.config import Config
    from mdclaw.operator.metrics import render
    from mdclaw.queue import GroupQueue
    from mdclaw.state import Database

    async def scrape() -> str:
        async def run_job(job: object) -> None:
            return None

        async def tokens_today(folder: str) -> int:
            return 0

        with Database(tmp_path / "state.db") as db:
            # the daemon as /metrics sees it (mdclaw.ops.view.DaemonView)
            d = SimpleNamespace(db=db, queue=GroupQueue(run_job, max_concurrent=2), channels=[],
                                mcp=None,
                                tokens_today=tokens_today,
                                cfg=Config(data_dir=tmp_path, groups={"main": {
                                    "name": "A", "jid": "hl:a", "main": True}}))
            return (await render(d)).decode()

    text = asyncio.run(scrape())
    names = set(re.findall(r"^# TYPE (\w+) ", text, re.M))
    names |= set(re.findall(r"^(\w+)[{ ]", text, re.M))
    # families without samples yet still name their series
    for fam in metrics.REGISTRY.collect():
        suffixes = {"counter": ("_total", "_created"),
                    "histogram": ("_bucket", "_count", "_sum", "_created")}.get(fam.type, ())
        names |= {fam.name + s for s in suffixes} | {fam.name}
    return names


def test_dashboard_asks_only_for_exported_series(tmp_path: Path) -> None:
    board = json.loads((REPO / "contrib" / "grafana" / "mdclaw.json").read_text())
    assert board["title"] and board["panels"] and board.get("schemaVersion")
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    exported = exported_names(tmp_path)
    used = {n for e in exprs for n in re.findall(r"\bmdclaw_\w+", e)}
    assert used, exprs
    assert used <= exported, sorted(used - exported)
    # every series family the daemon exports has a panel
    families = {re.sub(r"_(total|bucket|count|sum|created)$", "", n) for n in used}
    for fam in ("mdclaw_ipc_commit_seconds", "mdclaw_ipc_commands", "mdclaw_action_jobs",
                "mdclaw_queue_jobs", "mdclaw_queue_wait_seconds", "mdclaw_container_starts",
                "mdclaw_container_run_seconds", "mdclaw_outbox_rows",
                "mdclaw_outbox_delivery_seconds", "mdclaw_scheduler_lateness_seconds",
                "mdclaw_proxy_requests", "mdclaw_proxy_tokens", "mdclaw_budget_tokens_used",
                "mdclaw_approvals_pending", "mdclaw_approvals_decided",
                "mdclaw_approval_decide_seconds"):
        assert fam in families, fam
