"""The course's colours, shared by every drawing: one per rank, one per kind of timeline event."""
from __future__ import annotations

EMPTY = "#eeeeee"  # a slot with no contribution
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")  # matplotlib's tab10


def rank_color(rank: int) -> str:
    """The colour of ``rank`` (repeats after 10 ranks)."""
    return _PALETTE[rank % len(_PALETTE)]


def _luminance(rgb) -> float:
    """WCAG's relative luminance of an (r, g, b) colour, 0-255 each."""
    def linear(c):
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (linear(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


TEXT_CONTRAST = 4.5  # WCAG's minimum for body text


def rank_text_color(rank: int) -> str:
    """``rank_color`` darkened just enough for words to read at ``TEXT_CONTRAST``:1 on the white
    of the course's figures (tab10's orange reads at 2.5:1): labels, where bars and arrows keep
    ``rank_color``."""
    rgb = [int(rank_color(rank)[i:i + 2], 16) for i in (1, 3, 5)]
    scale = 1.0
    while (1.05 / (_luminance([c * scale for c in rgb]) + 0.05)) < TEXT_CONTRAST:
        scale -= 0.02
    return "#" + "".join(f"{round(c * scale):02x}" for c in rgb)


# A Timeline's bars by kind: compute in blues and a grey, waiting in red, and every collective
# ``tracking.tracker.C10D_OPS`` names in a hue of its own, none of them grey (a broadcast drawn
# in the optimizer's grey read as optimizer time).
KIND_COLORS = {"forward": "#9ecae1", "backward": "#3182bd", "optimizer": "#969696", "wait": "#de2d26",
               "all_reduce": "#fd8d3c", "all_gather": "#31a354", "reduce_scatter": "#756bb1",
               "broadcast": "#e7ba52", "reduce": "#d6616b", "all_to_all": "#17becf", "gather": "#8c6d31",
               "scatter": "#7b4173", "send": "#e377c2", "recv": "#ce6dbd", "barrier": "#393b79",
               "unsharded": "#c7e9c0"}
OTHER_KIND = "#bdbdbd"  # an event of a kind not listed above
