"""4.2c's try-it ``offload_clip``: FSDP2 with CPU offload, gradients clipped to 0.05. Its set-up on
the ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import models
from ...backends import rank_device
from ...grading.compare import close
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .large_models import TIMEOUT, largest_difference
from .shared import full

MAX_NORM, LR, CLIP_SAMPLES = 0.05, 0.1, 16     # the clip, SGD's lr, samples per rank


def _offloaded(module) -> bool | None:
    """Whether FSDP2 keeps ``module``'s shards in CPU memory (None: it shards no parameters)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from ...torch_private import fsdp2_offload_policy

    policy = fsdp2_offload_policy(module)
    return None if policy is None else isinstance(policy, CPUOffloadPolicy)


def _one_process_clip(x, y):
    """One process: the global gradient norm; the weights after a clipped step and an unclipped one."""
    out = {}
    for clip in (True, False):
        one = models.build_model("mlp")
        optimizer = torch.optim.SGD(one.parameters(), lr=LR)
        F.mse_loss(one(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(one.parameters(), MAX_NORM if clip else float("inf"))
        out["norm"] = norm.item()
        if not clip:
            out["grads"] = {n: p.grad.clone() for n, p in one.named_parameters()}
        optimizer.step()
        out["clipped" if clip else "unclipped"] = {n: p.detach().clone() for n, p in one.named_parameters()}
    return out


def _offload_clip_on_rank(clipped_step):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    device, rank, world = rank_device(), dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset("mlp", CLIP_SAMPLES * world).tensors
    mine = slice(rank * CLIP_SAMPLES, (rank + 1) * CLIP_SAMPLES)
    model = models.build_model("mlp").to(device)
    returned = clipped_step(model, x[mine].to(device), y[mine].to(device), MAX_NORM)
    if isinstance(returned, DTensor):
        returned = returned.full_tensor()
    norm = float(returned) if returned is not None else None
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    offloaded = [_offloaded(m) for m in units]
    local_devices = {p.to_local().device.type for p in model.parameters() if isinstance(p, DTensor)}
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    weights = {n: full(p) for n, p in model.named_parameters()} if sharded else None
    one = _one_process_clip(x, y)
    # the norm of this rank's rows of the gradient, as FSDP2 splits it: what a per-rank norm sees
    local_sq = sum(g.chunk(world)[rank].pow(2).sum().item() if len(g.chunk(world)) > rank else 0.0
                   for g in one["grads"].values())
    return {"norm": norm, "one_norm": one["norm"], "local_norm": local_sq ** 0.5, "units": len(units),
            "offloaded": offloaded, "local_devices": sorted(local_devices), "weights": weights,
            "clipped": one["clipped"], "unclipped": one["unclipped"],
            "initial": {n: p.detach().clone() for n, p in models.build_model("mlp").named_parameters()}}


@try_it("offload_clip", "4.2c", f"FSDP2 with CPU offload, gradients clipped to {MAX_NORM}")
@on_ranks(_offload_clip_on_rank, "the norm returned is the norm of all the ranks' gradients together",
          "the step used gradients clipped over all ranks (weights as one process's)",
          "the shards, gradients and optimizer state are kept in CPU memory", timeout=TIMEOUT)
def check_offload_clip(report: Report, got: list, norm, step, offload) -> None:
    r = got[0]
    norms = [x["norm"] for x in got]
    locals_ = [x["local_norm"] for x in got]
    if any(n is None for n in norms):
        report.add(norm, False, "the function returned None: return the total norm that clipping reported")
    elif all(abs(n - r["one_norm"]) <= 1e-4 * r["one_norm"] for n in norms):
        report.add(norm, True)
    elif all(abs(n - m) <= 1e-4 * m for n, m in zip(norms, locals_)):
        report.add(norm, False, f"the ranks returned different norms ({', '.join(f'{n:.4g}' for n in norms)}): "
                                "each the norm of its own shard of the gradients, a part of the whole. "
                                "What must the ranks combine before the norm is known?")
    elif all(abs(n - MAX_NORM) <= 1e-4 for n in norms):
        report.add(norm, False, f"the ranks returned {norms[0]:.4g}, the norm after clipping: clipping "
                                "reports the norm it found before it scaled the gradients")
    else:
        report.add(norm, False, f"the ranks returned {', '.join(f'{n:.4g}' for n in norms)}, not the norm of "
                                "the whole gradient (every rank's shard together)")
    if r["weights"] is None:
        report.add(step, None, "judged once every parameter is sharded")
    elif close(r["weights"], r["clipped"]):
        report.add(step, True)
    elif close(r["weights"], r["initial"]):
        report.add(step, False, "the weights did not change at all: the step moved nothing. fully_shard "
                                "replaces each parameter with a DTensor: which parameters does the "
                                "optimizer hold, and when was it created?")
    elif close(r["weights"], r["unclipped"]):
        report.add(step, False, "the weights are those of a step with unclipped gradients: the gradients "
                                "were scaled too late, or not at all. When does the optimizer read them?")
    else:
        diff = largest_difference(r["weights"], r["clipped"])
        report.add(step, False, f"the weights differ from a clipped step on one process (largest difference "
                                f"{diff:.3g}), and from an unclipped one: were the ranks' shards scaled by "
                                f"different factors? One norm of the whole gradient decides the factor.")
    if not r["units"]:
        report.add(offload, False, "no module was sharded with FSDP2, so there is nothing to offload")
    elif all(x is not False for x in r["offloaded"]) and r["local_devices"] in ([], ["cpu"]):
        report.add(offload, True)
    else:
        kept = sum(x is False for x in r["offloaded"])
        report.add(offload, False, f"{kept} of {r['units']} FSDP units were sharded without offloading: with "
                                   "an accelerator, their shards, gradients and optimizer state would stay "
                                   "in its memory. What tells FSDP2 to keep them in CPU memory, and did "
                                   "every unit get it?")
