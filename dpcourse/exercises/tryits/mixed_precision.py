"""4.2b's try-it ``mixed_precision``: fully_shard with bf16 blocks and an fp32 head. Its set-up on
the ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ... import models
from ...grading.judging import RankFailure, on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .fsdp import TIMEOUT
from .fully_shard import SHARD_LR, one_sgd_step
from .shared import Collectives, fsdp_imports, full, plural

MP_BATCH = 8          # samples per rank
# One SGD step (lr SHARD_LR) computed in bf16 moves the MLP's weights by ~1e-3 of the fp32
# step at most (bf16 keeps 8 bits: relative rounding 2**-8 on gradients of size ~0.1);
# measured here: 2e-5. A step in fp32 is within 1e-6.
MP_TOLERANCE = 1e-3


def _mixed_on_rank(shard):
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset("mlp", MP_BATCH * world).tensors
    mine = slice(rank * MP_BATCH, (rank + 1) * MP_BATCH)
    model = models.build_model("mlp", seed=0)
    blocks = len(model.blocks)
    mesh = init_device_mesh("cpu", (world,))
    sharded = shard(model, mesh)
    sharded = model if sharded is None else sharded
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=SHARD_LR)
    with Collectives() as seen:
        seen.phase = "forward"
        out = sharded(x[mine])
        seen.phase = "backward"
        models.loss_fn("mlp", out, y[mine]).backward()
        optimizer.step()
    gathers = [d for p, c, d in seen.seen if c == "all_gather" and p == "forward"]
    weights = {n: full(p) for n, p in params.items()}
    want = one_sgd_step("mlp", x, y)
    return {"blocks": blocks, "gathers": gathers, "reduce": sorted(seen.dtypes("reduce_scatter")),
            "output": str(out.dtype).replace("torch.", ""),
            "difference": max((weights[k].float() - v).abs().max().item() for k, v in want.items())}


def _dtype_refused(failure: RankFailure, world_size: int) -> str:
    """A failed call, said as the mistake behind it where a layer refused another dtype."""
    if "must have the same dtype" not in failure.summary:
        return failure.describe(TIMEOUT)
    return ("a layer was handed activations in one dtype while its weights are in the other (bf16 "
            "against fp32), and refused them: a unit computes in its policy's dtype and hands its output "
            "on in that dtype unless told otherwise. Where does the dtype change, and what dtype should a "
            "block's output leave it in?")


@try_it("mixed_precision", "4.2b", "fully_shard with bf16 blocks and an fp32 head")
@on_ranks(_mixed_on_rank, "each block gathers in bf16, the root's own parameters in fp32",
          "gradients are reduced in fp32", "the model hands back fp32 outputs",
          "one step lands within bf16's rounding of one fp32 process",
          timeout=TIMEOUT, warm_up=fsdp_imports, describe=_dtype_refused)
def check_mixed_precision(report: Report, got: list, gathers, reduced, outputs, one_step) -> None:
    r = got[0]
    bf16, fp32 = r["gathers"].count("bfloat16"), r["gathers"].count("float32")
    if (bf16, fp32) == (r["blocks"], 1):
        report.add(gathers, True)
    elif not r["gathers"]:
        report.add(gathers, False, "forward gathered nothing: were the blocks and the root sharded?")
    elif bf16 == 0:
        report.add(gathers, False, f"forward's {plural(len(r['gathers']), 'all-gather')} all carried float32: "
                   "the blocks computed in full precision. What tells fully_shard the dtype a unit computes in?")
    elif fp32 == 0:
        report.add(gathers, False, f"all {plural(bf16, 'all-gather')} carried bf16, the root's too: its own "
                   "parameters (the head) were to stay fp32. Which units did the bf16 policy reach?")
    else:
        report.add(gathers, False, f"forward gathered {bf16} unit(s) in bf16 and {fp32} in fp32, for "
                   f"{r['blocks']} blocks and the root: which units got which policy?")
    if r["reduce"] == ["float32"]:
        report.add(reduced, True)
    else:
        report.add(reduced, False, f"the reduce-scatters carried {', '.join(r['reduce']) or 'nothing'}: summed over "
                   "the ranks in bf16, small gradients lose their low bits. Which dtype does a reduction "
                   "use unless a policy says otherwise?")
    report.add(outputs, r["output"] == "float32",
               "" if r["output"] == "float32" else f"the model's output was {r['output']}: what does the "
               "root hand back when its own computation is in fp32 but its input came in bf16?")
    if r["difference"] <= MP_TOLERANCE:
        report.add(one_step, True)
    else:
        report.add(one_step, False, f"the weights after one step differ from one fp32 process's by up to "
                   f"{r['difference']:.1e}, far more than bf16's rounding explains: is the same step taken?")
