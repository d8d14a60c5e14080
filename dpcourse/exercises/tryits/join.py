"""4.2d's try-it ``join``: DDP through uneven batches per rank, averaged over the ranks still
training. Its set-up on the ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import models
from ...grading.compare import close
from ...grading.judging import RankFailure, on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .pitfalls import ATOL, RTOL, ready

JOIN_TIMEOUT = 6.0        # a correct call takes well under a second; a hang is reported after this
JOIN_LR, JOIN_BATCH = 0.1, 4


def _join_counts(world: int) -> list[int]:
    return [2 + 2 * r for r in range(world)]       # rank 0: 2 batches, rank 1: 4


def _join_batches(world: int):
    """Every rank's batches: [[(x, y), ...] for each rank]."""
    counts = _join_counts(world)
    x, y = models.make_dataset("mlp", sum(counts) * JOIN_BATCH).tensors
    out, start = [], 0
    for c in counts:
        out.append([(x[i:i + JOIN_BATCH], y[i:i + JOIN_BATCH])
                    for i in range(start, start + c * JOIN_BATCH, JOIN_BATCH)])
        start += c * JOIN_BATCH
    return out


def _join_on_rank(train):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _join_batches(world)[rank]
    model = DDP(models.build_model("mlp", seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=JOIN_LR)
    steps = [0]
    optimizer.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    train(model, optimizer, batches)
    return {"steps": steps[0], "batches": len(batches),
            "weights": {k: v.detach().clone() for k, v in model.module.named_parameters()}}


def _simulate_join(world: int, divide_by_initial_world_size: bool = True):
    """One process: the ranks' uneven training under DDP's join. While a rank has batches left
    it steps with the sum of the gradients of the ranks that still have one (a rank that ran out
    answers DDP's all-reduces with zeros) divided by the initial world size (or, with
    ``divide_by_initial_world_size=False``, by the number of ranks still training); at the end
    every rank receives the weights of the last rank to finish."""
    batches = _join_batches(world)
    model = models.build_model("mlp", seed=0)
    for s in range(max(len(b) for b in batches)):
        active = [b[s] for b in batches if s < len(b)]
        total = [torch.zeros_like(p) for p in model.parameters()]
        for x, y in active:
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            total = [t + p.grad for t, p in zip(total, model.parameters())]
        with torch.no_grad():
            for p, g in zip(model.parameters(), total):
                p -= JOIN_LR * g / (world if divide_by_initial_world_size else len(active))
    return dict(model.named_parameters())


def _join_failure(got: RankFailure, world_size: int) -> str:
    """What a join call that failed did: hung on uneven batches, called a hook of the wrong object, or else."""
    if got.kind == "hang":
        where = f" ({got.summary})" if got.summary else ""
        shares = ", ".join(f"rank {r} {n}" for r, n in enumerate(_join_counts(world_size)))
        return (f"the ranks did not finish within {JOIN_TIMEOUT:g} s{where}. Batches per rank: "
                f"{shares}. Each backward all-reduces the gradients, "
                "so the ranks issue different numbers of all-reduces, and a rank with batches left "
                "waits for a partner that has stopped. What can answer its all-reduces once a "
                "rank has run out?")
    if "join_hook" in got.summary or "joinable" in got.summary:
        return (f"{got.summary} -- the join context calls a hook of each object it is given, to "
                "answer that object's collectives for a rank that has run out: which object here "
                "issues the all-reduces?")
    return got.describe(JOIN_TIMEOUT)


@try_it("join", "4.2d", "DDP through uneven batches per rank, averaged over the ranks still training")
@on_ranks(_join_on_rank, "each rank takes one optimizer step per batch of its own",
          "the final weights are equal on every rank",
          "the final weights equal one process's training on every rank's batches, each step averaged over "
          "the ranks still training",
          timeout=JOIN_TIMEOUT, runs="runs on every rank and finishes", warm_up=ready, describe=_join_failure)
def check_join(report: Report, got: list, steps_name, equal_name, want_name) -> None:
    short = [f"rank {r} took {x['steps']} steps for its {x['batches']} batches" for r, x in enumerate(got)
             if x["steps"] != x["batches"]]
    if not short:
        report.add(steps_name, True)
    else:
        skipped = any(x["steps"] < x["batches"] for x in got)
        report.add(steps_name, False, "; ".join(short) + (
            ": its last batches were never trained on. Stopping where the shortest rank stops keeps "
            "the ranks in step, at the price of samples: what lets a rank go on alone?" if skipped
            else ": one step per batch is the loop asked for"))
    weights = [x["weights"] for x in got]
    if all(close(w, weights[0], RTOL, ATOL) for w in weights[1:]):
        report.add(equal_name, True)
    else:
        report.add(equal_name, False, "the ranks end with different weights: their gradients were not "
                                      "averaged at every step, or the replicas were not made equal at the end")
    by_active, diluted = _simulate_join(len(got), False), _simulate_join(len(got))
    if all(close(w, by_active, RTOL, ATOL) for w in weights):
        report.add(want_name, True)
    elif all(close(w, diluted, RTOL, ATOL) for w in weights):
        report.add(want_name, False, f"the steps after rank 0 ran out were divided by all {len(got)} ranks, "
                                     "the finished ranks counting as zeros: those steps came out smaller than "
                                     "the batches' mean. What tells the join hook to average over the ranks "
                                     "still training?")
    elif short:
        report.add(want_name, False, "they differ from it: some ranks' batches were left out")
    else:
        report.add(want_name, False, "they differ from it: was each step's gradient this batch's alone "
                                     "(nothing left over from the batches before), averaged over the ranks "
                                     "still training?")
