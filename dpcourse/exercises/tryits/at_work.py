"""4.2e's try-its: an evaluation metric shared by the ranks, PowerSGD sent in fp16, and ZeRO-1
as PyTorch ships it, with a learning rate of its own for the head (checked on the notebook's
ranks).

Each checker runs the learner's function on every rank and judges what it did against one
process or a rule derived apart from the learner's code: the samples the model was shown (a
forward hook), the value every rank returned, the bytes each step all-reduced, the weights
after a few steps, the optimizer state each rank holds.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import models
from ..report import Report
from . import on_ranks, try_it
from .ddp import _all_reduces   # 4.2a's listener: (dtype, bytes) of every all-reduce issued

TIMEOUT = 20.0          # seconds for one check's call on the ranks
RTOL, ATOL = 1e-5, 1e-6


@functools.lru_cache(maxsize=None)
def _mlp() -> tuple[tuple[torch.Size, ...], int]:
    """The demo MLP's parameter shapes and its bytes (fp32; it has no buffers): what the
    checkers' formulas count, read once."""
    shapes = tuple(p.shape for p in models.build_model("mlp").parameters())
    return shapes, 4 * sum(s.numel() for s in shapes)

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


# ------------------------------------------------------------------------------------ zero1
STEPS, SHARE, LR, HEAD_LR, MOMENTUM = 3, 8, 0.05, 0.005, 0.9   # the head at a tenth of the rate


def _state_bytes(optimizer) -> tuple[int, int]:
    """(bytes of tensors in the optimizer state this rank holds, parameters it has state for)."""
    inner = getattr(optimizer, "optim", optimizer)    # ZeroRedundancyOptimizer's local optimizer
    tensors = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors), len(inner.state)


def _stepped(optimizer, model) -> tuple[int, int] | None:
    """(the model's parameter tensors in the optimizer's ``param_groups``, other tensors there);
    None when the optimizer has no ``param_groups`` to read."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return None
    ids = {id(p) for g in groups for p in g.get("params", [])}
    mine = {id(p) for p in model.parameters()}
    return len(ids & mine), len(ids - mine)


def _zero_on_rank(make_optimizer):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ...pool.ranks.tracker import TRACKER

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset("mlp", SHARE * world).tensors
    mine = slice(rank * SHARE, (rank + 1) * SHARE)
    ddp = DDP(models.build_model("mlp", seed=0))
    optimizer = make_optimizer(ddp)
    after_step, stepping, first = [], [False], {}

    def listen(issued):
        if stepping[0] and issued.collective in ("broadcast", "all_gather"):
            after_step.append(issued.collective)

    with TRACKER.listen(listen):
        for step in range(STEPS):
            optimizer.zero_grad()
            F.mse_loss(ddp(x[mine]), y[mine]).backward()
            stepping[0] = True
            optimizer.step()
            stepping[0] = False
            first = first or {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    held, owned = _state_bytes(optimizer)
    return {"weights": ddp.module.state_dict(), "first": first, "held": held, "owned": owned,
            "after_step": len(after_step), "stepped": _stepped(optimizer, ddp.module)}


def _one_process(momentum: float = MOMENTUM, world: int = 2, head_lr: float = HEAD_LR) -> dict:
    """One process's SGD on the whole batch, the head at ``head_lr``, the other tensors at ``LR``."""
    model = models.build_model("mlp", seed=0)
    x, y = models.make_dataset("mlp", SHARE * world).tensors
    optimizer = torch.optim.SGD([{"params": model.blocks.parameters()},
                                 {"params": model.head.parameters(), "lr": head_lr}], lr=LR, momentum=momentum)
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def _first_rates(first: dict, world: int) -> dict[str, float] | None:
    """The learning rate each parameter tensor moved at in the first step: its change over one
    process's gradient of the whole batch at the initial weights (momentum's first step is the
    gradient itself). None when some tensor did not move along its gradient."""
    model = models.build_model("mlp", seed=0)
    x, y = models.make_dataset("mlp", SHARE * world).tensors
    F.mse_loss(model(x), y).backward()
    rates = {}
    for name, p in model.named_parameters():
        if name not in first:
            return None
        g, moved = p.grad.flatten(), (p.detach() - first[name]).flatten()
        rates[name] = float(moved @ g / (g @ g))
        if not torch.allclose(moved, rates[name] * g, rtol=1e-3, atol=1e-7):
            return None
    return rates


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=RTOL, atol=ATOL) for k in a)


def _rates_said(rates: dict[str, float]) -> str:
    """Which tensors moved as at which learning rate, and what that means for the groups."""
    head = [n for n in rates if n.startswith("head.")]
    lr_of = lambda names: sorted({f"{rates[n]:.3g}" for n in names})  # noqa: E731
    h, r = lr_of(head), lr_of(set(rates) - set(head))
    if len(h) != 1 or len(r) != 1:
        return ("in the first step the tensors moved as at learning rates " +
                ", ".join(f"{n} {v:.3g}" for n, v in rates.items()) + ". Which rate does each group get?")
    said = (f"in the first step the head ({' and '.join(head)}) moved as at learning rate {h[0]}, the "
            f"other {len(rates) - len(head)} tensors as at {r[0]}")
    if h == r:
        return f"{said}: one rate for all. How does an optimizer give some tensors a rate of their own?"
    if h == [f"{LR:.3g}"] and r == [f"{HEAD_LR:.3g}"]:
        return f"{said}: the two rates the other way round. Which tensors make up the head?"
    ratio = float(h[0]) / float(r[0])
    if abs(ratio - HEAD_LR / LR) < 1e-3 * HEAD_LR / LR:
        scale = float(r[0]) / LR
        return (f"{said}: the ratio of the rates is right, but every tensor moved {scale:.3g} times as far as "
                f"its rate says. What else than the rate sets the size of SGD's first step?")
    return (f"{said}: the head moves at {ratio:.3g} times the others' rate, where the try-it asks for a "
            "tenth. Which rate does each group get?")


def _judge_zero_step(report: Report, item: str, got: list) -> bool:
    """Item ``item``: the weights after the steps are one process's. True when the optimizer
    steps the model's parameters (the later items are judged then)."""
    world, tensors = len(got), len(_mlp()[0])
    stepped, want = got[0]["stepped"], _one_process(world=len(got))
    if all(_close(r["weights"], want) for r in got):
        report.add(item, True)
    elif stepped is not None and stepped[0] < tensors:
        kept = _close(got[0]["weights"], models.build_model("mlp", seed=0).state_dict())
        kept = ", so the model kept its initial weights" if kept else ""
        if stepped[1]:
            report.add(item, False, f"the optimizer's param_groups hold {stepped[1]} tensors that are not the "
                                    f"model's and {stepped[0]} of its {tensors} parameters: the optimizer steps "
                                    f"tensors that are not the model's{kept}. Which tensors does it need?")
        else:
            report.add(item, False, f"the optimizer's param_groups hold {stepped[0]} of the model's {tensors} "
                                    f"parameter tensors and nothing else{kept}. " + (
                                        "Were the parameters still there when it read them (a generator is "
                                        "used up by one pass)?" if not stepped[0] else
                                        "Which of the model's tensors are missing from the groups?"))
        return False
    elif any(not _close(r["weights"], got[0]["weights"]) for r in got):
        report.add(item, False, "the ranks' weights differ after the steps: each rank updated only some "
                                "parameters, and the others never received them")
    elif all(_close(r["weights"], _one_process(momentum=0.0, world=world)) for r in got):
        report.add(item, False, f"the weights are {STEPS} steps of SGD without momentum, at the right rates: "
                                "no rank kept a velocity between steps")
    elif (rates := _first_rates(got[0]["first"], world)) is not None and (
            {f"{v:.3g}" for n, v in rates.items() if n.startswith("head.")} != {f"{HEAD_LR:.3g}"}
            or {f"{v:.3g}" for n, v in rates.items() if not n.startswith("head.")} != {f"{LR:.3g}"}):
        report.add(item, False, _rates_said(rates))
    else:
        report.add(item, False, f"the weights differ from {STEPS} steps of SGD (learning rate {LR}, the head "
                                f"{HEAD_LR}, momentum {MOMENTUM}) on the whole batch: which optimizer, with "
                                "which settings, does the sharded one wrap?")
    return True


def _judge_zero_shard(report: Report, item: str, got: list) -> None:
    """Item ``item``: each rank holds the optimizer state of its share, the shares one momentum
    buffer per parameter together."""
    shapes, full = _mlp()
    tensors = len(shapes)
    held, owned = [r["held"] for r in got], [r["owned"] for r in got]
    if sum(owned) == tensors and sum(held) == full and all(h < full for h in held):
        report.add(item, True)
    elif all(h >= full for h in held):
        report.add(item, False, f"every rank holds state for all {tensors} parameter tensors "
                                f"({held[0]:,} bytes, at least the model's size): the state is replicated, as "
                                "in plain DDP. What splits it over the ranks?")
    elif not sum(held):
        report.add(item, False, "no rank holds any optimizer state: plain SGD keeps nothing between "
                                "steps, SGD with momentum one buffer per parameter tensor")
    elif sum(owned) == tensors and round(sum(held) / full) == 2:
        report.add(item, False, f"the ranks hold state for the {tensors} tensors once ({owned} of them), "
                                f"{sum(held):,} bytes together: two values per parameter, where the model is "
                                f"{full:,} bytes. Adam keeps two moments, SGD with momentum one buffer: "
                                "which optimizer does the sharded one wrap?")
    else:
        report.add(item, False, f"the ranks hold state for {owned} parameter tensors, {held} bytes: "
                                f"together they should cover the {tensors} tensors once")


@try_it("zero1", "4.2e", "SGD with momentum, the head at a tenth of the rate, its state sharded (ZeRO-1)")
@on_ranks(_zero_on_rank, f"{STEPS} steps equal one process's SGD with momentum, the head at a tenth of the rate",
          "each rank holds the momentum of its own share of the parameters",
          "after each step the updated parameters reach every rank", timeout=TIMEOUT)
def check_zero1(report: Report, got: list, step, shard, gather) -> None:
    if not _judge_zero_step(report, step, got):
        for name in (shard, gather):
            report.add(name, None, "judged once the optimizer steps the model's parameters")
        return
    _judge_zero_shard(report, shard, got)
    full = _mlp()[1]
    if all(r["after_step"] > 0 for r in got):
        report.add(gather, True)
    elif all(r["held"] >= full for r in got):
        report.add(gather, None, "judged once the state is sharded: with every rank stepping every "
                                 "parameter, nothing needs sending")
    else:
        report.add(gather, False, "no rank sent parameters during the optimizer step: a rank that updates "
                                  "a share only must pass it on")


# --------------------------------------------------------------------------------- powersgd
PSGD_RANK, PSGD_START, PSGD_STEPS = 2, 3, 5    # factors of rank 2, steps 0-2 plain, all in fp16


def powersgd_bytes(rank: int, min_compression_rate: float = 2, width: int = 4) -> int:
    """Bytes PowerSGD all-reduces per step for the MLP, ``width`` bytes a value (4: fp32, 2: fp16):
    a matrix n x m goes as (n + m) x rank values when (n + m) x rank x min_compression_rate < n x m
    (``powerSGD_hook._should_compress``); vectors and the other matrices go whole."""
    values = 0
    for shape in _mlp()[0]:
        n, m = (shape[0], shape[1]) if len(shape) == 2 else (shape.numel(), 1)
        compress = len(shape) == 2 and (n + m) * rank * min_compression_rate < n * m
        values += (n + m) * rank if compress else shape.numel()
    return width * values


def _sent(nbytes: int) -> tuple[str, str, int]:
    """What one step's ``nbytes`` all-reduced are for the MLP: ("whole" | "factors" | "", "fp32" |
    "fp16" | "", the factors' rank or 0)."""
    values = _mlp()[1] // 4
    for width, dtype in ((4, "fp32"), (2, "fp16")):
        if nbytes == width * values:
            return "whole", dtype, 0
        rank = next((r for r in range(1, 9) if nbytes == powersgd_bytes(r, width=width)), 0)
        if rank:
            return "factors", dtype, rank
    return "", "", 0


def _said(nbytes: int) -> str:
    kind, dtype, rank = _sent(nbytes)
    return {"whole": f"the whole gradients in {dtype}", "factors": f"rank-{rank} factors in {dtype}"}.get(
        kind, "neither the whole gradients nor factors") + f" ({nbytes:,} bytes)"


def _steps_named(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first} and {last}" if last == first + 1 else \
        f"steps {first} to {last}"


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


WARM_UP_ASKED = "How many steps of warm-up does the state let pass before it compresses?"
IN_FP16_ASKED = "What runs the hook in 2 bytes?"


def _judge_warm_up(report: Report, item: str, steps: list[int]) -> None:
    """Item ``item``: steps 0 to PSGD_START - 1 all-reduce the whole gradients, in fp16."""
    early, kinds = steps[:PSGD_START], [_sent(b) for b in steps[:PSGD_START]]
    factored = next((i for i, k in enumerate(kinds) if k[0] == "factors"), None)
    if all(k[:2] == ("whole", "fp16") for k in kinds):
        report.add(item, True)
    elif factored is not None:
        report.add(item, False, f"step {factored} already sent {_said(early[factored])}: compression began "
                                f"before the warm-up was over. {WARM_UP_ASKED}")
    elif all(_sent(b)[:2] == ("whole", "fp32") for b in steps):
        report.add(item, False, f"every step all-reduced the whole gradients in fp32, {early[0]:,} bytes, as DDP "
                                "does without a comm hook: is a hook registered on the model?")
    elif all(k[:2] == ("whole", "fp32") for k in kinds):
        report.add(item, False, f"{_steps_named(0, PSGD_START - 1)} all-reduced the whole gradients in fp32: "
                                f"4 bytes a value, {early[0]:,} bytes a step. {IN_FP16_ASKED}")
    else:
        report.add(item, False, "the first steps sent " + ", ".join(
            f"step {i} {_said(b)}" for i, b in enumerate(early)) + ": each should all-reduce the whole "
            "gradients, in fp16")


def _judge_factored(report: Report, item: str, steps: list[int]) -> None:
    """Item ``item``: steps PSGD_START on send rank-PSGD_RANK factors, in fp16."""
    later, kinds = steps[PSGD_START:], [_sent(b) for b in steps[PSGD_START:]]
    when, last = _steps_named(PSGD_START, len(steps) - 1), len(steps) - 1
    began = next((PSGD_START + i for i, k in enumerate(kinds) if k[0] == "factors"), None)
    if all(k == ("factors", "fp16", PSGD_RANK) for k in kinds):
        report.add(item, True)
    elif began is not None and began > PSGD_START and all(k[0] == "whole" for k in kinds[:began - PSGD_START]):
        late = began - PSGD_START
        report.add(item, False, f"{_steps_named(PSGD_START, began - 1)} still all-reduced the whole gradients, "
                                f"{_steps_named(began, last) if began == last else f'steps {began} on'} sent "
                                f"factors: compression began {'a step' if late == 1 else f'{late} steps'} late. "
                                f"{WARM_UP_ASKED}")
    elif all(k[:2] == ("whole", "fp32") for k in kinds):
        report.add(item, False, f"{when} still all-reduced the whole gradients in fp32, {later[0]:,} bytes: no "
                                "compression ran. Is the hook registered, and when does it start?")
    elif all(k[:2] == ("whole", "fp16") for k in kinds):
        report.add(item, False, f"{when} sent the whole gradients in fp16, {later[0]:,} bytes a step, half of "
                                "fp32's: the values were cast to 2 bytes, not factored. Does PowerSGD run "
                                "inside the cast, from which step, and which matrices does it factor?")
    elif len(set(kinds)) == 1 and kinds[0][0] == "factors":
        _, dtype, rank = kinds[0]
        columns = (f"each n x m matrix went as (n + m) x {rank} values: factors with {rank} column(s). "
                   f"How many columns does rank {PSGD_RANK} mean?") if rank != PSGD_RANK else ""
        fp32 = f"4 bytes a value, {later[0]:,} bytes a step. {IN_FP16_ASKED}" if dtype == "fp32" else ""
        report.add(item, False, f"{when} sent rank-{rank} factors in {dtype}: " + " ".join(
            s for s in (fp32, columns) if s))
    else:
        report.add(item, False, ", ".join(f"step {PSGD_START + i} sent {_said(b)}" for i, b in enumerate(later))
                   + f": each should send rank-{PSGD_RANK} factors, in fp16")


@try_it("powersgd", "4.2e", f"PowerSGD of rank {PSGD_RANK} after {PSGD_START} plain steps, everything in fp16")
@on_ranks(_powersgd_on_rank, f"the first {PSGD_START} steps all-reduce the whole gradients, in fp16",
          f"later steps send rank-{PSGD_RANK} factors, in fp16", timeout=TIMEOUT)
def check_powersgd(report: Report, got: list, warm, factored) -> None:
    _judge_warm_up(report, warm, got[0])
    _judge_factored(report, factored, got[0])
