"""Mail as the email channel reads and writes it: pure functions, no I/O.

In: `parse_mail` reads a whole message (RFC 5322, MIME); `loop_reason` says why a mail must
never reach an agent although it came from an allowed address (our own mail, auto-replies,
bounces and delivery reports, bulk and list mail); `sender_of` is the one From address;
`auth_verdict` reads the receiving server's Authentication-Results header (RFC 8601) for the
sender's domain; `read_incoming` takes the text (the plain part, else the HTML part as
Markdown; the quoted history of a reply cut off), the files and the threading headers.

Out: `build_mail` writes the assistant's Markdown as multipart/alternative (the Markdown as
text/plain, the markup layer's HTML as text/html), with files attached, threaded under the
mail it answers (In-Reply-To, References, "Re: <subject>"), marked as written by a program
(Auto-Submitted, RFC 3834) so that auto-responders do not answer it; `reaction_mail` is a
reaction (RFC 9078). Our Message-IDs carry `.mdclaw@` before the domain, so a copy of our own
mail that comes back is known.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email import policy
from email.headerregistry import Address
from email.message import EmailMessage, Message
from email.parser import BytesParser
from email.utils import format_datetime, getaddresses, parsedate_to_datetime
from typing import Any

from mdclaw.markup import to_html

MAX_TEXT = 50_000  # characters of a mail's text handed on
MAX_REFERENCES = 12  # Message-IDs kept in References (the first and the latest ones)
OWN_MARK = ".mdclaw@"
BULK_PRECEDENCE = frozenset({"bulk", "list", "junk"})
LIST_HEADERS = ("List-Id", "List-Unsubscribe", "List-Post")
BOUNCE_SENDERS = frozenset({"mailer-daemon", "postmaster"})
AUTO_HEADERS = ("X-Autoreply", "X-Autorespond")
_MSGID = re.compile(r"<[^<>\s]{1,250}>")
_REPLY_PREFIX = re.compile(r"^\s*(re|aw|sv|antw|vs|ref)\s*(\[\d+\])?\s*:\s*", re.IGNORECASE)


def parse_mail(raw: bytes) -> EmailMessage:
    """The message `raw` (a whole mail as the server holds it)."""
    msg = BytesParser(policy=policy.default).parsebytes(raw)
    assert isinstance(msg, EmailMessage)
    return msg


def header(msg: Message, name: str) -> str:
    """The first `name` header of `msg` as text ("" when absent or unreadable)."""
    try:
        value = msg.get(name)
    except (ValueError, TypeError, IndexError):  # a header the parser cannot make sense of
        return ""
    return " ".join(str(value).split()) if value is not None else ""


def all_headers(msg: Message, name: str) -> list[str]:
    try:
        return [" ".join(str(v).split()) for v in msg.get_all(name) or []]
    except (ValueError, TypeError, IndexError):
        return []


def message_ids(text: str) -> list[str]:
    """The `<id@host>` Message-IDs in a header's text, in order."""
    return _MSGID.findall(text or "")


def domain_of(address: str) -> str:
    return address.rpartition("@")[2].lower()


# --------------------------------------------------------------------------- who sent it


def sender_of(msg: Message) -> tuple[str, str] | None:
    """(address lower-cased, display name) of the one From address; None when there is no
    From, more than one, or it is no address."""
    froms = all_headers(msg, "From")
    if len(froms) != 1:
        return None
    found = [(n, a) for n, a in getaddresses(froms) if a]
    if len(found) != 1:
        return None
    name, address = found[0]
    address = address.strip().lower()
    local, at, domain = address.rpartition("@")
    if not at or not local or "." not in domain or any(c.isspace() for c in address):
        return None
    return address, (name.strip() or address)


def is_own_message_id(message_id: str, domain: str) -> bool:
    """True for a Message-ID this channel made (`new_message_id`) for `domain`."""
    return message_id.lower().endswith(f"{OWN_MARK}{domain.lower()}>")


def new_message_id(domain: str) -> str:
    return f"<{uuid.uuid4().hex}{OWN_MARK}{domain.lower()}>"


def loop_reason(msg: Message, own_address: str) -> str | None:
    """Why `msg` must not reach an agent whoever sent it (None: it may): our own mail, a mail
    a program wrote in answer or on its own, a bounce or a delivery/read report, bulk or list
    mail. Answering any of them could start a loop of mail between two programs."""
    sender = sender_of(msg)
    if sender is not None and sender[0] == own_address:
        return "it is our own mail (From is our address)"
    mid = header(msg, "Message-ID")
    if mid and is_own_message_id(mid, domain_of(own_address)):
        return "it is our own mail (its Message-ID is one of ours)"
    auto = header(msg, "Auto-Submitted").split(";")[0].strip().lower()
    if auto and auto != "no":
        return f"a program sent it (Auto-Submitted: {auto})"
    for name in AUTO_HEADERS:
        if header(msg, name):
            return f"it is an automatic reply ({name})"
    if msg.get_content_type() == "multipart/report":
        return "it is a delivery or read report (multipart/report)"
    if header(msg, "Return-Path").replace(" ", "") == "<>":
        return "it is a bounce (empty Return-Path)"
    if sender is not None and sender[0].partition("@")[0] in BOUNCE_SENDERS:
        return f"it is a bounce (from {sender[0]})"
    precedence = header(msg, "Precedence").lower()
    if precedence in BULK_PRECEDENCE:
        return f"it is bulk mail (Precedence: {precedence})"
    for name in LIST_HEADERS:
        if header(msg, name):
            return f"it comes from a mailing list ({name})"
    return None


def is_reaction(msg: Message) -> bool:
    """True for a reaction (RFC 9078): a part marked `Content-Disposition: reaction`. Like a
    reaction in a chat it is no message to answer."""
    return any(not part.is_multipart()
               and (part.get_content_disposition() or "").lower() == "reaction"
               for part in msg.walk())


# --------------------------------------------------------------------------- authentication

def _without_comments(text: str) -> str:
    out, depth, quoted, escaped = [], 0, False, False
    for c in text:
        if escaped:
            escaped = False
            if depth == 0:
                out.append(c)
            continue
        if c == "\\":
            escaped = True
            if depth == 0:
                out.append(c)
            continue
        if c == '"' and depth == 0:
            quoted = not quoted
        elif not quoted and c == "(":
            depth += 1
            continue
        elif not quoted and c == ")" and depth:
            depth -= 1
            continue
        if depth == 0:
            out.append(c)
    return "".join(out)


@dataclass(frozen=True)
class AuthResult:
    """One `method=result` of an Authentication-Results header, with its properties
    (`header.d`, `smtp.mailfrom`...)."""

    method: str
    result: str
    props: dict[str, str] = field(default_factory=dict)


def parse_auth_results(value: str) -> tuple[str, list[AuthResult]]:
    """(authserv-id, results) of one Authentication-Results header value (RFC 8601)."""
    parts = [p.strip() for p in _without_comments(value).split(";")]
    head = parts[0].split()
    authserv = head[0].lower() if head else ""
    results = []
    for part in parts[1:]:
        tokens = part.split()
        if not tokens or "=" not in tokens[0]:
            continue
        method, _, result = tokens[0].partition("=")
        props = {}
        for t in tokens[1:]:
            k, eq, v = t.partition("=")
            if eq and "." in k:
                props[k.lower()] = v.strip('"').lower()
        results.append(AuthResult(method.split("/")[0].lower(), result.lower(), props))
    return authserv, results


def _aligned(domain: str, other: str) -> bool:
    """Relaxed alignment (DMARC): the same domain, or one a subdomain of the other."""
    other = other.rpartition("@")[2].lower().strip(".")
    return bool(other) and (other == domain or domain.endswith("." + other)
                            or other.endswith("." + domain))


def auth_verdict(msg: Message, authserv_id: str, sender: str) -> tuple[bool, str]:
    """(passed, why) for `sender`'s mail by the Authentication-Results of the server named
    `authserv_id`: the first such header (the receiving server puts its own above any the
    sender wrote). It passes with dmarc=pass for the From domain, or dkim=pass or spf=pass
    for a domain aligned with it."""
    domain = domain_of(sender)
    for value in all_headers(msg, "Authentication-Results"):
        authserv, results = parse_auth_results(value)
        if authserv != authserv_id.lower():
            continue
        for r in results:
            if r.result != "pass":
                continue
            if r.method == "dmarc" and _aligned(domain, r.props.get("header.from", domain)):
                return True, "dmarc=pass"
            if r.method == "dkim" and _aligned(
                    domain, r.props.get("header.d") or r.props.get("header.i", "")):
                return True, "dkim=pass"
            if r.method == "spf" and _aligned(domain, r.props.get("smtp.mailfrom", "")):
                return True, "spf=pass"
        said = ", ".join(f"{r.method}={r.result}" for r in results) or "no results"
        return False, f"{authserv_id} did not authenticate {domain} ({said})"
    return False, f"no Authentication-Results from {authserv_id}"


# --------------------------------------------------------------------------- what it says

@dataclass(frozen=True)
class MailFile:
    """A file that came with a mail."""

    name: str | None
    mime: str
    data: bytes


@dataclass(frozen=True)
class Incoming:
    """What a mail says, as the channel hands it on."""

    message_id: str | None  # with its <>
    in_reply_to: str | None
    references: tuple[str, ...]
    subject: str
    text: str
    date: datetime | None
    files: tuple[MailFile, ...]
    # What the sender wrote themselves: no signature, no quoted lines ("approve 7KQ2" in a
    # reply that quotes the card above or below it and ends with "-- \nJane").
    own_words: str = ""


def _decoded(part: Message) -> str:
    try:
        content = part.get_content()  # type: ignore[attr-defined]
        if isinstance(content, str):
            return content
    except (LookupError, ValueError, KeyError, AttributeError):
        pass
    payload = part.get_payload(decode=True)
    return payload.decode("utf-8", "replace") if isinstance(payload, bytes) else ""


def html_to_text(html: str) -> str:
    """An HTML body as Markdown text."""
    from markdownify import markdownify  # the web actions' converter; loaded on first use

    text = markdownify(html, heading_style="ATX", strip=["img", "script", "style"])
    return re.sub(r"\n{3,}", "\n\n", text).strip()


# "On <date>, <name> wrote:" (perhaps wrapped over two lines), or any line ending in "wrote:".
_ATTRIBUTION = re.compile(r"^(on|am|le|el|il)\b.{0,300}\b(wrote|schrieb|a écrit|escribió|"
                          r"scrisse)\s*:\s*$", re.IGNORECASE)
_ATTRIBUTION_LINE = re.compile(r"^.{0,300}\b(wrote|schrieb|a écrit|escribió|scrisse|skrev|"
                               r"schreef)\s*:\s*$", re.IGNORECASE)
_DIVIDERS = re.compile(r"^\s*(-{2,}\s*(original message|forwarded message|ursprüngliche "
                       r"nachricht)\s*-{2,}|_{10,})\s*$", re.IGNORECASE)


# RFC 3676 4.3: a line of "-- " (dash dash space) starts the signature (an HTML mail's
# "-- <br>" comes out of html_to_text with more trailing spaces).
_SIGNATURE = re.compile(r"^-- [ \t]*\Z")


def strip_signature(text: str) -> str:
    """`text` without its signature: from the first "-- " line outside a quote on. Nothing
    is cut when nothing would be left."""
    lines = text.replace("\r\n", "\n").split("\n")
    for i, line in enumerate(lines):
        if _SIGNATURE.match(line) and any(x.strip() for x in lines[:i]):
            return "\n".join(lines[:i]).rstrip()
    return "\n".join(lines)


def own_words(text: str) -> str:
    """What the sender wrote themselves: `text` without its signature, without everything
    from an "-----Original Message-----" divider on, and without quoted (`>`) lines and the
    "On ... wrote:" line above them, wherever they are (above the answer, below it, between
    its paragraphs)."""
    lines = strip_signature(text).split("\n")
    for i, line in enumerate(lines):
        if _DIVIDERS.match(line):
            lines = lines[:i]
            break

    def quote_follows(k: int) -> bool:
        rest = [x for x in lines[k:] if x.strip()]
        return bool(rest) and rest[0].startswith(">")

    keep: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(">"):
            i += 1
        elif quote_follows(i + 1) and _ATTRIBUTION_LINE.match(line.strip()):
            i += 1
        elif (i + 1 < len(lines) and quote_follows(i + 2) and _ATTRIBUTION.match(
                f"{line.strip()} {lines[i + 1].strip()}")):
            i += 2  # wrapped over two lines
        else:
            keep.append(line)
            i += 1
    return re.sub(r"\n{3,}", "\n\n", "\n".join(keep)).strip()


def strip_quoted(text: str) -> str:
    """`text` without the history a reply quotes below it: the trailing `>` lines and the
    "On ... wrote:" line above them, or everything from an "-----Original Message-----"
    divider on. Nothing is cut when nothing would be left."""
    lines = text.replace("\r\n", "\n").split("\n")
    for i, line in enumerate(lines):
        if _DIVIDERS.match(line) and any(x.strip() for x in lines[:i]):
            lines = lines[:i]
            break
    end = len(lines)
    while end and not lines[end - 1].strip():
        end -= 1
    i = end
    while i and (lines[i - 1].startswith(">") or not lines[i - 1].strip()):
        i -= 1
    if i < end and any(lines[k].startswith(">") for k in range(i, end)):
        j = i
        if j >= 2 and _ATTRIBUTION.match(" ".join(x.strip() for x in lines[j - 2:j])):
            j -= 2  # wrapped over two lines
        elif j >= 1 and _ATTRIBUTION_LINE.match(lines[j - 1].strip()):
            j -= 1
        if any(x.strip() for x in lines[:j]):
            end = j
    return "\n".join(lines[:end]).strip()


def _is_body(part: Message, bodies: Sequence[Message]) -> bool:
    return any(part is b for b in bodies)


def _files(msg: Message, bodies: Sequence[Message]) -> list[MailFile]:
    out: list[MailFile] = []

    def walk(part: Message) -> None:
        ctype = part.get_content_type()
        if ctype == "message/rfc822":
            inner = part.get_payload()
            data = (inner[0].as_bytes() if isinstance(inner, list) and inner
                    and isinstance(inner[0], Message)
                    else part.get_payload(decode=True) or b"")
            out.append(MailFile(part.get_filename() or "forwarded.eml", "message/rfc822",
                                data if isinstance(data, bytes) else b""))
            return
        if part.is_multipart():
            for sub in part.get_payload() or []:
                if isinstance(sub, Message):
                    walk(sub)
            return
        if _is_body(part, bodies):
            return
        disposition = (part.get_content_disposition() or "").lower()
        name = part.get_filename()
        if not (disposition == "attachment" or name or part.get_content_maintype() != "text"):
            return  # another text part (a signature, a second body): not a file
        payload = part.get_payload(decode=True)
        out.append(MailFile(name, ctype, payload if isinstance(payload, bytes) else b""))

    walk(msg)
    return out


def read_incoming(msg: EmailMessage) -> Incoming:
    """The text, files and threading headers of `msg`."""
    bodies: list[Message] = []
    text = ""
    plain = msg.get_body(preferencelist=("plain",))
    html = msg.get_body(preferencelist=("html",))
    for b in (plain, html):
        if b is not None and b.get_content_disposition() != "attachment":
            bodies.append(b)
    if plain is not None and plain in bodies:
        text = _decoded(plain)
    elif html is not None and html in bodies:
        text = html_to_text(_decoded(html))
    own = own_words(text)[:MAX_TEXT]
    text = strip_quoted(strip_signature(text))
    if len(text) > MAX_TEXT:
        text = text[:MAX_TEXT] + "\n[… the rest of this mail was cut]"
    mid = message_ids(header(msg, "Message-ID"))
    irt = message_ids(header(msg, "In-Reply-To"))
    try:
        date: datetime | None = parsedate_to_datetime(header(msg, "Date"))
        if date is not None and date.tzinfo is None:
            date = date.replace(tzinfo=UTC)
    except (TypeError, ValueError, IndexError):
        date = None
    return Incoming(message_id=mid[0] if mid else None, in_reply_to=irt[0] if irt else None,
                    references=tuple(message_ids(header(msg, "References"))),
                    subject=header(msg, "Subject"), text=text, date=date,
                    files=tuple(_files(msg, bodies)), own_words=own)


# --------------------------------------------------------------------------- out

@dataclass(frozen=True)
class Thread:
    """The mail an answer goes under: its Message-ID, its References and its subject."""

    message_id: str
    references: tuple[str, ...]
    subject: str

    def as_dict(self) -> dict[str, Any]:
        return {"message_id": self.message_id, "references": list(self.references),
                "subject": self.subject}

    @classmethod
    def from_dict(cls, d: Any) -> Thread | None:
        if not isinstance(d, dict) or not isinstance(d.get("message_id"), str):
            return None
        refs = d.get("references")
        return cls(d["message_id"], tuple(r for r in refs if isinstance(r, str))
                   if isinstance(refs, list) else (), str(d.get("subject") or ""))

    @classmethod
    def of(cls, mail: Incoming) -> Thread | None:
        if mail.message_id is None:
            return None
        refs = list(mail.references)
        if mail.in_reply_to and mail.in_reply_to not in refs:
            refs.append(mail.in_reply_to)
        return cls(mail.message_id, tuple(refs), mail.subject)


def reply_subject(subject: str) -> str:
    """`subject` as an answer's: "Re: " once, before the subject without its reply marks."""
    s = " ".join(subject.split())
    while True:
        cut = _REPLY_PREFIX.sub("", s, count=1)
        if cut == s:
            break
        s = cut
    return f"Re: {s}" if s else "Re:"


def first_line_subject(markdown: str, fallback: str) -> str:
    """A subject for mail that starts a thread: the text's first line without Markdown marks
    (at most 78 characters), or `fallback`."""
    for line in markdown.splitlines():
        line = re.sub(r"[*_`~#>\[\]|]", "", line)
        line = re.sub(r"\((https?|mailto):[^)]*\)", "", line)
        line = " ".join(line.split()).strip(" -:")
        if line:
            if len(line) > 78:
                line = line[:77].rsplit(" ", 1)[0].rstrip(" ,.;:") + "…"
            return line
    return fallback


def _references(thread: Thread) -> str:
    refs = [*thread.references, thread.message_id]
    if len(refs) > MAX_REFERENCES:  # the thread's root and its latest mails (RFC 5322 3.6.4)
        refs = refs[:1] + refs[-(MAX_REFERENCES - 1):]
    return " ".join(refs)


EMAIL_CSS = ("body{font-family:sans-serif;line-height:1.45}"
             "pre{background:#f4f4f4;padding:8px;overflow-x:auto}"
             "code{font-family:monospace}"
             "blockquote{border-left:3px solid #ccc;margin-left:0;padding-left:10px;color:#555}"
             "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:3px 6px}")


def to_email_html(markdown: str) -> str:
    """The Markdown as an HTML document for a mail: the markup layer's safe HTML (raw HTML
    shown as text, links only to http, https and mailto)."""
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><style>"
            f"{EMAIL_CSS}</style></head>\n<body>\n{to_html(markdown)}\n</body></html>\n")


def _base(*, sender: str, sender_name: str | None, to: str, subject: str, message_id: str,
          thread: Thread | None, now: datetime | None) -> EmailMessage:
    msg = EmailMessage()
    local, _, domain = sender.rpartition("@")
    msg["From"] = Address(sender_name or "", local, domain)
    msg["To"] = to
    msg["Subject"] = subject
    msg["Date"] = format_datetime(now or datetime.now(UTC))
    msg["Message-ID"] = message_id
    if thread is not None:
        msg["In-Reply-To"] = thread.message_id
        msg["References"] = _references(thread)
    # RFC 3834: written by a program (auto-responders do not answer it); the Microsoft
    # header asks Exchange for no out-of-office answer either.
    msg["Auto-Submitted"] = "auto-replied" if thread is not None else "auto-generated"
    msg["X-Auto-Response-Suppress"] = "All"
    return msg


def build_mail(*, sender: str, sender_name: str | None, to: str, markdown: str,
               subject: str, message_id: str, thread: Thread | None,
               files: Sequence[MailFile] = (), now: datetime | None = None) -> EmailMessage:
    """The assistant's mail: the Markdown as text/plain and as HTML (multipart/alternative),
    the files attached (multipart/mixed), threaded under `thread` when given."""
    msg = _base(sender=sender, sender_name=sender_name, to=to, subject=subject,
                message_id=message_id, thread=thread, now=now)
    text = markdown if markdown.endswith("\n") else markdown + "\n"
    msg.set_content(text)
    msg.add_alternative(to_email_html(markdown), subtype="html")
    for f in files:
        maintype, _, subtype = (f.mime or "application/octet-stream").partition("/")
        msg.add_attachment(f.data, maintype=maintype, subtype=subtype or "octet-stream",
                           filename=f.name or "file")
    return msg


def reaction_mail(*, sender: str, sender_name: str | None, to: str, emoji: str,
                  message_id: str, thread: Thread, now: datetime | None = None) -> EmailMessage:
    """A reaction to `thread`'s mail (RFC 9078): a reply whose body is the emoji, marked
    `Content-Disposition: reaction` (clients that do not know it show a short reply)."""
    msg = _base(sender=sender, sender_name=sender_name, to=to,
                subject=reply_subject(thread.subject), message_id=message_id, thread=thread,
                now=now)
    msg.set_content(emoji + "\r\n", disposition="reaction")
    return msg


__all__ = ["AuthResult", "Incoming", "MailFile", "Thread", "auth_verdict", "build_mail",
           "domain_of", "first_line_subject", "header", "is_own_message_id", "is_reaction",
           "loop_reason", "message_ids", "new_message_id", "parse_auth_results", "parse_mail",
           "own_words", "reaction_mail", "read_incoming", "reply_subject", "sender_of",
           "strip_quoted", "strip_signature",
           "to_email_html"]
