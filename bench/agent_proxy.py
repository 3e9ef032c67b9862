"""Credential proxy overhead on time-to-first-byte of a streamed model response.

A fake Messages API on loopback streams a short answer (server-sent events). Each request
measures the time from sending it to the first body byte:

- `direct`: client → fake API over TCP;
- `proxy`: client → the group's unix socket → CredentialProxy (strip auth, inject the key
  from its file, count usage) → fake API;
- `proxy_forwarder`: as the agent does it: client → loopback TCP port → the runner's
  in-container forwarder → unix socket → proxy → fake API.

Reported per path: p50/p95 over N requests (after a warm-up), and the p50 overhead against
`direct`. Target (issue 6): ≤ 2 ms added. Run: python bench/agent_proxy.py [N]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "container" / "agent-runner"), str(REPO)]

from agent_helpers import ProxyThread  # noqa: E402
from fake_models import FakeAnthropic, say  # noqa: E402
from mdclaw.models import Upstream  # noqa: E402
from mdclaw.paths import Layout  # noqa: E402
from mdclaw.state import Database  # noqa: E402
from mdclaw_agent.forwarder import Forwarder  # noqa: E402

BODY = {"model": "claude-x", "stream": True, "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}]}


async def ttfb(session: aiohttp.ClientSession, url: str) -> float:
    t0 = time.perf_counter()
    async with session.post(url, json=BODY, headers={"x-api-key": "placeholder"}) as r:
        await r.content.readany()
        first = time.perf_counter()
        await r.read()
    return (first - t0) * 1000


async def series(session: aiohttp.ClientSession, url: str, n: int) -> list[float]:
    for _ in range(20):
        await ttfb(session, url)
    return [await ttfb(session, url) for _ in range(n)]


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        layout = Layout(Path(tmp))
        layout.group_ipc_dir("bench").mkdir(parents=True)
        key = Path(tmp) / "key"
        key.write_text("sk-bench")
        key.chmod(0o600)
        db = Database(layout.db_path)
        api = FakeAnthropic(script=[say("hello there")] * (4 * n + 100)).start()
        # The proxy on its own event loop thread, as in the daemon (the client, the fake API
        # and the forwarder each have theirs).
        proxy = ProxyThread(layout, db)
        sock = proxy.start_group("bench", Upstream("claude", "claude-x", api.url, key))
        fwd = Forwarder(sock).start()
        results = {}
        async with aiohttp.ClientSession() as direct:
            results["direct"] = await series(direct, f"{api.url}/v1/messages", n)
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s:
            results["proxy"] = await series(s, "http://proxy/v1/messages", n)
        async with aiohttp.ClientSession() as s:
            results["proxy_forwarder"] = await series(s, f"{fwd.base_url}/v1/messages", n)
        fwd.stop()
        proxy.close()
        api.stop()
        db.close()
    base = statistics.median(results["direct"])
    for name, samples in results.items():
        s = sorted(samples)
        p50 = statistics.median(s)
        print(json.dumps({"figure": f"ttfb_{name}_ms", "n": len(s), "p50": round(p50, 3),
                          "p95": round(s[int(len(s) * 0.95) - 1], 3),
                          "overhead_p50_ms": round(p50 - base, 3), "target_overhead_ms": 2}))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 300))
