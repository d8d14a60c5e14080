"""Exercise A: turn the single-device ``train_single.py`` into DDP; the checker runs it under torchrun.

It judges behaviour, not text: the script runs on 2 ranks under ``torchrun`` with the
course's observer (``observe.py``), and next to it the reference solution with the same
arguments. Any correct conversion passes. Only the training loop's passes over the data
count as epochs (a pass with optimizer steps): an evaluation pass, on every rank or on
rank 0 only, is the learner's business. Exercise F's checker shares these judges.
"""
from __future__ import annotations

import os
import re
import tempfile

import torch

from .. import models, scripts
from .observe import read_log
from .report import Report
from .torchrun import aborted_at_exit, torchrun

WORLD_SIZE = 2
ARGS = ["--epochs", "2", "--batch-size", "16", "--num-samples", "128", "--out", "model.pt"]
TOLERANCE = 1e-5  # max |difference| of final weights; float rounding is ~1e-7 here
_reference_cache: dict[tuple, dict] = {}


def check_a(path: str = "train_ddp.py", timeout: float = 180.0) -> Report:
    """Run the learner's DDP script on 2 ranks under torchrun and say, item by item, what is right."""
    return check_script(Report("Exercise A", key="A"), path, "make it data-parallel", ARGS, timeout, _judge)


def check_script(report: Report, path: str, unchanged: str, args: list, timeout: float, judge) -> Report:
    """Run the learner's script on 2 ranks under torchrun and have ``judge(report, run,
    timeout)`` fill the report; "not attempted" when it is missing or still the starter."""
    if not os.path.exists(path):
        report.attempted = False
        report.note = f"Write {path!r} (start from a copy of train_single.py), then run this cell again."
        return report
    if _same_text(path, scripts.path("train_single")):
        report.attempted = False
        report.note = f"{path!r} is still train_single.py, unchanged: {unchanged}."
        return report
    with tempfile.TemporaryDirectory(prefix="dpcourse-check-") as work:
        judge(report, torchrun(path, args, work, WORLD_SIZE, timeout), timeout)
    if not report.passed:
        report.note = "Each failed item says what the ranks did. To compare with a reference: report.fix()."
    return report


def _judge(report: Report, run, timeout: float) -> None:
    logs = [read_log(run.observed, r) for r in range(WORLD_SIZE)]
    finished = judge_completion(report, run, logs, timeout, "e.g. a barrier or all_reduce inside `if rank == 0:`")
    _judge_sampling(report, logs, finished=finished)
    _judge_logging_and_saving(report, run, logs, finished)
    weights = _judge_checkpoint(report, logs) if finished else None
    _judge_weights(report, weights)
    judge_leaving(report, logs, finished)


def judge_completion(report: Report, run, logs: list[dict], timeout: float, example: str) -> bool:
    """The first item of a torchrun check; True when the script's work was done."""
    destroyed = all(log["destroyed"] for log in logs)
    finished = run.returncode == 0 or aborted_at_exit(run.returncode, run.output, destroyed)
    if run.timed_out:
        detail = (f"did not finish within {timeout:g} s and was stopped (no process left behind): a rank "
                  f"may wait in a collective the other never calls -- {example}")
    elif run.returncode == 0:
        detail = "exit code 0"
    elif finished:
        detail = ("every rank returned from destroy_process_group; a rank was then aborted (SIGABRT) "
                  "while Python exited, a known race in Gloo's teardown, not your script")
    else:
        detail = f"torchrun exited with code {run.returncode}:\n{_error_excerpt(run.output, run.script)}"
    report.add("runs to completion on 2 ranks", finished and not run.timed_out, detail)
    return finished and not run.timed_out


def judge_leaving(report: Report, logs: list[dict], finished: bool) -> None:
    """The last item of a torchrun check: every rank left the process group."""
    report.add("destroys the process group on every rank",
               all(log["destroyed"] for log in logs) if finished else None,
               "; ".join(f"rank {r} ended without leaving the process group, so torch.distributed "
                         "never learnt it was done with it -- what closes a rank's part in the group?"
                         for r, log in enumerate(logs) if not log["destroyed"]))


def _judge_sampling(report: Report, logs: list[dict], finished: bool) -> None:
    epochs = [log["epochs"] for log in logs]
    if not all(epochs):
        report.add("each epoch, the ranks read disjoint samples that cover the dataset", None,
                   "no rank stepped its optimizer while reading the course's dataset (is it built "
                   "with make_dataset and read through a DataLoader?)"
                   if finished else "the run ended before every rank trained on the dataset")
        report.add("the order changes between epochs (set_epoch)", None)
        return
    n = int(ARGS[ARGS.index("--num-samples") + 1])
    problems = []
    for e in range(min(len(x) for x in epochs)):
        seen = [set(x[e]) for x in epochs]
        both = sorted(seen[0] & seen[1])
        if both:
            problems.append(f"rank 0 and rank 1 both read samples {_few(both)} in epoch {e}: each rank "
                            "drew from the whole dataset -- what gives every rank a part of its own?")
        elif len(seen[0] | seen[1]) < n:
            problems.append(f"in epoch {e} the ranks together read {len(seen[0] | seen[1])} of "
                            f"{n} samples")
        if problems:
            break
    report.add("each epoch, the ranks read disjoint samples that cover the dataset", not problems,
               problems[0] if problems else f"{len(epochs[0])} epochs, {len(epochs[0][0])} samples per rank each")
    orders = epochs[0]
    if problems:
        report.add("the order changes between epochs (set_epoch)", None,
                   "judged once the ranks read disjoint samples")
    elif len(orders) < 2:
        report.add("the order changes between epochs (set_epoch)", None, "fewer than 2 epochs were read")
    else:
        same = orders[0] == orders[1]
        report.add("the order changes between epochs (set_epoch)", not same,
                   "rank 0 read the same samples in the same order in epochs 0 and 1: the sampler "
                   "shuffles from a seed -- what makes a DistributedSampler reshuffle for a new epoch?"
                   if same else "")


def _judge_logging_and_saving(report: Report, run, logs: list[dict], finished: bool) -> None:
    chatty = [r for r in range(1, WORLD_SIZE) if run.rank_stdout.get(r, "").strip()]
    detail = ""
    if chatty:
        first = run.rank_stdout[chatty[0]].strip().splitlines()
        detail = (f"rank {chatty[0]} printed {len(first)} line(s), e.g. {first[0][:80]!r}: every rank runs "
                  "the whole script, so each prints the same log -- which rank speaks for the job?")
    report.add("only rank 0 logs", not chatty, detail)
    savers = [r for r, log in enumerate(logs) if log["saves"]]
    if savers == [0]:
        report.add("only rank 0 writes the checkpoint", True)
    elif not savers:
        failed = not finished
        report.add("only rank 0 writes the checkpoint", None if failed else False,
                   "the run ended before saving" if failed else "no rank called torch.save")
    else:
        others = [r for r in savers if r != 0]
        report.add("only rank 0 writes the checkpoint", False,
                   f"rank {others[0]} also called torch.save({os.path.basename(logs[others[0]]['saves'][0])!r}): "
                   "the replicas hold identical weights, so every rank wrote the same file" if others else
                   "rank 0 did not save")


def _judge_checkpoint(report: Report, logs: list[dict]):
    def wrapped(state):
        keys = [k for k in state if k.startswith("module.")]
        return (f"its keys start with 'module.' (e.g. {keys[0]!r}): the file holds the DDP wrapper's names, "
                "which the plain model does not load -- whose state dict is the plain model's?") if keys else None

    return judge_checkpoint(report, logs, "the checkpoint loads into the plain model (no 'module.' prefix)",
                            wrapped, "the file must hold the plain model's tensors")


def judge_checkpoint(report: Report, logs: list[dict], name: str, wrong, fix: str):
    """Rank 0's last checkpoint, if it is a state dict that loads into the plain MLP; else an
    item saying why not (``wrong(state)``: a message for what the script's kind gets wrong)."""
    saves = logs[0]["saves"]
    if not saves or not os.path.exists(saves[-1]):
        report.add(name, None, "no checkpoint file from rank 0")
        return None
    try:
        state = torch.load(saves[-1], map_location="cpu")
    except Exception as err:  # e.g. DTensors: they do not load without their process group
        report.add(name, False, f"torch.load could not read it ({type(err).__name__}): {fix}")
        return None
    if not isinstance(state, dict):
        report.add(name, False, f"the checkpoint holds a {type(state).__name__}, not a state dict")
        return None
    problem = wrong(state)
    if problem:
        report.add(name, False, problem)
        return None
    try:
        models.MLP().load_state_dict(state)
    except RuntimeError as err:
        report.add(name, False, str(err).splitlines()[0])
        return None
    report.add(name, True)
    return state


def _judge_weights(report: Report, weights) -> None:
    name = "final weights equal the reference solution's (same seed, 2 ranks)"
    if weights is None:
        report.add(name, None, "no loadable checkpoint to compare")
        return
    reference = reference_weights()
    diff = max((weights[k] - reference[k]).abs().max().item() for k in reference)
    report.add(name, diff <= TOLERANCE,
               f"largest difference {diff:.1e}" + ("" if diff <= TOLERANCE else
               " -- are gradients averaged (not summed)? is the learning rate unchanged? do "
               "all ranks start from the same seed?"))


def reference_weights(timeout: float = 180.0) -> dict:
    """The reference solution's final weights for ``ARGS`` on 2 ranks (computed once per process)."""
    key = (tuple(ARGS), WORLD_SIZE)
    if key not in _reference_cache:
        with tempfile.TemporaryDirectory(prefix="dpcourse-reference-a-") as work:
            run = torchrun(scripts.path("train_ddp"), ARGS, work, WORLD_SIZE, timeout)
            logs = [read_log(run.observed, r) for r in range(WORLD_SIZE)]
            done = all(log["destroyed"] for log in logs)
            if run.returncode != 0 and not aborted_at_exit(run.returncode, run.output, done):
                raise RuntimeError(f"the reference solution failed:\n{_tail(run.output)}")
            _reference_cache[key] = torch.load(os.path.join(work, "model.pt"), map_location="cpu")
    return _reference_cache[key]


def _same_text(a: str, b: str) -> bool:
    with open(a, errors="replace") as f, open(b, errors="replace") as g:
        return f.read().strip() == g.read().strip()


def _few(values: list[int], k: int = 3) -> str:
    shown = ", ".join(map(str, values[:k]))
    return shown + (f" (and {len(values) - k} more)" if len(values) > k else "")


def _error_excerpt(output: str, script: str) -> str:
    """The learner's Python error from torchrun's output (torchrun's own summary says less)."""
    lines = [re.sub(r"^\[(default)?rank\d+\]: ?", "", line) for line in output.splitlines()]
    mine = [i for i, line in enumerate(lines) if f'File "{script}"' in line]
    if not mine:
        return _tail(output)
    headers = [i for i in range(mine[0]) if lines[i].startswith("Traceback (most recent call last)")]
    start = headers[-1] if headers else mine[0]  # a SyntaxError has no header
    excerpt = []
    for line in lines[start:]:
        excerpt.append(line)
        if line and not line.startswith((" ", "Traceback")):  # the exception line ends it
            break
    return "\n".join(excerpt[-12:])


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
