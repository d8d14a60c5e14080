"""Every slider and drop-down of the course's widgets: redraw time beside a bare matplotlib draw.

    python -m dpcourse.bench widgets [--repeats 15]

A redraw is timed from setting a control's value (what the browser's change does in the
kernel) to the widget holding its new output. In each of ``repeats`` rounds every control
moves once and a bare matplotlib bar chart is drawn to PNG once (rounds interleave, so load
on the machine hits both alike); the table gives the medians side by side and their ratio.
The targets: every redraw's median under 100 ms, and under 0.8x the bare draw's median in
the same run (a PNG per step cannot reach that: the ratio is robust to a busy machine).

The players are fed without ranks: the ring player's trace comes from the schedule simulator
(in the notebook a drop-down also runs a traced all-reduce on the ranks: that run is the
experiment, not the redraw), the ledger player's step from the ledger's own phases. Each
step is drawn uncached, as the first visit of a frame is. A panel's controls redraw nothing
until Run (its experiment then runs on the ranks and draws what it returns); they are timed
all the same.
"""
from __future__ import annotations

import io
import statistics
import time
from dataclasses import dataclass

HELP = "widgets: each slider/drop-down's redraw time vs a bare matplotlib draw, same run"
LIMIT_MS = 100.0  # what a slider step may take, kernel side
RATIO = 0.8  # a redraw's median relative to the bare draw's, at most


@dataclass
class Redraw:
    """One control's timings (milliseconds, median over rounds) next to the bare draw's."""

    widget: str
    control: str
    redraw_ms: float
    bare_ms: float

    @property
    def ratio(self) -> float:
        return self.redraw_ms / self.bare_ms

    @property
    def ok(self) -> bool:
        return self.redraw_ms < LIMIT_MS and self.ratio < RATIO


def bare_draw() -> bytes:
    """A bare matplotlib bar chart drawn to PNG: the cheapest whole-figure redraw (the yardstick)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3))
    ax = fig.subplots()
    ax.bar(range(6), [3, 1, 4, 1, 5, 9], color="#1f77b4")
    ax.set_title("bare")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def _calculator_moves():
    """(control name, move) for every input of the calculator: each move sets a new value
    the ledger accepts (a refused value would skip the drawing)."""
    from ..viz.calculator import ZERO_PRESET, MemoryCalculator

    calc = MemoryCalculator(**ZERO_PRESET)
    names = {id(value): name for name, value in vars(calc).items()}
    moves = []
    for control in calc.inputs:
        options = list(getattr(control, "options", ()))
        values = options[:2] if options else [control.value, control.value * 2 if control.value else 1]

        def move(i, control=control, values=values):
            control.value = values[(values.index(control.value) + 1) % len(values)] \
                if control.value in values else values[i % len(values)]
            if calc.verdict.startswith("cannot compute"):
                raise RuntimeError(f"the calculator refused {control.description}={control.value}")
        moves.append((names[id(control)], move))
    moves.append(("preset button", lambda i: calc.preset.click()))
    return "MemoryCalculator", moves


def _ring_moves():
    import torch

    from ..collectives.schedule import simulate
    from ..viz.ring import RingPlayer

    def make_trace(world_size, numel):
        return simulate("ring_all_reduce", world_size, numel, 8,
                        [torch.arange(numel) + 100 * r for r in range(world_size)])

    player = RingPlayer(make_trace, world_size=4, numel=8)

    def step(i):
        player._drawn.clear()  # a frame not seen yet: the slow case of a cache
        player.slider.value = (player.slider.value + 1) % (player.slider.max + 1)

    def choose(control):
        def move(i):
            options = list(control.options)
            control.value = options[(options.index(control.value) + 1) % len(options)]
        return move
    return "RingPlayer", [("step slider", step), ("N drop-down", choose(player.world_size)),
                          ("numel drop-down", choose(player.numel))]


def recorded_step(world_size: int = 4, strategies=("ddp", "FULL_SHARD")):
    """({name: Memory}, {name: [Ledger per rank]}) whose recorded step is the ledger's own
    phases (no ranks run): what the ledger player draws, for timing its drawing."""
    from ..memory import ledger
    from ..memory.fit import equal_units
    from ..observe import Memory

    phases = ["forward blocks.0", "forward blocks.1", "forward root", "loss", "backward blocks.1",
              "backward blocks.0", "backward root", "optimizer step", "zero_grad"]
    from ..viz.memory import phase_kind

    measured, theory = {}, {}
    for name in strategies:
        books = [ledger(1_000_000, world_size, name, "fp32", "adam", rank=r, activation_bytes=200_000,
                        units=equal_units(1_000_000, 3)) for r in range(world_size)]
        memory = Memory()
        memory.collect([{"at_rest": book.at_rest(), "steps": 3,
                         "frames": [{"phase": p, "peak": book.phases[phase_kind(p)], "end": book.at_rest()}
                                    for p in phases]} for book in books])
        measured[name], theory[name] = memory, books
    return measured, theory


def _ledger_moves():
    from ..viz.memory import LedgerPlayer

    player = LedgerPlayer(*recorded_step())

    def step(i):
        player._drawn.clear()  # a frame not seen yet: the slow case of a cache
        player.slider.value = (player.slider.value + 1) % (player.slider.max + 1)
    return "LedgerPlayer", [("step slider", step)]


def _panel_moves():
    from ..viz.panel import Panel

    def experiment(cluster, bucket_cap_mb=0.5, kind="ddp", progress=None):  # never run here
        raise AssertionError("a control's change must not run the experiment")

    panel = Panel("timing", experiment, None, bucket_cap_mb=[0.05, 0.5, 5], kind=["ddp", "fsdp"])

    def choose(control):
        def move(i):
            options = list(control.options)
            control.value = options[(options.index(control.value) + 1) % len(options)]
        return move
    return "Panel", [("slider (numbers)", choose(panel.controls["bucket_cap_mb"])),
                     ("drop-down", choose(panel.controls["kind"]))]


def measure(repeats: int = 15) -> list[Redraw]:
    """Every control of every widget moved ``repeats`` times, interleaved with the bare draw."""
    import matplotlib

    matplotlib.use("Agg")  # drawing only: no window, whatever the backend was
    widgets = [_calculator_moves(), _ledger_moves(), _ring_moves(), _panel_moves()]
    bare_draw()  # the first draw loads fonts: not a redraw
    bare, times = [], {(w, c): [] for w, moves in widgets for c, _ in moves}
    for i in range(repeats + 1):  # round 0 warms every control up
        t0 = time.perf_counter()
        bare_draw()
        took = time.perf_counter() - t0
        if i:
            bare.append(took)
        for widget, moves in widgets:
            for control, move in moves:
                t0 = time.perf_counter()
                move(i)
                took = time.perf_counter() - t0
                if i:
                    times[widget, control].append(took)
    bare_ms = statistics.median(bare) * 1e3
    return [Redraw(w, c, statistics.median(t) * 1e3, bare_ms) for (w, c), t in times.items()]


def add_arguments(parser) -> None:
    parser.add_argument("--repeats", type=int, default=15, help="rounds; medians over them")


def main(args) -> int:
    rows = measure(args.repeats)
    print(f"redraw per control vs a bare matplotlib bar chart to PNG, median of {args.repeats} "
          f"interleaved rounds (targets: < {LIMIT_MS:.0f} ms and < {RATIO}x bare)")
    print(f"{'widget':17} {'control':20} {'redraw ms':>10} {'bare ms':>9} {'ratio':>7}  verdict")
    for r in rows:
        print(f"{r.widget:17} {r.control:20} {r.redraw_ms:10.2f} {r.bare_ms:9.2f} {r.ratio:6.3f}x  "
              + ("ok" if r.ok else "SLOW"))
    slow = [f"{r.widget} {r.control}" for r in rows if not r.ok]
    print("target: every control: " + ("ok" if not slow else "MISSED by " + ", ".join(slow)))
    return 0 if not slow else 1
