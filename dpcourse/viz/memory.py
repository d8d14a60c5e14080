"""Drawing the memory ledger: theory beside measurement, a step over time, and a player.

Draws what ``dpc.observe.Memory`` observers measured, next to the ledgers the notebook
computed for them: ``measured = {name: Memory}``, ``theory = {name: [Ledger of rank 0,
rank 1, ...]}`` (one Ledger is used for every rank). It never starts processes. Heights are
bytes per rank, shown in the labelled unit.
"""
from __future__ import annotations

from ..memory.ledger import AT_REST, CATEGORIES
from ..memory.sizes import in_unit

CATEGORY_COLORS = {
    "parameters": "#1f77b4", "gradients": "#ff7f0e", "optimizer_state": "#2ca02c",
    "master_weights": "#17becf", "bucket_buffers": "#8c564b", "unsharded_parameters": "#9467bd",
    "unsharded_gradients": "#e377c2", "activations": "#bcbd22", "temporaries": "#7f7f7f"}
LABELS = {c: c.replace("_", " ") for c in CATEGORIES}


def configs(measured: dict, theory: dict, names=None) -> list[list[dict]]:
    """Per configuration, per rank: {"label", "rank", "world_size", "at_rest", "frames",
    "theory"} -- what the drawings read. ``names``: which of ``measured`` (default: all)."""
    out = []
    for name in names or list(measured):
        memory, books = measured[name], theory[name]
        books = books if isinstance(books, (list, tuple)) else [books] * len(memory.per_rank)
        out.append([{"label": name, "rank": r, "world_size": len(memory.per_rank),
                     "at_rest": memory.at_rest(r), "frames": memory.frames(r), "theory": books[r]}
                    for r in range(len(memory.per_rank))])
    return out


def _rank(config, rank: int) -> dict:
    return config[rank]


def _peak(result: dict) -> int:
    return max(sum(f["peak"].values()) for f in result["frames"])


def phase_kind(phase: str) -> str:
    """Which of the theory's moments a recorded phase belongs to."""
    if phase.startswith("forward") or phase == "loss":
        return "forward"
    if phase.startswith("backward"):
        return "backward"
    return "optimizer step" if phase == "optimizer step" else "at rest"


def _stack(ax, x, values: dict, width: float, unit: str, hatch=None, alpha=1.0, label=True):
    bottom = 0.0
    for c in CATEGORIES:
        h = in_unit(values.get(c, 0), unit)
        if h:
            ax.bar(x, h, width, bottom=bottom, color=CATEGORY_COLORS[c], hatch=hatch, alpha=alpha,
                   edgecolor="white" if hatch is None else "0.3", lw=0.5,
                   label=LABELS[c] if label else None)
            bottom += h
    return bottom


def plot_memory(measured: dict, theory: dict, rank: int = 0, over: str = "strategy", names=None,
                unit: str = "KiB", ax=None):
    """What ``rank`` held, measured next to the ledger.

    over="strategy": stacked bars at rest per configuration, theory (hatched) beside measured
    (solid); short lines above each pair mark the peak over the recorded step (dashed: theory,
    solid: measured). over="step": memory over the recorded step, stacked by category, one
    panel per configuration, the dashed line the theory's total for each moment.
    over="player": a widget that plays the recorded step frame by frame, every rank side by
    side (a ``LedgerPlayer``; display it by leaving it as a cell's last expression).
    """
    if over == "player":
        return LedgerPlayer(measured, theory, names, unit)
    chosen = configs(measured, theory, names)
    if over == "step":
        return plot_timeline(chosen, rank, unit, axes=ax)
    if over != "strategy":
        raise ValueError(f"over must be 'strategy', 'step' or 'player', not {over!r}")
    return plot_bars(chosen, rank, unit, ax)


def plot_bars(configs, rank: int = 0, unit: str = "KiB", ax=None):
    """Per-rank stacked bars at rest per configuration (see ``plot_memory``)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(1.3 * len(configs) + 2.5, 3.8))
    names = []
    for i, config in enumerate(configs):
        result = _rank(config, rank)
        theory = result["theory"]
        _stack(ax, i - 0.2, theory.at_rest(), 0.38, unit, hatch="//", alpha=0.55, label=False)
        _stack(ax, i + 0.2, {c: result["at_rest"].get(c, 0) for c in AT_REST}, 0.38, unit,
               label=(i == 0))
        ax.hlines(in_unit(theory.peak, unit), i - 0.39, i - 0.01, colors="k", linestyles="--", lw=1)
        if result.get("frames"):
            ax.hlines(in_unit(_peak(result), unit), i + 0.01, i + 0.39, colors="k", lw=1.2)
        names.append(result["label"])
    ax.set_xticks(range(len(configs)), names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(f"{unit} per rank")
    world = _rank(configs[0], rank)["world_size"]
    ax.set_title(f"rank {rank} of {world}: at rest, theory (hatched) | measured (solid); "
                 "peak: --- theory, — measured", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize=7, loc="upper right")
    ax.figure.tight_layout()
    return ax.figure


def _series(result: dict):
    """x positions, phase names and category values: each phase's peak, then its end."""
    xs, names, points = [], [], []
    for i, frame in enumerate(result["frames"]):
        for j, key in enumerate(("peak", "end")):
            xs.append(i + 0.5 * j)
            points.append(frame[key])
        names.append(frame["phase"])
    return xs, names, points


def plot_timeline(configs, rank: int = 0, unit: str = "KiB", axes=None):
    """Memory over the recorded step, one panel per configuration (see ``plot_memory``)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(len(configs), 1, figsize=(9, 2.6 * len(configs)), sharex=False,
                               squeeze=False)
        axes = axes[:, 0]
    for ax, config in zip(axes, configs):
        result = _rank(config, rank)
        theory = result["theory"]
        xs, names, points = _series(result)
        ys = [[in_unit(p.get(c, 0), unit) for p in points] for c in CATEGORIES]
        ax.stackplot(xs, ys, colors=[CATEGORY_COLORS[c] for c in CATEGORIES],
                     labels=[LABELS[c] for c in CATEGORIES], step="post")
        expect = [in_unit(sum(theory.phases[phase_kind(f["phase"])].values()), unit)
                  for f in result["frames"] for _ in (0, 1)]
        ax.step(xs, expect, where="post", color="k", ls="--", lw=1, label="theory")
        ax.set_title(f"{result['label']}: rank {rank} of {result['world_size']}", fontsize=9)
        ax.set_ylabel(unit)
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=6)
    fig = axes[0].figure
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, ncol=5, loc="upper center")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    return fig


def _ranks(config) -> list:
    return list(config)


def draw_ledger_frame(axes, configs, k: int, unit: str = "KiB") -> None:
    """Frame ``k`` of the step: per configuration, one stacked bar per rank, theory as outline."""
    from matplotlib.patches import Patch, Rectangle

    theories = [[r["theory"] for r in config] for config in configs]
    # one y-axis for every panel and frame, so the strategies' heights compare at a glance
    everyone = [r for config in configs for r in _ranks(config)]
    top = max([sum(f["peak"].values()) for r in everyone for f in r["frames"]]
              + [t.peak for books in theories for t in books])
    for ax, config, books in zip(axes, configs, theories):
        ranks = _ranks(config)
        ax.clear()
        phase = "?"
        for r, (result, theory) in enumerate(zip(ranks, books)):
            frame = result["frames"][min(k, len(result["frames"]) - 1)]
            phase = frame["phase"]
            _stack(ax, r, frame["peak"], 0.6, unit, label=False)
            expected = sum(theory.phases[phase_kind(phase)].values())
            ax.add_patch(Rectangle((r - 0.36, 0), 0.72, in_unit(expected, unit), fill=False,
                                   ls="--", lw=1.2, ec="k"))
        ax.set_ylim(0, in_unit(top, unit) * 1.08)
        ax.set_xlim(-0.6, len(ranks) - 0.4)
        ax.set_xticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))], fontsize=7)
        ax.set_title(f"{ranks[0]['label']}\n{phase}", fontsize=8)
        ax.set_ylabel(f"{unit} per rank", fontsize=7)
    used = [c for c in CATEGORIES if any(f["peak"].get(c) for r in everyone for f in r["frames"])]
    handles = [Patch(color=CATEGORY_COLORS[c], label=LABELS[c]) for c in used]
    handles.append(Patch(fill=False, ls="--", ec="k", label="theory"))
    axes[-1].legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1))


# a frame of the player, in CSS pixels: panels of the same size as the matplotlib frame's
_PANEL_W, _PANEL_H, _LEFT, _TOP, _BOTTOM, _KEY_W = 288, 324, 58, 40, 26, 150


def render_ledger_svg(configs, k: int, unit: str = "KiB") -> str:
    """Frame ``k`` as SVG text (what the player shows): the figure ``draw_ledger_frame`` draws,
    written directly -- a matplotlib PNG per step takes longer than a slider step may."""
    from . import svg

    everyone = [r for config in configs for r in _ranks(config)]
    top = max([sum(f["peak"].values()) for r in everyone for f in r["frames"]]
              + [r["theory"].peak for r in everyone])
    axis_top = in_unit(top, unit) * 1.08 or 1.0  # one y-axis for every panel and frame
    ticks = svg.nice_ticks(axis_top)
    height = _PANEL_H
    y0, y1 = _TOP, _PANEL_H - _BOTTOM  # the plot's top and bottom, pixels
    scale = (y1 - y0) / axis_top
    parts = []
    for p, config in enumerate(configs):
        ranks = _ranks(config)
        x0 = p * _PANEL_W + _LEFT
        x1 = (p + 1) * _PANEL_W - 10
        slot = (x1 - x0) / len(ranks)  # one rank per slot, as xlim (-0.6, n - 0.4) spaces them
        phase = "?"
        for r, result in enumerate(ranks):
            frame = result["frames"][min(k, len(result["frames"]) - 1)]
            phase = frame["phase"]
            centre, bottom = x0 + (r + 0.5) * slot, 0.0
            for c in CATEGORIES:
                h = in_unit(frame["peak"].get(c, 0), unit)
                if h:
                    parts.append(svg.rect(centre - 0.3 * slot, y1 - (bottom + h) * scale, 0.6 * slot, h * scale,
                                          CATEGORY_COLORS[c], "white", width=0.5,
                                          title=f"rank {r}: {LABELS[c]} {h:.4g} {unit}"))
                    bottom += h
            expected = in_unit(sum(result["theory"].phases[phase_kind(phase)].values()), unit)
            parts.append(svg.rect(centre - 0.36 * slot, y1 - expected * scale, 0.72 * slot, expected * scale,
                                  stroke="#000", dash="5 3", width=1.2,
                                  title=f"rank {r}: theory {expected:.4g} {unit}"))
            parts.append(svg.text(centre, y1 + 6, f"rank {r}", 10, "middle", baseline="hanging"))
        for tick in ticks:
            y = y1 - tick * scale
            parts += [svg.line(x0 - 4, y, x0, y, "#444"), svg.text(x0 - 6, y, svg.tick_label(tick), 9, "end")]
        parts += [svg.rect(x0, y0, x1 - x0, y1 - y0, stroke="#444", width=0.8),
                  svg.text(p * _PANEL_W + 12, (y0 + y1) / 2, f"{unit} per rank", 10, "middle", rotate=-90),
                  svg.text((x0 + x1) / 2, 6, ranks[0]["label"], 11, "middle", baseline="hanging"),
                  svg.text((x0 + x1) / 2, 21, phase, 11, "middle", baseline="hanging")]
    used = [c for c in CATEGORIES if any(f["peak"].get(c) for r in everyone for f in r["frames"])]
    key_x, y = len(configs) * _PANEL_W + 4, y0
    for c in used:
        parts += [svg.rect(key_x, y - 5, 14, 10, CATEGORY_COLORS[c]), svg.text(key_x + 20, y, LABELS[c], 10)]
        y += 16
    parts += [svg.rect(key_x, y - 5, 14, 10, stroke="#000", dash="3 2"), svg.text(key_x + 20, y, "theory", 10)]
    return svg.svg(len(configs) * _PANEL_W + _KEY_W, height, parts)


class LedgerPlayer:
    """Play/pause and a step slider over one recorded training step, per rank and strategy.

    measured, theory: as for ``plot_memory``; names: which configurations (e.g. DDP and
    FULL_SHARD). The dashed outline is the theory's total for the current moment of the
    step. Each frame is SVG (``render_ledger_svg``), so a step redraws in a few ms. Display
    it by leaving it as a cell's last expression.
    """

    def __init__(self, measured: dict, theory: dict, names=None, unit: str = "KiB", interval_ms: int = 600):
        import ipywidgets as w

        self.configs, self.unit, self._drawn = configs(measured, theory, names), unit, {}
        steps = max(len(r["frames"]) for c in self.configs for r in _ranks(c))
        self.play = w.Play(min=0, max=steps - 1, step=1, interval=interval_ms, description="play")
        self.slider = w.IntSlider(min=0, max=steps - 1, description="step")
        w.jslink((self.play, "value"), (self.slider, "value"))
        self.image = w.Image(format="svg+xml")  # SVG the browser draws: see render_ledger_svg
        self.widget = w.VBox([w.HBox([self.play, self.slider]), self.image])
        self.slider.observe(lambda _: self.show(), names="value")
        self.show()

    def show(self) -> None:
        """Draw the frame the slider points at (cached once drawn), at its natural size."""
        from .svg import show_svg

        k = self.slider.value
        if k not in self._drawn:
            self._drawn[k] = render_ledger_svg(self.configs, k, self.unit)
        show_svg(self.image, self._drawn[k])

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
