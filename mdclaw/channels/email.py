"""Email (`mail:<address>`, one chat per person): IMAP for mail in, SMTP for mail out.

In: the mailbox (`channels.email.mailbox`, INBOX) is watched with IMAP IDLE, so new mail comes
at once; a server without IDLE is looked at every `poll_interval`. Each new mail (by UID, in
order) is read: mail that must never be answered is left alone (our own mail, auto-replies,
bounces and reports, bulk and list mail: mdclaw.channels.email_format.loop_reason), and so is
mail from anyone not allowed (`allow_from`, or a check the host gives: `is_allowed`) or whose
sender the receiving server did not authenticate (its Authentication-Results, `authserv_id`;
only `trust_from: true` believes the From address alone: docs/security.md). The rest becomes
an InboundMessage with id `mail:<address>:<Message-ID>` (a redelivery is a duplicate the host
drops), its files as Attachments. Only after the host stored it is the mail marked \\Seen, and
then the UID is written, with the mailbox's UIDVALIDITY, to the state database (router_state,
on a thread, never on the event loop): a restart goes on after that UID, so a crash at any
point neither loses a mail (it is still there, after the saved UID) nor hands one over twice
(the host has its id). At the first start, and when the server renumbered the mailbox
(another UIDVALIDITY), the unread mail of the last FIRST_LOOK_DAYS days is taken.

Out: each answer is a mail (multipart/alternative: the Markdown as text, the markup layer's
HTML) to the chat's address, under the person's latest mail (or the one `reply_to` names):
In-Reply-To, References and "Re: <subject>", remembered per address in the state database so
an answer after a restart still goes into its thread. Files go as attachments, reactions as
RFC 9078 reaction mails. An SMTP 4xx is "try again later" (`retry_after`), a 5xx is
permanent; a server that cannot be reached, refuses the login or fails TLS makes the channel
"not connected" (the outbox keeps the mail) until a retry with backoff logs in again.

IMAP uses imapclient (the `email` extra), SMTP the standard library's smtplib; both are
blocking, so each runs on a thread of the channel's own (the IMAP one waits in IDLE; a
disconnect shuts its socket down to end the wait at once). Passwords never reach a log or
an error: `redact` masks them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import mimetypes
import re
import smtplib
import socket
import sqlite3
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import date, timedelta
from email.message import EmailMessage
from pathlib import Path
from typing import Any, TypeVar

from mdclaw.channels.base import (
    Attachment,
    Channel,
    ChannelError,
    InboundCallback,
    InboundMessage,
    SavedPosition,
    kind_for_mime,
    read_upload,
)
from mdclaw.channels.email_format import (
    MailFile,
    Thread,
    auth_verdict,
    build_mail,
    domain_of,
    first_line_subject,
    is_reaction,
    loop_reason,
    message_ids,
    new_message_id,
    parse_mail,
    reaction_mail,
    read_incoming,
    reply_subject,
    sender_of,
)
from mdclaw.config import EXTRAS, MissingExtra, read_secret
from mdclaw.config import EmailChannel as EmailSection
from mdclaw.retry import Backoff, wait
from mdclaw.state import Database, now_iso
from mdclaw.state.conversations import get_router_value, set_router_value

log = logging.getLogger("mdclaw.channels.email")

T = TypeVar("T")

JID_RE = re.compile(r"^mail:([^@\s:]+@[^@\s:]+)\Z")
FIRST_LOOK_DAYS = 3
MAX_UPLOAD_BYTES = 25 * 1024 * 1024  # what Gmail and most providers take in one mail
THREADS_KEPT = 20  # mails per address whose threading headers are remembered
QUOTA_RETRY = 3600.0  # 5.4.5: a sending quota (Gmail's daily limit) is exceeded


def imapclient_module() -> Any:
    """The imapclient package. Raises ChannelError (permanent) naming the extra to install
    when it is missing (mdclaw.config.extras: the same line check-config and doctor say)."""
    try:
        import imapclient  # the `email` extra: imported only where mail is used
    except ImportError as e:
        missing = MissingExtra("channels.email", EXTRAS["email"], f"cannot be imported ({e})")
        raise ChannelError(missing.message, permanent=True) from None
    return imapclient


class MailTrouble(ChannelError):
    """A mail server could not be used. `kind`: tls, login, unreachable or server; `fix`
    says what to do (the operator reads it in status and doctor)."""

    def __init__(self, message: str, *, kind: str, fix: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.fix = fix


def ssl_context(section: EmailSection) -> ssl.SSLContext:
    """Certificate and host name checked, against `ca_file` when set (else the system's)."""
    return ssl.create_default_context(cafile=str(section.ca_file) if section.ca_file else None)


def trouble(e: BaseException, server: str, section: EmailSection) -> MailTrouble:
    """`e`, met talking to the IMAP or SMTP `server`, as the operator should read it."""
    if isinstance(e, MailTrouble):
        return e
    key = server.lower()
    host = section.imap_host if key == "imap" else section.smtp_host
    port = section.imap_port_used if key == "imap" else section.smtp_port_used
    where = f"{server} {host}:{port}"
    tls_ports = "993 and starttls for 143" if key == "imap" else "465 and starttls for 587"
    if isinstance(e, ssl.SSLCertVerificationError):
        return MailTrouble(
            f"{where}: its certificate is not trusted ({e.verify_message or e.reason})",
            kind="tls", fix=f"check that channels.email.{key}_host is the name in the "
            "server's certificate; a server with a certificate of its own CA needs "
            "channels.email.ca_file (that CA's PEM file)")
    if isinstance(e, ssl.SSLError):
        return MailTrouble(f"{where}: TLS failed ({e.reason or e})", kind="tls",
                           fix=f"check channels.email.{key}_security and {key}_port: tls for "
                           f"{tls_ports}")
    login_errors: tuple[type[BaseException], ...] = (smtplib.SMTPAuthenticationError,)
    capability_errors: tuple[type[BaseException], ...] = (smtplib.SMTPNotSupportedError,)
    imap_errors: tuple[type[BaseException], ...] = ()
    try:
        exc = imapclient_module().exceptions
        login_errors += (exc.LoginError,)
        capability_errors += (exc.CapabilityError,)
        imap_errors = (exc.IMAPClientError,)
    except ChannelError:
        pass
    user = section.login if key == "imap" else section.smtp_login
    if isinstance(e, login_errors):
        pw = "password_file" if key == "imap" else "smtp_password_file (or password_file)"
        return MailTrouble(
            f"{where} refused the login of {user}", kind="login",
            fix=f"check channels.email.{'user' if key == 'imap' else 'smtp_user'} and {pw}; "
            "with Gmail use an app password (docs/channels.md: Email)")
    if isinstance(e, capability_errors):
        return MailTrouble(f"{where}: {e}", kind="tls",
                           fix=f"the server does not offer what channels.email.{key}_security "
                           f"asks for: tls for {tls_ports}")
    if isinstance(e, socket.gaierror):
        return MailTrouble(f"{where}: the name does not resolve ({e.strerror or e})",
                           kind="unreachable", fix=f"check channels.email.{key}_host")
    if isinstance(e, smtplib.SMTPResponseException):
        return MailTrouble(f"{where} answered {e.smtp_code} {_text(e.smtp_error)}",
                           kind="server", fix=f"see what {host} says; mdclaw keeps trying")
    if isinstance(e, OSError | smtplib.SMTPException | EOFError) or isinstance(e, imap_errors):
        what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return MailTrouble(f"{where}: {what}", kind="unreachable",
                           fix=f"check channels.email.{key}_host, {key}_port and "
                           f"{key}_security (tls for {tls_ports}), and that the server runs; "
                           "mdclaw keeps trying")
    return MailTrouble(f"{where}: {type(e).__name__}: {e}", kind="server",
                       fix="see the log; mdclaw keeps trying")


def _text(value: Any) -> str:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return " ".join(text.split())[:300]


# --------------------------------------------------------------------------- the servers
# Blocking: called on a thread (the channel's own, or doctor's).

def open_imap(section: EmailSection, password: str, timeout: float) -> Any:
    """An IMAPClient logged in to `section`'s server. Raises what the library raises."""
    imapclient = imapclient_module()
    ctx = ssl_context(section)
    tls = section.imap_security == "tls"
    client = imapclient.IMAPClient(
        section.imap_host, port=section.imap_port_used, ssl=tls,
        ssl_context=ctx if tls else None,
        timeout=imapclient.SocketTimeout(connect=timeout, read=timeout))
    try:
        if section.imap_security == "starttls":
            client.starttls(ctx)
        client.login(section.login, password)
    except BaseException:
        _close_imap(client)
        raise
    return client


def _close_imap(client: Any) -> None:
    try:
        client.shutdown()
    except Exception:  # noqa: BLE001, S110 - closing a connection that is gone already
        pass


def open_smtp(section: EmailSection, password: str, timeout: float) -> smtplib.SMTP:
    """An SMTP connection logged in to `section`'s server. Raises what smtplib raises."""
    ctx = ssl_context(section)
    host, port = section.smtp_host, section.smtp_port_used
    smtp: smtplib.SMTP
    if section.smtp_security == "tls":
        smtp = smtplib.SMTP_SSL(host, port, timeout=timeout, context=ctx)
    else:
        smtp = smtplib.SMTP(host, port, timeout=timeout)
    try:
        smtp.ehlo()
        if section.smtp_security == "starttls":
            smtp.starttls(context=ctx)
            smtp.ehlo()
        smtp.login(section.smtp_login, password)
    except BaseException:
        smtp.close()
        raise
    return smtp


def probe(section: EmailSection, password: str, smtp_password: str,
          timeout: float = 15.0) -> list[tuple[str, str, str, str]]:
    """doctor's look at both servers: [(check, level, detail, fix)] for IMAP (TLS, login, the
    mailbox, IDLE) and SMTP (TLS, login). Blocking."""
    out: list[tuple[str, str, str, str]] = []
    try:
        client = open_imap(section, password, timeout)
        try:
            client.select_folder(section.mailbox, readonly=True)
            idle = client.has_capability("IDLE")
        finally:
            _close_imap(client)
        how = ("IDLE: new mail comes at once" if idle else
               f"no IDLE: the mailbox is looked at every "
               f"{int(section.poll_interval.total_seconds())} s")
        out.append(("email imap", "ok", f"{section.imap_host}: logged in as "
                    f"{section.login}, {section.mailbox} is there ({how})", ""))
    except Exception as e:  # noqa: BLE001 - every failure is the check's answer
        t = _mailbox_trouble(e, section)
        out.append(("email imap", "fail", _masked(str(t), password), t.fix))
    try:
        smtp = open_smtp(section, smtp_password, timeout)
        with _quietly():
            smtp.quit()
        out.append(("email smtp", "ok", f"{section.smtp_host}: logged in as "
                    f"{section.smtp_login}", ""))
    except Exception as e:  # noqa: BLE001 - every failure is the check's answer
        t = trouble(e, "SMTP", section)
        out.append(("email smtp", "fail", _masked(str(t), smtp_password), t.fix))
    return out


def _mailbox_trouble(e: BaseException, section: EmailSection) -> MailTrouble:
    """An IMAP error; a SELECT the server refused names the mailbox."""
    t = trouble(e, "IMAP", section)
    if t.kind == "unreachable" and "select" in str(e).lower():
        return MailTrouble(f"IMAP {section.imap_host}: the mailbox {section.mailbox!r} "
                           f"cannot be opened ({e})", kind="server",
                           fix="check channels.email.mailbox (INBOX for the inbox)")
    return t


def _masked(text: str, *secrets: str) -> str:
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    return text


class _quietly:
    """Ignore what closing a connection raises."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


@dataclass
class _Box:
    """The open IMAP connection with what SELECT said. Used on the IMAP thread only (but
    `interrupt`, which ends a wait from the event loop's thread)."""

    client: Any
    uidvalidity: int
    uidnext: int
    idle: bool
    broken: bool = False

    def interrupt(self) -> None:
        self.broken = True
        try:
            self.client.socket().shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _read_ahead(client: Any) -> bool:
    """True when the IMAP library has read more of the server's answer than it handed on.

    IDLE's "+ idling" and a push that follows at once ("* 4 EXISTS") can come in one packet:
    imaplib's buffered reader then holds the push, the socket has nothing more to say, and
    imapclient's idle_check (which waits on the socket) would not see it until the server
    speaks again. A look into the buffer (the socket non-blocking, so nothing waits) tells.
    """
    reader = getattr(getattr(client, "_imap", None), "file", None)
    if reader is None or not hasattr(reader, "peek"):
        return True  # cannot tell: look at the mailbox (a search costs little)
    sock = client.socket()
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        return bool(reader.peek(1))
    except OSError:  # nothing buffered, nothing on the socket (would block)
        return False
    finally:
        sock.settimeout(timeout)


# --------------------------------------------------------------------------- the channel

@dataclass(frozen=True)
class _Read:
    """One mail as read: what to hand over (None: nothing) and the thread it starts."""

    message: InboundMessage | None
    thread: Thread | None
    why: str = ""  # why nothing is handed over


class EmailChannel(Channel):
    """One mailbox (IMAP) and the server mail goes out through (SMTP)."""

    name = "email"
    jid_prefix = "mail:"
    max_message_length = 200_000  # a mail has no length limit worth cutting at
    # Waits before connecting again after a failure: 2 s doubling to 5 min (a server that
    # refuses the login is not asked every second).
    reconnect_backoff = Backoff(base=2.0, factor=2.0, cap=300.0)
    # Waits while the host does not take a mail (its database is locked, say).
    host_backoff = Backoff(base=1.0, factor=2.0, cap=60.0)
    smtp_retry_after = 60.0  # an SMTP 4xx: try again after this long
    idle_renew = 300.0  # an IDLE is ended and started again (and the mailbox searched)
    io_timeout = 20.0  # one network operation (connect, a command) at most

    def __init__(self, section: EmailSection, *, password: str,
                 smtp_password: str | None = None, on_inbound: InboundCallback | None = None,
                 db: Database | None = None, display_name: str | None = None,
                 trigger: str | None = None, max_mail_bytes: int = 100 * 1024 * 1024,
                 is_allowed: Callable[[str], bool] | None = None) -> None:
        super().__init__(on_inbound)
        if not password:
            raise ChannelError("channels.email.password_file is empty")
        self.section = section
        self.address = section.address
        self._password = password
        self._smtp_password = smtp_password or password
        self.db = db
        self.display_name = section.display_name or display_name
        self.trigger = trigger
        self.max_mail_bytes = max_mail_bytes
        allowed = frozenset(section.allow_from)
        # Who may reach the assistant: the allow-list, or what the host says (the people it
        # knows, issue "People and approvals": their `email` identities).
        self.is_allowed: Callable[[str], bool] = is_allowed or allowed.__contains__
        self._imap_pool: ThreadPoolExecutor | None = None
        self._smtp_pool: ThreadPoolExecutor | None = None
        self._box: _Box | None = None
        self._task: asyncio.Task[None] | None = None
        self._smtp_task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._running = False
        self.imap_state = "stopped"  # connecting | idle | polling | down | stopped
        self.imap_problem: MailTrouble | None = None
        self.smtp_problem: MailTrouble | None = None
        # (UIDVALIDITY, the last UID handled) of the mailbox, as saved.
        self._seen: tuple[int, int] | None = None
        self._saved_seen = SavedPosition(db, lambda: self._uid_key, channel="email",
                                         what="last mail handled")
        self._threads: dict[str, dict[str, Any]] = {}  # address -> threads (cached)
        self._refused_logged: set[str] = set()

    @classmethod
    def from_config(cls, section: EmailSection, *, on_inbound: InboundCallback | None = None,
                    db: Database | None = None, display_name: str | None = None,
                    trigger: str | None = None, max_mail_bytes: int = 100 * 1024 * 1024,
                    is_allowed: Callable[[str], bool] | None = None) -> EmailChannel:
        """Build from `channels.email`; reads the password files now. Raises ChannelError
        naming the file (never its content) when one cannot be read."""
        secrets: list[str | None] = []
        for key in ("password_file", "smtp_password_file"):
            path = getattr(section, key)
            if path is None:
                secrets.append(None)
                continue
            try:
                secrets.append(read_secret(path))
            except OSError as e:
                raise ChannelError(f"cannot read channels.email.{key} {path}: "
                                   f"{e.strerror}") from None
        return cls(section, password=secrets[0] or "", smtp_password=secrets[1],
                   on_inbound=on_inbound, db=db, display_name=display_name, trigger=trigger,
                   max_mail_bytes=max_mail_bytes, is_allowed=is_allowed)

    # ------------------------------------------------------------------ helpers
    def redact(self, text: str) -> str:
        return _masked(text, self._password, self._smtp_password)

    def is_connected(self) -> bool:
        """True while mail can be sent: running, and the SMTP server not known to be down."""
        return self._running and self.smtp_problem is None

    def status_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"connected": self.is_connected(), "imap": self.imap_state,
                                "smtp": "down" if self.smtp_problem else "ok"}
        problems = [p for p in (self.imap_problem, self.smtp_problem) if p is not None]
        if problems:
            info["detail"] = "; ".join(self.redact(str(p)) for p in problems)
            info["fix"] = "; ".join(p.fix for p in problems)
        else:
            info["detail"] = {"idle": "IMAP IDLE: new mail comes at once",
                              "polling": "no IMAP IDLE: the mailbox is looked at every "
                              f"{int(self.section.poll_interval.total_seconds())} s",
                              }.get(self.imap_state, f"IMAP: {self.imap_state}")
        return info

    @property
    def _uid_key(self) -> str:
        s = self.section
        return f"email_uid:{s.login}@{s.imap_host}/{s.mailbox}"

    async def _on_imap(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the IMAP thread."""
        assert self._imap_pool is not None
        return await asyncio.get_running_loop().run_in_executor(
            self._imap_pool, functools.partial(fn, *args))

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> None:
        """Log in to the IMAP server and start taking mail.

        Raises ChannelError when imapclient is missing, or when the server refuses the login
        or its TLS (the config must change). When the server cannot be reached the channel
        starts anyway and connects as soon as it answers.
        """
        if self._running:
            return
        imapclient_module()
        self._stop = asyncio.Event()
        self._imap_pool = ThreadPoolExecutor(1, thread_name_prefix="mdclaw-imap")
        self._smtp_pool = ThreadPoolExecutor(1, thread_name_prefix="mdclaw-smtp")
        self._running = True
        self.imap_state = "connecting"
        await self._load_seen()
        try:
            await self._open_box()
        except MailTrouble as t:
            if t.kind in ("login", "tls"):
                await self.disconnect()
                self.imap_problem = t
                raise ChannelError(f"{self.redact(str(t))}; {t.fix}") from None
            self._imap_down(t)
            log.warning("email: %s; will keep trying", self.redact(str(t)))
        self._task = asyncio.create_task(self._inbound_loop(), name="email-imap")

    async def disconnect(self) -> None:
        """Stop taking mail, end the IMAP wait at once and close both servers' connections.
        What was handed over is saved already (the UID after each mail)."""
        self._running = False
        self._stop.set()
        box = self._box
        if box is not None:
            box.interrupt()  # the IMAP thread's wait ends now
        tasks = [t for t in (self._task, self._smtp_task) if t is not None]
        self._task = self._smtp_task = None
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for t, r in zip(tasks, results, strict=True):
            if isinstance(r, Exception):
                log.warning("email: %s had ended with an error: %s", t.get_name(),
                            self.redact(f"{type(r).__name__}: {r}"))
        for pool in (self._imap_pool, self._smtp_pool):
            if pool is not None:
                if box is not None and pool is self._imap_pool:
                    pool.submit(_close_imap, box.client)
                pool.shutdown(wait=False, cancel_futures=False)
        self._imap_pool = self._smtp_pool = None
        self._box = None
        self.imap_state = "stopped"

    def _imap_down(self, t: MailTrouble) -> None:
        self.imap_state = "down"
        self.imap_problem = t

    async def _open_box(self) -> None:
        """Connect, log in and select the mailbox (on the IMAP thread)."""
        self.imap_state = "connecting"
        try:
            self._box = await self._on_imap(self._open_blocking)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - sorted into MailTrouble
            raise _mailbox_trouble(e, self.section) from None
        self.imap_problem = None
        self.imap_state = "idle" if self._box.idle else "polling"
        log.info("email: connected to %s as %s (%s)", self.section.imap_host,
                 self.section.login, "IDLE" if self._box.idle else "polling")

    def _open_blocking(self) -> _Box:
        client = open_imap(self.section, self._password, self.io_timeout)
        try:
            info = client.select_folder(self.section.mailbox)
            idle = client.has_capability("IDLE")
        except BaseException:
            _close_imap(client)
            raise
        return _Box(client, int(info.get(b"UIDVALIDITY", 0)), int(info.get(b"UIDNEXT", 1)),
                    bool(idle))

    # ------------------------------------------------------------------ mail in
    async def _inbound_loop(self) -> None:
        failures = 0
        while self._running:
            try:
                if self._box is None:
                    await self._open_box()
                failures = 0
                # Until a search finds nothing new: the server may have told of a mail that
                # came meanwhile in any command's answer, and IDLE would not tell it again.
                while await self._take_new():
                    pass
                await self._wait_for_news()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure: connect again, with backoff
                if not self._running:
                    return
                t = _mailbox_trouble(e, self.section)
                failures += 1
                self._imap_down(t)
                box, self._box = self._box, None
                if box is not None and self._imap_pool is not None:
                    await self._on_imap(_close_imap, box.client)
                delay = self.reconnect_backoff.delay(failures)
                log.warning("email: %s; connecting again in %.0f s", self.redact(str(t)),
                            delay)
                if await wait(delay, self._stop):
                    return

    async def _wait_for_news(self) -> None:
        """Wait until the mailbox may have new mail: IDLE's EXISTS (at most idle_renew
        seconds), or poll_interval without IDLE."""
        box = self._box
        assert box is not None
        if box.idle:
            await self._on_imap(self._idle_blocking, box, self.idle_renew)
        elif not await wait(self.section.poll_interval.total_seconds(), self._stop):
            await self._on_imap(box.client.noop)

    @staticmethod
    def _idle_blocking(box: _Box, timeout: float) -> bool:
        """IDLE until the server says a mail came (True) or `timeout` passes (False)."""
        client = box.client
        client.idle()
        news = _read_ahead(client)
        try:
            deadline = time.monotonic() + timeout
            while not news and not box.broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                t0 = time.monotonic()
                got = client.idle_check(timeout=left)
                for r in got:
                    if r and r[0] == b"BYE":
                        raise ConnectionError("the IMAP server ended the session (BYE)")
                    if len(r) > 1 and r[1] in (b"EXISTS", b"RECENT"):
                        news = True
                if not got and time.monotonic() - t0 < left - 0.5:
                    # Woken with nothing to read: the connection may have closed. Leaving
                    # IDLE tells (it fails if so); otherwise the mailbox is simply searched.
                    news = True
        except BaseException:
            box.broken = True
            raise
        finally:
            if not box.broken:
                client.idle_done()
        if box.broken:
            raise ConnectionError("the IMAP connection was closed")
        return news

    async def _take_new(self) -> int:
        """Hand over every mail after the last one handled, in UID order; returns how many
        the search found."""
        box = self._box
        assert box is not None
        after: int | None = None
        if self._seen is not None and self._seen[0] == box.uidvalidity:
            after = self._seen[1]
        elif self._seen is not None:
            log.warning("email: the server renumbered %s (UIDVALIDITY %d, was %d): taking "
                        "its unread mail of the last %d days again (mail handed over before "
                        "is recognised)", self.section.mailbox, box.uidvalidity,
                        self._seen[0], FIRST_LOOK_DAYS)
        since = date.today() - timedelta(days=FIRST_LOOK_DAYS)
        uids = await self._on_imap(self._search_blocking, box, after, since)
        for uid in uids:
            if not self._running or not await self._take(box, uid):
                return 0
        if after is None:
            # Nothing older than what the mailbox held when it was opened is taken later.
            await self._save_seen(box.uidvalidity, max(box.uidnext - 1, *uids, 0))
        return len(uids)

    @staticmethod
    def _search_blocking(box: _Box, after: int | None, since: date) -> list[int]:
        if after is None:
            found = box.client.search(["UNSEEN", "SINCE", since])
        else:
            found = box.client.search(["UID", f"{after + 1}:*"])
        return sorted(u for u in found if after is None or u > after)

    async def _take(self, box: _Box, uid: int) -> bool:
        """Read mail `uid`, hand it over (when it may reach the host), mark it \\Seen and
        save its UID. False when the channel stopped before the host took it."""
        read = await self._on_imap(self._read_blocking, box, uid)
        if read.message is None:
            if read.why:
                log.info("email: mail %d left alone: %s", uid, read.why)
        else:
            msg = read.message
            if read.thread is not None:
                await self._remember_thread(msg.sender, msg.id, read.thread)
            refused = 0
            while True:
                try:
                    if not await self.deliver_inbound(msg):
                        raise ChannelError("no handler takes inbound messages yet")
                    break
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - the host's callback, any failure
                    refused += 1
                    log.exception("email: the host did not take mail %d (%s)", uid, msg.id)
                    if await wait(self.host_backoff.delay(refused), self._stop):
                        return False
            await self._on_imap(self._mark_seen, box, uid)
        await self._save_seen(box.uidvalidity, uid)
        return True

    @staticmethod
    def _mark_seen(box: _Box, uid: int) -> None:
        box.client.add_flags([uid], [b"\\Seen"], silent=True)

    def _read_blocking(self, box: _Box, uid: int) -> _Read:
        """Fetch mail `uid` (without marking it seen) and read it."""
        client = box.client
        sizes = client.fetch([uid], ["RFC822.SIZE"])
        if uid not in sizes:
            return _Read(None, None, "it is gone from the mailbox")
        size = int(sizes[uid].get(b"RFC822.SIZE") or 0)
        too_big = size > self.max_mail_bytes
        part = b"BODY[HEADER]" if too_big else b"BODY[]"
        got = client.fetch([uid], ["BODY.PEEK[HEADER]" if too_big else "BODY.PEEK[]"])
        raw = got.get(uid, {}).get(part)
        if not isinstance(raw, bytes):
            return _Read(None, None, "the server sent no content")
        try:
            return self.read_mail(raw, uid=f"{box.uidvalidity}-{uid}",
                                  too_big=size if too_big else None)
        except Exception as e:  # noqa: BLE001 - one mail mdclaw cannot read must not stop the rest
            log.exception("email: mail %d cannot be read; it is left in the mailbox", uid)
            return _Read(None, None, f"it cannot be read ({type(e).__name__})")

    def read_mail(self, raw: bytes, *, uid: str, too_big: int | None = None) -> _Read:
        """What mail `raw` hands over: None (with why) for mail that must not reach an
        agent, else the message and the thread it belongs to. `too_big`: only its header
        was fetched (it has that many bytes)."""
        msg = parse_mail(raw)
        why = loop_reason(msg, self.address)
        if why:
            return _Read(None, None, why)
        sender = sender_of(msg)
        if sender is None:
            return _Read(None, None, "it has no single From address")
        address, name = sender
        if not self.is_allowed(address):
            if address not in self._refused_logged:
                if len(self._refused_logged) >= 1000:  # bounded, whatever comes in
                    self._refused_logged.clear()
                self._refused_logged.add(address)
                log.info("email: mail from %s is not answered: the address is neither in "
                         "channels.email.allow_from nor a person's email identity", address)
            return _Read(None, None, f"{address} may not write to the assistant")
        if self.section.authserv_id:
            ok, how = auth_verdict(msg, self.section.authserv_id, address)
            if not ok:
                log.warning("email: mail from %s is not answered: %s", address, how)
                return _Read(None, None, f"its sender is not authenticated ({how})")
        elif not self.section.trust_from:  # the config asks for one or the other
            return _Read(None, None, "its sender cannot be verified (channels.email has "
                         "neither authserv_id nor trust_from)")
        if is_reaction(msg):
            return _Read(None, None, "it is a reaction (RFC 9078), not a message to answer")
        mail = read_incoming(msg)
        text = mail.text
        files = mail.files
        if too_big is not None:
            text = (f"[This mail has {too_big // (1024 * 1024)} MB, more than mdclaw reads "
                    f"({self.max_mail_bytes // (1024 * 1024)} MB): its text and files were "
                    "not read.]")
            files = ()
        parts = []
        if mail.subject and not (mail.in_reply_to or mail.references):
            parts.append(f"Subject: {mail.subject}")
        if text:
            parts.append(text)
        content = "\n\n".join(parts)
        if self.trigger and not re.search(rf"(?<!\w){re.escape(self.trigger)}(?!\w)",
                                          content, re.IGNORECASE):
            content = f"{self.trigger} {content}".rstrip()
        jid = f"mail:{address}"
        mid = mail.message_id
        msg_id = f"{jid}:{mid[1:-1]}" if mid else f"{jid}:uid-{uid}"
        return _Read(InboundMessage(
            id=msg_id, chat_jid=jid, sender=address, sender_name=name, content=content,
            timestamp=now_iso(), chat_name=name, is_group=False, channel=self.name,
            addressed=True, attachments=tuple(_attachment(f) for f in files),
            own_words=mail.own_words if too_big is None else ""),
            Thread.of(mail))

    # ------------------------------------------------------------------ saved state
    async def _load_seen(self) -> None:
        if self._seen is not None:
            return
        parts = (await self._saved_seen.load() or "").split()
        if len(parts) == 2 and all(p.isdigit() for p in parts) and self._seen is None:
            self._seen = (int(parts[0]), int(parts[1]))

    async def _save_seen(self, uidvalidity: int, uid: int) -> None:
        """Remember `uid` as handled (on a thread; a later ask is never overwritten by an
        earlier one)."""
        if self._seen == (uidvalidity, uid):
            return
        self._seen = (uidvalidity, uid)
        await self._saved_seen.save(f"{uidvalidity} {uid}")

    async def _threads_of(self, address: str) -> dict[str, Any]:
        """{"latest": thread, "mails": {message id: thread}} of `address` (cached)."""
        cached = self._threads.get(address)
        if cached is not None:
            return cached
        data: dict[str, Any] = {}
        if self.db is not None:
            try:
                raw = await asyncio.to_thread(get_router_value, self.db,
                                              f"email_thread:{address}")
                loaded = json.loads(raw) if raw else {}
                data = loaded if isinstance(loaded, dict) else {}
            except (sqlite3.Error, ValueError) as e:
                log.warning("email: could not read the threads of %s: %s", address, e)
        data.setdefault("mails", {})
        self._threads[address] = data
        return data

    async def _remember_thread(self, address: str, msg_id: str, thread: Thread) -> None:
        data = await self._threads_of(address)
        mails = data["mails"] if isinstance(data.get("mails"), dict) else {}
        mails.pop(msg_id, None)
        mails[msg_id] = thread.as_dict()
        while len(mails) > THREADS_KEPT:
            mails.pop(next(iter(mails)))
        data["mails"] = mails
        data["latest"] = thread.as_dict()
        if self.db is not None:
            try:
                await asyncio.to_thread(set_router_value, self.db, f"email_thread:{address}",
                                        json.dumps(data))
            except sqlite3.Error as e:
                log.warning("email: could not save the thread of %s: %s", address, e)

    async def thread_for(self, address: str, reply_to: str | None) -> Thread | None:
        """The mail an answer to `address` goes under: the one `reply_to` names (when known),
        else the person's latest."""
        data = await self._threads_of(address)
        if reply_to:
            found = Thread.from_dict((data.get("mails") or {}).get(reply_to))
            if found is not None:
                return found
            prefix = f"mail:{address}:"
            mid = f"<{reply_to[len(prefix):]}>"
            # Only a Message-ID's shape goes into a header (an agent names the mail).
            if (reply_to.startswith(prefix) and not mid.startswith("<uid-")
                    and message_ids(mid) == [mid]):
                latest = Thread.from_dict(data.get("latest"))
                return Thread(mid, (), latest.subject if latest else "")
        return Thread.from_dict(data.get("latest"))

    # ------------------------------------------------------------------ mail out
    def _address(self, jid: str) -> str:
        m = JID_RE.match(jid)
        if not m:
            raise ChannelError(f"{jid!r} is not a mail chat (mail:<address>)", permanent=True)
        address = m.group(1).lower()
        if address == self.address:
            raise ChannelError("the assistant does not mail itself", permanent=True)
        return address

    def _subject(self, thread: Thread | None, text: str) -> str:
        if thread is not None and thread.subject:
            return reply_subject(thread.subject)
        return first_line_subject(text, f"A message from {self.display_name or 'mdclaw'}")

    async def send_message(self, jid: str, text: str, *, reply_to: str | None = None,
                           sender: str | None = None) -> str | None:
        last = None
        for i, part in enumerate(self.message_parts(text)):
            last = await self.send_part(jid, part, reply_to=reply_to if i == 0 else None)
        return last

    async def send_part(self, jid: str, part: Any, *, reply_to: str | None = None,
                        sender: str | None = None) -> str | None:
        """One mail with the Markdown `part` (text and HTML), threaded."""
        to = self._address(jid)
        text = str(part)
        thread = await self.thread_for(to, reply_to)
        mid = new_message_id(domain_of(self.address))
        msg = build_mail(sender=self.address, sender_name=self.display_name, to=to,
                         markdown=text, subject=self._subject(thread, text), message_id=mid,
                         thread=thread)
        await self._send(msg, to)
        return f"{jid}:{mid[1:-1]}"

    async def send_file(self, jid: str, path: Path, *, file_name: str | None = None,
                        caption: str | None = None) -> str | None:
        """A mail with the file attached and `caption` (Markdown) as its text."""
        to = self._address(jid)
        path = Path(path)
        content = await asyncio.to_thread(read_upload, path, MAX_UPLOAD_BYTES,
                                          "a mail may carry at most")
        name = file_name or path.name
        mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
        text = caption or name
        thread = await self.thread_for(to, None)
        mid = new_message_id(domain_of(self.address))
        msg = build_mail(sender=self.address, sender_name=self.display_name, to=to,
                         markdown=text, subject=self._subject(thread, text), message_id=mid,
                         thread=thread, files=[MailFile(name, mime, content)])
        await self._send(msg, to)
        return f"{jid}:{mid[1:-1]}"

    async def react(self, jid: str, message_id: str, emoji: str) -> None:
        """A reaction mail (RFC 9078) to the mail `message_id` names."""
        to = self._address(jid)
        thread = await self.thread_for(to, message_id)
        prefix = f"mail:{to}:"
        if (thread is None or not message_id.startswith(prefix)
                or thread.message_id != f"<{message_id[len(prefix):]}>"):
            raise ChannelError(f"no mail {message_id!r} of {to} to react to", permanent=True)
        msg = reaction_mail(sender=self.address, sender_name=self.display_name, to=to,
                            emoji=emoji, message_id=new_message_id(domain_of(self.address)),
                            thread=thread)
        await self._send(msg, to)

    async def set_typing(self, jid: str, typing: bool) -> None:
        """Mail shows no typing."""

    async def _send(self, msg: EmailMessage, to: str) -> None:
        if not self._running or self._smtp_pool is None:
            raise ChannelError("the email channel is not connected")
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._smtp_pool, self._send_blocking, msg, to)
        except MailTrouble as t:
            self._smtp_down(t)
            raise ChannelError(self.redact(f"{t}; {t.fix}")) from None

    def _send_blocking(self, msg: EmailMessage, to: str) -> None:
        """Send `msg` to `to` (on the SMTP thread). Raises ChannelError: a refusal (4xx:
        retry_after; 5xx: permanent), or MailTrouble when the server cannot be used."""
        try:
            smtp = open_smtp(self.section, self._smtp_password, self.io_timeout)
        except Exception as e:  # noqa: BLE001 - sorted into MailTrouble
            raise trouble(e, "SMTP", self.section) from None
        try:
            smtp.send_message(msg, from_addr=self.address, to_addrs=[to])
        except smtplib.SMTPRecipientsRefused as e:
            code, said = e.recipients.get(to, (550, b"refused"))
            raise self._refusal(code, said) from None
        except (smtplib.SMTPSenderRefused, smtplib.SMTPDataError) as e:
            raise self._refusal(e.smtp_code, e.smtp_error) from None
        except Exception as e:  # noqa: BLE001 - sorted into MailTrouble
            raise trouble(e, "SMTP", self.section) from None
        finally:
            with _quietly():
                smtp.quit()

    def _refusal(self, code: int, said: Any) -> ChannelError:
        text = _text(said)
        if 400 <= code < 500:
            return ChannelError(f"the SMTP server said {code} {text} (trying again later)",
                                retry_after=self.smtp_retry_after, code=code)
        if text.startswith("5.4.5"):  # a sending quota (Gmail's daily limit): it resets
            return ChannelError(f"the SMTP server said {code} {text} (a sending limit; "
                                "trying again in an hour)", retry_after=QUOTA_RETRY, code=code)
        return ChannelError(f"the SMTP server refused the mail: {code} {text}", permanent=True,
                            code=code)

    def _smtp_down(self, t: MailTrouble) -> None:
        """The SMTP server cannot be used: not connected (the outbox keeps the mail) until a
        login succeeds again."""
        first = self.smtp_problem is None
        self.smtp_problem = t
        if first:
            log.warning("email: %s; mail waits until it works again", self.redact(str(t)))
        if self._running and (self._smtp_task is None or self._smtp_task.done()):
            self._smtp_task = asyncio.create_task(self._smtp_again(), name="email-smtp")

    async def _smtp_again(self) -> None:
        tries = 0
        while self._running and self.smtp_problem is not None:
            tries += 1
            if await wait(self.reconnect_backoff.delay(tries), self._stop):
                return
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self._smtp_pool, self._smtp_check)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - still down
                self.smtp_problem = trouble(e, "SMTP", self.section)
                continue
            self.smtp_problem = None
            log.info("email: the SMTP server %s takes mail again", self.section.smtp_host)

    def _smtp_check(self) -> None:
        smtp = open_smtp(self.section, self._smtp_password, self.io_timeout)
        with _quietly():
            smtp.quit()


def _attachment(f: MailFile) -> Attachment:
    data = f.data

    async def fetch(limit: int) -> bytes:
        if len(data) > limit:
            raise ChannelError(f"it is {len(data)} bytes, over the {limit} bytes a file may "
                               "have here")
        return data

    return Attachment(kind=kind_for_mime(f.mime), name=f.name, mime=f.mime, size=len(data),
                      fetch=fetch)


__all__ = ["EmailChannel", "MailTrouble", "imapclient_module", "open_imap",
           "open_smtp", "probe", "ssl_context", "trouble"]

