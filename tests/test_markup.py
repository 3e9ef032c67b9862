"""The assistant's Markdown rendered for WhatsApp, and cut at a length without breaking code."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt

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
    (the markers go, the words stay; link targets are added, never dropped). A code fence's
    info string (its language, "```python") is not text: WhatsApp's code blocks have none."""
    out = to_whatsapp(md)
    assert _is_subsequence(_alnum(_without_fence_info(md)), _alnum(out)), (md, out)


def _without_fence_info(md: str) -> str:
    """`md` with the info string of every fence opener (as the parser reads it) removed."""
    lines = md.split("\n")
    for tok in MarkdownIt("commonmark").enable(["strikethrough", "table"]).parse(md):
        if tok.type == "fence" and tok.info and tok.map:
            first = tok.map[0]
            lines[first] = lines[first].replace(tok.info, "", 1)
    return "\n".join(lines)


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


# ---------------------------------------------------------------------- Telegram

from mdclaw.markup import split_telegram, to_html, to_telegram, utf16_len  # noqa: E402


def _spans(text: str, entities: list[dict]) -> list[tuple[str, str]]:
    """(type, covered text) of each entity, cut out by UTF-16 offsets."""
    raw = text.encode("utf-16-le")
    return [(e["type"], raw[2 * e["offset"]:2 * (e["offset"] + e["length"])].decode("utf-16-le"))
            for e in entities]


def test_telegram_entities_for_each_construct_with_utf16_offsets() -> None:
    md = ("# Über 😀\n\n**粗体 😀** and *italic* ~~old~~ `x=1` [docs](https://e.org/d) "
          "[mail](mailto:a@b.c) <https://auto.org>\n\n- one 😀\n- **two**\n  1. sub\n\n"
          "> quoted **q**\n\n```python\nprint('😀')\n```\n\n---")
    text, ents = to_telegram(md)
    assert text == ("Über 😀\n\n粗体 😀 and italic old x=1 docs mail (mailto:a@b.c) "
                    "https://auto.org\n\n• one 😀\n• two\n  1. sub\n\nquoted q\n\n"
                    "print('😀')\n\n———")
    assert _spans(text, ents) == [
        ("bold", "Über 😀"), ("bold", "粗体 😀"), ("italic", "italic"),
        ("strikethrough", "old"), ("code", "x=1"), ("text_link", "docs"), ("bold", "two"),
        ("blockquote", "quoted q"), ("bold", "q"), ("pre", "print('😀')")]
    assert [e.get("url") for e in ents if e["type"] == "text_link"] == ["https://e.org/d"]
    assert [e.get("language") for e in ents if e["type"] == "pre"] == ["python"]
    assert all(e["offset"] + e["length"] <= utf16_len(text) for e in ents)


def test_telegram_never_puts_an_entity_across_code() -> None:
    text, ents = to_telegram("**bold `code` bold**")
    assert _spans(text, ents) == [("bold", "bold "), ("code", "code"), ("bold", " bold")]


def test_telegram_tables_read_on_a_phone() -> None:
    text, ents = to_telegram("| a | b |\n|---|---|\n| 1 | 2 |")
    assert text == "a | b\n--+--\n1 | 2" and ents == [{"type": "pre", "offset": 0, "length": 17}]
    wide = ("| Name | Description of the thing |\n|---|---|\n"
            "| Alpha | the first letter of the Greek alphabet |\n| Beta | the second one |")
    text, ents = to_telegram(wide)
    assert text == ("Name: Alpha\nDescription of the thing: the first letter of the Greek "
                    "alphabet\n\nName: Beta\nDescription of the thing: the second one")
    assert [s for t, s in _spans(text, ents)] == ["Name", "Description of the thing"] * 2


def test_telegram_long_code_block_becomes_several_pre_entities() -> None:
    code = "\n".join(f"line_{i} = {i} * 2" for i in range(600))
    text, ents = to_telegram(f"Here:\n\n```python\n{code}\n```\n\nDone.")
    pieces = split_telegram(text, ents)
    assert len(pieces) >= 3
    pres = [e for _, es in pieces for e in es if e["type"] == "pre"]
    assert len(pres) >= 3 and all(e.get("language") == "python" for e in pres)
    body = "\n".join(_spans(t, es)[0][1] for t, es in pieces
                     if es and es[0]["type"] == "pre")
    assert body == code


_WORDS = st.sampled_from(["word", "😀", "中文字", "a", "𝔘", "longerword", "x" * 30, "é"])
_INLINE = st.lists(st.tuples(_WORDS, st.sampled_from(["", "**", "_", "~~", "`"])),
                   min_size=1, max_size=12).map(
    lambda ws: " ".join(f"{m}{w}{m}" for w, m in ws))
_BLOCK = st.one_of(
    _INLINE,
    _INLINE.map(lambda t: "# " + t),
    st.lists(_INLINE, min_size=1, max_size=4).map(lambda ls: "\n".join("- " + x for x in ls)),
    st.lists(_WORDS, min_size=1, max_size=30).map(lambda ls: "```sh\n" + "\n".join(ls) + "\n```"),
    _INLINE.map(lambda t: "> " + t),
    st.tuples(_WORDS, _WORDS).map(lambda p: f"[{p[0]}](https://e.org/{len(p[1])})"),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_BLOCK, min_size=1, max_size=10).map("\n\n".join),
       st.integers(min_value=8, max_value=300))
def test_split_telegram_pieces_fit_keep_entities_and_rebuild_the_text(md: str,
                                                                      limit: int) -> None:
    text, ents = to_telegram(md)

    def cover(t: str, es: list[dict]) -> list[set]:
        c: list[set] = [set() for _ in range(utf16_len(t))]
        for e in es:
            for k in range(e["offset"], e["offset"] + e["length"]):
                c[k].add((e["type"], e.get("url"), e.get("language")))
        return c

    whole = cover(text, ents)
    pieces = split_telegram(text, ents, limit)
    pos = 0  # in code points of `text`
    for piece, pents in pieces:
        assert utf16_len(piece) <= limit
        assert all(e["length"] > 0 and e["offset"] >= 0
                   and e["offset"] + e["length"] <= utf16_len(piece) for e in pents)
        skip = 0
        while not text[pos + skip:].startswith(piece) and text[pos + skip:pos + skip + 1] \
                in (" ", "\n"):
            skip += 1
        assert text[pos + skip:].startswith(piece), "pieces are the text, cut at breaks"
        base = utf16_len(text[:pos + skip])
        assert cover(piece, pents) == whole[base:base + utf16_len(piece)]
        pos += skip + len(piece)
    assert text[pos:] == ""


def test_to_html_renders_markdown_and_keeps_nothing_unsafe() -> None:
    html = to_html("# T\n\n**b** [ok](https://e.org) [m](mailto:a@b.c) [bad](javascript:alert(1))"
                   " <img src=x onerror=alert(1)> <script>alert(1)</script>\n\n"
                   "![pic](https://e.org/p.png)")
    assert "<h1>T</h1>" in html and "<strong>b</strong>" in html
    assert ('<a href="https://e.org" target="_blank" rel="noopener noreferrer">ok</a>'
            in html)
    assert 'href="mailto:a@b.c"' in html
    assert "javascript" not in html.replace("[bad](javascript:alert(1))", "")
    assert "<img" not in html and "<script" not in html
    assert "&lt;script&gt;" in html  # written HTML is shown as text
    assert '<a href="https://e.org/p.png" target="_blank" rel="noopener noreferrer">pic</a>' \
        in html


# ---------------------------------------------------------------------- Slack mrkdwn

from mdclaw.markup import split_slack, to_slack  # noqa: E402


@pytest.mark.parametrize(("md", "mrkdwn"), [
    ("**bold** and *it* and ~~gone~~", "*bold* and _it_ and ~gone~"),
    ("# Title", "*Title*"),
    ("a < b & c > d", "a &lt; b &amp; c &gt; d"),
    ("`x<y>` then", "`x&lt;y&gt;` then"),
    ("```js\nif (a < b && c) {}\n```", "```\nif (a &lt; b &amp;&amp; c) {}\n```"),
    ("[the docs](https://d.io/a?x=1&y=2)", "<https://d.io/a?x=1&amp;y=2|the docs>"),
    ("[pipe](https://d.io/a|b)", "<https://d.io/a%7Cb|pipe>"),
    ("<https://auto.link/x>", "<https://auto.link/x>"),
    ("[get](ftp://f.io/x)", "get (ftp://f.io/x)"),
    ("- one\n- two", "• one\n• two"),
    ("> quoted <b>", "> quoted &lt;b&gt;"),
    ("<@U123> <!channel>", "&lt;@U123&gt; &lt;!channel&gt;"),  # no mention by accident
])
def test_markdown_becomes_slack_mrkdwn(md: str, mrkdwn: str) -> None:
    assert to_slack(md) == mrkdwn


@given(st.lists(st.sampled_from(["word", "**bold words here**", "[a link](https://x.io)",
                                 "a&b<c>", "`co de`", "\n", "\n\n", "\n\n```\nx < 1\n```\n\n"]),
                max_size=120).map(" ".join), st.integers(60, 400))
@settings(max_examples=150, deadline=None)
def test_split_slack_never_cuts_a_link_an_escape_or_a_code_block(md: str, limit: int) -> None:
    rendered = to_slack(md)
    pieces = split_slack(rendered, limit)
    for p in pieces:
        assert len(p) <= limit
        assert p.count("```") % 2 == 0
        # every < opens a whole link, every & a whole escape
        assert re.fullmatch(r"(?:[^<>&]|<[^<>]+>|&(?:amp|lt|gt);)*", p, re.S), p
    letters = re.sub(r"[\s`]", "", rendered)
    assert re.sub(r"[\s`]", "", "".join(pieces)) == letters


def test_split_slack_keeps_a_long_link_whole_across_the_limit() -> None:
    label = "w " * 150  # spaces inside the link, on both sides of the limit
    rendered = to_slack("x " * 1975 + f"[{label.strip()}](https://e.io/a) " + "y " * 100)
    pieces = split_slack(rendered, 4000)
    assert len(pieces) == 2
    assert f"<https://e.io/a|{label.strip()}>" in pieces[1]


def test_table_column_alignment_becomes_a_class_the_page_knows() -> None:
    """`|--:|` (a number column) comes as class align-right, never as a style attribute (the
    chat page's CSP refuses those); a class written in the text is not taken."""
    html = to_html("| item | qty |\n|:-----|----:|\n| milk | 2 |")
    assert '<th class="align-left">item</th>' in html
    assert '<td class="align-right">2</td>' in html
    assert "style" not in html
    assert "<td" not in to_html('<td class="align-right">x</td>')  # shown as text
