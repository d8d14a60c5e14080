"""4.1b's alpha-beta cells, executed as stored on real ranks, with the all-reduce timings the
first cell receives replaced: by exact alpha-beta times (the fit must recover alpha and beta)
and by noise-dominated ones (larger messages faster than small ones), which the fit refuses
while the next cell still runs.
"""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import nbformat  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import dpcourse as dpc  # noqa: E402
from dpcourse.collectives.cost import ring_all_reduce_seconds  # noqa: E402

pytestmark = pytest.mark.timeout(240)
NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "4.1b-ring-fsdp-and-memory.ipynb"
NOISE = {4096: 3e-3, 1 << 14: 1e-3, 1 << 16: 2e-3, 1 << 18: 5e-4, 1 << 20: 8e-4, 1 << 22: 4e-4}


class ReplacedTimings:
    """The real cluster, except that the notebook's all-reduce timings come back as given."""

    def __init__(self, cluster, times):
        self.cluster, self.world_size, self.times = cluster, cluster.world_size, times

    def run(self, fn, *args, **kwargs):
        if getattr(fn, "__name__", "") == "time_all_reduce":  # the notebook's own timing function
            return [dict(self.times)] * self.world_size
        return self.cluster.run(fn, *args, **kwargs)


def cell(cell_id: str) -> str:
    return next(c.source for c in nbformat.read(NOTEBOOK, 4).cells if c.get("id") == cell_id)


def run_cells(cluster, times, ids):
    import time

    import torch.distributed as dist

    rows = [{"kind": k, "bucket_cap_mb": c, "collectives": 1, "step_s": 0.01, "exposed_s": 0.002}
            for k in ("BucketedDDP", "torch DDP") for c in (0.05, 1)]
    ns = {"dpc": dpc, "torch": torch, "dist": dist, "time": time, "cluster": ReplacedTimings(cluster, times),
          "rows": rows, "caps": [0.05, 1]}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for cell_id in ids:
            exec(cell(cell_id), ns)  # noqa: S102 -- the notebook's own cells
    return ns, out.getvalue()


def test_the_fit_recovers_alpha_and_beta_of_exact_timings(cluster2):
    alpha, beta, n = 70e-6, 2.5e9, cluster2.world_size
    exact = {s: 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / beta for s in NOISE}
    assert exact[1 << 22] == pytest.approx(ring_all_reduce_seconds(1 << 22, n, alpha, beta))
    ns, text = run_cells(cluster2, exact, ["nb41-ring-15"])
    assert ns["alpha"] == pytest.approx(alpha, rel=1e-6) and ns["beta"] == pytest.approx(beta, rel=1e-6)
    shown = re.search(r"alpha = (\d+) us per message, beta = ([\d.]+) GB/s", text)
    assert shown and shown.groups() == ("70", "2.50"), text


def test_noise_dominated_timings_are_refused_and_the_sweep_cell_still_runs(cluster2):
    ns, text = run_cells(cluster2, NOISE, ["nb41b-setup-2", "nb41-ring-15", "nb41-ring-19"])
    assert ns["alpha"] is None and ns["beta"] is None and ns["predicted"] is None
    assert "no alpha-beta fit from these timings: larger messages did not take longer" in text
    assert "no alpha-beta prediction" in text
    ax = matplotlib.pyplot.gcf().axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels and not any("alpha-beta" in label for label in labels)  # measured lines only
    matplotlib.pyplot.close("all")
