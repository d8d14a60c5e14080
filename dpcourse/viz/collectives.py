"""Drawing collectives: each rank's tensor before and after, element by element.

Takes what the ranks returned (per rank, {call as written: (before, after)}); never starts
processes. Each element is a box coloured by the rank its value came from, striped when it
sums several ranks' values (``collectives.live.contributions``), with the value written in it.
"""
from __future__ import annotations

from .colors import EMPTY, rank_color, rank_text_color


def _draw_tensor(ax, y, values, who):
    from matplotlib.patches import Rectangle

    if values is None:
        ax.text(0, y + 0.4, "(nothing)", fontsize=7, va="center", color="0.5")
        return
    for i, v in enumerate(values.tolist()):
        ranks = sorted(who[i]) if who is not None else []
        for k, rank in enumerate(ranks):  # one stripe per contributing rank
            ax.add_patch(Rectangle((i, y + k * 0.8 / len(ranks)), 1, 0.8 / len(ranks),
                                   facecolor=rank_color(rank), alpha=0.45, edgecolor="none"))
        ax.add_patch(Rectangle((i, y), 1, 0.8, fill=not ranks, facecolor=EMPTY, edgecolor="0.3",
                               lw=0.6))
        text = f"{v:.0f}" if isinstance(v, float) else str(v)
        ax.text(i + 0.5, y + 0.4, text, ha="center", va="center", fontsize=7)


def draw_collective(call: str, before: list, after: list, ax_before, ax_after) -> None:
    """One call's row: every rank's ``before`` and ``after`` tensor (None: nothing)."""
    from ..collectives.live import contributions

    n = len(before)
    longest = max(1, *(len(t) for t in before + after if t is not None))
    after_who = contributions(call, before)
    before_who = [None if t is None else [frozenset([r])] * len(t) for r, t in enumerate(before)]
    for ax, tensors, who, title in ((ax_before, before, before_who, "before"),
                                    (ax_after, after, after_who, "after")):
        for r, t in enumerate(tensors):
            _draw_tensor(ax, n - 1 - r, None if t is None else t.cpu(), who[r])
        ax.set_xlim(-0.2, longest + 0.2)
        ax.set_ylim(-0.3, n)
        ax.set_yticks([n - 1 - r + 0.4 for r in range(n)], [f"rank {r}" for r in range(n)])
        for r, label in enumerate(ax.get_yticklabels()):
            label.set_color(rank_text_color(r))
        ax.set_xticks([])
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
        ax.set_title(title, fontsize=9)


def draw_collectives(per_rank: list):
    """One figure with a before/after row per call; ``per_rank[r]`` is rank r's
    {call: (before, after)}, as the ranks returned it."""
    from matplotlib.figure import Figure

    calls, n = list(per_rank[0]), len(per_rank)
    heights = [0.45 * n + 0.5 for _ in calls]
    fig = Figure(figsize=(10, sum(heights) + 0.3), layout="constrained")
    rows = fig.subfigures(len(calls), 1, height_ratios=heights, squeeze=False)
    for sub, call in zip(rows.flat, calls):
        ax_before, ax_after = sub.subplots(1, 2)
        draw_collective(call, [r[call][0] for r in per_rank], [r[call][1] for r in per_rank],
                        ax_before, ax_after)
        sub.suptitle(f"dist.{call}", fontsize=8, family="monospace")
    return fig
