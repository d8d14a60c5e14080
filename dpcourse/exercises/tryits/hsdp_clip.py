"""4.2g's try-it ``hsdp_clip``: HSDP on a 2-D mesh, the gradients clipped across it. Its set-up on
the ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch.distributed as dist

from ... import models
from ...grading.compare import close
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .compile_meshes import TIMEOUT, one_process
from .shared import fsdp_imports, full, plural

CLIP_MODEL, CLIP_BATCH, MAX_NORM = "mlp", 8, 0.1   # the MLP's first gradient norm is ~0.5: clipping acts
NORM_RTOL = 1e-5


def _clip_on_rank(hsdp_clipped):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset(CLIP_MODEL, CLIP_BATCH * world).tensors
    mine = slice(rank * CLIP_BATCH, (rank + 1) * CLIP_BATCH)
    model = models.build_model(CLIP_MODEL, seed=0)
    shard_size = 2 if world % 2 == 0 else world   # HSDP where the ranks pair up, FSDP over 3
    norm = hsdp_clipped(model, lambda m: models.loss_fn(CLIP_MODEL, m(x[mine]), y[mine]), MAX_NORM, shard_size, "cpu")
    params = dict(model.named_parameters())
    shards = [p for p in params.values() if isinstance(p, DTensor)]
    meshes = sorted({tuple(p.device_mesh.shape) for p in shards})
    placements = sorted({", ".join(map(repr, p.placements)) for p in shards})
    hsdp = bool(shards) and all(tuple(p.placements) == (Replicate(), Shard(0)) for p in shards)
    missing = [n for n, p in params.items() if p.grad is None]
    grads = {n: full(p.grad) for n, p in params.items() if p.grad is not None}
    _, want, want_norm = one_process(CLIP_MODEL, x, y, MAX_NORM)
    try:
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    except (TypeError, ValueError, RuntimeError):
        norm = None
    return {"world": world, "shard_size": shard_size, "plain": len(params) - len(shards), "meshes": meshes, "placements": placements, "hsdp": hsdp,
            "norm": norm, "want_norm": want_norm, "missing": missing,
            "grads_close": not missing and close([grads[k] for k in want], list(want.values())),
            "ratio": (sum(float(g.norm()) ** 2 for g in grads.values()) ** 0.5) / want_norm if grads else 0.0}


@try_it("hsdp_clip", "4.2g", "HSDP on a 2-D mesh, the gradients clipped across it")
@on_ranks(_clip_on_rank, "parameters sharded over shard_size ranks and replicated over the rest (a 2-D mesh)",
          "the returned norm is the whole model's gradient norm", "the gradients are clipped as one process clips them",
          timeout=TIMEOUT, warm_up=fsdp_imports)
def check_hsdp_clip(report: Report, got: list, mesh, norm, clipped) -> None:
    r = got[0]
    n, s = r["world"], r["shard_size"]
    if r["plain"]:
        report.add(mesh, False, f"{plural(r['plain'], 'parameter')} stayed plain tensors: every rank holds them "
                   "whole and nothing reduces their gradients. Which call takes the parameters no block holds?")
    elif r["meshes"] == [(n // s, s)] and r["hsdp"]:
        report.add(mesh, True)
    elif all(len(m) == 1 for m in r["meshes"]):
        report.add(mesh, False, f"the parameters live on a 1-D mesh of {r['meshes'][0][0]} ranks, placed as "
                   f"{', '.join(r['placements'])}: every rank holds 1/{r['meshes'][0][0]} of them and every gather "
                   "spans all ranks, which is FSDP, not HSDP. How many axes has an HSDP mesh, and what does each do?")
    else:
        shape = " x ".join(str(s) for s in r["meshes"][0])
        report.add(mesh, False, f"the mesh is {shape} ranks with the parameters placed as {', '.join(r['placements'])}"
                   f": each rank holds 1/{r['meshes'][0][-1]} of each parameter, where a shard group is {s} ranks. "
                   "Which axis of the mesh shards, which replicates, and how long is each?")
    if r["norm"] is None:
        report.add(norm, False, "the function returned no number: what does clip_grad_norm_ hand back, and how "
                   "does a DTensor become a float?")
    elif abs(r["norm"] - r["want_norm"]) <= NORM_RTOL * r["want_norm"]:
        report.add(norm, True)
    else:
        report.add(norm, False, f"it returned {r['norm']:.4g} where one process's gradients have a total norm of "
                   f"{r['want_norm']:.4g}: was it computed from every rank's slices of every gradient, before "
                   "clipping?")
    if r["missing"]:
        report.add(clipped, False, f"{plural(len(r['missing']), 'parameter')} ({', '.join(r['missing'][:2])}) have "
                   "no gradient: did the loss's backward run on the sharded model?")
    elif all(x["grads_close"] for x in got):
        report.add(clipped, True)
    else:
        report.add(clipped, False, f"the gradients differ from one process's clipped gradients (their norm is "
                   f"{r['ratio']:.3g} times one process's norm before clipping): were the gradients the norm "
                   "was taken of the ones scaled down?")
