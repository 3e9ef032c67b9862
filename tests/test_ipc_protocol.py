"""The dialect parser: every dialect of every command maps to one canonical command, and
every malformed body is refused with a reason."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdclaw.ipc import protocol as P
from mdclaw.ipc.protocol import ProtocolError, parse_command, to_canonical_json

SCHED = {"prompt": "p", "schedule_type": "cron", "schedule_value": "0 8 * * *"}


def parse(body):  # noqa: ANN001, ANN201
    return parse_command(body)[0]


# --------------------------------------------------------------------------- each dialect

def test_message_in_every_dialect_is_the_same_command() -> None:
    want = P.SendMessage(chat_jid="tg:2", text="hi")
    assert parse({"type": "message", "chat_jid": "tg:2", "text": "hi"}) == want
    assert parse({"type": "message", "chatJid": "tg:2", "text": "hi"}) == want  # 001 / 003
    assert parse({"type": "send_message", "chatJid": "tg:2", "message": "hi",
                  "groupFolder": "family"}) == want  # send_message {message}
    assert parse({"type": "message", "payload": {"chatJid": "tg:2", "text": "hi"},
                  "source_group": "family"}) == want  # envelope
    m = parse({"type": "message", "chatJid": "x", "text": "t", "sender": "Research",
               "replyTo": "3EB0"})
    assert (m.sender, m.reply_to) == ("Research", "3EB0")
    assert parse({"type": "message", "text": "no chat"}).chat_jid is None


def test_claimed_group_is_returned_from_every_place() -> None:
    assert parse_command({"type": "refresh_groups"})[1] is None
    assert parse_command({"type": "refresh_groups", "groupFolder": "main"})[1] == "main"
    assert parse_command({"type": "refresh_groups", "source_group": "x"})[1] == "x"
    assert parse_command({"type": "refresh_groups", "payload": {},
                          "source_group": "y"})[1] == "y"
    assert parse_command({"type": "refresh_groups", "payload": {"groupFolder": "z"}})[1] == "z"
    with pytest.raises(ProtocolError, match="two different groups"):
        parse_command({"type": "refresh_groups", "source_group": "a", "groupFolder": "b"})


def test_send_file_and_react() -> None:
    f = parse({"type": "send_file", "chatJid": "c", "filePath": "/workspace/group/o.png",
               "fileName": "chart.png", "caption": "here"})
    assert f == P.SendFile(chat_jid="c", file_path="/workspace/group/o.png",
                           file_name="chart.png", caption="here")
    r = parse({"type": "react", "chatJid": "c", "messageId": "m1", "emoji": "👍"})
    assert r == P.React(chat_jid="c", message_id="m1", emoji="👍")
    with pytest.raises(ProtocolError, match="file_name"):
        parse({"type": "send_file", "filePath": "a", "fileName": "../x"})
    with pytest.raises(ProtocolError, match="emoji"):
        parse({"type": "react", "messageId": "m1"})


def test_schedule_task_dialects() -> None:
    canonical = parse({"type": "schedule_task", **SCHED, "chat_jid": "tg:2"})
    assert canonical == P.ScheduleTask(prompt="p", schedule_type="cron",
                                       schedule_value="0 8 * * *", chat_jid="tg:2")
    assert canonical.context_mode == "group"
    assert parse({"type": "schedule_task", **SCHED, "targetJid": "tg:2"}) == canonical  # 001
    assert parse({"type": "schedule_task", **SCHED, "chatJid": "tg:2",
                  "groupFolder": "family"}) == canonical  # update_task {updates}
    assert parse({"type": "schedule_task", "payload": {**SCHED, "chat_jid": "tg:2"},
                  "source_group": "family"}) == canonical  # envelope
    # a schedule_task may carry a model: accepted and ignored
    assert parse({"type": "schedule_task", **SCHED, "targetJid": "tg:2",
                  "model": "haiku"}) == canonical
    t = parse({"type": "schedule_task", "prompt": "p", "schedule_type": "interval",
               "schedule_value": 3600000, "taskId": "t-1", "context_mode": "isolated",
               "timezone": "UTC"})
    assert (t.schedule_value, t.task_id, t.context_mode, t.timezone) == (
        "3600000", "t-1", "isolated", "UTC")


@pytest.mark.parametrize("body, match", [
    ({"type": "schedule_task", "schedule_type": "cron", "schedule_value": "x"}, "prompt"),
    ({"type": "schedule_task", **SCHED, "schedule_type": "weekly"}, "schedule_type"),
    ({"type": "schedule_task", **SCHED, "context_mode": "shared"}, "context_mode"),
    ({"type": "schedule_task", **SCHED, "taskId": "../etc"}, "task_id"),
    ({"type": "schedule_task", **SCHED, "schedule_value": True}, "schedule_value"),
    ({"type": "schedule_task", **SCHED, "taskId": "a", "task_id": "b"}, "given twice"),
    ({"type": "schedule_task", **SCHED, "chatJid": "a", "targetJid": "b"}, "given twice"),
    ({"type": "schedule_task", **SCHED, "prompt": ""}, "prompt"),
    ({"type": "schedule_task", **SCHED, "colour": "red"}, "colour: unknown field"),
])
def test_schedule_task_invalid(body, match) -> None:  # noqa: ANN001
    with pytest.raises(ProtocolError, match=match):
        parse(body)


def test_task_id_operations_in_both_spellings() -> None:
    for t, cls in [("pause_task", P.PauseTask), ("resume_task", P.ResumeTask),
                   ("cancel_task", P.CancelTask), ("delete_task", P.DeleteTask)]:
        assert parse({"type": t, "taskId": "task-1"}) == cls(task_id="task-1")
        assert parse({"type": t, "payload": {"task_id": "task-1"},
                      "source_group": "g"}) == cls(task_id="task-1")
        with pytest.raises(ProtocolError, match="task_id: required"):
            parse({"type": t})
        with pytest.raises(ProtocolError, match="task_id"):
            parse({"type": t, "taskId": 5})


def test_update_task_updates_form_and_flat() -> None:
    a = parse({"type": "update_task", "taskId": "t1", "groupFolder": "family",
               "updates": {"prompt": "new", "schedule_value": "0 10 * * *", "status": "paused"}})
    b = parse({"type": "update_task", "task_id": "t1", "prompt": "new",
               "schedule_value": "0 10 * * *", "status": "paused"})
    assert a == b
    assert a.changes() == {"prompt": "new", "schedule_value": "0 10 * * *", "status": "paused"}
    with pytest.raises(ProtocolError, match="changes nothing"):
        parse({"type": "update_task", "taskId": "t1", "updates": {}})
    with pytest.raises(ProtocolError, match="status"):
        parse({"type": "update_task", "taskId": "t1", "updates": {"status": "completed"}})
    with pytest.raises(ProtocolError, match="both in updates and beside it"):
        parse({"type": "update_task", "taskId": "t1", "prompt": "a", "updates": {"prompt": "b"}})
    with pytest.raises(ProtocolError, match="updates must be"):
        parse({"type": "update_task", "taskId": "t1", "updates": ["prompt"]})
    with pytest.raises(ProtocolError, match="chat_jid: unknown field"):
        parse({"type": "update_task", "taskId": "t1", "updates": {"chat_jid": "x"}})


def test_group_commands() -> None:
    r = parse({"type": "register_group", "jid": "tg:9", "name": "N", "folder": "new-group",
               "trigger": "@Nova", "groupFolder": "main"})
    assert r == P.RegisterGroup(jid="tg:9", name="N", folder="new-group", trigger="@Nova")
    assert parse({"type": "register_group", "payload": {"chat_jid": "tg:9", "name": "N",
                                                        "folder": "new-group",
                                                        "trigger": "@Nova"}}) == r
    for flag in ("main", "is_main", "isMain"):
        with pytest.raises(ProtocolError, match="main flag cannot be granted"):
            parse({"type": "register_group", "jid": "j", "name": "n", "folder": "f", flag: True})
    for bad in ("../x", "global", "errors", "a/b", "", "-x", "x" * 65):
        with pytest.raises(ProtocolError, match="folder"):
            parse({"type": "register_group", "jid": "j", "name": "n", "folder": bad})
    assert parse({"type": "unregister_group", "jid": "tg:9"}) == P.UnregisterGroup(jid="tg:9")
    assert parse({"type": "unregister_group", "folder": "x"}) == P.UnregisterGroup(folder="x")
    with pytest.raises(ProtocolError, match="exactly one of jid, folder"):
        parse({"type": "unregister_group"})
    with pytest.raises(ProtocolError, match="exactly one of jid, folder"):
        parse({"type": "unregister_group", "jid": "a", "folder": "b"})
    assert parse({"type": "refresh_groups"}) == P.RefreshGroups()
    with pytest.raises(ProtocolError, match="unknown field"):
        parse({"type": "refresh_groups", "force": True})


def test_action_requests() -> None:
    a = parse({"type": "memory_action", "requestId": "req-1", "action": "memory_search",
               "params": {"query": "x"}})
    assert (a.request_id, a.action, a.params, a.family) == ("req-1", "memory_search",
                                                           {"query": "x"}, "memory_action")
    assert parse({"type": "farm_action", "requestId": "r", "action": "ha_restart",
                  "params": {}}).family == "farm_action"
    assert parse({"type": "action", "request_id": "r", "action": "memory_get"}).params == {}
    for rid in ("../x", "", ".hidden", "a/b", "x" * 200):
        with pytest.raises(ProtocolError, match="request_id"):
            parse({"type": "action", "request_id": rid, "action": "a"})
    with pytest.raises(ProtocolError, match="params"):
        parse({"type": "action", "request_id": "r", "action": "a", "params": [1]})


@pytest.mark.parametrize("body, match", [
    ([], "JSON object"),
    ("message", "JSON object"),
    ({}, "no string field 'type'"),
    ({"type": 3}, "no string field 'type'"),
    ({"type": "launch_missiles"}, "unknown command type"),
    ({"type": "message", "payload": "x"}, "payload must be"),
    ({"type": "message", "payload": {"text": "a"}, "text": "b"}, "beside payload"),
    ({"type": "message", "text": "x", "source_group": 5}, "must be a string"),
    ({"type": "message", "text": "x" * (P.MAX_TEXT + 1)}, "text"),
    ({"type": "message", "text": "a", "message": "b"}, "given twice"),
])
def test_malformed_bodies(body, match) -> None:  # noqa: ANN001
    with pytest.raises(ProtocolError, match=match):
        parse(body)


def test_canonical_form_round_trips() -> None:
    for body in [{"type": "send_message", "chatJid": "c", "message": "m"},
                 {"type": "schedule_task", **SCHED, "targetJid": "c", "taskId": "t"},
                 {"type": "update_task", "taskId": "t", "updates": {"prompt": "x"}},
                 {"type": "memory_action", "requestId": "r", "action": "memory_get",
                  "params": {"path": "MEMORY.md"}},
                 {"type": "register_group", "jid": "j", "name": "n", "folder": "f"}]:
        cmd = parse(body)
        canonical = to_canonical_json(cmd)
        assert "source_group" not in canonical
        again = parse(json.loads(json.dumps(canonical)))
        assert again.model_dump(exclude={"family"}) == cmd.model_dump(exclude={"family"})


# --------------------------------------------------------------------------- properties

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=4),
    max_leaves=12,
)
known_keys = st.sampled_from(["type", "payload", "source_group", "groupFolder", "chatJid",
                              "chat_jid", "targetJid", "text", "message", "taskId", "task_id",
                              "prompt", "schedule_type", "schedule_value", "updates", "jid",
                              "folder", "name", "requestId", "action", "params", "main"])
types = st.sampled_from(list(P.COMMAND_TYPES) + list(P.TYPE_ALIASES) + ["bogus"])


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(known_keys | st.text(max_size=10), json_values, max_size=8), types)
def test_any_body_parses_or_is_refused_with_a_reason(body, t) -> None:  # noqa: ANN001
    body = dict(body)
    body["type"] = t
    try:
        cmd, claimed = parse_command(body)
    except ProtocolError as e:
        assert str(e)
        return
    assert cmd.type in P.COMMAND_TYPES
    assert claimed is None or isinstance(claimed, str)
    if cmd.type == "register_group":
        assert not {"main", "is_main", "isMain"} & set(body)
    # A parsed command is frozen and re-parses to itself from its canonical form.
    assert parse(to_canonical_json(cmd)).model_dump(exclude={"family"}) == cmd.model_dump(
        exclude={"family"})


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=50), st.text(min_size=1, max_size=30),
       st.sampled_from(["chatJid", "chat_jid", "targetJid"]), st.booleans())
def test_message_text_survives_any_dialect(text, jid, jid_key, envelope) -> None:  # noqa: ANN001
    fields = {jid_key: jid, ("message" if jid_key == "chatJid" else "text"): text}
    if jid_key == "targetJid":  # targetJid is accepted everywhere chat_jid is
        fields = {"targetJid": jid, "text": text}
    body = ({"type": "message", "payload": fields} if envelope
            else {"type": "send_message" if "message" in fields else "message", **fields})
    cmd = parse(body)
    assert (cmd.text, cmd.chat_jid) == (text, jid)
