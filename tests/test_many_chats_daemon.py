"""One agent in many chats, on a real daemon (in this process; the tests' fake engine runs
the agent's containers): the same person on Telegram (the fake Bot API, tests/fake_telegram.py)
and in the web chat reaches one group, one folder and one memory.

shared: one conversation sees both chats' messages, each marked with its chat, and answers
each in the chat it came from. per_chat: a conversation (cursor, session) per chat over the
same folder: what the agent noted from Telegram it finds when asked on the web. And the
destinations rule: a message to a chat or group listed in may_send_to is delivered, one to
anywhere else is refused (quarantined) naming the rule."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import mdclaw.daemon.core as core
from fake_engine import FakeContainer, FakeEngine
from fake_telegram import TOKEN as TG_TOKEN
from fake_telegram import FakeBotApi, ThreadedFake
from mdclaw.config import load_config
from mdclaw.daemon.core import Daemon
from waiting import wait_until_async

ME = 111  # the person's Telegram user id (a private chat with the bot: tg:111)

CONFIG = """\
data_dir: {data}
assistant: {{name: Andy, timezone: UTC}}
server: {{listen: "127.0.0.1:0"}}
runtime: {{image: "mdclaw-agent:many-chats-test"}}
models: {{local: {{backend: openai, model: fake, base_url: "http://127.0.0.1:9/v1"}}}}
limits: {{ipc_poll_interval: 100ms, idle_timeout: 30s}}
channels:
  http: {{enabled: true}}
  telegram: {{token_file: {tg_token}, api_base: "{tg_url}"}}
groups:
  main: {{name: Admin, jid: "hl:admin", main: true}}
  me: {{name: Me, chats: ["tg:{me}", "hl:me"], session: {session}, requires_trigger: false,
        may_send_to: ["hl:news", family]}}
  family: {{name: Family, jid: "hl:family"}}
  other: {{name: Other, jid: "hl:other"}}
"""


class Agent:
    """The scripted agent of every container: it notes what it was told in its group's
    folder (its memory), answers each turn "re: <text>" and reports the session it is in;
    asked "what do you know?", it answers with its notes."""

    def __init__(self) -> None:
        self.turns: list[tuple[str, str | None, str]] = []  # (container, chat, text)
        self.lock = threading.Lock()

    def __call__(self, c: FakeContainer) -> int:
        session = c.input.get("sessionId") or f"s-{c.name}"
        text: str | None = c.prompt
        chat: str | None = c.input.get("chatJid")
        while text is not None:
            with self.lock:
                self.turns.append((c.name, chat, text))
            assert c.group_dir is not None
            notes = c.group_dir / "notes.md"
            if "what do you know?" in text:
                answer = "I know: " + (notes.read_text().strip() if notes.exists() else "-")
            else:
                with notes.open("a") as f:
                    f.write(f"{_said(text)}\n")
                answer = f"re: {_said(text)}"
            c.say({"status": "success", "result": answer, "newSessionId": session})
            got = c.next_input(timeout=60)
            text = None if got is None else str(got.get("content", ""))
            chat = None if got is None else got.get("chat_jid")
        return 0


def _said(prompt: str) -> str:
    """The text of the newest message of a prompt (`<message ...>text</message>`)."""
    last = prompt.rsplit("<message ", 1)[-1]
    return last.split(">", 1)[1].split("</message>", 1)[0]


class World:
    def __init__(self, tmp: Path, tg: FakeBotApi, fakes: ThreadedFake) -> None:
        self.tmp, self.tg, self.fakes = tmp, tg, fakes
        self.data = tmp / "data"
        self.agent = Agent()
        self.engine: FakeEngine | None = None
        self.d: Daemon | None = None
        self.n = 0
        self.extra = ""  # more config (top-level keys) after the common part

    def write_config(self, session: str) -> Path:
        token = self.tmp / "tg-token"
        token.write_text(TG_TOKEN)
        token.chmod(0o600)
        path = self.tmp / "config.yaml"
        path.write_text(CONFIG.format(data=self.data, tg_token=token, tg_url=self.fakes.urls["tg"],
                                      me=ME, session=session) + self.extra)
        return path

    @property
    def url(self) -> str:
        assert self.d is not None and self.d.web is not None
        return self.d.web.url

    def telegram(self, text: str) -> None:
        self.n += 1
        msg = {"message_id": 5000 + self.n, "date": int(time.time()),
               "chat": {"id": ME, "type": "private"},
               "from": {"id": ME, "is_bot": False, "first_name": "Sam"}, "text": text}
        self.fakes.call(self.tg.push, msg)

    async def web(self, text: str, jid: str = "hl:me") -> None:
        async with aiohttp.ClientSession() as s, s.post(
                f"{self.url}/message", json={"jid": jid, "text": text, "sender": "sam",
                                             "sender_name": "Sam"}) as r:
            assert r.status == 202, await r.text()

    async def web_out(self, jid: str) -> list[str]:
        """What the assistant wrote in web chat `jid`, read through the chat's API."""
        async with aiohttp.ClientSession() as s, s.get(
                f"{self.url}/messages", params={"jid": jid, "after": "0"}) as r:
            body = await r.json()
        return [m["content"] for m in body["messages"] if m["direction"] == "out"]

    def telegram_out(self) -> list[str]:
        return [p["text"] for p in self.tg.of("sendMessage") if int(p["chat_id"]) == ME]

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.data / "state.db", timeout=30) as db:
            return db.execute(sql, args).fetchall()

    async def until(self, cond: Callable[[], Any], what: str, timeout: float = 30) -> None:
        await wait_until_async(cond, timeout, what=what, interval=0.05)

    async def web_until(self, jid: str, want: str) -> None:
        for _ in range(600):
            if want in await self.web_out(jid):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{want!r} never reached {jid}: {await self.web_out(jid)}")


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    tg = FakeBotApi()
    with ThreadedFake(tg=tg) as fakes:
        w = World(tmp_path, tg, fakes)

        def engine(_runtime: Any) -> FakeEngine:
            w.engine = FakeEngine(default=w.agent)
            return w.engine

        monkeypatch.setattr(core, "create_runtime", engine)
        yield w


def run_daemon(w: World, session: str, body: Callable[[], Any]) -> None:
    path = w.write_config(session)

    async def go() -> None:
        d = Daemon(load_config(path), str(path), drain_timeout=1)
        ready = asyncio.Event()
        d.notifier.ready = lambda status=None: ready.set()  # type: ignore[method-assign]
        task = asyncio.create_task(d.run())
        await asyncio.wait_for(ready.wait(), 30)
        w.d = d
        try:
            await w.until(lambda: w.tg.of("getMe"), "the Telegram channel")
            await body()
        finally:
            d.stop_event.set()
            assert await asyncio.wait_for(task, 60) == 0

    asyncio.run(go())


def containers(w: World, folder: str) -> list[FakeContainer]:
    assert w.engine is not None
    return [c for c in w.engine.containers if c.spec.labels.get("mdclaw.group") == folder]


def test_shared_one_conversation_answers_each_chat_in_its_own(world: World) -> None:
    w = world

    async def body() -> None:
        w.telegram("my favourite colour is blue")
        await w.until(lambda: "re: my favourite colour is blue" in w.telegram_out(),
                      "the answer on Telegram")
        # The conversation is open: the web message is a follow-up of the same one.
        await w.web("and my cat is called Tom")
        await w.web_until("hl:me", "re: and my cat is called Tom")
        assert "re: and my cat is called Tom" not in w.telegram_out()
        assert "re: my favourite colour is blue" not in await w.web_out("hl:me")
        mine = containers(w, "me")
        assert len(mine) == 1, "one conversation for both chats"
        turns = [t for t in w.agent.turns if t[0] == mine[0].name]
        # Each message carries the chat it came from: in the prompt and with the follow-up
        # (the agent's tools answer there by default).
        assert 'chat="tg:111"' in turns[0][2] and turns[0][1] == "tg:111"
        assert 'chat="hl:me"' in turns[1][2] and turns[1][1] == "hl:me"
        # One memory: both chats' messages in the group's transcript, one folder.
        rows = w.query("SELECT chat_jid FROM transcript WHERE group_folder = 'me' "
                       "AND direction = 'in' ORDER BY id")
        assert [r[0] for r in rows] == ["tg:111", "hl:me"]
        notes = (w.data / "groups" / "me" / "notes.md").read_text()
        assert "blue" in notes and "Tom" in notes
        # One conversation, one cursor and one session: the group's.
        assert w.query("SELECT group_folder FROM sessions WHERE group_folder LIKE 'me%'") \
            == [("me",)]

    run_daemon(w, "shared", body)


def test_per_chat_separate_conversations_over_one_folder(world: World) -> None:
    w = world

    async def body() -> None:
        w.telegram("my favourite colour is green")
        await w.until(lambda: "re: my favourite colour is green" in w.telegram_out(),
                      "the answer on Telegram")
        # The web chat has a conversation of its own: the Telegram one ends, the web one
        # starts, and it does not see the Telegram message, yet finds what the agent noted.
        await w.web("what do you know?")
        await w.web_until("hl:me", "I know: my favourite colour is green")
        mine = containers(w, "me")
        assert len(mine) == 2
        tg_run, web_run = mine
        assert tg_run.input["chatJid"] == "tg:111" and web_run.input["chatJid"] == "hl:me"
        assert "favourite colour" not in web_run.prompt
        assert "what do you know" not in tg_run.prompt
        assert tg_run.group_dir == web_run.group_dir  # one folder, one memory
        # Each chat its own session: the Telegram one resumes its own.
        w.telegram("and the sky?")
        await w.until(lambda: "re: and the sky?" in w.telegram_out(), "the second answer")
        third = containers(w, "me")[2]
        assert third.input["chatJid"] == "tg:111"
        assert third.input.get("sessionId") == f"s-{tg_run.name}"
        assert "what do you know" not in third.prompt and "favourite" not in third.prompt
        sessions = dict(w.query("SELECT group_folder, session_id FROM sessions "
                                "WHERE group_folder LIKE 'me%'"))
        assert sessions == {"me@tg:111": f"s-{tg_run.name}", "me@hl:me": f"s-{web_run.name}"}
        assert "I know" not in " ".join(w.telegram_out())

    run_daemon(w, "per_chat", body)


def _command(data: Path, folder: str, body: dict[str, Any], n: int) -> str:
    d = data / "ipc" / folder / "messages"
    name = f"{int(time.time() * 1000)}-{n}.json"
    tmp = d / f".{name}.tmp"
    tmp.write_text(json.dumps(body))
    os.rename(tmp, d / name)
    return name


def test_a_listed_destination_is_delivered_and_any_other_refused(world: World) -> None:
    w = world

    async def body() -> None:
        send = [
            {"type": "message", "chat_jid": "hl:news", "text": "to a listed chat"},
            {"type": "message", "group": "family", "text": "to a listed group"},
            {"type": "message", "chat_jid": "hl:family", "text": "to a listed group's chat"},
            {"type": "message", "text": "to its own first chat"},
            {"type": "message", "chat_jid": "hl:me", "text": "to its own other chat"},
        ]
        refused = [
            {"type": "message", "chat_jid": "hl:other", "text": "to a group not listed"},
            {"type": "message", "group": "other", "text": "to a group by name, not listed"},
            {"type": "message", "chat_jid": "tg:999", "text": "to a chat not listed"},
        ]
        for n, cmd in enumerate(send + refused):
            _command(w.data, "me", cmd, n)
        await w.web_until("hl:news", "to a listed chat")
        await w.web_until("hl:family", "to a listed group")
        await w.web_until("hl:family", "to a listed group's chat")
        await w.web_until("hl:me", "to its own other chat")
        await w.until(lambda: "to its own first chat" in w.telegram_out(), "the own chat")
        errors = w.data / "ipc" / "errors"
        await w.until(lambda: len(list(errors.glob("*.error.json"))) >= 3,
                      "three refusals quarantined")
        quarantined = [json.loads(p.read_text()) for p in errors.glob("*.error.json")]
        assert {q["source_group"] for q in quarantined} == {"me"}
        reasons = " ".join(q["error"] for q in quarantined)
        assert reasons.count("not in groups.me.may_send_to") == 3, reasons
        assert "hl:other" in reasons and "'other'" in reasons and "tg:999" in reasons
        assert await w.web_out("hl:other") == []
        assert not [p for p in w.tg.of("sendMessage") if int(p["chat_id"]) == 999]

    run_daemon(w, "shared", body)


def test_per_chat_a_chat_waiting_while_another_starts_is_not_kept_waiting(
        world: World) -> None:
    """per_chat: a message in the web chat while the Telegram conversation's container is
    still being started (its run picked, no container yet) ends that conversation once its
    turn is answered, as it would a running one's: it does not wait for the Telegram
    conversation to go idle (limits.idle_timeout, 30 s here)."""
    w = world
    entered, go = threading.Event(), threading.Event()

    async def body() -> None:
        assert w.d is not None and w.d.orch is not None and w.d.orch.runner is not None
        runner = w.d.orch.runner
        build = runner.build_spec

        def held_build(folder: str, *args: Any, **kwargs: Any) -> Any:
            if folder == "me" and not entered.is_set():
                entered.set()
                assert go.wait(30)
            return build(folder, *args, **kwargs)

        runner.build_spec = held_build  # type: ignore[method-assign]
        w.telegram("first on telegram")
        await w.until(entered.is_set, "the Telegram conversation's start")
        await w.web("meanwhile on the web")
        orch = w.d.orch
        await w.until(lambda: orch.queue.pending("me"), "the web chat's run queued")
        go.set()
        await w.until(lambda: "re: first on telegram" in w.telegram_out(), "the Telegram answer")
        t0 = time.monotonic()
        await w.web_until("hl:me", "re: meanwhile on the web")
        assert time.monotonic() - t0 < 15, "the web chat waited for the idle timeout"

    run_daemon(w, "per_chat", body)
