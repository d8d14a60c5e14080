"""4.2g's try-its: FSDP2 with each block compiled, and HSDP on a 2-D mesh with its gradients
clipped across the mesh (checked on the notebook's ranks).

Each checker runs the learner's function on every rank next to a reference computed on the
same rank (one process on the whole global batch), and judges what happened: the units and
the parameters' placements, the graphs ``torch.compile`` handed its backend (the check passes
a backend that records them and runs each as it was captured), the parameters' names, the
norm returned and the gradients after clipping.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ... import models
from ..ranks import RankFailure
from ..report import Report
from . import on_ranks, try_it
from .fsdp import _close, _full, _imports, _plural

TIMEOUT = 60.0          # seconds for one check's call on the ranks: the first compile takes seconds
BATCH, LR = 4, 0.1      # samples per rank, SGD's learning rate
LINEARS_PER_BLOCK = 4   # a transformer block's qkv, proj, fc1 and fc2


def _warm_up() -> None:
    """FSDP, DTensor and Dynamo imported on every rank before a timed call."""
    _imports()
    torch.compiler.reset()   # loads Dynamo, which a first torch.compile would take seconds to import


def _one_process(name: str, x, y, max_norm: float | None = None) -> tuple[dict, dict, float]:
    """One process on the whole global batch: weights after one SGD step, the gradients (clipped
    to ``max_norm`` when given) and their total norm before clipping."""
    model = models.build_model(name, seed=0)
    models.loss_fn(name, model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm else float("inf"))
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {k: p.detach() for k, p in model.named_parameters()}, grads, float(norm)


def _linears(gm) -> int:
    """How many linear layers a captured graph computes."""
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_module") and "linear" in str(n.target))


# --------------------------------------------------------------------------- compile_blocks
def _compile_on_rank(shard_and_compile):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    torch.compiler.reset()   # graphs of earlier calls on this rank are not this answer's
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset("transformer", BATCH * world).tensors
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    model = models.build_model("transformer", seed=0)
    names = {id(m): n for n, m in model.named_modules()}
    before = [n for n, _ in model.named_parameters()]
    graphs = []

    def backend(gm, example_inputs):     # records each graph, runs it as it was captured
        graphs.append(_linears(gm))
        return gm.forward

    done = shard_and_compile(model, backend)
    model = model if done is None else done
    params = dict(model.named_parameters())
    units = sorted(names.get(id(m), "?") for m in model.modules() if isinstance(m, FSDPModule))
    plain = [n for n, p in params.items() if not isinstance(p, DTensor)]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings():   # the transformer's output is a view: harmless here
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        out = model(x[mine])
    models.loss_fn("transformer", out, y[mine]).backward()
    optimizer.step()
    # by the plain model's names, so that a wrapper's prefix is judged once, by its own item
    weights = {n.replace("._orig_mod", ""): _full(p) for n, p in params.items()}
    want, _, _ = _one_process("transformer", x, y)
    close = sorted(weights) == sorted(want) and _close([weights[k] for k in want], list(want.values()))
    return {"units": units, "blocks": sorted(f"blocks.{i}" for i in range(len(model.blocks))), "plain": plain,
            "graphs": graphs, "before": before, "after": list(params), "close": close}


def _whole_graph_refused(failure: RankFailure, world_size: int) -> str:
    """A call that failed where Dynamo refused to make one graph of code with FSDP2's hooks in it."""
    if "Unsupported" not in failure.summary and "fullgraph" not in failure.summary:
        return failure.describe(TIMEOUT)
    return ("Dynamo was asked for one graph without a break and could not make it: " + failure.summary.splitlines()[0]
            + " -- between two units run FSDP2's hooks (gathers, frees, reduce-scatters), which stay "
            "outside any graph. Which modules hold a forward with no unit boundary inside it?")


@try_it("compile_blocks", "4.2g", "FSDP2 with each block compiled, the parameters' names kept")
@on_ranks(_compile_on_rank, "one unit per block, then the root", "each block runs compiled, in one graph",
          "the parameters keep the plain model's names", "one SGD step equals one process's on the global batch",
          timeout=TIMEOUT, warm_up=_warm_up, describe=_whole_graph_refused)
def check_compile_blocks(report: Report, got: list, units, compiled, kept, step) -> None:
    r = got[0]
    want_units = sorted([""] + r["blocks"])
    if r["plain"]:
        report.add(units, False, f"{_plural(len(r['plain']), 'parameter')} ({', '.join(r['plain'][:3])}) stayed "
                   "plain tensors: every rank holds them whole and nothing averages their gradients. Which call "
                   "takes the parameters no block holds?")
    elif r["units"] != want_units:
        shown = ", ".join("the root" if u == "" else u for u in r["units"]) or "none"
        report.add(units, False, f"the units are {shown}: a unit is a module sharded on its own, gathered whole "
                   "before its forward. Which modules are to be units, and which comes last?")
    else:
        report.add(units, True)
    blocks = len(r["blocks"])
    whole = [g for g in r["graphs"] if g == LINEARS_PER_BLOCK]
    if not r["graphs"]:
        report.add(compiled, False, "torch.compile handed its backend no graph: nothing ran compiled. "
                   "torch.compile(module) returns a new, compiled module and leaves the one it was given as it "
                   "was: was its result the module the model calls? Which call compiles a module in place?")
    elif any(g > LINEARS_PER_BLOCK for g in r["graphs"]):
        report.add(compiled, False, f"one graph computed {max(r['graphs'])} linear layers, more than one block's "
                   f"{LINEARS_PER_BLOCK}: the units' gathers cannot run between blocks inside a graph. Are the "
                   "blocks units of their own?")
    elif not whole:
        report.add(compiled, False, f"the backend received {_plural(len(r['graphs']), 'graph')}, none holding a "
                   f"whole block's {LINEARS_PER_BLOCK} linear layers: what was compiled, if not the blocks?")
    else:
        report.add(compiled, True)
        if len(whole) < blocks:
            report.note = (f"Dynamo compiled one graph for the {blocks} identical blocks: the second reused "
                           "the first's compilation.")
    if r["after"] == r["before"]:
        report.add(kept, True)
    else:
        changed = [n for n in r["after"] if n not in r["before"]][:2]
        report.add(kept, False, f"the parameters' names changed ({', '.join(changed)}, ...): a compiled wrapper took "
                   "a block's place, so a state dict saved now does not load into the plain model, nor the plain "
                   "model's into this one. Which way of compiling leaves each module where it was?")
    if all(x["close"] for x in got):
        report.add(step, True)
    else:
        report.add(step, False, "the weights after one SGD step differ from one process's on the global batch: "
                   "are all parameters sharded, and their gradients averaged over the ranks?")


# -------------------------------------------------------------------------------- hsdp_clip
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
    grads = {n: _full(p.grad) for n, p in params.items() if p.grad is not None}
    _, want, want_norm = _one_process(CLIP_MODEL, x, y, MAX_NORM)
    try:
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    except (TypeError, ValueError, RuntimeError):
        norm = None
    return {"world": world, "shard_size": shard_size, "plain": len(params) - len(shards), "meshes": meshes, "placements": placements, "hsdp": hsdp,
            "norm": norm, "want_norm": want_norm, "missing": missing,
            "grads_close": not missing and _close([grads[k] for k in want], list(want.values())),
            "ratio": (sum(float(g.norm()) ** 2 for g in grads.values()) ** 0.5) / want_norm if grads else 0.0}


@try_it("hsdp_clip", "4.2g", "HSDP on a 2-D mesh, the gradients clipped across it")
@on_ranks(_clip_on_rank, "parameters sharded over shard_size ranks and replicated over the rest (a 2-D mesh)",
          "the returned norm is the whole model's gradient norm", "the gradients are clipped as one process clips them",
          timeout=TIMEOUT, warm_up=_imports)
def check_hsdp_clip(report: Report, got: list, mesh, norm, clipped) -> None:
    r = got[0]
    n, s = r["world"], r["shard_size"]
    if r["plain"]:
        report.add(mesh, False, f"{_plural(r['plain'], 'parameter')} stayed plain tensors: every rank holds them "
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
        report.add(clipped, False, f"{_plural(len(r['missing']), 'parameter')} ({', '.join(r['missing'][:2])}) have "
                   "no gradient: did the loss's backward run on the sharded model?")
    elif all(x["grads_close"] for x in got):
        report.add(clipped, True)
    else:
        report.add(clipped, False, f"the gradients differ from one process's clipped gradients (their norm is "
                   f"{r['ratio']:.3g} times one process's norm before clipping): were the gradients the norm "
                   "was taken of the ones scaled down?")
