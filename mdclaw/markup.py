"""The assistant's Markdown, parsed once and rendered for a chat service.

Agents answer in Markdown. Chat services each have their own way of showing emphasis: WhatsApp
marks it in the text (`*bold*`, `_italic_`, `~strike~`, ```` ``` ```` blocks), Telegram sends
entities beside plain text. `parse` turns Markdown (CommonMark plus `~~strike~~` and tables,
by markdown-it-py) into a syntax tree; a renderer walks that tree. `to_whatsapp` is the
WhatsApp renderer; another service's renderer walks the same tree.

Nothing the person should read is dropped: link targets follow their text in brackets, images
become their description and address, raw HTML is kept as written, and link reference
definitions are not taken out of the text (they stay as written, since no renderer here shows
a reference link differently from its text). Only the Markdown markers themselves go, and a
fenced block's language name.

`split_message` cuts a rendered text into pieces of a service's length, never inside a
``` block without closing it and opening it again in the next piece.

`to_telegram` walks the same tree into plain text plus Telegram `MessageEntity` dicts (offsets
and lengths in UTF-16 code units, as the Bot API counts); nothing in it can fail to parse on
Telegram's side. `split_telegram` cuts that at 4096 units, at a paragraph, line or word break
no entity crosses; a code block too long for one message becomes several `pre` entities.

`to_slack` renders Slack's mrkdwn (the WhatsApp marks, `&`, `<` and `>` escaped, links as
`<url|text>`); `split_slack` cuts it at Slack's length without cutting a ``` block, a link, an
escape or an inline code span.

`to_html` is the web chat's rendering: markdown-it-py with raw HTML off (written HTML shows as
text), then an nh3 allow-list (tags, attributes, and only http, https and mailto links, which
open in a new tab with `rel="noopener noreferrer"`).
"""

from __future__ import annotations

import html as _html
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import nh3
from markdown_it import MarkdownIt
from markdown_it.tree import SyntaxTreeNode


@lru_cache(maxsize=1)
def _parser() -> MarkdownIt:
    md = MarkdownIt("commonmark").enable(["strikethrough", "table"])
    # A `[name]: url` line would vanish from the text; keep it as written.
    md.disable("reference")
    return md


def parse(text: str) -> SyntaxTreeNode:
    """The syntax tree of Markdown `text` (the root node; its children are the blocks)."""
    return SyntaxTreeNode(_parser().parse(text or ""))


# ---------------------------------------------------------------------- WhatsApp

BULLET = "- "
RULE = "———"


class _WhatsApp:
    """Renders a tree in WhatsApp's text formatting."""

    bullet = BULLET

    def __init__(self) -> None:
        self.open: set[str] = set()  # styles in force (nested same styles are not repeated)

    # ------------------------------------------------------------------ blocks
    def blocks(self, nodes: list[SyntaxTreeNode], tight: bool = False) -> str:
        parts = [self.block(n) for n in nodes]
        return ("\n" if tight else "\n\n").join(p for p in parts if p != "")

    def block(self, node: SyntaxTreeNode) -> str:
        t = node.type
        if t == "paragraph":
            return self.inline_of(node)
        if t == "heading":
            return self.bold_block(node)
        if t in ("bullet_list", "ordered_list"):
            return self.list_(node)
        if t == "blockquote":
            inner = self.blocks(node.children)
            return "\n".join(f"> {line}" if line else ">" for line in inner.split("\n"))
        if t in ("fence", "code_block"):
            return f"```\n{node.content.rstrip(chr(10))}\n```"
        if t == "hr":
            return RULE
        if t == "html_block":
            return node.content.rstrip("\n")
        if t == "table":
            return self.table(node)
        if t == "inline":
            return self.inline(node.children)
        # Anything else (a future block type): its text, as blocks or inline.
        return self.blocks(node.children) if node.children else node.content

    def list_(self, node: SyntaxTreeNode) -> str:
        ordered = node.type == "ordered_list"
        start = int(node.attrs.get("start", 1) or 1) if ordered else 1
        tight = all(c.hidden for item in node.children for c in item.children
                    if c.type == "paragraph")
        out = []
        for i, item in enumerate(node.children):
            marker = f"{start + i}. " if ordered else self.bullet
            body = self.blocks(item.children, tight=tight)
            pad = " " * len(marker)
            lines = body.split("\n") if body else [""]
            out.append(marker + lines[0] + "".join(
                f"\n{pad}{line}" if line else "\n" for line in lines[1:]))
        return ("\n" if tight else "\n\n").join(out)

    def table(self, node: SyntaxTreeNode) -> str:
        rows = []
        for section in node.children:  # thead, tbody
            for tr in section.children:
                cells = [self.bold_block(cell) if section.type == "thead"
                         else self.inline_of(cell) for cell in tr.children]
                rows.append(" | ".join(cells))
        return "\n".join(rows)

    # ------------------------------------------------------------------ inline
    def inline_of(self, node: SyntaxTreeNode) -> str:
        return "".join(self.inline(c.children) if c.type == "inline" else self.block(c)
                       for c in node.children)

    def bold_block(self, node: SyntaxTreeNode) -> str:
        """A heading or table header: bold, without bold marks inside."""
        if "strong" in self.open:
            return self.inline_of(node)
        self.open.add("strong")
        try:
            inner = self.inline_of(node)
        finally:
            self.open.discard("strong")
        return self.styled("*", "strong", inner)

    def inline(self, nodes: list[SyntaxTreeNode]) -> str:
        return "".join(self.span(n) for n in nodes)

    def styled(self, mark: str, style: str, text: str) -> str:
        if style in self.open or not text.strip():
            return text
        # WhatsApp needs the marks against the text: move outer spaces outside them.
        core = text.strip()
        lead = text[:len(text) - len(text.lstrip())]
        trail = text[len(text.rstrip()):]
        return f"{lead}{mark}{core}{mark}{trail}"

    def styled_children(self, mark: str, style: str, node: SyntaxTreeNode) -> str:
        nested = style in self.open
        self.open.add(style)
        try:
            inner = self.inline(node.children)
        finally:
            if not nested:
                self.open.discard(style)
        return inner if nested else self.styled(mark, style, inner)

    def span(self, node: SyntaxTreeNode) -> str:
        t = node.type
        if t in ("text", "text_special"):
            return node.content
        if t in ("softbreak", "hardbreak"):
            return "\n"
        if t == "strong":
            return self.styled_children("*", "strong", node)
        if t == "em":
            return self.styled_children("_", "em", node)
        if t == "s":
            return self.styled_children("~", "s", node)
        if t == "code_inline":
            return f"`{node.content}`"
        if t == "link":
            text = self.inline(node.children)
            href = str(node.attrs.get("href", ""))
            if node.markup == "autolink" or not href or text in (href, f"mailto:{text}") \
                    or href in (text, f"mailto:{text}"):
                return text or href
            return f"{text} ({href})"
        if t == "image":
            alt = self.inline(node.children)
            src = str(node.attrs.get("src", ""))
            return f"{alt} ({src})" if alt else src
        if t == "html_inline":
            return node.content
        return self.inline(node.children) if node.children else node.content


def to_whatsapp(markdown: str) -> str:
    """`markdown` in WhatsApp's formatting: *bold*, _italic_, ~strike~, `code`, ``` blocks,
    "- " and "1. " lists, "> " quotes, links as "text (url)"."""
    if not (markdown or "").strip():
        return markdown or ""
    return _WhatsApp().blocks(parse(markdown).children).strip("\n")


# ---------------------------------------------------------------------- Slack

SLACK_LIMIT = 4000  # Slack's advice for a message's text (it truncates at 40,000)
SLACK_BULLET = "• "
_SLACK_SCHEMES = ("http://", "https://", "mailto:")


def slack_escape(text: str) -> str:
    """`text` with the three characters Slack reads as markup escaped (&, <, >)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _slack_url(href: str) -> str:
    """A link target as Slack takes it inside <...>: escaped, and no `|` or space that
    would end it early."""
    return slack_escape(href).replace("|", "%7C").replace(" ", "%20")


class _Slack(_WhatsApp):
    """Renders a tree in Slack's mrkdwn: WhatsApp's marks (*bold*, _italic_, ~strike~,
    `code`, ``` blocks, > quotes), with the text escaped and links as <url|text>."""

    bullet = SLACK_BULLET

    def block(self, node: SyntaxTreeNode) -> str:
        t = node.type
        if t in ("fence", "code_block"):
            return f"```\n{slack_escape(node.content.rstrip(chr(10)))}\n```"
        if t == "html_block":
            return slack_escape(node.content.rstrip("\n"))
        return super().block(node)

    def span(self, node: SyntaxTreeNode) -> str:
        t = node.type
        if t in ("text", "text_special", "html_inline"):
            return slack_escape(node.content)
        if t == "code_inline":
            return f"`{slack_escape(node.content)}`"
        if t in ("link", "image"):
            text = self.inline(node.children)
            href = str(node.attrs.get("href" if t == "link" else "src", ""))
            if not href:
                return text
            if not href.lower().startswith(_SLACK_SCHEMES):
                return f"{text} ({slack_escape(href)})" if text else slack_escape(href)
            plain = slack_escape(href)
            if node.markup == "autolink" or not text or text in (plain, f"mailto:{text}") \
                    or plain == f"mailto:{text}":
                return f"<{_slack_url(href)}>"
            # The label ends at the first `>`; it is escaped already, `|` is fine in it.
            return f"<{_slack_url(href)}|{text.replace(chr(10), ' ')}>"
        return super().span(node)


def to_slack(markdown: str) -> str:
    """`markdown` in Slack's mrkdwn: *bold*, _italic_, ~strike~, `code`, ``` blocks, "• "
    and "1. " lists, "> " quotes, links as <url|text>; &, < and > escaped everywhere."""
    if not (markdown or "").strip():
        return slack_escape(markdown or "")
    return _Slack().blocks(parse(markdown).children).strip("\n")


# Spans of rendered mrkdwn a cut must not fall into: a link or mention, an escape, inline
# code, a styled run (on one line).
_SLACK_ATOMS = re.compile(r"<[^<>\n]*>|&(?:amp|lt|gt);|`[^`\n]+`|(?<!\w)\*[^*\n]+\*(?!\w)"
                          r"|(?<!\w)_[^_\n]+_(?!\w)|(?<!\w)~[^~\n]+~(?!\w)")


def _split_slack_plain(text: str, limit: int) -> list[str]:
    """Cut mrkdwn without ``` blocks at a paragraph, line or word break outside the spans
    above (hard, outside them if it can, when there is none)."""
    pieces: list[str] = []
    rest = text
    while len(rest) > limit:
        spans = []
        for m in _SLACK_ATOMS.finditer(rest):
            if m.start() >= limit:
                break
            spans.append((m.start(), m.end()))

        def inside(i: int, spans: list[tuple[int, int]] = spans) -> bool:
            return any(s < i < e for s, e in spans)

        cut, skip = -1, 0
        for sep in ("\n\n", "\n", " "):
            i = rest.rfind(sep, 0, limit)
            while i > 0 and inside(i):
                i = rest.rfind(sep, 0, i)
            if i >= max(1, limit // 4):
                cut, skip = i, len(sep)
                break
        if cut <= 0:
            cut = limit
            while cut > limit // 2 and inside(cut):
                cut -= 1
            if inside(cut):
                cut = limit
        pieces.append(rest[:cut])
        rest = rest[cut + skip:]
    if rest or not pieces:
        pieces.append(rest)
    return pieces


def split_slack(text: str, limit: int = SLACK_LIMIT) -> list[str]:
    """Rendered mrkdwn `text` in pieces of at most `limit` characters: ``` blocks whole or
    closed and opened again, other text cut outside links, escapes and styled runs."""
    return split_message(text, limit, split_plain=_split_slack_plain)


# ---------------------------------------------------------------------- splitting

def split_text(text: str, limit: int, *, measure: Callable[[str], int] = len) -> list[str]:
    """Cut `text` into pieces no longer than `limit` (as `measure` counts).

    Prefers to cut after a paragraph break, then a line break, then a space; the single
    whitespace character at a cut is dropped. Text without any such break is cut hard.
    An empty text gives one empty piece.
    """
    if limit < 1:
        raise ValueError("limit must be at least 1")
    if measure(text) <= limit:
        return [text]
    pieces: list[str] = []
    rest = text
    while measure(rest) > limit:
        # Longest prefix that fits (binary search: the measure grows with the prefix, and
        # is never below the number of code points, so no prefix longer than `limit` fits).
        lo, hi = 1, min(len(rest), limit)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if measure(rest[:mid]) <= limit:
                lo = mid
            else:
                hi = mid - 1
        end = lo
        window = rest[:end]
        cut = -1
        for sep in ("\n\n", "\n", " "):
            i = window.rfind(sep)
            if i > 0:
                cut = i
                skip = len(sep)
                break
        if cut <= 0 or cut < end // 4:  # a break too early would leave tiny pieces
            cut, skip = end, 0
        pieces.append(rest[:cut])
        rest = rest[cut + skip:]
    if rest:
        pieces.append(rest)
    return pieces


FENCE = "```"


def _units(text: str) -> list[tuple[str, bool]]:
    """`text` as (chunk, is_code) units: ``` blocks whole, other text by paragraph."""
    units: list[tuple[str, bool]] = []
    para: list[str] = []
    code: list[str] | None = None
    for line in text.split("\n"):
        if code is not None:
            code.append(line)
            if line.rstrip().endswith(FENCE) and len(code) > 1:
                units.append(("\n".join(code), True))
                code = None
            continue
        if line.lstrip().startswith(FENCE) and not (
                len(line.strip()) > 3 and line.rstrip().endswith(FENCE)):
            if para:
                units.append(("\n".join(para), False))
                para = []
            code = [line]
            continue
        if line.strip() == "" and para:
            units.append(("\n".join(para), False))
            para = []
        elif line.strip() != "" or para:
            para.append(line)
    if code is not None:  # an unclosed block runs to the end
        units.append(("\n".join(code), True))
    if para:
        units.append(("\n".join(para), False))
    return units


def _split_code(block: str, limit: int, measure: Callable[[str], int]) -> list[str]:
    """A ``` block longer than `limit` as several closed blocks, cut between lines (a line
    too long for one block is cut hard)."""
    lines = block.split("\n")
    body = lines[1:-1] if lines[-1].strip() == FENCE else lines[1:]
    if lines[-1].strip() != FENCE and lines[-1].rstrip().endswith(FENCE):
        body = lines[1:-1] + [lines[-1].rstrip()[:-3]]
    # Each piece opens the way the block did ("```python" keeps its highlighting).
    opener = lines[0].strip() if lines[0].strip().startswith(FENCE) else FENCE
    room = limit - measure(f"{opener}\n\n{FENCE}")
    if room < 1:
        opener = FENCE
        room = limit - measure(f"{FENCE}\n\n{FENCE}")
    if room < 1:
        raise ValueError("limit too small for a code block")
    pieces: list[str] = []
    cur: list[str] = []

    def flush() -> None:
        if cur:
            pieces.append(f"{opener}\n" + "\n".join(cur) + f"\n{FENCE}")
            cur.clear()

    for line in body:
        while measure(line) > room:
            flush()
            cut = room
            while cut > 1 and measure(line[:cut]) > room:
                cut -= 1
            pieces.append(f"{opener}\n{line[:cut]}\n{FENCE}")
            line = line[cut:]
        if measure("\n".join([*cur, line])) > room:
            flush()
        cur.append(line)
    flush()
    return pieces or [block]


def split_message(text: str, limit: int, *, measure: Callable[[str], int] = len,
                  split_plain: Callable[[str, int], list[str]] | None = None) -> list[str]:
    """Cut rendered `text` into pieces of at most `limit` (as `measure` counts).

    Paragraphs and ``` blocks are kept whole when they fit; pieces are filled with as many
    of them as fit. A block too long is closed and opened again across pieces; other text
    too long is cut by `split_plain(text, limit)`, by default `split_text` (at a paragraph,
    line or word break).
    """
    if measure(text) <= limit:
        return [text]

    def plain(t: str) -> list[str]:
        if split_plain is not None:
            return split_plain(t, limit)
        return split_text(t, limit, measure=measure)

    pieces: list[str] = []
    cur = ""
    for chunk, is_code in _units(text):
        parts = ([chunk] if measure(chunk) <= limit
                 else _split_code(chunk, limit, measure) if is_code else plain(chunk))
        for part in parts:
            joined = f"{cur}\n\n{part}" if cur else part
            if measure(joined) <= limit:
                cur = joined
            else:
                if cur:
                    pieces.append(cur)
                cur = part
    if cur:
        pieces.append(cur)
    return pieces or [text]


# ---------------------------------------------------------------------- Telegram

TELEGRAM_LIMIT = 4096
TG_BULLET = "• "
#: A table at most this wide (characters) is shown as a monospace block; a wider one as
#: "header: cell" lines, one group per row (what reads on a phone).
TABLE_PRE_WIDTH = 40
_CODE_TYPES = frozenset({"code", "pre"})
_LINK_SCHEMES = ("http://", "https://")


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units (Telegram's unit for lengths and entity offsets)."""
    return len(text.encode("utf-16-le")) // 2


def _unit_index(text: str) -> list[int]:
    """u[i] = UTF-16 units before code point i of `text` (len(text) + 1 entries)."""
    out = [0] * (len(text) + 1)
    n = 0
    for i, ch in enumerate(text):
        out[i] = n
        n += 2 if ord(ch) > 0xFFFF else 1
    out[len(text)] = n
    return out


class _Out:
    """Plain text being built, with the entities over it (offsets in UTF-16 units)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.pos = 0
        self.entities: list[dict[str, Any]] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, s: str) -> None:
        if s:
            self.parts.append(s)
            self.pos += utf16_len(s)

    def mark(self, type_: str, start: int, **extra: Any) -> None:
        """An entity of `type_` from unit `start` to the current end (dropped when empty)."""
        if self.pos > start:
            self.entities.append({"type": type_, "offset": start, "length": self.pos - start,
                                  **extra})

    def extend(self, other: _Out) -> None:
        base = self.pos
        self.add(other.text)
        self.entities.extend({**e, "offset": e["offset"] + base} for e in other.entities)

    def indented(self, pad: str) -> _Out:
        """A copy with `pad` after every line break that starts a non-empty line (entities
        moved; a pad inserted where an entity starts goes before it, where one ends after
        it)."""
        text = self.text
        u = _unit_index(text)
        inserts = [u[i + 1] for i, ch in enumerate(text)
                   if ch == "\n" and i + 1 < len(text) and text[i + 1] != "\n"]
        out = _Out()
        lines = text.split("\n")
        out.add(lines[0] + "".join(f"\n{pad}{line}" if line else "\n" for line in lines[1:]))
        p = utf16_len(pad)
        for e in self.entities:
            s, end = e["offset"], e["offset"] + e["length"]
            ns = s + p * sum(1 for q in inserts if q <= s)
            ne = end + p * sum(1 for q in inserts if q < end)
            out.entities.append({**e, "offset": ns, "length": ne - ns})
        return out


def _language(info: str) -> str | None:
    word = (info or "").strip().split(maxsplit=1)
    lang = word[0] if word else ""
    return lang if lang and len(lang) <= 32 and lang.replace("-", "").replace(
        "+", "").replace("#", "").replace("_", "").isalnum() else None


class _Telegram:
    """Renders a tree as Telegram plain text plus message entities."""

    def __init__(self) -> None:
        self.quote_depth = 0

    # ------------------------------------------------------------------ blocks
    def blocks(self, nodes: list[SyntaxTreeNode], tight: bool = False) -> _Out:
        out = _Out()
        for n in nodes:
            b = self.block(n)
            if not b.text:
                continue
            if out.pos:
                out.add("\n" if tight else "\n\n")
            out.extend(b)
        return out

    def block(self, node: SyntaxTreeNode) -> _Out:
        t = node.type
        if t == "paragraph":
            return self.inline_of(node)
        if t == "heading":
            out = self.inline_of(node)
            out.mark("bold", 0)
            return out
        if t in ("bullet_list", "ordered_list"):
            return self.list_(node)
        if t == "blockquote":
            self.quote_depth += 1
            try:
                out = self.blocks(node.children)
            finally:
                self.quote_depth -= 1
            if self.quote_depth == 0:  # Telegram does not nest quotes
                out.mark("blockquote", 0)
            return out
        if t in ("fence", "code_block"):
            out = _Out()
            out.add(node.content.rstrip("\n"))
            lang = _language(node.info) if t == "fence" else None
            out.mark("pre", 0, **({"language": lang} if lang else {}))
            return out
        if t == "hr":
            out = _Out()
            out.add(RULE)
            return out
        if t == "html_block":
            out = _Out()
            out.add(node.content.rstrip("\n"))
            return out
        if t == "table":
            return self.table(node)
        if t == "inline":
            return self.inline(node.children)
        if node.children:
            return self.blocks(node.children)
        out = _Out()
        out.add(node.content)
        return out

    def list_(self, node: SyntaxTreeNode) -> _Out:
        ordered = node.type == "ordered_list"
        start = int(node.attrs.get("start", 1) or 1) if ordered else 1
        tight = all(c.hidden for item in node.children for c in item.children
                    if c.type == "paragraph")
        out = _Out()
        for i, item in enumerate(node.children):
            marker = f"{start + i}. " if ordered else TG_BULLET
            body = self.blocks(item.children, tight=tight).indented(" " * len(marker))
            if out.pos:
                out.add("\n" if tight else "\n\n")
            out.add(marker)
            out.extend(body)
        return out

    def table(self, node: SyntaxTreeNode) -> _Out:
        head: list[_Out] = []
        rows: list[list[_Out]] = []
        for section in node.children:
            for tr in section.children:
                cells = [self.inline_of(cell) for cell in tr.children]
                if section.type == "thead":
                    head = cells
                else:
                    rows.append(cells)
        plain = [[c.text.replace("\n", " ") for c in r] for r in ([head] if head else []) + rows]
        ncols = max((len(r) for r in plain), default=0)
        widths = [max((len(r[i]) for r in plain if i < len(r)), default=0) for i in range(ncols)]
        out = _Out()
        if sum(widths) + 3 * max(ncols - 1, 0) <= TABLE_PRE_WIDTH:
            lines = [" | ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip()
                     for r in plain]
            if head:
                lines.insert(1, "-+-".join("-" * w for w in widths))
            out.add("\n".join(lines))
            out.mark("pre", 0)
            return out
        # Too wide for a phone: each row as "header: cell" lines.
        for r in rows:
            if out.pos:
                out.add("\n\n")
            for i, cell in enumerate(r):
                if i:
                    out.add("\n")
                if i < len(head) and head[i].text:
                    s = out.pos
                    out.extend(head[i])
                    out.mark("bold", s)
                    out.add(": ")
                out.extend(cell)
        if not rows and head:
            s = out.pos
            out.add(" | ".join(h.text for h in head))
            out.mark("bold", s)
        return out

    # ------------------------------------------------------------------ inline
    def inline_of(self, node: SyntaxTreeNode) -> _Out:
        out = _Out()
        for c in node.children:
            out.extend(self.inline(c.children) if c.type == "inline" else self.block(c))
        return out

    def inline(self, nodes: list[SyntaxTreeNode]) -> _Out:
        out = _Out()
        for n in nodes:
            self.span(n, out)
        return out

    def span(self, node: SyntaxTreeNode, out: _Out) -> None:
        t = node.type
        if t in ("text", "text_special", "html_inline"):
            out.add(node.content)
        elif t in ("softbreak", "hardbreak"):
            out.add("\n")
        elif t in ("strong", "em", "s"):
            s = out.pos
            for c in node.children:
                self.span(c, out)
            out.mark({"strong": "bold", "em": "italic", "s": "strikethrough"}[t], s)
        elif t == "code_inline":
            s = out.pos
            out.add(node.content)
            out.mark("code", s)
        elif t in ("link", "image"):
            sub = _Out()
            for c in node.children:
                self.span(c, sub)
            text = sub.text
            s = out.pos
            out.extend(sub)
            href = str(node.attrs.get("href" if t == "link" else "src", ""))
            if node.markup == "autolink" or not href or text in (href, f"mailto:{text}") \
                    or href in (text, f"mailto:{text}"):
                if not text:
                    out.add(href)
                return
            if href.lower().startswith(_LINK_SCHEMES) and text:
                out.mark("text_link", s, url=href)
            else:
                out.add(f" ({href})" if text else href)
        elif node.children:
            for c in node.children:
                self.span(c, out)
        else:
            out.add(node.content)


def _clip_code(entities: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Telegram lets no entity but a quote contain or cross `code`/`pre`: cut the others
    around them."""
    code = sorted((e["offset"], e["offset"] + e["length"]) for e in entities
                  if e["type"] in _CODE_TYPES)
    if not code:
        return entities
    out: list[dict[str, Any]] = []
    for e in entities:
        if e["type"] in _CODE_TYPES or e["type"] == "blockquote":
            out.append(e)
            continue
        s, end = e["offset"], e["offset"] + e["length"]
        for cs, ce in code:
            if ce <= s or cs >= end:
                continue
            if cs > s:
                out.append({**e, "offset": s, "length": cs - s})
            s = max(s, ce)
            if s >= end:
                break
        if end > s:
            out.append({**e, "offset": s, "length": end - s})
    return out


def _sorted(entities: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(entities, key=lambda e: (e["offset"], -e["length"]))


def to_telegram(markdown: str) -> tuple[str, list[dict[str, Any]]]:
    """`markdown` as Telegram plain text and `MessageEntity` dicts: bold, italic,
    strikethrough, code, pre (with its language), text_link (http and https), blockquote;
    lists with "• " and "1. ", tables as a monospace block or "header: cell" lines."""
    if not (markdown or "").strip():
        return markdown or "", []
    out = _Telegram().blocks(parse(markdown).children)
    text = out.text
    # Nothing to trim at the start (blocks never begin with a break); trailing breaks go.
    stripped = text.rstrip()
    end = utf16_len(stripped)
    ents = []
    for e in out.entities:
        length = min(e["offset"] + e["length"], end) - e["offset"]
        if length > 0:
            ents.append({**e, "length": length})
    return stripped, _sorted(_clip_code(ents))


def _crosses(entities: Sequence[dict[str, Any]], cut: int) -> bool:
    return any(e["offset"] < cut < e["offset"] + e["length"] for e in entities)


def split_telegram(text: str, entities: Sequence[dict[str, Any]],
                   limit: int = TELEGRAM_LIMIT) -> list[tuple[str, list[dict[str, Any]]]]:
    """Cut (`text`, `entities`) into pieces of at most `limit` UTF-16 units, each with the
    entities inside it (offsets relative to the piece).

    A cut goes at a paragraph break, else a line break, else a space that no entity
    crosses (the break itself is dropped); an entity longer than `limit` (a long code
    block) is cut at a line break and continues as a second entity of the same kind in the
    next piece; text without any break is cut hard. Joined with the dropped breaks, the
    pieces are the whole text again.
    """
    if limit < 2:
        raise ValueError("limit must be at least 2")
    pieces: list[tuple[str, list[dict[str, Any]]]] = []
    ents = [dict(e) for e in entities]
    rest = text
    while utf16_len(rest) > limit:
        u = _unit_index(rest)
        # The longest prefix (in code points) within the limit.
        end = max(i for i in range(min(len(rest), limit) + 1) if u[i] <= limit)
        window = rest[:end]
        floor = end // 4
        cut, skip = -1, 0
        for seps, allow_cross, low in (
                (("\n\n", "\n", " "), False, floor), (("\n\n", "\n", " "), False, 1),
                (("\n", " "), True, floor)):
            for sep in seps:
                i = window.rfind(sep)
                while i >= low and _crosses(ents, u[i]) and not allow_cross:
                    i = window.rfind(sep, 0, i)
                if i >= max(low, 1):
                    cut, skip = i, len(sep)
                    break
            if cut > 0:
                break
        if cut <= 0:
            cut, skip = end, 0
        else:  # no piece ends or starts with a line break (spaces may be code's indent)
            while cut > 1 and rest[cut - 1] == "\n":
                cut -= 1
                skip += 1
            while cut + skip < len(rest) and rest[cut + skip] == "\n":
                skip += 1
        cu, nu = u[cut], u[cut + skip]
        head: list[dict[str, Any]] = []
        tail: list[dict[str, Any]] = []
        for e in ents:
            s, e_end = e["offset"], e["offset"] + e["length"]
            if s < cu:
                head.append({**e, "length": min(e_end, cu) - s})
            if e_end > nu:
                ns = max(s, nu)
                tail.append({**e, "offset": ns - nu, "length": e_end - ns})
        pieces.append((rest[:cut], _sorted([e for e in head if e["length"] > 0])))
        rest = rest[cut + skip:]
        ents = [e for e in tail if e["length"] > 0]
    if rest or not pieces:
        pieces.append((rest, _sorted(ents)))
    return pieces


# ---------------------------------------------------------------------- Discord

DISCORD_LIMIT = 2000
#: Characters Discord's Markdown reads as markers anywhere in a line.
_DC_SPECIAL = re.compile(r"([\\*_~`|])")
#: A line start Discord reads as a block (heading, quote, list, subtext).
_DC_LINE_START = re.compile(r"^(#{1,3} |-# |>>> |> |[-*+] |\d+\. )", re.MULTILINE)
_DC_URL = re.compile(r"https?://[^\s<>]+")
#: The inline markers whose pairs must end in the piece they start in.
_DC_PAIRS = ("**", "__", "~~", "||", "*", "_", "`")


def _dc_escape(text: str) -> str:
    """`text` with Discord's Markdown markers escaped, addresses left as they are (Discord
    links a bare URL; a backslash in it would break the link)."""
    out: list[str] = []
    pos = 0
    for m in _DC_URL.finditer(text):
        out.append(_DC_SPECIAL.sub(r"\\\1", text[pos:m.start()]))
        out.append(m.group(0))
        pos = m.end()
    out.append(_DC_SPECIAL.sub(r"\\\1", text[pos:]))
    return "".join(out)


class _Discord:
    """Renders a tree in Discord's Markdown: **bold**, *italic*, ~~strike~~, `code`, ```lang
    blocks, # headings (Discord has three levels), "- " lists, "> " quotes, [text](url)."""

    def __init__(self) -> None:
        self.open: set[str] = set()

    def blocks(self, nodes: list[SyntaxTreeNode], tight: bool = False) -> str:
        parts = [self.block(n) for n in nodes]
        return ("\n" if tight else "\n\n").join(p for p in parts if p != "")

    def block(self, node: SyntaxTreeNode) -> str:
        t = node.type
        if t == "paragraph":
            return _DC_LINE_START.sub(lambda m: "\\" + m.group(1), self.inline_of(node))
        if t == "heading":
            level = int(node.tag[1:]) if node.tag[1:].isdigit() else 1
            text = self.inline_of(node).replace("\n", " ")
            return f"{'#' * level} {text}" if level <= 3 else f"**{text}**"
        if t in ("bullet_list", "ordered_list"):
            return self.list_(node)
        if t == "blockquote":
            inner = self.blocks(node.children)
            return "\n".join(f"> {line}" if line else "> " for line in inner.split("\n"))
        if t in ("fence", "code_block"):
            lang = _language(node.info) if t == "fence" else None
            body = node.content.rstrip("\n").replace(FENCE, "`\u200b``")
            return f"{FENCE}{lang or ''}\n{body}\n{FENCE}"
        if t == "hr":
            return RULE
        if t == "html_block":
            return _dc_escape(node.content.rstrip("\n"))
        if t == "table":
            return self.table(node)
        if t == "inline":
            return self.inline(node.children)
        return self.blocks(node.children) if node.children else _dc_escape(node.content)

    def list_(self, node: SyntaxTreeNode) -> str:
        ordered = node.type == "ordered_list"
        start = int(node.attrs.get("start", 1) or 1) if ordered else 1
        tight = all(c.hidden for item in node.children for c in item.children
                    if c.type == "paragraph")
        out = []
        for i, item in enumerate(node.children):
            marker = f"{start + i}. " if ordered else BULLET
            body = self.blocks(item.children, tight=tight)
            lines = body.split("\n") if body else [""]
            out.append(marker + lines[0] + "".join(
                f"\n  {line}" if line else "\n" for line in lines[1:]))
        return ("\n" if tight else "\n\n").join(out)

    def table(self, node: SyntaxTreeNode) -> str:
        """Discord has no tables: the cells in a monospace block, columns aligned."""
        rows: list[list[str]] = []
        for section in node.children:
            for tr in section.children:
                rows.append([_WhatsApp().inline_of(cell).replace("\n", " ")
                             for cell in tr.children])
        widths = [max(len(r[i]) if i < len(r) else 0 for r in rows)
                  for i in range(max(len(r) for r in rows))]
        lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip()
                 for r in rows]
        if len(lines) > 1:
            lines.insert(1, "-+-".join("-" * w for w in widths))
        body = "\n".join(lines).replace(FENCE, "`\u200b``")
        return f"{FENCE}\n{body}\n{FENCE}"

    def inline_of(self, node: SyntaxTreeNode) -> str:
        return "".join(self.inline(c.children) if c.type == "inline" else self.block(c)
                       for c in node.children)

    def inline(self, nodes: list[SyntaxTreeNode]) -> str:
        return "".join(self.span(n) for n in nodes)

    def styled(self, mark: str, style: str, node: SyntaxTreeNode) -> str:
        if style in self.open:
            return self.inline(node.children)
        self.open.add(style)
        try:
            inner = self.inline(node.children)
        finally:
            self.open.discard(style)
        if not inner.strip():
            return inner
        core = inner.strip()
        lead = inner[:len(inner) - len(inner.lstrip())]
        trail = inner[len(inner.rstrip()):]
        return f"{lead}{mark}{core}{mark}{trail}"

    def span(self, node: SyntaxTreeNode) -> str:
        t = node.type
        if t in ("text", "text_special"):
            return _dc_escape(node.content)
        if t in ("softbreak", "hardbreak"):
            return "\n"
        if t == "strong":
            return self.styled("**", "strong", node)
        if t == "em":
            return self.styled("*", "em", node)
        if t == "s":
            return self.styled("~~", "s", node)
        if t == "code_inline":
            code = node.content
            return f"`` {code} ``" if "`" in code else f"`{code}`"
        if t == "link":
            text = self.inline(node.children)
            href = str(node.attrs.get("href", ""))
            if node.markup == "autolink" or not href or href in (node.children[0].content
                                                                 if node.children else "",):
                return href or text
            if not href.startswith(_LINK_SCHEMES):
                return f"{text} ({href})"
            return f"[{text}](<{href}>)"
        if t == "image":
            alt = self.inline(node.children)
            src = str(node.attrs.get("src", ""))
            return f"[{alt}](<{src}>)" if alt and src.startswith(_LINK_SCHEMES) else \
                (f"{alt} ({src})" if alt else src)
        if t == "html_inline":
            return _dc_escape(node.content)
        return self.inline(node.children) if node.children else _dc_escape(node.content)


def to_discord(markdown: str) -> str:
    """`markdown` in Discord's Markdown (see `_Discord`); text that is not Markdown is
    escaped, so nothing the agent did not mean as formatting becomes formatting."""
    if not (markdown or "").strip():
        return markdown or ""
    return _Discord().blocks(parse(markdown).children).strip("\n")


def _dc_open_marks(text: str) -> bool:
    """True if `text` (Discord Markdown) leaves an inline marker open: cutting after it
    would show the marker as text in both pieces."""
    i = 0
    stack: list[str] = []
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "`":
            run = len(text[i:]) - len(text[i:].lstrip("`"))
            close = text.find("`" * run, i + run)
            if close < 0:
                return True
            i = close + run
            continue
        for mark in _DC_PAIRS[:-1]:
            if text.startswith(mark, i):
                if stack and stack[-1] == mark:
                    stack.pop()
                else:
                    stack.append(mark)
                i += len(mark)
                break
        else:
            i += 1
    return bool(stack)


def _split_discord_plain(text: str, limit: int) -> list[str]:
    """Text too long for one message cut at a paragraph, line or word break that no inline
    marker spans (cut hard only when there is none)."""
    pieces: list[str] = []
    rest = text
    while utf16_len(rest) > limit:
        window = rest[:limit]
        while utf16_len(window) > limit:
            window = window[:-1]
        cut = -1
        for sep in ("\n\n", "\n", " "):
            i = len(window)
            while True:
                i = window.rfind(sep, 0, i)
                if i <= len(window) // 4:
                    break
                if not _dc_open_marks(rest[:i]):
                    cut = i
                    break
            if cut > 0:
                pieces.append(rest[:cut])
                rest = rest[cut + len(sep):]
                break
        else:
            end = len(window)
            if end > 1 and window[end - 1] == "\\":  # never cut an escape in two
                end -= 1
            pieces.append(rest[:end])
            rest = rest[end:]
    if rest:
        pieces.append(rest)
    return pieces


def split_discord(text: str, limit: int = DISCORD_LIMIT) -> list[str]:
    """Discord Markdown `text` in messages of at most `limit` characters (UTF-16 units, the
    way Discord counts): paragraphs and ``` blocks whole when they fit, a longer block
    closed and opened again (with its language), other text cut where no inline style
    spans the cut."""
    return split_message(text, limit, measure=utf16_len, split_plain=_split_discord_plain)


# ---------------------------------------------------------------------- web chat HTML

HTML_TAGS = frozenset({
    "p", "br", "strong", "em", "s", "del", "code", "pre", "blockquote", "ul", "ol", "li",
    "h1", "h2", "h3", "h4", "h5", "h6", "hr", "a", "table", "thead", "tbody", "tr", "th",
    "td"})
HTML_ATTRIBUTES = {"a": {"href", "title"}, "ol": {"start"}, "code": {"class"}}
# A table column's alignment (`|--:|`) as a class the page's style sheet knows: its CSP
# allows no style attribute.
ALIGN_CLASSES = frozenset({"align-left", "align-right", "align-center"})
URL_SCHEMES = frozenset({"http", "https", "mailto"})


def _image_as_link(self: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
    """An image shows as a link to it (the page loads nothing from elsewhere)."""
    token = tokens[idx]
    alt = self.renderInlineAsText(token.children or [], options, env)
    src = _html.escape(str(token.attrGet("src") or ""), quote=True)
    return f'<a href="{src}">{_html.escape(alt or str(token.attrGet("src") or ""))}</a>'


@lru_cache(maxsize=1)
def _align_as_class(state: Any) -> None:
    """Table cells' `style="text-align:x"` becomes `class="align-x"`."""
    for token in state.tokens:
        if token.type in ("th_open", "td_open"):
            style = token.attrGet("style") or ""
            if style.startswith("text-align:"):
                token.attrs.pop("style", None)
                token.attrSet("class", "align-" + style.split(":", 1)[1].strip())


def _html_parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False}).enable(["strikethrough", "table"])
    md.add_render_rule("image", _image_as_link)
    md.core.ruler.push("align_as_class", _align_as_class)
    return md


@lru_cache(maxsize=512)
def to_html(markdown: str) -> str:
    """`markdown` as safe HTML for the web chat (raw HTML shown as text, links only to
    http, https and mailto, opened in a new tab without opener or referrer)."""
    raw = _html_parser().render(markdown or "")
    return nh3.clean(raw, tags=set(HTML_TAGS),
                     attributes={k: set(v) for k, v in HTML_ATTRIBUTES.items()},
                     url_schemes=set(URL_SCHEMES), link_rel="noopener noreferrer",
                     allowed_classes={"th": set(ALIGN_CLASSES), "td": set(ALIGN_CLASSES)},
                     set_tag_attribute_values={"a": {"target": "_blank"}}).strip()


# ---------------------------------------------------------------------- Matrix HTML

#: What Matrix clients render of `formatted_body` (the spec's recommended tags): strike as
#: <del> (the spec's list has no <s>), code blocks keep their `language-x` class.
MATRIX_TAGS = frozenset(HTML_TAGS - {"s"})
MATRIX_ATTRIBUTES = {"a": {"href"}, "ol": {"start"}, "code": {"class"}}


def _del_open(self: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
    return "<del>"


def _del_close(self: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
    return "</del>"


@lru_cache(maxsize=1)
def _matrix_parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False}).enable(["strikethrough", "table"])
    md.add_render_rule("image", _image_as_link)
    md.add_render_rule("s_open", _del_open)
    md.add_render_rule("s_close", _del_close)
    return md


@lru_cache(maxsize=512)
def to_matrix_html(markdown: str) -> str:
    """`markdown` as a Matrix message's `formatted_body` (org.matrix.custom.html): the same
    parse as the web chat, raw HTML shown as text, links only to http, https and mailto,
    images as links (nothing is loaded from elsewhere)."""
    raw = _matrix_parser().render(markdown or "")
    return nh3.clean(raw, tags=set(MATRIX_TAGS),
                     attributes={k: set(v) for k, v in MATRIX_ATTRIBUTES.items()},
                     url_schemes=set(URL_SCHEMES), link_rel=None).strip()


def is_plain_html(markdown: str, html: str) -> bool:
    """True when `html` says no more than `markdown` as plain text does (one paragraph of
    text without markup): a Matrix message then needs no `formatted_body`."""
    return html == f"<p>{_html.escape(markdown.strip(), quote=False)}</p>"


__all__ = ["is_plain_html", "parse", "slack_escape", "split_discord", "split_message",
           "split_slack", "split_telegram", "split_text", "to_discord", "to_html",
           "to_matrix_html", "to_slack", "to_telegram", "to_whatsapp", "utf16_len"]
