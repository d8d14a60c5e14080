"""4.2c's try-it ``prefetch``: each block's forward all-gather issued 2 blocks early, the first by
the root. Its set-up on the ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ... import models
from ...backends import rank_device
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .large_models import TIMEOUT, judge_same, shard_blocks
from .shared import full

AHEAD, WIDTHS = 2, (32, 40, 48, 56, 64, 72)   # blocks prefetched ahead; widths (each block its own size)


class Widening(nn.Module):
    """An MLP whose blocks all differ in size, so each all-gather's bytes tell its block; the root
    holds an input layer (computed before block 0) and the head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTHS[0], WIDTHS[0])
        self.blocks = nn.ModuleList(models.MLPBlock(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))
        self.head = nn.Linear(WIDTHS[-1], 8)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _widening() -> Widening:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Widening()


def _forward_order(set_prefetch=None):
    """Two SGD steps of the sharded Widening model; the last forward's order of events on this
    rank: ("gather", bytes) and ("compute", block index; -1 the root's input layer), and the
    weights after the steps."""
    from ...observe import Timeline

    device, rank = rank_device(), dist.get_rank()
    x, y = models.make_dataset("mlp", 16 * dist.get_world_size()).tensors
    mine = slice(rank * 16, (rank + 1) * 16)
    model = shard_blocks(_widening().to(device))
    if set_prefetch is not None:
        set_prefetch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    timeline = Timeline()
    with timeline:
        for _ in range(2):
            F.mse_loss(model(x[mine].to(device)), y[mine].to(device)).backward()
            optimizer.step()
            optimizer.zero_grad()
    events = sorted((e for e in timeline.result()["events"] if e["step"] == 1), key=lambda e: e["start"])
    end = max(e["end"] for e in events if e["kind"] == "forward")
    order = []
    for e in events:
        if e["kind"] == "all_gather" and e["start"] < end:
            order.append(("gather", e["nbytes"]))
        elif e["kind"] == "forward" and e["name"].startswith("blocks."):
            order.append(("compute", int(e["name"].split(".")[1])))
        elif e["kind"] == "forward" and e["name"] == "inp":
            order.append(("compute", -1))
    return order, {n: full(p) for n, p in model.named_parameters()}


def _prefetch_on_rank(prefetch):
    default, _ = _forward_order()
    sizes = [nbytes for kind, nbytes in default if kind == "gather"]   # root, blocks 0, 1, ...: by default
    unit = {nbytes: i - 1 for i, nbytes in enumerate(sizes)}          # -1: the root
    order, weights = _forward_order(prefetch)
    events = [(kind, unit.get(v, "?") if kind == "gather" else v) for kind, v in order]
    one = _widening()
    optimizer = torch.optim.SGD(one.parameters(), lr=0.1)
    x, y = models.make_dataset("mlp", 16 * dist.get_world_size()).tensors
    for _ in range(2):
        F.mse_loss(one(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"events": events, "weights": weights, "want": {n: p.detach().clone() for n, p in one.named_parameters()}}


def _ahead(events, blocks: int) -> tuple[list[int], list, list[int]]:
    """For each block, how many later blocks were gathered before it began computing; the units
    gathered more than once in the forward; the blocks gathered before the root's input layer."""
    gathered, ahead, seen, first = set(), [], [], None
    for kind, v in events:
        if kind == "gather":
            if v in gathered:
                seen.append(v)
            gathered.add(v)
        elif v == -1 and first is None:
            first = sorted(j for j in gathered if isinstance(j, int) and j >= 0)
        elif len(ahead) == v:
            ahead.append(sum(1 for j in gathered if isinstance(j, int) and j > v))
    return ahead + [0] * (blocks - len(ahead)), seen, first or []


@try_it("prefetch", "4.2c", f"each block's forward all-gather issued {AHEAD} blocks early, the first by the root")
@on_ranks(_prefetch_on_rank, f"the first {AHEAD} blocks' gathers are issued before the root's input layer computes",
          f"each block finds the next {AHEAD} blocks' gathers issued when it starts",
          "each unit is gathered once per forward",
          "training is unchanged: the weights after two steps equal one process's", timeout=TIMEOUT)
def check_prefetch(report: Report, got: list, start, early, once, same) -> None:
    r = got[0]
    blocks = len(WIDTHS) - 1
    ahead, again, first = _ahead(r["events"], blocks)
    if first == list(range(AHEAD)):
        report.add(start, True)
    elif not first:
        report.add(start, False, "when the root's input layer began computing, no block's gather had been "
                                 "issued: block 0 waits for its own gather after the input layer, with the "
                                 "link idle meanwhile. The root is a unit too, and runs first: who can issue "
                                 "the first blocks' gathers before any block runs?")
    else:
        report.add(start, False, f"when the root's input layer began computing, the gathers of "
                                 f"{', '.join(f'block {j}' for j in first)} had been issued: which blocks does "
                                 "the root's prefetch list name?")
    want = [min(AHEAD, blocks - 1 - i) for i in range(blocks)]
    seen = ", ".join(f"block {i}: {a}" for i, a in enumerate(ahead))
    if ahead == want:
        report.add(early, True)
    elif max(ahead) < min(AHEAD, blocks - 1) and ahead[:-1] == [max(ahead)] * (blocks - 1) and max(ahead) > 0:
        report.add(early, False, f"later blocks already gathered as each block started: {seen}. Each block "
                                 "prefetches fewer blocks than asked: how many does its list name?")
    elif not any(ahead):
        report.add(early, False, f"later blocks already gathered as each block started: {seen}. The forward's "
                                 "all-gathers ran one by one, each as its block began, as with no prefetching "
                                 "at all. Forward and backward each have a prefetch list of their own: which "
                                 "one did the function set?")
    elif ahead[0] > 0 and not any(ahead[1:]):
        report.add(early, False, f"later blocks already gathered as each block started: {seen}. Only the "
                                 "first block found anything prefetched: the prefetching was set up once, "
                                 "where the forward begins. Who issues the gathers for the blocks further on?")
    else:
        report.add(early, False, f"later blocks already gathered as each block started: {seen}. Which "
                                 "blocks does each block's prefetch list name: those that come after it?")
    if not again:
        report.add(once, True)
    else:
        names = sorted({"the root" if u == -1 else f"block {u}" for u in again if u != "?"})
        report.add(once, False, f"{', '.join(names) or 'some units'} were gathered a second time in one "
                                "forward, after they had computed and freed their parameters: a prefetch "
                                "that names blocks already done gathers them again for nothing")
    judge_same(report, same, r["weights"], r["want"], "the weights differ", "prefetching changes when "
                "parameters arrive, never what is computed. Was anything else changed?")
