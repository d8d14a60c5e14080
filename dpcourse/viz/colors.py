"""One colour per rank, shared by every drawing of the course."""
from __future__ import annotations

EMPTY = "#eeeeee"  # a slot with no contribution
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")  # matplotlib's tab10


def rank_color(rank: int) -> str:
    """The colour of ``rank`` (repeats after 10 ranks)."""
    return _PALETTE[rank % len(_PALETTE)]
