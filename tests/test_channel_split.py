"""Splitting text at a channel's limit: every piece fits, nothing is lost or reordered."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from mdclaw.channels.base import split_text
from mdclaw.channels.telegram import utf16_len

WORDS = st.text(alphabet=st.sampled_from("ab \n\N{GRINNING FACE}é"), max_size=400)


def squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


@settings(max_examples=300, deadline=None)
@given(text=WORDS, limit=st.integers(min_value=2, max_value=60))
def test_pieces_fit_and_keep_every_visible_character(text: str, limit: int) -> None:
    for measure in (len, utf16_len):
        pieces = split_text(text, limit, measure=measure)
        assert all(measure(p) <= limit for p in pieces)
        # only the single whitespace at each cut is dropped
        assert squeeze("".join(pieces)) == squeeze(text)
        assert len("".join(pieces)) >= len(text) - 2 * (len(pieces) - 1)


def test_prefers_paragraphs_then_lines_then_words() -> None:
    assert split_text("aaaa\n\nbbbb cccc", 11) == ["aaaa", "bbbb cccc"]
    assert split_text("aaaa\nbbbb cccc", 11) == ["aaaa", "bbbb cccc"]
    assert split_text("aaaa bbbb cccc", 10) == ["aaaa bbbb", "cccc"]
    assert split_text("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]
    assert split_text("", 10) == [""]
    # an emoji is two UTF-16 units: never cut in half, never over the limit
    assert split_text("\N{GRINNING FACE}" * 5, 4, measure=utf16_len) == [
        "\N{GRINNING FACE}" * 2, "\N{GRINNING FACE}" * 2, "\N{GRINNING FACE}"]
