"""Mixed precision in FSDP, for real: what it sends, what it keeps, what a low-precision
reduction costs in accuracy.

    rows = dpc.train.precision.compare_precisions(cluster, "fully_shard")   # in the kernel
    cluster.run(dpc.train.precision.reduction_error)                          # on the ranks

FSDP1's ``MixedPrecision`` and FSDP2's ``MixedPrecisionPolicy`` keep the sharded fp32
parameters as the master copy, all-gather them in ``param_dtype`` and reduce gradients in
``reduce_dtype`` (by default the parameter dtype). ``TrainConfig(mixed_precision="bf16",
reduce_dtype="fp32")`` is the common recipe: half the bytes for the gathers, full precision
for the sums.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .config import TrainConfig
from .parallel import _DTYPES  # the runner's name -> dtype table


def reduction_error(numel: int = 1 << 16, seed: int = 0, grad_dtype: str = "bf16",
                    reduce_dtypes=("fp32", "bf16")) -> dict[str, float]:
    """On every rank: what reducing in each of ``reduce_dtypes`` costs in accuracy.

    Each rank holds ``numel`` normal values rounded to ``grad_dtype``, as a bf16 backward
    produces them. The error is the RMS error of the all-reduced sum relative to the float64
    sum of those same values, so it counts only the reduction's own rounding;
    ``"rounded_once"`` is the error of storing the exact sum in ``grad_dtype`` once.
    """
    rng = torch.Generator().manual_seed(seed + dist.get_rank())
    g = torch.randn(numel, generator=rng, dtype=torch.float64).to(_DTYPES[grad_dtype])
    exact = g.double()
    dist.all_reduce(exact)

    def error(x):
        return ((x.double() - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()

    out = {}
    for name in reduce_dtypes:
        t = g.to(_DTYPES[name])
        dist.all_reduce(t)
        out[name] = error(t)
    out["rounded_once"] = error(exact.to(_DTYPES[grad_dtype]))
    return out


@dataclasses.dataclass(frozen=True)
class PrecisionRun:
    """One configuration's figures on rank 0: bytes of one step by collective (measured and
    ``volume``'s theory at these dtypes), model states at rest, peak, and the largest loss
    difference from fp32 single-process training over the run."""

    label: str
    measured: dict
    theory: dict
    at_rest: dict
    peak_bytes: int
    loss_difference: float


def compare_precisions(cluster, strategy: str = "fully_shard", recipes=(("fp32", None), ("bf16", None),
                       ("bf16", "fp32")), hooks=(), **options) -> list[PrecisionRun]:
    """Train ``strategy`` on ``cluster`` in each (mixed_precision, reduce_dtype) recipe.

    hooks: extra step hooks whose metrics the caller reads (the memory probe lives outside
    ``dpcourse.train``: pass ``dpc.memory.MemoryProbe()`` for ``at_rest`` and ``peak_bytes``)."""
    from .measure import CommMeter
    from .runner import train, train_single_process

    base = TrainConfig(**{"steps": 6, "batch_size": 8, "num_samples": 128, "progress": False, **options,
                          "strategy": strategy})
    reference = train_single_process(base, cluster.world_size)["losses"]
    rows = []
    for param_dtype, reduce_dtype in recipes:
        cfg = dataclasses.replace(base, mixed_precision=param_dtype, reduce_dtype=reduce_dtype)
        m = cluster.run(train, cfg, [CommMeter(), *hooks], timeout=180)[0]
        memory = m.get("memory") or {}
        label = param_dtype + (f", reduce {reduce_dtype}" if reduce_dtype else "")
        rows.append(PrecisionRun(label, m["comm"]["measured"], {c: int(b) for c, b in m["comm"]["theory"].items()},
                                 memory.get("at_rest", {}), memory.get("peak_bytes", 0),
                                 max(abs(a - b) for a, b in zip(m["losses"], reference))))
    return rows
