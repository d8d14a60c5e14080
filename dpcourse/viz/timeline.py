"""Drawing timelines: a Gantt chart per rank, and the bucket-size sweep. Pure drawing.

Draws the events the ranks recorded (anything with ``rank``, ``lane``, ``kind``, ``name``,
``start`` and ``end``, e.g. ``dpcourse.scratch.timeline.Event``) and sweep rows; it never
starts processes, and computes nothing but the layout (``stack_rows``). Each rank gets a
"compute" lane (forward, per-layer backward, optimizer; red where it waits for
communication), a "comm" lane (one bar per collective from launch to completion, stacked
when several are in flight) and, for FSDP, a "memory" lane (how long each unit's gathered
parameters lived: from gather to free).
"""
from __future__ import annotations

from .colors import KIND_COLORS, OTHER_KIND, rank_text_color

LANES = ("compute", "comm", "memory")


def stack_rows(events) -> list[int]:
    """A row per event so that overlapping events of one rank and lane never share a row
    (greedy interval colouring, in order of start); for drawing concurrent collectives."""
    rows, ends = [0] * len(events), {}
    for i in sorted(range(len(events)), key=lambda i: events[i].start):
        e = events[i]
        lane_ends = ends.setdefault((e.rank, e.lane), [])
        row = next((k for k, end in enumerate(lane_ends) if end <= e.start), len(lane_ends))
        if row == len(lane_ends):
            lane_ends.append(e.end)
        else:
            lane_ends[row] = e.end
        rows[i] = row
    return rows


def draw_timeline(events, ax=None, title: str = "", unit: str = "ms", label_min: float = 0.06):
    """A Gantt chart of merged events (``timeline.from_lists``), one band per rank.

    unit: "ms" or "s" on the x axis. Bars wider than ``label_min`` of the axis get their
    name written in. Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.transforms import offset_copy

    scale = {"ms": 1e3, "s": 1.0}[unit]
    events = [e for e in events if e.end >= e.start]
    rows = stack_rows(events)
    ranks = sorted({e.rank for e in events})
    depth = {}  # (rank, lane) -> rows used
    for e, r in zip(events, rows):
        key = (e.rank, e.lane)
        depth[key] = max(depth.get(key, 0), r + 1)
    y, base, ticks = 0.0, {}, []
    for rank in reversed(ranks):
        for lane in reversed(LANES):
            if (rank, lane) in depth:
                base[rank, lane] = y
                ticks.append((y + depth[rank, lane] / 2, f"rank {rank} {lane}", rank))
                y += depth[rank, lane]
        y += 0.6
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.45 * y + 1.2))
    span = max((e.end for e in events), default=1.0) * scale
    for e, r in zip(events, rows):
        left, width = e.start * scale, max(e.duration * scale, span * 0.002)
        bottom = base[e.rank, e.lane] + r + 0.1
        ax.barh(bottom, width, left=left, height=0.8, align="edge",
                color=KIND_COLORS.get(e.kind, OTHER_KIND), edgecolor="white", linewidth=0.4)
        if width > label_min * span and e.name:
            ax.text(left + width / 2, bottom + 0.4, e.name.replace("gradient sync", "wait"),
                    ha="center", va="center", fontsize=6.5, clip_on=True)
    ax.set_yticks([t for t, _, _ in ticks], [label for _, label, _ in ticks], fontsize=8)
    for tick, (_, _, rank) in zip(ax.get_yticklabels(), ticks):
        tick.set_color(rank_text_color(rank))
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, span * 1.01)
    used = sorted({e.kind for e in events if e.kind in KIND_COLORS}, key=list(KIND_COLORS).index)
    # under the axis title, a fixed 34 points below the axes whatever their height (a fraction
    # of a tall chart's height left a gap as tall as a band of ranks)
    below = offset_copy(ax.transAxes, fig=ax.figure, y=-34, units="points")
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=k.replace("_", "-")) for k in used],
              loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=below, ncol=len(used),
              fontsize=7, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def draw_bucket_sweep(rows, predicted=None, ax=None, title: str = "bucket-size sweep"):
    """Seconds per step and exposed communication vs ``bucket_cap_mb``, one line per kind.

    rows: dicts with ``kind`` (a wrapper's name), ``bucket_cap_mb``, ``step_s``, ``exposed_s``
    and ``collectives`` (buckets all-reduced), e.g. ``Timeline.summary()`` plus the first two;
    predicted: optional {bucket_cap_mb: seconds} of the alpha-beta model's communication
    time. Returns the Axes (milliseconds on the y axis, MiB on a log x axis); the first
    kind's points are labelled with their number of buckets.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9.5, 4))
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    for i, kind in enumerate(kinds):
        mine = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["bucket_cap_mb"])
        color = ("#3182bd", "#e6550d", "#31a354", "#636363")[i % 4]
        caps = [r["bucket_cap_mb"] for r in mine]
        ax.plot(caps, [r["step_s"] * 1e3 for r in mine], "o-", color=color, label=f"{kind}: step")
        ax.plot(caps, [r["exposed_s"] * 1e3 for r in mine], "s--", color=color, alpha=0.7,
                label=f"{kind}: exposed comm")
        if i == 0:
            for r in mine:
                ax.annotate(f"{r['collectives']}", (r["bucket_cap_mb"], r["step_s"] * 1e3),
                            textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    if predicted:
        caps = sorted(predicted)
        ax.plot(caps, [predicted[c] * 1e3 for c in caps], ":", color="black",
                label="alpha-beta: all buckets' comm")
    ax.set_xscale("log")
    ax.set_xlabel(f"bucket_cap_mb (MiB; numbers: {kinds[0] if kinds else ''} buckets)")
    ax.set_ylabel("ms per step")
    ax.margins(y=0.12)  # room for the bucket counts above the highest points
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside: never on a label
    ax.set_title(title, fontsize=10)
    ax.figure.tight_layout()
    return ax
