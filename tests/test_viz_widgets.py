"""The widgets as the browser shows them: natural-size figures, labels clear of arrows, a
player that survives a failing callback, one y-axis for the ledger, a calculator that says
things once and disables what it ignores; every slider and drop-down redraws faster than a
bare matplotlib draw, and its SVG shows what the matplotlib drawing shows."""
from __future__ import annotations

import io
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

import dpcourse as dpc  # noqa: E402
from dpcourse.collectives.schedule import simulate  # noqa: E402
from dpcourse.bench import widgets  # noqa: E402
from dpcourse.memory.ledger import AT_REST  # noqa: E402
from dpcourse.viz import calculator, memory, ring  # noqa: E402
from dpcourse.viz.png import png_size  # noqa: E402
from dpcourse.viz.svg import svg_size  # noqa: E402
from dpcourse.viz.ring import frame_figure  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _trace(n: int, numel: int = 8):
    return simulate("ring_all_reduce", n, numel, 8, [torch.arange(numel) + 100 * r for r in range(n)])


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_labels_stay_clear_of_arrows_and_of_each_other(n):
    trace = _trace(n)
    for frame in trace.frames():
        fig = frame_figure(trace, frame)  # the places the player's SVG shares
        ax = fig.axes[0]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        labels = [t.get_window_extent(renderer) for t in ax.texts if "sent" in t.get_text()]
        tags = [t.get_window_extent(renderer) for t in ax.texts if t.get_bbox_patch() is not None]
        assert len(labels) == n and len(tags) == len(frame.transfers)
        for arrow in (p for p in ax.patches if isinstance(p, FancyArrowPatch)):
            path = arrow.get_transform().transform_path(arrow.get_path())
            points = [pt for poly in path.to_polygons() for pt in poly]
            assert len(points) > 10
            for box in labels:
                assert not any(box.contains(x, y) for x, y in points), (n, frame.number)
        for i, a in enumerate(labels + tags):
            for b in (labels + tags)[i + 1:]:
                assert not a.overlaps(b), (n, frame.number)


def test_png_size_reads_the_header_and_refuses_other_data():
    fig = Figure(figsize=(2, 1))
    fig.add_subplot().plot([0, 1])
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=50)
    assert png_size(buf.getvalue()) == (100, 50)
    with pytest.raises(ValueError, match="not a PNG"):
        png_size(b"GIF89a" + bytes(30))


def test_ring_player_shows_its_picture_at_natural_size_and_survives_a_closed_cluster():
    cluster = dpc.Cluster(world_size=2, timeout=60)
    calls = []

    def traced(world_size, numel):  # the notebook's function, before the fix
        calls.append(numel)
        return dpc.collectives.trace_all_reduce(cluster, numel).trace

    player = dpc.viz.RingPlayer(traced, world_size=2, numel=8)
    width, height = svg_size(bytes(player.image.value).decode())
    assert (player.image.layout.width, player.image.layout.max_width, player.image.layout.height) == (
        "100%", f"{width}px", "auto")  # the output area's width, never more than its own
    shown = bytes(player.image.value)
    cluster.shutdown()
    player.numel.value = 4  # the callback now uses a closed cluster
    assert "ClusterError" in player.status.value and "still showing the previous trace" in player.status.value
    assert "ClusterError" in "".join(o.get("text", "") for o in player.errors.outputs)
    assert player.trace.numel == 8 and bytes(player.image.value) == shown
    player.slider.value = 1  # still usable: the old trace's next step
    assert bytes(player.image.value) != shown

    def traced_fixed(world_size, numel):  # the notebook's function: a fresh cluster when closed
        if not cluster.closed:
            return dpc.collectives.trace_all_reduce(cluster, numel).trace
        with dpc.Cluster(world_size=world_size, timeout=60) as ranks:
            return dpc.collectives.trace_all_reduce(ranks, numel).trace

    player.make_trace = traced_fixed
    player.numel.value = 12
    assert player.trace.numel == 12 and "12 elements" in player.status.value
    assert player.errors.outputs == ()


@pytest.fixture(scope="module")
def measured(cluster2):
    from test_memory_viz import measure

    return measure(cluster2)


def test_ledger_panels_share_one_y_axis_that_holds_every_frame(measured):
    fig = Figure()
    axes = fig.subplots(1, 2)
    configs = memory.configs(*measured)
    for k in (0, 3):
        memory.draw_ledger_frame(axes, configs, k)
        assert axes[0].get_ylim() == axes[1].get_ylim()
    highest = max(sum(f["peak"].values()) for c in configs for r in c for f in r["frames"]) / 1024
    assert highest <= axes[0].get_ylim()[1] < highest * 1.5
    player = memory.LedgerPlayer(*measured)
    assert player.image.layout.max_width == f"{svg_size(bytes(player.image.value).decode())[0]}px"


def test_calculator_disables_what_it_ignores_and_says_a_miss_once():
    calc = calculator.MemoryCalculator(**calculator.ZERO_PRESET)
    assert not calc.billions.disabled and calc.n_layers.disabled
    assert "<svg" in calc.chart.value and "device memory" in calc.chart.value
    calc.apply(world_size=1)
    assert "does not fit with any strategy" in calc.verdict and "on 1 rank," in calc.verdict
    assert "; does not fit:" not in calc.verdict  # no list of every strategy after "any"
    calc.apply(mode="transformer shape")
    assert calc.billions.disabled and calc.num_units.disabled and not calc.n_layers.disabled
    assert calc.preset.layout.width == "auto"


# --- every control answers in 100 ms: SVG the browser draws, not a PNG per step ----------
SVG = "{http://www.w3.org/2000/svg}"


def _svg(markup: str) -> ET.Element:
    return ET.fromstring(re.search(r"<svg.*</svg>", markup, re.S).group(0))


def _words(root) -> list[str]:
    """Each <text>'s words, its lines (tspans) joined by newlines."""
    return ["\n".join(s.text or "" for s in t.iter(f"{SVG}tspan")) or (t.text or "")
            for t in root.iter(f"{SVG}text")]


def test_every_control_of_every_widget_redraws_faster_than_a_bare_matplotlib_draw():
    rows = widgets.measure(repeats=7)
    calc = calculator.MemoryCalculator()
    moved = [r.control for r in rows if r.widget == "MemoryCalculator"]
    assert moved == [name for i in calc.inputs for name, v in vars(calc).items() if v is i] + ["preset button"]
    assert {r.widget for r in rows} == {"MemoryCalculator", "LedgerPlayer", "RingPlayer", "Panel"}
    slow = [f"{r.widget} {r.control}: {r.redraw_ms:.1f} ms vs bare {r.bare_ms:.1f} ms" for r in rows
            if r.ratio >= widgets.RATIO]
    assert not slow, slow


def test_the_widgets_benchmark_prints_both_medians_and_their_ratio():
    out = subprocess.run([sys.executable, "-m", "dpcourse.bench", "widgets", "--repeats", "3"],
                         capture_output=True, text=True, timeout=150).stdout
    rows = re.findall(r"^(\w+) +(.+?) +([\d.]+) +([\d.]+) +([\d.]+)x  (ok|SLOW)$", out, re.M)
    assert len(rows) >= 20, out
    for widget, control, redraw, bare, ratio, verdict in rows:
        assert float(ratio) == pytest.approx(float(redraw) / float(bare), abs=0.002), (widget, control)
        assert (verdict == "ok") == (float(redraw) < 100 and float(ratio) < 0.8)
    assert len({bare for *_, bare, _, _ in rows}) == 1  # one yardstick, drawn in the same run
    assert ("target: every control: ok" in out) == all(v == "ok" for *_, v in rows), out


def test_the_calculators_bars_are_its_ledgers_at_one_scale():
    calc = calculator.MemoryCalculator(**calculator.ZERO_PRESET)
    root = _svg(calc.chart.value)
    bars = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    origin, pairs = calculator._LABELS, []  # pairs: (pixels wide, GB held)
    for row in calc.rows:
        mine = [b for b in bars if b.find(f"{SVG}title").text.startswith(row["strategy"] + ":")]
        held = [row["ledger"].bytes[c] / 1e9 for c in AT_REST if row["ledger"].bytes[c]]
        assert len(mine) == len(held), row["strategy"]
        pairs += [(float(b.get("width")), gb) for b, gb in zip(mine, held)]
        assert float(mine[0].get("x")) == pytest.approx(origin, abs=0.1)
    widest = max(pairs)
    scale = widest[0] / widest[1]  # pixels per GB
    assert [w for w, _ in pairs] == pytest.approx([gb * scale for _, gb in pairs], abs=0.1)
    xs = {float(line.get("x1")) for line in root.iter(f"{SVG}line")}
    for row in calc.rows:  # the black peak tick of every row
        assert any(abs(x - origin - row["peak"] / 1e9 * scale) < 0.2 for x in xs), row["strategy"]
    dashed = [line for line in root.iter(f"{SVG}line") if line.get("stroke") == "red"]
    assert float(dashed[0].get("x1")) == pytest.approx(origin + 32 * scale, abs=0.2)  # 32 GB device
    words = _words(root)
    assert [("" if r["fits"] else "✗ ") + r["strategy"] for r in calc.rows] == \
        [w for w in words if w.lstrip("✗ ") in {r["strategy"] for r in calc.rows}]
    assert "GB per rank (bars: at rest; tick: peak with transients)" in words
    for label in ("parameters", "gradients", "optimizer state", "master weights", "bucket buffers",
                  "device memory"):
        assert f" {label}</span>" in calc.chart.value
    calc.apply(unit="GiB")
    assert "GiB per rank" in calc.chart.value


@pytest.mark.parametrize("n", [3, 5])
def test_the_ring_players_svg_shows_what_draw_frame_draws(n):
    from matplotlib.colors import to_hex
    from matplotlib.patches import Rectangle

    trace = _trace(n)
    for frame in trace.frames()[:3]:
        fig = frame_figure(trace, frame)
        ax = fig.axes[0]
        drawn = sorted([t.get_text() for t in ax.texts] + [ax.get_title()])
        fills = [to_hex(p.get_facecolor()) for p in ax.patches if isinstance(p, Rectangle) and p.get_fill()]
        root = _svg(ring.render_frame_svg(trace, frame))
        assert sorted(_words(root)) == drawn
        shown = [r.get("fill") for r in root.iter(f"{SVG}rect") if r.get("fill") not in ("none", "white")]
        assert shown == fills
        assert len(list(root.iter(f"{SVG}path"))) == len(frame.transfers)


def test_the_ledger_players_svg_stacks_what_draw_ledger_frame_stacks():
    from matplotlib.colors import to_hex

    configs = memory.configs(*widgets.recorded_step())
    fig = Figure()
    axes = fig.subplots(1, 2)
    for k in (0, 4, 8):
        memory.draw_ledger_frame(axes, configs, k)
        bars = [(to_hex(p.get_facecolor()), p.get_height()) for ax in axes for p in ax.patches if p.get_fill()]
        outlines = [p.get_height() for ax in axes for p in ax.patches if not p.get_fill()]
        root = _svg(memory.render_ledger_svg(configs, k))
        rects = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
        shown = [(r.get("fill"), float(r.get("height"))) for r in rects if r.get("fill") != "none"]
        dashed = [float(r.get("height")) for r in rects if r.get("fill") == "none"]
        assert [c for c, _ in shown] == [c for c, _ in bars]
        scale = sum(h for _, h in shown) / sum(h for _, h in bars)
        assert [h for _, h in shown] == pytest.approx([h * scale for _, h in bars], rel=2e-3, abs=0.1)
        assert dashed == pytest.approx([h * scale for h in outlines], rel=2e-3, abs=0.1)
        words = _words(root)
        for ax in axes:
            assert all(line in words for line in ax.get_title().split("\n"))
        assert "theory" in words and words.count("rank 3") == 2
