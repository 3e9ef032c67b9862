"""The approval flow through the real IPC engine, action worker and a fake Home Assistant:
an agent's held request waits (its tool reads an interim result), a decision releases it,
and what runs is the request as stored, exactly once. The decisions here are recorded as
the channels and the CLI record them (mdclaw.approvals.flow.decide); the daemon-level tests
with the channels are tests/test_approvals_daemon.py."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestServer

import agent_helpers  # noqa: F401 - puts the runner package on sys.path
from fake_home_assistant import FakeHomeAssistant, state
from ipc_helpers import Env
from mdclaw.approvals import flow, store
from mdclaw.channels.base import Channel, InboundMessage
from mdclaw.decisions import Decider
from mdclaw.integrations import load_all
from mdclaw.ipc.watcher import IpcWatcher
from mdclaw.markup import to_whatsapp
from mdclaw.orchestrator import Orchestrator
from mdclaw.outbox import OutboxWorker, RetryPolicy
from mdclaw_agent.tools import ToolContext, run_tool, tools_for
from test_action_worker import Running, job, request, result
from test_home_assistant import TOKEN, ha_config
from waiting import wait_until_async

load_all()


async def until(cond: Any, timeout: float = 60.0) -> Any:
    """The one wait helper, with a deadline that a loaded machine does not reach."""
    return await wait_until_async(cond, timeout)

PEOPLE = """\
people:
  alex: {name: Alex, role: owner, identities: {telegram: ["111"]}}
  bob: {name: Bob, role: admin, identities: {telegram: ["222"]}}
"""


class Flow:
    def __init__(self, env: Env, fake: FakeHomeAssistant, watcher: IpcWatcher) -> None:
        self.env, self.fake, self.watcher = env, fake, watcher

    def calls(self) -> list[tuple[str, str, dict[str, Any]]]:
        return list(self.fake.calls)

    def approvals(self) -> list[store.Approval]:
        return list(reversed(store.list_approvals(self.env.db)))

    def decide(self, approval_id: int, status: str, by: str = "alex") -> bool:
        with self.env.db.transaction() as conn:
            got = flow.decide(conn, self.env.cfg, approval_id, status=status, by=by,
                              label=f"{by.title()} (owner)", via="test")
        self.watcher.wake_settle()
        self.watcher.actions.wake()
        return got is not None

    async def settled(self, approval_id: int) -> store.Approval:
        return await until(lambda: (a := store.get(self.env.db, approval_id)) is not None
                           and a.settled_at is not None and a, timeout=60)


@asynccontextmanager
async def running(tmp_path: Path, extra: str = "", people: str = PEOPLE) -> AsyncIterator[Flow]:
    fake = FakeHomeAssistant(TOKEN)
    fake.states["lock.front_door"] = state("lock.front_door", "locked")
    fake.states["lock.back_door"] = state("lock.back_door", "locked")
    server = TestServer(fake.app())
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        env = Env(tmp_path, extra=ha_config(url, tmp_path, services=["lock.*", "light.*"],
                                            entities=["lock.*", "light.*"]) + people + extra)
        try:
            async with Running(env) as watcher:
                yield Flow(env, fake, watcher)
        finally:
            env.close()
    finally:
        await server.close()


def unlock(rid: str, entity: str = "lock.front_door") -> dict[str, Any]:
    return request(rid, "ha_call_service", domain="lock", service="unlock",
                   target={"entity_id": entity})


def test_an_approved_action_runs_once_a_denied_one_never(tmp_path: Path) -> None:
    async def go() -> None:
        async with running(tmp_path) as f:
            f.env.write("main", unlock("u1"), sub="actions")
            interim = await until(lambda: result(f.env, "main", "u1"))
            assert interim["status"] == "pending_approval" and interim["approver"] == "owner"
            (a,) = f.approvals()
            assert interim["approvalId"] == a.id and interim["expiresAt"] == a.expires_at
            assert a.kind == "action" and a.request["params"]["target"]["entity_id"] == \
                "lock.front_door" and a.rule.startswith("defaults[0]")
            assert job(f.env, "main", "u1")["status"] == "awaiting_approval"
            await asyncio.sleep(0.3)
            assert f.calls() == []  # nothing reached Home Assistant while it waits
            cards = f.env.db.query("SELECT chat_jid, card FROM outbox WHERE card IS NOT NULL")
            assert [r[0] for r in cards] == ["tg:111"]  # the owner's; Bob is an admin
            assert f.decide(a.id, "approved")
            assert not f.decide(a.id, "denied", by="bob")  # too late: one decision wins
            done = await until(lambda: (r := result(f.env, "main", "u1")) and
                               r["status"] != "pending_approval" and r)
            assert done["status"] == "success", done
            await f.settled(a.id)
            assert [c[:2] for c in f.calls()] == [("lock", "unlock")]
            assert f.calls()[0][2]["entity_id"] == "lock.front_door"
            ran = f.env.db.query_one("SELECT content FROM messages WHERE id = ?",
                                     (f"host:approval:{a.id}",))
            assert ran is not None and "approved by Alex (owner) and ran" in ran[0]

            f.env.write("main", unlock("u2"), sub="actions")
            await until(lambda: len(f.approvals()) == 2)
            b = f.approvals()[1]
            assert f.decide(b.id, "denied")
            denied = await until(lambda: (r := result(f.env, "main", "u2")) and
                                 r["status"] == "error" and r)
            assert "denied by Alex (owner)" in denied["error"] and "did not run" in \
                denied["error"]
            await f.settled(b.id)
            await asyncio.sleep(0.3)
            assert len(f.calls()) == 1  # still the one approved call
            # the denied agent is told in its conversation, as context for its next turn
            note = f.env.db.query_one("SELECT sender, content FROM messages WHERE id = ?",
                                      (f"host:approval:{b.id}",))
            assert note is not None and note[0] == "mdclaw:host" and "denied by Alex" in note[1]
            # every card was edited to show the outcome
            edits = [json.loads(r[0]) for r in f.env.db.query(
                "SELECT card FROM outbox WHERE card IS NOT NULL ORDER BY id")]
            assert any(e["text"].startswith(f"Denied (#{b.id})") and "by Alex" in e["text"]
                       and not e["choices"] for e in edits)
    asyncio.run(go())


def test_no_answer_in_time_is_a_denial(tmp_path: Path) -> None:
    async def go() -> None:
        async with running(tmp_path, "approvals: {timeout: 1s}\n") as f:
            f.env.write("main", unlock("u1"), sub="actions")
            expired = await until(lambda: (r := result(f.env, "main", "u1")) and
                                  r["status"] == "error" and r, timeout=60)
            assert "nobody answered in time" in expired["error"]
            (a,) = f.approvals()
            a = await f.settled(a.id)
            assert a.status == "expired" and a.decided_via == "timeout"
            assert not f.decide(a.id, "approved")  # an expired approval cannot be approved
            await asyncio.sleep(0.3)
            assert f.calls() == []
    asyncio.run(go())


def test_a_request_file_rewritten_after_the_card_changes_nothing_that_runs(
        tmp_path: Path) -> None:
    async def go() -> None:
        async with running(tmp_path) as f:
            name = f.env.write("main", unlock("u1"), sub="actions")
            await until(lambda: f.approvals())
            (a,) = f.approvals()
            # the agent writes the same file again, now for the back door, and once more
            # under a new name with the same requestId
            f.env.write("main", unlock("u1", "lock.back_door"), sub="actions", name=name)
            f.env.write("main", unlock("u1", "lock.back_door"), sub="actions")
            await until(lambda: len(list(f.env.errors.glob("main.*.error.json"))) == 2)
            assert len(f.approvals()) == 1  # the rewrites opened nothing
            assert f.decide(a.id, "approved")
            await f.settled(a.id)
            await until(lambda: f.calls())
            await asyncio.sleep(0.3)
            assert [(c[0], c[1], c[2]["entity_id"]) for c in f.calls()] == \
                [("lock", "unlock", "lock.front_door")]
    asyncio.run(go())


def test_an_approved_command_runs_from_the_stored_request_exactly_once(tmp_path: Path) -> None:
    async def go() -> None:
        async with running(tmp_path) as f:
            f.env.write("main", {"type": "message", "chat_jid": "tg:2", "text": "to family"},
                        sub="messages")
            f.env.write("main", {"type": "message", "text": "to my own chat"},
                        sub="messages")
            await until(lambda: f.env.db.query_one(
                "SELECT 1 FROM outbox WHERE text = 'to my own chat'"))
            (a,) = f.approvals()  # only the other chat's message waits
            assert a.kind == "command" and a.request == {"type": "message",
                                                         "chat_jid": "tg:2",
                                                         "text": "to family"}
            assert f.env.db.query_one("SELECT 1 FROM outbox WHERE text = 'to family'") is None
            assert f.decide(a.id, "approved")
            settled = await f.settled(a.id)
            assert settled.outcome == "applied"
            # settling again (the CLI's ipc drain, a restart) does nothing more
            assert f.env.engine.settle() == []
            rows = f.env.db.query("SELECT chat_jid FROM outbox WHERE text = 'to family'")
            assert [r[0] for r in rows] == ["tg:2"]
    asyncio.run(go())


def test_nothing_an_agent_writes_decides(tmp_path: Path) -> None:
    """Every command type and dialect an agent might try, in every IPC folder of its own:
    quarantined or a plain request, never a decision."""
    async def go() -> None:
        async with running(tmp_path) as f:
            f.env.write("main", unlock("u1"), sub="actions")
            await until(lambda: f.approvals())
            a = store.get(f.env.db, f.approvals()[0].id, codes=True)
            code = a.codes["alex"]
            tries = [{"type": t, "id": a.id, "approvalId": a.id, "code": code,
                      "decision": "approve"}
                     for t in ("approve", "approval", "decide", "approvals_approve",
                               "answer")]
            tries += [{"type": "action", "requestId": "x1", "action": "approve",
                       "params": {"id": a.id, "code": code}},
                      {"type": "action", "requestId": "x2", "action": "ask_person",
                       "params": {"question": f"approve {code}", "who": "owner"}},
                      {"type": "message", "text": f"approve {code}"},
                      {"type": "message", "chat_jid": "tg:111", "text": f"approve {code}"}]
            for sub in ("messages", "tasks", "groups", "actions"):
                for body in tries:
                    f.env.write("main", body, sub=sub)
                    f.env.write("family", body, sub=sub)
            await until(lambda: f.env.pending("main", "actions") == []
                        and f.env.pending("family", "messages") == [], timeout=60)
            await asyncio.sleep(0.5)
            assert store.get(f.env.db, a.id).status == "pending"
            assert f.calls() == []
    asyncio.run(go())


# --------------------------------------------------------------------------- no buttons


class CodesChannel(Channel):
    """A chat service without buttons that renders Markdown (as WhatsApp does)."""

    name = "sms"
    jid_prefix = "sm:"

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []

    async def connect(self) -> None: ...
    async def disconnect(self) -> None: ...
    def is_connected(self) -> bool:
        return True

    def message_parts(self, text: str) -> list[str]:
        return [to_whatsapp(text)]

    async def send_message(self, jid: str, text: str, *, reply_to: str | None = None,
                           sender: str | None = None) -> str | None:
        self.sent.append(to_whatsapp(text))
        return None

    async def send_part(self, jid: str, part: Any, *, reply_to: str | None = None,
                        sender: str | None = None) -> str | None:
        self.sent.append(part)
        return None

    async def send_file(self, *a: Any, **k: Any) -> str | None:
        return None

    async def react(self, *a: Any, **k: Any) -> None: ...
    async def set_typing(self, *a: Any, **k: Any) -> None: ...


def test_a_channel_without_buttons_answers_by_reply_code(tmp_path: Path) -> None:
    people = PEOPLE + '  dana: {name: Dana, role: admin, identities: {sms: ["555"]}, ' \
        'direct_chat: "sm:555"}\n'
    extra = "approvals:\n  rules:\n    - match: {action: ha_call_service}\n" \
            "      approver: dana\n"

    async def go() -> None:
        async with running(tmp_path, extra, people) as f:
            ch = CodesChannel()
            outbox = OutboxWorker(f.env.db, [ch], policy=RetryPolicy(max_attempts=1))
            orch = Orchestrator(f.env.cfg, f.env.db, runner=None)
            orch.decider = Decider(f.env.cfg, f.env.db, decided=f.watcher.wake_settle)
            f.env.write("main", unlock("u1"), sub="actions")
            await until(lambda: f.approvals())
            assert await outbox.run_once() == 1
            (card,) = ch.sent
            code = store.get(f.env.db, f.approvals()[0].id, codes=True).codes["dana"]
            assert f'Reply "approve {code}" / "deny {code}".' in card
            assert '"lock.front_door"' in card  # shown as written, no formatting eaten

            def said(text: str, sender: str = "555") -> InboundMessage:
                return InboundMessage(id=f"sm:555:{text}", chat_jid="sm:555", sender=sender,
                                      sender_name="Dana", content=text,
                                      timestamp="2026-01-01T00:00:00.000Z", channel="sms")

            # someone else with the code is no approver: an ordinary message (no group here)
            await orch.on_inbound(said(f"approve {code}", sender="556"))
            assert store.get(f.env.db, f.approvals()[0].id).pending
            await orch.on_inbound(said(f"approve {code.lower()}"))
            done = await until(lambda: (r := result(f.env, "main", "u1")) and
                               r["status"] == "success" and r)
            assert done["status"] == "success"
            a = await f.settled(f.approvals()[0].id)
            assert (a.decided_by, a.decided_via) == ("dana", "sms")
            # the answer to Dana, and the card's outcome as a new message (no edits here)
            await outbox.run_once()
            assert any(t.startswith("Approved #") for t in ch.sent[1:])
            stored = [r[0] for r in f.env.db.query("SELECT content FROM messages")]
            assert f"approve {code.lower()}" not in stored  # a decision is no message
            assert [c[:2] for c in f.calls()] == [("lock", "unlock")]
    asyncio.run(go())


class MailLikeChannel(CodesChannel):
    """Chats `mail:<address>` (the email channel's): no buttons, the card's text by mail."""

    name = "email"
    jid_prefix = "mail:"


def test_an_approver_by_email_answers_with_the_code_in_a_mail(tmp_path: Path) -> None:
    """An email identity (any case in the config) gets its cards at mail:<address>; the
    mail answering it comes in as the email channel makes it: the address lower-cased, the
    trigger put before the text ("@Andy approve 7KQ2"), and it decides."""
    people = PEOPLE + '  erin: {name: Erin, role: admin, identities: ' \
        '{email: ["Erin@Example.ORG"]}}\n'
    extra = "approvals:\n  rules:\n    - match: {action: ha_call_service}\n" \
            "      approver: erin\n"

    async def go() -> None:
        async with running(tmp_path, extra, people) as f:
            ch = MailLikeChannel()
            outbox = OutboxWorker(f.env.db, [ch], policy=RetryPolicy(max_attempts=1))
            orch = Orchestrator(f.env.cfg, f.env.db, runner=None)
            orch.decider = Decider(f.env.cfg, f.env.db, decided=f.watcher.wake_settle)
            f.env.write("main", unlock("m1"), sub="actions")
            await until(lambda: f.approvals())
            (card_chat,) = f.env.db.query("SELECT chat_jid FROM outbox")
            assert card_chat[0] == "mail:erin@example.org"
            assert await outbox.run_once() == 1
            code = store.get(f.env.db, f.approvals()[0].id, codes=True).codes["erin"]
            assert f'Reply "approve {code}"' in ch.sent[0]

            def mail(text: str) -> InboundMessage:
                return InboundMessage(
                    id=f"mail:erin@example.org:{text}", chat_jid="mail:erin@example.org",
                    sender="erin@example.org", sender_name="Erin", content=f"@Andy {text}",
                    timestamp="2026-01-01T00:00:00.000Z", channel="email", addressed=True)

            await orch.on_inbound(mail(f"approve {code}"))
            done = await until(lambda: (r := result(f.env, "main", "m1")) and
                               r["status"] == "success" and r)
            assert done["status"] == "success"
            a = await f.settled(f.approvals()[0].id)
            assert (a.decided_by, a.decided_via) == ("erin", "email")
            assert [c[:2] for c in f.calls()] == [("lock", "unlock")]
    asyncio.run(go())


def test_an_email_answer_with_a_signature_and_the_quoted_card_decides(tmp_path: Path) -> None:
    """The mail as a client sends it, read by the email channel itself: the card quoted, the
    answer below it, a signature ("-- "). A mail that only quotes the card (its own
    words no answer) decides nothing and is no wrong code."""
    from mdclaw.channels.email import EmailChannel
    from mdclaw.config import EmailChannel as EmailSection

    people = PEOPLE + '  erin: {name: Erin, role: admin, identities: ' \
        '{email: ["erin@example.org"]}}\n'
    extra = "approvals:\n  rules:\n    - match: {action: ha_call_service}\n" \
            "      approver: erin\n"
    pw = tmp_path / "mail-pw"
    pw.write_text("secret\n")
    mailer = EmailChannel(EmailSection(address="andy@example.org", imap_host="h",
                                       smtp_host="h", password_file=pw, trust_from=True),
                          password="secret", is_allowed=lambda a: True, trigger="@Andy")

    def mail(n: int, text: str, card: str, *, below: bool = False) -> InboundMessage:
        quote = "On Tue, 3 Mar 2026 at 09:00, Andy <andy@example.org> wrote:\r\n" + "".join(
            f"> {line}\r\n" for line in card.splitlines())
        body = f"{quote}\r\n{text}" if below else f"{text}\r\n{quote}"
        raw = ("From: Erin <erin@example.org>\r\nTo: andy@example.org\r\n"
               f"Subject: Re: Approval\r\nMessage-ID: <r{n}@example.org>\r\n"
               "In-Reply-To: <card@example.org>\r\nMIME-Version: 1.0\r\n"
               f"Content-Type: text/plain; charset=utf-8\r\n\r\n{body}").encode()
        got = mailer.read_mail(raw, uid=f"1-{n}")
        assert got.message is not None, got.why
        return got.message

    async def go() -> None:
        async with running(tmp_path, extra, people) as f:
            ch = MailLikeChannel()
            outbox = OutboxWorker(f.env.db, [ch], policy=RetryPolicy(max_attempts=1))
            orch = Orchestrator(f.env.cfg, f.env.db, runner=None)
            orch.decider = Decider(f.env.cfg, f.env.db, decided=f.watcher.wake_settle)
            f.env.write("main", unlock("m1"), sub="actions")
            await until(lambda: f.approvals())
            assert await outbox.run_once() == 1
            a = store.get(f.env.db, f.approvals()[0].id, codes=True)
            code = a.codes["erin"]
            assert f'Reply "approve {code}"' in ch.sent[0]

            await orch.on_inbound(mail(1, "Thanks, I will look later.\r\n\r\n-- \r\nErin",
                                       ch.sent[0]))
            assert store.get(f.env.db, a.id).pending
            assert store.get(f.env.db, a.id).wrong_codes == 0
            # answered below the quoted card (the card says the code too: only the answer
            # counts), then the signature
            await orch.on_inbound(mail(2, f"approve {code}\r\n\r\n-- \r\nErin Example\r\n"
                                          "Sent from my phone\r\n", ch.sent[0], below=True))
            done = await until(lambda: (r := result(f.env, "main", "m1")) and
                               r["status"] == "success" and r)
            assert done["status"] == "success"
            decided = await f.settled(a.id)
            assert (decided.decided_by, decided.decided_via) == ("erin", "email")
    asyncio.run(go())


# --------------------------------------------------------------------------- the agent's tools


def test_the_agents_tools_wait_for_a_person_and_ask_person_gets_the_answer(
        tmp_path: Path) -> None:
    """The agent runner's own tools against the real engine and worker: ha_call_service
    and ask_person keep waiting past their usual timeout while the approval is pending."""
    async def go() -> None:
        async with running(tmp_path) as f:
            ctx = ToolContext(ipc_dir=f.env.ipc / "main", group_folder="main", chat_jid="tg:1",
                              is_main=True, group_dir=f.env.data / "groups" / "main",
                              action_timeout=1.0, web_timeout=1.0)
            tools = tools_for(True)
            replies: dict[str, tuple[str, bool]] = {}

            def use(name: str, args: dict[str, Any]) -> threading.Thread:
                t = threading.Thread(target=lambda: replies.__setitem__(
                    name, run_tool(tools, ctx, name, args)), daemon=True)
                t.start()
                return t

            asked = use("ask_person", {"question": "Open the door for the plumber?",
                                       "options": ["Yes, now", "No", "Later"]})
            q = await until(lambda: [a for a in f.approvals() if a.kind == "question"])
            card = json.loads(f.env.db.query_one(
                "SELECT card FROM outbox WHERE card IS NOT NULL ORDER BY id DESC")[0])
            assert [c["label"] for c in card["choices"]] == ["Yes, now", "No", "Later"]
            await asyncio.sleep(2.5)  # past the tool's own 1 s: it still waits
            assert asked.is_alive()
            with f.env.db.transaction() as conn:
                flow.decide(conn, f.env.cfg, q[0].id, status="answered", by="alex",
                            label="Alex (owner)", via="test", choice="3")
            f.watcher.actions.wake()
            await until(lambda: not asked.is_alive(), timeout=60)
            assert replies["ask_person"] == ("Alex (owner) answered: Later", False)

            called = use("ha_call_service", UNLOCK_ARGS)
            a = await until(lambda: [x for x in f.approvals() if x.kind == "action"])
            await asyncio.sleep(2.5)
            assert called.is_alive()
            f.decide(a[0].id, "denied")
            await until(lambda: not called.is_alive(), timeout=60)
            text, err = replies["ha_call_service"]
            assert err and "denied by Alex (owner)" in text
            assert f.calls() == []
    asyncio.run(go())


UNLOCK_ARGS = {"domain": "lock", "service": "unlock", "target": {"entity_id": "lock.front_door"}}


def test_a_group_cannot_bury_the_owner_in_cards(tmp_path: Path) -> None:
    async def go() -> None:
        async with running(tmp_path) as f:
            n = store.MAX_PENDING_PER_GROUP + 2
            for i in range(n):
                f.env.write("main", unlock(f"u{i}"), sub="actions")
            await until(lambda: f.env.pending("main", "actions") == [], timeout=60)
            assert len(f.approvals()) == store.MAX_PENDING_PER_GROUP
            refused = [f.env.errors_for("main", p.name.split(".", 2)[2].removesuffix(
                ".error.json")) for p in f.env.errors.glob("main.*.error.json")]
            assert len(refused) == 2
            assert all("wait for a person already" in json.dumps(r) for r in refused)
            # a question counts too: it gets an error result instead of a card
            f.env.write("main", {"type": "action", "requestId": "q1", "action": "ask_person",
                                 "params": {"question": "one more?"}}, sub="actions")
            r = await until(lambda: result(f.env, "main", "q1"))
            assert r["status"] == "error" and "wait for a person already" in r["error"]
    asyncio.run(go())
