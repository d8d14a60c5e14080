"""4.1's alpha-beta cells when the fit refuses noise-dominated timings: the next cell still runs.

The two notebook cells are executed as stored, on real ranks; only the all-reduce timings the
first cell receives are replaced by noise-dominated ones (larger messages faster than small
ones), the case ``fit_alpha_beta`` refuses.
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import nbformat  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import dpcourse as dpc  # noqa: E402
import dpcourse.viz.timeline  # noqa: E402,F401

pytestmark = pytest.mark.timeout(240)
NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "4.1-data-parallelism-in-depth.ipynb"
NOISE = {4096: 3e-3, 1 << 14: 1e-3, 1 << 16: 2e-3, 1 << 18: 5e-4, 1 << 20: 8e-4, 1 << 22: 4e-4}


class NoisyTimings:
    """The real cluster, except that all-reduce timings come back dominated by noise."""

    def __init__(self, cluster):
        self.cluster, self.world_size = cluster, cluster.world_size

    def run(self, fn, *args, **kwargs):
        if getattr(fn, "__name__", "") == "time_all_reduce":  # the notebook's own timing function
            return [dict(NOISE)] * self.world_size
        return self.cluster.run(fn, *args, **kwargs)


def cell(cell_id: str) -> str:
    return next(c.source for c in nbformat.read(NOTEBOOK, 4).cells if c.get("id") == cell_id)


def test_noise_dominated_timings_are_refused():
    with pytest.raises(ValueError, match="did not take longer"):
        dpc.collectives.alpha_beta.fit_alpha_beta(NOISE, 2)


def test_the_sweep_cell_runs_without_a_fit(cluster2):
    import time

    import torch.distributed as dist

    rows = [{"kind": k, "bucket_cap_mb": c, "collectives": 1, "step_s": 0.01, "exposed_s": 0.002}
            for k in ("BucketedDDP", "torch DDP") for c in (0.05, 1)]
    ns = {"dpc": dpc, "torch": torch, "dist": dist, "time": time, "cluster": NoisyTimings(cluster2),
          "rows": rows, "caps": [0.05, 1]}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for cell_id in ("nb41-buckets-02", "nb41-ring-15", "nb41-ring-17", "nb41-ring-19"):
            exec(cell(cell_id), ns)  # noqa: S102 -- the notebook's own cells
    text = out.getvalue()
    assert ns["alpha"] is None and ns["beta"] is None and ns["predicted"] is None
    assert "no alpha-beta fit from these timings: larger messages did not take longer" in text
    assert "no alpha-beta prediction" in text
    ax = matplotlib.pyplot.gcf().axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels and not any("alpha-beta" in label for label in labels)  # measured lines only
    matplotlib.pyplot.close("all")
