"""4.2e's try-its: an evaluation metric over the ranks, and ZeRO-1 as PyTorch ships it
(checked on the notebook's ranks).

Each checker runs the learner's function on every rank and judges what it did against one
process: the samples the model was shown (a forward hook), the value every rank returned,
the weights after a few steps, the optimizer state each rank holds.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import models
from ..report import Report
from . import on_ranks, try_it
from .ddp import _all_reduces   # 4.2a's listener: (dtype, bytes) of every all-reduce issued

TIMEOUT = 20.0          # seconds for one check's call on the ranks
RTOL, ATOL = 1e-5, 1e-6

# ------------------------------------------------------------------------------ eval_metric
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


@try_it("eval_metric", "4.2e", f"an accuracy over {N_EVAL} samples, counted once each on the ranks")
@on_ranks(_accuracy_on_rank, "every sample is counted once, by one rank",
          "every rank returns the accuracy of the whole dataset", timeout=TIMEOUT)
def check_eval_metric(report: Report, got: list, once, same) -> None:
    world, want = len(got), _labelled()[1]
    reads: dict[int, list[int]] = {}
    for rank, r in enumerate(got):
        for i in r["seen"]:
            reads.setdefault(i, []).append(rank)
    twice = {i: ranks for i, ranks in sorted(reads.items()) if len(ranks) > 1}
    missing = [i for i in range(N_EVAL) if i not in reads]
    if not twice and not missing:
        report.add(once, True)
    elif len(twice) > N_EVAL // 2:
        report.add(once, False, f"the ranks read {len(twice)} of the {N_EVAL} samples more than once: each "
                                "rank went through the whole dataset. Which part of it is this rank's?")
    elif twice:
        i, ranks = next(iter(twice.items()))
        who = " and ".join(map(str, sorted(set(ranks)))) if len(set(ranks)) > 1 else f"{ranks[0]}, {len(ranks)} times"
        report.add(once, False, f"sample {i} was counted by rank{'s' if len(set(ranks)) > 1 else ''} {who}: "
                                f"{N_EVAL} samples do not divide among {world} ranks, and the parts were made "
                                "equal by repeating samples. Must every rank read as many samples in evaluation?")
    else:
        report.add(once, False, f"samples {missing[:4]} were read by no rank: the uneven tail was left out. "
                                "Must every rank read as many samples in evaluation?")
    values = [r["value"] for r in got]
    if not all(isinstance(v, float) for v in values):
        report.add(same, False, f"the function returned {type(values[0]).__name__}, not a number")
    elif all(abs(v - want) <= 1e-6 for v in values):
        report.add(same, True)
    elif max(values) - min(values) > 1e-6:
        shown = ", ".join(f"rank {r} {v:.4f}" for r, v in enumerate(values))
        report.add(same, False, f"the ranks returned different values ({shown}): each one's own part. "
                                "What brings every rank's counts together?")
    elif twice or missing:
        report.add(same, False, f"the ranks agree on {values[0]:.4f}, one process on the whole dataset "
                                "finds another value: the samples counted twice or never weigh in it")
    else:
        report.add(same, False, f"the ranks agree on {values[0]:.4f}, one process on the whole dataset finds "
                                "another value, though every sample was read once: the ranks hold different "
                                "numbers of samples. Does averaging the ranks' own accuracies weigh every "
                                "sample alike?")


# ------------------------------------------------------------------------------------ zero1
STEPS, SHARE, LR, MOMENTUM = 3, 8, 0.05, 0.9


def _state_bytes(optimizer) -> tuple[int, int]:
    """(bytes of tensors in the optimizer state this rank holds, parameters it has state for)."""
    inner = getattr(optimizer, "optim", optimizer)    # ZeroRedundancyOptimizer's local optimizer
    tensors = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors), len(inner.state)


def _zero_on_rank(make_optimizer):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ...pool.ranks.tracker import TRACKER

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset("mlp", SHARE * world).tensors
    mine = slice(rank * SHARE, (rank + 1) * SHARE)
    ddp = DDP(models.build_model("mlp", seed=0))
    optimizer = make_optimizer(ddp)
    after_step, stepping = [], [False]

    def listen(issued):
        if stepping[0] and issued.collective in ("broadcast", "all_gather"):
            after_step.append(issued.collective)

    with TRACKER.listen(listen):
        for _ in range(STEPS):
            optimizer.zero_grad()
            F.mse_loss(ddp(x[mine]), y[mine]).backward()
            stepping[0] = True
            optimizer.step()
            stepping[0] = False
    held, owned = _state_bytes(optimizer)
    return {"weights": ddp.module.state_dict(), "held": held, "owned": owned, "after_step": len(after_step),
            "kind": type(optimizer).__name__}


def _one_process(momentum: float = MOMENTUM, world: int = 2) -> dict:
    model = models.build_model("mlp", seed=0)
    x, y = models.make_dataset("mlp", SHARE * world).tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=RTOL, atol=ATOL) for k in a)


@try_it("zero1", "4.2e", "SGD with momentum, its state sharded over the ranks (ZeRO-1)")
@on_ranks(_zero_on_rank, f"{STEPS} steps equal one process's SGD with momentum",
          "each rank holds the momentum of its own share of the parameters",
          "after each step the updated parameters reach every rank", timeout=TIMEOUT)
def check_zero1(report: Report, got: list, step, shard, gather) -> None:
    world = len(got)
    full = sum(v.numel() * v.element_size() for v in models.build_model("mlp", seed=0).state_dict().values())
    tensors = len(models.build_model("mlp", seed=0).state_dict())
    want = _one_process(world=world)
    if all(_close(r["weights"], want) for r in got):
        report.add(step, True)
    elif all(_close(r["weights"], _one_process(momentum=0.0, world=world)) for r in got):
        report.add(step, False, f"the weights are {STEPS} steps of SGD without momentum: no rank kept a "
                                "velocity between steps")
    elif any(not _close(r["weights"], got[0]["weights"]) for r in got):
        report.add(step, False, "the ranks' weights differ after the steps: each rank updated only some "
                                "parameters, and the others never received them")
    else:
        report.add(step, False, f"the weights differ from {STEPS} steps of SGD (learning rate {LR}, momentum "
                                f"{MOMENTUM}) on the whole batch: which optimizer, with which settings, "
                                "does the sharded one wrap?")
    held = [r["held"] for r in got]
    owned = [r["owned"] for r in got]
    if sum(held) and sum(owned) == tensors and all(h < full for h in held):
        report.add(shard, True)
    elif all(h >= full for h in held):
        report.add(shard, False, f"every rank holds momentum for all {tensors} parameter tensors "
                                 f"({held[0]:,} bytes, the model's size): the state is replicated, as in plain "
                                 "DDP. What splits it over the ranks?")
    elif not sum(held):
        report.add(shard, False, "no rank holds any optimizer state: plain SGD keeps nothing between "
                                 "steps, SGD with momentum one buffer per parameter tensor")
    else:
        report.add(shard, False, f"the ranks hold state for {owned} parameter tensors, {held} bytes: "
                                 f"together they should cover the {tensors} tensors once")
    if all(r["after_step"] > 0 for r in got):
        report.add(gather, True)
    elif all(h >= full for h in held):
        report.add(gather, None, "judged once the state is sharded: with every rank stepping every "
                                 "parameter, nothing needs sending")
    else:
        report.add(gather, False, "no rank sent parameters during the optimizer step: a rank that updates "
                                  "a share only must pass it on")


# --------------------------------------------------------------------------------- powersgd
PSGD_RANK, PSGD_START, PSGD_STEPS = 2, 3, 5


def powersgd_bytes(rank: int, min_compression_rate: float = 2) -> int:
    """Bytes PowerSGD all-reduces per step for the MLP (fp32): a matrix n x m goes as
    (n + m) x rank values when (n + m) x rank x min_compression_rate < n x m
    (``powerSGD_hook._should_compress``); vectors and the other matrices go whole."""
    values = 0
    for p in models.build_model("mlp").parameters():
        n, m = (p.shape[0], p.shape[1]) if p.dim() == 2 else (p.numel(), 1)
        compress = p.dim() == 2 and (n + m) * rank * min_compression_rate < n * m
        values += (n + m) * rank if compress else p.numel()
    return 4 * values


def _powersgd_on_rank(register):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ...pool.ranks.tracker import TRACKER

    rank = dist.get_rank()
    x, y = models.make_dataset("mlp", SHARE * dist.get_world_size()).tensors
    mine = slice(rank * SHARE, (rank + 1) * SHARE)
    ddp = DDP(models.build_model("mlp", seed=0))
    register(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    per_step = []
    for _ in range(PSGD_STEPS):
        seen = []
        with TRACKER.listen(_all_reduces(seen)):
            optimizer.zero_grad()
            F.mse_loss(ddp(x[mine]), y[mine]).backward()
        per_step.append(sum(nbytes for _, nbytes in seen))
        optimizer.step()
    return per_step


@try_it("powersgd", "4.2e", f"PowerSGD of rank {PSGD_RANK} after {PSGD_START} plain steps")
@on_ranks(_powersgd_on_rank, f"the first {PSGD_START} steps all-reduce the whole gradients",
          f"later steps send rank-{PSGD_RANK} factors", timeout=TIMEOUT)
def check_powersgd(report: Report, got: list, warm, factored) -> None:
    steps, full, want = got[0], 4 * sum(p.numel() for p in models.build_model("mlp").parameters()), \
        powersgd_bytes(PSGD_RANK)
    early = next((i for i, b in enumerate(steps[:PSGD_START]) if b != full), None)
    if early is None:
        report.add(warm, True)
    else:
        report.add(warm, False, f"step {early} all-reduced {steps[early]:,} bytes where the whole gradients "
                                f"are {full:,}: compression began before the warm-up was over. How many "
                                "steps does the state let pass before it compresses?")
    later = steps[PSGD_START:]
    if all(b == want for b in later):
        report.add(factored, True)
    elif all(b == full for b in later):
        report.add(factored, False, f"steps {PSGD_START} and later still all-reduced the whole {full:,} bytes: "
                                    "no compression ran. Is the hook registered, and when does it start?")
    elif all(b == full // 2 for b in later):
        report.add(factored, False, f"steps {PSGD_START} and later sent {later[0]:,} bytes, half of the whole "
                                    "gradients: the values were cast to 2 bytes, not factored")
    else:
        seen = next((r for r in range(1, 9) if all(b == powersgd_bytes(r) for b in later)), None)
        how = (f"each n x m matrix went as (n + m) x {seen} values: factors with {seen} column(s). "
               f"How many columns does rank {PSGD_RANK} mean?" if seen else
               f"rank-{PSGD_RANK} factors of this model are {want:,} bytes per step")
        report.add(factored, False, f"steps {PSGD_START} and later sent {later[0]:,} bytes: {how}")
