"""4.2a's try-it ``sampler``: 11 samples on the ranks, a new shuffle every epoch. Its set-up on the
ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch

from ...grading.judging import RankFailure, run_or_failure
from ...grading.registry import try_it
from ...grading.report import Report
from .ddp import TIMEOUT

N_ITEMS, EPOCHS, SEED = 11, 3, 5   # a dataset of 11 items: not a multiple of 2 (or 4) ranks


def _orders_on_rank(epoch_orders):
    from torch.utils.data import TensorDataset

    def orders(seed):
        got = epoch_orders(TensorDataset(torch.arange(N_ITEMS)), EPOCHS, seed)
        # one list of indices per epoch; batches (tensors) inside it are read in order too
        return [torch.cat([torch.as_tensor(i).flatten() for i in epoch]).tolist() if len(epoch) else []
                for epoch in got]

    return {"orders": orders(SEED), "again": orders(SEED), "other": orders(SEED + 1)}


def _overlap(epoch: int, runs: list[list[int]]) -> str | None:
    """What the ranks read twice in an epoch, in words (None: nothing)."""
    reads: dict[int, list[int]] = {}
    for rank, order in enumerate(runs):
        for i in order:
            reads.setdefault(i, []).append(rank)
    twice = {i: ranks for i, ranks in reads.items() if len(ranks) > 1}
    if not twice:
        return None
    if len(twice) > len(reads) // 2:
        return (f"in epoch {epoch} the ranks read {len(twice)} of the same samples: each rank went "
                "through the whole dataset, shuffled its own way. What gives each rank its own part?")
    i, ranks = next(iter(sorted(twice.items())))
    if len(set(ranks)) > 1:
        who = "by ranks " + " and ".join(map(str, sorted(set(ranks))))
    else:
        who = f"{len(ranks)} times by rank {ranks[0]}"
    total = sum(len(order) for order in runs)
    if len(reads) < min(total, N_ITEMS):   # padding repeats a few and leaves none out: this left some out
        return (f"in epoch {epoch}, sample {i} was read {who}, and {N_ITEMS - len(reads)} of the {N_ITEMS} "
                "samples by no rank: each rank took its part of a permutation of its own -- the ranks "
                "shuffled with different seeds, so their parts overlap and miss samples. The parts are "
                "slices of one shared shuffle only when every rank shuffles with the same seed")
    return (f"in epoch {epoch}, sample {i} was read {who}: to give every rank as many samples, "
            "the sampler repeated some to fill up the uneven tail")


def _unequal(by_epoch: list[list[list[int]]], world: int) -> str | None:
    """How the ranks' parts ([epoch][rank] -> indices) differ from equal shares of all but the
    uneven tail, in words (None: they do not)."""
    share, counts = N_ITEMS // world, [len(x) for x in by_epoch[0]]
    read = [len(set().union(*map(set, runs_e))) for runs_e in by_epoch]
    if all(len(x) == share for runs_e in by_epoch for x in runs_e) and read == [share * world] * EPOCHS:
        return None
    if min(counts) >= N_ITEMS:
        return (f"every rank read {counts[0]} samples per epoch, the whole dataset of {N_ITEMS}: "
                f"{world} ranks did the work of one process {world} times over")
    if len(set(counts)) > 1:
        return (f"in epoch 0 the ranks read {counts} samples: their epochs then have different numbers "
                "of steps, and a rank with more waits in an all-reduce the others never start")
    if sum(counts) > N_ITEMS:
        return (f"the {world} ranks read {sum(counts)} samples per epoch from a dataset of {N_ITEMS}: the "
                "sampler padded the parts with repeated samples. What makes it leave out the uneven tail instead?")
    if 0 < read[0] < sum(counts):
        return (f"the ranks read {counts[0]} samples each in epoch 0, but only {read[0]} different ones: "
                f"their parts overlap (see above), so {N_ITEMS - read[0]} of the {N_ITEMS} went unread, more "
                "than the uneven tail")
    return (f"together the ranks read {read[0]} different samples in epoch 0, {counts[0]} each, of "
            f"{N_ITEMS}: only the uneven tail (what does not divide by the world size) should be left out")


@try_it("sampler", "4.2a", f"{N_ITEMS} samples on the ranks, a new shuffle every epoch")
def check_sampler(epoch_orders, cluster) -> Report:
    report = Report("")
    runs, parts, new, seeded = ("runs on every rank", "the ranks' parts never overlap",
                                "a new shared shuffle every epoch", "the seed decides the orders")
    equal = "the ranks read equal parts, all but the uneven tail"
    got = run_or_failure(cluster, _orders_on_rank, epoch_orders, timeout=TIMEOUT)
    if isinstance(got, RankFailure):
        return report.fail(runs, got.describe(TIMEOUT), [parts, equal, new, seeded])
    world = len(got)
    lengths = {len(r["orders"]) for r in got}
    if lengths != {EPOCHS}:
        report.add(runs, False, f"asked for {EPOCHS} epochs, the function returned {sorted(lengths)} "
                                "lists: one list of indices per epoch")
        for name in (parts, equal, new, seeded):
            report.add(name, None, "judged once it returns one list per epoch")
        return report
    report.add(runs, True)
    by_epoch = [[r["orders"][e] for r in got] for e in range(EPOCHS)]   # [epoch][rank] -> indices
    overlaps = [o for e, runs_e in enumerate(by_epoch) if (o := _overlap(e, runs_e))]
    report.add(parts, not overlaps, overlaps[0] if overlaps else "")

    unequal = _unequal(by_epoch, world)
    report.add(equal, unequal is None, unequal or "")

    same = [e for e in range(1, EPOCHS) if by_epoch[e] == by_epoch[e - 1]]
    # one permutation of the whole dataset, redrawn each epoch, cut into the ranks' parts: a
    # rank's part changes between epochs. A fixed part per rank, shuffled within, never does.
    fixed = all(len({frozenset(by_epoch[e][r]) for e in range(EPOCHS)}) == 1 for r in range(world))
    if same:
        report.add(new, False, f"epoch {same[0]} read the same order as epoch {same[0] - 1} on every "
                               "rank: the sampler shuffles from its seed and its epoch. What tells it "
                               "that a new epoch began?")
    elif fixed and any(by_epoch[0]) and not overlaps:
        report.add(new, False, f"each rank read the same samples in all {EPOCHS} epochs, only in another order "
                               f"(rank 0: {sorted(by_epoch[0][0])}): every rank kept a fixed part of its own and "
                               "shuffled within it. The shuffle must be one permutation of the whole dataset, "
                               "shared by all ranks and redrawn every epoch, each rank taking its part of it, "
                               "so that a sample can land on any rank")
    else:
        report.add(new, True)
    if any(r["again"] != r["orders"] for r in got):
        report.add(seeded, False, "called again with the same seed, the function read other orders: "
                                  "the shuffle drew from a random state, not from the seed alone. Which "
                                  "object should shuffle, so that the seed decides?")
    elif all(r["other"] == r["orders"] for r in got):
        report.add(seeded, False, "another seed gave the same orders: is the seed passed on to what "
                                  "shuffles?")
    else:
        report.add(seeded, True)
    return report
