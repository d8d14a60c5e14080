"""4.2b's try-its: FSDP2, FSDP1 and mixed precision, written by the learner (checked on the
notebook's ranks). 4.2f's DCP and accumulation checkers (``long_runs``) use the helpers here.

Each checker runs the learner's function on every rank next to a reference computed on the
same rank (one process on the whole global batch, or the saver's own full state), and judges
what happened: the parameters' types, the collectives the ranks issued (seen from outside by
the collective tracker, with their dtypes and the phase, forward or backward, they ran in),
weights, gradients and optimizer state.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from ... import models
from ..ranks import RankFailure
from ..report import Report
from . import on_ranks, try_it

TIMEOUT = 20.0          # seconds for one check's call on the ranks
RTOL, ATOL = 1e-4, 1e-6


class _Collectives:
    """On a rank: every collective issued inside ``with``, as (phase, collective, dtype);
    ``phase`` is whatever the checker last set ("forward", "backward", ...)."""

    def __init__(self):
        self.phase, self.seen, self.sizes = "", [], []   # sizes: each collective's first tensor's numel

    def __enter__(self):
        from ...observe.comm import first_tensor
        from ...pool.ranks.tracker import TRACKER

        def issued(call):
            t = first_tensor(call.args[0]) if call.args else None
            self.seen.append((self.phase, call.collective, None if t is None else str(t.dtype).replace("torch.", "")))
            self.sizes.append(None if t is None else t.numel())

        self._listening = TRACKER.listen(issued)
        self._listening.__enter__()
        return self

    def __exit__(self, *exc):
        self._listening.__exit__(*exc)

    def count(self, collective: str, phase: str | None = None) -> int:
        return sum(1 for p, c, _ in self.seen if c == collective and (phase is None or p == phase))

    def dtypes(self, collective: str) -> set[str]:
        return {d for _, c, d in self.seen if c == collective}


@contextlib.contextmanager
def _quiet():
    """FSDP1's state-dict code warns about its own internals (ShardedTensor, default devices)
    at every call: not the learner's business in a check."""
    with warnings.catch_warnings():
        for text in ("Please use DTensor instead", "`_get_pg_default_device` will be deprecated",
                     "Multiple backends are registered"):
            warnings.filterwarnings("ignore", text)
        yield


def _close(got, want) -> bool:
    return all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(got, want))


def _ratio(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """How many times ``want`` ``got`` is, fitted over all tensors (1.0 when equal)."""
    g, w = torch.cat([t.flatten() for t in got]), torch.cat([t.flatten() for t in want])
    return float((g @ w) / (w @ w).clamp_min(1e-30))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _full(t):
    """A DTensor's full value (a collective: every rank calls it), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.detach().full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _imports() -> None:
    """The warm-up of these checks: every rank imports FSDP, DTensor and DCP before a timed call."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401


# ------------------------------------------------------------------------------ fully_shard
SHARD_MODEL, SHARD_BATCH, SHARD_LR = "transformer", 4, 0.1   # samples per rank, SGD's lr


def _one_sgd_step(name: str, x, y) -> dict[str, torch.Tensor]:
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
    with _Collectives() as seen:
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
    weights = {n: _full(p) for n, p in params.items()}
    return {"plain": plain, "meshes": sorted(meshes), "sharded_dim0": placements <= {(Shard(0),)}, "placements": shown,
            "units": units, "blocks": blocks, "gathered": gathered, "forward": seen.count("all_gather", "forward"),
            "backward": seen.count("all_gather", "backward"), "world": world,
            "weights": weights, "want": _one_sgd_step(SHARD_MODEL, x, y)}


@try_it("fully_shard", "4.2b", "a transformer under fully_shard: only the last block kept gathered for backward")
@on_ranks(_fully_shard_on_rank, "every parameter is a DTensor shard over all ranks",
          "one unit per block, then the root",
          "only the last block keeps its gathered parameters from forward to backward",
          "one SGD step equals one process's on the global batch", timeout=TIMEOUT, warm_up=_imports)
def check_fully_shard(report: Report, got: list, sharded, units, kept, step) -> None:
    r = got[0]
    if r["plain"]:
        shown = ", ".join(r["plain"][:3]) + (", ..." if len(r["plain"]) > 3 else "")
        report.add(sharded, False, f"{_plural(len(r['plain']), 'parameter')} ({shown}) stayed plain tensors: "
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
        report.add(units, False, f"forward ran {_plural(r['forward'], 'all-gather')}, one per unit; the units are "
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
                   f"backward all-gathered {_plural(r['backward'], 'time')}: the last block freed them after its "
                   "forward and gathered them again at once for its backward. What tells that one block to "
                   "keep them?")
    if all(_close([x["weights"][k] for k in x["want"]], list(x["want"].values())) for x in got):
        report.add(step, True)
    else:
        ratio = _ratio([r["weights"][k] - v for k, v in _initial(SHARD_MODEL).items()],
                       [r["want"][k] - v for k, v in _initial(SHARD_MODEL).items()])
        size = f" (the update is about {ratio:.2g} times the right size)" if abs(ratio - 1) > 0.05 else ""
        report.add(step, False, f"the weights after the step differ from one process's{size}: are all "
                   "parameters' gradients averaged over the ranks?")


def _initial(name: str) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in models.build_model(name, seed=0).named_parameters()}


# ------------------------------------------------------------------------------------ fsdp1
FSDP1_STEPS, FSDP1_BATCH, FSDP1_LR = 2, 8, 0.05
BF16_TOLERANCE = 1e-3   # weights after 2 SGD steps, bf16 gathers vs fp32 one process: 4e-5 measured


def _fsdp1_units(wrapped, modules: dict[int, str], names: list[str]) -> list[tuple]:
    """(is the root, its parameters' names) for each FSDP1 unit, by the plain model's names
    (``modules``: id of each module -> its name, ``names``: the parameters', read before
    wrapping): each parameter belongs to the innermost FSDP instance around its module."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if not isinstance(wrapped, FSDP):
        return []
    prefixes = [modules.get(id(m.module), "?") for m in wrapped.modules() if isinstance(m, FSDP)]
    owner = {name: max((p for p in prefixes if p == "" or name.startswith(p + ".")), key=len) for name in names}
    return sorted(((p == "", frozenset(n for n in names if owner[n] == p)) for p in prefixes),
                  key=lambda unit: (unit[0], sorted(unit[1])))


def _plain_units(model, unit_names) -> list[frozenset]:
    """(is the root, its parameters' names) for each unit: the modules ``unit_names``, then the root."""
    units = [frozenset(f"{u}.{n}" for n, _ in model.get_submodule(u).named_parameters()) for u in unit_names]
    rest = frozenset(n for n, _ in model.named_parameters()) - frozenset().union(*units)
    return sorted([(False, u) for u in units] + [(True, rest)], key=lambda unit: (unit[0], sorted(unit[1])))


def _describe_units(units: list) -> str:
    """"blocks.1 | blocks.2 | the root: blocks.0, head": each unit by the modules its
    parameters belong to."""
    def modules(root, unit):
        held = ", ".join(sorted({".".join(n.split(".")[:2]) if n.startswith("blocks.") else n.split(".")[0]
                                 for n in unit})) or "no parameters"
        return f"the root: {held}" if root else held
    return " | ".join(modules(root, u) for root, u in units)


def _fsdp1_on_rank(wrap):
    with _quiet():
        return _fsdp1_run(wrap)


def _fsdp1_run(wrap):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset("mlp", FSDP1_STEPS * FSDP1_BATCH * world).tensors
    plain = models.build_model("mlp", seed=0)
    want_units = _plain_units(plain, ["blocks.1", "blocks.2", "blocks.3"])
    reference = models.build_model("mlp", seed=0)   # one process, the whole global batches
    sgd = torch.optim.SGD(reference.parameters(), lr=FSDP1_LR)
    for step in range(FSDP1_STEPS):
        rows = slice(step * world * FSDP1_BATCH, (step + 1) * world * FSDP1_BATCH)
        models.loss_fn("mlp", reference(x[rows]), y[rows]).backward()
        sgd.step()
        sgd.zero_grad()

    modules, names = {id(m): n for n, m in plain.named_modules()}, [n for n, _ in plain.named_parameters()]
    model = wrap(plain)
    units = _fsdp1_units(model, modules, names)
    optimizer = torch.optim.SGD(model.parameters(), lr=FSDP1_LR)
    with _Collectives() as seen:
        for step in range(FSDP1_STEPS):
            rows = slice((step * world + rank) * FSDP1_BATCH, (step * world + rank + 1) * FSDP1_BATCH)
            seen.phase = f"forward {step}"
            loss = models.loss_fn("mlp", model(x[rows]), y[rows])
            seen.phase = f"backward {step}"
            loss.backward()
            seen.phase = "step"
            optimizer.step()
            optimizer.zero_grad()
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    last = FSDP1_STEPS - 1
    return {"units": [(root, sorted(u)) for root, u in units], "want_units": [(root, sorted(u)) for root, u in want_units],
            "fsdp": len(units), "forward": seen.count("all_gather", f"forward {last}"),
            "backward": seen.count("all_gather", f"backward {last}"),
            "all_reduce": seen.count("all_reduce"), "gather_dtypes": sorted(seen.dtypes("all_gather")),
            "reduce_dtypes": sorted(seen.dtypes("reduce_scatter") | seen.dtypes("all_reduce")),
            "difference": max((weights[k].float() - v).abs().max().item()
                              for k, v in reference.state_dict().items())}


@try_it("fsdp1", "4.2b", "FSDP1 with blocks 1-3 as units, kept gathered, bf16 gathers and fp32 reduction")
@on_ranks(_fsdp1_on_rank, "the units are blocks 1-3 and the root", "parameters stay gathered from forward to backward",
          "gathers in bf16, gradients reduced in fp32", "trains as one process does, to bf16's rounding",
          timeout=TIMEOUT, warm_up=_imports)
def check_fsdp1(report: Report, got: list, units, kept, dtypes, trains) -> None:
    r = got[0]
    seen = [(root, frozenset(u)) for root, u in r["units"]]
    if not seen:
        report.add(units, False, "the function did not return an FSDP1 model: FullyShardedDataParallel "
                   "is the wrapper this cell is about")
    elif seen == [(root, frozenset(u)) for root, u in r["want_units"]]:
        report.add(units, True)
    else:
        report.add(units, False, f"FSDP made {_plural(len(seen), 'unit')} ({_describe_units(seen)}): a module "
                   "becomes a unit when its parameters not yet in a unit reach the policy's threshold, "
                   "children before parents. Which of the sizes in the cell must reach it, which not?")
    if r["forward"] == 0:
        report.add(kept, False, "forward all-gathered nothing: every rank held whole parameters, so "
                   "nothing was sharded. Which strategy shards the parameters at rest?")
    elif r["backward"] == 0 and r["forward"] == r["fsdp"]:
        report.add(kept, True)
    elif r["backward"]:
        report.add(kept, False, f"backward all-gathered parameters again ({_plural(r['backward'], 'all-gather')} "
                   f"after {r['forward']} in forward): the units freed them after forward. Which sharding "
                   "strategy keeps them from forward to backward?")
    else:
        report.add(kept, False, f"forward ran {_plural(r['forward'], 'all-gather')} for "
                   f"{_plural(r['fsdp'], 'unit')}: is each unit gathered once?")
    gathers, reduces = r["gather_dtypes"], r["reduce_dtypes"]
    if not gathers:
        report.add(dtypes, None, "nothing was all-gathered, so the gathers' dtype cannot show: judged once "
                   "the parameters are sharded")
    elif gathers == ["bfloat16"] and reduces == ["float32"]:
        report.add(dtypes, True)
    else:
        said = []
        if gathers != ["bfloat16"]:
            said.append(f"the parameters were all-gathered in {', '.join(gathers)}, so each gather moved "
                        "4-byte elements where 2 would do")
        if reduces != ["float32"]:
            said.append(f"the gradients were reduced in {', '.join(reduces) or 'nothing'}, so every addition "
                        "of the sum rounds to bf16's 8 bits of mantissa")
        report.add(dtypes, False, "; ".join(said) + ". Which dtypes does FSDP1's mixed-precision "
                   "setting take, one for the gathers and one for the reduction?")
    worst = max(x["difference"] for x in got)
    if worst < BF16_TOLERANCE:
        report.add(trains, True)
    else:
        by = f"by up to {worst:.2g}, far more than bf16's rounding" if worst == worst else "and are not finite"
        report.add(trains, False, f"after {FSDP1_STEPS} SGD steps the weights differ from one process's {by}: "
                   "do all ranks train one model, with gradients averaged over them?")


# -------------------------------------------------------------------------- mixed_precision
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
    with _Collectives() as seen:
        seen.phase = "forward"
        out = sharded(x[mine])
        seen.phase = "backward"
        models.loss_fn("mlp", out, y[mine]).backward()
        optimizer.step()
    gathers = [d for p, c, d in seen.seen if c == "all_gather" and p == "forward"]
    weights = {n: _full(p) for n, p in params.items()}
    want = _one_sgd_step("mlp", x, y)
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
          timeout=TIMEOUT, warm_up=_imports, describe=_dtype_refused)
def check_mixed_precision(report: Report, got: list, gathers, reduced, outputs, one_step) -> None:
    r = got[0]
    bf16, fp32 = r["gathers"].count("bfloat16"), r["gathers"].count("float32")
    if (bf16, fp32) == (r["blocks"], 1):
        report.add(gathers, True)
    elif not r["gathers"]:
        report.add(gathers, False, "forward gathered nothing: were the blocks and the root sharded?")
    elif bf16 == 0:
        report.add(gathers, False, f"forward's {_plural(len(r['gathers']), 'all-gather')} all carried float32: "
                   "the blocks computed in full precision. What tells fully_shard the dtype a unit computes in?")
    elif fp32 == 0:
        report.add(gathers, False, f"all {_plural(bf16, 'all-gather')} carried bf16, the root's too: its own "
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
