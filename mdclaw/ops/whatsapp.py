"""The WhatsApp link, as `status`, `doctor` and `mdclaw whatsapp link` describe it."""

from __future__ import annotations

from typing import Any

from mdclaw.config import Config


def whatsapp_status(cfg: Config) -> dict[str, Any] | None:
    """{link_state, account, session, fix} of the configured WhatsApp channel (None when it is
    not enabled), read from the session files: what `status` and `doctor` say."""
    wa = cfg.channels.whatsapp
    if wa is None or not wa.enabled:
        return None
    # Imported here for the CLI's start-up: the channel module brings in the chat formatter
    # (markdown-it, nh3: ~60 ms on every command); only an install with WhatsApp reads it.
    from mdclaw.channels.whatsapp import LINK_FIX, link_state

    state, account = link_state(cfg.whatsapp_session_path)
    return {"link_state": state, "account": account,
            "session": str(cfg.whatsapp_session_path), "fix": LINK_FIX.get(state)}
