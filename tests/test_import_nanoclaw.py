"""`mdclaw import nanoclaw` against a NanoClaw v1.2.53 install made by NanoClaw's own code
(tests/data/nanoclaw-v1, README there): the plan and config snippet, the import, a second
run that changes nothing, hostile files, and the imported groups answering through a real
daemon."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fake_engine import FakeContainer, FakeEngine
from mdclaw.channels.base import InboundMessage
from mdclaw.config import load_config
from mdclaw.daemon import core
from mdclaw.daemon.core import Daemon
from mdclaw.schedule import from_iso, utc_now
from mdclaw.state import Database
from mdclaw.state.conversations import get_cursor
from mdclaw.state.transcripts import search
from waiting import wait_until_async

REPO = Path(__file__).resolve().parents[1]
NANOCLAW = REPO / "tests" / "data" / "nanoclaw-v1"
FAMILY = "wa:120363001234567890@g.us"
BASE = """\
data_dir: {data}
assistant: {{name: Andy, timezone: Europe/Berlin, model: local}}
models:
  local: {{backend: openai, model: m, base_url: "http://10.1.2.3:11434/v1"}}
runtime: {{socket: "unix://{tmp}/no-engine.sock"}}
server: null
channels: {{http: {{enabled: false}}}}
limits: {{idle_timeout: 500ms}}
"""


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "mdclaw", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def install(tmp_path: Path) -> Path:
    """A copy of the NanoClaw install (tests may plant things in it)."""
    dst = tmp_path / "nanoclaw"
    shutil.copytree(NANOCLAW, dst)
    return dst


def config_from_snippet(tmp_path: Path, install: Path) -> Path:
    """config.yaml: the base plus the groups `mdclaw import nanoclaw` printed."""
    p = cli("import", "nanoclaw", str(install), "--json")
    assert p.returncode == 0, p.stderr
    snippet = yaml.safe_load(json.loads(p.stdout)["config"])
    config = tmp_path / "config.yaml"
    config.write_text(BASE.format(data=tmp_path / "data", tmp=tmp_path)
                      + yaml.safe_dump({"groups": snippet["groups"]}))
    return config


def test_the_plan_maps_groups_and_prints_a_valid_config(tmp_path: Path,
                                                        install: Path) -> None:
    p = cli("import", "nanoclaw", str(install), "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    groups = {g["folder"]: g for g in plan["groups"]}
    assert groups["main"]["mdclaw_jid"] == "wa:4915112345678@s.whatsapp.net"
    assert groups["main"]["main"] is True and groups["main"]["requires_trigger"] is False
    assert groups["family"]["mdclaw_jid"] == FAMILY
    assert groups["bookclub"]["mdclaw_jid"] == "tg:-1001234567890"
    assert (groups["family"]["messages"], groups["bookclub"]["messages"]) == (3, 2)
    assert plan["messages"] == 7 and plan["sessions_not_imported"] == 1
    assert any("completed" in x for x in plan["problems"])
    snippet = yaml.safe_load(plan["config"])
    assert snippet["channels"]["whatsapp"] == {"enabled": True}
    assert snippet["groups"]["family"] == {"name": "Family", "jid": FAMILY,
                                           "trigger": "@Andy"}
    config = config_from_snippet(tmp_path, install)
    r = cli("check-config", "--config", str(config))
    assert r.returncode == 0, r.stdout + r.stderr
    # Nothing was written anywhere: the plan only reads.
    assert not (tmp_path / "data").exists()
    assert (install / "store" / "messages.db").read_bytes() == \
        (NANOCLAW / "store" / "messages.db").read_bytes()


def snapshot(data: Path) -> tuple[list[str], dict[str, str]]:
    conn = sqlite3.connect(data / "state.db")
    try:
        dump = [x for x in conn.iterdump()]
    finally:
        conn.close()
    files = {str(p.relative_to(data)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted((data / "groups").rglob("*")) if p.is_file()}
    return dump, files


def test_apply_imports_history_tasks_and_files_and_a_second_run_changes_nothing(
        tmp_path: Path, install: Path) -> None:
    config = config_from_snippet(tmp_path, install)
    data = tmp_path / "data"
    (install / "groups" / "family" / "evil").symlink_to("/etc/passwd")
    p = cli("import", "nanoclaw", str(install), "--apply", "--json", "--config", str(config))
    assert p.returncode == 0, p.stderr
    done = json.loads(p.stdout)
    assert sorted(done["groups"]) == ["bookclub", "family", "main"]
    assert done["messages"] == 7 and done["tasks"] == 2 and done["changed"] is True
    problems = "\n".join(done["problems"])
    assert "task-1772350000004-bad000" in problems and "every monday" in problems
    assert "task-1772350000002-ghi789" in problems and "in the past" in problems
    assert "groups/family/evil: a symlink: skipped" in problems
    assert not (data / "groups" / "family" / "evil").exists()
    with Database(data / "state.db") as db:
        rows = db.query("SELECT chat_jid, content, is_bot_message FROM messages "
                        "WHERE chat_jid = ? ORDER BY seq", (FAMILY,))
        assert [r["content"][:12] for r in rows] == ["@Andy what s", "Andy: How ab",
                                                     "Grandma visi"]
        assert [r["is_bot_message"] for r in rows] == [0, 1, 0]
        # Memory search finds the old conversation, in its group only.
        hits = search(db.conn, "family", "pumpkin", 10)
        assert hits and all(h.group == "family" for h in hits)
        assert search(db.conn, "bookclub", "pumpkin", 10) == []
        top = db.scalar("SELECT MAX(seq) FROM messages WHERE chat_jid = ?", (FAMILY,))
        assert get_cursor(db, "family") == top  # history is not answered as new
        tasks = {r["id"]: dict(r) for r in db.query("SELECT * FROM scheduled_tasks")}
        weekly = tasks["task-1772350000000-abc123"]
        assert (weekly["group_folder"], weekly["chat_jid"]) == ("family", FAMILY)
        assert weekly["schedule_value"] == "0 9 * * 6" and weekly["status"] == "active"
        nxt = from_iso(weekly["next_run"])
        assert nxt > utc_now() and nxt.astimezone().weekday() in (5, 6)
        assert tasks["task-1772350000001-def456"]["status"] == "paused"
        assert tasks["task-1772350000001-def456"]["context_mode"] == "isolated"
    memory = (data / "groups" / "family" / "CLAUDE.md").read_text()
    assert "Grandma visits on the 14th" in memory
    assert (data / "groups" / "bookclub" / "reading-list.md").read_text().endswith(
        "The Left Hand of Darkness\n")
    assert (data / "groups" / "global" / "CLAUDE.md").read_bytes() == \
        (install / "groups" / "global" / "CLAUDE.md").read_bytes()
    assert (data / "groups" / "family").stat().st_mode & 0o7777 == 0o2770

    before = snapshot(data)
    p = cli("import", "nanoclaw", str(install), "--apply", "--config", str(config))
    assert p.returncode == 0, p.stderr
    assert "nothing changed" in p.stdout
    assert snapshot(data) == before


def test_a_file_of_ours_is_kept_and_nanoclaws_written_beside_it(tmp_path: Path,
                                                               install: Path) -> None:
    config = config_from_snippet(tmp_path, install)
    mine = tmp_path / "data" / "groups" / "family"
    mine.mkdir(parents=True)
    (mine / "CLAUDE.md").write_text("# mdclaw's own notes\n")
    p = cli("import", "nanoclaw", str(install), "--apply", "--config", str(config))
    assert p.returncode == 0, p.stderr
    assert (mine / "CLAUDE.md").read_text() == "# mdclaw's own notes\n"
    assert "Grandma" in (mine / "CLAUDE.md.nanoclaw").read_text()
    assert "kept it; NanoClaw's is beside it as CLAUDE.md.nanoclaw" in p.stdout


def test_groups_not_in_the_config_are_not_imported(tmp_path: Path, install: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(BASE.format(data=tmp_path / "data", tmp=tmp_path)
                      + 'groups: {main: {name: A, jid: "hl:main", main: true}}\n')
    p = cli("import", "nanoclaw", str(install), "--apply", "--config", str(config))
    assert p.returncode == 1 and "none of NanoClaw's groups is in the config" in p.stdout
    assert "jid: \"wa:120363001234567890@g.us\"" in p.stdout


def test_not_a_nanoclaw_install(tmp_path: Path) -> None:
    p = cli("import", "nanoclaw", str(tmp_path))
    assert p.returncode == 1 and "not a NanoClaw v1 install" in p.stderr
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "messages.db").write_bytes(b"not a database" * 100)
    p = cli("import", "nanoclaw", str(tmp_path))
    assert p.returncode == 1 and "not a NanoClaw store" in p.stderr


def test_imported_groups_answer_through_a_real_daemon(
        tmp_path: Path, install: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = config_from_snippet(tmp_path, install)
    p = cli("import", "nanoclaw", str(install), "--apply", "--config", str(config))
    assert p.returncode == 0, p.stderr
    prompts: list[str] = []

    def agent(c: FakeContainer) -> int:
        assert c.group_dir is not None and c.prompt is not None
        prompts.append(c.prompt)
        memory = (c.group_dir / "CLAUDE.md").read_text()
        note = next(line for line in memory.splitlines() if "Grandma" in line)
        c.say({"status": "success", "result": f"From my notes: {note.strip('- ')}"})
        return 0

    engine = FakeEngine(default=agent)
    monkeypatch.setattr(core, "create_runtime", lambda _cfg: engine)

    async def go() -> list[dict[str, Any]]:
        d = Daemon(load_config(config), str(config), drain_timeout=5)
        ready = asyncio.Event()
        d.notifier.ready = lambda status=None: ready.set()  # type: ignore[method-assign]
        task = asyncio.create_task(d.run())
        try:
            await asyncio.wait_for(ready.wait(), 60)
            assert d.orch is not None
            await asyncio.wait_for(d.orch.engine_ready.wait(), 30)
            await d.orch.on_inbound(InboundMessage(
                id="wa-new-1", chat_jid=FAMILY, sender="4915100000001@s.whatsapp.net",
                sender_name="Anna", content="@Andy when does Grandma come?",
                timestamp="2026-11-26T10:00:00.000Z", is_group=True))

            def replied() -> list[dict[str, Any]]:
                return [dict(r) for r in d.db.query(
                    "SELECT chat_jid, text FROM outbox WHERE text LIKE 'From my notes%'")]

            return await wait_until_async(replied, 60, what="the family group's answer")
        finally:
            d.stop_event.set()
            assert await asyncio.wait_for(task, 120) == 0

    out = asyncio.run(go())
    assert out == [{"chat_jid": FAMILY,
                    "text": "From my notes: Grandma visits on the 14th (train 10:42)"}]
    # One turn, for the new message: the imported history was not answered again.
    assert len(prompts) == 1
    assert "when does Grandma come" in prompts[0] and "pumpkin" not in prompts[0]


def test_nanoclaws_chat_forms_map_to_mdclaws_channels() -> None:
    from mdclaw.nanoclaw import map_jid
    assert map_jid("120363001234567890@g.us") == ("wa:120363001234567890@g.us", "whatsapp")
    assert map_jid("4915112345678@s.whatsapp.net")[0] == "wa:4915112345678@s.whatsapp.net"
    assert map_jid("tg:-1001234567890") == ("tg:-1001234567890", "telegram")
    assert map_jid("dc:1234567890123") == ("dc:1234567890123", "discord")
    assert map_jid("slack:C0123456789") == ("slack:C0123456789", "slack")
    for odd in ("gmail:someone@example.org", "dc:../x", "x@evil.com", ""):
        mapped, why = map_jid(odd)
        assert mapped is None and "mdclaw has no" in why
