#!/usr/bin/env python3
"""Draw the web chat's icons (mdclaw/channels/static/*.png): a white speech bubble on the
accent blue of mdclaw.css. Run after changing the drawing; the PNGs are committed.

    .venv/bin/python contrib/make-chat-icons.py

Needs Pillow (in requirements.lock, through the whatsapp extra). Sizes: 192 and 512 (the
manifest's "any" icons, rounded), a 512 maskable one (full bleed, the bubble inside the
safe circle of 80 %) and the 180 px apple-touch-icon (full bleed: iOS rounds it itself).
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parent.parent / "mdclaw" / "channels" / "static"
ACCENT = (29, 78, 216, 255)  # --accent of mdclaw.css (light)
WHITE = (255, 255, 255, 255)
SCALE = 4  # drawn larger, then reduced: smooth edges


def bubble(size: int, *, rounded: bool, inner: float) -> Image.Image:
    """The icon at `size` px; the bubble fills `inner` of it (centred)."""
    big = size * SCALE
    img = Image.new("RGBA", (big, big), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    if rounded:
        d.rounded_rectangle((0, 0, big - 1, big - 1), radius=big // 5, fill=ACCENT)
    else:
        d.rectangle((0, 0, big, big), fill=ACCENT)
    w = big * inner
    x0, y0 = (big - w) / 2, (big - w * 0.8) / 2 - w * 0.04
    x1, y1 = x0 + w, y0 + w * 0.68
    d.rounded_rectangle((x0, y0, x1, y1), radius=w * 0.2, fill=WHITE)
    # the tail, bottom left
    d.polygon([(x0 + w * 0.2, y1 - 2), (x0 + w * 0.16, y1 + w * 0.2), (x0 + w * 0.42, y1 - 2)],
              fill=WHITE)
    # three dots: someone is writing
    r = w * 0.065
    cy = (y0 + y1) / 2
    for k in (-1, 0, 1):
        cx = big / 2 + k * w * 0.22
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=ACCENT)
    return img.resize((size, size), Image.Resampling.LANCZOS)


def save(img: Image.Image, name: str, *, opaque: bool = False) -> None:
    if opaque:
        img = img.convert("RGB")
    img = img.quantize(colors=32)  # a small palette PNG
    img.save(OUT / name, optimize=True)
    print(f"{name}: {(OUT / name).stat().st_size} bytes")


def main() -> None:
    save(bubble(192, rounded=True, inner=0.62), "icon-192.png")
    save(bubble(512, rounded=True, inner=0.62), "icon-512.png")
    save(bubble(512, rounded=False, inner=0.5), "icon-maskable-512.png", opaque=True)
    save(bubble(180, rounded=False, inner=0.58), "apple-touch-icon.png", opaque=True)


if __name__ == "__main__":
    main()
