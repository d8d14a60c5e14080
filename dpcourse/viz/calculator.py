"""The memory calculator widget: model size, ranks, precision, optimizer -> does it fit?

Every redraw computes ``ledger`` for each strategy (microseconds) and writes the bars as
inline SVG into an HTML widget (a few ms: a matplotlib PNG would take longer than the 100 ms a
slider step may); it never starts processes. Bytes are shown in the chosen unit
(GB = 10^9 bytes, as the ZeRO paper counts; GiB = 2^30 bytes).
"""
from __future__ import annotations

from ..memory.choice import TOKENS_PER_RANK, choose, plans, recommend
from ..memory.fit import equal_units, fit_table, transformer_units
from ..memory.layout import transformer_num_params
from ..memory.ledger import CATEGORIES, OPTIMIZERS
from ..memory.sizes import UNITS, in_unit
from . import svg
from .memory import CATEGORY_COLORS, LABELS
from .plans import render_plans_html

ZERO_PRESET = {"mode": "parameters", "billions": 7.5, "world_size": 64, "precision": "mixed",
               "optimizer": "adam", "device_gb": 32.0, "activations_gb": 0.0}  # ZeRO paper, Fig. 1


# the chart's geometry, in CSS pixels: a label column, the bars, room for the numbers
_WIDTH, _LABELS, _RIGHT, _ROW, _BAR, _TOP, _AXIS = 720, 130, 24, 30, 22, 10, 44


def render_fit_html(rows, device_bytes: int, unit: str = "GB") -> str:
    """Horizontal stacked bars (at rest, bytes per rank in ``unit``) with the peak marked, and
    the device's memory, as inline SVG plus an HTML legend: the browser draws it, so a redraw
    costs the kernel a few hundred short strings instead of a matplotlib PNG."""
    peaks = [in_unit(r["peak"], unit) for r in rows]
    device = in_unit(device_bytes, unit)
    axis_end = max(peaks + [device]) * 1.05 or 1.0  # matplotlib's 5 % margin beyond the longest
    ticks = svg.nice_ticks(axis_end)
    right = _WIDTH - _RIGHT
    scale = (right - _LABELS) / axis_end
    height = _TOP + _ROW * len(rows) + _AXIS
    bottom = _TOP + _ROW * len(rows)
    parts, used = [], []
    for tick in ticks:
        x = _LABELS + tick * scale
        parts += [svg.line(x, bottom, x, bottom + 4, svg.INK2),
                  svg.text(x, bottom + 6, svg.tick_label(tick), 10, "middle", svg.INK, "hanging")]
    for i, row in enumerate(rows):  # first row on top, as the table lists them
        y, left = _TOP + i * _ROW + (_ROW - _BAR) / 2, 0.0
        book = row["ledger"]
        for c in CATEGORIES:
            width = in_unit(book.bytes[c], unit) if c in book.at_rest() else 0
            if width:
                parts.append(svg.rect(_LABELS + left * scale, y, width * scale, _BAR, CATEGORY_COLORS[c],
                                      title=f"{row['strategy']}: {LABELS[c]} {width:.4g} {unit}"))
                left += width
                used += [c] if c not in used else []
        x = _LABELS + peaks[i] * scale
        parts.append(svg.line(x, y - 3, x, y + _BAR + 3, svg.INK, 2))
        name = ("" if row["fits"] else "✗ ") + row["strategy"]
        parts.append(svg.text(_LABELS - 6, y + _BAR / 2, name, 11, "end"))
    x = _LABELS + device * scale
    parts += [svg.line(_LABELS, _TOP, _LABELS, bottom, svg.INK2), svg.line(_LABELS, bottom, right, bottom, svg.INK2),
              svg.line(x, _TOP - 4, x, bottom, "red", 1.5, "6 3"),
              svg.text((_LABELS + right) / 2, height - 4, f"{unit} per rank (bars: at rest; tick: peak "
                       "with transients)", 11, "middle", svg.INK, "auto")]
    key = [(CATEGORY_COLORS[c], LABELS[c]) for c in used] + [("--red", "device memory")]
    return (f"<div style='max-width:{_WIDTH}px'>" + svg.svg(_WIDTH, height, parts, fit=True) + svg.legend(key)
            + "</div>")


def _hybrid_absent(rows, world_size: int, shard_group_size: int) -> str:
    """Why the HYBRID_SHARD row is missing, when it is (else ""): a row that vanishes silently
    reads as a strategy that fits nowhere."""
    if any(r["strategy"] == "HYBRID_SHARD" for r in rows):
        return ""
    if shard_group_size < 1 or world_size % shard_group_size:
        why = f"shard_group_size={shard_group_size} does not divide world_size={world_size}"
    else:
        why = (f"shard_group_size={shard_group_size} leaves one replica on {world_size} rank"
               + ("s" if world_size != 1 else "") + " (it is FULL_SHARD then)")
    return f" HYBRID_SHARD is not listed: {why}."


class MemoryCalculator:
    """Widgets for the ledger of every strategy; flags the ones that do not fit, names the plan
    ``dpcourse.memory.recommend`` picks and tabulates every plan (``memory.choice.plans``: fit
    beside the estimated step time, at ``tokens`` per rank and step).

    ``verdict`` holds the last text shown; ``apply(**values)`` sets inputs from code.
    """

    def __init__(self, **values):
        import ipywidgets as w

        style = {"description_width": "130px"}
        self.mode = w.ToggleButtons(options=["parameters", "transformer shape"], value="parameters")
        self.billions = w.FloatText(value=7.5, description="params (10⁹)", style=style)
        self.num_units = w.IntText(value=32, description="FSDP units", style=style)
        self.n_layers = w.IntText(value=32, description="n_layers", style=style)
        self.d_model = w.IntText(value=4096, description="d_model", style=style)
        self.vocab_size = w.IntText(value=50257, description="vocab_size", style=style)
        self.seq_len = w.IntText(value=2048, description="seq_len", style=style)
        self.world_size = w.IntText(value=8, description="world_size", style=style)
        self.shard_group_size = w.IntText(value=8, description="shard_group_size", style=style)
        self.precision = w.Dropdown(options=["mixed", "fp32"], value="mixed", description="precision", style=style)
        self.optimizer = w.Dropdown(options=list(OPTIMIZERS), value="adam", description="optimizer", style=style)
        self.device_gb = w.FloatText(value=80.0, description="device (GB)", style=style)
        self.activations_gb = w.FloatText(value=0.0, description="activations (GB)", style=style)
        self.tokens = w.IntText(value=TOKENS_PER_RANK, description="tokens/rank/step", style=style)
        self.unit = w.ToggleButtons(options=["GB", "GiB"], value="GB")
        self.preset = w.Button(description="ZeRO paper: 7.5B on 64 GPUs", layout=w.Layout(width="auto"))
        self.text = w.HTML()
        self.chart = w.HTML()  # the bars, as inline SVG
        self.table = w.HTML()  # every plan of the rule, fit beside estimated step time
        self.inputs = [self.mode, self.billions, self.num_units, self.n_layers, self.d_model,
                       self.vocab_size, self.seq_len, self.world_size, self.shard_group_size,
                       self.precision, self.optimizer, self.device_gb, self.activations_gb, self.tokens, self.unit]
        shape = w.VBox([self.n_layers, self.d_model, self.vocab_size, self.seq_len])
        self.widget = w.VBox([w.HBox([self.mode, self.preset]),
                              w.HBox([w.VBox([self.billions, self.num_units, shape]),
                                      w.VBox([self.world_size, self.shard_group_size, self.precision,
                                              self.optimizer, self.device_gb, self.activations_gb,
                                              self.tokens, self.unit])]),
                              self.text, self.chart, self.table])
        self.verdict, self.rows, self.plans = "", [], []
        self.apply(**values)
        for widget in self.inputs:
            widget.observe(lambda _: self.update(), names="value")
        self.preset.on_click(lambda _: self.apply(**ZERO_PRESET))

    def num_params(self) -> int:
        """Parameters (elements) from the count or from the transformer shape."""
        if self.mode.value == "parameters":
            return max(1, round(self.billions.value * 1e9))
        return transformer_num_params(self.n_layers.value, self.d_model.value, self.vocab_size.value,
                                      self.seq_len.value)

    def units(self) -> list[int]:
        """FSDP units (parameters each): equal units, or one per transformer block plus the root."""
        if self.mode.value == "parameters":
            return equal_units(self.num_params(), self.num_units.value)
        return transformer_units(self.n_layers.value, self.d_model.value, self.vocab_size.value,
                                 self.seq_len.value)

    def apply(self, **values) -> None:
        """Set inputs by name (e.g. ``world_size=64``), then redraw once."""
        self._quiet = True
        try:
            for name, value in values.items():
                getattr(self, name).value = value
        finally:
            self._quiet = False
        self.update()

    def update(self) -> None:
        """Recompute the ledger of every strategy and redraw."""
        if getattr(self, "_quiet", False):
            return
        by_count = self.mode.value == "parameters"
        self.billions.disabled = self.num_units.disabled = not by_count  # the shape decides
        for box in (self.n_layers, self.d_model, self.vocab_size, self.seq_len):
            box.disabled = by_count
        try:
            n, world = self.num_params(), self.world_size.value
            device = int(self.device_gb.value * 1e9)
            options = dict(units=self.units(), activation_bytes=int(self.activations_gb.value * 1e9))
            self.rows = fit_table(n, world, device, self.precision.value, self.optimizer.value,
                                  shard_group_size=self.shard_group_size.value, **options)
            choice, why = recommend(n, world, device, self.shard_group_size.value, self.precision.value,
                                    self.optimizer.value, tokens=self.tokens.value, **options)
            self.plans = plans(n, world, device, self.shard_group_size.value, self.precision.value,
                               self.optimizer.value, tokens=self.tokens.value, **options)
        except ValueError as err:
            self.verdict = f"cannot compute: {err}"
            self.text.value = f"<b style='color:var(--jp-error-color1, #b00)'>{self.verdict}</b>"
            return
        unit = self.unit.value
        fit = [r["strategy"] for r in self.rows if r["fits"]]
        misses = [r["strategy"] for r in self.rows if not r["fits"]]
        ranks = f"{world} rank" + ("s" if world != 1 else "")
        self.verdict = (f"{n / 1e9:.3g}e9 parameters on {ranks}, device {self.device_gb.value:g} GB: "
                        + (f"fits with {', '.join(fit)}" if fit else "does not fit with any strategy")
                        + (f"; does not fit: {', '.join(misses)}" if fit and misses else "")
                        + f". The rule picks {choice}: {why}." + _hybrid_absent(self.rows, world,
                                                                               self.shard_group_size.value))
        self.text.value = self.verdict.replace("does not fit", "<b style='color:var(--jp-error-color1, #b00)'>does not fit</b>")
        self.chart.value = render_fit_html(self.rows, device, unit if unit in UNITS else "GB")
        self.table.value = render_plans_html(self.plans, *choose(self.plans), unit if unit in UNITS else "GB")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
