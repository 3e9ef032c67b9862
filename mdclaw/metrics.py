"""The daemon's Prometheus series: one registry, the metric objects the hot paths bump.

Everything here is cheap enough for the IPC loop: a counter increment or a histogram
observation on a label child looked up once and cached (`Labeled.get`), no locks beyond
the ones prometheus-client takes per value. Gauges that come from the database (outbox
rows, action jobs, budget use) are not kept here: the daemon's collector
(`mdclaw.operator.metrics`) computes them when Prometheus scrapes.

The registry is `REGISTRY`, mdclaw's own (never prometheus-client's global one), so nothing
else in the process adds series and tests can read it alone. Label values are bounded:
group folders come from the config, command types from the protocol (anything else is
"other"), models are capped at `MAX_MODELS` distinct names. docs/metrics.md lists every
series.

This module imports nothing of mdclaw's, so any layer may bump a series.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

# Seconds, from sub-millisecond (the IPC loop) to minutes (containers).
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_SLOW = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_WAIT = (0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

MAX_MODELS = 32  # distinct model label values; more are counted as "other"
MAX_CHILDREN = 4096  # label combinations cached per metric (a safety net, never reached)

IPC_COMMIT = Histogram(
    "mdclaw_ipc_commit_seconds",
    "IPC command files: from the loop picking up a batch to its transaction committing.",
    buckets=_FAST, registry=REGISTRY)
IPC_COMMANDS = Counter(
    "mdclaw_ipc_commands",
    "IPC command files finished, by command type, group and outcome (applied, quarantined).",
    ["type", "group", "outcome"], registry=REGISTRY)
ACTION_JOBS_FINISHED = Counter(
    "mdclaw_action_jobs_finished",
    "Off-loop action jobs finished by the action worker, by action and outcome (done, failed).",
    ["action", "outcome"], registry=REGISTRY)
QUEUE_WAIT = Histogram(
    "mdclaw_queue_wait_seconds",
    "Container jobs: from being queued to their first start, by kind (task, message).",
    ["kind"], buckets=_WAIT, registry=REGISTRY)
CONTAINER_STARTS = Counter(
    "mdclaw_container_starts",
    "Agent containers the engine was asked to start, by outcome (started, failed).",
    ["outcome"], registry=REGISTRY)
CONTAINER_START = Histogram(
    "mdclaw_container_start_seconds",
    "How long the engine took to start an agent container (successful starts).",
    buckets=_FAST[4:] + (10.0, 30.0, 60.0), registry=REGISTRY)
CONTAINER_RUN = Histogram(
    "mdclaw_container_run_seconds",
    "Agent container runs from start to exit, by outcome (success, error, timeout).",
    ["outcome"], buckets=_SLOW, registry=REGISTRY)
OUTBOX_DELIVERY = Histogram(
    "mdclaw_outbox_delivery_seconds",
    "Outbox rows: from the row's commit to the channel's send returning, by channel.",
    ["channel"], buckets=_FAST[3:] + (10.0, 30.0, 60.0, 300.0), registry=REGISTRY)
OUTBOX_ATTEMPTS = Counter(
    "mdclaw_outbox_attempts",
    "Outbox delivery attempts, by channel and outcome (sent, retry, failed).",
    ["channel", "outcome"], registry=REGISTRY)
SCHEDULER_LATENESS = Histogram(
    "mdclaw_scheduler_lateness_seconds",
    "Scheduled task runs: from the slot's time to the run being started.",
    buckets=_FAST[3:] + (10.0, 30.0, 60.0, 300.0, 3600.0), registry=REGISTRY)
APPROVALS_DECIDED = Counter(
    "mdclaw_approvals_decided",
    "Approvals decided and carried out, by kind (command, action, admission, question) and "
    "outcome (approved, denied, expired, answered).",
    ["kind", "outcome"], registry=REGISTRY)
APPROVAL_WAIT = Histogram(
    "mdclaw_approval_decide_seconds",
    "Approvals: from the request to the decision (expired ones included), by outcome.",
    ["outcome"], buckets=(1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
                          7200.0, 86400.0), registry=REGISTRY)
PROXY_REQUESTS = Counter(
    "mdclaw_proxy_requests",
    "Model requests through the credential proxy, by group, model and outcome (ok, error).",
    ["group", "model", "outcome"], registry=REGISTRY)
PROXY_TOKENS = Counter(
    "mdclaw_proxy_tokens",
    "Model tokens the API reported through the credential proxy, by group, model and "
    "direction (input, output).",
    ["group", "model", "direction"], registry=REGISTRY)
MCP_CALLS = Counter(
    "mdclaw_mcp_calls",
    "MCP tool calls of agents and operators, by server, tool and outcome (ok, tool_error, "
    "refused, timeout, too_large, server_down, crashed, protocol_error, error).",
    ["server", "tool", "outcome"], registry=REGISTRY)
MCP_CALL = Histogram(
    "mdclaw_mcp_call_seconds",
    "MCP tool calls from the host taking them to their result, by server and tool.",
    ["server", "tool"], buckets=_FAST[2:] + (10.0, 30.0, 60.0, 300.0), registry=REGISTRY)
MCP_RESTARTS = Counter(
    "mdclaw_mcp_server_restarts",
    "MCP servers started again after they stopped or could not start, by server.",
    ["server"], registry=REGISTRY)
HTTP_CONNECTIONS_CLOSED = Counter(
    "mdclaw_http_connections_closed",
    "HTTP connections the daemon closed on a slow or greedy client, by listener (web, "
    "metrics, proxy) and reason (over_cap, header_timeout, body_timeout, idle, not_reading).",
    ["listener", "reason"], registry=REGISTRY)


class Labeled:
    """Label children of `metric` cached by their values: one dict lookup per event
    instead of prometheus-client's validation and lock in `labels()`."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def get(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(self._children) >= MAX_CHILDREN:
                values = tuple("other" for _ in values)
            child = self._children[values] = self.metric.labels(*values)
        return child


ipc_commands = Labeled(IPC_COMMANDS)
action_jobs_finished = Labeled(ACTION_JOBS_FINISHED)
queue_wait = Labeled(QUEUE_WAIT)
container_starts = Labeled(CONTAINER_STARTS)
container_run = Labeled(CONTAINER_RUN)
outbox_delivery = Labeled(OUTBOX_DELIVERY)
outbox_attempts = Labeled(OUTBOX_ATTEMPTS)
approvals_decided = Labeled(APPROVALS_DECIDED)
approval_wait = Labeled(APPROVAL_WAIT)
proxy_requests = Labeled(PROXY_REQUESTS)
proxy_tokens = Labeled(PROXY_TOKENS)
mcp_calls = Labeled(MCP_CALLS)
mcp_call = Labeled(MCP_CALL)
mcp_restarts = Labeled(MCP_RESTARTS)
http_connections_closed = Labeled(HTTP_CONNECTIONS_CLOSED)

def observe_many(histogram: Any, amount: float, n: int) -> None:
    """`n` observations of the same `amount` (the files of one IPC round)."""
    for _ in range(n):
        histogram.observe(amount)


_models: set[str] = set()


def model_label(model: str) -> str:
    """`model` as a label value: the first MAX_MODELS distinct names, then "other" (an
    agent may name any model when none is configured)."""
    if model in _models:
        return model
    if len(_models) >= MAX_MODELS:
        return "other"
    _models.add(model)
    return model
