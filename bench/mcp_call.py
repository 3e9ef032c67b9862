"""MCP calls: what the host adds to a tool call, and other groups' IPC commits while slow
calls are in flight.

The real IPC loop, its action worker and an MCP hub run in a child process (as in the
daemon), with tests/mcp_servers/hostile.py (stdio) as the server, from the MCP servers'
environment (`make mcp-servers`).

- "added": `--calls` mcp_call requests of `echo`, one at a time, timed from the request
  file's rename to its result file appearing (as the agent's runner waits for it), minus the
  time the hub measured for the tool call itself (the JSON-RPC round trip to the server and
  the server's work). Also the same call made directly with mdclaw's MCP client, for scale.
  Target: added p50 <= 5 ms.
- "commits": pause/resume commands of other groups timed from rename to COMMIT, idle, then
  while 10 `slow` calls (5 s each, 2 from each of g001..g005) are in flight. Target: loaded
  p99 within 2x of idle p99.

    python bench/mcp_call.py [--calls 200] [--samples 300] [--groups 30] [--delay 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

from inotify_simple import INotify
from inotify_simple import flags as F

from ipc_common import (
    REPO,
    SERVE,
    PauseResume,
    Server,
    emit,
    make_data_dir,
    one_task_per_group,
    p50_p99,
    stage,
)

BIN = Path(os.environ.get("MDCLAW_MCP_SERVERS_BIN") or REPO / ".venv" / "mcp-servers" / "bin")
HOSTILE = REPO / "tests" / "mcp_servers" / "hostile.py"
CALLERS = [f"g{i:03d}" for i in range(1, 6)]

# The IPC loop of ipc_common, with the MCP hub the daemon runs beside it; the hub's record
# of each call (with the time the tool call itself took) is written out at the end.
SERVE_MCP = SERVE.replace(
    "load_all()\n", "load_all()\nfrom collections import deque\n"
    "from mdclaw.mcp.hub import McpHub, install\n").replace(
    "    t = asyncio.create_task(w.run(stop))\n",
    "    hub = McpHub(cfg)\n    hub.recent = deque(maxlen=100000)\n    install(hub)\n"
    "    await hub.start()\n    assert await hub.wait_up(60), hub.status()\n"
    "    t = asyncio.create_task(w.run(stop))\n").replace(
    "    w.close()\n",
    "    w.close()\n    await hub.stop()\n"
    "    with open({commits_file!r} + '.calls', 'w') as f:\n"
    "        json.dump(list(hub.recent), f)\n")


def request(ipc: Path, group: str, rid: str, tool: str, **arguments: object) -> None:
    d = ipc / group / "actions"
    d.mkdir(exist_ok=True)
    stage(d / f"{rid}.json", {"type": "action", "request_id": rid, "action": "mcp_call",
                              "params": {"server": "hostile", "tool": tool,
                                         "arguments": arguments}}).rename(d / f"{rid}.json")


def direct_calls(n: int) -> list[float]:
    """The same echo call made directly with mdclaw's MCP client (no IPC, no worker)."""
    from mdclaw.mcp.client import McpClient
    from mdclaw.mcp.transport import StdioTransport

    async def go() -> list[float]:
        t = StdioTransport(str(BIN / "python"), [str(HOSTILE)], {"PATH": os.environ["PATH"]},
                           REPO, 1 << 20)
        c = McpClient("direct", t)
        await c.start(60)
        out = []
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                await c.call_tool("echo", {"text": "hi"}, 10)
                out.append((time.perf_counter() - t0) * 1000)
        finally:
            await c.close()
        return out
    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--groups", type=int, default=30)
    ap.add_argument("--delay", type=float, default=5.0)
    ap.add_argument("--gap", type=float, default=0.005)
    ap.add_argument("--root", default=None)
    args = ap.parse_args()
    if not (BIN / "python").exists():
        raise SystemExit(f"no MCP servers' environment at {BIN}: run `make mcp-servers`")
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        cfg = make_data_dir(root, args.groups)
        text = cfg.read_text().replace(
            "limits: {errors_max_files: 100000}",
            "limits: {errors_max_files: 100000, action_jobs: 12, action_jobs_per_group: 4}\n"
            f"mcp_servers:\n  hostile: {{command: \"{BIN / 'python'}\", "
            f"args: [\"{HOSTILE}\"], max_concurrent: 12, max_concurrent_per_group: 4}}")
        text = text.replace("'tg:0', main: true}", "'tg:0', main: true, "
                                                    "mcp: {hostile: ['*']}}")
        for g in CALLERS:
            i = int(g[1:])
            text = text.replace(f"jid: 'tg:{i}'}}", f"jid: 'tg:{i}', mcp: {{hostile: ['*']}}}}")
        cfg.write_text(text)
        ipc = root / "data" / "ipc"
        groups = [f"g{i:03d}" for i in range(11, args.groups)]
        one_task_per_group(ipc, groups)
        server = Server(cfg, template=SERVE_MCP)
        try:
            # Added latency, one call at a time, as an agent makes them.
            results = ipc / "g000" / "action_results"
            results.mkdir(exist_ok=True)
            ino = INotify()
            ino.add_watch(str(results), F.MOVED_TO | F.CREATE)
            totals: dict[str, float] = {}
            for n in range(args.calls + 10):
                rid = f"echo-{n}"
                t0 = time.perf_counter()
                request(ipc, "g000", rid, "echo", text="hi")
                while not (results / f"{rid}.json").exists():
                    ino.read(timeout=100)
                if n >= 10:  # the first ones warm the paths
                    totals[rid] = (time.perf_counter() - t0) * 1000
                (results / f"{rid}.json").unlink()
            # Commits of other groups, idle and with 10 slow calls in flight.
            timed = PauseResume(ipc, groups, rng, args.gap)
            for _ in range(args.samples):
                timed.sample("idle")
            loaded = rounds = 0
            slow_ids: list[tuple[str, str]] = []
            while loaded < args.samples:
                rounds += 1
                started = time.monotonic()
                for g in CALLERS:
                    for k in range(2):
                        rid = f"slow{rounds}-{g}-{k}"
                        slow_ids.append((g, rid))
                        request(ipc, g, rid, "slow", seconds=args.delay)
                time.sleep(0.3)  # the calls reach the server
                while time.monotonic() - started < args.delay - 0.5 and loaded < args.samples:
                    timed.sample("loaded")
                    loaded += 1
                deadline = time.monotonic() + args.delay + 30
                while not all((ipc / g / "action_results" / f"{r}.json").exists()
                              for g, r in slow_ids):
                    if time.monotonic() > deadline:
                        raise SystemExit("slow call results missing")
                    time.sleep(0.05)
            ok = sum(json.loads((ipc / g / "action_results" / f"{r}.json").read_text())
                     ["status"] == "success" for g, r in slow_ids)
        finally:
            commits = server.stop()
            calls = json.loads(Path(str(server.commits_file) + ".calls").read_text())
    server_ms = {}
    for c in calls:
        if c.get("tool") == "echo" and "server_seconds" in c:
            server_ms[c.get("at")] = c["server_seconds"] * 1000
    echo_server = [c["server_seconds"] * 1000 for c in reversed(calls)
                   if c.get("tool") == "echo" and "server_seconds" in c][10:]
    added = [t - s for t, s in zip(totals.values(), echo_server, strict=False)]
    direct = direct_calls(args.calls)
    t50, t99 = p50_p99(list(totals.values()))
    a50, a99 = p50_p99(added)
    s50, _ = p50_p99(echo_server)
    d50, _ = p50_p99(direct)
    common = {"calls": args.calls, "transport": "stdio"}
    emit("mcp_call_total_p50", t50, "ms", **common)
    emit("mcp_call_total_p99", t99, "ms", **common)
    emit("mcp_call_server_p50", s50, "ms", **common)
    emit("mcp_call_direct_client_p50", d50, "ms", **common)
    emit("mcp_call_added_p50", a50, "ms", target="<= 5", **common)
    emit("mcp_call_added_p99", a99, "ms", **common)
    by_phase = timed.commit_ms(commits)
    idle50, idle99 = p50_p99(by_phase["idle"])
    load50, load99 = p50_p99(by_phase["loaded"])
    common = {"samples": args.samples, "groups": args.groups, "calls_in_flight": 10,
              "call_seconds": args.delay, "calls_ok": ok, "calls_made": len(slow_ids)}
    emit("mcp_commit_idle_p50", idle50, "ms", **common)
    emit("mcp_commit_idle_p99", idle99, "ms", **common)
    emit("mcp_commit_loaded_p50", load50, "ms", **common)
    emit("mcp_commit_loaded_p99", load99, "ms", **common)
    emit("mcp_commit_p99_ratio", load99 / idle99, "x", target="<= 2", **common)


if __name__ == "__main__":
    main()
