"""A group in several chats, and where its agent may send: the config's rules, the database's
chats, the reconciler's cursors when chats or the session mode change, the IPC checks and the
snapshot the agent reads. The whole path through a daemon is tests/test_many_chats_daemon.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipc_helpers import Env
from mdclaw.config import ConfigError, load_config
from mdclaw.ipc import protocol as P
from mdclaw.ipc.auth import Caller, Unauthorized, check_chat_target
from mdclaw.ipc.writers import write_snapshots
from mdclaw.paths import Layout
from mdclaw.reconcile import reconcile
from mdclaw.state import Database
from mdclaw.state.conversations import (
    StoredMessage,
    get_cursor,
    get_session,
    line_messages,
    set_cursor,
    set_session,
    store_message,
)
from mdclaw.state.groups import get_group, get_group_by_jid

GROUPS = """\
data_dir: {{data_dir}}
groups:
  main: {{name: Admin, jid: "tg:1", main: true}}
  me: {{name: Me, chats: ["tg:2", "hl:me", "mail:me@example.org"], session: {session}}}
  family: {{name: Family, jid: "tg:-100", may_send_to: ["hl:news", me]}}
tasks:
  - {{id: t1, group: me, prompt: hi, cron: "0 8 * * *"}}
  - {{id: t2, group: me, prompt: hi, cron: "0 9 * * *", chat: "hl:me"}}
"""


def errors_of(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    return [i.render(str(path)) for i in ei.value.issues]


def test_a_chat_in_two_groups_and_other_mistakes_are_named(write_config) -> None:
    errs = " | ".join(errors_of(write_config("""\
        groups:
          main: {name: A, jid: "tg:1", main: true}
          me: {name: Me, chats: ["hl:me", "tg:1"]}
          b: {name: B, chats: ["tg:5", "tg:5"]}
          c: {name: C, jid: "tg:6", may_send_to: [nosuch, "hl:ok"]}
          d: {name: D}
        tasks:
          - {id: t, group: c, prompt: x, cron: "0 8 * * *", chat: "tg:7"}
    """)))
    assert "groups.me.chats: 'tg:1' is also the jid of group 'main'" in errs
    assert "from 'main' or from 'me'" in errs  # both named, with the fix
    assert "'tg:5' is listed twice" in errs
    assert "groups.c.may_send_to.0: 'nosuch' is neither a chat" in errs
    assert "groups.d.jid: a group needs a chat" in errs
    assert "tasks.0.chat: 'tg:7' is not a chat of group 'c'" in errs


def test_one_jid_stays_as_it_was_and_chats_alone_give_the_first(write_config) -> None:
    cfg = load_config(write_config(GROUPS.format(session="shared")))
    assert cfg.groups["main"].all_chats == ("tg:1",)
    assert cfg.groups["me"].jid == "tg:2"
    assert cfg.groups["me"].all_chats == ("tg:2", "hl:me", "mail:me@example.org")


def _setup(write_config, session: str = "shared") -> tuple[object, Database]:
    cfg = load_config(write_config(GROUPS.format(session=session)))
    db = Database(Layout(cfg.data_dir).db_path)
    reconcile(cfg, db)
    return cfg, db


def _msg(db: Database, chat: str, n: int) -> int:
    store_message(db, StoredMessage(f"{chat}:{n}", chat, "u", "U", f"m{n}",
                                    "2026-01-01T00:00:00Z", False, False))
    r = db.query_one("SELECT seq FROM messages WHERE id = ?", (f"{chat}:{n}",))
    assert r is not None
    return int(r[0])


def test_every_chat_routes_to_its_group_and_the_transcript_is_the_groups(write_config) -> None:
    cfg, db = _setup(write_config)
    for chat in ("tg:2", "hl:me", "mail:me@example.org"):
        g = get_group_by_jid(db, chat)
        assert g is not None and g.folder == "me"
    assert get_group_by_jid(db, "tg:3") is None
    g = get_group(db, "me")
    assert g is not None and g.all_chats == ("tg:2", "hl:me", "mail:me@example.org")
    a, b, c = _msg(db, "tg:2", 1), _msg(db, "hl:me", 2), _msg(db, "tg:2", 3)
    # A shared conversation reads both chats in the host's order.
    assert [m.seq for m in line_messages(db, g.all_chats, None)] == [a, b, c]
    assert [m.seq for m in line_messages(db, g.all_chats, a)] == [b, c]
    assert [m.seq for m in line_messages(db, g.all_chats, None, limit=2)] == [b, c]
    rows = db.query("SELECT chat_jid FROM transcript WHERE group_folder = 'me' ORDER BY id")
    assert [r[0] for r in rows] == ["tg:2", "hl:me", "tg:2"]
    # Tasks report to their chat: the group's first unless they name one.
    tasks = {r["id"]: r["chat_jid"] for r in db.query("SELECT id, chat_jid FROM scheduled_tasks")}
    assert tasks == {"t1": "tg:2", "t2": "hl:me"}


def test_cursors_stay_in_place_when_chats_or_the_mode_change(write_config) -> None:
    cfg, db = _setup(write_config)
    _msg(db, "tg:2", 1)
    answered = _msg(db, "hl:me", 2)
    set_cursor(db, "me", answered)  # the shared conversation answered both
    set_session(db, "me", "shared-session")
    # To per_chat: each chat's conversation starts where the shared one stood.
    cfg2 = load_config(write_config(GROUPS.format(session="per_chat")))
    reconcile(cfg2, db)
    assert get_cursor(db, "me", "tg:2") == answered
    assert get_cursor(db, "me", "hl:me") == answered
    assert get_session(db, "me", "tg:2") is None  # a conversation of its own
    later = _msg(db, "tg:2", 3)
    set_cursor(db, "me", later, "tg:2")
    # Back to shared: the furthest any chat got, so nothing is answered twice.
    reconcile(cfg, db)
    assert get_cursor(db, "me") == later
    assert get_session(db, "me") == "shared-session"
    # A chat that joins an existing group starts after what it already holds.
    old = _msg(db, "hl:new", 4)
    joined = load_config(write_config(GROUPS.format(session="shared").replace(
        '"mail:me@example.org"]', '"mail:me@example.org", "hl:new"]')))
    reconcile(joined, db)
    assert get_cursor(db, "me", "hl:new") == old


def test_a_chat_held_by_a_group_registered_over_ipc_is_a_conflict(write_config, tmp_path) -> None:
    cfg, db = _setup(write_config)
    db.conn.execute("DELETE FROM group_chats WHERE jid = 'hl:me'")
    from mdclaw.state.groups import GroupRow, upsert_group
    upsert_group(db, GroupRow("side", "Side", "hl:me", "@Andy", True, False, "ipc"))
    with pytest.raises(Exception, match="chat 'hl:me' is already registered to group 'side'"):
        reconcile(cfg, db)


def test_who_may_send_where() -> None:
    chats = {"tg:1": "main", "tg:2": "me", "hl:me": "me", "tg:-100": "family",
             "hl:x": "other"}
    family = Caller("family", False, "tg:-100", ("tg:-100",), ("hl:news", "me"))
    assert check_chat_target(family, None, chats, "message") == ("tg:-100", "family")
    assert check_chat_target(family, "hl:news", chats, "message") == ("hl:news", "")
    assert check_chat_target(family, "hl:me", chats, "send_file") == ("hl:me", "me")
    for chat in ("hl:x", "tg:1", "tg:999"):
        with pytest.raises(Unauthorized, match="not in groups.family.may_send_to"):
            check_chat_target(family, chat, chats, "message")
    # may_send_to opens messages and files, never tasks or reactions in another chat.
    with pytest.raises(Unauthorized, match="may only use its own chats"):
        check_chat_target(family, "hl:me", chats, "schedule_task")
    me = Caller("me", False, "tg:2", ("tg:2", "hl:me"))
    assert check_chat_target(me, "hl:me", chats, "schedule_task") == ("hl:me", "me")
    assert check_chat_target(me, "hl:me", chats, "react") == ("hl:me", "me")


def test_a_send_names_a_chat_or_a_group_not_both() -> None:
    cmd, _ = P.parse_command({"type": "message", "group": "family", "text": "hi"})
    assert cmd.group == "family" and cmd.chat_jid is None
    with pytest.raises(P.ProtocolError, match="chat_jid or group, not both"):
        P.parse_command({"type": "message", "group": "family", "chatJid": "tg:1",
                         "text": "hi"})
    with pytest.raises(P.ProtocolError):
        P.parse_command({"type": "send_file", "group": "../x", "file_path": "a"})


def test_the_agent_reads_its_chats_and_destinations(write_config) -> None:
    cfg, db = _setup(write_config, "per_chat")
    layout = Layout(cfg.data_dir)
    for folder in ("main", "me", "family"):
        (layout.ipc_dir / folder).mkdir(parents=True, exist_ok=True)
    write_snapshots(db, layout)
    me = json.loads((layout.ipc_dir / "me" / "chats.json").read_text())
    assert [(c["jid"], c["first"]) for c in me["chats"]] == [
        ("tg:2", True), ("hl:me", False), ("mail:me@example.org", False)]
    assert me["session"] == "per_chat" and me["maySendTo"] == []
    fam = json.loads((layout.ipc_dir / "family" / "chats.json").read_text())
    assert fam["maySendTo"] == [{"jid": "hl:news"}, {"group": "me", "jid": "tg:2"}]


def test_a_send_to_a_listed_group_by_name_goes_to_its_first_chat(tmp_path: Path) -> None:
    env = Env(tmp_path, family="    may_send_to: [work]\n")
    try:
        env.write("family", {"type": "message", "group": "work", "text": "hello work"},
                  sub="messages")
        env.write("family", {"type": "message", "group": "main", "text": "hello main"},
                  sub="messages")
        res = env.drain()
        assert (res.applied, res.rejected) == (1, 1)
        rows = env.db.query("SELECT chat_jid, text FROM outbox")
        assert [(r[0], r[1]) for r in rows] == [("tg:3", "hello work")]
        errors = [json.loads(p.read_text()) for p in env.errors.glob("*.error.json")]
        assert [e["error"] for e in errors] == [
            "unauthorized: group 'main' is not in groups.family.may_send_to"]
    finally:
        env.close()


def test_the_main_agent_sees_every_chat_of_every_group(write_config) -> None:
    """available_groups.json lists each group with all its chats and its session mode (the
    main agent can address any of them); `jid` stays the first chat, and a group's other
    chats are not listed as chats no group answers in."""
    cfg, db = _setup(write_config, "per_chat")
    layout = Layout(cfg.data_dir)
    for folder in ("main", "me", "family"):
        (layout.ipc_dir / folder).mkdir(parents=True, exist_ok=True)
    with db.transaction() as c:
        c.execute("INSERT INTO chats (jid, name, last_activity, channel, is_group) VALUES "
                  "('hl:me', 'Web', '2026-02-24T12:00:00.000Z', 'http', 0), "
                  "('tg:2', 'Sam', '2026-02-23T12:00:00.000Z', 'telegram', 0), "
                  "('tg:77', 'Club', '2026-02-22T12:00:00.000Z', 'telegram', 1)")
    write_snapshots(db, layout)
    snap = json.loads((layout.ipc_dir / "main" / "available_groups.json").read_text())
    entries = snap["groups"]
    assert [e["jid"] for e in entries if e["folder"] is None] == ["tg:77"]
    me = next(e for e in entries if e["folder"] == "me")
    assert me["jid"] == "tg:2" and me["session"] == "per_chat" and me["isRegistered"]
    assert me["chats"] == [
        {"jid": "tg:2", "name": "Sam", "lastActivity": "2026-02-23T12:00:00.000Z",
         "first": True},
        {"jid": "hl:me", "name": "Web", "lastActivity": "2026-02-24T12:00:00.000Z",
         "first": False},
        {"jid": "mail:me@example.org", "name": "mail:me@example.org", "lastActivity": None,
         "first": False}]
    assert me["lastActivity"] == "2026-02-24T12:00:00.000Z"  # the newest of its chats
    fam = next(e for e in entries if e["folder"] == "family")
    assert fam["session"] == "shared" and [c["jid"] for c in fam["chats"]] == ["tg:-100"]
