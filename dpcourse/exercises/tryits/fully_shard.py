"""4.2b's try-it ``fully_shard``: a transformer under fully_shard: only the last block kept
gathered for backward. Its set-up on the ranks, its items and the mistakes it names."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ... import models
from ...grading.compare import close, scale_of
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .fsdp import TIMEOUT
from .shared import Collectives, fsdp_imports, full, plural

SHARD_MODEL, SHARD_BATCH, SHARD_LR = "transformer", 4, 0.1   # samples per rank, SGD's lr


def one_sgd_step(name: str, x, y) -> dict[str, torch.Tensor]:
    """One process: one SGD step on the whole global batch (the ground truth)."""
    model = models.build_model(name, seed=0)
    models.loss_fn(name, model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=SHARD_LR).step()
    return {k: v.detach() for k, v in model.named_parameters()}


def _fully_shard_on_rank(shard):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset(SHARD_MODEL, SHARD_BATCH * world).tensors
    mine = slice(rank * SHARD_BATCH, (rank + 1) * SHARD_BATCH)
    model = models.build_model(SHARD_MODEL, seed=0)
    names = {id(m): n for n, m in model.named_modules()}
    blocks = [names[id(b)] for b in model.blocks]
    sharded = shard(model, "cpu")
    sharded = model if sharded is None else sharded
    params = dict(model.named_parameters())
    plain = [n for n, p in params.items() if not isinstance(p, DTensor)]
    meshes = {p.device_mesh.size() for p in params.values() if isinstance(p, DTensor)}
    placements = {tuple(p.placements) for p in params.values() if isinstance(p, DTensor)}
    shown = ", ".join(sorted({str(tuple(map(str, pl))) for pl in placements}))
    units = [names.get(id(m), "?") for m in model.modules() if isinstance(m, FSDPModule)]
    optimizer = torch.optim.SGD(model.parameters(), lr=SHARD_LR)
    with Collectives() as seen:
        seen.phase = "forward"
        with warnings.catch_warnings():   # the transformer's output is a view: harmless here
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            loss = models.loss_fn(SHARD_MODEL, sharded(x[mine]), y[mine])
        # between forward and backward: a block holding plain tensors kept its gathered parameters
        gathered = [i for i, b in enumerate(model.blocks)
                    if any(not isinstance(p, DTensor) for p in b.parameters())]
        seen.phase = "backward"
        loss.backward()
        seen.phase = "step"
        optimizer.step()
    weights = {n: full(p) for n, p in params.items()}
    return {"plain": plain, "meshes": sorted(meshes), "sharded_dim0": placements <= {(Shard(0),)}, "placements": shown,
            "units": units, "blocks": blocks, "gathered": gathered, "forward": seen.count("all_gather", "forward"),
            "backward": seen.count("all_gather", "backward"), "world": world,
            "weights": weights, "want": one_sgd_step(SHARD_MODEL, x, y)}


@try_it("fully_shard", "4.2b", "a transformer under fully_shard: only the last block kept gathered for backward")
@on_ranks(_fully_shard_on_rank, "every parameter is a DTensor shard over all ranks",
          "one unit per block, then the root",
          "only the last block keeps its gathered parameters from forward to backward",
          "one SGD step equals one process's on the global batch", timeout=TIMEOUT, warm_up=fsdp_imports)
def check_fully_shard(report: Report, got: list, sharded, units, kept, step) -> None:
    r = got[0]
    if r["plain"]:
        shown = ", ".join(r["plain"][:3]) + (", ..." if len(r["plain"]) > 3 else "")
        report.add(sharded, False, f"{plural(len(r['plain']), 'parameter')} ({shown}) stayed plain tensors: "
                   "every rank holds them whole, and nothing averages their gradients over the ranks. "
                   "Which call takes the parameters no block holds?")
    elif r["meshes"] != [r["world"]] or not r["sharded_dim0"]:
        report.add(sharded, False, f"the parameters are DTensors on a mesh of {'/'.join(map(str, r['meshes']))} "
                   f"rank(s), placed as {r['placements']}: does each of the {r['world']} ranks hold a slice of "
                   "every parameter? How many dimensions has the mesh, over how many ranks?")
    else:
        report.add(sharded, True)
    unit_names = sorted("the root" if u == "" else u for u in r["units"])
    if sorted(r["units"]) == sorted([""] + r["blocks"]) and r["forward"] == len(r["units"]):
        report.add(units, True)
    elif r["forward"] == 1:
        report.add(units, False, f"forward all-gathered the parameters in a single collective: the model is "
                   f"one unit ({', '.join(unit_names)}), gathered whole, so every rank holds all of it at once. "
                   "What makes a block a unit of its own, and in which order?")
    else:
        report.add(units, False, f"forward ran {plural(r['forward'], 'all-gather')}, one per unit; the units are "
                   f"{', '.join(unit_names) or 'none'}: a unit is a module sharded on its own, and it takes the "
                   "parameters no unit below it holds. Which modules are to be units?")
    last, n = len(r["blocks"]) - 1, len(r["blocks"])
    held = ", ".join(f"block {i}" for i in r["gathered"]) or "none"
    if r["gathered"] == [last] and r["backward"] == n - 1:
        report.add(kept, True)
    elif any(i != last for i in r["gathered"]):
        report.add(kept, False, f"between forward and backward these blocks still held their gathered "
                   f"parameters: {held}. A block other than the last keeps them in memory through every later "
                   "block's forward and backward, the peak FSDP is meant to avoid. Whose backward follows its "
                   "forward at once, so that keeping them saves a gather and costs nothing?")
    else:
        report.add(kept, False, f"between forward and backward no block held its gathered parameters, and "
                   f"backward all-gathered {plural(r['backward'], 'time')}: the last block freed them after its "
                   "forward and gathered them again at once for its backward. What tells that one block to "
                   "keep them?")
    if all(close([x["weights"][k] for k in x["want"]], list(x["want"].values())) for x in got):
        report.add(step, True)
    else:
        ratio = scale_of([r["weights"][k] - v for k, v in _initial(SHARD_MODEL).items()],
                       [r["want"][k] - v for k, v in _initial(SHARD_MODEL).items()])
        size = f" (the update is about {ratio:.2g} times the right size)" if abs(ratio - 1) > 0.05 else ""
        report.add(step, False, f"the weights after the step differ from one process's{size}: are all "
                   "parameters' gradients averaged over the ranks?")


def _initial(name: str) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in models.build_model(name, seed=0).named_parameters()}
