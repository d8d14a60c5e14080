"""The widgets as the browser shows them: natural-size figures, labels clear of arrows, a
player that survives a failing callback, one y-axis for the ledger, a calculator that says
things once and disables what it ignores."""
from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

import dpcourse as dpc  # noqa: E402
from dpcourse.collectives.schedule import simulate  # noqa: E402
from dpcourse.viz import calculator, memory  # noqa: E402
from dpcourse.viz.png import png_size  # noqa: E402
from dpcourse.viz.ring import frame_figure  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _trace(n: int, numel: int = 8):
    return simulate("ring_all_reduce", n, numel, 8, [torch.arange(numel) + 100 * r for r in range(n)])


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_labels_stay_clear_of_arrows_and_of_each_other(n):
    trace = _trace(n)
    for frame in trace.frames():
        fig = frame_figure(trace, frame)  # what the player shows
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
    width, height = png_size(bytes(player.image.value))
    assert (player.image.layout.width, player.image.layout.height) == (f"{width}px", f"{height}px")
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
    assert player.image.layout.width == f"{png_size(bytes(player.image.value))[0]}px"


def test_calculator_disables_what_it_ignores_and_says_a_miss_once():
    calc = calculator.MemoryCalculator(**calculator.ZERO_PRESET)
    assert not calc.billions.disabled and calc.n_layers.disabled
    assert calc.image.layout.width == f"{png_size(bytes(calc.image.value))[0]}px"
    calc.apply(world_size=1)
    assert "does not fit with any strategy" in calc.verdict and "on 1 rank," in calc.verdict
    assert "; does not fit:" not in calc.verdict  # no list of every strategy after "any"
    calc.apply(mode="transformer shape")
    assert calc.billions.disabled and calc.num_units.disabled and not calc.n_layers.disabled
    assert calc.preset.layout.width == "auto"
