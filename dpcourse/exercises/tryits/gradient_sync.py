"""4.2f's try-it ``gradient_sync``: micro-batches of 2, 4, 6 samples under fully_shard, one reduce-
scatter. Its set-up on the ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ... import models
from ...grading.compare import close, scale_of
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .fsdp import TIMEOUT as FSDP_TIMEOUT
from .shared import Collectives, fsdp_imports, full

SYNC_SIZES = (2, 4, 6)     # samples in each of a rank's micro-batches: unequal on purpose


def _accumulate_on_rank(accumulate):
    import math as _math

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    share = sum(SYNC_SIZES)
    x, y = models.make_dataset("mlp", share * world).tensors
    mine = slice(rank * share, (rank + 1) * share)
    micro_batches = list(zip(x[mine].split(list(SYNC_SIZES)), y[mine].split(list(SYNC_SIZES))))
    reference = models.build_model("mlp", seed=0)
    models.loss_fn("mlp", reference(x), y).backward()
    want = [p.grad for p in reference.parameters()]
    equal = models.build_model("mlp", seed=0)          # each micro-batch's mean loss counted alike
    for r in range(world):
        rows = slice(r * share, (r + 1) * share)
        for xb, yb in zip(x[rows].split(list(SYNC_SIZES)), y[rows].split(list(SYNC_SIZES))):
            (models.loss_fn("mlp", equal(xb), yb) / (len(SYNC_SIZES) * world)).backward()

    mesh = init_device_mesh("cpu", (world,))
    model = models.build_model("mlp", seed=0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    units = len(model.blocks) + 1
    # the root's reduce-scatter output: its own parameters' (the head's) padded rows on one rank
    root_size = sum(_math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in model.head.parameters())
    with Collectives() as seen:
        # a collective's phase: the micro-batch whose forward ran last (its backward follows it)
        seen.phase = -1
        counting = model.register_forward_pre_hook(lambda _module, _args: setattr(seen, "phase", seen.phase + 1))
        try:
            accumulate(model, micro_batches)
        finally:
            counting.remove()
    sizes = [n for (_, c, _), n in zip(seen.seen, seen.sizes) if c == "reduce_scatter"]
    grads = [torch.zeros(p.shape) if p.grad is None else full(p.grad) for p in model.parameters()]
    return {"reduce_scatter": len(sizes), "root": sum(n == root_size for n in sizes), "units": units,
            "in_micro_batches": sorted({p for p, c, _ in seen.seen if c == "reduce_scatter"}),
            "grads": grads, "want": want, "equal": [p.grad for p in equal.parameters()],
            "empty": all(p.grad is None for p in model.parameters())}


@try_it("gradient_sync", "4.2f", f"micro-batches of {', '.join(map(str, SYNC_SIZES))} samples under fully_shard, "
        "one reduce-scatter")
@on_ranks(_accumulate_on_rank, "FSDP reduce-scatters each unit once per step",
          "gradients equal one process's on the global batch", timeout=FSDP_TIMEOUT, warm_up=fsdp_imports)
def check_gradient_sync(report: Report, got: list, once, same) -> None:
    r = got[0]
    blocks, n = r["units"] - 1, len(SYNC_SIZES)
    root, of_blocks = r["root"], r["reduce_scatter"] - r["root"]
    ran_in = r["in_micro_batches"]   # the micro-batches (from 0) whose backward reduce-scattered
    early = bool(ran_in) and max(ran_in) < n - 1
    if r["reduce_scatter"] == 0:
        report.add(once, False, "no reduce-scatter ran at all: every micro-batch's backward ran with the "
                   "gradient synchronisation off, so the gradients stayed unsharded on each rank, never "
                   "averaged over the ranks. Is synchronisation back on for the last backward?")
    elif (root, of_blocks) == (1, blocks) and ran_in == [n - 1]:
        report.add(once, True)
    elif (root, of_blocks) == (1, blocks):
        which = " and ".join(str(b + 1) for b in ran_in)
        report.add(once, False, f"each unit reduce-scattered once, but in the backward pass of micro-batch {which} "
                   f"of {n}, not of the last: what the later micro-batches added stayed unsharded on each rank, "
                   "never synchronised. The gradient-sync switch governs the next backward pass, the one that "
                   "runs after it is set: it must be set before the backward it applies to.")
    else:
        report.add(once, False, f"for {n} micro-batches the root's unit reduce-scattered {_times(root)} and "
                   f"the {blocks} blocks' units {_times(of_blocks)} in all: a unit that synchronised more than "
                   "once did so for micro-batches whose gradients were not final yet. Which units did the "
                   "switch reach: the root alone, or every unit below it too?")
    if all(close(x["grads"], x["want"]) for x in got):
        report.add(same, True)
    elif r["empty"]:
        report.add(same, False, "the parameters' .grad are empty: FSDP2 keeps the accumulated unsharded "
                   "gradients aside and writes .grad only when a backward reduce-scatters them")
    elif all(close(x["grads"], x["equal"]) for x in got):
        report.add(same, False, f"the gradients are those of the mean of the micro-batches' mean losses, each "
                   f"micro-batch counting alike, although they hold {', '.join(map(str, SYNC_SIZES))} samples: "
                   "a sample in a small micro-batch counted more than one in a large one. How much should "
                   "each micro-batch's mean loss count, if every sample is to count the same?")
    elif early:
        ratio = scale_of(r["grads"], r["want"])
        report.add(same, False, f"about {ratio:.2g} times the right size: they hold only what the micro-batches up to "
                   f"{max(ran_in) + 1} of {n} added when the reduce-scatter ran, not the whole step's gradient "
                   "(see the item above)")
    else:
        ratio = scale_of(r["grads"], r["want"])
        scale = (f"about {ratio:.2g} times the right size: how much should each micro-batch's loss count, "
                 "if the step is to see the mean over all the samples?" if abs(ratio - 1) > 0.05
                 else "they differ from it: is every micro-batch's loss part of the gradient, once, weighted "
                      "by its samples, and reduce-scattered after the last one?")
        report.add(same, False, scale)


def _times(n: int) -> str:
    return {0: "never", 1: "once", 2: "twice"}.get(n, f"{n} times")
