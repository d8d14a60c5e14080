"""Drawing a live collective: each rank's tensor before and after, element by element.

Takes a ``collectives.LiveResult`` (data already fetched from the ranks); never starts
processes. Each element is a box coloured by the rank its value came from, striped when it
sums several ranks' values (``collectives.contributions``), with the value written in it.
"""
from __future__ import annotations

from .colors import EMPTY, rank_color


def _draw_tensor(ax, y, values, who, n):
    from matplotlib.patches import Rectangle

    if values is None:
        ax.text(0, y + 0.4, "(nothing)", fontsize=7, va="center", color="0.5")
        return 1
    for i, v in enumerate(values.tolist()):
        ranks = sorted(who[i]) if who is not None else []
        for k, rank in enumerate(ranks):  # one stripe per contributing rank
            ax.add_patch(Rectangle((i, y + k * 0.8 / len(ranks)), 1, 0.8 / len(ranks),
                                   facecolor=rank_color(rank), alpha=0.45, edgecolor="none"))
        ax.add_patch(Rectangle((i, y), 1, 0.8, fill=not ranks, facecolor=EMPTY, edgecolor="0.3",
                               lw=0.6))
        text = f"{v:.0f}" if isinstance(v, float) else str(v)
        ax.text(i + 0.5, y + 0.4, text, ha="center", va="center", fontsize=7)
    return len(values)


def draw_collective(result, ax_before=None, ax_after=None):
    """Draw ``result`` (a LiveResult) on two Axes, or on a new Figure; returns the Figure."""
    from ..collectives.live import contributions

    n = result.world_size
    if ax_before is None or ax_after is None:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(9, 0.45 * n + 0.9), layout="constrained")
        ax_before, ax_after = fig.subplots(1, 2)
    fig = ax_before.figure
    longest = max(1, *(len(t) for t in result.before + result.after if t is not None))
    numel = min(len(t) for t in result.before if t is not None)
    if result.collective in ("reduce_scatter", "all_to_all"):
        numel //= n
    after_who = contributions(result.collective, n, numel, result.root)
    before_who = [None if t is None else [frozenset([r])] * len(t)
                  for r, t in enumerate(result.before)]
    if result.collective == "barrier":
        before_who = [None] * n
    for ax, tensors, who, title in ((ax_before, result.before, before_who, "before"),
                                    (ax_after, result.after, after_who, "after")):
        for r, t in enumerate(tensors):
            _draw_tensor(ax, n - 1 - r, t, who[r], n)
        ax.set_xlim(-0.2, longest + 0.2)
        ax.set_ylim(-0.3, n)
        ax.set_yticks([n - 1 - r + 0.4 for r in range(n)], [f"rank {r}" for r in range(n)])
        for r, label in enumerate(ax.get_yticklabels()):
            label.set_color(rank_color(r))
        ax.set_xticks([])
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"{result.collective}:  {result.call}", fontsize=9, family="monospace")
    return fig


def draw_collectives(results):
    """One figure with a before/after row for each LiveResult in ``results``."""
    from matplotlib.figure import Figure

    heights = [0.45 * r.world_size + 0.5 for r in results]
    fig = Figure(figsize=(10, sum(heights) + 0.3), layout="constrained")
    rows = fig.subfigures(len(results), 1, height_ratios=heights, squeeze=False)
    for sub, result in zip(rows.flat, results):
        ax_before, ax_after = sub.subplots(1, 2)
        draw_collective(result, ax_before, ax_after)
        sub.suptitle(f"{result.collective}:  {result.call}", fontsize=8, family="monospace")
    return fig
