"""The email channel against real servers on loopback: Dovecot (IMAP) and an SMTP server that
delivers into Dovecot's maildirs (tests/mailserver.py), one of each for the session.

The rules of reading mail (loops, authentication, quoted history, subjects) are checked on
their own first; then the channel itself: mail in (IDLE, the first look, marked \\Seen only
after the host took it, the UID kept across a restart), mail out (multipart, threaded, files,
reactions), SMTP's answers (4xx waits, 5xx fails), a server that is down, a wrong password or
an untrusted certificate, and a server without IDLE.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import pytest

from mailserver import (
    AUTHSERV,
    Dovecot,
    MailWorld,
    User,
    body,
    channel_section,
    make_mail,
)
from mdclaw.channels.base import ChannelError, InboundMessage
from mdclaw.channels.email import EmailChannel, probe
from mdclaw.channels.email_format import (
    auth_verdict,
    loop_reason,
    parse_auth_results,
    parse_mail,
    read_incoming,
    reply_subject,
    sender_of,
    strip_quoted,
)
from mdclaw.config import EmailChannel as EmailSection
from mdclaw.outbox import OutboxWorker, RetryPolicy, get_row
from mdclaw.retry import Backoff
from mdclaw.state import Database
from mdclaw.state.outbox import enqueue
from waiting import holds_for, wait_until_async

OWN = "bot@example.test"


def mail(headers: dict[str, str], body: str = "hello", *, sender: str = "alice@example.test",
         ctype: str | None = None) -> EmailMessage:
    m = make_mail(sender, OWN, "subject", body, headers=headers)
    if ctype:
        m.replace_header("Content-Type", ctype)
    return parse_mail(m.as_bytes())


# --------------------------------------------------------------------------- the rules


def test_mail_a_program_wrote_or_our_own_is_never_answered() -> None:
    assert loop_reason(mail({}), OWN) is None
    cases = {
        "our own address": mail({}, sender="Bot <BOT@example.test>"),
        "our Message-ID": mail({"X-Test": "1"}, sender="alice@example.test"),
        "Auto-Submitted": mail({"Auto-Submitted": "auto-replied"}),
        "X-Autoreply": mail({"X-Autoreply": "yes"}),
        "report": mail({}, ctype="multipart/report; report-type=delivery-status"),
        "empty Return-Path": mail({"Return-Path": "<>"}),
        "mailer-daemon": mail({}, sender="MAILER-DAEMON@mx.example.org"),
        "Precedence": mail({"Precedence": "bulk"}),
        "List-Id": mail({"List-Id": "<news.example.org>"}),
        "List-Unsubscribe": mail({"List-Unsubscribe": "<mailto:u@example.org>"}),
    }
    cases["our Message-ID"].replace_header("Message-ID", "<abc123.mdclaw@example.test>")
    for what, m in cases.items():
        assert loop_reason(m, OWN), what
    assert loop_reason(mail({"Auto-Submitted": "no"}), OWN) is None
    assert loop_reason(mail({"Precedence": "first-class"}), OWN) is None


def test_the_sender_is_one_address_and_the_receiving_server_vouches_for_it() -> None:
    assert sender_of(mail({}, sender='"Alice A." <Alice@Example.test>')) == (
        "alice@example.test", "Alice A.")
    assert sender_of(mail({}, sender="a@example.test, b@example.test")) is None
    assert sender_of(mail({}, sender="not an address")) is None

    authserv, results = parse_auth_results(
        "mx.google.com; dkim=pass (2048-bit key; secure) header.i=@example.org "
        "header.s=s1 header.b=AbC; spf=pass (google.com: domain of a@example.org designates "
        "1.2.3.4 as permitted sender) smtp.mailfrom=a@example.org; dmarc=pass (p=NONE "
        "sp=NONE dis=NONE) header.from=example.org")
    assert authserv == "mx.google.com"
    assert [(r.method, r.result) for r in results] == [("dkim", "pass"), ("spf", "pass"),
                                                       ("dmarc", "pass")]
    assert results[0].props["header.i"] == "@example.org"

    def verdict(*values: str, sender: str = "alice@example.org") -> bool:
        m = EmailMessage()
        for v in values:
            m["Authentication-Results"] = v
        m["From"] = sender
        return auth_verdict(m, "mx.example.org", sender)[0]

    assert verdict("mx.example.org; dmarc=pass header.from=example.org")
    assert verdict("mx.example.org; dkim=pass header.d=mail.example.org")  # aligned
    assert verdict("mx.example.org; spf=pass smtp.mailfrom=bounce@example.org")
    assert not verdict("mx.example.org; dkim=pass header.d=evil.test; spf=pass "
                       "smtp.mailfrom=x@evil.test; dmarc=fail header.from=example.org")
    assert not verdict("other.test; dmarc=pass header.from=example.org")  # another server
    assert not verdict()  # no verdict at all
    # The receiving server's header comes first; a pass the sender wrote below it is not
    # believed.
    assert not verdict("mx.example.org; dmarc=fail header.from=example.org",
                       "mx.example.org; dmarc=pass header.from=example.org")


def test_no_mail_reaches_the_agent_unless_its_sender_is_verified_or_trusted(
        tmp_path: Path) -> None:
    """From is only what the sender typed: with allow_from, the config must say how senders
    are verified (authserv_id) or that the From address is trusted (trust_from). A reaction
    mail is no message to answer."""
    from mdclaw.config import ConfigError, load_config

    pw = tmp_path / "pw"
    pw.write_text("secret\n")

    def config(extra: str) -> None:
        load_config(tmp_path / "c.yaml", text=(
            f"data_dir: {tmp_path}\nchannels: {{email: {{address: {OWN}, imap_host: h, "
            f"smtp_host: h, password_file: {pw}, allow_from: [alice@example.test]{extra}}}}}\n"))

    with pytest.raises(ConfigError) as e:
        config("")
    assert "channels.email.authserv_id:" in str(e.value) and "trust_from" in str(e.value)
    config(", authserv_id: mx.example.test")
    config(", trust_from: true")

    alice = make_mail("Alice <alice@example.test>", OWN, "hi", "token-x").as_bytes()
    base = {"address": OWN, "imap_host": "h", "smtp_host": "h", "password_file": pw}

    def read(raw: bytes, **section: Any) -> tuple[InboundMessage | None, str]:
        # The host's own check of who may write (is_allowed) stands in for allow_from, so
        # the section's own rule is what the channel applies, not the config's validation.
        ch = EmailChannel(EmailSection(**base, **section), password="secret",
                          is_allowed=lambda a: a == "alice@example.test")
        got = ch.read_mail(raw, uid="1-1")
        return got.message, got.why

    msg, why = read(alice)
    assert msg is None and "cannot be verified" in why
    msg, _ = read(alice, trust_from=True)
    assert msg is not None and msg.sender == "alice@example.test"
    msg, why = read(alice, authserv_id="mx.example.test")
    assert msg is None and "no Authentication-Results from mx.example.test" in why

    reaction = make_mail("alice@example.test", OWN, "Re: hi", "")
    reaction.set_content("\N{THUMBS UP SIGN}\r\n", disposition="reaction")
    msg, why = read(reaction.as_bytes(), trust_from=True)
    assert msg is None and "reaction" in why


def test_a_reply_loses_the_history_it_quotes_and_keeps_one_re() -> None:
    text = ("Sounds good, see you then.\n\nOn Mon, 3 Mar 2026 at 09:00, Andy <bot@example.test>"
            "\nwrote:\n> Shall we meet at 7?\n>\n> -- \n> Andy\n")
    assert strip_quoted(text) == "Sounds good, see you then."
    assert strip_quoted("> only a quote\n> nothing else") == "> only a quote\n> nothing else"
    assert strip_quoted("a\n> inline quote\nmy answer to it") == \
        "a\n> inline quote\nmy answer to it"
    assert strip_quoted("ok!\n\n-----Original Message-----\nFrom: x\nSubject: y\n\nold") == "ok!"
    assert reply_subject("Plan") == "Re: Plan"
    assert reply_subject("RE: Re: AW: Plan") == "Re: Plan"
    html = make_mail("alice@example.test", OWN, "s", "")
    html.set_content("<p>Hello <b>there</b></p><blockquote>x</blockquote>", subtype="html")
    assert read_incoming(parse_mail(html.as_bytes())).text.startswith("Hello **there**")


# --------------------------------------------------------------------------- the channel


class Harness:
    """An EmailChannel on the world's servers, its inbound messages, and its database."""

    def __init__(self, world: MailWorld, tmp: Path, assistant: User, allow: list[User],
                 *, db: Database | None = None,
                 on_inbound: Callable[[InboundMessage], Awaitable[None] | None] | None = None,
                 **section: Any) -> None:
        self.world = world
        self.assistant = assistant
        self.got: list[InboundMessage] = []
        self.db = db or Database(tmp / "state.db")
        self.section = EmailSection(**channel_section(world, assistant, allow, **section))
        self.ch = EmailChannel.from_config(self.section, on_inbound=on_inbound or self.got.append,
                                           db=self.db, display_name="Andy")
        self.ch.reconnect_backoff = Backoff(base=0.2, factor=2.0, cap=1.0, jitter=0)


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_mail_in_is_handed_over_once_and_marked_seen_only_after(
        mail_world: MailWorld, tmp_path: Path) -> None:
    w = mail_world
    bot, alice, bob = w.user(), w.user(), w.user()
    # Before the first start: an unread mail (taken) and one already read (not taken).
    w.send(make_mail(alice, bot, "waiting", "token-a"), as_user=alice)
    w.send(make_mail(alice, bot, "read already", "token-b"), as_user=alice)
    read_file = next(p for p in (bot.maildir / "new").iterdir()
                     if b"token-b" in p.read_bytes())
    read_file.rename(bot.maildir / "cur" / f"{read_file.name}:2,S")
    seen_when_handed: list[bool] = []
    h: Harness

    def host(m: InboundMessage) -> None:
        mid = "<" + m.id.split(":", 2)[2] + ">"
        seen_when_handed.append(w.seen_flags(bot)[mid])
        h.got.append(m)

    h = Harness(w, tmp_path, bot, [alice], on_inbound=host)

    async def go() -> None:
        await h.ch.connect()
        try:
            assert h.ch.status_info()["imap"] == "idle"
            await wait_until_async(lambda: len(h.got) == 1)
            w.send(make_mail(alice, bot, "news", "token-c\n\nOn Mon, Alice wrote:\n> old"),
                   as_user=alice)
            w.send(make_mail(bob, bot, "from bob", "token-d"), as_user=bob)  # not allowed
            await wait_until_async(lambda: len(h.got) == 2, timeout=15)
            await wait_until_async(lambda: sum(w.seen_flags(bot).values()) == 3)
            await holds_for(lambda: len(h.got) == 2, 1.0)
        finally:
            await h.ch.disconnect()

    run(go())
    a, c = h.got
    assert (a.chat_jid, a.sender, a.channel, a.addressed) == (
        f"mail:{alice.address}", alice.address, "email", True)
    assert a.content == "Subject: waiting\n\ntoken-a"
    assert c.content == "Subject: news\n\ntoken-c"  # the quoted history is not handed on
    assert seen_when_handed == [False, False]  # \Seen only after the host took it
    flags = {m["Subject"]: seen for m in w.mailbox(bot)
             for mid, seen in w.seen_flags(bot).items() if mid == str(m["Message-ID"])}
    assert flags == {"waiting": True, "read already": True, "news": True,
                     "from bob": False}  # a stranger's mail is left for the owner to read
    (value,) = h.db.query_one("SELECT value FROM router_state WHERE key LIKE 'email_uid:%'")
    assert value.split()[1] == "4"

    # A restart goes on after the UID saved: nothing comes twice, a new mail comes.
    again = Harness(w, tmp_path, bot, [alice], db=h.db)

    async def restart() -> None:
        await again.ch.connect()
        try:
            w.send(make_mail(alice, bot, "after restart", "token-e"), as_user=alice)
            await wait_until_async(lambda: again.got)
            await holds_for(lambda: len(again.got) == 1, 0.5)
        finally:
            await again.ch.disconnect()

    run(restart())
    assert [m.content for m in again.got] == ["Subject: after restart\n\ntoken-e"]


def test_a_renumbered_mailbox_is_looked_at_again_for_unread_mail(
        mail_world: MailWorld, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The UID saved is only good with its UIDVALIDITY: when the server says another (it
    renumbered the mailbox), the unread mail of the last days is taken again (a mail the host
    has is a duplicate it drops) and read mail is not; then the new numbering is saved."""
    caplog.set_level(logging.INFO)
    w = mail_world
    bot, alice = w.user(), w.user()
    h = Harness(w, tmp_path, bot, [alice])

    async def first() -> None:
        await h.ch.connect()
        try:
            w.send(make_mail(alice, bot, "handled", "token-r1"), as_user=alice)
            await wait_until_async(lambda: h.got)
            await wait_until_async(lambda: any(w.seen_flags(bot).values()))
            # The UID is saved after the mail is marked seen: wait for it, not just the flag.
            await wait_until_async(lambda: (h.ch._saved_seen.saved or " 0").split()[1] != "0",
                                   what="the handled mail's UID saved")
        finally:
            await h.ch.disconnect()

    run(first())
    (value,) = h.db.query_one("SELECT value FROM router_state WHERE key LIKE 'email_uid:%'")
    validity, uid = value.split()
    # While the channel is away: a mail comes, and the server's numbering changes (as
    # Dovecot's does when its index is rebuilt, or a mailbox is restored).
    w.send(make_mail(alice, bot, "while away", "token-r2"), as_user=alice)
    with h.db.transaction() as c:
        c.execute("UPDATE router_state SET value = ? WHERE key LIKE 'email_uid:%'",
                  (f"{int(validity) + 7} 999",))
    again = Harness(w, tmp_path, bot, [alice], db=h.db)

    async def second() -> None:
        await again.ch.connect()
        try:
            await wait_until_async(lambda: again.got)
            await holds_for(lambda: len(again.got) == 1, 0.5)
        finally:
            await again.ch.disconnect()

    run(second())
    # UID 999 of the old numbering would have hidden the new mail; the read one is not taken.
    assert [m.content for m in again.got] == ["Subject: while away\n\ntoken-r2"]
    assert "renumbered" in caplog.text
    (value,) = h.db.query_one("SELECT value FROM router_state WHERE key LIKE 'email_uid:%'")
    assert value == f"{validity} {int(uid) + 1}"


def test_a_forged_sender_and_a_host_that_refuses(mail_world: MailWorld, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A mail with an allowed From that the server did not authenticate is left alone; a
    mail the host does not take is not marked seen and comes again."""
    caplog.set_level(logging.INFO)
    w = mail_world
    bot, alice = w.user(), w.user()
    calls: list[str] = []
    h: Harness

    def host(m: InboundMessage) -> None:
        calls.append(m.content)
        if len(calls) == 1:
            raise sqlite3.OperationalError("database is locked")
        h.got.append(m)

    h = Harness(w, tmp_path, bot, [alice], on_inbound=host)
    h.ch.host_backoff = Backoff(base=0.2, factor=2.0, cap=1.0, jitter=0)

    async def go() -> None:
        await h.ch.connect()
        try:
            # Not logged in: the relay takes it as mail from outside and DMARC fails.
            w.send(make_mail(alice.address, bot, "forged", "token-forged",
                             headers={"Authentication-Results":
                                      f"{AUTHSERV}; dmarc=pass header.from=example.test"}))
            w.send(make_mail(alice, bot, "real", "token-real"), as_user=alice)
            await wait_until_async(lambda: h.got, timeout=15)
        finally:
            await h.ch.disconnect()

    run(go())
    assert calls == ["Subject: real\n\ntoken-real"] * 2
    assert [m.content for m in h.got] == ["Subject: real\n\ntoken-real"]
    assert "not authenticated" in caplog.text or "did not authenticate" in caplog.text


def test_a_mail_that_cannot_be_read_is_left_and_the_next_one_comes(
        mail_world: MailWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mdclaw.channels.email as channel_module

    read = channel_module.read_incoming

    def poisoned(msg: EmailMessage) -> Any:
        if "poison" in str(msg["Subject"]):
            raise UnicodeError("a part no codec can read")
        return read(msg)

    monkeypatch.setattr(channel_module, "read_incoming", poisoned)
    w = mail_world
    bot, alice = w.user(), w.user()
    h = Harness(w, tmp_path, bot, [alice])

    async def go() -> None:
        await h.ch.connect()
        try:
            w.send(make_mail(alice, bot, "poison", "token-bad"), as_user=alice)
            w.send(make_mail(alice, bot, "fine", "token-good"), as_user=alice)
            await wait_until_async(lambda: h.got, timeout=15)
            await holds_for(lambda: len(h.got) == 1, 0.5)
        finally:
            await h.ch.disconnect()

    run(go())
    assert [m.content for m in h.got] == ["Subject: fine\n\ntoken-good"]
    assert h.ch.status_info()["imap"] == "stopped" and "fix" not in h.ch.status_info()
    assert sorted(w.seen_flags(bot).values()) == [False, True]  # left for its owner


def test_answers_are_threaded_multipart_mail_with_files_and_reactions(
        mail_world: MailWorld, tmp_path: Path) -> None:
    w = mail_world
    bot, alice = w.user(), w.user()
    h = Harness(w, tmp_path, bot, [alice])
    first = make_mail(alice, bot, "Dinner plan", "token-1")
    doc = tmp_path / "menu.pdf"
    doc.write_bytes(b"%PDF-1.4 menu")

    async def go() -> None:
        await h.ch.connect()
        try:
            w.send(first, as_user=alice)
            await wait_until_async(lambda: h.got)
            jid = h.got[0].chat_jid
            await h.ch.send_message(jid, "**Yes**: at `7`\n\n- soup\n- bread")
            await h.ch.send_file(jid, doc, caption="the *menu*")
            await h.ch.react(jid, h.got[0].id, "\N{THUMBS UP SIGN}")
            # An id that is no Message-ID (an agent's typo) never reaches a header, nor does
            # it fall back to another mail: nothing is sent.
            for bad in (f"{h.got[0].id}</message>", f"{jid}:a b@x", f"{jid}:uid-1-1",
                        f"mail:other@example.test:{h.got[0].id.split(':', 2)[2]}"):
                with pytest.raises(ChannelError) as e:
                    await h.ch.react(jid, bad, "\N{THUMBS UP SIGN}")
                assert e.value.permanent, bad
            with pytest.raises(ChannelError) as e:
                await h.ch.send_message("mail:" + bot.address, "to myself")
            assert e.value.permanent
        finally:
            await h.ch.disconnect()

    run(go())
    answer, with_file, reaction = w.mailbox(alice)
    root = str(first["Message-ID"])
    for m in (answer, with_file, reaction):
        assert str(m["Subject"]) == "Re: Dinner plan"
        assert str(m["In-Reply-To"]) == root and str(m["References"]) == root
        assert str(m["Auto-Submitted"]) == "auto-replied"
        assert str(m["From"]) == f"Andy <{bot.address}>"
        assert str(m["Message-ID"]).endswith(".mdclaw@example.test>")
    assert answer.get_content_type() == "multipart/alternative"
    plain, html = body(answer), body(answer, "html")
    assert plain.strip() == "**Yes**: at `7`\n\n- soup\n- bread"
    assert "<strong>Yes</strong>" in html and "<code>7</code>" in html and "<li>soup</li>" in html
    (att,) = list(with_file.iter_attachments())
    assert att.get_filename() == "menu.pdf" and att.get_content() == b"%PDF-1.4 menu"
    assert "<em>menu</em>" in body(with_file, "html")
    assert reaction.get_content_disposition() == "reaction"
    assert reaction.get_content().strip() == "\N{THUMBS UP SIGN}"

    # The thread is remembered in the database: a new channel answers in it, and a
    # reply_to naming the first mail goes under it after a reply moved the thread on.
    again = Harness(w, tmp_path, bot, [alice], db=h.db)
    reply = make_mail(alice, bot, "Re: Dinner plan", "token-2", in_reply_to=str(
        answer["Message-ID"]), references=[root, str(answer["Message-ID"])])

    async def later() -> None:
        await again.ch.connect()
        try:
            w.send(reply, as_user=alice)
            await wait_until_async(lambda: again.got)
            assert again.got[0].content == "token-2"  # a reply: no subject line
            await again.ch.send_message(again.got[0].chat_jid, "noted")
            await again.ch.send_message(again.got[0].chat_jid, "about the first",
                                        reply_to=h.got[0].id)
        finally:
            await again.ch.disconnect()

    run(later())
    noted, about_first = w.mailbox(alice)[3:]
    assert str(noted["In-Reply-To"]) == str(reply["Message-ID"])
    assert str(noted["References"]).split() == [root, str(answer["Message-ID"]),
                                                str(reply["Message-ID"])]
    assert str(noted["Subject"]) == "Re: Dinner plan"
    assert str(about_first["In-Reply-To"]) == root


def test_smtp_4xx_waits_and_5xx_fails_through_the_outbox(mail_world: MailWorld,
                                                        tmp_path: Path) -> None:
    w = mail_world
    bot, alice = w.user(), w.user()
    h = Harness(w, tmp_path, bot, [alice])
    h.ch.smtp_retry_after = 0.5

    async def go() -> None:
        await h.ch.connect()
        worker = OutboxWorker(h.db, [h.ch], policy=RetryPolicy(max_attempts=3, base_delay=0.1,
                                                               jitter=0))
        await worker.start()
        try:
            w.relay.fail_next(451, "4.7.1 Try again later")
            with h.db.transaction() as c:
                later = enqueue(c, chat_jid=f"mail:{alice.address}", kind="text",
                                text="after a 451", source_group="g")
            worker.wake()
            await wait_until_async(lambda: get_row(h.db, later).status == "sent", timeout=15)
            row = get_row(h.db, later)
            assert row.attempts == 2 and "451" in (row.last_error or "")
            w.relay.fail_next(550, "5.1.1 mailbox unavailable")
            with h.db.transaction() as c:
                never = enqueue(c, chat_jid=f"mail:{alice.address}", kind="text",
                                text="after a 550", source_group="g")
            worker.wake()
            await wait_until_async(lambda: get_row(h.db, never).status == "failed")
            row = get_row(h.db, never)
            assert row.attempts == 1 and "550 5.1.1 mailbox unavailable" in row.last_error
        finally:
            await worker.stop()
            await h.ch.disconnect()

    run(go())
    assert [body(m).strip() for m in w.mailbox(alice)] == [
        "after a 451"]


def test_an_smtp_server_that_is_down_holds_mail_until_it_is_back(mail_world: MailWorld,
                                                                 tmp_path: Path) -> None:
    w = mail_world
    bot, alice = w.user(), w.user()
    h = Harness(w, tmp_path, bot, [alice])

    async def go() -> None:
        await h.ch.connect()
        worker = OutboxWorker(h.db, [h.ch], policy=RetryPolicy(max_attempts=2, base_delay=0.1),
                              disconnected_recheck=0.2)
        await worker.start()
        try:
            w.relay.stop()
            with h.db.transaction() as c:
                rid = enqueue(c, chat_jid=f"mail:{alice.address}", kind="text",
                              text="held", source_group="g")
            worker.wake()
            await wait_until_async(lambda: not h.ch.is_connected())
            info = h.ch.status_info()
            assert info["smtp"] == "down" and "check channels.email.smtp_host" in info["fix"]
            await asyncio.sleep(1.0)
            assert get_row(h.db, rid).status == "pending"
            assert get_row(h.db, rid).attempts <= 1  # waiting does not use up its tries
            w.relay.start()
            await wait_until_async(lambda: get_row(h.db, rid).status == "sent", timeout=20)
            assert h.ch.is_connected() and "fix" not in h.ch.status_info()
        finally:
            await worker.stop()
            await h.ch.disconnect()

    run(go())
    assert len(w.mailbox(alice)) == 1


def test_a_wrong_password_or_an_untrusted_certificate_says_what_to_fix(
        mail_world: MailWorld, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    w = mail_world
    bot, alice = w.user(), w.user()
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)

    async def connect_fails(**section: Any) -> str:
        h = Harness(w, tmp_path, bot, [alice], **section)
        with pytest.raises(ChannelError) as e:
            await h.ch.connect()
        assert not h.ch.is_connected()
        return str(e.value)

    login = asyncio.run(connect_fails(password_file=str(wrong)))
    assert "refused the login" in login and "password_file" in login
    assert "not-the-password" not in login
    tls = asyncio.run(connect_fails(ca_file=None))
    assert "certificate is not trusted" in tls and "ca_file" in tls

    # doctor's look at both servers
    good = EmailSection(**channel_section(w, bot, [alice]))
    assert [c[:2] for c in probe(good, bot.password, bot.password)] == [
        ("email imap", "ok"), ("email smtp", "ok")]
    checks = probe(good, "not-the-password", "not-the-password")
    assert [c[:2] for c in checks] == [("email imap", "fail"), ("email smtp", "fail")]
    assert all("refused the login" in c[2] and "app password" in c[3] for c in checks)
    untrusted = EmailSection(**channel_section(w, bot, [alice], ca_file=None,
                                               smtp_security="tls",
                                               smtp_port=w.relay.tls_port))
    checks = probe(untrusted, bot.password, bot.password)
    assert all(c[1] == "fail" and "ca_file" in c[3] for c in checks)
    tls_to_plain = EmailSection(**channel_section(w, bot, [alice],
                                                  imap_port=w.dovecot.imap_port))
    (imap, _smtp) = probe(tls_to_plain, bot.password, bot.password)
    assert imap[1] == "fail" and "TLS failed" in imap[2] and "imap_security" in imap[3]
    for record in caplog.records:  # the passwords are never logged (imaplib's debug too)
        assert bot.password not in record.getMessage()
        assert "not-the-password" not in record.getMessage()


def test_a_server_without_idle_is_polled(mail_world: MailWorld, tmp_path: Path) -> None:
    w = mail_world
    # Users of its own (n1@...): the assistant is never a user of the world's Dovecot.
    no_idle = Dovecot(w.root / "no-idle", w.cert, w.cert.with_name("key.pem"), idle=False,
                      user_prefix="n")
    no_idle.root.mkdir()
    no_idle.write_config()
    no_idle.add_users(1)
    no_idle.start()
    try:
        bot = no_idle.take_user()
        alice = w.user()
        h = Harness(w, tmp_path, bot, [alice], imap_port=no_idle.imaps_port,
                    poll_interval="1s", authserv_id=None, trust_from=True)

        async def go() -> None:
            await h.ch.connect()
            try:
                assert h.ch.status_info()["imap"] == "polling"
                no_idle.deliver(bot.address, make_mail(alice, bot, "polled", "token-p")
                                .as_bytes())
                await wait_until_async(lambda: h.got, timeout=10)
            finally:
                await h.ch.disconnect()

        run(go())
        assert h.got[0].content.endswith("token-p")
    finally:
        no_idle.stop()


def test_a_mail_too_large_is_named_not_read(mail_world: MailWorld, tmp_path: Path) -> None:
    w = mail_world
    bot, alice = w.user(), w.user()
    h = Harness(w, tmp_path, bot, [alice])
    h.ch.max_mail_bytes = 50_000

    async def go() -> None:
        await h.ch.connect()
        try:
            w.send(make_mail(alice, bot, "scan", "see the file",
                             files=[("scan.bin", "application/octet-stream", b"x" * 80_000)]),
                   as_user=alice)
            w.send(make_mail(alice, bot, "small", "token-small",
                             files=[("a.txt", "text/plain", b"tiny")]), as_user=alice)
            await wait_until_async(lambda: len(h.got) == 2, timeout=15)
        finally:
            await h.ch.disconnect()

    run(go())
    big, small = h.got
    assert "more than mdclaw reads" in big.content and big.attachments == ()
    (att,) = small.attachments
    assert (att.kind, att.name, att.mime, att.size) == ("document", "a.txt", "text/plain", 4)
    assert asyncio.run(att.fetch(10)) == b"tiny"
    with pytest.raises(ChannelError):
        asyncio.run(att.fetch(3))


def test_doctor_status_and_check_config_say_what_to_fix(
        mail_world: MailWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        cli: Any) -> None:
    import json

    import yaml

    from mdclaw.config import load_config
    from mdclaw.ops import email as ops_email

    w = mail_world
    bot, alice, bob = w.user(), w.user(), w.user()
    section = channel_section(w, bot, [alice], authserv_id=None, trust_from=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "data_dir": str(tmp_path / "data"), "server": None,
        "runtime": {"socket": f"unix://{tmp_path}/no-engine.sock"},
        "groups": {"main": {"name": "A", "jid": "hl:main", "main": True},
                   "bob": {"name": "Bob", "jid": f"mail:{bob.address}"}},
        "channels": {"http": None, "email": section}}))
    checked = cli("check-config", "--config", str(path))
    assert checked.returncode == 0, checked.stderr
    assert f"{bob.address} is neither in channels.email.allow_from nor a person" in checked.stderr

    doctor = cli("doctor", "--json", "--config", str(path))
    checks = {c["check"]: c for c in json.loads(doctor.stdout)}
    assert checks["email imap"]["level"] == "ok" and "IDLE" in checks["email imap"]["detail"]
    assert checks["email smtp"]["level"] == "ok"
    assert checks["email senders"]["level"] == "warn"
    assert "authserv_id" in checks["email senders"]["fix"]
    assert checks["channels.email.password_file"]["level"] == "ok"

    status = cli("status", "--config", str(path))
    assert (f"email: {bot.address} (IMAP 127.0.0.1:{w.dovecot.imaps_port} tls, SMTP "
            f"127.0.0.1:{w.relay.starttls_port} starttls); 1 allowed sender (From address "
            "not verified)") in status.stdout

    # Without the library: check-config fails naming the extra at channels.email
    # (tests/test_cli_extras.py runs the commands so); the channel says the same line, and
    # doctor's email checks ask no server (its extras check fails instead).
    import sys

    from mdclaw.config import check_extras

    monkeypatch.setitem(sys.modules, "imapclient", None)
    cfg = load_config(path)
    (line,) = check_extras(cfg)
    assert line.startswith("channels.email: the email channel needs imapclient")
    assert "pip install 'mdclaw[email]'" in line
    with pytest.raises(ChannelError, match=r"mdclaw\[email\]") as e:
        asyncio.run(EmailChannel.from_config(cfg.channels.email).connect())
    assert e.value.permanent
    checks = asyncio.run(ops_email.email_checks(cfg))
    assert [c[0] for c in checks] == ["email senders", "email"]  # no server asked


def _reply(body: bytes, *, ctype: bytes = b"text/plain; charset=utf-8; format=flowed",
           cte: bytes = b"quoted-printable") -> bytes:
    """A reply to a card as a mail client sends it (raw, CRLF, the card's Message-ID)."""
    return (b"From: Jane Doe <alice@example.test>\r\nTo: Andy <" + OWN.encode() + b">\r\n"
            b"Subject: Re: Approval #3: ha_call_service\r\n"
            b"Date: Tue, 03 Mar 2026 09:05:00 +0100\r\n"
            b"Message-ID: <CAF=reply1@mail.example.test>\r\n"
            b"In-Reply-To: <card-3@bot.example.test>\r\n"
            b"References: <card-3@bot.example.test>\r\n"
            b"MIME-Version: 1.0\r\nContent-Type: " + ctype + b"\r\n"
            b"Content-Transfer-Encoding: " + cte + b"\r\n\r\n" + body)


CARD_QUOTE = (b"> Approval #3 (group main): ha_call_service light.turn_on\r\n"
              b"> Reply \"approve 7KQ2\" / \"deny 7KQ2\".\r\n")


def test_a_reply_code_is_read_past_a_signature_and_the_quoted_card(tmp_path: Path) -> None:
    """What the person wrote themselves (own_words) is what a reply code is read from: a
    signature ("-- " line, RFC 3676) and the card quoted above or below the answer are not
    part of it; the text the agent sees loses the signature too."""
    pw = tmp_path / "pw"
    pw.write_text("secret\n")
    ch = EmailChannel(EmailSection(address=OWN, imap_host="h", smtp_host="h",
                                   password_file=pw, trust_from=True), password="secret",
                      is_allowed=lambda a: a == "alice@example.test")

    def read(raw: bytes) -> InboundMessage:
        got = ch.read_mail(raw, uid="1-1")
        assert got.message is not None, got.why
        return got.message

    # top-posted (Gmail, Apple Mail): answer, signature (quoted-printable "--=20"), the card
    top = read(_reply(b"approve 7KQ2\r\n\r\n--=20\r\nJane Doe\r\nExample Corp\r\n\r\n"
                      b"On Tue, 3 Mar 2026 at 09:00, Andy <bot@example.test> wrote:\r\n"
                      + CARD_QUOTE))
    assert top.own_words == "approve 7KQ2"
    assert top.content == "approve 7KQ2"  # no signature, no quoted card
    # bottom-posted: the card quoted first, the answer below it, then the signature
    bottom = read(_reply(b"On Tue, 3 Mar 2026 at 09:00, Andy <bot@example.test>\r\n"
                         b"wrote:\r\n" + CARD_QUOTE + b"\r\nDeny 7kq2.\r\n\r\n-- \r\nJane\r\n",
                         cte=b"8bit"))
    assert bottom.own_words == "Deny 7kq2."
    assert "> Reply" in bottom.content and "Jane" not in bottom.content  # context stays
    # Outlook: the answer, a signature without the "-- " line, the original below a divider
    outlook = read(_reply(b"approve 7KQ2\r\n\r\n-----Original Message-----\r\n"
                          b"From: Andy <bot@example.test>\r\nSubject: Approval #3\r\n\r\n"
                          b"Reply \"approve 7KQ2\" / \"deny 7KQ2\".\r\n", cte=b"8bit"))
    assert outlook.own_words == "approve 7KQ2"
    # an HTML-only reply (a signature block, the card in a blockquote)
    html = read(_reply(b"<div dir=3D\"ltr\">approve 7KQ2<br><br>-- <br><div class=3D\"gmail_"
                       b"signature\">Jane</div></div><br><div class=3D\"gmail_quote\"><div>"
                       b"On Tue, 3 Mar 2026 at 09:00, Andy &lt;bot@example.test&gt; wrote:<br>"
                       b"</div><blockquote>Reply \"approve 7KQ2\" / \"deny 7KQ2\".</blockquote>"
                       b"</div>", ctype=b"text/html; charset=utf-8"))
    assert html.own_words == "approve 7KQ2"
    # a mail that only quotes the card says nothing of its own: never the code's answer
    quoted = read(_reply(b"On Tue, 3 Mar 2026 at 09:00, Andy <bot@example.test> wrote:\r\n"
                         + CARD_QUOTE, cte=b"8bit"))
    assert quoted.own_words == ""
    # words and a "--" that is no signature delimiter stay
    plain = read(_reply(b"approve 7KQ2 -- and thanks\r\n--\r\nnot a signature\r\n",
                        cte=b"8bit"))
    assert plain.own_words == "approve 7KQ2 -- and thanks\n--\nnot a signature"
