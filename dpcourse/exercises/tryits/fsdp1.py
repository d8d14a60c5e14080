"""4.2b's try-it ``fsdp1``: FSDP1 with blocks 1-3 as units, kept gathered, bf16 gathers and fp32
reduction. Its set-up on the ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ... import models
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .fsdp import TIMEOUT
from .shared import Collectives, fsdp_imports, plural, quiet_fsdp1

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
    with quiet_fsdp1():
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
    with Collectives() as seen:
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
          timeout=TIMEOUT, warm_up=fsdp_imports)
def check_fsdp1(report: Report, got: list, units, kept, dtypes, trains) -> None:
    r = got[0]
    seen = [(root, frozenset(u)) for root, u in r["units"]]
    if not seen:
        report.add(units, False, "the function did not return an FSDP1 model: FullyShardedDataParallel "
                   "is the wrapper this cell is about")
    elif seen == [(root, frozenset(u)) for root, u in r["want_units"]]:
        report.add(units, True)
    else:
        report.add(units, False, f"FSDP made {plural(len(seen), 'unit')} ({_describe_units(seen)}): a module "
                   "becomes a unit when its parameters not yet in a unit reach the policy's threshold, "
                   "children before parents. Which of the sizes in the cell must reach it, which not?")
    if r["forward"] == 0:
        report.add(kept, False, "forward all-gathered nothing: every rank held whole parameters, so "
                   "nothing was sharded. Which strategy shards the parameters at rest?")
    elif r["backward"] == 0 and r["forward"] == r["fsdp"]:
        report.add(kept, True)
    elif r["backward"]:
        report.add(kept, False, f"backward all-gathered parameters again ({plural(r['backward'], 'all-gather')} "
                   f"after {r['forward']} in forward): the units freed them after forward. Which sharding "
                   "strategy keeps them from forward to backward?")
    else:
        report.add(kept, False, f"forward ran {plural(r['forward'], 'all-gather')} for "
                   f"{plural(r['fsdp'], 'unit')}: is each unit gathered once?")
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
