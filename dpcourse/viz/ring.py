"""Drawing a traced all-reduce: ranks on a ring, chunks coloured by contributions, arrows.

Draws ``Trace.frames()`` only; it never starts processes. Each rank shows its N chunks as
columns; a column has one stripe per rank, filled in that rank's colour when the chunk
already includes that rank's contribution -- a fully reduced chunk is striped in every
colour. Arrows are the current step's transfers, labelled with the chunk they carry.
``RingPlayer`` steps through the frames with ipywidgets and re-runs a real traced run
(through the callable it is given) when N or the tensor size changes.
"""
from __future__ import annotations

import io
import math

from .colors import EMPTY, rank_color


def _positions(n: int):
    # rank 0 at the top, clockwise, so "rank r sends to r+1" runs clockwise round the ring
    return [(math.sin(2 * math.pi * r / n), math.cos(2 * math.pi * r / n)) for r in range(n)]


def draw_frame(ax, trace, frame, show_values: bool = True) -> None:
    """Draw one ``Frame`` of ``trace`` on a matplotlib Axes."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    n = trace.world_size
    pos = _positions(n)
    width = 0.8 if n > 1 else 1.0   # of a rank's block of chunks, in data units
    cw, ch = width / n, 0.4
    ax.set_xlim(-1.65, 1.65)
    ax.set_ylim(-1.7, 1.55)
    ax.set_aspect("equal")
    ax.axis("off")
    for r, (x, y) in enumerate(pos):
        left, bottom = x - width / 2, y - ch / 2
        for c in range(n):
            who = frame.holding[r][c]
            for k in range(n):
                ax.add_patch(Rectangle((left + c * cw, bottom + k * ch / n), cw, ch / n,
                                       facecolor=rank_color(k) if k in who else EMPTY,
                                       edgecolor="none"))
            ax.add_patch(Rectangle((left + c * cw, bottom), cw, ch, fill=False, lw=0.8))
            ax.text(left + (c + 0.5) * cw, bottom + ch + 0.02, f"c{c}", ha="center",
                    va="bottom", fontsize=6, color="0.35")
        label = f"rank {r}: sent {frame.bytes_sent[r]} B"
        if show_values and frame.values is not None and trace.numel <= 8:
            label += "\n" + " ".join(str(v) for v in frame.values[r].tolist())
        ax.text(x, bottom - 0.03, label, ha="center", va="top", fontsize=6.5,
                color=rank_color(r))
    for t in frame.transfers:
        (x0, y0), (x1, y1) = pos[t.src], pos[t.dst]
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), connectionstyle="arc3,rad=-0.25",
                                     arrowstyle="-|>", mutation_scale=10, lw=1.2,
                                     color=rank_color(t.src), shrinkA=18, shrinkB=18, alpha=0.8))
        what = "all" if t.chunk is None else f"c{t.chunk}"
        mx, my = (x0 + x1) / 2 * 0.45, (y0 + y1) / 2 * 0.45
        ax.text(mx, my, what, fontsize=7, ha="center", va="center", color=rank_color(t.src))
    total = len(trace.steps())
    title = "start: each rank holds only its own data" if frame.number == 0 else \
        f"step {frame.number}/{total}: {frame.phase}"
    ax.set_title(title, fontsize=8)


def plot_ring_trace(trace, columns: int = 4, panel_size: float = 3.0):
    """A static figure: one panel per frame of ``trace`` (start, then every step)."""
    from matplotlib.figure import Figure

    frames = trace.frames()
    rows = math.ceil(len(frames) / columns)
    cols = min(columns, len(frames))
    fig = Figure(figsize=(panel_size * cols, panel_size * 1.05 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(frames):]:
        ax.axis("off")
    for ax, frame in zip(axes.flat, frames):
        draw_frame(ax, trace, frame)
    fig.suptitle(f"{trace.algorithm}: {trace.world_size} ranks, {trace.numel} elements "
                 f"x {trace.itemsize} B", fontsize=9)
    return fig


def render_frame_png(trace, frame, size: float = 4.2, dpi: int = 100) -> bytes:
    """One frame as PNG bytes (what the player shows)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size, size))
    draw_frame(fig.add_subplot(), trace, frame)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


class RingPlayer:
    """An ipywidgets player for a traced all-reduce: play/pause, step slider, N and size.

    make_trace(world_size, numel) -> Trace: called at start and whenever N or the size
    changes; in the course it runs a real traced all-reduce on ranks (drawing itself never
    starts processes). Display the player by leaving it as a cell's last expression.
    """

    def __init__(self, make_trace, world_sizes=(2, 3, 4, 5), numels=(4, 8, 12, 1000),
                 world_size: int = 4, numel: int = 8, interval_ms: int = 1200):
        import ipywidgets as w

        self.make_trace = make_trace
        self.play = w.Play(min=0, max=1, step=1, interval=interval_ms, description="play")
        self.slider = w.IntSlider(min=0, max=1, description="step")
        w.jslink((self.play, "value"), (self.slider, "value"))
        self.world_size = w.Dropdown(options=list(world_sizes), value=world_size, description="N")
        self.numel = w.Dropdown(options=list(numels), value=numel, description="numel")
        self.image = w.Image(format="png")
        self.status = w.Label()
        self.widget = w.VBox([w.HBox([self.play, self.slider]),
                              w.HBox([self.world_size, self.numel]), self.status, self.image])
        self.slider.observe(lambda _: self.show(), names="value")
        self.world_size.observe(lambda _: self.rerun(), names="value")
        self.numel.observe(lambda _: self.rerun(), names="value")
        self.trace, self.frames, self._png = None, [], {}
        self.rerun()

    def rerun(self) -> None:
        """Record a new trace for the chosen N and size; show its first frame."""
        self.status.value = f"running a traced all-reduce on {self.world_size.value} ranks..."
        self.trace = self.make_trace(self.world_size.value, self.numel.value)
        self.frames, self._png = self.trace.frames(), {}
        self.slider.value = 0
        self.slider.max = self.play.max = len(self.frames) - 1
        self.status.value = (f"{self.trace.algorithm}: {self.trace.world_size} ranks, "
                             f"{self.trace.numel} elements, {len(self.frames) - 1} steps")
        self.show()

    def show(self) -> None:
        """Draw the frame the slider points at."""
        k = min(self.slider.value, len(self.frames) - 1)
        if k not in self._png:
            self._png[k] = render_frame_png(self.trace, self.frames[k])
        self.image.value = self._png[k]

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


