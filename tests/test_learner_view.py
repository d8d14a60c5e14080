"""What a new learner sees, in either JupyterLab theme: drawings in the theme's colours, figures
no wider than the output area, a calculator that says why a row is missing, collectives in
colours of their own, words in a rank's colour that read on white, and no red block for a line
that means nothing. (tests/test_browser.py looks at the same in a browser.)"""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import torch

import dpcourse as dpc
from dpcourse.collectives.schedule import simulate
from dpcourse.pool.kernel.printer import RankPrinter, harmless
from dpcourse.tracking.tracker import C10D_OPS
from dpcourse.viz import calculator, ring, svg
from dpcourse.viz.colors import KIND_COLORS

from conftest import wait_gone

THEME_VAR = re.compile(r"var\(--jp-[\w-]+, #[0-9a-f]{3,6}\)")


def _texts(markup: str) -> list[ET.Element]:
    root = ET.fromstring(re.search(r"<svg.*</svg>", markup, re.S).group(0))
    return [e for e in root.iter() if e.tag.endswith("text")]


def test_the_calculators_words_and_lines_follow_the_theme():
    calc = calculator.MemoryCalculator(**calculator.ZERO_PRESET)
    chart = calc.chart.value
    texts = _texts(chart)
    assert len(texts) > 10  # strategy names, ticks, the axis title
    for element in texts:
        assert "fill" not in element.attrib and THEME_VAR.search(element.get("style", "")), ET.tostring(element)
    assert not re.search(r'(fill|stroke)="#(000|222|444)"', chart), "a fixed black or grey is left"
    assert "color:var(--jp-ui-font-color1" in chart  # the legend's words
    assert "max-width:720px" in chart and "max-width:100%;height:auto" in chart  # shrinks to the output area
    calc.world_size.value = 1
    assert "does not fit" in calc.text.value and "var(--jp-error-color1" in calc.text.value


def test_the_calculator_says_why_the_hybrid_row_is_absent():
    calc = calculator.MemoryCalculator(**calculator.ZERO_PRESET)
    listed = lambda: [r["strategy"] for r in calc.rows]  # noqa: E731
    assert "HYBRID_SHARD" in listed() and "HYBRID_SHARD is not listed" not in calc.verdict
    for world, why in ((1, "shard_group_size=8 does not divide world_size=1"),
                       (12, "shard_group_size=8 does not divide world_size=12"),
                       (8, "shard_group_size=8 leaves one replica on 8 ranks")):
        calc.world_size.value = world
        assert "HYBRID_SHARD" not in listed()
        assert f"HYBRID_SHARD is not listed: {why}" in calc.verdict and f"on {world} rank" in calc.verdict


def test_an_svg_in_an_image_gets_the_light_themes_paper():
    """An <img> sees none of the page's CSS: its theme colours fall back to the light theme's,
    so it is drawn on white, never dark text on a dark page."""
    import ipywidgets as w

    image = w.Image(format="svg+xml")
    svg.show_svg(image, svg.svg(100, 50, [svg.text(5, 5, "words")]))
    shown = bytes(image.value).decode()
    assert shown.count('<rect width="100%" height="100%" fill="white"/>') == 1
    assert (image.layout.width, image.layout.max_width, image.layout.height) == ("100%", "100px", "auto")
    trace = simulate("ring_all_reduce", 2, 8, 8)
    svg.show_svg(image, ring.render_frame_svg(trace, trace.frames()[1]))
    assert bytes(image.value).decode().count('height="100%" fill="white"') == 1  # the ring has its own


def test_a_ring_of_any_size_fits_an_output_area_with_words_of_a_readable_size():
    for n in range(2, 9):
        trace = simulate("ring_all_reduce", n, 2 * n, 8, [torch.arange(2 * n) + 100 * r for r in range(n)])
        drawn = ring.render_frame_svg(trace, trace.frames()[1])
        width, _ = svg.svg_size(drawn)
        assert width <= ring.MAX_WIDTH_PX, (n, width)
        sizes = [float(e.get("font-size")) for e in _texts(drawn)]
        assert min(sizes) >= 10, (n, min(sizes))  # CSS pixels, drawn at its natural size
        figure = ring.plot_ring_trace(trace)
        assert figure.get_size_inches()[0] <= ring.MAX_FIGURE_INCHES + 1e-9, (n, figure.get_size_inches())


def test_every_collective_has_a_colour_of_its_own_and_none_is_grey():
    collectives = set(C10D_OPS.values())
    assert collectives <= set(KIND_COLORS), collectives - set(KIND_COLORS)
    colours = [KIND_COLORS[c] for c in collectives]
    assert len(set(colours)) == len(colours)
    compute = {KIND_COLORS[k] for k in ("forward", "backward", "optimizer", "wait")}
    assert not compute & set(colours)
    for c in collectives:
        r, g, b = (int(KIND_COLORS[c][i:i + 2], 16) for i in (1, 3, 5))
        assert max(r, g, b) - min(r, g, b) > 40, f"{c} is drawn in a grey"


def test_kinetos_tracepoint_lines_are_not_shown_and_other_lines_are(capsys):
    usdt = "USDT:2026-12-04 02:29:46 11335:11335 SyncActivityProfilerHandler.cpp:52] profiler_start"
    assert harmless(usdt) and harmless(usdt.replace("start", "stop"))
    assert not harmless("USDT: keep me") and not harmless("[W reducer.cpp:1] Warning: find_unused_parameters")
    printer = RankPrinter(2, color=False)
    printer.feed(0, "stderr", usdt + "\nrank zero speaks\n")
    printer.feed(1, "stdout", usdt + "\n")  # only stderr is sifted
    said = capsys.readouterr()
    assert said.err == "[rank 0] rank zero speaks\n" and said.out == f"[rank 1] {usdt}\n"


def _profile():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):
        torch.ones(8).sum()
    return "profiled"


def test_on_real_ranks_the_profiler_shows_no_tracepoint_line(capfd):
    """torch.profiler on the ranks: Kineto's "USDT: ... profiler_start" lines are not shown."""
    cluster = dpc.Cluster(world_size=2, current=False)
    try:
        assert cluster.run(_profile, timeout=60) == ["profiled", "profiled"]
    finally:
        pids = cluster.pids + [cluster.launcher_pid]
        cluster.shutdown()
    assert wait_gone(pids) == []
    assert "USDT" not in capfd.readouterr().err


def test_words_in_a_ranks_colour_read_on_the_figures_white():
    from dpcourse.viz.colors import TEXT_CONTRAST, _luminance, rank_color, rank_text_color

    for rank in range(10):
        text = rank_text_color(rank)
        rgb = [int(text[i:i + 2], 16) for i in (1, 3, 5)]
        assert 1.05 / (_luminance(rgb) + 0.05) >= TEXT_CONTRAST, (rank, text)
        assert text == rank_color(rank) or 1.05 / (_luminance(
            [int(rank_color(rank)[i:i + 2], 16) for i in (1, 3, 5)]) + 0.05) < TEXT_CONTRAST  # darkened only if needed
    trace = simulate("ring_all_reduce", 2, 8, 8)
    drawn = ring.render_frame_svg(trace, trace.frames()[1])
    assert "fill:#b85b0a" in drawn and "fill:#ff7f0e" not in drawn  # rank 1's words, not its blocks
