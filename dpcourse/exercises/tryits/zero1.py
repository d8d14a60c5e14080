"""4.2e's try-it ``zero1``: SGD with momentum, the head at a tenth of the rate, its state sharded
(ZeRO-1). Its set-up on the ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import models
from ...grading.compare import close
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .at_work import ATOL, RTOL, TIMEOUT, mlp

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

    from ...tracking.tracker import TRACKER

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


def one_process(momentum: float = MOMENTUM, world: int = 2, head_lr: float = HEAD_LR) -> dict:
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
    world, tensors = len(got), len(mlp()[0])
    stepped, want = got[0]["stepped"], one_process(world=len(got))
    if all(close(r["weights"], want, RTOL, ATOL) for r in got):
        report.add(item, True)
    elif stepped is not None and stepped[0] < tensors:
        kept = close(got[0]["weights"], models.build_model("mlp", seed=0).state_dict(), RTOL, ATOL)
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
    elif any(not close(r["weights"], got[0]["weights"], RTOL, ATOL) for r in got):
        report.add(item, False, "the ranks' weights differ after the steps: each rank updated only some "
                                "parameters, and the others never received them")
    elif all(close(r["weights"], one_process(momentum=0.0, world=world), RTOL, ATOL) for r in got):
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
    shapes, full = mlp()
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
    full = mlp()[1]
    if all(r["after_step"] > 0 for r in got):
        report.add(gather, True)
    elif all(r["held"] >= full for r in got):
        report.add(gather, None, "judged once the state is sharded: with every rank stepping every "
                                 "parameter, nothing needs sending")
    else:
        report.add(gather, False, "no rank sent parameters during the optimizer step: a rank that updates "
                                  "a share only must pass it on")
