"""The email channel as `status`, `doctor` and `check-config` describe it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from mdclaw.config import Config, ServiceCredential, missing_extras, read_secret
from mdclaw.people import mail_senders

SENDERS_UNCHECKED = ("sender addresses are not verified: anyone can send mail with an allowed "
                     "address in From")
AUTHSERV_FIX = ("set channels.email.authserv_id to the name your mail server writes in its "
                "Authentication-Results header (Gmail: mx.google.com) instead of trust_from; "
                "docs/security.md")


def email_status(cfg: Config) -> dict[str, Any] | None:
    """{address, imap, smtp, senders} of the configured email channel (None when it is not
    enabled): what `status` says whether the daemon runs or not."""
    em = cfg.channels.email
    if em is None or not em.enabled:
        return None
    n = len(mail_senders(cfg))
    senders = (f"{n} allowed sender{'' if n == 1 else 's'}" if n else "no allowed senders")
    senders += (f", checked by {em.authserv_id}'s Authentication-Results" if em.authserv_id
                else " (From address not verified)")
    return {"address": em.address,
            "imap": f"{em.imap_host}:{em.imap_port_used} {em.imap_security}",
            "smtp": f"{em.smtp_host}:{em.smtp_port_used} {em.smtp_security}",
            "senders": senders}


def unanswered_groups(cfg: Config) -> Iterable[str]:
    """check-config's warning: a group answers in a mail chat whose address may not write."""
    em = cfg.channels.email
    if em is None or not em.enabled:
        return []
    allowed = mail_senders(cfg)
    out = []
    for folder, g in cfg.groups.items():
        for jid in g.all_chats:
            if jid.startswith("mail:") and jid[5:].lower() not in allowed:
                key = "jid" if jid == g.jid else "chats"
                out.append(f"groups.{folder}.{key}: {jid} is a mail chat, but "
                           f"{jid[5:]} is neither in channels.email.allow_from nor a person's "
                           "email identity: its mail never reaches the agent; add the address "
                           "to one of them")
    return out


async def email_checks(cfg: Config) -> list[tuple[str, str, str, str]]:
    """doctor's checks of the email channel as [(check, level, detail, fix)]: who may write
    and whether senders are verified, then both servers (TLS, login, the mailbox), asked on
    a thread. A missing imapclient is doctor's extras check (mdclaw.config.extras); the
    servers are not asked then."""
    em = cfg.channels.email
    if em is None or not em.enabled:
        return []
    out: list[tuple[str, str, str, str]] = []
    senders = mail_senders(cfg)
    if not senders:
        out.append(("email senders", "warn", "channels.email.allow_from is empty and no person "
                    "has an email identity: no one's mail reaches the assistant",
                    "add the addresses that may write to it"))
    elif em.authserv_id:
        out.append(("email senders", "ok", f"{len(senders)} allowed, verified by "
                    f"{em.authserv_id}'s Authentication-Results", ""))
    else:
        out.append(("email senders", "warn", SENDERS_UNCHECKED, AUTHSERV_FIX))
    out += [("email", "warn", w, "") for w in unanswered_groups(cfg)]
    try:
        password = read_secret(em.password_file)
        smtp_password = (read_secret(em.smtp_password_file) if em.smtp_password_file
                         else password)
    except (OSError, ServiceCredential):
        return out  # the secret file checks say so
    if not password or not smtp_password or any(
            m.extra.name == "email" for m in missing_extras(cfg)):
        return out
    # Imported here: the channel module brings in the Markdown layer, which only an install
    # with mail needs on the command line.
    from mdclaw.channels.email import probe

    out += await asyncio.to_thread(probe, em, password, smtp_password)
    return out
