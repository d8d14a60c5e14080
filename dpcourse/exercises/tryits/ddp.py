"""4.2a's try-its: DDP written by the learner (checked on the notebook's ranks).

Each checker runs the learner's function on every rank next to a reference computed on the
same rank (one process's gradient of the whole global batch), and judges what happened:
gradients, and what the ranks sent, seen from outside (a counting comm hook, ``Comm``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import models
from ..ranks import RankFailure, run_or_failure
from ..report import Report
from . import try_it

TIMEOUT = 20.0          # seconds for one check's call on the ranks
RTOL, ATOL = 1e-4, 1e-6


def _grads(model) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _global_grads(samples_per_rank: int, world_size: int) -> list[torch.Tensor]:
    """One process: the gradient of the mean loss over every rank's samples (the ground truth)."""
    model = models.build_model("mlp", seed=0)
    x, y = models.make_dataset("mlp", samples_per_rank * world_size).tensors
    F.mse_loss(model(x), y).backward()
    return _grads(model)


def _ratio(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """How many times ``want`` ``got`` is, fitted over all gradients (1.0 when equal)."""
    g, w = torch.cat([t.flatten() for t in got]), torch.cat([t.flatten() for t in want])
    return float((g @ w) / (w @ w).clamp_min(1e-30))


def _same(got, want) -> bool:
    return all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(got, want))


# ---------------------------------------------------------------------------------- no_sync
MICRO_BATCHES, MICRO = 4, 4   # micro-batches per rank and step, samples in each


def _accumulate_on_rank(accumulate):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    share = MICRO_BATCHES * MICRO
    x, y = models.make_dataset("mlp", share * world).tensors
    mine = slice(rank * share, (rank + 1) * share)
    micro_batches = list(zip(x[mine].chunk(MICRO_BATCHES), y[mine].chunk(MICRO_BATCHES)))
    calls = [0]

    def counting(state, bucket):   # DDP's own all-reduce, counted
        calls[0] += 1
        return allreduce_hook(state, bucket)

    one = DDP(models.build_model("mlp", seed=0))       # one synchronised backward: how many buckets
    one.register_comm_hook(None, counting)
    F.mse_loss(one(x[mine]), y[mine]).backward()
    per_sync, calls[0] = calls[0], 0
    one.module.zero_grad()
    with one.no_sync():
        F.mse_loss(one(x[mine]), y[mine]).backward()
    local = _grads(one.module)                          # this rank's own gradient, not averaged

    ddp = DDP(models.build_model("mlp", seed=0))
    ddp.register_comm_hook(None, counting)
    accumulate(ddp, micro_batches)
    return {"calls": calls[0], "per_sync": per_sync, "grads": _grads(ddp.module), "local": local,
            "want": _global_grads(share, world)}


@try_it("no_sync", "4.2a", f"{MICRO_BATCHES} micro-batches per step under DDP, one all-reduce")
def check_no_sync(accumulate, cluster) -> Report:
    report = Report("")
    runs = "runs on every rank"
    got = run_or_failure(cluster, _accumulate_on_rank, accumulate, timeout=TIMEOUT)
    if isinstance(got, RankFailure):
        report.add(runs, False, got.describe(TIMEOUT))
        report.add("DDP all-reduces once per optimizer step", None, "judged once it runs")
        report.add("gradients equal one process's on the global batch", None, "judged once it runs")
        return report
    report.add(runs, True)
    r = got[0]
    syncs = r["calls"] / r["per_sync"]
    if syncs == 1:
        report.add("DDP all-reduces once per optimizer step", True)
    elif syncs == 0:
        report.add("DDP all-reduces once per optimizer step", False,
                   "no all-reduce ran at all: every micro-batch's backward ran with DDP's "
                   "synchronisation switched off, so the ranks' gradients were never averaged")
    else:
        report.add("DDP all-reduces once per optimizer step", False,
                   f"DDP all-reduced the gradients {syncs:g} times for {MICRO_BATCHES} micro-batches: it "
                   "synchronised after micro-batches whose gradients were not final yet. What lets "
                   "backward only add to .grad, without communicating?")
    name = "gradients equal one process's on the global batch"
    if all(_same(x["grads"], x["want"]) for x in got):
        report.add(name, True)
    elif any(_ratio(x["grads"], x["local"]) > 0.5 and not _same(x["local"], x["want"])
             and _same([g / _ratio(x["grads"], x["local"]) for g in x["grads"]], x["local"]) for x in got):
        report.add(name, False, "each rank kept a gradient of its own samples only: the last "
                                "micro-batch's backward must be the one DDP averages over the ranks")
    else:
        ratio = _ratio(r["grads"], r["want"])
        scale = (f"about {ratio:.2g} times the right size: how much should each micro-batch's loss "
                 "count, if the step is to see the mean over all of them?" if abs(ratio - 1) > 0.05
                 else "they differ from it: is every micro-batch's loss part of the gradient, once?")
        report.add(name, False, scale)
    return report
