"""`/metrics`: the daemon's Prometheus series for the operator.

Served on the daemon's web server (beside the operator page) and, with `metrics.listen`, on
a listener of its own that serves nothing else; both behind the operator page's access rule
(`mdclaw.operator.access`): the web server's bearer token when it has one, else loopback
clients under a loopback host name only.

A scrape renders mdclaw's own registry (`mdclaw.metrics.REGISTRY`: counters and histograms
the hot paths bump) and then the gauges of a collector built for that scrape from the
daemon's state (mdclaw.ops.view.DaemonView): queue depth and channels from memory, outbox rows
and action jobs from indexed counts in the database (on a thread, off the loop), budget use
per group as the credential proxy counts it. Nothing is computed per event for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from mdclaw import metrics
from mdclaw.backup import last_backup
from mdclaw.listener import ConnectionGuard
from mdclaw.operator.access import Access, Handler
from mdclaw.ops.view import DaemonView
from mdclaw.state import Database
from mdclaw.webserver import TokenGate, WebServer, connection_limits, parse_listen

log = logging.getLogger("mdclaw.metrics")

PATH = "/metrics"
OUTBOX_STATES = ("pending", "sending", "failed")
JOB_STATES = ("awaiting_approval", "queued", "running", "failed")
APPROVAL_KINDS = ("command", "action", "admission", "question")


class _Snapshot(Collector):
    """The gauges of one scrape, already computed."""

    def __init__(self, families: list[GaugeMetricFamily]) -> None:
        self.families = families

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return iter(self.families)


def database_counts(db: Database) -> tuple[dict[str, int], list[tuple[str, str, int]]]:
    """(outbox rows per state, (action, status, jobs) rows): index range counts only."""
    outbox = {s: int(db.query("SELECT COUNT(*) FROM outbox WHERE status = ?", (s,))[0][0])
              for s in OUTBOX_STATES}
    jobs = [(str(r[0]), str(r[1]), int(r[2])) for r in db.query(
        "SELECT action, status, COUNT(*) FROM action_jobs WHERE status IN "
        "('awaiting_approval', 'queued', 'running', 'failed') GROUP BY action, status")]
    return outbox, jobs


def pending_approvals(db: Database) -> dict[str, int]:
    """Pending approvals per kind (the partial index of pending ones, nothing else)."""
    counts = {k: 0 for k in APPROVAL_KINDS}
    for r in db.query("SELECT kind, COUNT(*) FROM approvals WHERE status = 'pending' "
                      "GROUP BY kind"):
        counts[str(r[0])] = int(r[1])
    return counts


async def scrape_gauges(d: DaemonView) -> list[GaugeMetricFamily]:
    """The gauges computed at scrape time from daemon `d`'s state."""

    out: list[GaugeMetricFamily] = []
    outbox, jobs = await asyncio.to_thread(database_counts, d.db)
    g = GaugeMetricFamily("mdclaw_outbox_rows", "Outbox rows by status (pending, sending, "
                          "failed).", labels=["status"])
    for status, n in outbox.items():
        g.add_metric([status], n)
    out.append(g)
    g = GaugeMetricFamily("mdclaw_action_jobs", "Off-loop action jobs by action and status "
                          "(awaiting_approval, queued, running, failed).",
                          labels=["action", "status"])
    for action, status, n in jobs:
        g.add_metric([action, status], n)
    out.append(g)
    g = GaugeMetricFamily("mdclaw_approvals_pending", "Approvals waiting for a person, by "
                          "kind (command, action, admission, question).", labels=["kind"])
    for kind, n in (await asyncio.to_thread(pending_approvals, d.db)).items():
        g.add_metric([kind], n)
    out.append(g)
    queue = d.queue
    if queue is not None:
        st = queue.status()
        g = GaugeMetricFamily("mdclaw_queue_jobs", "Container jobs by state (pending, running, "
                              "retrying).", labels=["state"])
        g.add_metric(["pending"], st["pending"])
        g.add_metric(["running"], len(st["running"]))
        g.add_metric(["retrying"], len(st["retrying"]))
        out.append(g)
        out.append(GaugeMetricFamily("mdclaw_queue_max_concurrent", "Containers allowed to run "
                                     "at once (limits.max_concurrent_containers).",
                                     value=st["max_concurrent"]))
    g = GaugeMetricFamily("mdclaw_channel_connected", "1 when the channel is connected.",
                          labels=["channel"])
    for ch in d.channels:
        g.add_metric([ch.name], 1 if ch.is_connected() else 0)
    out.append(g)
    cfg = d.cfg
    last = await asyncio.to_thread(last_backup, cfg.data_dir)
    if last is not None and last.at is not None:
        out.append(GaugeMetricFamily(
            "mdclaw_backup_last_success_timestamp_seconds", "When the last `mdclaw backup` "
            "succeeded (Unix time; absent before the first).", value=last.at.timestamp()))
    used = GaugeMetricFamily("mdclaw_budget_tokens_used", "Model tokens the group used today "
                             "(UTC day), as its budget counts them.", labels=["group"])
    limit = GaugeMetricFamily("mdclaw_budget_tokens_per_day", "The group's daily token budget "
                              "(only groups that have one).", labels=["group"])
    for folder in cfg.groups:
        used.add_metric([folder], await d.tokens_today(folder))
        budget = cfg.token_budget(folder)
        if budget:
            limit.add_metric([folder], budget)
    out += [used, limit]
    hub = d.mcp
    if hub is not None:
        up = GaugeMetricFamily("mdclaw_mcp_server_up", "1 when the MCP server is up (started, "
                               "initialized, its tools listed).", labels=["server"])
        tools = GaugeMetricFamily("mdclaw_mcp_tools", "Tools the MCP server offers (as last "
                                  "listed).", labels=["server"])
        for s in hub.status():
            up.add_metric([s["server"]], 1 if s["state"] == "up" else 0)
            tools.add_metric([s["server"]], len(s["tools"]))
        out += [up, tools]
    return out


async def render(d: DaemonView) -> bytes:
    """The exposition text of one scrape."""
    own = CollectorRegistry(auto_describe=False)
    own.register(_Snapshot(await scrape_gauges(d)))
    return generate_latest(metrics.REGISTRY) + generate_latest(own)


def handler(d: DaemonView) -> Handler:
    async def serve(request: web.Request) -> web.Response:
        body = await render(d)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST,
                                                "Cache-Control": "no-store"})
    return serve


def mount_metrics(server: WebServer, d: DaemonView, access: Access) -> bool:
    """Serve `/metrics` on the daemon's web server (before it starts), behind the operator
    page's `access` rule. False when metrics are off."""
    if not d.cfg.metrics.enabled:
        return False
    server.add_route("GET", PATH, access.protect(handler(d)))
    return True


async def start_listener(d: DaemonView, gate: TokenGate) -> web.AppRunner | None:
    """The listener of `metrics.listen` (None when unset or metrics are off), guarded by the
    web server's token `gate` (its lockout shared). Raises OSError when it cannot listen."""
    section = d.cfg.metrics
    if not section.enabled or not section.listen:
        return None
    host, port = parse_listen(section.listen)
    access = Access(gate)
    # Slow and greedy clients: the web server's limits (server:), mdclaw.listener.
    guard = ConnectionGuard(connection_limits(d.cfg), name="metrics")
    app = web.Application(middlewares=[guard.middleware])
    app.router.add_get(PATH, access.protect(handler(d)))
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0,
                           keepalive_timeout=guard.keepalive_timeout)
    await runner.setup()
    try:
        await guard.site(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    if not gate.has_secret and host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("metrics listen on %s without a token: only loopback clients are "
                    "answered (set server.secret_file to scrape from elsewhere)", host)
    log.info("metrics: listening on %s:%d%s", host, int(runner.addresses[0][1]), PATH)
    return runner
