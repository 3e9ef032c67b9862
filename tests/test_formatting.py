"""Trigger matching, prompt format and reply clean-up."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mdclaw.formatting import (
    PromptMessage,
    addresses,
    format_prompt,
    strip_internal,
)


def test_trigger_regex_characters_are_literal() -> None:
    assert addresses("hi @C++bot!", "@C++bot")
    assert not addresses("hi @Cbot", "@C++bot")
    assert addresses("a.b, yo", "a.b") and not addresses("axb, yo", "a.b")


@given(st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,15}", fullmatch=True),
       st.sampled_from(["", "@"]))
def test_word_triggers_match_alone_but_not_inside_words(name, at) -> None:
    trigger = at + name
    assert addresses(f"@{name} hello", trigger)
    assert addresses(f"{name.upper()}, hello", trigger)
    assert not addresses(f"x{name}, hi", trigger)
    assert not addresses(f"{name}x, hi", trigger)
    assert not addresses(f"hello @x{name}", trigger)


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


# --------------------------------------------------------------------------- addressing


@pytest.mark.parametrize("trigger", ["@Andy", "Andy"])
@pytest.mark.parametrize("text", [
    "@Andy what's up", "ok @andy.", "what do you think, @ANDY?",  # @Name anywhere
    "Andy, what's the weather?", "andy: turn on the light", "ANDY!", "Andy?", "andy",
    "Hey Andy, help me", "hi andy: quick one", "  Andy ,  hi",  # the name first, then , or :
])
def test_a_message_that_addresses_the_assistant_wakes_it(trigger, text) -> None:
    assert addresses(text, trigger)


@pytest.mark.parametrize("trigger", ["@Andy", "Andy"])
@pytest.mark.parametrize("text", [
    "I told andy yesterday", "andy is asleep", "andy's bike is broken", "ask Andy, he knows",
    "Sandy, come here", "Andyman, hi", "mail me at bob@andy.com", "Hey Andy what now",
    "we said Andy: no", "", "andy andy",
])
def test_a_passing_mention_does_not_wake_the_assistant(trigger, text) -> None:
    assert not addresses(text, trigger)


@given(st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,15}", fullmatch=True),
       st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_the_name_inside_a_sentence_never_wakes_it(name, tail) -> None:
    """Words before the name that are no greeting make it a mention, whatever follows."""
    assert not addresses(f"I think {name}{tail}", name) or f"@{name}".lower() in \
        f"I think {name}{tail}".lower()
