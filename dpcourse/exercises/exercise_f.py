"""Exercise F: turn the single-device ``train_single.py`` into FSDP2; the checker runs it under torchrun.

    report = dpc.exercises.check_f("train_fsdp.py")

Like exercise A it judges behaviour: the script runs on 2 ranks under ``torchrun`` with the
course's worker observer (``observe.py``: the samples each training pass reads, every
collective with its dtype, the gradients' squares before each optimizer step, the size of
what the optimizer steps), and the same training runs as one process with
``train_single.py`` at the global batch size. What is judged: it completes; each rank reads
its own samples and a new order every epoch; each rank's optimizer steps about 1/N of every
parameter, as DTensor shards; every block is a unit of its own (gathered and reduce-scattered
every step); the gathers carry bf16 and the reductions fp32; the gradients' global norm is
clipped to ``--max-norm``; the final weights equal the single-process run's within bf16's
rounding; rank 0 alone writes a checkpoint with plain keys that loads into the plain MLP;
every rank leaves the group.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile

import torch

from .. import models, scripts
from . import exercise_a as a
from .observe import read_log
from .report import Report

WORLD_SIZE = 2
MAX_NORM = 0.5
ARGS = a.ARGS + ["--max-norm", str(MAX_NORM)]  # 2 epochs, 16 samples per rank, 128 samples
TOLERANCE = {"bfloat16": 1e-3, "float16": 1e-3, "float32": 1e-5}  # largest |weight difference|
# measured with these ARGS: bf16 gathers drift 1.1e-4 from float32 one process (float32 gathers
# 3e-8); a summed loss, whose gradients clipping then shrinks in more steps, misses by 3.6e-3
ITEMS = {"sharded": "each rank's optimizer steps about 1/2 of every parameter, as DTensor shards",
         "units": "every block is a unit: its weights gathered and its gradients reduce-scattered each step",
         "precision": "mixed precision: gathers in bf16, gradients reduced in fp32",
         "clip": "the gradients' global norm is clipped to --max-norm before every step",
         "weights": "final weights equal one process training the global batch (train_single.py), "
                    "to bf16's rounding"}
_reference_cache: dict[tuple, dict] = {}


def check_f(path: str = "train_fsdp.py", timeout: float = 240.0) -> Report:
    """Run the learner's FSDP2 script on 2 ranks under torchrun and say, item by item, what is right."""
    return a.check_script(Report("Exercise F", key="F"), path, "shard it with fully_shard", ARGS, timeout, _judge)


def _judge(report: Report, run, timeout: float) -> None:
    logs = [read_log(run.observed, r) for r in range(WORLD_SIZE)]
    finished = a.judge_completion(report, run, logs, timeout, "gathering a full state dict is one: it is a "
                                  "collective -- which ranks must take part in it?")
    a._judge_sampling(report, logs, finished=finished)
    report.add(ITEMS["sharded"], *_judge_shards(logs))
    report.add(ITEMS["units"], *_judge_units(logs))
    dtype, verdict = _judge_precision(logs)
    report.add(ITEMS["precision"], *verdict)
    report.add(ITEMS["clip"], *_judge_clip(logs))
    a._judge_logging_and_saving(report, run, logs, finished)
    weights = _judge_checkpoint(report, logs) if finished else None
    report.add(ITEMS["weights"], *_judge_weights(weights, dtype))
    a.judge_leaving(report, logs, finished)


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
    if any(abs(h - 1 / WORLD_SIZE) > 0.1 for h in held):
        return False, (f"the ranks step {', '.join(f'{h:.0%}' for h in held)} of the parameters' "
                       "elements: is every parameter sharded over all ranks (a 1-D mesh of the world)?")
    return True, f"{params} DTensor parameters; rank 0 steps {local:,} of {total:,} elements"


def _per_step(log, collective: str) -> list[int]:
    """Calls of ``collective`` in each complete step (optimizer step k ends step k)."""
    steps = max(log["grads"], default=-1) + 1
    return [sum(1 for s, c, *_ in log["comms"] if s == k and c == collective) for k in range(steps)]


def _judge_units(logs) -> tuple[bool | None, str]:
    log, blocks = logs[0], len(models.MLP().blocks)
    gathers, scatters = _per_step(log, "all_gather"), _per_step(log, "reduce_scatter")
    if not scatters:
        return None, "judged once a step completes"
    if min(scatters) == 0:
        return False, ("no reduce-scatter in a step: are the gradients sharded? (DDP all-reduces; "
                       "fully_shard reduce-scatters)")
    if min(scatters) < blocks or min(gathers) < blocks:
        return False, (f"rank 0 made {min(gathers)} all-gather(s) and {min(scatters)} reduce-scatter(s) "
                       f"in a step, fewer than the MLP's {blocks} blocks: the model is gathered in "
                       "fewer, larger pieces -- what makes each block a unit of its own?")
    return True, f"per step on rank 0: {min(gathers)} all-gathers, {min(scatters)} reduce-scatters"


def _judge_precision(logs) -> tuple[str | None, tuple]:
    comms = logs[0]["comms"]
    gathered = {d for _, c, d, *_ in comms if c == "all_gather"}
    reduced = {d for _, c, d, *_ in comms if c == "reduce_scatter"}
    if not gathered or not reduced:
        return None, (None, "judged once parameters are gathered and gradients reduce-scattered")
    low = {"bfloat16", "float16"}
    dtype = next(iter(gathered)) if len(gathered) == 1 else None
    cuda_without_bf16 = torch.cuda.is_available() and not torch.cuda.is_bf16_supported()
    if not gathered <= low and not (cuda_without_bf16 and gathered == {"float32"}):
        return dtype, (False, f"the all-gathers carried {', '.join(sorted(gathered))}: the parameters were "
                       "gathered at full precision (PyTorch runs bf16 on CPUs too) -- what tells fully_shard "
                       "the dtype to compute in?")
    if reduced != {"float32"}:
        return dtype, (False, f"the reduce-scatters carried {', '.join(sorted(reduced))}: summed over the "
                       "ranks in a 16-bit format, small gradients lose their low bits -- which dtype should "
                       "the reduction use?")
    return dtype, (True, f"gathers in {', '.join(sorted(gathered))}, reductions in float32")


def _judge_clip(logs) -> tuple[bool | None, str]:
    steps = sorted(set.intersection(*(set(log["grads"]) for log in logs)))
    if not steps:
        return None, "judged at the first optimizer step, which a rank never reached"
    dtensors = all(log["shards"] and log["shards"][2] == log["shards"][3] for log in logs)
    if all(log["grads"][k] == 0 for log in logs for k in steps):
        return None, ("the optimizer's parameters never had a gradient (it holds parameters the model no "
                      "longer uses?): judged once it steps the shards")
    norms = []
    for k in steps:
        squares = [log["grads"][k] for log in logs]
        # sharded: each rank holds its slice, the global norm adds them; replicated: any rank's
        norms.append(math.sqrt(sum(squares)) if dtensors else math.sqrt(squares[0]))
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

    return a.judge_checkpoint(report, logs, "the checkpoint loads into the plain model (plain keys, full tensors)",
                              sharded, "the file must hold whole, plain tensors, gathered from every rank")


def _judge_weights(weights, dtype) -> tuple[bool | None, str]:
    if weights is None:
        return None, "no loadable checkpoint to compare"
    reference = reference_weights()
    diff = max((weights[k].float() - reference[k]).abs().max().item() for k in reference)
    tolerance = TOLERANCE.get(dtype or "bfloat16", TOLERANCE["bfloat16"])
    if diff <= tolerance:
        return True, f"largest difference {diff:.1e}"
    return False, (f"largest difference {diff:.1e}, more than {dtype or 'bf16'}'s rounding explains -- do all "
                   "ranks start from the same seed before sharding (fully_shard does not broadcast)? is the "
                   "loss a mean over each rank's batch? the same learning rate and --max-norm?")


def reference_weights(timeout: float = 180.0) -> dict:
    """``train_single.py`` at the global batch size, as one process (computed once per process)."""
    args = list(ARGS)
    i = args.index("--batch-size")
    args[i + 1] = str(int(args[i + 1]) * WORLD_SIZE)
    key = tuple(args)
    if key not in _reference_cache:
        with tempfile.TemporaryDirectory(prefix="dpcourse-reference-f-") as work:
            out = os.path.join(work, "model.pt")
            args[args.index("--out") + 1] = out
            done = subprocess.run([sys.executable, scripts.path("train_single"), *args], cwd=work,
                                  capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            if done.returncode != 0:
                raise RuntimeError(f"train_single.py failed:\n{a._tail(done.stdout + done.stderr)}")
            _reference_cache[key] = torch.load(out, map_location="cpu")
    return _reference_cache[key]
