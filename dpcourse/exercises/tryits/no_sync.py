"""4.2a's try-it ``no_sync``: 4 micro-batches per step under DDP, one all-reduce. Its set-up on the
ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F

from ... import models
from ...grading.compare import close, scale_of
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .ddp import TIMEOUT, global_grads, grads_of

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
    local = grads_of(one.module)                          # this rank's own gradient, not averaged

    ddp = DDP(models.build_model("mlp", seed=0))
    ddp.register_comm_hook(None, counting)
    accumulate(ddp, micro_batches)
    return {"calls": calls[0], "per_sync": per_sync, "grads": grads_of(ddp.module), "local": local,
            "want": global_grads(share, world)}


@try_it("no_sync", "4.2a", f"{MICRO_BATCHES} micro-batches per step under DDP, one all-reduce")
@on_ranks(_accumulate_on_rank, "DDP all-reduces once per optimizer step",
          "gradients equal one process's on the global batch", timeout=TIMEOUT)
def check_no_sync(report: Report, got: list, once, same) -> None:
    r = got[0]
    syncs = r["calls"] / r["per_sync"]
    if syncs == 1:
        report.add(once, True)
    elif syncs == 0:
        report.add(once, False,
                   "no all-reduce ran at all: every micro-batch's backward ran with DDP's "
                   "synchronisation switched off, so the ranks' gradients were never averaged")
    else:
        report.add(once, False,
                   f"DDP all-reduced the gradients {syncs:g} times for {MICRO_BATCHES} micro-batches: it "
                   "synchronised after micro-batches whose gradients were not final yet. What lets "
                   "backward only add to .grad, without communicating -- and DDP decides that in "
                   "forward: does each micro-batch's forward run where it should?")
    if all(close(x["grads"], x["want"]) for x in got):
        report.add(same, True)
    elif any(scale_of(x["grads"], x["local"]) > 0.5 and not close(x["local"], x["want"])
             and close([g / scale_of(x["grads"], x["local"]) for g in x["grads"]], x["local"]) for x in got):
        report.add(same, False, "each rank kept a gradient of its own samples only: the last "
                                "micro-batch's backward must be the one DDP averages over the ranks")
    else:
        ratio = scale_of(r["grads"], r["want"])
        if abs(ratio - 1) > 0.05:
            detail = (f"about {ratio:.2g} times the right size: how much should each micro-batch's loss "
                      "count, if the step is to see the mean over all of them?")
        elif syncs == 1:
            detail = ("DDP all-reduced once, but not the whole step's gradient: the all-reduce averages "
                      "what .grad holds when it runs, and the micro-batches after it stayed this rank's "
                      "own. After which micro-batch's backward must it run?")
        else:
            detail = "they differ from it: is every micro-batch's loss part of the gradient, once?"
        report.add(same, False, detail)
