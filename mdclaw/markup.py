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
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

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
            marker = f"{start + i}. " if ordered else BULLET
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


# ---------------------------------------------------------------------- splitting

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
    room = limit - measure(f"{FENCE}\n\n{FENCE}")
    if room < 1:
        raise ValueError("limit too small for a code block")
    pieces: list[str] = []
    cur: list[str] = []

    def flush() -> None:
        if cur:
            pieces.append(f"{FENCE}\n" + "\n".join(cur) + f"\n{FENCE}")
            cur.clear()

    for line in body:
        while measure(line) > room:
            flush()
            cut = room
            while cut > 1 and measure(line[:cut]) > room:
                cut -= 1
            pieces.append(f"{FENCE}\n{line[:cut]}\n{FENCE}")
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
    too long is cut by `split_plain(text, limit)` (the channel's plain splitter; without one
    it is cut hard).
    """
    if measure(text) <= limit:
        return [text]

    def plain(t: str) -> list[str]:
        if split_plain is not None:
            return split_plain(t, limit)
        out = []
        while t:
            n = min(len(t), limit)
            while n > 1 and measure(t[:n]) > limit:
                n -= 1
            out.append(t[:n])
            t = t[n:]
        return out

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


__all__ = ["parse", "split_message", "to_whatsapp"]
