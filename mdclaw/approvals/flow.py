"""Opening an approval with its cards, deciding it, and what a decision leads to.

- `open_approval`, in the transaction of whatever asked (an IPC command, an action, an
  unknown sender, an agent's question): the pending row with a reply code per approver, and
  a card (an outbox row: its text, its choices) to each approver's direct chat.
- `decide`, in the decider's transaction: the conditional UPDATE (only one decision wins),
  and at once what the decision makes possible: a held action job is released to the action
  worker (which runs it, or writes "denied by ..." as its result), an admitted sender is
  admitted and the message that asked is stored as a message of the group.
- `settle_effects`, in the daemon's settle pass (mdclaw.ipc.apply.IpcEngine.settle), in
  the transaction that marks the approval settled (after an approved command ran there):
  the note that tells the agent the outcome, and every card edited to show it.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from mdclaw import schedule
from mdclaw.approvals import cards, store
from mdclaw.approvals.store import Approval
from mdclaw.config import Config
from mdclaw.people import People, channel_of
from mdclaw.senders import HOST_SENDER
from mdclaw.state.outbox import enqueue
from mdclaw.state.people import admit

CARD_PREFIX = "mdc"
CHOICES = {
    "command": [("approve", "Approve"), ("deny", "Deny")],
    "action": [("approve", "Approve"), ("deny", "Deny")],
    "admission": [("admit", "Admit"), ("ignore", "Ignore")],
}
# A reply word's decision, per kind (questions: the option's number).
VERDICTS = {"approve": "approved", "deny": "denied", "admit": "approved", "ignore": "denied"}
HOST_NAME = "mdclaw"


def choices_for(kind: str, request: dict[str, Any]) -> list[tuple[str, str]]:
    """(reply word, button label) of an approval's answers."""
    if kind == "question":
        return [(str(n), str(o)[:60]) for n, o in enumerate(request.get("options") or [], 1)]
    return CHOICES[kind]


def press_data(approval_id: int, word: str) -> str:
    """A button's data (at most 64 bytes, as Telegram allows): which approval, which answer.
    It proves nothing: who pressed is the channel's authenticated sender."""
    return f"{CARD_PREFIX}:{approval_id}:{word}"


def parse_press(data: str) -> tuple[int, str] | None:
    """(approval id, reply word) of a button's data; None for data that is no card's."""
    prefix, _, rest = data.partition(":")
    num, _, word = rest.partition(":")
    if prefix != CARD_PREFIX or not num.isdigit() or not word or len(data) > 64:
        return None
    return int(num), word


def local_expiry(cfg: Config, iso: str) -> str:
    """An expiry as a person reads it: local time of the assistant's time zone."""
    try:
        dt = schedule.from_iso(iso).astimezone(schedule.get_zone(cfg.assistant.timezone))
    except (ValueError, schedule.ScheduleError):
        return iso
    return dt.strftime("%Y-%m-%d %H:%M") + f" ({cfg.assistant.timezone})"


def card_json(text: str, fallback: str, choices: Sequence[tuple[str, str]] = (),
              approval_id: int | None = None) -> str:
    """The `card` column of an outbox row."""
    return json.dumps({"approval": approval_id, "text": text, "fallback": fallback,
                       "choices": [{"label": label, "data": data} for label, data in choices]},
                      ensure_ascii=False)


@dataclass(frozen=True)
class Opened:
    id: int
    approvers: tuple[str, ...]
    expires_at: str
    cards: int


def open_approval(conn: sqlite3.Connection, cfg: Config, *, kind: str, folder: str,
                  group_name: str, request: dict[str, Any], approver: str,
                  timeout: timedelta, rule: str | None = None, subject: str = "",
                  request_id: str | None = None, chat_jid: str | None = None) -> Opened:
    """A pending approval and a card to each approver's direct chat, in the caller's
    transaction. An approval nobody may decide (no such person) is opened all the same: the
    operator can decide it, and it expires as a denial. `chat_jid`: the group's chat the
    request came from (where its outcome note goes; None: the group's first chat)."""
    people = People.of(cfg)
    approvers = people.approvers(approver)
    summary = cards.summary(kind, request)
    approval_id, codes = store.insert(
        conn, kind=kind, folder=folder, subject=subject or summary, summary=summary,
        request=request, rule=rule, approver=approver, approvers=approvers,
        timeout=timeout, request_id=request_id, chat_jid=chat_jid)
    a = store.get(conn, approval_id)
    assert a is not None
    words = choices_for(kind, request)
    sent: set[str] = set()
    for person in approvers:
        chat = people.card_chat(person)
        if chat is None or chat in sent:
            continue
        sent.add(chat)
        text = cards.card_text(approval_id=approval_id, kind=kind, group=folder,
                               group_name=group_name, request=request, rule=rule,
                               expires=local_expiry(cfg, a.expires_at),
                               code=codes.get(person), choices=words)
        buttons = [(label, press_data(approval_id, word)) for word, label in words]
        if text.cut:
            buttons.append(("Show all", press_data(approval_id, "show")))
        outbox_id = enqueue(conn, chat_jid=chat, kind="text",
                            card=card_json(text.text, text.codes_text, buttons, approval_id))
        store.add_card(conn, approval_id, chat, outbox_id)
    return Opened(approval_id, tuple(approvers), a.expires_at, len(sent))


def decide(conn: sqlite3.Connection, cfg: Config, approval_id: int, *, status: str,
           by: str | None, label: str, via: str, choice: str | None = None) -> Approval | None:
    """Record a decision and do at once what it makes possible (see the module doc); None
    when the approval was decided already (the other decision won)."""
    if not store.decide(conn, approval_id, status=status, by=by, label=label, via=via,
                        choice=choice):
        return None
    a = store.get(conn, approval_id)
    assert a is not None
    if a.kind in ("action", "question"):
        conn.execute("UPDATE action_jobs SET status = 'queued' WHERE approval_id = ? AND "
                     "status = 'awaiting_approval'", (a.id,))
    if a.kind == "admission" and a.status == "approved":
        _admit(conn, a)
    return a


def _admit(conn: sqlite3.Connection, a: Approval) -> None:
    """Admit the sender of an admission and store the message that asked, now (as the
    newest of its chat, so the group's cursor cannot have passed it)."""
    r = a.request
    admit(conn, channel=str(r.get("channel")), sender=str(r.get("sender")),
          folder=a.group_folder, sender_name=r.get("sender_name"), by=a.decided_by or "",
          approval_id=a.id)
    jid = str(r.get("chat_jid"))
    at = store.now()
    _ensure_chat(conn, jid, at)
    conn.execute(
        "INSERT OR IGNORE INTO messages (id, chat_jid, sender, sender_name, content, timestamp,"
        " is_from_me, is_bot_message) VALUES (?, ?, ?, ?, ?, ?, 0, 0)",
        (str(r.get("message_id") or f"admitted:{a.id}"), jid, str(r.get("sender")),
         str(r.get("sender_name") or r.get("sender")), str(r.get("content") or ""), at))


def _ensure_chat(conn: sqlite3.Connection, jid: str, at: str) -> None:
    conn.execute("INSERT OR IGNORE INTO chats (jid, name, last_activity, channel, is_group)"
                 " VALUES (?, NULL, ?, ?, 0)", (jid, at, channel_of(jid)))


def note_text(a: Approval, outcome: str | None) -> str | None:
    """What the agent is told of a decided request of its own, for its next turn (None for
    admissions and questions, which are not the agent's requests). An approved action's
    result also reaches the tool call that waited for it, if that is still running."""
    if a.kind not in ("command", "action"):
        return None
    what = f"Your request #{a.id} ({a.summary})"
    if a.status == "approved":
        if a.kind == "action":
            return (f"{what} was approved by {a.decided_label} and ran; its result went to "
                    "the tool call that asked.")
        done = f": {outcome}" if outcome and outcome != "applied" else "; it was carried out"
        return f"{what} was approved by {a.decided_label}{done}."
    if a.status == "expired":
        return f"{what} was not approved: nobody answered in time, so it did not happen."
    return f"{what} was denied by {a.decided_label}; it did not happen."


def settle_effects(conn: sqlite3.Connection, cfg: Config, a: Approval, *,
                   group_jid: str | None, outcome: str | None = None) -> None:
    """After a decision (in the settle pass's transaction): a note into the requesting
    group's conversation (context for its next turn, mdclaw.senders.HOST_NOTE), and every
    card of the approval edited to show the outcome and who decided."""
    text = note_text(a, outcome)
    if text is not None and group_jid:
        at = store.now()
        _ensure_chat(conn, group_jid, at)
        conn.execute(
            "INSERT OR IGNORE INTO messages (id, chat_jid, sender, sender_name, content,"
            " timestamp, is_from_me, is_bot_message) VALUES (?, ?, ?, ?, ?, ?, 0, 0)",
            (f"host:approval:{a.id}", group_jid, HOST_SENDER, HOST_NAME, text, at))
    final = cards.outcome_text(approval_id=a.id, kind=a.kind, summary=a.summary,
                               status=a.status, by=a.decided_label,
                               outcome=None if outcome in (None, "applied") else outcome)
    if a.kind == "question" and a.choice:
        final += f"\nAnswer: {a.choice}"
    edit = card_json(final, final, [], a.id)
    for chat, outbox_id in store.cards(conn, a.id):
        row = conn.execute("SELECT status, card FROM outbox WHERE id = ?",
                           (outbox_id,)).fetchone()
        if row is not None and conn.execute(
                "UPDATE outbox SET card = ? WHERE id = ? AND status = 'pending'",
                (edit, outbox_id)).rowcount:
            continue  # not sent yet: it goes out showing the outcome
        sent = None
        if row is not None and row["card"]:
            try:
                sent = json.loads(row["card"]).get("sent")
            except ValueError:
                sent = None
        enqueue(conn, chat_jid=chat, kind="text", card=edit,
                message_id=sent if isinstance(sent, str) else None)


def send_full(conn: sqlite3.Connection, a: Approval, chat_jid: str) -> int:
    """The whole request (escaped, not cut) as messages to `chat_jid`; returns how many."""
    parts = cards.full_text(a.id, a.kind, a.request)
    for part in parts:
        enqueue(conn, chat_jid=chat_jid, kind="text", card=card_json(part, part))
    return len(parts)
