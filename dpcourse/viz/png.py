"""Showing PNG figures in ipywidgets at their natural size, or narrower where the output is.

An ``ipywidgets.Image`` inside a ``VBox`` is stretched to the box's width by the browser
(a flex column stretches its children), which blurs a small figure and pushes most of it
below the fold; a figure wider than the output area is cut at its right edge. So the widget
takes the output area's width up to the PNG's own pixel width (``fit_image``): every pixel
shown once where there is room, the whole figure scaled down where there is not.
"""
from __future__ import annotations

import struct

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels of PNG ``data``, read from its IHDR header."""
    if data[:8] != _SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError("not a PNG image (no PNG signature and IHDR header)")
    return struct.unpack(">II", data[16:24])


def fit_image(image, width: int) -> None:
    """Size the ``ipywidgets.Image`` ``image`` to the output area, at most ``width`` pixels
    wide (its natural size: never blown up), its height following (no distortion)."""
    image.layout.width, image.layout.max_width, image.layout.height = "100%", f"{width}px", "auto"
    image.layout.min_width = ""


def show_png(image, data: bytes) -> None:
    """Put PNG ``data`` into the ``ipywidgets.Image`` ``image``, at most its natural size."""
    width, _ = png_size(data)
    image.value = data
    fit_image(image, width)
