"""4.2e's try-it ``eval_metric``: an accuracy over 13 samples, a part on every rank, each counted
once. Its set-up on the ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch

from ... import models
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .at_work import TIMEOUT

N_EVAL = 13   # samples: not a multiple of 2, 3 or 4 ranks


def _labelled(n: int = N_EVAL):
    """A dataset of (x, label) the MLP gets right about two times in three, and its accuracy."""
    from torch.utils.data import TensorDataset

    model = models.build_model("mlp", seed=0)
    x = models.make_dataset("mlp", n).tensors[0]
    with torch.no_grad():
        guess = model(x).argmax(dim=1)
    wrong = torch.arange(n) % 3 == 0
    label = torch.where(wrong, (guess + 1) % guess.new_tensor(8), guess)
    return TensorDataset(x, label), float((~wrong).sum()) / n


def _accuracy_on_rank(accuracy):
    dataset, _ = _labelled()
    model = models.build_model("mlp", seed=0)
    rows = []
    model.register_forward_pre_hook(lambda module, args: rows.append(args[0].detach().clone()))
    value = accuracy(model, dataset)
    x = dataset.tensors[0]
    seen = []
    for row in torch.cat(rows) if rows else []:
        hits = (x == row).all(dim=1).nonzero()
        seen.append(int(hits[0]) if len(hits) else -1)
    return {"value": float(value) if isinstance(value, (int, float, torch.Tensor)) else value, "seen": seen}


def _part_accuracy(seen: list) -> float | None:
    """The accuracy one rank finds on the samples it read (``_labelled`` marks every third wrong)."""
    known = [i for i in seen if i >= 0]
    return sum(i % 3 != 0 for i in known) / len(known) if known else None


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {' and '.join(map(str, ranks))}"


def _judge_shared(report: Report, item: str, got: list) -> bool:
    """Item ``item``: every rank read a part, each sample once, by one rank. True when some
    sample was read by two ranks or by none (the value then cannot be the whole set's)."""
    reads: dict[int, list[int]] = {}
    for rank, r in enumerate(got):
        for i in r["seen"]:
            reads.setdefault(i, []).append(rank)
    twice = {i: ranks for i, ranks in sorted(reads.items()) if len(set(ranks)) > 1}
    missing = [i for i in range(N_EVAL) if i not in reads]
    again = {r: sorted(i for i in set(g["seen"]) if g["seen"].count(i) > 1) for r, g in enumerate(got)}
    again = {r: d for r, d in again.items() if d}
    idle = [r for r, g in enumerate(got) if not g["seen"]]
    if len(idle) == len(got):
        report.add(item, False, "the model handed to the function was shown no sample on any rank: the "
                                "function evaluated another model. Which model does the check ask about?")
    elif all(set(g["seen"]) >= set(range(N_EVAL)) for g in got):
        report.add(item, False, f"each rank read all {N_EVAL} samples: every rank went through the whole "
                                "dataset. Which part of it is this rank's?")
    elif again:
        r, dup = next(iter(again.items()))
        part, times = set(got[r]["seen"]), {got[r]["seen"].count(i) for i in set(got[r]["seen"])}
        said = (f"each of its {len(part)} samples {times.pop()} times" if len(times) == 1 else
                f"{len(dup)} of its {len(part)} samples more than once (sample {dup[0]} "
                f"{got[r]['seen'].count(dup[0])} times)")
        report.add(item, False, f"rank {r} read {said}: the rank went through its own part again. How many "
                                "passes over its part does one evaluation make?")
    elif twice and len({len(g["seen"]) for g in got}) == 1 and len(twice) < len(got):
        i, ranks = next(iter(twice.items()))
        report.add(item, False, f"sample {i} was counted by {_ranks(set(ranks))}: {N_EVAL} samples do not "
                                f"divide among {len(got)} ranks, and the parts were made equal by repeating "
                                "samples. Must every rank read as many samples in evaluation?")
    elif twice:  # parts that overlap beyond an even-out: they were not cut by this world size
        i, ranks = next(iter(twice.items()))
        report.add(item, False, f"sample {i} was counted by {_ranks(set(ranks))}, and {len(twice)} samples in all "
                                f"by more than one rank on {len(got)} ranks: the parts overlap. Are they cut by "
                                "the number of ranks there are, each rank taking the part its rank names?")
    elif missing:
        report.add(item, False, f"samples {missing[:4]} were read by no rank: the uneven tail was left out. "
                                "Must every rank read as many samples in evaluation?")
    elif idle:
        busy = [r for r in range(len(got)) if r not in idle]
        report.add(item, False, f"{_ranks(busy)} read all {N_EVAL} samples and {_ranks(idle)} none: the "
                                "evaluation was not shared. How can every rank take a part of the dataset?")
    else:
        report.add(item, True)
    return bool(twice or missing)


def _judge_value(report: Report, item: str, got: list, skewed: bool) -> None:
    """Item ``item``: every rank returned the whole dataset's accuracy, said by what it returned."""
    want, values = _labelled()[1], [r["value"] for r in got]
    parts = [_part_accuracy(r["seen"]) for r in got]
    near = lambda a, b: a is not None and abs(a - b) <= 1e-6  # noqa: E731
    if not all(isinstance(v, float) for v in values):
        report.add(item, False, f"the function returned {type(values[0]).__name__}, not a number")
        return
    shown = ", ".join(f"rank {r} {v:.4f}" for r, v in enumerate(values))
    whole = [r for r, v in enumerate(values) if near(v, want)]
    if len(whole) == len(values):
        report.add(item, True)
    elif max(values) - min(values) > 1e-6 and all(near(p, v) for p, v in zip(parts, values)):
        report.add(item, False, f"the ranks returned different values ({shown}): each one's own part. "
                                "What brings every rank's counts together?")
    elif max(values) - min(values) > 1e-6 and whole:
        report.add(item, False, f"the ranks returned different values ({shown}): {_ranks(whole)} the whole "
                                f"dataset's accuracy, {_ranks(set(range(len(values))) - set(whole))} not: the "
                                "counts reached one rank only. Which collective leaves the sum on every rank?")
    elif max(values) - min(values) > 1e-6:
        report.add(item, False, f"the ranks returned different values ({shown}), and one process on the whole "
                                "dataset finds another. What brings every rank's counts together?")
    elif skewed:
        report.add(item, False, f"the ranks agree on {values[0]:.4f}, one process on the whole dataset "
                                "finds another value: the samples counted twice or never weigh in it")
    elif None not in parts and near(values[0], sum(parts) / len(parts)):
        report.add(item, False, f"the ranks agree on {values[0]:.4f}, the mean of their own parts' accuracies; "
                                "one process on the whole dataset finds another value, and the ranks hold "
                                "different numbers of samples. Does averaging the ranks' own accuracies "
                                "weigh every sample alike?")
    else:
        report.add(item, False, f"the ranks agree on {values[0]:.4f}, though every sample was read once: that is "
                                "neither the whole dataset's accuracy nor a mean of the ranks' own. What does "
                                "each rank count as a hit, and what does the fraction of the two sums return?")


@try_it("eval_metric", "4.2e", f"an accuracy over {N_EVAL} samples, a part on every rank, each counted once")
@on_ranks(_accuracy_on_rank, "the ranks share the samples: each counted once, by one rank",
          "every rank returns the accuracy of the whole dataset", timeout=TIMEOUT)
def check_eval_metric(report: Report, got: list, once, same) -> None:
    _judge_value(report, same, got, _judge_shared(report, once, got))
