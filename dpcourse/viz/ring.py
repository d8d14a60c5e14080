"""Drawing a traced all-reduce: ranks on a ring, chunks coloured by contributions, arrows.

Draws ``Trace.frames()`` only; it never starts processes. Each rank shows its N chunks as
columns; a column has one stripe per rank, filled in that rank's colour when the chunk
already includes that rank's contribution -- a fully reduced chunk is striped in every
colour. Arrows are the current step's transfers, labelled with the chunk they carry.
``RingPlayer`` steps through the frames with ipywidgets and re-runs a real traced run
(through the callable it is given) when N or the tensor size changes; it shows each frame as
SVG (``render_frame_svg``: the same drawing, written directly, since a matplotlib PNG per
step takes longer than the 100 ms a slider step may).
"""
from __future__ import annotations

import io
import math

from .colors import EMPTY, rank_color, rank_text_color
from .panel import ErrorView


_BLOCK_W, _BLOCK_H = 0.8, 0.4  # a rank's block of chunks, in data units


def _radius(n: int) -> float:
    """Ring radius in data units: wider for 4+ ranks so labels and arrows keep apart."""
    return 1.0 if n <= 3 else 1.5


def _positions(n: int):
    # rank 0 at the top, clockwise, so "rank r sends to r+1" runs clockwise round the ring
    radius = _radius(n)
    return [(radius * math.sin(2 * math.pi * r / n), radius * math.cos(2 * math.pi * r / n))
            for r in range(n)]


def _edge_point(centre, towards, margin: float = 0.06):
    """Where the segment from a block's ``centre`` towards ``towards`` leaves the block."""
    (x, y), (tx, ty) = centre, towards
    dx, dy = tx - x, ty - y
    hw, hh = _BLOCK_W / 2 + margin, _BLOCK_H / 2 + 0.12 + margin  # + the chunk names above
    t = min(hw / abs(dx) if dx else math.inf, hh / abs(dy) if dy else math.inf)
    return x + t * dx, y + t * dy


def _transfer_geometry(start, end, rad: float = -0.25):
    """(tail, Bezier control point, head, label point) of the arrow from the block at
    ``start`` to the block at ``end`` (data units), bending by ``rad`` as matplotlib's arc3."""
    a, b = _edge_point(start, end), _edge_point(end, start)
    dx, dy = b[0] - a[0], b[1] - a[1]
    control = ((a[0] + b[0]) / 2 + rad * dy, (a[1] + b[1]) / 2 - rad * dx)
    # the middle of the quadratic Bezier curve is half the control point's offset
    middle = ((a[0] + b[0]) / 2 + 0.5 * rad * dy, (a[1] + b[1]) / 2 - 0.5 * rad * dx)
    return a, control, b, middle


def _draw_transfer(ax, start, end, what: str, color, rad: float = -0.25, text_color=None) -> None:
    """An arrow from the block at ``start`` to the block at ``end`` (data units) bending by
    ``rad``, labelled ``what`` at the middle of its arc (in ``text_color``, else ``color``)."""
    text_color = text_color or color
    from matplotlib.patches import FancyArrowPatch

    a, _, b, (mx, my) = _transfer_geometry(start, end, rad)
    ax.add_patch(FancyArrowPatch(a, b, connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>",
                                 mutation_scale=10, lw=1.2, color=color, alpha=0.8,
                                 shrinkA=0, shrinkB=0))
    ax.text(mx, my, what, fontsize=7, ha="center", va="center", color=text_color,
            bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.85))


def _rank_label_place(trace, frame, r: int, x: float, y: float, show_values: bool):
    """(x, y, text, ha, va) of rank ``r``'s bytes sent (and values), on the outer side of its
    block, where no arrow runs: above a block at the top, beside one at the sides, below one
    at the bottom."""
    values = []
    if show_values and frame.values is not None and trace.numel <= 8:
        values = [str(v) for v in frame.values[r].tolist()]
    radius = _radius(trace.world_size)
    if abs(x) > 0.7 * radius:  # at a side: a narrow label, values four to a line
        lines = [f"rank {r}:", f"sent {frame.bytes_sent[r]} B"]
        lines += [" ".join(values[i:i + 4]) for i in range(0, len(values), 4)]
        return (x + math.copysign(_BLOCK_W / 2 + 0.06, x), y, "\n".join(lines),
                "left" if x > 0 else "right", "center")
    label = "\n".join([f"rank {r}: sent {frame.bytes_sent[r]} B"] + ([" ".join(values)] if values else []))
    if y > 0:
        return x, y + _BLOCK_H / 2 + 0.14, label, "center", "bottom"
    return x, y - _BLOCK_H / 2 - 0.03, label, "center", "top"


def _rank_label(ax, trace, frame, r: int, x: float, y: float, show_values: bool) -> None:
    lx, ly, label, ha, va = _rank_label_place(trace, frame, r, x, y, show_values)
    ax.text(lx, ly, label, ha=ha, va=va, fontsize=6.5, color=rank_text_color(r))


def _limits(n: int):
    """((x0, x1), (y0, y1)) of a frame's drawing, data units."""
    radius = _radius(n)
    side = 1.25 if n >= 3 else 0.6   # room for the labels beside the side blocks
    return (-radius - side, radius + side), (-radius - 0.6, radius + 0.85)


def _title(trace, frame) -> str:
    total = len(trace.steps())
    return "start: each rank holds only its own data" if frame.number == 0 else \
        f"step {frame.number}/{total}: {frame.phase}"


def draw_frame(ax, trace, frame, show_values: bool = True) -> None:
    """Draw one ``Frame`` of ``trace`` on a matplotlib Axes."""
    from matplotlib.patches import Rectangle

    n = trace.world_size
    pos = _positions(n)
    cw, ch = _BLOCK_W / n, _BLOCK_H
    xlim, ylim = _limits(n)
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_aspect("equal")
    ax.axis("off")
    for r, (x, y) in enumerate(pos):
        left, bottom = x - _BLOCK_W / 2, y - ch / 2
        for c in range(n):
            who = frame.holding[r][c]
            for k in range(n):
                ax.add_patch(Rectangle((left + c * cw, bottom + k * ch / n), cw, ch / n,
                                       facecolor=rank_color(k) if k in who else EMPTY,
                                       edgecolor="none"))
            ax.add_patch(Rectangle((left + c * cw, bottom), cw, ch, fill=False, lw=0.8))
            ax.text(left + (c + 0.5) * cw, bottom + ch + 0.02, f"c{c}", ha="center",
                    va="bottom", fontsize=6, color="0.35")
        _rank_label(ax, trace, frame, r, x, y, show_values)
    for t in frame.transfers:
        _draw_transfer(ax, pos[t.src], pos[t.dst], "all" if t.chunk is None else f"c{t.chunk}",
                       rank_color(t.src), text_color=rank_text_color(t.src))
    ax.set_title(_title(trace, frame), fontsize=8)


MAX_FIGURE_INCHES = 8.0  # 800 px at the inline backend's 100 dpi: a laptop's output area


def plot_ring_trace(trace, columns: int = 4, panel_size: float = 2.6):
    """A static figure: one panel per frame of ``trace`` (start, then every step), at most
    ``columns`` a row and no wider than ``MAX_FIGURE_INCHES`` (a wider PNG is shrunk to the
    output area by the browser, and its words with it)."""
    from matplotlib.figure import Figure

    frames = trace.frames()
    cols = max(1, min(columns, len(frames), int(MAX_FIGURE_INCHES // panel_size)))
    rows = math.ceil(len(frames) / cols)
    fig = Figure(figsize=(panel_size * cols, panel_size * 1.05 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(frames):]:
        ax.axis("off")
    for ax, frame in zip(axes.flat, frames):
        draw_frame(ax, trace, frame)
    fig.suptitle(f"{trace.algorithm}: {trace.world_size} ranks, {trace.numel} elements "
                 f"x {trace.itemsize} B", fontsize=9)
    return fig


def frame_figure(trace, frame, size: float = 4.2):
    """One frame as a matplotlib Figure; ``size``: inches of the 2-rank drawing's height,
    larger rings get proportionally larger figures (the same font size)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 0.93))
    draw_frame(ax, trace, frame)
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    per_unit = size / 3.45  # inches per data unit; 3.45 units: the height of a 2-rank ring
    fig.set_size_inches(per_unit * (x1 - x0), per_unit * (y1 - y0) / 0.93)
    return fig


def render_frame_png(trace, frame, size: float = 4.2, dpi: int = 100) -> bytes:
    """One frame as PNG bytes, at the player's natural size (the player itself shows SVG)."""
    fig = frame_figure(trace, frame, size)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


MAX_WIDTH_PX = 800  # a ring's drawing at most: a notebook's output area on a laptop is ~830 px


def render_frame_svg(trace, frame, size: float = 4.2, dpi: int = 100, show_values: bool = True) -> str:
    """One frame as SVG text, what the player shows: ``draw_frame``'s drawing (the same
    places, colours and words, at ``frame_figure``'s scale and ``dpi``) written directly,
    since a matplotlib PNG per step takes longer than a slider step may."""
    from . import svg

    n = trace.world_size
    (x0, x1), (y0, y1) = _limits(n)
    unit = size / 3.45 * dpi  # pixels per data unit, as frame_figure sizes the figure
    # A ring of 4 or 5 ranks would be ~1,200 px wide, wider than a notebook's output area,
    # where the browser shrinks it and its labels with it: draw it narrower instead, the
    # words at their size (they are placed beside the blocks, which have room for them).
    unit = min(unit, MAX_WIDTH_PX / (x1 - x0))
    pt = dpi / 72  # pixels per point
    fs = 1.25 * pt  # pixels per point of text: the player's words a size larger than the figure's
    head = (1 / 0.93 - 1) * (y1 - y0) * unit  # the title's band: frame_figure's axes fill 93 %

    def px(x, y):
        return (x - x0) * unit, head + (y1 - y) * unit

    pos, cw, ch = _positions(n), _BLOCK_W / n, _BLOCK_H
    parts = []
    for r, (x, y) in enumerate(pos):
        left, bottom = x - _BLOCK_W / 2, y - ch / 2
        for c in range(n):
            who = frame.holding[r][c]
            for k in range(n):
                sx, sy = px(left + c * cw, bottom + (k + 1) * ch / n)
                parts.append(svg.rect(sx, sy, cw * unit, ch / n * unit, rank_color(k) if k in who else EMPTY))
            sx, sy = px(left + c * cw, bottom + ch)
            parts.append(svg.rect(sx, sy, cw * unit, ch * unit, stroke="#000", width=0.8 * pt))
            tx, ty = px(left + (c + 0.5) * cw, bottom + ch + 0.02)
            parts.append(svg.lines(tx, ty, f"c{c}", 6 * fs, "middle", "#595959", "bottom"))
        lx, ly, label, ha, va = _rank_label_place(trace, frame, r, x, y, show_values)
        anchor = {"left": "start", "right": "end", "center": "middle"}[ha]
        parts.append(svg.lines(*px(lx, ly), label, 6.5 * fs, anchor, rank_text_color(r), va))
    for t in frame.transfers:
        a, control, b, middle = _transfer_geometry(pos[t.src], pos[t.dst])
        color = rank_color(t.src)
        parts.append(svg.arrow([px(*a), px(*control), px(*b)], color, 1.2 * pt, 0.8, 10 * pt * 0.9))
        parts.append(svg.lines(*px(*middle), "all" if t.chunk is None else f"c{t.chunk}", 7 * fs, "middle",
                               rank_text_color(t.src), halo=True))
    width, height = (x1 - x0) * unit, head + (y1 - y0) * unit
    parts.append(svg.lines(width / 2, head - 6 * pt, _title(trace, frame), 8 * fs, "middle", va="bottom"))
    return svg.svg(width, height, ['<rect width="100%" height="100%" fill="white"/>'] + parts)


class RingPlayer:
    """An ipywidgets player for a traced all-reduce: play/pause, step slider, N and size.

    make_trace(world_size, numel) -> Trace: called at start and whenever N or the size
    changes; in the course it runs a real traced all-reduce on ranks (drawing itself never
    starts processes). If a later call raises (a closed cluster, a rank error), the player
    shows the error in its ``errors`` output area, keeps the trace it had and stays usable.
    Display the player by leaving it as a cell's last expression.
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
        self.image = w.Image(format="svg+xml")  # SVG the browser draws: see render_frame_svg
        self.view = ErrorView()  # a failed re-run's report, shown under the controls
        self.status, self.errors = self.view.status, self.view.errors
        self.widget = w.VBox([w.HBox([self.play, self.slider]),
                              w.HBox([self.world_size, self.numel]), self.status, self.errors,
                              self.image])
        self.slider.observe(lambda _: self.show(), names="value")
        self.world_size.observe(lambda _: self.changed(), names="value")
        self.numel.observe(lambda _: self.changed(), names="value")
        self.trace, self.frames, self._drawn = None, [], {}
        self.rerun()  # a failure here raises in the cell that creates the player

    def changed(self) -> None:
        """N or numel changed (a widget callback): re-run, and show any error in the widget,
        since an exception raised in a callback reaches only the server's log."""
        self.view.clear()
        try:
            self.rerun()
        except Exception as err:  # noqa: BLE001 -- shown to the learner, nothing is lost
            shown = "the previous trace" if self.trace is not None else "nothing"
            self.view.show(err, f"still showing {shown}; change N or numel to try again")

    def rerun(self) -> None:
        """Record a new trace for the chosen N and size; show its first frame."""
        self.status.value = f"running a traced all-reduce on {self.world_size.value} ranks..."
        trace = self.make_trace(self.world_size.value, self.numel.value)
        self.trace, self.frames, self._drawn = trace, trace.frames(), {}
        self.slider.value = 0
        self.slider.max = self.play.max = len(self.frames) - 1
        self.status.value = (f"{self.trace.algorithm}: {self.trace.world_size} ranks, "
                             f"{self.trace.numel} elements, {len(self.frames) - 1} steps")
        self.show()

    def show(self) -> None:
        """Draw the frame the slider points at, at its natural size."""
        from .svg import show_svg

        k = min(self.slider.value, len(self.frames) - 1)
        if k not in self._drawn:
            self._drawn[k] = render_frame_svg(self.trace, self.frames[k])
        show_svg(self.image, self._drawn[k])

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
