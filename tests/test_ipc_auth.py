"""The authorization matrix: main, the group itself, and another group, for every command.
Each case runs the real engine on real files and a real database."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipc_helpers import FAMILY_JID, MAIN_JID, WORK_JID, Env, schedule_body
from mdclaw.ipc.auth import Caller, Unauthorized, check_chat_target, check_identity


@pytest.fixture
def env(tmp_path: Path):  # noqa: ANN201
    e = Env(tmp_path)
    (e.data / "groups" / "family" / "out.txt").write_text("report")
    (e.data / "groups" / "work" / "out.txt").write_text("report")
    (e.data / "groups" / "main" / "out.txt").write_text("report")
    (e.data / "groups" / "work" / "MEMORY.md").write_text("work secret: tomatoes\n")
    (e.data / "groups" / "family" / "MEMORY.md").write_text("family: tomatoes\n")
    # A task owned by `work`, for the task operations.
    e.write("work", schedule_body("work-task"))
    assert e.drain().applied == 1
    yield e
    e.close()


def _outcome(env: Env, writer: str, body: dict) -> str:
    name = env.write(writer, body)
    res = env.drain()
    assert res.applied + res.rejected == 1
    meta = env.errors_for(writer, name)
    if res.rejected:
        assert meta is not None and meta["error"]
        return "rejected"
    assert meta is None
    return "applied"


TASK_OPS = [
    {"type": "pause_task", "taskId": "work-task"},
    {"type": "resume_task", "taskId": "work-task"},
    {"type": "update_task", "taskId": "work-task", "updates": {"prompt": "changed"}},
    {"type": "cancel_task", "taskId": "work-task"},
    {"type": "delete_task", "taskId": "work-task"},
]

# (writer, body, expected). "own" is work acting on its own things, "other" is family acting
# on work's, main may act on anyone's.
MATRIX = [
    # outbound
    *[(w, {"type": "message", "chatJid": WORK_JID, "text": "x"}, exp)
      for w, exp in (("main", "applied"), ("work", "applied"), ("family", "rejected"))],
    *[(w, {"type": "react", "chatJid": WORK_JID, "messageId": "m", "emoji": "👍"}, exp)
      for w, exp in (("main", "applied"), ("work", "applied"), ("family", "rejected"))],
    *[(w, {"type": "send_file", "chatJid": WORK_JID, "filePath": "/workspace/group/out.txt"},
       exp) for w, exp in (("main", "applied"), ("work", "applied"), ("family", "rejected"))],
    ("family", {"type": "message", "text": "own chat by default"}, "applied"),
    ("main", {"type": "message", "chatJid": "tg:unknown", "text": "x"}, "rejected"),
    # scheduling for a chat
    *[(w, schedule_body(targetJid=WORK_JID), exp)
      for w, exp in (("main", "applied"), ("work", "applied"), ("family", "rejected"))],
    ("main", schedule_body(targetJid="tg:unknown"), "rejected"),
    # task operations on work's task
    *[(w, op, exp) for op in TASK_OPS
      for w, exp in (("main", "applied"), ("work", "applied"), ("family", "rejected"))],
    # group administration
    *[(w, body, exp)
      for body in ({"type": "register_group", "jid": "tg:9", "name": "N", "folder": "newbie"},
                   {"type": "refresh_groups"},
                   {"type": "unregister_group", "jid": "tg:9"})
      for w, exp in (("main", "applied" if body["type"] != "unregister_group" else "rejected"),
                     ("work", "rejected"), ("family", "rejected"))],
    # memory actions on work's memory
    *[(w, {"type": "memory_action", "requestId": f"r-{w}", "action": "memory_search",
           "params": {"query": "tomatoes", "groupFolder": "work"}}, exp)
      for w, exp in (("main", "applied"), ("work", "applied"), ("family", "rejected"))],
    # identity: a body naming another group
    ("family", {"type": "message", "text": "x", "groupFolder": "main"}, "rejected"),
    ("family", {"type": "refresh_groups", "payload": {}, "source_group": "main"}, "rejected"),
    ("main", {"type": "message", "text": "x", "groupFolder": "main"}, "applied"),
]


@pytest.mark.parametrize("writer, body, expected", MATRIX,
                         ids=[f"{w}-{b['type']}-{i}" for i, (w, b, _) in enumerate(MATRIX)])
def test_authorization_matrix(env: Env, writer: str, body: dict, expected: str) -> None:
    before_tasks = env.tasks()
    before_outbox = env.outbox()
    assert _outcome(env, writer, body) == expected
    if expected == "rejected":  # and nothing changed
        assert env.tasks() == before_tasks and env.outbox() == before_outbox


def test_main_flag_is_never_granted_and_main_cannot_be_unregistered(env: Env) -> None:
    assert _outcome(env, "main", {"type": "register_group", "jid": "tg:9", "name": "N",
                                  "folder": "sneaky", "isMain": True}) == "rejected"
    assert _outcome(env, "main", {"type": "unregister_group", "folder": "main"}) == "rejected"
    assert _outcome(env, "main", {"type": "unregister_group", "jid": FAMILY_JID}) == "rejected"
    rows = env.db.query("SELECT folder FROM registered_groups WHERE is_main = 1")
    assert [r["folder"] for r in rows] == ["main"]
    # An IPC-registered group can be unregistered again, by main only.
    assert _outcome(env, "main", {"type": "register_group", "jid": "tg:9", "name": "N",
                                  "folder": "newbie"}) == "applied"
    assert _outcome(env, "family", {"type": "unregister_group", "jid": "tg:9"}) == "rejected"
    assert _outcome(env, "main", {"type": "unregister_group", "jid": "tg:9"}) == "applied"


def test_non_main_schedules_only_for_its_own_chat(env: Env) -> None:
    assert _outcome(env, "family", schedule_body("f1")) == "applied"
    assert env.task("f1")["group_folder"] == "family"
    assert env.task("f1")["chat_jid"] == FAMILY_JID
    assert _outcome(env, "family", schedule_body("f2", chatJid=MAIN_JID)) == "rejected"
    # main scheduling for work's chat creates work's task
    assert _outcome(env, "main", schedule_body("m1", targetJid=WORK_JID)) == "applied"
    assert env.task("m1")["group_folder"] == "work"


def test_auth_functions_directly() -> None:
    main = Caller("main", True, MAIN_JID)
    fam = Caller("family", False, FAMILY_JID)
    reg = {MAIN_JID: "main", FAMILY_JID: "family"}
    assert check_chat_target(main, FAMILY_JID, reg, "m") == (FAMILY_JID, "family")
    assert check_chat_target(fam, None, reg, "m") == (FAMILY_JID, "family")
    with pytest.raises(Unauthorized, match="own chat"):
        check_chat_target(fam, MAIN_JID, reg, "m")
    with pytest.raises(Unauthorized, match="has no chat"):
        check_chat_target(Caller("x", False, None), None, reg, "m")
    check_identity(fam, None)
    check_identity(fam, "family")
    with pytest.raises(Unauthorized, match="claims to come from group 'main'"):
        check_identity(fam, "main")
