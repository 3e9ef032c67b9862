"""Discord's Markdown from the assistant's Markdown (mdclaw.markup.to_discord) and the split
at Discord's 2,000 characters (split_discord)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdclaw.markup import split_discord, to_discord, utf16_len


@pytest.mark.parametrize(("markdown", "discord"), [
    ("**bold** and *it* and ~~gone~~", "**bold** and *it* and ~~gone~~"),
    ("__bold__ _it_", "**bold** *it*"),
    ("a_b*c|d~e", "a\\_b\\*c\\|d\\~e"),  # not Markdown: escaped, shown as written
    ("see https://example.org/a_b*c", "see https://example.org/a_b*c"),  # links stay whole
    ("# One\n\n## Two\n\n#### Four", "# One\n\n## Two\n\n**Four**"),
    ("- a\n- b\n\n1. x\n2. y", "- a\n- b\n\n1. x\n2. y"),
    ("> quoted **q**", "> quoted **q**"),
    ("```python\nprint('hi')\n```", "```python\nprint('hi')\n```"),
    ("`a`b`", "`a`b\\`"),
    ("``a`b``", "`` a`b ``"),
    ("[docs](https://e.org/x)", "[docs](<https://e.org/x>)"),
    ("[local](/x)", "local (/x)"),
    ("<https://e.org>", "https://e.org"),
    ("\\# not a heading", "\\# not a heading"),
    ("| a | b |\n|---|---|\n| 1 | 22 |", "```\na | b\n--+---\n1 | 22\n```"),
    ("```\nhas ``` inside\n```", "```\nhas `\u200b`` inside\n```"),
])
def test_to_discord(markdown: str, discord: str) -> None:
    assert to_discord(markdown) == discord


def test_a_code_block_split_keeps_its_language_and_every_line() -> None:
    code = "\n".join(f"x = {i}" for i in range(600))
    pieces = split_discord(to_discord(f"Intro.\n\n```python\n{code}\n```\n\nEnd."))
    assert all(utf16_len(p) <= 2000 for p in pieces)
    blocks = [p for p in pieces if "```" in p]
    assert len(blocks) >= 3 and all(p.count("```") == 2 for p in blocks)
    assert all("```python\n" in p for p in blocks)
    body = [ln for p in blocks for ln in p.split("\n") if ln.startswith("x = ")]
    assert body == code.split("\n")


def test_a_long_paragraph_is_never_cut_inside_a_style() -> None:
    text = to_discord(" ".join(f"**bold {i} words here** plain" for i in range(300)))
    pieces = split_discord(text)
    assert len(pieces) > 1
    for p in pieces:
        assert utf16_len(p) <= 2000
        assert p.count("**") % 2 == 0
    assert " ".join(pieces) == text


def test_the_limit_counts_utf16_units() -> None:
    text = "\N{GRINNING FACE}" * 1500  # 3000 units, one word
    pieces = split_discord(text)
    assert all(utf16_len(p) <= 2000 for p in pieces)
    assert "".join(pieces) == text


_WORDS = st.text(alphabet="abc *_`~\n#>-", min_size=0, max_size=40)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(
    _WORDS,
    st.lists(_WORDS, min_size=1, max_size=40).map(
        lambda ls: "```sh\n" + "\n".join(ls) + "\n```")), min_size=1, max_size=12),
    st.integers(min_value=40, max_value=400))
def test_pieces_fit_and_blocks_stay_closed(blocks: list[str], limit: int) -> None:
    text = to_discord("\n\n".join(blocks))
    for p in split_discord(text, limit):
        assert utf16_len(p) <= limit
        fences = [ln for ln in p.split("\n") if ln.startswith("```")]
        assert len(fences) % 2 == 0
