"""Showing PNG figures in ipywidgets at their natural size.

An ``ipywidgets.Image`` inside a ``VBox`` is stretched to the box's width by the browser
(a flex column stretches its children), which blurs a small figure and pushes most of it
below the fold. Fixing the widget's CSS size to the PNG's own pixel size shows every pixel
once, whatever the width of the notebook.
"""
from __future__ import annotations

import struct

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels of PNG ``data``, read from its IHDR header."""
    if data[:8] != _SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError("not a PNG image (no PNG signature and IHDR header)")
    return struct.unpack(">II", data[16:24])


def show_png(image, data: bytes) -> None:
    """Put PNG ``data`` into the ``ipywidgets.Image`` ``image``, sized to its natural pixels."""
    width, height = png_size(data)
    image.value = data
    image.layout.width, image.layout.height = f"{width}px", f"{height}px"
    image.layout.min_width = f"{width}px"  # a narrow notebook scrolls instead of squeezing it
