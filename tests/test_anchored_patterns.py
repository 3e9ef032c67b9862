"""Names and ids checked by a regular expression are checked whole: Python's `$` also
matches before a final newline, so `^...$` lets "main\n" through; every such check anchors
with `\\Z` instead."""

from __future__ import annotations

import pytest

from mdclaw.channels.base import ChannelError
from mdclaw.channels.http import normalize_jid
from mdclaw.integrations.ha_dashboards import entity_format_errors
from mdclaw.integrations.home_assistant import entity_form_refusal


@pytest.mark.parametrize("value", ["hl:main", "main", "hl:a.b@c-d_e"])
def test_local_jids_accepted(value: str) -> None:
    assert normalize_jid(value) == (value if value.startswith("hl:") else f"hl:{value}")


@pytest.mark.parametrize("value", ["hl:main\n", "main\n", "hl:main\r\n", "hl:ma\nin"])
def test_local_jid_with_a_newline_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="is not a local chat"):
        normalize_jid(value)


def test_telegram_chat_with_a_newline_is_not_a_telegram_chat() -> None:
    from mdclaw.channels.telegram import TelegramChannel

    ch = TelegramChannel.__new__(TelegramChannel)  # _chat_id needs no connection
    assert ch._chat_id("tg:-100123") == -100123
    with pytest.raises(ChannelError, match="is not a Telegram chat"):
        ch._chat_id("tg:-100123\n")


def test_ha_entity_ids_with_a_newline_are_refused() -> None:
    assert entity_form_refusal("light.kitchen") is None
    assert entity_form_refusal("light.kitchen\n") is not None
    assert entity_format_errors(["light.kitchen\n"]) != []
