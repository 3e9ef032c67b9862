"""A person decides: button presses on cards, reply codes, and admit cards for unknown
senders. The only ways a decision enters mdclaw besides the operator's (CLI, operator page:
mdclaw.ops.approvals).

Who decided is the identity the chat service authenticated: a press's sender (Telegram's
`callback_query.from.id`, the web chat's sender behind its token), or the sender of an
inbound message that is exactly "approve 7KQ2" / "deny 7KQ2" (or "admit", "ignore", an
option's number; in an email, what the sender wrote above their signature, outside the
original it quotes: `InboundMessage.own_words`). That identity must be a person of the
config and one of the approval's approvers; nothing in the text says who decided. Nothing
an agent writes arrives here: its IPC files are commands (none of which decides anything),
and what it sends into a chat goes out through the outbox and never comes back as inbound.
A reply code is bound to one approval and one approver; MAX_WRONG_CODES wrong codes from a
person lock the codes of every approval they may decide (buttons, the operator page and the
CLI still work).
"""

from __future__ import annotations

import logging
import re
import sqlite3
from collections.abc import Callable

from mdclaw.approvals import flow, store
from mdclaw.channels.base import CardPress, InboundMessage
from mdclaw.config import Config, LiveConfig
from mdclaw.people import People, channel_of, identity_label
from mdclaw.state import Database
from mdclaw.state.groups import GroupRow
from mdclaw.state.outbox import enqueue

log = logging.getLogger("mdclaw.decisions")

# "approve 7KQ2", "Deny 7kq2", "admit 7KQ2", "2 7KQ2" (a question's option): the whole message.
REPLY_RE = re.compile(r"^\s*(approve|deny|admit|ignore|[1-4])\s+([0-9A-Za-z-]{4,9})\s*[.!]?\s*\Z",
                      re.IGNORECASE)
WORD_STATUS = {"approve": "approved", "deny": "denied", "admit": "approved",
               "ignore": "denied"}
KIND_WORDS = {"command": ("approve", "deny"), "action": ("approve", "deny"),
              "admission": ("admit", "ignore")}


def _without_address(text: str, name: str) -> str:
    """`text` without a leading "@Andy " (the email channel puts the trigger before every
    mail, which is always addressed to the assistant): "@Andy approve 7KQ2" is an answer."""
    return re.sub(rf"^\s*@{re.escape(name)}[,:]?\s+", "", text, count=1, flags=re.IGNORECASE)


class Decider:
    """Takes people's decisions for the daemon. `decided` is called after each decision is
    committed (the daemon wakes the IPC loop's settle pass, the action worker and the
    outbox)."""

    def __init__(self, cfg: Config | LiveConfig, db: Database, *,
                 decided: Callable[[], None] = lambda: None) -> None:
        self.live = LiveConfig.of(cfg)
        self.db = db
        self.decided = decided

    @property
    def cfg(self) -> Config:
        return self.live.current

    # ------------------------------------------------------------------ buttons
    async def on_press(self, press: CardPress) -> str | None:
        """A button on a card was pressed; returns what the presser is shown."""
        parsed = flow.parse_press(press.data)
        if parsed is None:
            return None
        approval_id, word = parsed
        people = People.of(self.cfg)
        person = people.person_for(press.channel, press.sender)
        a = store.get(self.db, approval_id)
        if a is None:
            return "This request is not known here."
        if person is None or person not in a.approvers:
            log.warning("approval #%d: %s pressed %r but may not decide it", a.id,
                        identity_label(press.channel, press.sender), word)
            return "Only the people it was sent to can answer this."
        if not a.pending:
            return _already(a)
        if word == "show":
            with self.db.transaction() as conn:
                flow.send_full(conn, a, press.chat_jid)
            self.decided()
            return "The whole request follows."
        return self._decide(a, person, word, via=press.channel)

    # ------------------------------------------------------------------ reply codes
    def take_reply(self, msg: InboundMessage) -> bool:
        """If `msg` is a person's answer by code ("approve 7KQ2"), record it and answer in
        its chat; True when it was one (it is then not a message of the chat: it is never
        stored nor shown to an agent). A message of that form from someone who is no
        approver of anything is an ordinary message (False)."""
        said = msg.own_words if msg.own_words is not None else msg.content
        m = REPLY_RE.match(_without_address(said or "", self.cfg.assistant.name))
        if m is None or msg.attachments:
            return False
        channel = channel_of(msg.chat_jid, msg.channel)
        person = People.of(self.cfg).person_for(channel, msg.sender)
        if person is None:
            return False
        word, code = m.group(1).lower(), m.group(2)
        with self.db.transaction() as conn:
            a = store.by_code(conn, person, code)
            if a is None:
                if not store.pending_for(conn, person):
                    return False  # no approver of anything: not an answer
                locked = store.wrong_code(conn, person)
                answer = (f"No request waits for code {store.normalize_code(code)} from you.")
                if locked:
                    answer += (" Too many wrong codes: the codes of request(s) "
                               f"{', '.join(f'#{i}' for i in locked)} are locked; answer "
                               "those with the buttons, on the operator page or with "
                               "`mdclaw approvals`.")
                log.warning("approvals: wrong code from %s (%s)%s", person,
                            identity_label(channel, msg.sender),
                            f"; locked {locked}" if locked else "")
                self._reply(conn, msg, answer)
        if a is None:
            self.decided()
            return True
        self._decide(a, person, word, via=channel, message=msg)
        return True

    # ------------------------------------------------------------------ admit cards
    def ask_admission(self, group: GroupRow, msg: InboundMessage) -> int | None:
        """Send the owner an admit card for `msg`'s unknown sender (once per sender and
        group while one waits); returns the approval's id, or None when one waits already.
        The message is kept with the card (stored as the group's once admitted)."""
        channel = channel_of(msg.chat_jid, msg.channel)
        identity = identity_label(channel, msg.sender)
        request = {"channel": channel, "sender": msg.sender, "sender_name": msg.sender_name,
                   "identity": identity, "chat_jid": msg.chat_jid, "message_id": msg.id,
                   "content": msg.content[:4000]}
        try:
            with self.db.transaction() as conn:
                opened = flow.open_approval(
                    conn, self.cfg, kind="admission", folder=group.folder,
                    group_name=group.name, request=request, approver="owner",
                    timeout=self.cfg.approvals.timeout, subject=f"{channel}:{msg.sender}",
                    rule=f"groups.{group.folder}.unknown_senders: ask_owner")
        except sqlite3.IntegrityError:
            return None  # one card per sender and group while it waits
        log.info("group %s: %s (%s) asks to talk; admit card #%d to the owner", group.folder,
                 identity, msg.sender_name, opened.id)
        self.decided()
        return opened.id

    # ------------------------------------------------------------------ deciding
    def _decide(self, a: store.Approval, person: str, word: str, *, via: str,
                message: InboundMessage | None = None) -> str:
        people = People.of(self.cfg)
        if a.kind == "question":
            options = a.request.get("options") or []
            if not word.isdigit() or not 1 <= int(word) <= len(options):
                return f"Answer with one of the options (1-{len(options)})."
            status, choice = "answered", word
        else:
            if word not in KIND_WORDS.get(a.kind, ()):
                return f"Answer this one with {' or '.join(KIND_WORDS.get(a.kind, ()))}."
            status, choice = WORD_STATUS[word], None
        label = people.label(person)
        with self.db.transaction() as conn:
            got = flow.decide(conn, self.cfg, a.id, status=status, by=person, label=label,
                              via=via, choice=choice)
            answer = _done(got) if got is not None else _already(store.get(conn, a.id) or a)
            if message is not None:
                self._reply(conn, message, answer)
        if got is not None:
            log.info("approval #%d (%s) %s by %s via %s", a.id, a.summary, status, label, via)
        self.decided()
        return answer

    @staticmethod
    def _reply(conn: sqlite3.Connection, msg: InboundMessage, text: str) -> None:
        enqueue(conn, chat_jid=msg.chat_jid, kind="text", card=flow.card_json(text, text),
                reply_to=msg.id)


def _done(a: store.Approval) -> str:
    if a.kind == "question":
        options = a.request.get("options") or []
        n = int(a.choice or 0)
        shown = options[n - 1] if 1 <= n <= len(options) else a.choice
        return f"Answered #{a.id}: {shown}."
    verb = {"approved": "Admitted" if a.kind == "admission" else "Approved",
            "denied": "Ignored" if a.kind == "admission" else "Denied"}[a.status]
    return f"{verb} #{a.id}: {a.summary}."


def _already(a: store.Approval) -> str:
    if a.status == "expired":
        return f"#{a.id} expired: nobody answered in time."
    return f"#{a.id} was {a.status} already (by {a.decided_label or 'someone'})."
