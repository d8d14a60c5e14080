"""Small inline-SVG pieces for widgets that must redraw within 100 ms of a slider move.

A matplotlib figure drawn to PNG costs about as much as a whole slider step may take (a bare
bar chart: tens of ms on a laptop core, ~100 ms on a busy one), so the widgets write their
bars as SVG text into an ``ipywidgets.HTML`` instead: the browser draws it, and the kernel
only formats a few hundred short strings. Coordinates are pixels, y pointing down.
"""
from __future__ import annotations

import html
import math
import re

FONT = "font-family:sans-serif"
# JupyterLab's theme colours, with what they are in the light theme as the fallback (a page
# without JupyterLab's CSS, and an ``<img>``, which sees no CSS of the page): text and lines
# drawn in these follow the theme, so a dark theme never shows black on black.
INK = "var(--jp-ui-font-color1, #000)"       # text, ticks, the peak mark
INK2 = "var(--jp-ui-font-color2, #444)"      # axes, secondary text
PAPER = "var(--jp-layout-color1, #fff)"      # the page: halos drawn behind text
ALARM = "var(--jp-error-color1, #b00)"       # "does not fit", errors: a red that reads on both


def _paint(attribute: str, color: str) -> str:
    """``fill="#d00"`` for a plain colour; a theme colour (``var(...)``) goes into ``style``,
    since SVG's presentation attributes take no CSS variables."""
    if color.startswith("var("):
        return f' style="{attribute}:{color}"'
    return f' {attribute}="{color}"'


def _num(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


def rect(x: float, y: float, w: float, h: float, fill: str = "none", stroke: str | None = None,
         dash: str | None = None, width: float = 1.0, title: str | None = None) -> str:
    """A rectangle; ``title`` becomes its hover tooltip."""
    extra = _paint("stroke", stroke) + f' stroke-width="{width}"' if stroke else ""
    extra += f' stroke-dasharray="{dash}"' if dash else ""
    tip = f"<title>{html.escape(title)}</title>" if title else ""
    return (f'<rect x="{_num(x)}" y="{_num(y)}" width="{_num(max(w, 0))}" height="{_num(max(h, 0))}" '
            f'fill="{fill}"{extra}>{tip}</rect>')


def line(x1: float, y1: float, x2: float, y2: float, stroke: str = INK, width: float = 1.0,
         dash: str | None = None) -> str:
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<line x1="{_num(x1)}" y1="{_num(y1)}" x2="{_num(x2)}" y2="{_num(y2)}"{_paint("stroke", stroke)} '
            f'stroke-width="{width}"{extra}/>')


def text(x: float, y: float, words: str, size: float = 11, anchor: str = "start", color: str = INK,
         baseline: str = "middle", weight: str = "normal", rotate: float = 0) -> str:
    """``words`` at (x, y); anchor: start, middle or end; baseline: middle, hanging or auto."""
    turn = f' transform="rotate({_num(rotate)} {_num(x)} {_num(y)})"' if rotate else ""
    bold = ' font-weight="bold"' if weight != "normal" else ""
    return (f'<text x="{_num(x)}" y="{_num(y)}" font-size="{_num(size)}" text-anchor="{anchor}" '
            f'dominant-baseline="{baseline}"{_paint("fill", color)}{bold}{turn}>{html.escape(words)}</text>')


def lines(x: float, y: float, words: str, size: float = 11, anchor: str = "start", color: str = INK,
          va: str = "center", halo: bool = False, paper: str = PAPER) -> str:
    """Text of one or more lines (split at newlines) placed as matplotlib's ``va`` places it:
    its top, centre or bottom at ``y``. ``halo``: an outline of the background's colour
    (``paper``) keeps it readable over lines."""
    rows = words.split("\n")
    step = 1.2 * size
    top = {"top": y, "center": y - step * len(rows) / 2, "bottom": y - step * len(rows)}[va]
    paint = f"fill:{color}" + (f";stroke:{paper}" if halo else "")  # one style: it takes theme colours
    outline = ' stroke-width="3" stroke-opacity="0.85" paint-order="stroke"' if halo else ""
    spans = "".join(f'<tspan x="{_num(x)}" y="{_num(top + (i + 0.5) * step)}">{html.escape(row)}</tspan>'
                    for i, row in enumerate(rows))
    return (f'<text font-size="{_num(size)}" text-anchor="{anchor}" dominant-baseline="middle" '
            f'style="{paint}"{outline}>{spans}</text>')


def arrow(points: list[tuple[float, float]], color: str, width: float = 1.5, opacity: float = 0.8,
          head: float = 9.0) -> str:
    """A quadratic Bezier from ``points[0]`` through control ``points[1]`` to ``points[2]``,
    with a filled head at the end (matplotlib's ``-|>`` arrow style)."""
    (ax, ay), (cx, cy), (bx, by) = points
    dx, dy = bx - cx, by - cy
    length = math.hypot(dx, dy) or 1.0
    ux, uy = dx / length, dy / length
    # stop the line at the head's base, so its width does not blunt the tip
    sx, sy = bx - ux * head * 0.8, by - uy * head * 0.8
    base = (bx - ux * head, by - uy * head)
    left = (base[0] - uy * head * 0.4, base[1] + ux * head * 0.4)
    right = (base[0] + uy * head * 0.4, base[1] - ux * head * 0.4)
    tip = " ".join(f"{_num(px)},{_num(py)}" for px, py in ((bx, by), left, right))
    return (f'<g opacity="{opacity}"><path d="M{_num(ax)},{_num(ay)} Q{_num(cx)},{_num(cy)} {_num(sx)},{_num(sy)}" '
            f'fill="none" stroke="{color}" stroke-width="{width}"/><polygon points="{tip}" fill="{color}"/></g>')


def svg(width: float, height: float, parts: list[str], fit: bool = False) -> str:
    """An ``<svg>`` element of ``width`` x ``height`` pixels holding ``parts``. ``fit``: inline
    in HTML, as wide as the output area up to ``width`` (narrower: scaled down, never up)."""
    size = ";max-width:100%;height:auto" if fit else ""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_num(width)}" height="{_num(height)}" '
            f'viewBox="0 0 {_num(width)} {_num(height)}" style="{FONT}{size}">' + "".join(parts) + "</svg>")


def legend(entries: list[tuple[str, str]], size: float = 10) -> str:
    """An HTML legend: a coloured square and its label per (colour, label); a colour written
    ``"--#d00"`` is drawn as a dashed line instead (a reference line, not a bar)."""
    items = []
    for color, label in entries:
        if color.startswith("--"):
            mark = f"<span style='display:inline-block;width:14px;border-top:2px dashed {color[2:]};" \
                   "vertical-align:middle'></span>"
        else:
            mark = f"<span style='display:inline-block;width:10px;height:10px;background:{color};" \
                   "vertical-align:middle'></span>"
        items.append(f"<span style='margin-right:12px;white-space:nowrap'>{mark} {html.escape(label)}</span>")
    return (f"<div style='font-size:{_num(size)}px;{FONT};line-height:1.6;color:{INK}'>" + "".join(items)
            + "</div>")


def nice_ticks(top: float, count: int = 6) -> list[float]:
    """Round tick values from 0 up to ``top`` (about ``count`` of them): steps of 1, 2, 2.5 or
    5 times a power of ten, as an axis labels them."""
    if top <= 0 or not math.isfinite(top):
        return [0.0]
    raw = top / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(math.floor(top / step + 1e-9)) + 1)]


def tick_label(value: float) -> str:
    """A tick value as an axis writes it: no trailing zeros, thousands unseparated."""
    return f"{value:.6g}"


def svg_size(data: str) -> tuple[int, int]:
    """(width, height) in pixels of the ``<svg>`` element ``data`` starts with."""
    found = re.match(r'<svg[^>]*?\swidth="([\d.]+)"[^>]*?\sheight="([\d.]+)"', data)
    if not found:
        raise ValueError("not an SVG image with its width and height in pixels")
    return round(float(found.group(1))), round(float(found.group(2)))


def show_svg(image, data: str) -> None:
    """Put SVG text ``data`` into the ``ipywidgets.Image`` ``image`` (``format="svg+xml"``): as
    wide as the output area, at most its own width in pixels (``png.fit_image``)."""
    width, height = svg_size(data)
    if "<rect width=\"100%\" height=\"100%\"" not in data:
        # an <img> sees none of the page's CSS, so its theme colours are the light theme's:
        # give it the light theme's paper, or its dark text would sit on a dark page
        data = re.sub(r"(<svg[^>]*>)", r'\1<rect width="100%" height="100%" fill="white"/>', data, count=1)
    image.value = data.encode()
    from .png import fit_image

    fit_image(image, width)
