"""4.2g's try-it ``compile_blocks``: FSDP2 with each block compiled, the parameters' names kept.
Its set-up on the ranks, its items and the mistakes it names."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ... import models
from ...grading.compare import close
from ...grading.judging import RankFailure, on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .compile_meshes import BATCH, LINEARS_PER_BLOCK, LR, TIMEOUT, linears, one_process, warm_up
from .shared import full, plural

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
        graphs.append(linears(gm))
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
    weights = {n.replace("._orig_mod", ""): full(p) for n, p in params.items()}
    want, _, _ = one_process("transformer", x, y)
    same = sorted(weights) == sorted(want) and close([weights[k] for k in want], list(want.values()))
    return {"units": units, "blocks": sorted(f"blocks.{i}" for i in range(len(model.blocks))), "plain": plain,
            "graphs": graphs, "before": before, "after": list(params), "close": same}


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
          timeout=TIMEOUT, warm_up=warm_up, describe=_whole_graph_refused)
def check_compile_blocks(report: Report, got: list, units, compiled, kept, step) -> None:
    r = got[0]
    want_units = sorted([""] + r["blocks"])
    if r["plain"]:
        report.add(units, False, f"{plural(len(r['plain']), 'parameter')} ({', '.join(r['plain'][:3])}) stayed "
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
        report.add(compiled, False, f"the backend received {plural(len(r['graphs']), 'graph')}, none holding a "
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
