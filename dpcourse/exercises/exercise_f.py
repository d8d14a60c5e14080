"""Exercise F: turn the single-device ``train_lm.py`` into FSDP2; the checker runs it under torchrun.

    report = dpc.exercises.check_f("train_lm_fsdp.py")

Like exercise A it judges behaviour (``script_check.py`` holds the judges they share): the
script runs on 2 ranks under ``torchrun`` with the course's observer, and the starter as one
process on the global batch beside it. Judged besides A's items: each rank's optimizer
steps about 1/N of every parameter, as DTensor shards; every block is a unit of its own
(its gradients reduce-scattered on their own); the gathers carry bf16 and the reductions
fp32; accumulation reduce-scatters in the last micro-batch's backward only; the gradients'
global norm is clipped to ``--max-norm``; rank 0 saves whole, plain tensors. The tied
embedding and head: PyTorch 2.13 refuses them in two units (a ValueError at the first
forward), which the first item then explains.
"""
from __future__ import annotations

import math

import torch

from .. import models
from . import equivalence as eq
from . import script_check as sc
from .exercise_a import ARGS as A_ARGS
from ..grading.events import Comm, read_events
from .recorder import Backward, Pass, Read, Step, read_log
from ..grading import provenance
from ..grading.report import Report

MAX_NORM = float(A_ARGS[A_ARGS.index("--max-norm") + 1])
ARGS = list(A_ARGS)  # 2 epochs, 8 sequences per rank and micro-batch, 4 micro-batches per step
# measured with these ARGS: bf16 gathers end 4.8 % of one process's travel away from its
# float32 weights and move the printed val_loss by 6e-5; a DistributedSampler's repeated
# validation sequence moves it by 4e-3 or more
SETTING = sc.Setting(ARGS, "reduce_scatter", val_tolerance=1e-3, grad_tolerance=0.05, weight_tolerance=0.15,
                     sync_idea="what tells fully_shard whether this backward pass should reduce its gradients?")
ITEMS = {"sharded": "each rank's optimizer steps about 1/2 of every parameter, as DTensor shards",
         "units": "every block is a unit: its gradients reduce-scattered on their own in each backward",
         "precision": "mixed precision: gathers in bf16, gradients reduced in fp32",
         "clip": "the gradients' global norm is clipped to --max-norm before every step"}
TIED = "is shared with a parameter already managed by another FSDP group"


@provenance.judged("F")
def check_f(path: str = "train_lm_fsdp.py", timeout: float = 240.0) -> Report:
    """Run the learner's FSDP2 script on 2 ranks under torchrun and say, item by item, what is right."""
    return sc.check_script(Report("Exercise F", key="F"), path, "shard it with fully_shard", SETTING, timeout,
                           _judge)


def _judge(report: Report, run, single: sc.SingleRun, setting: sc.Setting, timeout: float) -> None:
    logs = [read_log(run.observed, r) for r in range(sc.WORLD_SIZE)]
    finished = sc.judge_completion(report, run, logs, timeout, "under FSDP a forward pass and gathering a full "
                                   "state dict are collectives too: which ranks must take part in them?")
    if TIED in run.output and TIED not in report.items[0].detail:
        report.items[0].detail += ("\nThe token embedding and the head are one Parameter, used at both ends of "
                                   "the model: which unit can hold both of its users?")
    uneven = None if finished else _uneven_validation(run.observed)
    if uneven:
        report.items[0].detail += "\n" + uneven
    sc.judge_sampling(report, logs, finished, int(setting.arg("--num-samples")))
    report.add(ITEMS["sharded"], *_judge_shards(logs))
    report.add(ITEMS["units"], *_judge_units(logs))
    report.add(ITEMS["precision"], *_judge_precision(logs))
    eq.judge_synchronisation(report, logs, setting, "FSDP")
    eq.judge_gradient(report, logs, single, setting)
    report.add(ITEMS["clip"], *_judge_clip(logs))
    eq.judge_the_outcome(report, run, logs, single, setting, finished, _judge_checkpoint,
                         "do all ranks build the same initial weights before "
                         "sharding (fully_shard does not broadcast)? the same learning rate and --max-norm?")


def _passes(directory: str, rank: int) -> list[dict]:
    """One rank's DataLoader passes in order, each {"reads", "backwards", "steps", "gathers",
    "step": optimizer steps before its first collective, "comms": the optimizer steps before
    each collective it issued}: read from the event log in order, an event belonging to the
    pass that last began or handed out a sample."""
    passes: dict[int, dict] = {}
    current = None
    for e in read_events(directory, rank):
        match e:
            case Pass() | Read():
                current = passes.setdefault(e.number, {"reads": 0, "backwards": 0, "steps": 0, "gathers": 0,
                                                        "step": None, "comms": []})
                current["reads"] += isinstance(e, Read)
            case _ if current is None:
                continue
            case Backward():
                current["backwards"] += 1
            case Step():
                current["steps"] += 1
            case Comm():
                current["comms"].append(e.step)
                current["gathers"] += e.collective == "all_gather"
                current["step"] = e.step if current["step"] is None else current["step"]
    return [passes[k] for k in sorted(passes)]


def _uneven_validation(directory: str) -> str | None:
    """Under FSDP every forward pass all-gathers each unit's parameters: a collective. When a
    rank ran a validation pass (data read, forward passes that all-gathered, no backward) that
    another rank did not run, because that rank went on with other collectives meanwhile, the
    words that say so; else None."""
    passes = [_passes(directory, r) for r in range(sc.WORLD_SIZE)]
    scoring = [[p for p in rank_passes if p["reads"] and p["gathers"] and not p["backwards"] and not p["steps"]]
               for rank_passes in passes]
    for a in range(sc.WORLD_SIZE):
        for b in range(sc.WORLD_SIZE):
            if len(scoring[a]) <= len(scoring[b]):
                continue
            alone = scoring[a][len(scoring[b])]
            others = [p for p in passes[b] if all(p is not q for q in scoring[b])]
            elsewhere = [s for p in others for s in p["comms"] if s >= alone["step"]]
            if not elsewhere:
                continue
            return (f"Rank {a} ran a validation pass after {alone['step']} optimizer steps (forward passes over "
                    f"{alone['reads']} sequences, {alone['gathers']} all-gathers) that rank {b} never ran: rank {b} "
                    "went on with other collectives meanwhile, so the ranks met in collectives that do not "
                    "match. Under FSDP a forward pass is a collective -- every unit all-gathers its parameters "
                    "from all ranks -- so every rank must run the same validation forwards, as many batches in "
                    "the same order, even if only rank 0 prints the result.")
    return None


def _judge_shards(logs) -> tuple[bool | None, str]:
    shards = [log["shards"] for log in logs]
    if any(s is None for s in shards):
        return None, "judged at the first optimizer step, which a rank never reached"
    local, total, dtensors, params = shards[0]
    if dtensors < params:
        return False, (f"rank 0's optimizer holds {params - dtensors} of {params} parameters as plain "
                       "tensors: fully_shard replaces every parameter by a DTensor shard, so these are "
                       "tensors the model no longer uses -- when must the optimizer be created?")
    held = [s[0] / s[1] for s in shards]
    if any(abs(h - 1 / sc.WORLD_SIZE) > 0.1 for h in held):
        return False, (f"the ranks step {', '.join(f'{h:.0%}' for h in held)} of the parameters' "
                       "elements: is every parameter sharded over all ranks (a 1-D mesh of the world)?")
    return True, f"{params} DTensor parameters; rank 0 steps {local:,} of {total:,} elements"


def _judge_units(logs) -> tuple[bool | None, str]:
    """Each unit reduce-scatters its own gradients: a backward that synchronises runs one
    reduce-scatter per unit, at least one per block."""
    log, blocks = logs[0], len(models.build_model(sc.MODEL).blocks)
    per_backward: dict[tuple, int] = {}
    for step, name, *_rest, inside in log["comms"]:
        if name == "reduce_scatter" and inside:
            per_backward[(step, inside)] = per_backward.get((step, inside), 0) + 1
    if not per_backward:
        if log["backwards"]:
            return False, ("no reduce-scatter in any backward pass: are the gradients sharded? (DDP "
                           "all-reduces; fully_shard reduce-scatters)")
        return None, "judged once a backward pass has run"
    fewest = min(per_backward.values())
    if fewest < blocks:
        return False, (f"a backward pass on rank 0 ran {fewest} reduce-scatter(s), fewer than the model's {blocks} "
                       "blocks: the gradients travel in fewer, larger pieces -- what makes each block a unit "
                       "of its own?")
    return True, f"{fewest} reduce-scatters in each synchronising backward pass on rank 0"


def _judge_precision(logs) -> tuple[bool | None, str]:
    comms = logs[0]["comms"]  # FSDP's own collectives (DTensor's, e.g. the norm's, are not these)
    gathered = {d for _, c, d, *_ in comms if c == "all_gather"}
    reduced = {d for _, c, d, *_ in comms if c == "reduce_scatter"}
    if not gathered or not reduced:
        return None, "judged once parameters are gathered and gradients reduce-scattered"
    low = {"bfloat16", "float16"}
    cuda_without_bf16 = torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False)
    if not gathered <= low and not (cuda_without_bf16 and gathered == {"float32"}):
        return False, (f"the all-gathers carried {', '.join(sorted(gathered))}: the parameters were gathered at "
                       "full precision (PyTorch runs bf16 on CPUs too) -- what tells fully_shard the dtype "
                       "to compute in?")
    if reduced != {"float32"}:
        return False, (f"the reduce-scatters carried {', '.join(sorted(reduced))}: summed over the ranks in a "
                       "16-bit format, small gradients lose their low bits -- which dtype should the "
                       "reduction use?")
    return True, f"gathers in {', '.join(sorted(gathered))}, reductions in float32"


def _judge_clip(logs) -> tuple[bool | None, str]:
    steps = sorted(set.intersection(*(set(log["grads"]) for log in logs)))
    if not steps:
        return None, "judged at the first optimizer step, which a rank never reached"
    if all(log["grads"][k] == 0 for log in logs for k in steps):
        return None, ("the optimizer's parameters never had a gradient (it holds parameters the model no "
                      "longer uses?): judged once it steps the shards")
    norms = [math.sqrt(eq.global_squares(logs, "grads", k)) for k in steps]
    worst = max(range(len(norms)), key=lambda k: norms[k])
    if norms[worst] > MAX_NORM * (1 + 1e-3):
        return False, (f"before optimizer step {steps[worst]} the gradients' global norm was "
                       f"{norms[worst]:.3f}, above --max-norm {MAX_NORM}: the step used unclipped "
                       "gradients, or each rank scaled by the norm of its own slice, which is smaller than "
                       "the norm of the whole gradient -- what must a norm over sharded gradients add up?")
    return True, f"{len(steps)} steps, every global norm at most {MAX_NORM}"


def _judge_checkpoint(report: Report, logs: list[dict]):
    def sharded(state):
        keys = [k for k, v in state.items() if type(v).__name__ == "DTensor"]
        return (f"its values are DTensors (e.g. {keys[0]!r}): the file holds rank 0's shards, which the plain "
                "model cannot load -- the whole tensors have to be gathered from every rank first") if keys else None

    return sc.judge_checkpoint(report, logs, "the checkpoint loads into the plain model (plain keys, full tensors)",
                               sharded, "the file must hold whole, plain tensors, gathered from every rank")
