"""Rank-labelled output stays readable with many ranks: aligned labels, one colour per rank."""
from __future__ import annotations

import re

import pytest

import dpcourse as dpc
from dpcourse.pool.kernel.printer import RANK_RGB, RankPrinter
from dpcourse.viz.colors import rank_color

pytestmark = pytest.mark.timeout(180)


def test_labels_line_up_whatever_the_world_size():
    assert RankPrinter(2, color=False).label(1) == "[rank 1] "
    wide = RankPrinter(12, color=False)
    assert [wide.label(r) for r in (3, 11)] == ["[rank  3] ", "[rank 11] "]


def test_each_rank_has_its_drawing_colour_as_a_bar_before_a_plain_label():
    printer = RankPrinter(8, color=True)
    for r in range(10):
        assert "#{:02x}{:02x}{:02x}".format(*RANK_RGB[r]) == rank_color(r)
    label = printer.label(3)
    assert label == "\x1b[38;2;214;39;40m\u258c\x1b[0m[rank 3] "
    assert label.endswith("[rank 3] ")  # searching for "[rank 3] text" still finds the line


def test_eight_ranks_printing_at_once_give_whole_labelled_lines(capfd):
    def chatty():
        import torch.distributed as dist

        for i in range(5):
            print(f"line {i} of rank {dist.get_rank()}", flush=True)
            dist.barrier()  # every rank prints each line at the same moment
        return dist.get_rank()

    with dpc.Cluster(world_size=8, timeout=120) as cluster:
        assert cluster.run(chatty) == list(range(8))
    lines = [x for x in capfd.readouterr().out.splitlines() if "line " in x]
    assert len(lines) == 40
    for line in lines:  # one label per line, and it is the rank that wrote the line
        m = re.fullmatch(r"\[rank (\d)\] line (\d) of rank (\d)", line)
        assert m and m.group(1) == m.group(3), line
    for r in range(8):
        assert [int(re.search(r"line (\d)", x).group(1)) for x in lines if x.startswith(f"[rank {r}]")] == list(range(5))
