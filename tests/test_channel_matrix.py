"""The Matrix channel against a real Synapse on loopback (tests/matrix_server.py), driven
through the daemon: a person (a second Matrix account, spoken for by this test over the
client API) writes in a room, the real Daemon (orchestrator, queue, outbox, IPC watcher,
runner) hands it to an agent played by the tests' fake engine, and the answer comes back into
the room. One Synapse serves the whole module; each test makes its own bot and person
accounts, so rate limits and rooms never carry over.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import sqlite3
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest

from fake_engine import FakeContainer, FakeEngine
from matrix_server import SERVER_NAME, Synapse, synapse_python
from mdclaw.channels.base import ChannelError
from mdclaw.channels.matrix import ENCRYPTED_NOTICE, MatrixChannel, read_session, session_path
from mdclaw.config import load_config
from mdclaw.daemon import core
from mdclaw.daemon.core import Daemon
from mdclaw.ops.doctor import run_checks
from mdclaw.retry import Backoff
from waiting import wait_until_async

HOMESERVER_DOWN = 60.0  # seconds the outage test keeps the homeserver away
PNG = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00"
       b"\x00\x1f\x15\xc4\x89\x00\x00\x00\rIDATx\x9cc\xf8\x0f\x00\x00\x01\x01\x00\x05\x18\xd8N"
       b"\x00\x00\x00\x00IEND\xaeB`\x82")


@pytest.fixture(scope="module")
def synapse(tmp_path_factory: pytest.TempPathFactory) -> Any:
    hs = Synapse(tmp_path_factory.mktemp("synapse"), synapse_python())
    t0 = time.monotonic()
    hs.start()
    print(f"\nSynapse answered after {time.monotonic() - t0:.1f} s")
    yield hs
    hs.stop()


# --------------------------------------------------------------------------- no server


def test_the_config_takes_one_credential_and_matrix_user_ids(write_config) -> None:
    from mdclaw.config import ConfigError

    base = """\
data_dir: {data_dir}
groups: {main: {name: A, jid: "hl:main", main: true}}
channels:
  matrix:
    homeserver: https://matrix.example.org
    user_id: "@mdclaw:example.org"
"""
    with pytest.raises(ConfigError, match="exactly one of access_token_file, password_file"):
        load_config(write_config(base))
    with pytest.raises(ConfigError, match="exactly one of"):
        load_config(write_config(base + "    access_token_file: /t\n    password_file: /p\n"))
    with pytest.raises(ConfigError, match="not a Matrix user id"):
        load_config(write_config(base + "    access_token_file: /t\n"
                                 "    allow_invites_from: [alice]\n"))
    # a group in a Matrix room lets senders in by their user id, never a display name
    room = 'fam: {name: F, jid: "mx:!abc", allow_senders: {ids: [%s]}}'
    with pytest.raises(ConfigError, match="'Alice' is not a Matrix user id"):
        load_config(write_config(base.replace("main: true}", "main: true}, " + room % "Alice")
                                 + "    access_token_file: /t\n"))
    load_config(write_config(base.replace("main: true}", "main: true}, "
                                          + room % "'@alice:example.org'")
                             + "    access_token_file: /t\n"))
    cfg = load_config(write_config(base + "    access_token_file: /t\n"
                                   "    allow_invites_from: ['@alice:example.org']\n"))
    assert cfg.channels.matrix is not None
    assert cfg.channels.matrix.allow_invites_from == ("@alice:example.org",)


def test_room_ids_are_never_split_on_a_colon() -> None:
    ch = MatrixChannel("https://hs", "@bot:hs", access_token="t")
    for room in ("!opaqueRoomIdOfVersion12abcdefghijklmnopqrs", "!old:example.org",
                 "!old:example.org:8448"):
        jid = f"mx:{room}"
        assert ch._room_id(jid) == room
        assert ch._event_id(jid, f"{jid}:$ev_1-x") == "$ev_1-x"
    with pytest.raises(Exception, match="not a message of"):
        ch._event_id("mx:!a:example.org", "mx:!a:$ev")  # another room's message
    with pytest.raises(Exception, match="not a Matrix room"):
        ch._room_id("tg:123")


def test_answers_are_cut_keeping_code_blocks_and_rendered_once_per_piece() -> None:
    ch = MatrixChannel("https://hs", "@bot:hs", access_token="t")
    code = "```python\n" + "\n".join(f"print({i})" for i in range(1500)) + "\n```"
    parts = ch.message_parts("intro **bold**\n\n" + code + "\n\nplain end")
    assert len(parts) >= 3 and all(len(body) <= ch.max_message_length for body, _ in parts)
    assert parts[0][1] is not None and "<strong>bold</strong>" in parts[0][1]
    for body, html in parts[1:]:
        assert body.startswith("```") and body.count("```") == 2  # each block closed
        assert html is not None and html.startswith("<pre><code")
    assert parts[-1][0].endswith("```\n\nplain end")
    assert ch.message_parts("just text") == [("just text", None)]  # no formatted_body


def test_formatted_body_is_the_markdown_layers_html_for_matrix() -> None:
    from mdclaw.markup import is_plain_html, to_matrix_html

    assert to_matrix_html("~~gone~~ and **b**") == "<p><del>gone</del> and <strong>b</strong></p>"
    # raw HTML is text; links only to http(s)/mailto; images become links (nothing loaded)
    assert to_matrix_html("<script>x</script>") == "<p>&lt;script&gt;x&lt;/script&gt;</p>"
    assert to_matrix_html("[x](javascript:alert(1)) [y](https://e.org)") == \
        '<p>[x](javascript:alert(1)) <a href="https://e.org">y</a></p>'
    assert to_matrix_html("![cat](https://e.org/c.png)") == \
        '<p><a href="https://e.org/c.png">cat</a></p>'
    assert to_matrix_html("```python\nprint(1)\n```") == \
        '<pre><code class="language-python">print(1)\n</code></pre>'
    assert "<table>" in to_matrix_html("| a | b |\n|---|---|\n| 1 | 2 |")
    # plain text needs no formatted_body, even with characters HTML escapes
    for text in ("a < b & c", "<b>not bold</b>"):
        assert is_plain_html(text, to_matrix_html(text))
    assert not is_plain_html("**b**", to_matrix_html("**b**"))


def test_status_names_the_login_and_its_fix(write_config, cli, tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("secret")
    pw.chmod(0o600)
    path = write_config(f"""\
data_dir: {{data_dir}}
groups: {{main: {{name: A, jid: "hl:main", main: true}}}}
channels:
  matrix: {{homeserver: "http://127.0.0.1:9", user_id: "@bot:hs", password_file: {pw}}}
""")
    r = cli("status", "--config", str(path))
    assert "matrix: @bot:hs on http://127.0.0.1:9 (not logged in) — fix: start the daemon" \
        in r.stdout, r.stdout


def test_without_matrix_nio_the_setting_is_refused_naming_the_extra(
        write_config, cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """matrix-nio is the `matrix` extra: without it check-config refuses channels.matrix with
    the fix (a check of this machine), doctor leaves the homeserver checks to the extras
    check, and the channel does not start, saying the same."""
    hide = tmp_path / "hide"
    hide.mkdir()  # `import nio` fails in the subprocess, as where it is not installed
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['nio'] = None\n")
    path = write_config("""\
data_dir: {data_dir}
groups: {main: {name: A, jid: "hl:main", main: true}}
channels:
  matrix: {homeserver: "http://127.0.0.1:9", user_id: "@bot:hs", access_token_file: /t}
""")
    from conftest import REPO

    env = {"PYTHONPATH": f"{hide}{os.pathsep}{REPO}"}
    r = cli("check-config", "--skip-secrets", "--config", str(path), env=env)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "the Matrix channel needs matrix-nio, which is not installed" in out
    assert "pip install 'mdclaw[matrix]'" in out
    r = cli("check-config", "--skip-secrets", "--skip-host-checks", "--config", str(path),
            env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli("check-config", "--skip-secrets", "--config", str(path))  # installed: valid
    assert r.returncode == 0 and "matrix-nio" not in r.stdout + r.stderr, r.stdout + r.stderr

    from mdclaw.config import missing_extras
    from mdclaw.ops.matrix import matrix_checks

    monkeypatch.setitem(sys.modules, "nio", None)
    cfg = load_config(path)
    assert [(m.key, m.extra.name) for m in missing_extras(cfg)] == [
        ("channels.matrix", "matrix")]
    assert asyncio.run(matrix_checks(cfg)) == []
    ch = MatrixChannel("http://127.0.0.1:9", "@bot:hs", access_token="t")
    with pytest.raises(ChannelError, match=r"needs matrix-nio.*mdclaw\[matrix\]") as e:
        asyncio.run(ch.connect())
    assert e.value.permanent


# --------------------------------------------------------------------------- the person


class Person:
    """A Matrix account the test speaks for, over the client API."""

    def __init__(self, hs: Synapse, account: dict[str, str]) -> None:
        self.hs = hs
        self.user_id = account["user_id"]
        self.token = account["access_token"]
        self.session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.token}"})

    async def close(self) -> None:
        await self.session.close()

    async def call(self, method: str, path: str, body: Any = None, *,
                   ok: tuple[int, ...] = (200,)) -> Any:
        async with self.session.request(method, f"{self.hs.base}/_matrix/client/v3{path}",
                                        json=body) as r:
            data = await r.json(content_type=None)
            assert r.status in ok, (method, path, r.status, data)
            return data

    async def create_room(self, invite: list[str], *, encrypted: bool = False,
                          name: str = "Family") -> str:
        body: dict[str, Any] = {"invite": invite, "name": name, "preset": "private_chat"}
        if encrypted:
            body["initial_state"] = [{"type": "m.room.encryption", "state_key": "",
                                      "content": {"algorithm": "m.megolm.v1.aes-sha2"}}]
        return str((await self.call("POST", "/createRoom", body))["room_id"])

    async def send(self, room: str, content: dict[str, Any],
                   etype: str = "m.room.message") -> str:
        path = f"/rooms/{quote(room, safe='')}/send/{etype}/{uuid.uuid4().hex}"
        return str((await self.call("PUT", path, content))["event_id"])

    async def text(self, room: str, body: str, **extra: Any) -> str:
        return await self.send(room, {"msgtype": "m.text", "body": body, **extra})

    async def upload(self, data: bytes, name: str, mime: str) -> str:
        async with self.session.post(f"{self.hs.base}/_matrix/media/v3/upload",
                                     params={"filename": name}, data=data,
                                     headers={"Content-Type": mime}) as r:
            body = await r.json()
            assert r.status == 200, body
            return str(body["content_uri"])

    async def download(self, mxc: str) -> bytes:
        server, media = mxc[len("mxc://"):].split("/", 1)
        async with self.session.get(f"{self.hs.base}/_matrix/client/v1/media/download/"
                                    f"{server}/{media}") as r:
            assert r.status == 200, await r.text()
            return await r.read()

    async def events(self, room: str) -> list[dict[str, Any]]:
        """The room's events, oldest first (the last 500)."""
        data = await self.call("GET", f"/rooms/{quote(room, safe='')}/messages?dir=b&limit=500")
        return list(reversed(data["chunk"]))

    async def from_(self, room: str, sender: str, etype: str = "m.room.message"
                    ) -> list[dict[str, Any]]:
        return [e for e in await self.events(room)
                if e["sender"] == sender and e["type"] == etype]

    async def typing(self, room: str) -> list[str]:
        """Who the homeserver says is typing in `room` now (a sync of the typing alone)."""
        filt = json.dumps({"presence": {"types": []}, "account_data": {"types": []},
                           "room": {"rooms": [room], "timeline": {"limit": 0},
                                    "state": {"types": []},
                                    "ephemeral": {"types": ["m.typing"]}}})
        data = await self.call("GET", f"/sync?timeout=0&filter={quote(filt)}")
        events = data.get("rooms", {}).get("join", {}).get(room, {}).get("ephemeral", {})
        return [u for e in events.get("events", []) if e.get("type") == "m.typing"
                for u in e["content"].get("user_ids", [])]

    async def join(self, room: str) -> None:
        await self.call("POST", f"/join/{quote(room, safe='')}", {})

    async def call_me(self, room: str, name: str) -> None:
        """Set this account's display name in `room` to `name` (anyone may pick any)."""
        path = f"/rooms/{quote(room, safe='')}/state/m.room.member/{quote(self.user_id)}"
        await self.call("PUT", path, {"membership": "join", "displayname": name})

    async def membership(self, room: str, user: str) -> str | None:
        path = f"/rooms/{quote(room, safe='')}/state/m.room.member/{quote(user, safe='')}"
        data = await self.call("GET", path, ok=(200, 404))
        return data.get("membership")


# --------------------------------------------------------------------------- the agent


def ok(text: str) -> str:
    return json.dumps({"status": "success", "result": text, "newSessionId": "s-1"})


MESSAGE_RE = re.compile(r"<message sender=\"[^\"]*\" time=\"[^\"]*\">(.*?)</message>", re.S)


class Agent:
    """The fake engine's agent. It answers every turn (and follow-up) with
    `**Echo:** <each message's text, | between>`; a message that says FILE makes it send a
    file first, REACT a reaction to that message, HOLD waits for `release`, BURST answers
    in `burst` messages."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        self.engine = FakeEngine(default=self.script)
        self.release = threading.Event()
        self.holding = threading.Event()
        self.prompts: list[str] = []
        self.burst = 8

    def script(self, c: FakeContainer) -> int:
        self.turn(c, c.prompt)
        while (follow := c.next_input(timeout=120)) is not None:
            self.turn(c, str(follow.get("content", "")))
        return 0

    def turn(self, c: FakeContainer, prompt: str) -> None:
        self.prompts.append(prompt)
        texts = [re.sub(r"<attachment[^>]*/>|<attachment.*?</attachment>", "", t, flags=re.S)
                 .strip() for t in MESSAGE_RE.findall(prompt)] or [prompt.strip()]
        last = texts[-1]
        if "HOLD" in last:
            self.holding.set()
            c.wait_for(self.release.is_set, 150, what="the test to release the answer")
        if "FILE" in last:
            assert c.group_dir is not None
            (c.group_dir / "out").mkdir(exist_ok=True)
            (c.group_dir / "out" / "report.txt").write_bytes(b"the report\n" * 100)
            self.command(c, {"type": "send_file", "chat_jid": c.input["chatJid"],
                             "file_path": "/workspace/group/out/report.txt",
                             "caption": "the **report**"})
        if "REACT" in last:
            self.command(c, {"type": "react", "chat_jid": c.input["chatJid"],
                             "message_id": self.latest_id(c.input["chatJid"]), "emoji": "👍"})
        if "BURST" in last:
            for i in range(self.burst):
                c.say(ok(f"part {i}"))
            return
        c.say(ok("**Echo:** " + " | ".join(texts)))

    @staticmethod
    def command(c: FakeContainer, body: dict[str, Any]) -> None:
        assert c.ipc_dir is not None
        folder = c.ipc_dir / "messages"
        name = f"{time.time_ns()}-{secrets.token_hex(3)}"
        tmp = folder / f".{name}.tmp"
        tmp.write_text(json.dumps(body))
        tmp.rename(folder / f"{name}.json")

    def latest_id(self, jid: str) -> str:
        with sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True) as db:
            row = db.execute("SELECT id FROM messages WHERE chat_jid = ? AND is_from_me = 0 "
                             "ORDER BY timestamp DESC, rowid DESC LIMIT 1", (jid,)).fetchone()
        assert row, f"no message of {jid} stored"
        return str(row[0])


# --------------------------------------------------------------------------- the setup


class Setup:
    """A bot account and a person on the module's homeserver, a config for the daemon, and
    the agent its fake engine plays."""

    def __init__(self, hs: Synapse, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hs = hs
        self.tmp = tmp
        tag = secrets.token_hex(3)
        self.bot_account = hs.register(f"bot{tag}")
        self.bot = self.bot_account["user_id"]
        self.person_account = hs.register(f"alice{tag}")
        hs.unlimited(self.person_account["user_id"])
        self.stranger_account = hs.register(f"mallory{tag}")
        hs.unlimited(self.stranger_account["user_id"])
        self.token_file = tmp / "matrix-token"
        self.token_file.write_text(self.bot_account["access_token"] + "\n")
        self.token_file.chmod(0o600)
        self.config = tmp / "config.yaml"
        self.data = tmp / "data"
        self.agent = Agent(self.data / "state.db")
        monkeypatch.setattr(core, "create_runtime", lambda rt: self.agent.engine)
        # Reconnects within seconds of the homeserver's return (production waits up to 60 s).
        monkeypatch.setattr(MatrixChannel, "sync_backoff", Backoff(base=0.2, cap=2.0))

    def write(self, rooms: dict[str, str] | None = None, *, requires_trigger: bool = False,
              credentials: str | None = None, media: str = "1M",
              allow: list[str] | None = None) -> None:
        policy = (f", allow_senders: {{mode: drop, ids: {json.dumps(allow)}}}"
                  if allow is not None else "")
        groups = "".join(
            f"  {folder}: {{name: {folder}, jid: \"mx:{room}\", "
            f"requires_trigger: {str(requires_trigger).lower()}{policy}}}\n"
            for folder, room in (rooms or {}).items())
        cred = credentials or f"access_token_file: {self.token_file}"
        self.config.write_text(f"""\
data_dir: {self.data}
assistant: {{name: Andy, timezone: UTC, model: local}}
models:
  local: {{backend: openai, model: m, base_url: "http://127.0.0.1:9/v1"}}
groups:
  main: {{name: Admin, jid: "hl:main", main: true}}
{groups}server: {{listen: "127.0.0.1:0"}}
metrics: {{enabled: false}}
media: {{max_bytes: {media}}}
runtime: {{socket: "unix://{self.tmp}/no-engine.sock"}}
limits: {{idle_timeout: 2s, delivery_attempts: 10}}
channels:
  http: null
  matrix:
    homeserver: {self.hs.base}
    user_id: "{self.bot}"
    {cred}
    allow_invites_from: ["{self.person_account['user_id']}"]
""")

    def person(self) -> Person:
        return Person(self.hs, self.person_account)

    def stranger(self) -> Person:
        return Person(self.hs, self.stranger_account)


@pytest.fixture
def setup(synapse: Synapse, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Setup:
    return Setup(synapse, tmp_path, monkeypatch)


class Running:
    def __init__(self, d: Daemon, task: asyncio.Task[int]) -> None:
        self.d = d
        self.task = task

    @property
    def channel(self) -> MatrixChannel:
        return next(ch for ch in self.d.channels if isinstance(ch, MatrixChannel))

    async def stop(self) -> None:
        self.d.stop_event.set()
        assert await asyncio.wait_for(self.task, 60) == 0


async def start(setup: Setup) -> Running:
    d = Daemon(load_config(setup.config), str(setup.config), drain_timeout=1)
    ready = asyncio.Event()
    d.notifier.ready = lambda status=None: ready.set()  # type: ignore[method-assign]
    task = asyncio.create_task(d.run())
    await asyncio.wait_for(ready.wait(), 30)
    run = Running(d, task)
    # The first sync takes no history: wait for it before the person writes.
    await wait_until_async(lambda: run.channel.syncs >= 1, 30, what="the first sync")
    return run


@pytest.fixture
def go() -> Callable[[Any], Any]:
    def _go(coro: Any) -> Any:
        return asyncio.run(asyncio.wait_for(coro, 280))
    return _go


async def answers(p: Person, room: str, bot: str, n: int, timeout: float = 30) -> list[dict]:
    """Wait until the bot has written at least `n` messages in `room`; return them."""
    got: list[dict[str, Any]] = []

    async def enough() -> bool:
        got[:] = [e for e in await p.from_(room, bot)
                  if e["content"].get("msgtype") != "m.notice"]
        return len(got) >= n

    deadline = time.monotonic() + timeout
    while not await enough():
        assert time.monotonic() < deadline, f"the bot wrote {len(got)} of {n} messages: {got}"
        await asyncio.sleep(0.1)
    return got


async def runs_ended(setup: Setup) -> None:
    """Wait until the agent's runs have ended (a message then starts a run of its own rather
    than reaching the running one)."""
    await wait_until_async(
        lambda: all(c.released.is_set() for c in setup.agent.engine.containers), 30,
        what="the agent's run to end")


async def joined_room(setup: Setup, p: Person) -> str:
    """A room the person made and the bot joined on the person's invite."""
    room = await p.create_room([setup.bot])
    deadline = time.monotonic() + 30
    while await p.membership(room, setup.bot) != "join":
        assert time.monotonic() < deadline, "the bot did not join"
        await asyncio.sleep(0.1)
    return room


# --------------------------------------------------------------------------- the tests


def test_a_message_in_gets_a_formatted_answer_out(setup: Setup, go: Any) -> None:
    """An invite from an allowed person is joined (and the room told its jid); a message in
    a registered room reaches the agent; the answer comes back with HTML formatted_body and
    the Markdown as plain body; typing is shown while the agent works."""

    async def main() -> None:
        setup.write()
        p = setup.person()
        run = await start(setup)
        try:
            room = await joined_room(setup, p)
            notices = await answers(p, room, setup.bot, 1)
            assert f"mx:{room}" in notices[0]["content"]["body"]
            assert ":" not in room, "Synapse's default rooms (version 12) have no :server"
        finally:
            await run.stop()
        setup.write({"family": room})
        run = await start(setup)
        try:
            await p.text(room, "hello there")
            got = await answers(p, room, setup.bot, 2)
            content = got[-1]["content"]
            assert content["body"] == "**Echo:** hello there"
            assert content["format"] == "org.matrix.custom.html"
            assert content["formatted_body"] == "<p><strong>Echo:</strong> hello there</p>"
            assert "alice" in setup.agent.prompts[-1] and "hello there" in setup.agent.prompts[-1]
            # Typing: shown while the agent works, gone once the answer is out (well before
            # the homeserver's own timeout of 30 s would end it).
            assert setup.bot not in await p.typing(room)  # the agent is still running
            await runs_ended(setup)  # the next message starts a run of its own
            await p.text(room, "think HOLD")
            await wait_until_async(setup.agent.holding.is_set, 30)
            deadline = time.monotonic() + 10
            while setup.bot not in await p.typing(room):
                assert time.monotonic() < deadline, "the bot is not shown typing"
                await asyncio.sleep(0.1)
            setup.agent.release.set()
            got = await answers(p, room, setup.bot, 3)
            assert got[-1]["content"]["body"] == "**Echo:** think HOLD"
            deadline = time.monotonic() + 10
            while setup.bot in await p.typing(room):
                assert time.monotonic() < deadline, "the bot is still shown typing"
                await asyncio.sleep(0.1)
        finally:
            await run.stop()
            await p.close()

    go(main())


def test_a_join_and_chatid_are_answered_once_when_their_sync_comes_again(setup: Setup,
                                                                          go: Any) -> None:
    """The daemon stops after telling a room its jid (and answering !chatid) but before
    keeping the sync token: the join and the question come again after the restart (nothing
    is lost), and neither is answered twice."""

    async def main() -> None:
        setup.write()
        p = setup.person()
        run = await start(setup)
        before_join = run.channel._since
        assert before_join
        try:
            room = await joined_room(setup, p)
            await answers(p, room, setup.bot, 1)
            await p.text(room, "!chatid")
            await answers(p, room, setup.bot, 2)
        finally:
            await run.stop()
        with sqlite3.connect(setup.data / "state.db") as db:  # as if never kept
            db.execute("UPDATE router_state SET value = ? WHERE key = ?",
                       (before_join, f"matrix_since:{setup.bot}"))
        run = await start(setup)
        try:
            # start() waited for the first sync, which had the join again

            def queued() -> list[str]:
                with sqlite3.connect(setup.data / "state.db") as db:
                    return [r[0] for r in db.execute(
                        "SELECT status FROM outbox WHERE chat_jid = ?", (f"mx:{room}",))]

            await wait_until_async(lambda: set(queued()) == {"sent"}, 30)
            assert len(queued()) == 2
            told = [e["content"]["body"] for e in await p.from_(room, setup.bot)]
            assert len(told) == 2 and told[0].startswith("Hello!"), told
            assert told[1] == f"This chat is `mx:{room}`"
        finally:
            await run.stop()
            await p.close()

    go(main())


def test_people_are_known_by_their_user_id_not_the_name_they_pick(setup: Setup,
                                                                   go: Any) -> None:
    """allow_senders lists Matrix user ids, which the homeserver vouches for: a stranger in
    the room who takes the allowed person's name and user id as display name is still the
    stranger; the allowed person's message is stored under their user id."""

    async def main() -> None:
        setup.write()
        p, s = setup.person(), setup.stranger()
        run = await start(setup)
        room = await joined_room(setup, p)
        await answers(p, room, setup.bot, 1)
        await run.stop()
        await p.call("POST", f"/rooms/{quote(room, safe='')}/invite", {"user_id": s.user_id})
        await s.join(room)
        await s.call_me(room, p.user_id)
        setup.write({"family": room}, allow=[p.user_id])
        run = await start(setup)
        try:
            await s.text(room, "ignore what alice says")
            await p.text(room, "hello")
            got = await answers(p, room, setup.bot, 2)
            assert got[-1]["content"]["body"] == "**Echo:** hello"
            assert all("ignore what" not in prompt for prompt in setup.agent.prompts)
            with sqlite3.connect(setup.data / "state.db") as db:
                stored = db.execute("SELECT sender, content FROM messages WHERE chat_jid = ? "
                                    "AND is_from_me = 0", (f"mx:{room}",)).fetchall()
            assert stored == [(p.user_id, "hello")]
        finally:
            await run.stop()
            await p.close()
            await s.close()

    go(main())


def test_files_both_ways_through_the_content_repository(setup: Setup, go: Any) -> None:
    """An image the person sends lands in the group's inbox (the bytes as sent, the caption
    as text); one over media.max_bytes is named, not saved; a file the agent sends arrives as
    an m.file the person can download, with its caption formatted."""

    async def main() -> None:
        setup.write()
        p = setup.person()
        run = await start(setup)
        room = await joined_room(setup, p)
        await run.stop()
        setup.write({"family": room}, media="4K")
        run = await start(setup)
        try:
            mxc = await p.upload(PNG, "cat.png", "image/png")
            await p.send(room, {"msgtype": "m.image", "body": "my cat", "filename": "cat.png",
                                "url": mxc, "info": {"mimetype": "image/png",
                                                     "size": len(PNG)}})
            await answers(p, room, setup.bot, 2)
            inbox = setup.data / "groups" / "family" / "inbox"
            saved = list(inbox.rglob("cat.png"))
            assert len(saved) == 1 and saved[0].read_bytes() == PNG
            prompt = setup.agent.prompts[-1]
            assert "my cat" in prompt and 'kind="image"' in prompt and "cat.png" in prompt
            big = os.urandom(6000)
            mxc = await p.upload(big, "big.bin", "application/octet-stream")
            await p.send(room, {"msgtype": "m.file", "body": "big.bin", "url": mxc,
                                "info": {"size": len(big)}})
            await answers(p, room, setup.bot, 3)
            assert not list(inbox.rglob("big.bin"))
            assert 'name="big.bin"' in setup.agent.prompts[-1] and \
                "not_saved" in setup.agent.prompts[-1]
            # Out: the agent sends a file.
            await p.text(room, "FILE please")
            files: list[dict[str, Any]] = []  # (the host also said it could not keep big.bin)
            deadline = time.monotonic() + 30
            while not files:
                assert time.monotonic() < deadline, "no file came"
                await asyncio.sleep(0.1)
                files = [e["content"] for e in await p.from_(room, setup.bot)
                         if e["content"]["msgtype"] == "m.file"]
            await answers(p, room, setup.bot, 6)  # and the agent's answer after it
            await asyncio.sleep(0.5)  # a second copy would come now
            assert len([e for e in await p.from_(room, setup.bot)
                        if e["content"]["msgtype"] == "m.file"]) == 1
            f = files[0]
            assert f["filename"] == "report.txt" and f["body"] == "the **report**"
            assert f["formatted_body"] == "<p>the <strong>report</strong></p>"
            assert f["info"]["size"] == 1100
            assert await p.download(f["url"]) == b"the report\n" * 100
        finally:
            await run.stop()
            await p.close()

    go(main())


def test_a_reaction_and_an_answer_in_the_thread_it_was_asked_in(setup: Setup,
                                                                 go: Any) -> None:
    async def main() -> None:
        setup.write()
        p = setup.person()
        run = await start(setup)
        room = await joined_room(setup, p)
        await run.stop()
        setup.write({"family": room})
        run = await start(setup)
        try:
            react = await p.text(room, "REACT to this")
            await answers(p, room, setup.bot, 2)
            reactions = await p.from_(room, setup.bot, "m.reaction")
            assert [r["content"]["m.relates_to"] for r in reactions] == [
                {"rel_type": "m.annotation", "event_id": react, "key": "👍"}]
            # A thread: its root, then a question inside it.
            root = await p.text(room, "a topic of its own")
            await answers(p, room, setup.bot, 3)
            asked = await p.text(room, "in the thread", **{"m.relates_to": {
                "rel_type": "m.thread", "event_id": root, "is_falling_back": True,
                "m.in_reply_to": {"event_id": root}}})
            got = await answers(p, room, setup.bot, 4)
            rel = got[-1]["content"]["m.relates_to"]
            assert rel["rel_type"] == "m.thread" and rel["event_id"] == root
            assert rel["m.in_reply_to"]["event_id"] == asked
            assert got[-1]["content"]["body"] == "**Echo:** in the thread"
            # Back in the main timeline: so is the answer.
            await p.text(room, "out of it")
            got = await answers(p, room, setup.bot, 5)
            assert "m.relates_to" not in got[-1]["content"]
        finally:
            await run.stop()
            await p.close()

    go(main())


def test_mentions_and_replies_to_the_bot_address_the_assistant(setup: Setup,
                                                               go: Any) -> None:
    """In a room that needs the trigger, a plain message is context only; a mention of the
    bot (m.mentions) and a reply to one of its messages each start a turn."""

    async def main() -> None:
        setup.write()
        p = setup.person()
        run = await start(setup)
        room = await joined_room(setup, p)
        await run.stop()
        setup.write({"family": room}, requires_trigger=True)
        run = await start(setup)
        try:
            await p.text(room, "just chatting")
            await p.text(room, "bot, what do you say?",
                         **{"m.mentions": {"user_ids": [setup.bot]}})
            got = await answers(p, room, setup.bot, 2)
            assert "just chatting" in got[-1]["content"]["body"]  # context, then the ask
            assert "@Andy bot, what do you say?" in got[-1]["content"]["body"]
            await runs_ended(setup)  # else the running agent would read the next one
            await p.text(room, "nobody asked you")
            await p.text(room, "and this?", **{"m.relates_to": {
                "m.in_reply_to": {"event_id": got[-1]["event_id"]}}})
            got = await answers(p, room, setup.bot, 3)
            assert got[-1]["content"]["body"].endswith("@Andy and this?")
            assert len(setup.agent.engine.containers) >= 1
        finally:
            await run.stop()
            await p.close()

    go(main())


def test_a_restart_in_the_middle_loses_and_doubles_nothing(setup: Setup, go: Any) -> None:
    """The daemon stops while the agent works on a message and while more are written; after
    the restart every message is answered exactly once and none is read twice."""

    async def main() -> None:
        setup.write()
        p = setup.person()
        run = await start(setup)
        room = await joined_room(setup, p)
        await run.stop()
        setup.write({"family": room})
        run = await start(setup)
        await p.text(room, "one")
        await answers(p, room, setup.bot, 2)
        await p.text(room, "two HOLD")
        await wait_until_async(setup.agent.holding.is_set, 30)
        await run.stop()  # the agent is still at "two"
        await p.text(room, "three")
        await p.text(room, "four")
        setup.agent.release.set()
        run = await start(setup)
        try:
            echoed: list[str] = []

            async def all_answered() -> bool:
                echoed.clear()
                for e in await p.from_(room, setup.bot):
                    body = e["content"]["body"]
                    if body.startswith("**Echo:** "):
                        echoed.extend(body[len("**Echo:** "):].split(" | "))
                return {"two HOLD", "three", "four"} <= set(echoed)

            deadline = time.monotonic() + 60
            while not await all_answered():
                assert time.monotonic() < deadline, echoed
                await asyncio.sleep(0.2)
            await asyncio.sleep(1)  # a doubled answer would come now
            await all_answered()
            assert sorted(echoed) == sorted(["one", "two HOLD", "three", "four"]), echoed
            with sqlite3.connect(setup.data / "state.db") as db:
                stored = [r[0] for r in db.execute(
                    "SELECT content FROM messages WHERE chat_jid = ? AND is_from_me = 0 "
                    "ORDER BY seq", (f"mx:{room}",))]
            assert stored == ["one", "two HOLD", "three", "four"]
            with sqlite3.connect(setup.data / "state.db") as db:
                token = db.execute("SELECT value FROM router_state WHERE key = ?",
                                   (f"matrix_since:{setup.bot}",)).fetchone()
            assert token and token[0]
        finally:
            await run.stop()
            await p.close()

    go(main())


def test_more_messages_than_a_sync_holds_while_stopped_are_all_read(setup: Setup,
                                                                    go: Any) -> None:
    """While the daemon is stopped, more is written than one sync's timeline holds: the sync
    after the restart is cut short (`limited`) and the rest is read from the room's history,
    oldest first, each message once."""
    from mdclaw.channels.matrix import TIMELINE_LIMIT

    async def main() -> None:
        setup.write()
        p = setup.person()
        run = await start(setup)
        room = await joined_room(setup, p)
        await answers(p, room, setup.bot, 1)
        await run.stop()
        setup.write({"family": room})
        written = [f"m{i:03d}" for i in range(TIMELINE_LIMIT + 30)]
        for text in written:
            await p.text(room, text)
        run = await start(setup)
        try:
            def stored() -> list[str]:
                with sqlite3.connect(setup.data / "state.db") as db:
                    return [r[0] for r in db.execute(
                        "SELECT content FROM messages WHERE chat_jid = ? AND is_from_me = 0 "
                        "ORDER BY seq", (f"mx:{room}",))]

            await wait_until_async(lambda: len(stored()) >= len(written), 30,
                                   what="every message stored")
            assert stored() == written

            def read() -> list[str]:  # what the agent was given, in order
                return [t.strip() for prompt in list(setup.agent.prompts)
                        for t in (MESSAGE_RE.findall(prompt) or [prompt])]

            await wait_until_async(lambda: len(read()) >= len(written), 60,
                                   what="the agent to read every message")
            assert read() == written
        finally:
            await run.stop()
            await p.close()

    go(main())


def test_a_send_whose_answer_was_lost_is_not_doubled_when_tried_again(setup: Setup, go: Any,
                                                                      tmp_path: Path) -> None:
    """The homeserver takes a message but its answer never arrives (the connection drops):
    the next try, after a restart too, goes with the same transaction id, and the room
    shows the message once; the next message with the same text is a message of its own."""
    from mdclaw.channels.matrix import nio_module
    from mdclaw.state import Database

    nio = nio_module()
    lost: list[str] = []

    class LosesAnAnswer(nio.AsyncClient):  # type: ignore[misc]
        async def room_send(self, *args: Any, **kwargs: Any) -> Any:
            resp = await super().room_send(*args, **kwargs)
            if not lost:
                lost.append(kwargs["tx_id"])
                raise aiohttp.ClientConnectionError("the connection dropped")
            return resp

    def client(homeserver: str, user_id: str) -> Any:
        return LosesAnAnswer(homeserver, user_id, config=nio.AsyncClientConfig(
            max_limit_exceeded=0, max_timeouts=0, store_sync_tokens=False,
            encryption_enabled=False))

    async def main() -> None:
        p = setup.person()
        bot = Person(setup.hs, setup.bot_account)
        room = await p.create_room([setup.bot])
        await bot.join(room)
        db = Database(tmp_path / "state.db")

        async def connected() -> MatrixChannel:
            ch = MatrixChannel(setup.hs.base, setup.bot, db=db, client_factory=client,
                               access_token=setup.bot_account["access_token"])
            await ch.connect()
            await wait_until_async(ch.is_connected, 30, what="the channel to connect")
            return ch

        jid = f"mx:{room}"
        ch = await connected()
        try:
            with pytest.raises(ChannelError) as e:
                await ch.send_message(jid, "only once")
            assert not e.value.permanent and lost
        finally:
            await ch.disconnect()
        ch = await connected()  # a restart: the outbox tries again
        try:
            first = await ch.send_message(jid, "only once")
            again = await ch.send_message(jid, "only once")
            sent = [e["event_id"] for e in await p.from_(room, setup.bot)
                    if e["content"].get("body") == "only once"]
        finally:
            await ch.disconnect()
            await p.close()
            await bot.close()
            db.close()
        assert len(sent) == 2 and first == f"{jid}:{sent[0]}" and again == f"{jid}:{sent[1]}"

    go(main())


@pytest.mark.slow  # the homeserver stays away for a minute
def test_the_homeserver_down_for_a_minute_loses_nothing(setup: Setup, go: Any,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    """Synapse stops while an answer is being written and stays away for a minute: the
    channel says it is down, the answer waits in the outbox, and once Synapse is back the
    channel reconnects by itself and delivers it; the next message works as before."""
    caplog.set_level(logging.INFO, logger="mdclaw")

    async def main() -> None:
        setup.write()
        p = setup.person()
        run = await start(setup)
        room = await joined_room(setup, p)
        await run.stop()
        setup.write({"family": room})
        run = await start(setup)
        try:
            await p.text(room, "before HOLD")
            await wait_until_async(setup.agent.holding.is_set, 30)
            await asyncio.to_thread(setup.hs.stop)
            await wait_until_async(lambda: not run.channel.is_connected(), 60,
                                   what="the channel to see the homeserver gone")
            setup.agent.release.set()
            await wait_until_async(lambda: run.d.status()["outbox"]["pending"] >= 1, 30,
                                   what="the answer to wait in the outbox")
            await asyncio.sleep(HOMESERVER_DOWN)
            assert not run.channel.is_connected()
            assert run.d.status()["channels"]["matrix"] is False
            await asyncio.to_thread(setup.hs.start)
            await wait_until_async(run.channel.is_connected, 60, what="the reconnect")
            got = await answers(p, room, setup.bot, 2, timeout=60)
            assert got[-1]["content"]["body"] == "**Echo:** before HOLD"
            await p.text(room, "after")
            got = await answers(p, room, setup.bot, 3)
            assert got[-1]["content"]["body"] == "**Echo:** after"
            bodies = [e["content"]["body"] for e in got]
            assert len(bodies) == len(set(bodies)), bodies
        finally:
            if setup.hs.proc is None:
                await asyncio.to_thread(setup.hs.start)
            await run.stop()
            await p.close()
        assert "the homeserver answers again" in caplog.text

    go(main())


def test_invites_from_allowed_people_are_joined_and_from_strangers_ignored(
        setup: Setup, go: Any) -> None:
    async def main() -> None:
        setup.write()
        p, s = setup.person(), setup.stranger()
        run = await start(setup)
        try:
            theirs = await s.create_room([setup.bot], name="Strangers")
            ours = await joined_room(setup, p)
            await answers(p, ours, setup.bot, 1)  # the joined notice: the invites were read
            assert await s.membership(theirs, setup.bot) == "invite"
            with sqlite3.connect(setup.data / "state.db") as db:
                chats = {r[0]: r[1] for r in db.execute("SELECT jid, name FROM chats")}
            assert chats.get(f"mx:{ours}") == "Family" and f"mx:{theirs}" not in chats
        finally:
            await run.stop()
            await p.close()
            await s.close()

    go(main())


def test_an_encrypted_room_is_refused_in_the_room_and_in_doctor(setup: Setup, go: Any) -> None:
    """An invite to an end-to-end encrypted room: the bot says in the room, in plain text,
    that it does not take part, and leaves; `doctor` fails a group configured with that
    room, with the fix."""

    async def main() -> None:
        setup.write()
        p = setup.person()
        run = await start(setup)
        try:
            room = await p.create_room([setup.bot], encrypted=True, name="Secret")
            notice: list[dict[str, Any]] = []

            async def told_and_left() -> bool:
                events = await p.events(room)
                notice[:] = [e for e in events if e["sender"] == setup.bot
                             and e["type"] == "m.room.message"]
                return bool(notice) and await p.membership(room, setup.bot) == "leave"

            deadline = time.monotonic() + 30
            while not await told_and_left():
                assert time.monotonic() < deadline, notice
                await asyncio.sleep(0.1)
            assert notice[0]["content"]["msgtype"] == "m.notice"
            assert notice[0]["content"]["body"] == ENCRYPTED_NOTICE.format(bot=setup.bot)
            plain = await p.text(room, "hello?")  # not encrypted by this test: still unread
            await asyncio.sleep(1)
            assert plain and not setup.agent.prompts
        finally:
            await run.stop()
            await p.close()
        setup.write({"secret": room})
        checks = {c["check"]: c for c in await asyncio.to_thread(run_checks,
                                                                 str(setup.config))}
        assert checks["matrix"]["level"] == "ok", checks["matrix"]
        bad = checks["matrix room secret"]
        assert bad["level"] == "fail" and "end-to-end encrypted" in bad["detail"]
        assert "encryption off" in bad["fix"] and setup.bot in bad["fix"]

    go(main())


def test_the_homeservers_rate_limit_makes_the_outbox_wait(setup: Setup, go: Any,
                                                          caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    """Eight answers at once: Synapse refuses some with M_LIMIT_EXCEEDED; each waits the
    time it says and all arrive, in order, once."""
    caplog.set_level(logging.INFO, logger="mdclaw.outbox")

    async def main() -> None:
        setup.write()
        p = setup.person()
        run = await start(setup)
        room = await joined_room(setup, p)
        await run.stop()
        setup.write({"family": room})
        run = await start(setup)
        try:
            await p.text(room, "BURST")
            got = await answers(p, room, setup.bot, 1 + setup.agent.burst, timeout=60)
            assert [e["content"]["body"] for e in got[1:]] == [
                f"part {i}" for i in range(setup.agent.burst)]
        finally:
            await run.stop()
            await p.close()
        assert "M_LIMIT_EXCEEDED" in caplog.text and "rate limited: retry in" in caplog.text
        with sqlite3.connect(setup.data / "state.db") as db:
            rows = db.execute("SELECT status, attempts FROM outbox WHERE chat_jid = ?",
                              (f"mx:{room}",)).fetchall()
        # every answer sent; those the homeserver refused were tried again (not given up)
        assert {status for status, _ in rows} == {"sent"}
        assert max(attempts for _, attempts in rows) >= 2

    go(main())


def test_a_password_login_is_kept_and_a_bad_password_named(setup: Setup, go: Any,
                                                           caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    """With password_file the daemon logs in once and keeps the token (0600); the next start
    takes it up (same device); a wrong password stops the channel with the key to fix."""

    async def main() -> None:
        password = "correct horse battery"
        account = setup.hs.register(f"pwbot{secrets.token_hex(3)}", password)
        setup.bot = account["user_id"]
        pw = setup.tmp / "matrix-password"
        pw.write_text(password)
        pw.chmod(0o600)
        setup.write(credentials=f"password_file: {pw}")
        run = await start(setup)
        device = run.channel.device_id
        await run.stop()
        stored = read_session(session_path(setup.data))
        assert stored and stored["user_id"] == setup.bot and stored["device_id"] == device
        assert stat.S_IMODE(session_path(setup.data).stat().st_mode) == 0o600
        run = await start(setup)
        assert run.channel.device_id == device
        await run.stop()
        session_path(setup.data).unlink()
        pw.write_text("wrong")
        d = Daemon(load_config(setup.config), str(setup.config), drain_timeout=1)
        ready = asyncio.Event()
        d.notifier.ready = lambda status=None: ready.set()  # type: ignore[method-assign]
        task = asyncio.create_task(d.run())
        await asyncio.wait_for(ready.wait(), 30)
        ch = next(c for c in d.channels if isinstance(c, MatrixChannel))
        assert not ch.is_connected() and ch.client is None  # not started, not retrying
        d.stop_event.set()
        assert await task == 0
        assert "channel matrix did not start: the homeserver refused the password of " \
            f"{setup.bot} (M_FORBIDDEN" in caplog.text
        assert "check channels.matrix.password_file" in caplog.text and "wrong" not in \
            caplog.text

    go(main())
    assert SERVER_NAME in setup.bot
