"""The style sheet the chat page and the operator page share (mdclaw/static/mdclaw.css):
served by both pages' assets, with colours that keep their contrast in light and dark mode."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from mdclaw.webassets import SHARED_STYLE, PageAssets

HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}
# (text, background, least ratio): WCAG AA, 4.5:1 for text, 3:1 for lines and focus rings
PAIRS = [("fg", "bg", 4.5), ("fg", "surface", 4.5), ("fg", "surface-2", 4.5),
         ("fg", "mine", 4.5), ("muted", "bg", 4.5), ("muted", "surface", 4.5),
         ("muted", "surface-2", 4.5), ("muted", "mine", 4.5), ("accent", "bg", 4.5),
         ("accent", "surface", 4.5), ("accent-fg", "accent", 4.5), ("ok", "bg", 4.5),
         ("ok", "surface", 4.5), ("warn", "bg", 4.5), ("warn", "surface", 4.5),
         ("warn", "warn-bg", 4.5), ("bad", "bg", 4.5), ("bad", "surface", 4.5),
         ("bad", "bad-bg", 4.5), ("fg", "warn-bg", 4.5), ("fg", "bad-bg", 4.5),
         ("border", "bg", 3.0), ("focus", "bg", 3.0)]


def _sheet() -> str:
    return resources.files("mdclaw").joinpath("static", "mdclaw.css").read_text()


def _colours(block: str) -> dict[str, tuple[int, int, int]]:
    return {m[1]: tuple(int(m[2][i:i + 2], 16) for i in (0, 2, 4))  # type: ignore[misc]
            for m in re.finditer(r"--([a-z0-9-]+):\s*#([0-9a-f]{6})\b", block)}


def _luminance(rgb: tuple[int, int, int]) -> float:
    def lin(c: int) -> float:
        v = c / 255
        return v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4
    r, g, b = (lin(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def test_contrast_helper_knows_black_on_white() -> None:
    assert contrast((0, 0, 0), (255, 255, 255)) == pytest.approx(21.0)
    assert contrast((0x77, 0x77, 0x77), (255, 255, 255)) < 4.5  # the classic grey fails


@pytest.mark.parametrize("mode", ["light", "dark"])
def test_every_text_colour_keeps_its_contrast(mode: str) -> None:
    sheet = _sheet()
    dark_at = sheet.index("@media (prefers-color-scheme: dark)")
    light = _colours(sheet[:dark_at])
    colours = light if mode == "light" else {**light, **_colours(sheet[dark_at:])}
    assert {name for pair in PAIRS for name in pair[:2]} <= set(colours)
    low = [(fg, bg, round(contrast(colours[fg], colours[bg]), 2)) for fg, bg, least in PAIRS
           if contrast(colours[fg], colours[bg]) < least]
    assert low == []


def test_both_pages_serve_the_one_shared_sheet() -> None:
    chat = PageAssets("mdclaw.channels", {"mdclaw.css": SHARED_STYLE}, headers=HEADERS,
                      page_csp="default-src 'none'")
    operator = PageAssets("mdclaw.operator", {"mdclaw.css": SHARED_STYLE}, headers=HEADERS,
                          page_csp="default-src 'none'")
    assert chat.body("mdclaw.css") == operator.body("mdclaw.css") == _sheet().encode()
    r = chat.response("mdclaw.css")
    assert r.content_type == "text/css" and r.charset == "utf-8"
