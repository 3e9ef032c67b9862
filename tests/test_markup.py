"""The assistant's Markdown rendered for WhatsApp, and cut at a length without breaking code."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdclaw.channels.base import split_text
from mdclaw.markup import parse, split_message, to_whatsapp


@pytest.mark.parametrize(("md", "wa"), [
    ("plain text", "plain text"),
    ("**bold**", "*bold*"),
    ("__bold__", "*bold*"),
    ("*italic*", "_italic_"),
    ("_italic_", "_italic_"),
    ("~~gone~~", "~gone~"),
    ("***both***", "_*both*_"),
    ("**bold _and italic_ inside**", "*bold _and italic_ inside*"),
    ("**outer **inner** outer**", "*outer inner outer*"),
    ("`x = 1`", "`x = 1`"),
    ("```python\nprint('hi')\n```", "```\nprint('hi')\n```"),
    ("    indented code", "```\nindented code\n```"),
    ("[the docs](https://example.org/d)", "the docs (https://example.org/d)"),
    ("<https://example.org>", "https://example.org"),
    ("[https://example.org](https://example.org)", "https://example.org"),
    ("![a cat](https://example.org/c.png)", "a cat (https://example.org/c.png)"),
    ("# Title", "*Title*"),
    ("## Title with **bold**", "*Title with bold*"),
    ("- one\n- two", "- one\n- two"),
    ("* one\n* two", "- one\n- two"),
    ("1. one\n2. two", "1. one\n2. two"),
    ("3. three\n4. four", "3. three\n4. four"),
    ("- one\n  - nested\n- two", "- one\n  - nested\n- two"),
    ("> quoted\n> more", "> quoted\nmore".replace("\nmore", "\n> more")),
    ("a\\*not bold\\*", "a*not bold*"),
    ("fish &amp; chips", "fish & chips"),
    ("line one\nline two", "line one\nline two"),
    ("para one\n\npara two", "para one\n\npara two"),
    ("---", "———"),
    ("text <b>html</b>", "text <b>html</b>"),
    ("| a | b |\n|---|---|\n| 1 | 2 |", "*a* | *b*\n1 | 2"),
    ("[ref]: https://example.org", "[ref]: https://example.org"),
    ("", ""),
    ("   ", "   "),
])
def test_markdown_becomes_whatsapp_formatting(md: str, wa: str) -> None:
    assert to_whatsapp(md) == wa


def test_a_long_reply_keeps_its_structure() -> None:
    md = ("# Plan\n\nHere is **what** I found:\n\n1. The *first* step\n2. The second, see "
          "[the page](https://example.org/x)\n\n```sh\nls -l\n```\n\nDone.")
    assert to_whatsapp(md) == (
        "*Plan*\n\nHere is *what* I found:\n\n1. The _first_ step\n2. The second, see "
        "the page (https://example.org/x)\n\n```\nls -l\n```\n\nDone.")


def test_parse_gives_one_tree_other_renderers_can_walk() -> None:
    tree = parse("**a** b")
    assert [c.type for c in tree.children] == ["paragraph"]
    inline = tree.children[0].children[0]
    assert [n.type for n in inline.children if n.content or n.children] == ["strong", "text"]


# ------------------------------------------------------------------ nothing is lost

def _alnum(s: str) -> str:
    return "".join(c for c in s if c.isalnum())


def _is_subsequence(small: str, big: str) -> bool:
    it = iter(big)
    return all(c in it for c in small)


# Markdown's own characters among letters, so that every construct turns up. `&` is left out:
# entities (`&amp;`) are decoded on purpose (test above).
ALPHABET = "ab1 \n*_~`#->[]()!<>:|\\.x"


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=80))
def test_conversion_never_loses_text(md: str) -> None:
    """Every letter and digit of the Markdown is in the WhatsApp text, in the same order
    (the markers go, the words stay; link targets are added, never dropped)."""
    out = to_whatsapp(md)
    assert _is_subsequence(_alnum(md), _alnum(out)), (md, out)


words = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=8)


@st.composite
def documents(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A Markdown document built from constructs, and the words it holds."""
    blocks, seen = [], []
    for _ in range(draw(st.integers(1, 6))):
        ws = draw(st.lists(words, min_size=1, max_size=5))
        seen.extend(ws)
        kind = draw(st.sampled_from(["p", "bold", "em", "strike", "code", "fence", "h",
                                     "ul", "ol", "quote", "link"]))
        text = " ".join(ws)
        blocks.append({
            "p": text, "bold": f"**{text}**", "em": f"*{text}*", "strike": f"~~{text}~~",
            "code": f"`{text}`", "fence": f"```\n{text}\n```", "h": f"## {text}",
            "ul": "\n".join(f"- {w}" for w in ws), "ol": "\n".join(f"1. {w}" for w in ws),
            "quote": f"> {text}", "link": f"[{text}](https://example.org/{ws[0]})",
        }[kind])
    return "\n\n".join(blocks), seen


@settings(max_examples=200, deadline=None)
@given(documents())
def test_every_word_of_a_document_arrives_in_order(doc: tuple[str, list[str]]) -> None:
    md, ws = doc
    out = to_whatsapp(md)
    found = re.findall(r"[a-z0-9]+", out)
    assert _is_subsequence(" ".join(ws).replace(" ", ""), "".join(found)), (md, out)


# ------------------------------------------------------------------ splitting

def test_short_text_is_one_piece() -> None:
    assert split_message("hello", 100) == ["hello"]


def test_paragraphs_are_packed_into_pieces() -> None:
    text = "\n\n".join(["a" * 30] * 5)
    pieces = split_message(text, 70)
    assert pieces == ["a" * 30 + "\n\n" + "a" * 30] * 2 + ["a" * 30]


def test_a_code_block_that_fits_moves_whole_to_the_next_piece() -> None:
    code = "```\n" + "\n".join(f"line {i}" for i in range(6)) + "\n```"
    text = "intro " * 8 + "\n\n" + code
    pieces = split_message(text, len(code) + 5)
    assert pieces[-1] == code
    assert all(p.count("```") % 2 == 0 for p in pieces)


def test_a_code_block_too_long_is_closed_and_reopened() -> None:
    code = "```\n" + "\n".join(f"print({i})" for i in range(40)) + "\n```"
    pieces = split_message("before\n\n" + code + "\n\nafter", 60)
    assert all(len(p) <= 60 for p in pieces)
    assert all(p.count("```") % 2 == 0 for p in pieces), pieces
    lines = [ln for ln in "\n".join(pieces).split("\n") if ln and ln != "```"]
    assert lines == ["before", *(f"print({i})" for i in range(40)), "after"]


def test_a_code_line_longer_than_the_limit_is_cut_hard_inside_blocks() -> None:
    pieces = split_message("```\n" + "x" * 100 + "\n```", 30)
    assert all(len(p) <= 30 and p.startswith("```\n") and p.endswith("\n```") for p in pieces)
    assert "".join(p[4:-4] for p in pieces) == "x" * 100


def test_long_plain_text_uses_the_channels_splitter() -> None:
    text = " ".join(["word"] * 50)
    pieces = split_message(text, 40, split_plain=lambda t, n: split_text(t, n))
    assert pieces == split_text(text, 40)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab \n`x", max_size=300), st.integers(12, 80))
def test_pieces_fit_and_lose_no_letters(text: str, limit: int) -> None:
    pieces = split_message(text, limit, split_plain=lambda t, n: split_text(t, n))
    assert all(len(p) <= limit for p in pieces)
    assert _alnum("".join(pieces)) == _alnum(text)
