"""4.2e's try-it ``powersgd``: PowerSGD of rank 2 after 3 plain steps, everything in fp16. Its set-
up on the ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import models
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .at_work import TIMEOUT, mlp
from .shared import all_reduces
from .zero1 import SHARE

PSGD_RANK, PSGD_START, PSGD_STEPS = 2, 3, 5    # factors of rank 2, steps 0-2 plain, all in fp16


def powersgd_bytes(rank: int, min_compression_rate: float = 2, width: int = 4) -> int:
    """Bytes PowerSGD all-reduces per step for the MLP, ``width`` bytes a value (4: fp32, 2: fp16):
    a matrix n x m goes as (n + m) x rank values when (n + m) x rank x min_compression_rate < n x m
    (``powerSGD_hook._should_compress``); vectors and the other matrices go whole."""
    values = 0
    for shape in mlp()[0]:
        n, m = (shape[0], shape[1]) if len(shape) == 2 else (shape.numel(), 1)
        compress = len(shape) == 2 and (n + m) * rank * min_compression_rate < n * m
        values += (n + m) * rank if compress else shape.numel()
    return width * values


def _sent(nbytes: int) -> tuple[str, str, int]:
    """What one step's ``nbytes`` all-reduced are for the MLP: ("whole" | "factors" | "", "fp32" |
    "fp16" | "", the factors' rank or 0)."""
    values = mlp()[1] // 4
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

    from ...tracking.tracker import TRACKER

    rank = dist.get_rank()
    x, y = models.make_dataset("mlp", SHARE * dist.get_world_size()).tensors
    mine = slice(rank * SHARE, (rank + 1) * SHARE)
    ddp = DDP(models.build_model("mlp", seed=0))
    register(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    per_step = []
    for _ in range(PSGD_STEPS):
        seen = []
        with TRACKER.listen(all_reduces(seen)):
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
