"""Exercises A and F: a learner's training script under torchrun, next to the starter
``train_lm.py`` run as one process on the global batch, and the judges of the run itself
(it completes, who reads, logs and saves what, the checkpoint, leaving the group).

Both runs carry the course's observer (``recorder.py``), so every judge reads what the ranks
*did*: which samples each pass read, every collective and the backward pass it ran in, the
learning rate and the gradients before each optimizer step, what was printed and saved. Any
correct conversion passes; each failed item names the behaviour it saw and asks for the idea
behind it, never the line that fixes it.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

from .. import models
from ..grading import provenance
from . import starters
from .known_errors import first_cause, lost_a_peer, with_hint
from .recorder import read_log
from ..grading.report import Report
from ..grading.torchrun import torchrun
from ..processes import PACKAGE_ROOT, aborted_at_exit

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")   # its sitecustomize records a worker

WORLD_SIZE = 2
MODEL = "tied_transformer"
VAL_SEED = 15  # the starter's validation set: make_dataset(MODEL, --val-samples, seed=VAL_SEED)
VAL_LOSS = re.compile(r"val_loss\W+([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)")
_single_cache: dict[tuple, "SingleRun"] = {}


@dataclass
class Setting:
    """What one exercise's check passes and allows. ``args``: the learner's script's options
    (``--batch-size`` per rank); ``collective``: the one that synchronises gradients
    ("all_reduce" for DDP, "reduce_scatter" for FSDP); tolerances: of the printed val_loss
    (absolute), of the first step's gradient norm and of the final weights (relative)."""

    args: list[str]
    collective: str
    val_tolerance: float
    grad_tolerance: float
    weight_tolerance: float
    sync_idea: str  # the question a failed synchronisation item asks
    # the batch size of a second run, judged once the first passes: four times the micro-batches
    # (still a whole number of optimizer steps per epoch) and, on each rank, another number of
    # validation batches (37 sequences on 2 ranks are 19 and 18: in batches of 2, 10 on one rank
    # and 9 on the other, where batches of 8 make 3 on each)
    second_batch_size: int = 2

    def arg(self, name: str) -> str:
        return self.args[self.args.index(name) + 1]

    def with_batch_size(self, size: int) -> "Setting":
        args = list(self.args)
        args[args.index("--batch-size") + 1] = str(size)
        return dataclasses.replace(self, args=args)


@dataclass
class SingleRun:
    """The starter as one process on the global batch: its printed val_loss per epoch, its
    log (learning rates, gradients before clipping) and its final weights."""

    val_losses: list[float]
    log: dict
    state: dict


def check_script(report: Report, path: str, unchanged: str, setting: Setting, timeout: float, judge) -> Report:
    """Run the learner's script on 2 ranks under torchrun (and the starter as one process
    beside it) and have ``judge(report, run, single, setting, timeout)`` fill the report;
    once it passes, again with ``setting.second_batch_size``, where a script right for one
    batch size only fails, saying which; "not attempted" when the script is missing or still
    the starter."""
    if not os.path.exists(path):
        report.attempted = False
        report.note = f"Write {path!r} (start from a copy of train_lm.py), then run this cell again."
        return report
    if _same_text(path, starters.path("train_lm")):
        report.attempted = False
        report.note = f"{path!r} is still train_lm.py, unchanged: {unchanged}."
        return report
    _judge_run(report, path, setting, timeout, judge)
    if report.passed and setting.second_batch_size:
        first, other = setting.arg("--batch-size"), setting.with_batch_size(setting.second_batch_size)
        again = dataclasses.replace(report, items=[], note="")
        _judge_run(again, path, other, timeout, judge)
        if again.passed:
            report.note = f"Judged with --batch-size {first} and again with {setting.second_batch_size}."
        else:
            for item in again.items:
                if item.status == "fail":
                    item.detail = f"with --batch-size {setting.second_batch_size} (it passed with {first}): {item.detail}"
            report.items = again.items
    with open(path, errors="replace") as f, open(starters.path("train_lm")) as g:
        if provenance.embeds(f.read(), report.key, g.read()):
            provenance.shown(report.key)     # its text is in the script: the report says so
    if not report.passed:
        report.note = "Each failed item says what the ranks did. To compare with a reference: report.fix()."
    return report


def _judge_run(report: Report, path: str, setting: Setting, timeout: float, judge) -> None:
    pending = _start_single(setting.args)
    with tempfile.TemporaryDirectory(prefix="dpcourse-check-") as work:
        run = torchrun(path, setting.args, work, WORLD_SIZE, timeout, site=SITE)
        provenance.from_log(run.observed)   # a reference the script's workers read
        judge(report, run, pending(), setting, timeout)


def single_args(args: list[str]) -> list[str]:
    """The starter's options for one process training the same global batch."""
    out = list(args)
    i = out.index("--batch-size")
    out[i + 1] = str(int(out[i + 1]) * WORLD_SIZE)
    return out


def _start_single(args: list[str]):
    """Start the starter as one process (observed); return a function that waits for it."""
    key = tuple(args)
    if key in _single_cache:
        return lambda: _single_cache[key]
    work = tempfile.TemporaryDirectory(prefix="dpcourse-single-")
    observed = os.path.join(work.name, ".observed")
    os.makedirs(observed)
    argv = single_args(args)
    argv[argv.index("--out") + 1] = os.path.join(work.name, "model.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DPCOURSE_OBSERVE_DIR": observed, "RANK": "0",
           "PYTHONPATH": os.pathsep.join([SITE, PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, starters.path("train_lm"), *argv], cwd=work.name, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait() -> SingleRun:
        with work:
            output, _ = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"train_lm.py failed as one process:\n{tail(output)}")
            _single_cache[key] = SingleRun([float(v) for v in VAL_LOSS.findall(output)], read_log(observed, 0),
                                           torch.load(os.path.join(work.name, "model.pt"), map_location="cpu"))
        return _single_cache[key]

    return wait


# --- the items every torchrun check has (equivalence.py: those that compare with one process) ---

def judge_completion(report: Report, run, logs: list[dict], timeout: float, example: str) -> bool:
    """The first item of a torchrun check; True when the script's work was done."""
    destroyed = all(log["destroyed"] for log in logs)
    finished = run.returncode == 0 or aborted_at_exit(run.returncode, run.output, destroyed)
    if run.hung:
        detail = (f"stopped after {run.seconds:.0f} s, because the ranks could no longer meet: {run.where}. "
                  f"A collective completes only once every rank of the group calls it -- {example}")
    elif run.timed_out:
        detail = (f"did not finish within {timeout:g} s and was stopped (no process left behind): "
                  f"{run.where or 'no rank reached a collective'}. A rank may wait in a collective the "
                  f"other never calls -- {example}")
    elif run.returncode == 0:
        detail = "exit code 0"
    elif finished:
        detail = ("every rank returned from destroy_process_group; a rank was then aborted (SIGABRT) "
                  "while Python exited, a known race in Gloo's teardown, not your script")
    else:
        detail = f"torchrun exited with code {run.returncode}:\n{error_excerpt(run.output, run.script)}"
        if lost_a_peer(detail):  # this rank only lost its peer: what the other said first, when it is known
            cause = first_cause(run.output)
            detail += f"\nAnother rank said first: {cause}" if cause else ""
        detail = with_hint(detail)
    report.add("runs to completion on 2 ranks", finished and not run.timed_out, detail)
    return finished and not run.timed_out


def judge_sampling(report: Report, logs: list[dict], finished: bool, num_samples: int) -> None:
    epochs = [log["epochs"] for log in logs]
    if not all(epochs):
        report.add("each epoch, the ranks read disjoint samples that cover the dataset", None,
                   "no rank stepped its optimizer while reading the course's dataset (is it built "
                   "with make_dataset and read through a DataLoader?)"
                   if finished else "the run ended before every rank trained on the dataset")
        report.add("the order changes between epochs (set_epoch)", None)
        return
    problems = []
    for e in range(min(len(x) for x in epochs)):
        seen = [set(x[e]) for x in epochs]
        both = sorted(seen[0] & seen[1])
        if both:
            problems.append(f"rank 0 and rank 1 both read samples {few(both)} in epoch {e}: each rank "
                            "drew from the whole dataset -- what gives every rank a part of its own?")
        elif len(seen[0] | seen[1]) < num_samples:
            problems.append(f"in epoch {e} the ranks together read {len(seen[0] | seen[1])} of "
                            f"{num_samples} samples")
        if problems:
            break
    report.add("each epoch, the ranks read disjoint samples that cover the dataset", not problems,
               problems[0] if problems else f"{len(epochs[0])} epochs, {len(epochs[0][0])} samples per rank each")
    orders = epochs[0]
    if problems:
        report.add("the order changes between epochs (set_epoch)", None, "judged once the ranks read disjoint samples")
    elif len(orders) < 2:
        report.add("the order changes between epochs (set_epoch)", None, "fewer than 2 epochs were read")
    else:
        same = orders[0] == orders[1]
        report.add("the order changes between epochs (set_epoch)", not same,
                   "rank 0 read the same samples in the same order in epochs 0 and 1: the sampler "
                   "shuffles from a seed -- what makes a DistributedSampler reshuffle for a new epoch?"
                   if same else "")


def judge_logging_and_saving(report: Report, run, logs: list[dict], finished: bool) -> None:
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


def judge_checkpoint(report: Report, logs: list[dict], name: str, wrong, fix: str):
    """Rank 0's last checkpoint, if it is a state dict that loads into the plain model; else
    an item saying why not (``wrong(state)``: a message for what the script's kind gets wrong)."""
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
        models.build_model(MODEL).load_state_dict(state)
    except RuntimeError as err:
        report.add(name, False, str(err).splitlines()[0])
        return None
    report.add(name, True)
    return state


def judge_leaving(report: Report, logs: list[dict], finished: bool) -> None:
    """The last item of a torchrun check: every rank left the process group."""
    if not finished:
        report.add("destroys the process group on every rank", None, "judged once the script runs to its end")
        return
    report.add("destroys the process group on every rank", all(log["destroyed"] for log in logs),
               "; ".join(f"rank {r} ended without leaving the process group, so torch.distributed "
                         "never learnt it was done with it -- what closes a rank's part in the group?"
                         for r, log in enumerate(logs) if not log["destroyed"]))


# --- helpers ---------------------------------------------------------------------------------

def _same_text(a: str, b: str) -> bool:
    with open(a, errors="replace") as f, open(b, errors="replace") as g:
        return f.read().strip() == g.read().strip()


def few(values: list[int], k: int = 3) -> str:
    shown = ", ".join(map(str, values[:k]))
    return shown + (f" (and {len(values) - k} more)" if len(values) > k else "")


def error_excerpt(output: str, script: str) -> str:
    """The learner's Python error from torchrun's output (torchrun's own summary says less)."""
    lines = [re.sub(r"^\[(default)?rank\d+\]: ?", "", line) for line in output.splitlines()]
    mine = [i for i, line in enumerate(lines) if f'File "{script}"' in line]
    if not mine:
        return tail(output)
    headers = [i for i in range(mine[0]) if lines[i].startswith("Traceback (most recent call last)")]
    start = headers[-1] if headers else mine[0]  # a SyntaxError has no header
    excerpt = []
    for line in lines[start:]:
        excerpt.append(line)
        if line and not line.startswith((" ", "Traceback")):  # the exception line ends it
            break
    return "\n".join(excerpt[-12:])


def tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
