"""4.2c's try-it ``checkpointing``: checkpoint blocks [1, 2, 5] of 8, no others. Its set-up on the
ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ... import models
from ...backends import rank_device
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .large_models import TIMEOUT, judge_same, plain_name, shard_blocks
from .shared import full

DEPTH, CHOSEN = 8, [1, 2, 5]      # MLP blocks, and those the learner checkpoints
AC_SAMPLES = 64                   # per rank: enough for activations to show


class _Recompute(nn.Module):
    """The checker's own checkpointing (public ``torch.utils.checkpoint``), for the two extremes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


def _ac_data():
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset("mlp", AC_SAMPLES * world).tensors
    mine = slice(rank * AC_SAMPLES, (rank + 1) * AC_SAMPLES)
    return x, y, mine


def _saved_bytes(model, x, y) -> int:
    """Bytes saved for backward when backward begins, with the model's blocks and root sharded."""
    from ...observe import Activations

    device = rank_device()
    shard_blocks(model)
    activations = Activations()
    with activations:
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
    return activations.result()["at_backward"][0]


def _checkpointing_on_rank(checkpoint_some):
    device = rank_device()
    x, y, mine = _ac_data()
    none = _saved_bytes(models.build_model("mlp", depth=DEPTH).to(device), x[mine], y[mine])
    every = models.build_model("mlp", depth=DEPTH).to(device)
    for i in range(DEPTH):
        every.blocks[i] = _Recompute(every.blocks[i])
    every = _saved_bytes(every, x[mine], y[mine])

    model = models.build_model("mlp", depth=DEPTH).to(device)
    modules = {"root": model, **{i: block for i, block in enumerate(model.blocks)},
               **{n: m for n, m in model.named_modules() if n.startswith("blocks.") and n.count(".") > 1}}
    calls = {k: 0 for k in modules}
    hooks = [m.register_forward_pre_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
             for k, m in modules.items()]
    returned = checkpoint_some(model, list(CHOSEN))
    model = returned if isinstance(returned, nn.Module) else model
    saved = _saved_bytes(model, x[mine], y[mine])       # one forward and one backward
    for hook in hooks:
        hook.remove()
    grads = {plain_name(n): full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    one = models.build_model("mlp", depth=DEPTH)
    F.mse_loss(one(x), y).backward()
    return {"none": none, "every": every, "saved": saved, "calls": calls, "grads": grads,
            "want": {n: p.grad for n, p in one.named_parameters()}}


@try_it("checkpointing", "4.2c", f"checkpoint blocks {CHOSEN} of {DEPTH}, no others")
@on_ranks(_checkpointing_on_rank, "exactly the chosen blocks run their forward again in backward",
          "bytes saved for backward: as for the chosen blocks", "gradients equal one process's without checkpointing",
          timeout=TIMEOUT)
def check_checkpointing(report: Report, got: list, which, saved, grads) -> None:
    r = got[0]
    calls = r["calls"]
    again = [i for i in range(DEPTH) if calls[i] > 1]
    if calls["root"] > 1:
        report.add(which, False, "the whole model ran its forward a second time during backward: the "
                                 "checkpoint was put around the model itself, so every block's insides "
                                 "were recomputed. Which modules should be wrapped?")
    elif again == CHOSEN and all(calls[i] == 2 for i in CHOSEN):
        report.add(which, True)
    elif not again and any(calls[k] > 1 for k in calls if isinstance(k, str) and k != "root"):
        inner = sorted(k for k in calls if isinstance(k, str) and k != "root" and calls[k] > 1)
        report.add(which, False, f"no block ran its forward again in backward, but modules inside them did "
                                 f"({', '.join(inner)}): the wrong modules were checkpointed, smaller ones "
                                 "than the blocks. Which modules did the selection accept?")
    elif not again:
        report.add(which, False, "no block ran its forward again in backward: nothing was checkpointed. "
                                 "Did the selection accept any module? A check_fn is called with modules, "
                                 "not indices; a wrapper counts only where it replaces the block in the model.")
    else:
        report.add(which, False, f"blocks {again} ran their forward again in backward: the selection "
                                 "accepted other modules than the chosen blocks. Which modules did it "
                                 "accept?")
    k, depth = len(CHOSEN), DEPTH
    per_block = (r["none"] - r["every"]) / depth
    expected = r["none"] - k * per_block
    as_many = round((r["none"] - r["saved"]) / per_block) if per_block > 0 else 0
    if r["every"] < r["saved"] < r["none"] and abs(r["saved"] - expected) <= 0.02 * per_block:
        report.add(saved, True)
    elif r["saved"] >= r["none"]:
        report.add(saved, False, f"{r['saved']:,} bytes were saved when backward began, as many as with no "
                                 "block checkpointed: every block kept its insides for backward")
    elif r["saved"] < r["every"]:
        report.add(saved, False, f"{r['saved']:,} bytes were saved when backward began, fewer than with all "
                                 f"{depth} blocks checkpointed ({r['every']:,}): something larger than a "
                                 "block kept only its input")
    elif r["saved"] == r["every"]:
        report.add(saved, False, f"{r['saved']:,} bytes were saved when backward began, as with all {depth} "
                                 "blocks checkpointed: blocks that were not chosen kept only their input too")
    else:
        blocks = f"{as_many} checkpointed block{'s' if as_many != 1 else ''}"
        report.add(saved, False, f"{r['saved']:,} bytes were saved when backward began: the saving of about "
                                 f"{blocks} ({r['none']:,} with none, {r['every']:,} with all {depth}). "
                                 "How many blocks were chosen?")
    judge_same(report, grads, r["grads"], r["want"], "they differ", "a recomputed forward must give the "
                "same gradients. Was anything else changed in the model?")
