"""Mail to the assistant, end to end: the real daemon (`mdclaw run`, in a process of its own:
tests/fake_daemon.py) with its orchestrator, queue, runner, IPC and outbox, the tests' fake
engine playing the agent (mailserver.answering_agent), and real mail servers on loopback:
Dovecot holds the assistant's and the person's mailboxes, an SMTP server (aiosmtpd)
delivers into them (tests/mailserver.py).

The person's side is what a mail client does: mail sent through the SMTP server after a
login, answers read from the person's mailbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import pytest
import yaml

from mailserver import AGENT_DELAY_VAR, MailWorld, User, body, channel_section, make_mail
from waiting import wait_until

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow


class Daemon:
    """The daemon of one test: its config (one group per person, answering by mail), its
    process, its log and its database."""

    def __init__(self, tmp: Path, world: MailWorld, assistant: User, people: list[User],
                 **email: Any) -> None:
        self.tmp, self.world = tmp, world
        self.data = tmp / "data"
        self.config = tmp / "config.yaml"
        self.log = tmp / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.offset = 0
        cfg = {
            "data_dir": str(self.data),
            "assistant": {"name": "Andy", "timezone": "UTC"},
            "server": None,
            "models": {"local": {"backend": "openai", "model": "fake",
                                 "base_url": "http://127.0.0.1:9/v1"}},
            "groups": {"main": {"name": "Admin", "jid": "hl:main", "main": True},
                       **{f"p{n}": {"name": p.address, "jid": f"mail:{p.address}",
                                    "requires_trigger": False}
                          for n, p in enumerate(people)}},
            "channels": {"http": None,
                         "email": channel_section(world, assistant, people, **email)},
            "media": {"max_bytes": "64k"},
            "limits": {"idle_timeout": "2s", "run_attempts": 2},
        }
        self.config.write_text(yaml.safe_dump(cfg))

    def start(self, *flags: str, env: dict[str, str] | None = None) -> None:
        assert self.proc is None
        self._log = self.log.open("ab")
        self.offset = offset = self.log.stat().st_size
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "fake_daemon.py"), "--config", str(self.config),
             "--agent", "mailserver:answering_agent", *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"the daemon exited ({self.proc.returncode}):\n"
                                     f"{self.text()[-3000:]}")
            return "mdclaw.daemon: ready:" in self.text()[offset:]

        wait_until(ready, 60, interval=0.05, what="the daemon to be ready")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def text_since_start(self) -> str:
        return self.text()[self.offset:]

    def stop(self) -> int:
        proc, self.proc = self.proc, None
        assert proc is not None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        finally:
            self._log.close()
        return code

    def killed(self) -> None:
        """Wait for the daemon to have killed itself (--die-at)."""
        assert self.proc is not None
        code = self.proc.wait(60)
        assert code == -signal.SIGKILL, (code, self.text()[-3000:])
        self.proc = None
        self._log.close()

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with contextlib.closing(sqlite3.connect(self.data / "state.db", timeout=30)) as db:
            return db.execute(sql, args).fetchall()

    def stored(self) -> list[str]:
        """The contents of the messages stored from mail, in order."""
        return [r[0] for r in self.query(
            "SELECT content FROM messages WHERE chat_jid LIKE 'mail:%' ORDER BY timestamp")]

    def status(self) -> dict[str, Any]:
        try:
            return json.loads((self.data / "daemon-status.json").read_text())
        except (OSError, ValueError):
            return {}


@pytest.fixture
def daemons() -> Any:
    """Daemons made by the test, stopped after it whatever happens."""
    made: list[Daemon] = []
    yield made
    for d in made:
        if d.proc is not None:
            with contextlib.suppress(Exception):
                d.stop()


def setup(world: MailWorld, tmp: Path, daemons: list[Daemon], **email: Any
          ) -> tuple[Daemon, User, User]:
    bot, alice = world.user(), world.user()
    d = Daemon(tmp, world, bot, [alice], **email)
    daemons.append(d)
    return d, bot, alice


def answers(world: MailWorld, person: User, n: int, timeout: float = 30) -> list[EmailMessage]:
    """The person's mailbox once it holds `n` mails (the assistant's), and no more."""
    got = wait_until(lambda: (lambda m: m if len(m) >= n else None)(world.mailbox(person)),
                     timeout, what=f"{n} mail(s) in {person.address}'s mailbox")
    assert len(got) == n, [body(m) for m in got]
    return got


def tokens_answered(world: MailWorld, person: User) -> list[str]:
    """Every `token-...` the assistant's answers name, in order (an answer names what the
    agent read: a mail handed over twice would be named twice)."""
    import re

    out: list[str] = []
    for m in world.mailbox(person):
        out += re.findall(r"token-[\w-]+", body(m).split("\n", 1)[0])
    return out


# --------------------------------------------------------------------------- the tests


def test_a_mail_is_answered_formatted_in_its_thread_and_the_thread_is_followed(
        mail_world: MailWorld, tmp_path: Path, daemons: list[Daemon]) -> None:
    w = mail_world
    d, bot, alice = setup(w, tmp_path, daemons)
    d.start()
    first = make_mail(alice, bot, "Plans for Saturday", "Any idea? token-1")
    w.send(first, as_user=alice)
    (answer,) = answers(w, alice, 1)
    root = str(first["Message-ID"])
    assert str(answer["Subject"]) == "Re: Plans for Saturday"
    assert str(answer["In-Reply-To"]) == root and str(answer["References"]) == root
    assert str(answer["From"]) == f"Andy <{bot.address}>"
    assert answer.get_content_type() == "multipart/alternative"
    assert body(answer).startswith("**Answer** to token-1\n\n- one\n- two\n\n```")
    html = body(answer, "html")
    assert "<strong>Answer</strong> to token-1" in html
    assert "<li>one</li>" in html and "<pre><code>print('hi')" in html

    # Alice answers the answer: the thread goes on, and so does the conversation.
    reply = make_mail(alice, bot, "Re: Plans for Saturday", "Sounds good token-2\n\n"
                      f"On Sat, Andy <{bot.address}> wrote:\n> **Answer** to token-1",
                      in_reply_to=str(answer["Message-ID"]),
                      references=[root, str(answer["Message-ID"])])
    w.send(reply, as_user=alice)
    second = answers(w, alice, 2)[1]
    assert str(second["Subject"]) == "Re: Plans for Saturday"
    assert str(second["In-Reply-To"]) == str(reply["Message-ID"])
    assert str(second["References"]).split() == [root, str(answer["Message-ID"]),
                                                 str(reply["Message-ID"])]
    assert tokens_answered(w, alice) == ["token-1", "token-2"]
    # Every mail is addressed to the assistant: the trigger is put in front (as Telegram
    # does for a mention of the bot), the quoted history is cut off.
    assert d.stored() == ["@Andy Subject: Plans for Saturday\n\nAny idea? token-1",
                          "@Andy Sounds good token-2"]
    wait_until(lambda: all(w.seen_flags(bot).values()), 10,
               what="both of Alice's mails marked seen")

    # The agent reacts to Alice's first mail: a reaction mail (RFC 9078) in that mail's thread
    # (the agent's `react` command, the outbox, the channel), besides its answer.
    w.send(make_mail(alice, bot, "Re: Plans for Saturday",
                     f"Thanks token-3, react to mail:{alice.address}:{root[1:-1]}",
                     in_reply_to=str(second["Message-ID"]),
                     references=[root, str(second["Message-ID"])]), as_user=alice)
    mails = answers(w, alice, 4)
    (reaction,) = [m for m in mails
                   if any(p.get_content_disposition() == "reaction" for p in m.walk())]
    assert body(reaction).strip() == "\N{THUMBS UP SIGN}"
    assert str(reaction["In-Reply-To"]) == root
    assert str(reaction["Subject"]) == "Re: Plans for Saturday"
    assert tokens_answered(w, alice) == ["token-1", "token-2", "token-3"]
    assert d.stop() == 0


def test_files_go_both_ways_with_the_size_cap(mail_world: MailWorld, tmp_path: Path,
                                              daemons: list[Daemon]) -> None:
    w = mail_world
    d, bot, alice = setup(w, tmp_path, daemons)
    d.start()
    pdf = os.urandom(2048)
    w.send(make_mail(alice, bot, "notes", "the notes token-3",
                     files=[("notes.pdf", "application/pdf", pdf)]), as_user=alice)
    (first,) = answers(w, alice, 1)
    assert "read notes.pdf: 2048 bytes" in body(first)
    (saved,) = (d.data / "groups" / "p0" / "inbox").glob("*/notes.pdf")
    assert saved.read_bytes() == pdf

    # Over media.max_bytes (64k): not saved; the agent is told, and so is Alice.
    w.send(make_mail(alice, bot, "scan", "the scan token-4",
                     files=[("big.bin", "application/octet-stream", os.urandom(100_000))]),
           as_user=alice)
    mails = answers(w, alice, 3)
    texts = sorted(body(m) for m in mails[1:])
    assert any("I could not keep 'big.bin'" in t for t in texts), texts
    assert not list((d.data / "groups" / "p0" / "inbox").glob("*/big.bin"))
    assert not any("read big.bin" in t for t in texts)

    # A file from the agent: attached to a mail in the thread.
    ask = make_mail(alice, bot, "report please", "send me a file token-5")
    w.send(ask, as_user=alice)
    mails = answers(w, alice, 5)
    (with_file,) = [m for m in mails if list(m.iter_attachments())]
    (att,) = list(with_file.iter_attachments())
    assert att.get_filename() == "report.txt"
    assert att.get_content().replace("\r\n", "\n") == "report for token-5\n"
    assert "<strong>your report</strong>" in body(with_file, "html")
    assert str(with_file["In-Reply-To"]) == str(ask["Message-ID"])
    assert d.stop() == 0


def test_loops_and_strangers_never_reach_the_agent(mail_world: MailWorld, tmp_path: Path,
                                                  daemons: list[Daemon]) -> None:
    w = mail_world
    d, bot, alice = setup(w, tmp_path, daemons)
    bob = w.user()  # has an account here; not allowed to write to the assistant
    d.start()
    w.send(make_mail(alice, bot, "Out of office", "I am away token-auto",
                     headers={"Auto-Submitted": "auto-replied"}), as_user=alice)
    bounce = make_mail(f"MAILER-DAEMON@{alice.address.split('@')[1]}", bot,
                       "Undelivered Mail Returned to Sender", "token-bounce")
    bounce.replace_header("Content-Type", "multipart/report; report-type=delivery-status; "
                          "boundary=x")
    bounce.set_payload("--x\r\nContent-Type: text/plain\r\n\r\ntoken-bounce\r\n--x--\r\n")
    w.send(bounce, mail_from="")
    w.send(make_mail(alice, bot, "[club] news", "token-list",
                     headers={"List-Id": "<club.example.test>"}),
           as_user=alice)
    w.send(make_mail(bot, bot, "a copy of our own", "token-own"), as_user=bot)
    w.send(make_mail(bob, bot, "hello", "token-stranger"), as_user=bob)
    w.send(make_mail(alice.address, bot, "forged", "token-forged"))  # no login: DMARC fails
    w.send(make_mail(alice, bot, "a real one", "token-ok"), as_user=alice)
    (answer,) = answers(w, alice, 1)
    time.sleep(1.0)  # nothing else comes
    assert tokens_answered(w, alice) == ["token-ok"]
    assert d.stored() == ["@Andy Subject: a real one\n\ntoken-ok"]
    assert w.mailbox(bob) == []
    seen = w.seen_flags(bot)
    assert sum(seen.values()) == 1  # the rest are left unread for the mailbox's owner
    log = d.text()
    for why in ("Auto-Submitted", "delivery or read report", "mailing list", "our own mail",
                "may not write to the assistant", "not authenticated"):
        assert why in log, why
    assert d.stop() == 0


def test_restarts_and_kill_9_lose_no_mail_and_double_none(
        mail_world: MailWorld, tmp_path: Path, daemons: list[Daemon]) -> None:
    w = mail_world
    d, bot, alice = setup(w, tmp_path, daemons)
    slow = {AGENT_DELAY_VAR: "3"}  # the agent answers after the kill, never before it
    # Killed after the mail was stored and marked seen, before its UID was saved.
    d.start("--die-at", "before-uid=1", env=slow)
    w.send(make_mail(alice, bot, "one", "token-k1"), as_user=alice)
    d.killed()
    assert d.stored() == ["@Andy Subject: one\n\ntoken-k1"]
    assert list(w.seen_flags(bot).values()) == [True]
    assert w.mailbox(alice) == []
    # Killed after the host stored the mail, before it was marked seen. (Mail one is taken
    # again first: a duplicate the host drops; its turn runs from the database.)
    d.start("--die-at", "before-seen=2", env=slow)
    wait_until(lambda: tokens_answered(w, alice) == ["token-k1"], 30,
               what="mail one to be answered after the restart")
    # Its conversation ends (idle_timeout) before mail two comes, so that mail two starts a
    # run of its own rather than joining that one.
    wait_until(lambda: ": success (exit 0" in d.text_since_start(), 30,
               what="the conversation of mail one to end")
    w.send(make_mail(alice, bot, "two", "token-k2"), as_user=alice)
    d.killed()
    assert len(d.stored()) == 2
    assert sorted(w.seen_flags(bot).values()) == [False, True]
    # Started again: mail two is answered. Then stopped properly; a mail comes while it is
    # down.
    d.start()
    wait_until(lambda: "token-k2" in tokens_answered(w, alice), 30,
               what="the mail of the killed daemon to be answered")
    assert d.stop() == 0
    w.send(make_mail(alice, bot, "three", "token-k3"), as_user=alice)
    d.start()
    wait_until(lambda: "token-k3" in tokens_answered(w, alice), 30,
               what="the mail sent while the daemon was down to be answered")
    time.sleep(1.0)
    assert d.stop() == 0
    assert tokens_answered(w, alice) == ["token-k1", "token-k2", "token-k3"], [
        body(m).split("\n", 1)[0] for m in w.mailbox(alice)]
    assert d.stored() == [f"@Andy Subject: {n}\n\ntoken-k{i}"
                          for i, n in enumerate(("one", "two", "three"), 1)]
    assert all(w.seen_flags(bot).values())


def test_the_imap_server_down_for_a_minute_loses_nothing(
        mail_world: MailWorld, tmp_path: Path, daemons: list[Daemon], cli: Any) -> None:
    w = mail_world
    d, bot, alice = setup(w, tmp_path, daemons)
    d.start("--fast-reconnect")
    w.send(make_mail(alice, bot, "before", "token-o1"), as_user=alice)
    answers(w, alice, 1)
    w.dovecot.stop()
    try:
        t0 = time.monotonic()
        # The SMTP server still takes mail: it waits in the mailbox for IMAP to come back.
        w.send(make_mail(alice, bot, "during", "token-o2"), as_user=alice)
        details = wait_until(lambda: ((d.status().get("channel_details") or {}).get("email")
                                      or {}).get("fix") and d.status()["channel_details"]["email"],
                             30, what="the status to say the email channel has a problem")
        assert details["detail"].startswith("IMAP 127.0.0.1:"), details
        assert "imap_host" in details["fix"], details
        status = cli("status", "--config", str(d.config))
        assert "email: IMAP" in status.stdout and "fix: check channels.email.imap_host" in \
            status.stdout, status.stdout
        time.sleep(max(0.0, 60 - (time.monotonic() - t0)))
    finally:
        w.dovecot.start()
    answers(w, alice, 2, timeout=60)
    assert tokens_answered(w, alice) == ["token-o1", "token-o2"]
    wait_until(lambda: "fix" not in d.status()["channel_details"].get("email", {}), 30,
               what="the status to be clear again")
    assert "connected to 127.0.0.1" in d.text().rsplit("connecting again", 1)[1]
    assert d.stop() == 0
