"""Approvals as the CLI (`mdclaw approvals ...`) and the operator page show and decide them:
the host operator may decide any pending approval; the decision is recorded as theirs
(`cli:<unix user>`, `page`), the audit keeps it, and the daemon carries it out (its IPC
loop's settle pass, woken at once by the page and within a poll interval for the CLI)."""

from __future__ import annotations

import getpass
from typing import Any

from mdclaw.approvals import flow, store
from mdclaw.approvals.cards import what_lines
from mdclaw.approvals.rules import rules_listing
from mdclaw.config import Config
from mdclaw.errors import StateError
from mdclaw.mcp.policy import default_listing
from mdclaw.state import Database


class ApprovalError(StateError, ValueError):
    """An operator's decision that cannot be made (no such approval, decided already, an
    answer a question does not have). The message is safe to show."""


def operator(via: str) -> tuple[str, str]:
    """(decided_by, label) of the host operator deciding through `via` (cli or page)."""
    if via == "cli":
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = "unknown"
        return f"cli:{user}", f"the operator ({user}, CLI)"
    return "page", "the operator (operator page)"


def decide(db: Database, cfg: Config, approval_id: int, verdict: str, *, via: str,
           option: int | None = None) -> store.Approval:
    """Approve or deny (`verdict`) pending approval `approval_id` as the host operator; a
    question is answered with `option` (its number). Raises ApprovalError."""
    with db.transaction() as conn:
        a = store.get(conn, approval_id)
        if a is None:
            raise ApprovalError(f"no approval #{approval_id}")
        if not a.pending:
            raise ApprovalError(f"approval #{approval_id} is {a.status} already"
                                + (f" (by {a.decided_label})" if a.decided_label else ""))
        status, choice = ("approved" if verdict == "approve" else "denied"), None
        if a.kind == "question" and verdict == "approve":
            options = a.request.get("options") or []
            if option is None or not 1 <= option <= len(options):
                raise ApprovalError(f"#{approval_id} is a question: answer it with an option "
                                    f"from 1 to {len(options)} (--option N)")
            status, choice = "answered", str(option)
        by, label = operator(via)
        got = flow.decide(conn, cfg, approval_id, status=status, by=by, label=label, via=via,
                          choice=choice)
        if got is None:  # decided between the read and now (same transaction: never)
            raise ApprovalError(f"approval #{approval_id} was decided meanwhile")
        return got


def approval_row(a: store.Approval) -> dict[str, Any]:
    """One approval as `mdclaw approvals list --json` and the page show it (no codes)."""
    return a.as_dict()


def approval_rows(db: Database, *, status: str | None = None, folder: str | None = None,
                  limit: int = 200) -> list[dict[str, Any]]:
    return [approval_row(a) for a in store.list_approvals(db, status=status, folder=folder,
                                                          limit=limit)]


def approval_detail(db: Database, approval_id: int) -> dict[str, Any] | None:
    """One approval with the whole request, escaped as a card shows it, not cut."""
    a = store.get(db, approval_id)
    if a is None:
        return None
    lines, _ = what_lines(a.kind, a.request, full=True)
    return approval_row(a) | {"shown": lines}


def rules_for_groups(cfg: Config, folder: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """The effective approval rules of every group (or one), in the order they are tried,
    then the MCP default that holds a call no rule matched (`"default": true` entries:
    mdclaw.mcp.policy.default_steps, the definition the daemon decides with)."""
    folders = [folder] if folder is not None else sorted(cfg.groups)
    return {f: rules_listing(cfg, f) + default_listing(cfg, f) for f in folders}
