"""Approval rules, cards and the store, on a real database: which request needs whose yes
(the family defaults, global and per-group rules, globs and argument conditions), what a
card shows of hostile arguments, and that a decision is taken once (two approvers at once,
on two connections), codes are single-use and lock after wrong guesses."""

from __future__ import annotations

import json
import re
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mdclaw.approvals import cards, flow, store
from mdclaw.approvals.rules import (
    DEFAULT_RULES,
    Request,
    effective_rules,
    matching_rule,
    rule_for,
    rules_listing,
)
from mdclaw.config import load_config
from mdclaw.reconcile import reconcile
from mdclaw.state import Database

CONFIG = """\
data_dir: {data}
assistant: {{name: Andy, timezone: Europe/Berlin}}
people:
  alex: {{name: Alex, role: owner, identities: {{telegram: ["111"]}}}}
  bob: {{name: Bob, role: admin, identities: {{telegram: ["222"]}}}}
  kim: {{name: Kim, identities: {{http: [kim]}}}}
approvals:
  rules:
    - match: {{action: "web_*", args: {{url: ["https://bank.example/*"]}}}}
      approver: admin
      timeout: 5m
groups:
  main: {{name: Admin, jid: "tg:111", main: true}}
  kids:
    name: Kids
    jid: "tg:-5"
    approvals:
      - match: {{action: ha_call_service, args: {{domain: [light]}}}}
        approver: none
      - match: {{action: web_fetch}}
        approver: kim
"""


@pytest.fixture
def cfg(tmp_path: Path):
    p = tmp_path / "config.yaml"
    p.write_text(CONFIG.format(data=tmp_path / "data"))
    return load_config(p)


def act(name: str, **params) -> Request:
    return Request("action", name, params)


def test_the_family_defaults(cfg) -> None:
    for name in ("ha_call_service", "ha_set_entity", "ha_restart", "ha_apply_dashboard",
                 "ha_canvas_set_spec", "ha_canvas_patch_spec", "ha_dashboard_patch"):
        rule = rule_for(cfg, "main", act(name, domain="switch"))
        assert rule is not None and rule.approver == "owner", name
        assert rule.timeout == timedelta(minutes=30)
    for name in ("ha_get_status", "ha_dashboard_get", "farm_state_refresh", "memory_search",
                 "web_search"):
        assert rule_for(cfg, "main", act(name)) is None, name
    assert rule_for(cfg, "main", act("ha_dashboard_patch", dryRun=True)) is None
    for ctype in ("register_group", "unregister_group"):
        assert rule_for(cfg, "main", Request("command", ctype, {})).approver == "owner"
    for ctype in ("message", "send_file", "react", "schedule_task"):
        assert rule_for(cfg, "main", Request("command", ctype, {}, other_chat=True)) is not None
        assert rule_for(cfg, "main", Request("command", ctype, {}, other_chat=False)) is None
    assert rule_for(cfg, "main", Request("command", "pause_task", {})) is None


def test_no_rule_matched_is_not_a_rule_that_says_none(cfg, tmp_path: Path) -> None:
    asked: list[str] = []

    def unmatched() -> str:
        asked.append("asked")
        return "mcp_servers.git: tool annotations (not read-only)"

    # nothing matches: the action's own say holds it for the owner, under its reason
    rule = rule_for(cfg, "main", act("mcp_call", server="git"), unmatched=unmatched)
    assert rule is not None and rule.approver == "owner" and asked == ["asked"]
    assert rule.source == "mcp_servers.git: tool annotations (not read-only)"
    assert rule.describe().startswith("mcp_servers.git: tool annotations (not read-only): ")
    assert rule.timeout == timedelta(minutes=30)
    assert rule_for(cfg, "main", act("mcp_call"), unmatched=lambda: None) is None
    # a matching rule with approver: none lets it go unasked; the action is not asked
    m = matching_rule(cfg, "kids", act("ha_call_service", domain="light"))
    assert m is not None and m.approver == "none"
    asked.clear()
    assert rule_for(cfg, "kids", act("ha_call_service", domain="light"),
                    unmatched=unmatched) is None
    assert asked == []
    assert matching_rule(cfg, "main", act("mcp_call")) is None
    # without an owner nobody could say yes: it is not held
    p = tmp_path / "no-owner.yaml"
    p.write_text(f"data_dir: {tmp_path / 'd2'}\ngroups: {{main: {{name: A, jid: 'tg:1', "
                 "main: true}}\n")
    assert rule_for(load_config(p), "main", act("mcp_call"), unmatched=unmatched) is None


def test_later_rules_win_globs_and_argument_conditions(cfg) -> None:
    # kids loosens lights, keeps locks; names another approver for web_fetch
    assert rule_for(cfg, "kids", act("ha_call_service", domain="light")) is None
    assert rule_for(cfg, "kids", act("ha_call_service", domain="lock")).approver == "owner"
    assert rule_for(cfg, "main", act("ha_call_service", domain="light")).approver == "owner"
    kids = rule_for(cfg, "kids", act("web_fetch", url="https://bank.example/x"))
    assert kids.approver == "kim" and kids.source == "groups.kids.approvals[1]"
    glob = rule_for(cfg, "main", act("web_fetch", url="https://bank.example/login"))
    assert glob.approver == "admin" and glob.timeout == timedelta(minutes=5)
    assert glob.source == "approvals.rules[0]"
    assert rule_for(cfg, "main", act("web_fetch", url="https://news.example/")) is None
    assert rule_for(cfg, "main", act("web_fetch")) is None  # no url: the condition fails
    sources = [r["source"] for r in rules_listing(cfg, "kids")]
    assert sources[:len(DEFAULT_RULES)] == [f"defaults[{n}]" for n in range(len(DEFAULT_RULES))]
    assert sources[-3:] == ["approvals.rules[0]", "groups.kids.approvals[0]",
                            "groups.kids.approvals[1]"]


def test_list_arguments_dotted_paths_and_types(cfg, tmp_path: Path) -> None:
    p = tmp_path / "c2.yaml"
    p.write_text(CONFIG.format(data=tmp_path / "data").replace(
        '      - match: {action: web_fetch}\n        approver: kim\n',
        '      - match: {action: ha_call_service, args: {target.entity_id: ["lock.*"]}}\n'
        '        approver: bob\n'
        '      - match: {action: ha_set_entity, args: {value: [1]}}\n        approver: bob\n'))
    c = load_config(p)
    hit = rule_for(c, "kids", act("ha_call_service", domain="light",
                                  target={"entity_id": ["light.a", "lock.front_door"]}))
    assert hit is not None and hit.approver == "bob"
    assert rule_for(c, "kids", act("ha_call_service", domain="light",
                                   target={"entity_id": "light.a"})) is None
    # 1 is not True: a boolean never matches a number, nor the other way round
    assert rule_for(c, "kids", act("ha_set_entity", value=1)).approver == "bob"
    assert rule_for(c, "kids", act("ha_set_entity", value=True)).approver == "owner"


def test_no_people_no_defaults(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(f"data_dir: {tmp_path}/d\ngroups:\n  main: {{name: M, jid: 'tg:1', "
                 "main: true}\n")
    c = load_config(p)
    assert effective_rules(c, "main") == []
    assert rule_for(c, "main", act("ha_restart")) is None


def test_the_rules_follow_the_config_in_force_group_by_group(cfg, tmp_path: Path) -> None:
    """Rules are made once per config and group: a reloaded config (another object, maybe
    at the address of one gone) gets its own, for every group, and so does the old one
    when it is in force again."""
    p = tmp_path / "bare.yaml"
    p.write_text(f"data_dir: {tmp_path}/d2\ngroups:\n  main: {{name: M, jid: 'tg:1', "
                 "main: true}\n  kids: {name: K, jid: 'tg:2'}\n")
    bare = load_config(p)
    with_rules = {f: [r.source for r in effective_rules(cfg, f)] for f in ("main", "kids")}
    assert all(with_rules.values())
    assert effective_rules(bare, "main") == effective_rules(bare, "kids") == []
    assert {f: [r.source for r in effective_rules(cfg, f)]
            for f in ("main", "kids")} == with_rules
    assert effective_rules(cfg, "main") is effective_rules(cfg, "main")  # made once


# --------------------------------------------------------------------------- cards

HOSTILE = "\x1b[8mhidden\x1b[0m ok\u202etxt.exe\u2066\u200b\n\\x1b"


def test_hostile_arguments_show_escaped_on_the_card() -> None:
    text = cards.card_text(
        approval_id=7, kind="action", group="main", group_name="Admin",
        request={"action": "ha_call_service",
                 "params": {"domain": "lock", "service": "unlock",
                            "target": {"entity_id": HOSTILE}, "\u202ekey": 1,
                            "long": "x" * 500}},
        rule="defaults[0]: action ha_call_service -> owner", expires="2026-01-01 10:00",
        code="7KQ2", choices=[("approve", "Approve"), ("deny", "Deny")])
    for raw in ("\x1b", "\u202e", "\u2066", "\u200b"):
        assert raw not in text.codes_text
    assert all(line.isprintable() for line in text.codes_text.split("\n"))
    assert "\n  hidden" not in text.text  # the agent's newline does not make a line
    assert '"\\x1b[8mhidden\\x1b[0m ok\\u202etxt.exe\\u2066\\u200b\\n\\\\x1b"' in text.text
    assert "\\u202ekey: 1" in text.text
    assert text.cut and "x" * 200 not in text.text and '"' + "x" * 150 in text.text
    assert "x…\n" in text.text
    assert 'Reply "approve 7KQ2" / "deny 7KQ2".' in text.codes_text
    assert "domain: \"lock\"" in text.text and "target.entity_id:" in text.text
    full = "".join(cards.full_text(7, "action", {"action": "x", "params": {"long": "y" * 9000}}))
    assert full.count("y") == 9000 and "…" not in full


_ESC = re.compile(r"\\(\\|n|r|t|x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})")


def _unescape(text: str) -> str:
    def one(m: re.Match[str]) -> str:
        e = m.group(1)
        return {"\\": "\\", "n": "\n", "r": "\r", "t": "\t"}.get(e) or chr(int(e[1:], 16))
    return _ESC.sub(one, text)


@given(st.text(max_size=200))
def test_an_escaped_value_is_printable_and_reads_back(value) -> None:
    shown, cut = cards.shown(value, limit=10_000)
    assert not cut and all(ch.isprintable() for ch in shown)
    assert _unescape(shown[1:-1]) == value  # nothing hidden, nothing lost


# --------------------------------------------------------------------------- the store


def opened(cfg, db: Database, **kw):
    with db.transaction() as conn:
        return flow.open_approval(conn, cfg, kind=kw.pop("kind", "action"), folder="main",
                                  group_name="Admin", request=kw.pop("request", {
                                      "action": "ha_restart", "params": {}}),
                                  approver=kw.pop("approver", "admin"),
                                  timeout=kw.pop("timeout", timedelta(minutes=30)), **kw)


def test_a_card_goes_to_every_approver_with_a_code_of_their_own(cfg) -> None:
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    o = opened(cfg, db)
    assert set(o.approvers) == {"alex", "bob"} and o.cards == 2
    a = store.get(db, o.id, codes=True)
    assert a.pending and set(a.codes) == {"alex", "bob"}
    assert all(len(c) == 4 and set(c) <= set(store.CODE_ALPHABET) for c in a.codes.values())
    rows = db.query("SELECT chat_jid, text, card FROM outbox ORDER BY id")
    assert [r["chat_jid"] for r in rows] == ["tg:111", "tg:222"]
    for r in rows:
        assert r["text"] is None  # out of every transcript
        card = json.loads(r["card"])
        assert [c["label"] for c in card["choices"]] == ["Approve", "Deny"]
        assert card["choices"][0]["data"] == f"mdc:{o.id}:approve"
    owner_card = json.loads(rows[0]["card"])["fallback"]
    assert f'"approve {a.codes["alex"]}"' in owner_card
    assert a.codes["bob"] not in owner_card  # each sees only their own code
    assert db.query("SELECT count(*) FROM transcript")[0][0] == 0


def test_two_approvers_at_once_one_decision_wins(cfg) -> None:
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    def answer(o: flow.Opened, barrier: threading.Barrier, won: list[str], who: str,
               status: str) -> None:
        conn_db = Database(cfg.db_path, migrate=False)  # a connection of its own
        try:
            barrier.wait()
            with conn_db.transaction() as conn:
                if flow.decide(conn, cfg, o.id, status=status, by=who, label=who,
                               via="test") is not None:
                    won.append(f"{who}:{status}")
        finally:
            conn_db.close()

    for _round in range(20):
        o = opened(cfg, db)
        barrier = threading.Barrier(2)
        won: list[str] = []
        threads = [threading.Thread(target=answer, args=(o, barrier, won, "alex", "approved")),
                   threading.Thread(target=answer, args=(o, barrier, won, "bob", "denied"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(won) == 1
        a = store.get(db, o.id)
        assert f"{a.decided_by}:{a.status}" == won[0]


def test_codes_are_single_use_and_wrong_guesses_lock_them(cfg) -> None:
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    o = opened(cfg, db)
    a = store.get(db, o.id, codes=True)
    code = a.codes["alex"]
    with db.transaction() as conn:
        assert store.by_code(conn, "bob", code) is None or a.codes["bob"] == code
        assert store.by_code(conn, "alex", code.lower()).id == o.id  # case does not matter
        for n in range(store.MAX_WRONG_CODES):
            locked = store.wrong_code(conn, "alex")
            assert locked == ([o.id] if n == store.MAX_WRONG_CODES - 1 else [])
        assert store.by_code(conn, "alex", code) is None  # locked: even the right one
        assert store.by_code(conn, "bob", a.codes["bob"]) is None  # the approval's codes
    assert store.get(db, o.id).codes_locked
    # a decided approval's code is spent
    o2 = opened(cfg, db)
    code2 = store.get(db, o2.id, codes=True).codes["bob"]
    with db.transaction() as conn:
        assert flow.decide(conn, cfg, o2.id, status="denied", by="bob", label="Bob",
                           via="test") is not None
        assert store.by_code(conn, "bob", code2) is None
        assert flow.decide(conn, cfg, o2.id, status="approved", by="alex", label="Alex",
                           via="test") is None
    assert store.get(db, o2.id, codes=True).codes == {}  # spent codes are gone
    assert set(store.get(db, o.id, codes=True).codes) == {"alex", "bob"}  # still pending


def test_expiry_is_found_by_the_index_and_settles_once(cfg) -> None:
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    o = opened(cfg, db, timeout=timedelta(milliseconds=1))
    assert store.due(db, "2999-01-01T00:00:00.000Z") == [o.id]
    plan = db.query("EXPLAIN QUERY PLAN SELECT id FROM approvals WHERE status = 'pending' AND "
                    "expires_at <= ? ORDER BY expires_at", ("x",))
    assert any("idx_approvals_pending" in r[3] for r in plan)
    with db.transaction() as conn:
        flow.decide(conn, cfg, o.id, status="expired", by=None, label="nobody", via="timeout")
    assert [a.id for a in store.unsettled(db)] == [o.id]
    with db.transaction() as conn:
        assert store.mark_settled(conn, o.id, None)
        assert not store.mark_settled(conn, o.id, None)
    assert store.unsettled(db) == []


def test_check_config_and_the_cli_show_the_rules_in_force(tmp_path: Path, cli) -> None:
    p = tmp_path / "config.yaml"
    p.write_text(CONFIG.format(data=tmp_path / "data"))
    ok = cli("check-config", "--config", str(p))
    assert ok.returncode == 0, ok.stderr
    assert "approvals for kids: 17 rule(s), the last that matches decides (14 built-in)" \
        in ok.stdout
    assert "groups.kids.approvals[0]: action ha_call_service with domain in ['light'] -> " \
        "nobody" in ok.stdout
    r = cli("approvals", "rules", "-g", "kids", "--json", "--config", str(p))
    assert r.returncode == 0, r.stderr
    rules = json.loads(r.stdout)["kids"]
    assert rules[0] == {"source": "defaults[0]", "command": None, "action": "ha_call_service",
                        "to": None, "args": {}, "approver": "owner", "timeout": 1800,
                        "describe": "defaults[0]: action ha_call_service -> owner"}
    assert rules[-1]["approver"] == "kim" and rules[-2]["approver"] == "none"
    text = cli("approvals", "rules", "--config", str(p)).stdout
    assert text.startswith("kids:\n  defaults[0]: action ha_call_service -> owner")
    assert "main:\n" in text
    bad = cli("approvals", "rules", "-g", "nope", "--config", str(p))
    assert bad.returncode == 1 and "no group 'nope'" in bad.stderr
    # an operator's decision from the CLI, and its audit
    cfg = load_config(p)
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    o = opened(cfg, db, kind="question", request={"question": "Pizza?",
                                                  "options": ["yes", "no"], "who": "owner"},
               approver="owner", chat_jid="tg:4242")
    no_option = cli("approvals", "approve", str(o.id), "--config", str(p))
    assert no_option.returncode == 1 and "--option" in no_option.stderr
    r = cli("approvals", "approve", str(o.id), "--option", "2", "--json", "--config", str(p))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["status"] == "answered" and got["choice"] == "2"
    assert got["decided_by"].startswith("cli:") and got["decided_via"] == "cli"
    twice = cli("approvals", "deny", str(o.id), "--config", str(p))
    assert twice.returncode == 1 and "answered already" in twice.stderr
    listing = json.loads(cli("approvals", "list", "--json", "--config", str(p)).stdout)
    assert [a["id"] for a in listing] == [o.id] and "codes" not in listing[0]
    assert listing[0]["chat_jid"] == "tg:4242"  # the chat the request came from
    shown = cli("approvals", "show", str(o.id), "--config", str(p)).stdout
    assert "Pizza?" in shown and "1. \"yes\"" in shown
