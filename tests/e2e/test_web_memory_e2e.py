"""Web access and past conversations from the real agent image on the real engine.

A scripted model (openai backend) in a non-main group's container:
- `web_fetch`es a page served on 127.0.0.2, which `web.allow_private` allows: the page's
  text (HTML turned into Markdown by the host, scripts dropped) comes back as the tool result;
- `web_fetch`es the same server through 127.0.0.1 (loopback, not allowed) and two private
  addresses (10.0.0.1, 192.168.77.1): each refused by the host, nothing sent;
- `memory_search`es its past conversations (`sources: sessions`) for a word said three
  conversations ago, stored the way the daemon stores them (inbound messages, the replies'
  outbox rows): the hit's snippet comes back; another group's use of the word does not.

The container has no network: the host's IPC engine and action worker do the fetching."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from mdclaw.config import load_config
from mdclaw.ipc.watcher import IpcWatcher
from mdclaw.paths import Layout
from mdclaw.proxy import CredentialProxy
from mdclaw.reconcile import reconcile
from mdclaw.runner import ContainerInput, ContainerRunner
from mdclaw.runtime import install_labels
from mdclaw.state import Database
from mdclaw.state.conversations import StoredMessage, store_message
from mdclaw.state.outbox import enqueue

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from fake_models import FakeOpenAI, call, say  # noqa: E402

pytestmark = pytest.mark.e2e

PAGE = """<!doctype html><html><head><title>Allotment rules</title>
<script>document.write("script-text-never-shown")</script></head>
<body><h1>Allotment 14</h1><p>Water the <b>marrows</b> before nine.</p></body></html>"""

# Three conversations of the family group, oldest first: the word is said in the first.
CONVERSATIONS = [
    ("Where did we put the zeppelin kite?", "The zeppelin kite is in the attic."),
    ("What time is football practice?", "Practice starts at five on Thursday."),
    ("Can you add milk to the list?", "Milk is on the shopping list."),
]


def store_conversations(db: Database) -> None:
    """Inbound messages and the replies' outbox rows, as the daemon stores them."""
    for i, (question, answer) in enumerate(CONVERSATIONS):
        ts = f"2026-03-0{i + 1}T10:00:00.000Z"
        assert store_message(db, StoredMessage(f"tg:2:{i}", "tg:2", "u1", "Alice", question,
                                               ts, False, False),
                             channel="tg", is_group=True)
        with db.transaction() as c:
            enqueue(c, chat_jid="tg:2", kind="text", text=answer, source_group="family")
    # Another group said the word too: the family group must not see it.
    assert store_message(db, StoredMessage("tg:3:1", "tg:3", "u9", "Bob",
                                           "the zeppelin budget is secret", "2026-03-01T11:00:00"
                                           ".000Z", False, False), channel="tg", is_group=True)


def test_web_fetch_and_memory_search_in_the_container(tmp_path, engine, real_agent_image,
                                                      install_id, reap) -> None:
    page_hits: list[str] = []

    async def page(request: web.Request) -> web.Response:
        page_hits.append(request.host)
        return web.Response(text=PAGE, content_type="text/html")

    app = web.Application()
    app.router.add_get("/allotment", page)

    async def scenario():  # noqa: ANN202
        site = TestServer(app, host="127.0.0.2")
        await site.start_server()
        port = site.port
        model.script[:] = [
            call("web_fetch", url=f"http://127.0.0.2:{port}/allotment"),
            call("web_fetch", url=f"http://127.0.0.1:{port}/allotment"),
            call("web_fetch", url="http://10.0.0.1/allotment"),
            call("web_fetch", url="http://192.168.77.1:8080/"),
            call("memory_search", query="zeppelin", sources="sessions"),
            say("fetched and remembered"),
        ]
        cfg_path = tmp_path / "config.yaml"
        cfg_path.write_text(textwrap.dedent(f"""\
            data_dir: {tmp_path / 'data'}
            assistant: {{name: Andy, timezone: UTC, model: local}}
            models:
              local: {{backend: openai, model: fake-model, base_url: "{model.url}/v1"}}
            groups:
              main: {{name: Admin, jid: "tg:1", main: true}}
              family: {{name: Family, jid: "tg:2"}}
              work: {{name: Work, jid: "tg:3"}}
            web:
              enabled: true
              allow_private: ["127.0.0.2/32"]
              timeout: 10s
            limits: {{container_timeout: 120s, idle_timeout: 60s, memory: 256m, cpus: 1.0,
                      pids: 128}}
            runtime: {{image: {real_agent_image}, install_id: {install_id}}}
            """))
        cfg = load_config(cfg_path)
        reap(install_labels(cfg))
        db = Database(cfg.db_path)
        reconcile(cfg, db)
        store_conversations(db)
        watcher = IpcWatcher(cfg, db)
        stop = asyncio.Event()
        serving = asyncio.create_task(watcher.run(stop))
        runner = ContainerRunner(cfg, engine)
        proxy = CredentialProxy(Layout(cfg.data_dir))
        outs: list[dict] = []
        try:
            async with proxy.for_run(cfg, "family") as fields:
                res = await runner.run(
                    "family", ContainerInput(prompt="read the allotment page",
                                             group_folder="family", chat_jid="tg:2",
                                             is_scheduled_task=True, **fields),
                    on_output=lambda b: outs.append(json.loads(b)))
        finally:
            stop.set()
            await serving
            watcher.close()
            await proxy.close()
            await runner.aclose()
            await site.close()
            db.close()
        return cfg, res, outs

    model = FakeOpenAI([]).start()
    try:
        cfg, res, outs = asyncio.run(scenario())
    finally:
        model.stop()
    assert res.exit_code == 0 and res.status == "success", res.stderr_tail
    assert outs[0]["result"] == "fetched and remembered"
    replies = model.tool_results()
    assert len(replies) == 5, replies
    fetched, loopback, ten, lan, remembered = replies
    # The allowed page: its text, title, status and type; no script text.
    assert fetched.startswith("http://127.0.0.2:"), fetched
    assert "(HTTP 200, text/html)" in fetched.splitlines()[0]
    assert "Title: Allotment rules" in fetched
    assert "# Allotment 14" in fetched and "Water the **marrows** before nine." in fetched
    assert "script-text-never-shown" not in fetched
    # Loopback and private addresses: refused by the host, the page server saw one request.
    assert "web_fetch failed: refused 127.0.0.1: 127.0.0.1 is a loopback address" in loopback
    assert "web_fetch failed: refused 10.0.0.1: 10.0.0.1 is a private address" in ten
    assert "web_fetch failed: refused 192.168.77.1: 192.168.77.1 is a private address" in lan
    assert len(page_hits) == 1, page_hits
    # The word said three conversations ago, with when and who; not the other group's.
    assert remembered.startswith("2 match(es) for 'zeppelin':"), remembered
    assert "2026-03-01T10:00:00.000Z message (Alice): Where did we put the **zeppelin** " \
           "kite?" in remembered
    assert "reply (assistant): The **zeppelin** kite is in the attic." in remembered
    assert "budget" not in remembered


def test_a_daemon_remembers_and_fetches(tmp_path, engine, real_agent_image, install_id,
                                        reap) -> None:
    """The same through a real `mdclaw run`: three conversations through the HTTP channel
    (the daemon stores the messages and the replies), then the model searches them and
    fetches pages; the daemon's IPC loop and action worker answer."""
    from test_daemon_e2e import free_port, http, replies, wait_until
    from test_failures_e2e import Daemon, healthy

    from mdclaw.runtime import install_labels

    page_hits: list[str] = []

    async def page(request: web.Request) -> web.Response:
        page_hits.append(request.path)
        return web.Response(text=PAGE, content_type="text/html")

    app = web.Application()
    app.router.add_get("/allotment", page)
    site_loop = asyncio.new_event_loop()
    site = TestServer(app, host="127.0.0.2", loop=site_loop)
    site_loop.run_until_complete(site.start_server())
    threading.Thread(target=site_loop.run_forever, daemon=True).start()
    page_url = f"http://127.0.0.2:{site.port}/allotment"
    loop_url = f"http://127.0.0.1:{site.port}/allotment"

    def answer(body: dict):  # noqa: ANN202 - a fake model's Step
        last = body["messages"][-1]
        if last.get("role") == "tool":
            return say("tool said: " + last["content"])
        text = str(last.get("content"))
        if "remember" in text:
            return call("memory_search", query="zeppelin", sources="sessions")
        if "fetch loopback" in text:
            return call("web_fetch", url=loop_url)
        if "fetch" in text:
            return call("web_fetch", url=page_url)
        for word in ("kite", "practice", "milk"):
            if word in text:
                extra = " (a zeppelin one)" if word == "kite" else ""
                return say(f"noted the {word}{extra}")
        return say("default reply")

    model = FakeOpenAI([], fallback=answer).start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        data_dir: {tmp_path / 'data'}
        assistant: {{name: Andy, timezone: UTC, model: local}}
        models: {{local: {{backend: openai, model: fake-model, base_url: "{model.url}/v1"}}}}
        groups: {{main: {{name: Admin, jid: "hl:main", main: true}}}}
        web: {{enabled: true, allow_private: ["127.0.0.2/32"], timeout: 10s}}
        limits: {{container_timeout: 120s, idle_timeout: 30s, memory: 256m, cpus: 1.0,
                 pids: 128}}
        runtime: {{image: "{real_agent_image}", install_id: {install_id},
                  socket: "{engine.base_url}"}}
        channels: {{http: {{listen: "127.0.0.1:{port}"}}}}
        """))
    reap(install_labels(load_config(cfg_path)))
    daemon = Daemon(cfg_path, tmp_path / "daemon.log")

    def said(text: str) -> str:
        """Post `text` to the main group; return the agent's next new reply."""
        before = len(replies(base, "hl:main"))
        http("POST", f"{base}/message", {"text": text, "sender": "alice"})
        got = wait_until(lambda: replies(base, "hl:main")[before:], 120,
                         what=f"a reply to {text!r}")
        return got[0]

    try:
        wait_until(lambda: healthy(base), 60, what="the HTTP channel")
        for question, _ in CONVERSATIONS:
            said(question)
        found = said("do you remember where the kite was?")
        assert found.startswith("tool said: 2 match(es) for 'zeppelin':"), found
        assert "message (alice): Where did we put the **zeppelin** kite?" in found
        assert "reply (assistant): noted the kite (a **zeppelin** one)" in found
        fetched = said("fetch the allotment page")
        assert "(HTTP 200, text/html)" in fetched and "Water the **marrows**" in fetched
        refused = said("fetch loopback please")
        assert "refused 127.0.0.1: 127.0.0.1 is a loopback address" in refused, refused
        assert page_hits == ["/allotment"]
    finally:
        daemon.stop()
        model.stop()
        asyncio.run_coroutine_threadsafe(site.close(), site_loop).result(10)
        site_loop.call_soon_threadsafe(site_loop.stop)

