"""People and approvals on a real daemon (`mdclaw run` in a subprocess, no container
engine), with a fake Telegram Bot API (tests/fake_telegram.py: callback queries, inline
keyboards, answerCallbackQuery, editMessageText), the local web chat, and a fake Home
Assistant (tests/fake_home_assistant.py). The agent is scripted: the test writes its action
files into ipc/main/actions/ and reads action_results/, as the agent runner's tools do."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO
from fake_home_assistant import FakeHomeAssistant, state
from fake_telegram import TOKEN as TG_TOKEN
from fake_telegram import FakeBotApi, ThreadedFake
from mcp_helpers import git_repo, servers_bin
from operator_helpers import free_ports, running_daemon
from waiting import wait_until

HA_TOKEN = "hatoken-approvals-SECRET"
OWNER, SECOND, STRANGER = 111, 222, 999
FAMILY = -500


def wait(cond: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    return wait_until(cond, timeout, what=what, interval=0.05)


class Setup:
    """The fakes, the config and the scripted agent of one test."""

    def __init__(self, tmp_path: Path, fakes: ThreadedFake, tg: FakeBotApi,
                 ha: FakeHomeAssistant, extra: str, main_extra: str = "") -> None:
        self.tmp, self.fakes, self.tg, self.ha = tmp_path, fakes, tg, ha
        self.data = tmp_path / "data"
        self.port, = free_ports(1)
        tg_token = tmp_path / "tg-token"
        tg_token.write_text(TG_TOKEN)
        tg_token.chmod(0o600)
        ha_token = tmp_path / "ha-token"
        ha_token.write_text(HA_TOKEN)
        ha_token.chmod(0o600)
        self.config = tmp_path / "config.yaml"
        self.config.write_text(f"""\
data_dir: {self.data}
assistant: {{name: Andy, timezone: UTC}}
server: {{listen: "127.0.0.1:{self.port}"}}
limits: {{ipc_poll_interval: 200ms}}
channels:
  http: {{enabled: true}}
  telegram: {{token_file: {tg_token}, api_base: "{fakes.urls['tg']}"}}
integrations:
  home_assistant:
    url: "{fakes.urls['ha']}"
    token_file: {ha_token}
    allow: {{services: ["lock.*"], entities: ["lock.*"]}}
people:
  alex: {{name: Alex, role: owner, identities: {{telegram: ["{OWNER}"], http: [alex]}}}}
  bob: {{name: Bob, role: owner, identities: {{telegram: ["{SECOND}"]}}}}
  carol: {{name: Carol, role: admin, identities: {{http: [carol]}}}}
groups:
  main: {{name: Admin, jid: "tg:{OWNER}", main: true{main_extra}}}
  family: {{name: Family, jid: "tg:{FAMILY}", members: [alex, bob],
            unknown_senders: ask_owner}}
  web: {{name: Web, jid: "hl:web"}}
{extra}""")
        self.n = 0

    # ------------------------------------------------------------------ the scripted agent
    def ask(self, action: str, params: dict[str, Any], *, name: str | None = None,
            rid: str | None = None) -> tuple[str, str]:
        """Write an action request as the agent runner does; returns (requestId, file)."""
        self.n += 1
        rid = rid or f"req-{self.n}"
        d = self.data / "ipc" / "main" / "actions"
        name = name or f"{int(time.time() * 1000)}-{self.n}.json"
        tmp = d / f".{name}.tmp"
        tmp.write_text(json.dumps({"type": "action", "requestId": rid, "action": action,
                                   "params": params}))
        os.rename(tmp, d / name)
        return rid, name

    def write(self, sub: str, body: dict[str, Any]) -> None:
        self.n += 1
        d = self.data / "ipc" / "main" / sub
        d.mkdir(exist_ok=True)  # groups/ is the agent's to make
        tmp = d / f".c{self.n}.tmp"
        tmp.write_text(json.dumps(body))
        os.rename(tmp, d / f"{int(time.time() * 1000)}-c{self.n}.json")

    def result(self, rid: str) -> dict[str, Any] | None:
        p = self.data / "ipc" / "main" / "action_results" / f"{rid}.json"
        try:
            return json.loads(p.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def final(self, rid: str, timeout: float = 60.0) -> dict[str, Any]:
        return wait(lambda: (r := self.result(rid)) and r["status"] != "pending_approval"
                    and r, f"the final result of {rid}", timeout)

    # ------------------------------------------------------------------ people
    def card(self, chat: int, n: int = 1) -> tuple[int, dict[str, Any]]:
        """The `n`-th card with a keyboard the bot sent to `chat` (waits for it)."""
        got = wait(lambda: len(self.tg.keyboards(chat)) >= n and self.tg.keyboards(chat),
                   f"card {n} in chat {chat}")
        return got[n - 1]

    def card_ids(self, chat: int) -> list[int]:
        """The ids of every card message sent to `chat` (with or without keyboard now)."""
        return [mid for (cid, mid), m in self.tg.sent()
                if cid == chat and (m["reply_markup"] or m["edits"])]

    def press(self, who: int, chat: int, message_id: int, data: str) -> str:
        return str(self.fakes.call(self.tg.push_press, from_id=who, chat_id=chat,
                                   message_id=message_id, data=data))

    def say(self, who: int, chat: int, text: str) -> None:
        self.n += 1
        msg = {"message_id": 10_000 + self.n, "date": int(time.time()),
               "chat": {"id": chat, "type": "private" if chat > 0 else "group"},
               "from": {"id": who, "is_bot": False, "first_name": f"user{who}"}, "text": text}
        self.fakes.call(self.tg.push, msg)

    def answered(self, qid: str) -> dict[str, Any]:
        return wait(lambda: self.tg.answered.get(qid), f"the answer to {qid}")

    def sent_to(self, chat: int) -> list[str]:
        return [p["text"] for p in self.tg.of("sendMessage") if int(p["chat_id"]) == chat]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
        env["PYTHONPATH"] = str(REPO)
        return subprocess.run([sys.executable, "-m", "mdclaw", *args, "--config",
                               str(self.config)], capture_output=True, text=True, env=env,
                              timeout=60)

    def approvals(self, *args: str) -> list[dict[str, Any]]:
        r = self.cli("approvals", "list", "--json", *args)
        assert r.returncode == 0, r.stderr
        return list(reversed(json.loads(r.stdout)))

    def unlock_calls(self) -> list[str]:
        return [c[2].get("entity_id") for c in list(self.ha.calls) if c[:2] == ("lock", "unlock")]

    @contextmanager
    def daemon(self) -> Iterator[subprocess.Popen[str]]:
        with running_daemon(self.config, self.port) as proc:
            wait(lambda: self.tg.of("getMe"), "the daemon's Telegram channel")
            yield proc


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Callable[..., Setup]]:
    made: list[ThreadedFake] = []

    def make(extra: str = "", main_extra: str = "") -> Setup:
        tg = FakeBotApi()
        ha = FakeHomeAssistant(HA_TOKEN)
        for door in ("front_door", "back_door"):
            ha.states[f"lock.{door}"] = state(f"lock.{door}", "locked")
        fakes = ThreadedFake(tg=tg, ha=ha.app)
        fakes.__enter__()
        made.append(fakes)
        return Setup(tmp_path, fakes, tg, ha, extra, main_extra)

    yield make
    for f in made:
        f.__exit__(None, None, None)


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True, timeout=30).stdout


UNLOCK = {"domain": "lock", "service": "unlock", "target": {"entity_id": "lock.front_door"}}


def test_approve_on_telegram_runs_exactly_one_call_deny_runs_none(setup) -> None:
    s = setup()
    with s.daemon():
        rid, _ = s.ask("ha_call_service", UNLOCK)
        interim = wait(lambda: s.result(rid), "the interim result")
        assert interim["status"] == "pending_approval" and interim["approver"] == "owner"
        mid, card = s.card(OWNER)  # the owner's private chat with the bot
        assert "ha_call_service" in card["text"] and '"lock.front_door"' in card["text"]
        assert "Admin (main)" in card["text"] and "defaults[0]" in card["text"]
        assert [b["text"] for b in card["reply_markup"]["inline_keyboard"][0]] == \
            ["Approve", "Deny"]
        assert len(s.tg.keyboards(SECOND)) == 1  # the other owner got a card too
        time.sleep(0.5)
        assert s.unlock_calls() == []  # it waits
        data = card["reply_markup"]["inline_keyboard"][0][0]["callback_data"]
        qid = s.press(OWNER, OWNER, mid, data)
        assert s.answered(qid)["text"].startswith("Approved #")
        done = s.final(rid)
        assert done["status"] == "success", done
        assert s.unlock_calls() == ["lock.front_door"]
        # every card now shows the outcome and who decided, without buttons
        wait(lambda: s.tg.keyboards(OWNER) == [] and s.tg.keyboards(SECOND) == [],
             "the cards edited")
        assert "Approved" in s.tg.messages[(OWNER, mid)]["text"]
        assert "by Alex (owner)" in s.tg.messages[(OWNER, mid)]["text"]
        # pressing again changes nothing
        again = s.press(OWNER, OWNER, mid, data)
        assert "already" in s.answered(again)["text"]

        rid2, _ = s.ask("ha_call_service", UNLOCK)
        mid2, card2 = s.card(OWNER)
        deny = card2["reply_markup"]["inline_keyboard"][0][1]["callback_data"]
        qid2 = s.press(OWNER, OWNER, mid2, deny)
        assert s.answered(qid2)["text"].startswith("Denied #")
        denied = s.final(rid2)
        assert denied["status"] == "error" and "denied by Alex (owner)" in denied["error"]
        time.sleep(0.5)
        assert s.unlock_calls() == ["lock.front_door"]  # still the one approved call
        audit = s.approvals()
        assert [(a["status"], a["decided_by"], a["decided_via"]) for a in audit] == \
            [("approved", "alex", "telegram"), ("denied", "alex", "telegram")]
        assert all(a["settled_at"] and a["seconds_to_decide"] is not None for a in audit)


def test_no_answer_in_time_is_a_denial_and_the_card_says_so(setup) -> None:
    s = setup("approvals: {timeout: 2s}\n")
    with s.daemon():
        rid, _ = s.ask("ha_call_service", UNLOCK)
        mid, _card = s.card(OWNER)
        expired = s.final(rid)
        assert expired["status"] == "error" and "nobody answered in time" in expired["error"]
        wait(lambda: "Expired" in s.tg.messages[(OWNER, mid)]["text"], "the card edited")
        assert s.tg.keyboards(OWNER) == []
        assert s.unlock_calls() == []
        (a,) = s.approvals()
        assert a["status"] == "expired" and a["decided_via"] == "timeout"


def test_a_restart_while_pending_then_approve_runs_it_once(setup) -> None:
    s = setup()
    with s.daemon() as proc:
        rid, _ = s.ask("ha_call_service", UNLOCK)
        mid, card = s.card(OWNER)
        proc.kill()  # kill -9 while the approval waits
        proc.wait()
    with s.daemon():
        data = card["reply_markup"]["inline_keyboard"][0][0]["callback_data"]
        qid = s.press(OWNER, OWNER, mid, data)
        assert s.answered(qid)["text"].startswith("Approved #")
        assert s.final(rid)["status"] == "success"
        time.sleep(0.5)
    # approved by the operator while no daemon runs: the next start carries it out once
    with s.daemon() as proc:
        rid2, _ = s.ask("ha_call_service", UNLOCK)
        s.card(OWNER, 1)
        wait(lambda: len(s.approvals()) == 2, "the second approval")
        proc.kill()
        proc.wait()
    second = s.approvals()[1]["id"]
    r = s.cli("approvals", "approve", str(second), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["decided_by"].startswith("cli:")
    with s.daemon():
        assert s.final(rid2)["status"] == "success"
        time.sleep(0.5)
    assert s.unlock_calls() == ["lock.front_door", "lock.front_door"]
    assert [a["status"] for a in s.approvals()] == ["approved", "approved"]
    # a held command (main's message into the family chat): approved, then kill -9 right
    # away, over and over: it is sent exactly once
    with s.daemon() as proc:
        s.write("messages", {"type": "message", "chat_jid": f"tg:{FAMILY}",
                             "text": "dinner at eight"})
        wait(lambda: len(s.approvals()) == 3, "the message waits")
        # (a card of #2 sent just before the kill may still show its buttons: the outbox
        # sends at least once; pressing it says "approved already")
        mid3, card3 = wait(lambda: next((k for k in s.tg.keyboards(OWNER)
                                         if "dinner at eight" in k[1]["text"]), None),
                           "the message's card")
        assert f"tg:{FAMILY}" in card3["text"]
        assert s.sent_to(FAMILY) == []
        s.press(OWNER, OWNER, mid3, card3["reply_markup"]["inline_keyboard"][0][0]
                ["callback_data"])
        wait(lambda: s.approvals()[2]["status"] == "approved", "the decision recorded")
        proc.kill()
        proc.wait()
    for _ in range(2):
        with s.daemon() as proc:
            wait(lambda: s.approvals()[2]["settled_at"], "settled after the restart")
            proc.kill()
            proc.wait()
    with s.daemon():
        wait(lambda: "dinner at eight" in s.sent_to(FAMILY), "the message sent")
    # applied once: one outbox row (its delivery is the outbox's at-least-once, invariant 4)
    db = sqlite3.connect(s.data / "state.db")
    try:
        rows = db.execute("SELECT chat_jid FROM outbox WHERE text = 'dinner at eight'").fetchall()
    finally:
        db.close()
    assert rows == [(f"tg:{FAMILY}",)]
    assert s.approvals()[2]["outcome"] == "applied"


def test_two_approvers_within_the_same_second_one_decision_wins(setup) -> None:
    s = setup()
    with s.daemon():
        for round_ in range(3):
            rid, _ = s.ask("ha_call_service", UNLOCK)
            mid_a, card_a = s.card(OWNER)
            mid_b, card_b = s.card(SECOND)
            approve = card_a["reply_markup"]["inline_keyboard"][0][0]["callback_data"]
            deny = card_b["reply_markup"]["inline_keyboard"][0][1]["callback_data"]
            q1 = s.press(OWNER, OWNER, mid_a, approve)
            q2 = s.press(SECOND, SECOND, mid_b, deny)
            answers = [s.answered(q1)["text"], s.answered(q2)["text"]]
            assert sum(a.startswith(("Approved #", "Denied #")) for a in answers) == 1, answers
            assert sum("already" in a for a in answers) == 1, answers
            result = s.final(rid)
            won = s.approvals()[round_]
            assert won["status"] in ("approved", "denied")
            assert (result["status"] == "success") == (won["status"] == "approved")
            wait(lambda: not s.tg.keyboards(OWNER) and not s.tg.keyboards(SECOND),
                 "both cards edited")
        expected = sum(a["status"] == "approved" for a in s.approvals())
        time.sleep(0.5)
        assert len(s.unlock_calls()) == expected


def test_the_agent_cannot_approve_itself(setup) -> None:
    s = setup()
    with s.daemon():
        rid, _ = s.ask("ha_call_service", UNLOCK)
        mid, card = s.card(OWNER)
        (a,) = s.approvals()
        shown = s.cli("approvals", "show", str(a["id"]), "--json")
        assert "codes" not in json.loads(shown.stdout)  # the CLI never prints codes
        # 1. IPC files of decision-like types, in every folder of its own
        for sub in ("messages", "tasks", "groups", "actions"):
            for t in ("approve", "approval", "decide", "answer"):
                s.write(sub, {"type": t, "id": a["id"], "decision": "approve"})
        # 2. its own message "approve <code>" into the owner's chat: out, never back in
        for code in ("0000", "7KQ2", "ZZZZ"):
            s.write("messages", {"type": "message", "text": f"approve {code}"})
        wait(lambda: len([t for t in s.sent_to(OWNER) if t.startswith("approve ")]) == 3,
             "the agent's messages delivered")
        # 3. the buttons' data pressed by someone who is no approver (a stranger in a group)
        q = s.press(STRANGER, OWNER, mid, card["reply_markup"]["inline_keyboard"][0][0]
                    ["callback_data"])
        assert "Only the people" in s.answered(q)["text"]
        errors = s.data / "ipc" / "errors"
        wait(lambda: len(list(errors.glob("main.*.error.json"))) == 16, "16 quarantined")
        time.sleep(1.0)
        assert s.approvals()[0]["status"] == "pending"
        assert s.unlock_calls() == [] and s.result(rid)["status"] == "pending_approval"
        # 4. guessed codes: five wrong ones from the owner's identity lock the codes
        for guess in ("AAAA", "BBBB", "CCCC", "DDDD", "EEEE"):
            s.say(OWNER, OWNER, f"approve {guess}")
        wait(lambda: any("locked" in t for t in s.sent_to(OWNER)), "the lock announced")
        assert s.approvals()[0]["codes_locked"]
        assert s.approvals()[0]["status"] == "pending"
        # the owner's button still decides (the identity is the channel's, not a code)
        qid = s.press(OWNER, OWNER, mid, card["reply_markup"]["inline_keyboard"][0][1]
                      ["callback_data"])
        assert s.answered(qid)["text"].startswith("Denied #")
        assert s.final(rid)["status"] == "error"
    db = json.loads(s.cli("approvals", "list", "--json").stdout)
    assert db[0]["decided_by"] == "alex"


def test_hostile_arguments_show_escaped_and_a_rewritten_file_changes_nothing(setup) -> None:
    s = setup()
    with s.daemon():
        hostile = {"domain": "lock", "service": "unlock",
                   "target": {"entity_id": "lock.front_door"},
                   "data": {"code": "\x1b[8m1234\x1b[0m \u202eedoc\u2066 " + "x" * 400}}
        rid, name = s.ask("ha_call_service", hostile)
        mid, card = s.card(OWNER)
        text = card["text"]
        for raw in ("\x1b", "\u202e", "\u2066"):
            assert raw not in text
        assert "\\x1b[8m1234\\x1b[0m \\u202eedoc\\u2066" in text
        assert "…" in text and "x" * 400 not in text
        labels = [b["text"] for row in card["reply_markup"]["inline_keyboard"] for b in row]
        assert labels == ["Approve", "Deny", "Show all"]
        show = card["reply_markup"]["inline_keyboard"][1][0]["callback_data"]
        s.answered(s.press(OWNER, OWNER, mid, show))
        wait(lambda: any("x" * 400 in t for t in s.sent_to(OWNER)), "the whole request")
        # the agent rewrites its request file (same name) and writes another for the back
        # door under the same requestId: neither changes what the approval runs
        time.sleep(0.3)
        back = dict(hostile, target={"entity_id": "lock.back_door"})
        s.ask("ha_call_service", back, name=name, rid=rid)
        s.ask("ha_call_service", back, rid=rid)
        errors = s.data / "ipc" / "errors"
        wait(lambda: len(list(errors.glob("main.*.error.json"))) == 2, "both refused")
        qid = s.press(OWNER, OWNER, mid, card["reply_markup"]["inline_keyboard"][0][0]
                      ["callback_data"])
        s.answered(qid)
        assert s.final(rid)["status"] == "success"
        time.sleep(0.5)
        assert s.unlock_calls() == ["lock.front_door"]
        (call,) = [c for c in s.ha.calls if c[:2] == ("lock", "unlock")]
        assert call[2]["code"].startswith("\x1b[8m1234")  # what ran is what was stored


def test_the_web_chat_shows_cards_with_buttons(setup) -> None:
    s = setup("approvals:\n  rules:\n    - match: {action: ha_call_service}\n"
              "      approver: carol\n")
    base = f"http://127.0.0.1:{s.port}"

    def get(path: str) -> dict[str, Any]:
        with urllib.request.urlopen(base + path, timeout=10) as r:
            return json.load(r)

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)

    with s.daemon():
        rid, _ = s.ask("ha_call_service", UNLOCK)
        rows = wait(lambda: [m for m in get("/messages?jid=hl:carol")["messages"]
                             if m.get("card")], "the card in Carol's web chat")
        (card,) = rows
        assert card["html"] is None and "lock.front_door" in card["content"]
        assert [c["label"] for c in card["card"]["choices"]] == ["Approve", "Deny"]
        approve = card["card"]["choices"][0]["data"]
        # a press under another name is no approver's
        assert "Only the people" in post("/card", {"jid": "hl:carol", "id": card["id"],
                                                   "data": approve,
                                                   "sender_name": "mallory"})["answer"]
        got = post("/card", {"jid": "hl:carol", "id": card["id"], "data": approve,
                             "sender_name": "carol"})
        assert got["answer"].startswith("Approved #")
        assert s.final(rid)["status"] == "success"
        after = wait(lambda: [m for m in get("/messages?jid=hl:carol")["messages"]
                              if m["card"] and m["card"]["state"] == "closed"
                              and m["content"].startswith("Approved")], "the outcome")
        assert "by Carol (admin)" in after[0]["content"]
        first = [m for m in get("/messages?jid=hl:carol")["messages"] if m["id"] == card["id"]]
        assert first[0]["card"]["state"] == "closed" and first[0]["card"]["choices"] == []
        time.sleep(0.3)
        assert s.unlock_calls() == ["lock.front_door"]


def test_an_unknown_sender_is_admitted_through_the_owners_card_and_can_then_talk(
        setup) -> None:
    s = setup()
    with s.daemon():
        s.say(STRANGER, FAMILY, "just saying hello")  # not addressed: no card, not stored
        s.say(STRANGER, FAMILY, "@Andy can you help me?")
        s.say(STRANGER, FAMILY, "@Andy hello??")  # one card per sender while it waits
        mid, card = s.card(OWNER)
        assert "wants to talk" in card["text"] or "Someone wants to talk" in card["text"]
        assert "Telegram 999" in card["text"] and "can you help me?" in card["text"]
        labels = [b["text"] for b in card["reply_markup"]["inline_keyboard"][0]]
        assert labels == ["Admit", "Ignore"]
        time.sleep(0.5)
        assert len(s.tg.keyboards(OWNER)) == 1 and s.sent_to(FAMILY) == []
        qid = s.press(OWNER, OWNER, mid, card["reply_markup"]["inline_keyboard"][0][0]
                      ["callback_data"])
        assert s.answered(qid)["text"].startswith("Admitted #")
        # the held message is answered (here: no model is configured, said at once)
        wait(lambda: s.sent_to(FAMILY), "an answer in the family chat")
        people = json.loads(s.cli("people", "list", "--json").stdout)
        (admitted,) = people["admitted"]
        assert (admitted["channel"], admitted["sender"], admitted["group_folder"],
                admitted["admitted_by"]) == ("telegram", str(STRANGER), "family", "alex")
        n = len(s.sent_to(FAMILY))
        # At once, in the second of the admission (Telegram dates in whole seconds): the
        # cursor is the host's sequence (invariant 11), so the admitted message stored at
        # the admission cannot hide the next one.
        s.say(STRANGER, FAMILY, "@Andy and now?")
        wait(lambda: len(s.sent_to(FAMILY)) > n, "the admitted sender answered again")


def test_a_main_group_that_requires_a_trigger_and_passing_mentions(setup) -> None:
    s = setup()
    s.config.write_text(s.config.read_text().replace(
        f'main: {{name: Admin, jid: "tg:{OWNER}", main: true}}',
        f'main: {{name: Admin, jid: "tg:{OWNER}", main: true, requires_trigger: true}}'))
    with s.daemon():
        for text in ("good morning", "I told andy yesterday", "andy's bike is fixed"):
            s.say(OWNER, OWNER, text)
        time.sleep(1.5)
        assert s.sent_to(OWNER) == []  # nothing woke the agent
        s.say(OWNER, OWNER, "Andy, are you there?")
        wait(lambda: s.sent_to(OWNER), "the addressed message answered")
        s.say(SECOND, FAMILY, "I told andy yesterday")  # a member, a passing mention
        time.sleep(1.0)
        assert s.sent_to(FAMILY) == []


def test_the_operator_page_decides_and_metrics_count(setup) -> None:
    s = setup()
    base = f"http://127.0.0.1:{s.port}"

    def call(path: str, body: dict[str, Any] | None = None,
             headers: dict[str, str] | None = None) -> Any:
        req = urllib.request.Request(
            base + path, data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})})
        with urllib.request.urlopen(req, timeout=10) as r:
            raw = r.read()
            return json.loads(raw) if r.headers.get_content_type() == "application/json" \
                else raw.decode()

    def metric(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{") and \
                    line.split(" ")[0] == name:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    with s.daemon():
        rid, _ = s.ask("ha_call_service", UNLOCK)
        page = wait(lambda: (a := call("/operator/api/approvals"))["pending"] and a,
                    "the page lists it")
        (p,) = page["pending"]
        assert p["kind"] == "action" and p["status"] == "pending"
        assert 'target.entity_id: "lock.front_door"' in "\n".join(p["shown"])
        assert [r["source"] for r in page["rules"]["main"]][0] == "defaults[0]"
        text = call("/metrics")
        assert metric(text, 'mdclaw_approvals_pending{kind="action"}') == 1
        assert metric(text, 'mdclaw_action_jobs{action="ha_call_service",status='
                            '"awaiting_approval"}') == 1
        csrf = call("/operator/api/session")["csrf"]
        done = call(f"/operator/api/approvals/{p['id']}/approve", {},
                    {"X-CSRF-Token": csrf, "Origin": base})
        assert done["status"] == "approved" and done["decided_by"] == "page"
        assert s.final(rid)["status"] == "success"
        wait(lambda: "Approved" in s.tg.messages[(OWNER, s.card_ids(OWNER)[0])]["text"],
             "the card edited after the page's decision")
        text = wait(lambda: (t := call("/metrics")) and metric(
            t, 'mdclaw_approvals_decided_total{kind="action",outcome="approved"}') == 1 and t,
            "the decision counted")
        assert metric(text, 'mdclaw_approvals_pending{kind="action"}') == 0
        assert metric(text, 'mdclaw_approval_decide_seconds_count{outcome="approved"}') == 1
        after = call("/operator/api/approvals")
        assert after["pending"] == [] and after["recent"][0]["decided_label"] == \
            "the operator (operator page)"
    assert s.unlock_calls() == ["lock.front_door"]


def test_mcp_calls_that_write_wait_for_the_owner_read_only_ones_do_not(setup, tmp_path) -> None:
    """Real MCP servers (mcp-server-time, mcp-server-git) under a real daemon: a tool whose
    annotations say read-only, and one an `approver: none` rule names, run unasked; a write
    (git_commit) waits for the owner's card, runs exactly once when approved (one commit),
    and not at all when denied (the result names who denied)."""
    bin_dir = servers_bin()
    repo = git_repo(tmp_path / "repo")
    s = setup(f"""\
mcp_servers:
  time: {{command: "{bin_dir / 'mcp-server-time'}", args: [--local-timezone, UTC]}}
  git: {{command: "{bin_dir / 'mcp-server-git'}", args: [--repository, "{repo}"]}}
approvals:
  rules:
    - match: {{action: mcp_call, args: {{server: git, tool: git_add}}}}
      approver: none
""", main_extra=", mcp: {time: ['*'], git: ['*']}")

    def commits() -> list[str]:
        return git(repo, "log", "--format=%s").splitlines()

    def offered() -> set[str]:
        try:
            body = json.loads((s.data / "ipc" / "main" / "mcp_tools.json").read_text())
        except (OSError, ValueError):
            return set()
        return {t["name"] for t in body["tools"]}

    with s.daemon():
        wait(lambda: {"time__get_current_time", "git__git_commit", "git__git_add"}
             <= offered(), "both servers' tools offered")
        # read-only (readOnlyHint: true): no card, the answer at once
        rid, _ = s.ask("mcp_call", {"server": "time", "tool": "get_current_time",
                                    "arguments": {"timezone": "Asia/Tokyo"}})
        got = s.final(rid)
        assert got["status"] == "success" and "Asia/Tokyo" in json.dumps(got["result"]), got
        # a write an `approver: none` rule names: no card either
        rid, _ = s.ask("mcp_call", {"server": "git", "tool": "git_add",
                                    "arguments": {"repo_path": str(repo),
                                                  "files": ["notes.txt"]}})
        got = s.final(rid)
        assert got["status"] == "success", got
        assert git(repo, "diff", "--cached", "--name-only").split() == ["notes.txt"]
        assert s.approvals() == [] and s.tg.keyboards(OWNER) == []

        # a write no rule matched: held for the owner, by its annotations
        message = "water the beans\x1b[2J\u202e"
        rid, _ = s.ask("mcp_call", {"server": "git", "tool": "git_commit",
                                    "arguments": {"repo_path": str(repo),
                                                  "message": message}})
        interim = wait(lambda: s.result(rid), "the interim result")
        assert interim["status"] == "pending_approval" and interim["approver"] == "owner"
        mid, card = s.card(OWNER)
        text = card["text"]
        assert "MCP tool git_commit of server git (mcp_call), with:" in text, text
        assert f'  repo_path: "{repo}"' in text, text
        assert '  message: "water the beans\\x1b[2J\\u202e"' in text, text  # escaped
        assert "\x1b" not in text and "\u202e" not in text
        assert "Rule: mcp_servers.git: tool annotations (not read-only)" in text, text
        assert commits() == ["first notes"]  # it waits
        approve = card["reply_markup"]["inline_keyboard"][0][0]["callback_data"]
        assert s.answered(s.press(OWNER, OWNER, mid, approve))["text"].startswith("Approved #")
        done = s.final(rid)
        assert done["status"] == "success" and not done["result"]["isError"], done
        assert commits() == [message, "first notes"]  # the server saw one call
        wait(lambda: s.tg.keyboards(OWNER) == [] and s.tg.keyboards(SECOND) == [],
             "the cards edited")
        assert "git__git_commit" in s.tg.messages[(OWNER, mid)]["text"]

        # denied: the server sees no call, the agent is told who denied
        (repo / "notes.txt").write_text("plant the beans\nwater them\npick them\n")
        git(repo, "add", "notes.txt")
        rid2, _ = s.ask("mcp_call", {"server": "git", "tool": "git_commit",
                                     "arguments": {"repo_path": str(repo),
                                                   "message": "pick the beans"}})
        mid2, card2 = s.card(OWNER)
        assert "pick the beans" in card2["text"]
        deny = card2["reply_markup"]["inline_keyboard"][0][1]["callback_data"]
        assert s.answered(s.press(OWNER, OWNER, mid2, deny))["text"].startswith("Denied #")
        denied = s.final(rid2)
        assert denied["status"] == "error" and "denied by Alex (owner)" in denied["error"]
        assert "mcp_call" in denied["error"]
        assert commits() == [message, "first notes"]
        assert git(repo, "diff", "--cached", "--name-only").split() == ["notes.txt"]
        audit = s.approvals()
        assert [(a["status"], a["decided_by"]) for a in audit] == \
            [("approved", "alex"), ("denied", "alex")]
        assert all("mcp_servers.git: tool annotations" in (a.get("rule") or "")
                   for a in audit), audit
