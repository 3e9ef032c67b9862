"""Swarm identities on Telegram, on a real daemon (`mdclaw run` in a subprocess, no container
engine) with the fake Bot API (tests/fake_telegram.py) answering for the main bot and three
pool bots. The agent of group `team` is the test: it writes `message` commands with a
`sender` name into ipc/team/messages/, as the agent runner's send_message tool does."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fake_telegram import BOT_ID, FakeBotApi, ThreadedFake
from fake_telegram import TOKEN as TG_TOKEN
from operator_helpers import free_ports, running_daemon
from waiting import wait_until

pytestmark = pytest.mark.slow

TEAM = -500
POOL = {"700001:POOL-a-SECRET": {TEAM}, "700002:POOL-b-SECRET": {TEAM},
        "700003:POOL-c-SECRET": set()}  # c is in no chat
A, B, C = 700001, 700002, 700003


def secret(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


GROUPS = f"""\
  main: {{name: Admin, jid: "tg:111", main: true}}
  team: {{name: Team, jid: "tg:{TEAM}"}}
"""


class World:
    def __init__(self, tmp: Path) -> None:
        self.tg = FakeBotApi()
        for token, chats in POOL.items():
            self.tg.add_bot(token, f"pool bot {token[:6]}", chats)
        self.fakes = ThreadedFake(tg=self.tg)
        self.fakes.__enter__()
        self.data = tmp / "data"
        self.port, = free_ports(1)
        for n, t in enumerate(POOL):
            secret(tmp / f"pool-{n}", t)
        self.config = tmp / "config.yaml"
        self.write(GROUPS)
        self.n = 0

    def write(self, groups: str) -> None:
        pool = [str(self.data.parent / f"pool-{n}") for n in range(len(POOL))]
        self.config.write_text(f"""\
data_dir: {self.data}
assistant: {{name: Andy, timezone: UTC}}
server: {{listen: "127.0.0.1:{self.port}"}}
limits: {{ipc_poll_interval: 200ms}}
channels:
  telegram:
    token_file: {secret(self.data.parent / "tg-token", TG_TOKEN)}
    api_base: "{self.fakes.urls['tg']}"
    pool_token_files: {json.dumps(pool)}
groups:
{groups}""")

    def post(self, text: str, sender: str | None, group: str = "team") -> None:
        """The team agent's send_message, with its sub-agent's name."""
        self.n += 1
        d = self.data / "ipc" / group / "messages"
        body: dict[str, Any] = {"type": "message", "chat_jid": f"tg:{TEAM}", "text": text}
        if sender is not None:
            body["sender"] = sender
        tmp = d / f".m{self.n}.tmp"
        tmp.write_text(json.dumps(body))
        os.rename(tmp, d / f"{int(time.time() * 1000)}-m{self.n}.json")

    def posted(self, text: str) -> dict[str, Any]:
        """The message with `text` (or ending in it) that reached the team chat."""
        def find() -> dict[str, Any] | None:
            for (chat, _mid), m in self.tg.sent():
                if chat == TEAM and m["text"].endswith(text):
                    return m
            return None
        got: dict[str, Any] = wait_until(find, 60, interval=0.05, what=f"{text!r} posted")
        return got

    def renames(self) -> list[tuple[int, str]]:
        return [(bot, p["name"]) for bot, m, p in list(self.tg.calls_by) if m == "setMyName"]

    def close(self) -> None:
        self.fakes.__exit__(None, None, None)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    try:
        yield w
    finally:
        w.close()


def test_pool_bots_speak_as_the_sub_agents_and_keep_their_names(world: World) -> None:
    with running_daemon(world.config, world.port):
        wait_until(lambda: world.tg.of("getMe"), 30, what="the Telegram channel")
        world.post("found three papers", "Researcher")
        m = world.posted("found three papers")
        assert (m["bot"], m["bot_name"], m["text"]) == (A, "Researcher", "found three papers")
        assert world.renames() == [(A, "Researcher")]
        # The same name again: the same bot, not renamed again.
        world.post("and a fourth", "Researcher")
        assert world.posted("and a fourth")["bot"] == A
        # Telegram refuses the next rename (rate limit): the main bot posts, the name before
        # the text in bold; the bot is not asked again before its retry_after.
        world.fakes.call(world.tg.fail.setdefault("setMyName", []).append,
                         (429, {"ok": False, "error_code": 429, "description":
                                "Too Many Requests: retry after 3600",
                                "parameters": {"retry_after": 3600}}))
        world.post("a draft", "Writer")
        m = world.posted("a draft")
        assert (m["bot"], m["text"]) == (BOT_ID, "Writer: a draft")
        assert m["entities"][0] == {"type": "bold", "offset": 0, "length": 6}
        # The next free bot (c) is renamed, but is in no chat: the main bot posts.
        world.post("looks fine", "Critic")
        m = world.posted("looks fine")
        assert (m["bot"], m["text"]) == (BOT_ID, "Critic: looks fine")
        assert world.renames()[-1] == (C, "Critic")
        # No name: the main bot, as always.
        world.post("plain", None)
        m = world.posted("plain")
        assert (m["bot"], m["text"]) == (BOT_ID, "plain")
        renamed = len(world.renames())
    # After a restart the same name gets the same bot, which is not renamed again.
    with running_daemon(world.config, world.port):
        world.post("back again", "Researcher")
        m = world.posted("back again")
        assert (m["bot"], m["bot_name"]) == (A, "Researcher")
        assert len(world.renames()) == renamed
        # b is free now (its rename was refused in the last run, not held against it).
        world.post("second draft", "Writer")
        m = world.posted("second draft")
        assert (m["bot"], m["bot_name"], m["text"]) == (B, "Writer", "second draft")
        assert world.renames()[-1] == (B, "Writer")


def _assigned(w: World) -> list[list[str]]:
    """The pool's (group, name, bot) assignments as the channel saved them."""
    with sqlite3.connect(w.data / "state.db", timeout=30) as db:
        r = db.execute("SELECT value FROM router_state WHERE key = ?",
                       (f"telegram_pool:{TG_TOKEN.split(':', 1)[0]}",)).fetchone()
    return sorted(json.loads(r[0])["assigned"]) if r else []


def test_a_chat_moved_to_another_group_by_a_reload_is_that_groups(world: World) -> None:
    """The channel knows which group a chat is (pool bots are assigned per group and name)
    from the database as it is now: after a reload moves the team's chat to group `lab`,
    a name lab's agent speaks as there is lab's, not the team's (no restart needed)."""
    w = world
    with running_daemon(w.config, w.port) as proc:
        wait_until(lambda: w.tg.of("getMe"), 30, what="the Telegram channel")
        w.post("found three papers", "Researcher")
        assert w.posted("found three papers")["bot"] == A
        want = [["team", "Researcher", str(A)]]
        wait_until(lambda: _assigned(w) == want, 30, what=f"{want} saved")
        w.write(f"""\
  main: {{name: Admin, jid: "tg:111", main: true}}
  team: {{name: Team, jid: "hl:team"}}
  lab: {{name: Lab, jid: "tg:{TEAM}"}}
""")
        proc.send_signal(signal.SIGHUP)

        def moved() -> bool:
            with sqlite3.connect(w.data / "state.db", timeout=30) as db:
                r = db.execute("SELECT folder FROM group_chats WHERE jid = ?",
                               (f"tg:{TEAM}",)).fetchone()
            return r is not None and r[0] == "lab" and (w.data / "ipc" / "lab" / "messages"
                                                          ).is_dir()

        wait_until(moved, 30, interval=0.05, what="the reload to move the chat to lab")
        w.post("a new lead", "Scout", group="lab")
        m = w.posted("a new lead")
        assert (m["bot"], m["bot_name"]) == (B, "Scout")
        want = [["lab", "Scout", str(B)], ["team", "Researcher", str(A)]]
        wait_until(lambda: _assigned(w) == want, 30, what=f"{want} saved, have {_assigned(w)}")
