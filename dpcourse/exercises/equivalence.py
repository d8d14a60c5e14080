"""The judges that compare a learner's run with one process's: exercises A and F ask the same
training of their data-parallel scripts as of ``train_lm.py`` on the global batch.

Each reads the ranks' logs (``recorder.py``) beside the single-process run's: the backward
pass every gradient collective ran in, the gradient and the learning rate at every optimizer
step, the val_loss rank 0 printed and the sequences each rank scored, the final weights.
"""
from __future__ import annotations

import math
from collections import Counter

import torch

from .. import models
from ..grading.report import Report
from .script_check import (MODEL, VAL_LOSS, VAL_SEED, WORLD_SIZE, Setting, SingleRun, few, judge_leaving,
                           judge_logging_and_saving)


def judge_synchronisation(report: Report, logs: list[dict], setting: Setting, what: str,
                          other: str | None = None) -> None:
    """Gradient accumulation: the gradients cross the ranks once per optimizer step, in the
    backward pass of its last micro-batch (``what``: the wrapper's name, e.g. "DDP"; ``other``:
    why the run is not of the exercise's kind (``not_ddp``), said when its collective never ran)."""
    name = f"gradients are synchronised once per optimizer step: {setting.collective.replace('_', '-')}s " \
           "only in the last micro-batch's backward"
    accum = int(setting.arg("--accum-steps"))
    log = logs[0]
    steps = sorted(log["lrs"])
    if not steps or not log["backwards"]:
        report.add(name, None, "judged once rank 0 has taken an optimizer step after a backward pass")
        return
    passes = [log["backwards"].get(k, 0) for k in steps]
    if any(n != accum for n in passes):
        k = next(k for k, n in zip(steps, passes) if n != accum)
        report.add(name, False, f"optimizer step {k} came after {log['backwards'].get(k, 0)} backward pass(es), "
                   f"not --accum-steps {accum}: how many micro-batches make one optimizer step?")
        return
    for k in steps:
        inside = [c[6] for c in log["comms"] if c[0] == k and c[1] == setting.collective and c[6]]
        early = sorted({n for n in inside if n < accum})
        if early:
            report.add(name, False, f"in optimizer step {k}, {what} ran {setting.collective.replace('_', '-')}s in the "
                       f"backward pass of micro-batch {', '.join(map(str, early))} of {accum}, not only in "
                       f"the last: the micro-batches "
                       f"before the last only need to add to each rank's own gradients -- {setting.sync_idea}")
            return
        if accum not in inside:
            report.add(name, False, f"in optimizer step {k} no {setting.collective.replace('_', '-')} ran in any "
                       "backward pass: " + (other or "are the gradients combined over the ranks at all?"))
            return
    report.add(name, True, f"{len(steps)} steps of {accum} backward passes each, the "
               f"{setting.collective.replace('_', '-')}s in the last one")


def global_squares(logs: list[dict], key: str, step: int) -> float | None:
    """The sum of squares of the whole gradient before ``step`` (``key`` "before_clip": after
    the step's last backward, "grads": at the step): the ranks' parts added up when they
    hold shards."""
    if any(step not in log[key] for log in logs):
        return None
    sharded = all(log["shards"] and log["shards"][2] == log["shards"][3] for log in logs)
    return sum(log[key][step] for log in logs) if sharded else logs[0][key][step]


def changed_between_backwards(logs: list[dict], steps: list[int] | None = None) -> str | None:
    """What changed a rank's gradients between two backward passes of one optimizer step, in
    words (None: nothing did). Accumulation only adds: each backward pass must begin with the
    gradients the one before left; a smaller norm means they were clipped or scaled before the
    step's gradient was complete, a zero that they were zeroed. (Under FSDP's accumulation the
    .grad of the shards stays empty until the reduce-scatter: nothing to compare.)"""
    for r, log in enumerate(logs):
        accumulated = log.get("accumulated", {})
        for step in sorted(accumulated) if steps is None else steps:
            passes = accumulated.get(step, [])
            for k in range(1, len(passes)):
                left, found = passes[k - 1][1], passes[k][0]
                if not left:
                    continue
                between = (f"on rank {r}, between the backward passes of micro-batches {k} and {k + 1} of "
                           f"optimizer step {step}")
                if found == 0:
                    return (f"{between}, the gradients were set to zero: the micro-batches before were lost "
                            "from the step -- when may the gradients be zeroed?")
                if found < left * (1 - 1e-6):
                    return (f"{between}, the gradients' norm fell from {math.sqrt(left):.4g} to "
                            f"{math.sqrt(found):.4g}: they were clipped per micro-batch, before the step's "
                            "gradient was complete, so each micro-batch's share was cut on its own -- clipping "
                            "bounds the norm of the whole accumulated gradient: when is that gradient complete?")
    return None


def same_order_every_epoch(logs: list[dict], single: SingleRun) -> str | None:
    """In words, when every rank read the same samples in the same order in every epoch while
    one process read a new order each epoch (None otherwise): judged from what the ranks read."""
    orders = [log["epochs"] for log in logs]
    if not all(len(o) >= 2 for o in orders) or any(o[e] != o[0] for o in orders for e in range(1, len(o))):
        return None
    theirs = single.log["epochs"]
    if len(theirs) >= 2 and theirs[0] == theirs[1]:
        return None
    return (f"every rank read the same samples in the same order in all {len(orders[0])} epochs: the shuffle "
            "did not change between epochs, while one process reads a new order every epoch, and the "
            "weights follow the order the samples come in")


def not_ddp(logs: list[dict]) -> str | None:
    """Why a run is not exercise A's kind (DDP, computing in float32), from its collectives and
    its optimizer's parameters; None when nothing says so."""
    log = logs[0]
    scattered = any(c[1] == "reduce_scatter" for c in log["comms"])
    sharded = bool(log["shards"] and log["shards"][2])
    low = sorted({f"{c[1].replace('_', '-')}s carried {c[2]}" for c in log["comms"] if c[2] in ("bfloat16", "float16")})
    if not (scattered or sharded or low):
        return None
    seen = (["the gradients were reduce-scattered"] if scattered else []) + \
           (["the optimizer stepped DTensor shards"] if sharded else []) + low
    kind = "a sharded (FSDP) script" if scattered or sharded else "a script that communicates in 16 bits"
    precision = " computing in 16-bit precision" if low and (scattered or sharded) else ""
    return (f"{'; '.join(seen)}: this is {kind}{precision}, not DDP in float32. Exercise A compares a DDP "
            "script with one float32 process, to float32's rounding, so every comparison below reads its "
            "sharding and rounding as mistakes -- is this the script for exercise F (check_f)?")


def rounding_of(logs: list[dict]) -> str | None:
    """The 16-bit dtype the run computed or communicated in, in a few words (None: none)."""
    low = sorted({c[2] for c in logs[0]["comms"] if c[2] in ("bfloat16", "float16")})
    return f"the ranks computed in {' and '.join(low)}" if low else None


def judge_gradient(report: Report, logs: list[dict], single: SingleRun, setting: Setting) -> None:
    """The first optimizer step's gradient, before clipping, has one process's norm."""
    name = "the first step's gradient equals one process's on the global batch (its norm before clipping)"
    mine = global_squares(logs, "before_clip", 0)
    theirs = single.log["before_clip"].get(0)
    if mine is None or theirs is None:
        report.add(name, None, "judged at the first optimizer step, which a rank never reached")
        return
    if mine == 0:
        report.add(name, None, "the optimizer's parameters had no gradient after the backward passes (it holds "
                   "parameters the model no longer uses?)")
        return
    ratio = math.sqrt(mine / theirs) if theirs else float("inf")
    if abs(ratio - 1) <= setting.grad_tolerance:
        report.add(name, True, f"{math.sqrt(mine):.4g} against one process's {math.sqrt(theirs):.4g}")
        return
    accum = int(setting.arg("--accum-steps"))
    detail = f"its norm was {math.sqrt(mine):.4g}, {ratio:.3g}x one process's {math.sqrt(theirs):.4g}"
    changed = changed_between_backwards(logs, steps=[0])
    if changed:
        detail += f": {changed}"
    elif abs(ratio - accum) <= 0.1 * accum:
        detail += (f": about --accum-steps ({accum}) times too large, so the gradients of the {accum} "
                   "micro-batches were added up, not averaged -- what share of the step's loss is one "
                   "micro-batch's loss?")
    elif abs(ratio - WORLD_SIZE) <= 0.1 * WORLD_SIZE:
        detail += " -- about the number of ranks: are the ranks' gradients averaged, or summed?"
    else:
        detail += (" -- is the loss a mean over each rank's micro-batch, and is every rank's model the "
                   "same before the first step?")
    report.add(name, False, detail)


def judge_learning_rate(report: Report, logs: list[dict], single: SingleRun) -> None:
    name = "the learning rate at every optimizer step equals one process's"
    mine, theirs = logs[0]["lrs"], single.log["lrs"]
    if not mine:
        report.add(name, None, "judged at the optimizer steps, which rank 0 never took")
        return
    steps = sorted(set(mine) & set(theirs))
    wrong = [k for k in steps if abs(mine[k] - theirs[k]) > 1e-6 * max(abs(theirs[k]), 1e-12)]
    if not wrong and len(mine) == len(theirs):
        report.add(name, True, f"{len(steps)} steps, from {theirs[steps[0]]:.3g} to {theirs[steps[-1]]:.3g}")
        return
    if not wrong:
        report.add(name, False, f"rank 0 took {len(mine)} optimizer steps, one process {len(theirs)}")
        return
    k = wrong[0]
    detail = f"at optimizer step {k} it was {mine[k]:.4g}, one process's {theirs[k]:.4g}"
    later = sorted(theirs)
    ahead = [j for j in later if j > k and abs(theirs[j] - mine[k]) <= 1e-6 * abs(theirs[j])]
    if ahead:
        detail += (f" (one process's rate at step {ahead[0]}): the schedule ran ahead of the optimizer -- "
                   "how often may a schedule move when one step takes several micro-batches?")
    else:
        detail += (" -- the schedule's length is counted in optimizer steps: how many does each rank take "
                   "in the whole run?")
    report.add(name, False, detail)


def judge_validation(report: Report, run, logs: list[dict], single: SingleRun, setting: Setting,
                     weights: dict | None, other: str | None = None) -> None:
    """The val_loss rank 0 prints last is the whole validation set's mean loss per token under
    the weights rank 0 then saved (so a training that went wrong elsewhere does not count
    here); without a loadable checkpoint, every epoch's is one process's. ``other``: why the
    run is not of the exercise's kind, which then explains a difference instead of the reads."""
    name = "the val_loss rank 0 prints is the mean loss per token over the whole validation set"
    printed = [float(v) for v in VAL_LOSS.findall(run.rank_stdout.get(0, ""))]
    if not printed:
        report.add(name, None if not run.rank_stdout.get(0) else False,
                   "rank 0 printed no val_loss (the checker reads the starter's `val_loss` on each epoch's line)")
        return
    epochs = len(single.val_losses)
    if len(printed) < epochs:
        report.add(name, False, f"rank 0 printed {len(printed)} val_loss value(s) in {epochs} epochs")
        return
    size = int(setting.arg("--val-samples"))
    losses = sequence_losses(weights, size) if weights is not None else None
    if losses is not None:
        e, expected = epochs - 1, float(losses.mean())
        whose = "the whole set's mean under the weights rank 0 saved"
    else:
        off = [e for e in range(epochs) if abs(printed[e] - single.val_losses[e]) > setting.val_tolerance]
        e = off[0] if off else epochs - 1
        expected, whose = single.val_losses[e], "one process's whole-set mean"
    if abs(printed[e] - expected) <= setting.val_tolerance:
        report.add(name, True, f"epoch {e}: {printed[e]:.6f}, {whose} {expected:.6f}")
        return
    detail = f"epoch {e}: rank 0 printed {printed[e]:.6f}, {whose} is {expected:.6f}"
    if other:
        report.add(name, False, f"{detail}: {other}")
        return
    passes = [log["evaluations"][e] if len(log["evaluations"]) > e else [] for log in logs]
    report.add(name, False, detail + _what_was_averaged(printed[e], passes, losses, size, setting.val_tolerance))


def _what_was_averaged(printed: float, passes: list[list[int]], losses, size: int, tolerance: float) -> str:
    """Why a printed val_loss is off, from the sequences each rank read in that validation
    pass: the mean it equals (when the sequences' losses are known), else what the reads show."""
    reads = Counter(i for rank_reads in passes for i in rank_reads)
    twice = sorted(i for i, n in reads.items() if n > 1)
    padded = (f"; that is the mean with sequence {few(twice)} counted twice ({sum(reads.values())} reads for {size} "
              "sequences): a DistributedSampler repeats sequences until every rank has as many -- what does a "
              "repeated sequence do to a mean, and which sequences must the sums leave out?")
    own = len(set(passes[0]))
    alone = (f"; that is the mean over the {own} sequences rank 0 scored itself -- does its number include the "
             "losses the other rank computed?")
    means = ("; that is the mean of the ranks' own means, although their shares differ in size -- what must the "
             "ranks add up before anyone divides?")
    missing = f"; that is the mean over the {len(reads)} of {size} sequences the ranks read -- which did no rank score?"
    if losses is not None and reads:
        def mean(counts: Counter) -> float:
            return sum(float(losses[i]) * n for i, n in counts.items()) / sum(counts.values())

        candidates = [(mean(reads), padded if twice else missing if len(reads) < size else "")]
        if passes[0]:
            candidates += [(mean(Counter(passes[0])), alone), (mean(Counter(set(passes[0]))), alone)]
        if all(passes) and len({len(p) for p in passes}) > 1:  # equal shares: the same as the padded mean
            candidates.append((sum(mean(Counter(p)) for p in passes) / len(passes), means))
        close = [(abs(value - printed), words) for value, words in candidates if words]
        best = min(close, key=lambda c: c[0], default=None)  # a tie: the first, the root cause
        if best is not None and best[0] <= tolerance:
            return best[1]
    if twice:
        return padded.replace("; that is the mean", "; in that pass the ranks read the validation set")
    return (" -- is it the sum of every token's loss over the number of tokens, over all ranks' sequences (the "
            "last batch is shorter)?")


def sequence_losses(weights: dict, size: int):
    """Each validation sequence's mean loss per token under ``weights`` (all are equally long,
    so their mean is the starter's val_loss); None when they do not load."""
    model = models.build_model(MODEL)
    try:
        model.load_state_dict({k: v.float() for k, v in weights.items()})
    except (RuntimeError, AttributeError):
        return None
    x, y = models.make_dataset(MODEL, size, seed=VAL_SEED).tensors
    with torch.no_grad():
        token_losses = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).double(), y.flatten(), reduction="none")
    return token_losses.view(len(x), -1).mean(1)


def rank0_weights(logs: list[dict]) -> dict | None:
    """The plain model's weights in rank 0's last checkpoint (a wrapper's 'module.' names
    unwrapped), or None when there is none that loads."""
    saves = logs[0]["saves"]
    try:
        state = torch.load(saves[-1], map_location="cpu")
        state = {k.removeprefix("module."): v for k, v in state.items()}
        models.build_model(MODEL).load_state_dict(state)
        return state
    except Exception:  # no file, not a state dict, DTensors, other keys: the checkpoint item says why
        return None


def weight_distance(weights: dict, reference: dict) -> float:
    """|weights - reference| / |reference - initial weights|: how far apart the two runs
    ended, as a share of how far one process travelled (AdamW turns rounding differences in
    tiny gradients into visible ones, so the largest single difference says little)."""
    initial = models.build_model(MODEL).state_dict()
    apart = sum(float((weights[k].float() - reference[k]).pow(2).sum()) for k in reference)
    travelled = sum(float((reference[k] - initial[k]).pow(2).sum()) for k in reference)
    return math.sqrt(apart / travelled)


def judge_weights(report: Report, weights, single: SingleRun, setting: Setting, idea: str) -> None:
    name = "final weights equal one process training the global batch (train_lm.py)"
    if weights is None:
        report.add(name, None, "no loadable checkpoint to compare")
        return
    apart = weight_distance(weights, single.state)
    tie = (weights["tok.weight"].float() - weights["head.weight"].float()).abs().max().item()
    if tie > 0:
        report.add(name, False, f"the embedding and the head differ by up to {tie:.1e}: in the plain model they "
                   "are one tensor, used twice -- did both uses stay one parameter?")
        return
    ok = apart <= setting.weight_tolerance
    report.add(name, ok, f"{100 * apart:.3g} % of the distance one process's weights travelled"
               + ("" if ok else f", more than the {100 * setting.weight_tolerance:.2g} % rounding explains -- {idea}"))


def judge_the_outcome(report: Report, run, logs: list[dict], single: SingleRun, setting: Setting, finished: bool,
                      judge_checkpoint, idea: str, other: str | None = None) -> None:
    """The items a training script's check ends with, in this order: learning rate, validation
    loss, logging and saving, the checkpoint (``judge_checkpoint(report, logs)``: its weights, judged
    once every rank finished), the final weights against one process's (``idea``: what to look at
    when they differ, unless the ranks' logs show the cause: ``other``, the script is not of the
    exercise's kind (``not_ddp``); gradients changed between micro-batches; the same order every
    epoch), and leaving the process group."""
    judge_learning_rate(report, logs, single)
    rounding = (f"{rounding_of(logs) or 'the run is not DDP in float32'} (see the synchronisation item), and "
                "exercise A's comparison holds to float32's rounding only") if other else None
    judge_validation(report, run, logs, single, setting, rank0_weights(logs) if finished else None, rounding)
    judge_logging_and_saving(report, run, logs, finished)
    weights = judge_checkpoint(report, logs) if finished else None
    cause = ("the run is not DDP in float32 (see the synchronisation item)" if other else
             changed_between_backwards(logs) or same_order_every_epoch(logs, single))
    judge_weights(report, weights, single, setting, cause or idea)
    judge_leaving(report, logs, finished)
