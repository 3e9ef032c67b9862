"""People as `mdclaw people list` and the operator page show them: the config's people (role,
identities, where their cards go) and the identities admitted through admit cards."""

from __future__ import annotations

from typing import Any

from mdclaw.config import Config
from mdclaw.people import identity_label
from mdclaw.state import Database
from mdclaw.state.people import list_admitted


def people_rows(cfg: Config) -> list[dict[str, Any]]:
    """One row per person of the config: key, name, role, identities, card chat."""
    return [{"key": key, "name": p.name, "role": p.role,
             "identities": {c: list(ids) for c, ids in p.identities.items()},
             "card_chat": p.card_chat()}
            for key, p in sorted(cfg.people.items())]


def admitted_rows(db: Database) -> list[dict[str, Any]]:
    """One row per identity admitted to a group (who admitted it, when)."""
    return [a.as_dict() | {"identity": identity_label(a.channel, a.sender)}
            for a in list_admitted(db)]
