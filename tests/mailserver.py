"""Real mail servers on loopback for the email channel's tests.

- `Dovecot`: Debian's Dovecot as the IMAP server, with a config written here: a passwd-file
  of test users (added while it runs: Dovecot reads the file again when it changes), their
  maildirs under a folder of its own, TLS with a certificate made for the session, ports
  above 1024. Dovecot refuses to run as root, so under root (CI) it runs as `nobody`, who
  owns its folder; its login and internal users are that user, `first_valid_uid` lowered.
- `Relay`: an SMTP server (aiosmtpd) on two ports, STARTTLS and TLS from the first byte,
  with AUTH against the same users. It is the domain's mail server both ways: what an
  authenticated user sends, and what anyone sends to a user of the domain, is delivered into
  the recipient's maildir (as an MTA does: a file in Maildir/new), with Return-Path and
  Authentication-Results (authserv-id AUTHSERV) the way a receiving server writes them: a
  From of the domain passes DMARC only when its owner logged in to send it. Mail for other
  domains is refused (no open relay). `fail_next` makes it answer the next RCPT with a code
  of the test's choosing; `received` keeps every mail as it came.
- `MailWorld`: both, one per test session (tests/test_email_*.py), and fresh users for each
  test (`user(...)`), so tests never see each other's mail.

When Dovecot or openssl is missing the tests are skipped, and under CI=true they fail
(`.ci/setup-mail` installs them).
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import pwd
import shutil
import signal
import smtplib
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from pathlib import Path
from typing import Any

import pytest

from waiting import wait_until

DOMAIN = "example.test"
AUTHSERV = "mx.example.test"
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
USERS = 300  # users Dovecot knows from its start; each test takes a few


def unavailable(reason: str) -> None:
    if CI:
        pytest.fail(f"CI=true but {reason}; .ci/setup-mail should have provided it",
                    pytrace=False)
    pytest.skip(f"{reason} (run .ci/setup-mail to install it)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass(frozen=True)
class User:
    address: str
    password: str
    maildir: Path

    @property
    def name(self) -> str:
        return self.address.split("@")[0]


# --------------------------------------------------------------------------- Dovecot

class Dovecot:
    """One Dovecot, run by an unprivileged user in a folder of its own."""

    def __init__(self, root: Path, cert: Path, key: Path, *, idle: bool = True,
                 user_prefix: str = "u") -> None:
        self.root = root
        self.user_prefix = user_prefix  # users are <prefix><n>@DOMAIN
        self.cert, self.key = cert, key
        self.idle = idle
        self.imaps_port = free_port()
        self.imap_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        if os.geteuid() == 0:
            pw = pwd.getpwnam("nobody")
        else:
            pw = pwd.getpwuid(os.geteuid())
        self.uid, self.gid = pw.pw_uid, pw.pw_gid
        self.user_name = pw.pw_name
        import grp
        self.group_name = grp.getgrgid(self.gid).gr_name
        self.users: dict[str, User] = {}
        self._free: list[str] = []
        self._lock = threading.Lock()

    @property
    def passwd(self) -> Path:
        return self.root / "passwd"

    def _own(self, path: Path) -> None:
        if os.geteuid() == 0:
            os.chown(path, self.uid, self.gid)

    def write_config(self) -> None:
        for d in ("run", "state", "home"):
            (self.root / d).mkdir(exist_ok=True)
            self._own(self.root / d)
        if not self.passwd.exists():
            self.passwd.write_text("")
        self._own(self.passwd)
        caps = "" if self.idle else (
            # The capabilities Dovecot offers after the login, less IDLE: a server that
            # cannot push new mail, to test the channel's polling.
            "protocol imap {\n  imap_capability = IMAP4rev1 LITERAL+ SASL-IR ID ENABLE "
            "UIDPLUS\n}\n")
        conf = f"""\
base_dir = {self.root}/run
state_dir = {self.root}/state
log_path = {self.root}/dovecot.log
protocols = imap
listen = 127.0.0.1
ssl = yes
ssl_cert = <{self.cert}
ssl_key = <{self.key}
default_login_user = {self.user_name}
default_internal_user = {self.user_name}
default_internal_group = {self.group_name}
first_valid_uid = 1
first_valid_gid = 0
mail_location = maildir:~/Maildir
auth_mechanisms = plain login
auth_failure_delay = 0
passdb {{
  driver = passwd-file
  args = scheme=PLAIN username_format=%u {self.passwd}
}}
userdb {{
  driver = passwd-file
  args = username_format=%u {self.passwd}
}}
service imap-login {{
  chroot =
  inet_listener imap {{
    port = {self.imap_port}
  }}
  inet_listener imaps {{
    port = {self.imaps_port}
    ssl = yes
  }}
}}
service anvil {{
  chroot =
}}
service stats {{
  chroot =
}}
{caps}"""
        (self.root / "dovecot.conf").write_text(conf)
        self._own(self.root / "dovecot.conf")
        self._own(self.root)

    def start(self) -> None:
        self.write_config()
        kw: dict[str, Any] = {}
        if os.geteuid() == 0:
            kw = {"user": self.uid, "group": self.gid, "extra_groups": []}
        self.proc = subprocess.Popen(
            [shutil.which("dovecot") or "dovecot", "-F", "-c", str(self.root / "dovecot.conf")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.root,
            start_new_session=True, **kw)

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise AssertionError(f"dovecot exited ({self.proc.returncode}): {err}"
                                     f"{self.log()}")
            return listening(self.imaps_port) and listening(self.imap_port)

        wait_until(up, 20, interval=0.05, what="Dovecot to listen")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        if proc.stderr:
            proc.stderr.close()
        # Its children (login, imap, anvil...) end with the master; wait until the ports
        # are free again, so that a start after this one can bind them.
        wait_until(lambda: not listening(self.imaps_port) and not listening(self.imap_port),
                   15, interval=0.05, what="Dovecot's ports to close")

    def log(self) -> str:
        try:
            return (self.root / "dovecot.log").read_text()[-4000:]
        except OSError:
            return ""

    def add_users(self, count: int) -> None:
        """Write `count` more users into the passwd-file (before the start: Dovecot looks at
        the file at most once a second, so a user added while it runs may not log in at
        once)."""
        with self._lock, self.passwd.open("a") as f:
            for _ in range(count):
                n = len(self.users) + 1
                address = f"{self.user_prefix}{n}@{DOMAIN}"
                home = self.root / "home" / address
                password = f"pw-{uuid.uuid4().hex[:12]}"
                self.users[address] = User(address, password, home / "Maildir")
                self._free.append(address)
                f.write(f"{address}:{{PLAIN}}{password}:{self.uid}:{self.gid}::{home}::\n")

    def take_user(self) -> User:
        """A user no test had yet, its maildir made."""
        with self._lock:
            user = self.users[self._free.pop(0)]
            for d in (user.maildir.parent, user.maildir,
                      *(user.maildir / s for s in ("tmp", "new", "cur"))):
                d.mkdir(exist_ok=True)
                self._own(d)
        return user

    def deliver(self, address: str, raw: bytes) -> Path:
        """Put `raw` into `address`'s maildir as an MTA does (tmp/, then new/)."""
        user = self.users[address]
        name = f"{time.time():.6f}.{uuid.uuid4().hex}.mx"
        tmp = user.maildir / "tmp" / name
        tmp.write_bytes(raw)
        os.chmod(tmp, 0o600)
        self._own(tmp)
        final = user.maildir / "new" / name
        os.rename(tmp, final)
        return final


# --------------------------------------------------------------------------- SMTP

class Relay:
    """The domain's SMTP server (see the module's notes)."""

    def __init__(self, dovecot: Dovecot, cert: Path, key: Path) -> None:
        self.dovecot = dovecot
        self.cert, self.key = cert, key
        self.starttls_port = free_port()
        self.tls_port = free_port()
        self.received: list[tuple[str, list[str], bytes]] = []  # (mail from, rcpts, raw)
        self._fail: list[tuple[int, str]] = []
        self._controllers: list[Any] = []
        self.lock = threading.Lock()

    def fail_next(self, code: int, text: str) -> None:
        """Answer the next RCPT with `code text` (once)."""
        with self.lock:
            self._fail.append((code, text))

    # aiosmtpd's handler hooks ------------------------------------------------------
    def authenticate(self, server: Any, session: Any, envelope: Any, mechanism: str,
                     auth_data: Any) -> Any:
        from aiosmtpd.smtp import AuthResult

        login = auth_data.login.decode() if isinstance(auth_data.login, bytes) else ""
        password = (auth_data.password.decode() if isinstance(auth_data.password, bytes)
                    else "")
        user = self.dovecot.users.get(login.lower())
        ok = user is not None and user.password == password
        if not ok:  # aiosmtpd answers 535 5.7.8 itself
            return AuthResult(success=False, handled=False)
        return AuthResult(success=True, auth_data=login.lower())

    async def handle_RCPT(self, server: Any, session: Any, envelope: Any, address: str,
                          rcpt_options: list[str]) -> str:
        with self.lock:
            scripted = self._fail.pop(0) if self._fail else None
        if scripted is not None:
            return f"{scripted[0]} {scripted[1]}"
        if address.lower() not in self.dovecot.users:
            return "550 5.1.1 no such user here (this server relays for no one)"
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        raw = envelope.original_content or envelope.content
        if isinstance(raw, str):
            raw = raw.encode()
        with self.lock:
            self.received.append((envelope.mail_from, list(envelope.rcpt_tos), raw))
        login = session.auth_data if session.authenticated else None
        head = BytesParser(policy=policy.default).parsebytes(raw, headersonly=True)
        froms = email.utils.getaddresses([str(v) for v in head.get_all("From") or []])
        from_addr = froms[0][1].lower() if froms else ""
        from_domain = from_addr.rpartition("@")[2]
        if login and login == from_addr:
            verdict = f"dkim=pass header.d={from_domain}; dmarc=pass header.from={from_domain}"
        elif from_domain == DOMAIN:
            verdict = f"dkim=none; spf=fail smtp.mailfrom={envelope.mail_from}; " \
                      f"dmarc=fail header.from={from_domain}"
        else:
            verdict = f"dkim=none; spf=none; dmarc=none header.from={from_domain}"
        trace = (f"Return-Path: <{envelope.mail_from}>\r\n"
                 f"Authentication-Results: {AUTHSERV}; {verdict}\r\n"
                 f"Received: from {session.host_name or 'unknown'} (127.0.0.1) by {AUTHSERV} "
                 f"with ESMTP{'SA' if login else 'S'}; {email.utils.formatdate()}\r\n")
        for rcpt in envelope.rcpt_tos:
            self.dovecot.deliver(rcpt.lower(), trace.encode() + raw)
        return "250 2.0.0 OK: delivered"

    def start(self) -> None:
        from aiosmtpd.controller import Controller

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        common = {"hostname": "127.0.0.1", "authenticator": self.authenticate,
                  "server_hostname": AUTHSERV}
        starttls = Controller(self, port=self.starttls_port, tls_context=ctx,
                              auth_require_tls=True, **common)
        tls = Controller(self, port=self.tls_port, ssl_context=ctx, auth_require_tls=False,
                         **common)
        for c in (starttls, tls):
            c.start()
            self._controllers.append(c)

    def stop(self) -> None:
        for c in self._controllers:
            c.stop()
        self._controllers.clear()


# --------------------------------------------------------------------------- the world

@dataclass
class MailWorld:
    """Dovecot and the relay, with the certificate both present."""

    root: Path
    cert: Path
    dovecot: Dovecot
    relay: Relay

    def user(self) -> User:
        """A fresh user (`u<n>@example.test`) with its maildir."""
        return self.dovecot.take_user()

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cert))

    def send(self, raw: EmailMessage | bytes, *, as_user: User | None = None,
             mail_from: str | None = None, to: list[str] | None = None) -> None:
        """Hand a mail to the relay: logged in as `as_user` (submission), or not (a mail
        from outside, for a user of the domain)."""
        msg = raw if isinstance(raw, EmailMessage) else BytesParser(
            policy=policy.default).parsebytes(raw)
        with smtplib.SMTP("127.0.0.1", self.relay.starttls_port, timeout=20) as s:
            s.starttls(context=self.ssl_context())
            if as_user is not None:
                s.login(as_user.address, as_user.password)
            sender = mail_from if mail_from is not None else (
                as_user.address if as_user else email.utils.parseaddr(str(msg["From"]))[1])
            rcpts = to or [a for _, a in email.utils.getaddresses(
                [str(v) for v in msg.get_all("To") or []])]
            if isinstance(raw, bytes):
                s.sendmail(sender, rcpts, raw)
            else:
                s.send_message(msg, from_addr=sender, to_addrs=rcpts)

    @staticmethod
    def _files(user: User) -> list[tuple[str, bytes]]:
        """(file name, content) of every mail in `user`'s maildir, in delivery order. Dovecot
        renames a file when its flags change: a listing that meets a rename is taken again."""
        for _ in range(50):
            try:
                found = [(p.name, p.read_bytes()) for d in ("new", "cur")
                         for p in (user.maildir / d).glob("*")]
            except FileNotFoundError:
                continue
            return sorted(found)
        raise AssertionError(f"{user.maildir} kept changing")

    def mailbox(self, user: User) -> list[EmailMessage]:
        """Every mail in `user`'s maildir (new and cur), in delivery order."""
        out = []
        for _name, raw in self._files(user):
            msg = BytesParser(policy=policy.default).parsebytes(raw)
            assert isinstance(msg, EmailMessage)
            out.append(msg)
        return out

    def seen_flags(self, user: User) -> dict[str, bool]:
        """Message-ID -> marked \\Seen, as the maildir says (the `S` flag in a file's name)."""
        out = {}
        for name, raw in self._files(user):
            msg = BytesParser(policy=policy.default).parsebytes(raw, headersonly=True)
            flags = name.rpartition(":2,")[2] if ":2," in name else ""
            out[str(msg["Message-ID"])] = "S" in flags
        return out


def body(msg: EmailMessage, kind: str = "plain") -> str:
    """The text of `msg`'s text/`kind` body, line ends as "\\n"."""
    part = msg.get_body((kind,))
    assert part is not None, f"no text/{kind} part in {msg.get_content_type()}"
    return str(part.get_content()).replace("\r\n", "\n")


def make_cert(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    os.chmod(cert, 0o644)
    os.chmod(key, 0o644)  # read by Dovecot's user and by this process
    return cert, key


def start_world() -> MailWorld:
    if not shutil.which("dovecot"):
        unavailable("Dovecot (Debian's dovecot-imapd) is not installed")
    if not shutil.which("openssl"):
        unavailable("openssl is not installed")
    try:
        import aiosmtpd  # noqa: F401
    except ImportError:
        unavailable("aiosmtpd is not installed (the test extra)")
    # Not under pytest's tmp_path: its parents are private to this user, and Dovecot runs as
    # another one under root.
    root = Path(tempfile.mkdtemp(prefix="mdclaw-mail-"))
    os.chmod(root, 0o755)
    cert, key = make_cert(root)
    dovecot = Dovecot(root / "dovecot", cert, key)
    dovecot.root.mkdir()
    dovecot.write_config()
    dovecot.add_users(USERS)
    dovecot.start()
    relay = Relay(dovecot, cert, key)
    relay.start()
    return MailWorld(root, cert, dovecot, relay)


def stop_world(world: MailWorld) -> None:
    world.relay.stop()
    world.dovecot.stop()
    shutil.rmtree(world.root, ignore_errors=True)


def make_mail(sender: User | str, to: User | str, subject: str, text: str, *,
              message_id: str | None = None, in_reply_to: str | None = None,
              references: list[str] | None = None, headers: dict[str, str] | None = None,
              files: list[tuple[str, str, bytes]] = ()) -> EmailMessage:  # type: ignore[assignment]
    """A person's mail (text/plain, files attached as (name, mime, data))."""
    msg = EmailMessage()
    msg["From"] = sender.address if isinstance(sender, User) else sender
    msg["To"] = to.address if isinstance(to, User) else to
    msg["Subject"] = subject
    msg["Date"] = email.utils.formatdate(localtime=True)
    msg["Message-ID"] = message_id or email.utils.make_msgid(domain="client.example.test")
    if in_reply_to:
        msg["In-Reply-To"] = in_reply_to
    if references:
        msg["References"] = " ".join(references)
    for k, v in (headers or {}).items():
        msg[k] = v
    msg.set_content(text)
    for name, mime, data in files:
        maintype, _, subtype = mime.partition("/")
        msg.add_attachment(data, maintype=maintype, subtype=subtype, filename=name)
    return msg


def channel_section(world: MailWorld, assistant: User, allow: list[User],
                    **over: Any) -> dict[str, Any]:
    """`channels.email` for `assistant`'s mailbox on the world's servers (IMAP TLS, SMTP
    STARTTLS, the session's CA), as config.yaml would say it."""
    pw_file = world.root / f"{assistant.address}.{assistant.password[-8:]}.password"
    if not pw_file.exists():
        pw_file.write_text(assistant.password + "\n")
        os.chmod(pw_file, 0o600)
    section: dict[str, Any] = {
        "address": assistant.address, "password_file": str(pw_file),
        "imap_host": "127.0.0.1", "imap_port": world.dovecot.imaps_port,
        "imap_security": "tls", "smtp_host": "127.0.0.1",
        "smtp_port": world.relay.starttls_port, "smtp_security": "starttls",
        "ca_file": str(world.cert), "allow_from": [u.address for u in allow],
        "authserv_id": AUTHSERV}
    section.update(over)
    return section


# --------------------------------------------------------------------------- the agent

AGENT_DELAY_VAR = "MDCLAW_TEST_AGENT_DELAY"


def answering_agent(c: Any) -> int:
    """The fake engine's agent for the email tests (tests/fake_daemon.py runs it in the
    daemon): it answers each turn in Markdown naming every `token-...` it read, the size of
    every file the prompt shows it, sends a file when asked to ("send me a file") and reacts
    to the message a prompt names ("react to mail:..."); the conversation goes on until the
    host closes it."""
    delay = float(os.environ.get(AGENT_DELAY_VAR) or 0)
    _answer(c, c.prompt, delay)
    while (follow_up := c.next_input(timeout=600)) is not None:
        _answer(c, str(follow_up.get("content", "")), delay)
    return 0


def _answer(c: Any, prompt: str, delay: float) -> None:
    import re

    if delay:
        c.sleep(delay)
    tokens = list(dict.fromkeys(re.findall(r"token-[\w-]+", prompt)))
    lines = [f"**Answer** to {' '.join(tokens) or 'nothing'}", "", "- one", "- two", "",
             "```", "print('hi')", "```"]
    for path in re.findall(r'<attachment [^>]*path="/workspace/group/([^"]+)"', prompt):
        data = (c.group_dir / path).read_bytes()
        lines.append(f"\nread {Path(path).name}: {len(data)} bytes")
    for message_id in re.findall(r"react to (mail:[^\s<]+)", prompt):
        _command(c, {"type": "react", "chat_jid": c.input["chatJid"],
                     "message_id": message_id, "emoji": "\N{THUMBS UP SIGN}"})
    if "send me a file" in prompt:
        (c.group_dir / "report.txt").write_text(f"report for {' '.join(tokens)}\n")
        _command(c, {"type": "send_file", "chat_jid": c.input["chatJid"],
                     "file_path": "/workspace/group/report.txt",
                     "caption": "Here is **your report**"})
    c.say({"status": "success", "result": "\n".join(lines), "newSessionId": "s-1"})


def _command(c: Any, command: dict[str, Any]) -> None:
    """An IPC command from the agent (written as the agent runner writes them)."""
    import json

    folder = c.ipc_dir / "messages"
    folder.mkdir(exist_ok=True)
    name = uuid.uuid4().hex
    (folder / f".{name}.tmp").write_text(json.dumps(command))
    os.rename(folder / f".{name}.tmp", folder / f"{name}.json")
