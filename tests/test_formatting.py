"""Trigger matching, prompt format and reply clean-up."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mdclaw.formatting import (
    PromptMessage,
    format_prompt,
    mentions_trigger,
    strip_internal,
)


@pytest.mark.parametrize("trigger", ["@Andy", "Andy", " @andy "])
@pytest.mark.parametrize("text,hit", [
    ("@Andy what's up", True), ("hey andy, help", True), ("ANDY!", True), ("ok @andy.", True),
    ("Andyman is here", False), ("mail me at bob@andy.com", False), ("sandy beach", False),
    ("", False),
])
def test_trigger_whole_word_case_insensitive(trigger, text, hit) -> None:
    assert mentions_trigger(text, trigger) is hit


def test_trigger_regex_characters_are_literal() -> None:
    assert mentions_trigger("hi @C++bot!", "@C++bot")
    assert not mentions_trigger("hi @Cbot", "@C++bot")
    assert mentions_trigger("yo a.b", "a.b") and not mentions_trigger("yo axb", "a.b")


@given(st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,15}", fullmatch=True),
       st.sampled_from(["", "@"]))
def test_word_triggers_match_alone_but_not_inside_words(name, at) -> None:
    trigger = at + name
    assert mentions_trigger(f"@{name} hello", trigger)
    assert mentions_trigger(f"hello {name.upper()}?", trigger)
    assert not mentions_trigger(f"x{name}", trigger)
    assert not mentions_trigger(f"{name}x", trigger)


def test_strip_internal() -> None:
    assert strip_internal("<internal>thinking</internal>Hello") == "Hello"
    assert strip_internal("A<internal>x\ny</internal> B <INTERNAL>z</INTERNAL>") == "A B"
    assert strip_internal("<internal>unterminated secret") == ""
    assert strip_internal("plain") == "plain"


def test_prompt_escapes_and_uses_local_time() -> None:
    msgs = [PromptMessage("Alice <a>", "1 < 2 & \"quoted\"", "2026-07-01T06:30:00.000Z")]
    out = format_prompt(msgs, "Europe/Berlin")
    assert 'sender="Alice &lt;a&gt;"' in out
    assert "1 &lt; 2 &amp;" in out
    assert 'time="2026-07-01 08:30"' in out


def test_prompt_keeps_newest_within_caps() -> None:
    msgs = [PromptMessage("u", f"m{i}", "2026-01-01T00:00:00Z") for i in range(100)]
    out = format_prompt(msgs, "UTC", max_messages=10)
    assert "m99" in out and "m90" in out and "m89" not in out
    out = format_prompt(msgs, "UTC", max_chars=200)
    assert "m99" in out and "m0<" not in out


def test_prompt_lists_failed_deliveries() -> None:
    out = format_prompt([PromptMessage("u", "hi", "2026-01-01T00:00:00Z")], "UTC",
                        failed=["reply 7: chat not found"])
    assert "<failed>reply 7: chat not found</failed>" in out
