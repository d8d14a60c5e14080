"""4.2f's try-its: long runs, written by the learner (checked on the notebook's ranks): a DCP
checkpoint of model, optimizer and schedule resumed under another sharding, and gradient
accumulation under FSDP2 with micro-batches of unequal sizes.

Each checker runs the learner's code on every rank and judges what it did against one
process (weights, optimizer state, gradients of the plain model) and against what the ranks
did, seen from outside (each unit's reduce-scatters).
"""
from __future__ import annotations

import re
import shutil
import tempfile

import torch
import torch.distributed as dist

from ... import models
from ..ranks import RankFailure
from ..report import Report
from . import RUNS, fail_all, on_ranks, run_checked, try_it
from .fsdp import _Collectives, _close, _imports, _quiet, _ratio   # 4.2b's: the tracker, FSDP1's warnings
from .fsdp import TIMEOUT as FSDP_TIMEOUT   # seconds for a call after 4.2b's warm-up
from .large_models import RTOL, ATOL, _full   # 4.2c's: tolerances, a DTensor glued on the CPU


# -------------------------------------------------------------------------------------- dcp
DCP_STEPS, DCP_BATCH, DCP_LR = 2, 8, 1e-2   # steps before the checkpoint, samples per rank
DCP_AFTER, DCP_WARMUP = 2, 4                # steps after it; warm-up steps of the learning rate


def _warmup(step: int) -> float:
    """The schedule: the learning rate rises linearly over DCP_WARMUP steps, then stays."""
    return min(1.0, (step + 1) / DCP_WARMUP)


def _dcp_step(model, optimizer, scheduler, step, x, y):
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice((step * world + rank) * DCP_BATCH, (step * world + rank + 1) * DCP_BATCH)
    models.loss_fn("mlp", model(x[rows]), y[rows]).backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _full_state(model, optimizer) -> tuple[dict, dict]:
    """The model's full weights and the optimizer's full state, under the plain model's names."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True)
    weights = get_model_state_dict(model, options=options)
    state = get_optimizer_state_dict(model, optimizer, options=options)["state"]
    return ({k: v.detach().clone() for k, v in weights.items()},
            {k: {s: v.detach().clone() for s, v in per.items()} for k, per in state.items()})


def _dcp_on_rank(checkpoint, folder):
    with _quiet():
        return _dcp_run(checkpoint, folder)


def _dcp_run(checkpoint, folder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.optim.lr_scheduler import LambdaLR

    world = dist.get_world_size()
    x, y = models.make_dataset("mlp", (DCP_STEPS + DCP_AFTER) * DCP_BATCH * world).tensors
    # the saver: fully_shard (each parameter a DTensor sharded on dim 0), AdamW with a warm-up, 2 steps
    mesh = init_device_mesh("cpu", (world,))
    saver = models.build_model("mlp", seed=0)
    for block in saver.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(saver, mesh=mesh)
    optimizer = torch.optim.AdamW(saver.parameters(), lr=DCP_LR)
    scheduler = LambdaLR(optimizer, _warmup)
    for step in range(DCP_STEPS):
        _dcp_step(saver, optimizer, scheduler, step, x, y)
    saved_weights, saved_state = _full_state(saver, optimizer)
    saved_at = (scheduler.last_epoch, scheduler.get_last_lr()[0])
    checkpoint.save(saver, optimizer, scheduler, folder)
    dist.barrier()
    for step in range(DCP_STEPS, DCP_STEPS + DCP_AFTER):   # the uninterrupted run goes on
        _dcp_step(saver, optimizer, scheduler, step, x, y)
    want, _ = _full_state(saver, optimizer)

    # the loader: FSDP1 over a model with other weights (flat parameters, sharded otherwise)
    plain = models.build_model("mlp", seed=1)
    loader = FSDP(plain, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({models.MLPBlock}))
    resumed = torch.optim.AdamW(loader.parameters(), lr=DCP_LR)
    schedule = LambdaLR(resumed, _warmup)
    checkpoint.load(loader, resumed, schedule, folder)
    weights, state = _full_state(loader, resumed)
    loaded_at = (schedule.last_epoch, schedule.get_last_lr()[0])
    for step in range(DCP_STEPS, DCP_STEPS + DCP_AFTER):
        _dcp_step(loader, resumed, schedule, step, x, y)
    after, _ = _full_state(loader, resumed)
    return {"weights": _close([weights.get(k, torch.full_like(v, float("nan"))) for k, v in saved_weights.items()],
                              list(saved_weights.values())),
            "state": _compare_state(state, saved_state), "saved_at": saved_at, "loaded_at": loaded_at,
            "next": max((after[k] - v).abs().max().item() for k, v in want.items())}


def _compare_state(state: dict, saved: dict) -> str:
    """"" when ``state`` is ``saved``; else what differs, in words."""
    if not any(state.values()):
        return "empty: the optimizer holds no moments and no step count"
    steps = {float(per["step"]) for per in state.values() if "step" in per}
    want_steps = {float(per["step"]) for per in saved.values() if "step" in per}
    if steps != want_steps:
        fresh = ", what the state-dict API gives a fresh optimizer," if steps == {1.0} else ""
        return f"its step count is {', '.join(f'{s:g}' for s in sorted(steps))}{fresh} not the saved one"
    for fqn, per in saved.items():
        mine = state.get(fqn, {})
        for key, value in per.items():
            if key not in mine or not torch.allclose(mine[key].float(), value.float(), rtol=RTOL, atol=ATOL):
                zero = key in mine and not mine[key].abs().max().item()
                return f"its {key} of {fqn} {'is all zeros' if zero else 'differs from the saved one'}"
    return ""


def _load_failure(got: RankFailure, world_size: int) -> str:
    """A failed call, said as what load saw where it failed putting the optimizer's state back."""
    by_position = re.search(r"Size mismatch between saved .* for \S*state\.\d+\.", got.summary)
    said = re.search(r"(Size mismatch between saved[^\n]*|loaded state dict contains a parameter group[^\n]*)",
                     got.summary)
    if not (by_position or "parameter group that doesn't match" in got.summary):
        return got.describe(FSDP_TIMEOUT)
    seen = ("the saved optimizer state, numbered by position, has other shapes than the new "
            "optimizer's" if by_position else "the saved parameter groups do not match the new "
            "optimizer's in size")
    return (f"load failed putting the optimizer's state back: {seen} "
            f"(PyTorch: \"{said.group(1).strip()[:160] if said else got.summary[:160]}\"). An optimizer's own state_dict numbers "
            "its parameters by their position in this rank's optimizer and holds them as this "
            "sharding lays them out, which another sharding does otherwise: which state dicts "
            "name them by the model's parameter names, whatever the sharding?")


@try_it("dcp", "4.2f", "a DCP checkpoint of model, optimizer and schedule, resumed sharded otherwise")
def check_dcp(checkpoint, cluster) -> Report:
    report = Report("")
    weights, state = "after load, the weights are the saved ones", "after load, the optimizer's state is the saved one"
    where = "after load, the schedule is where the saved run left it"
    step = f"the next {DCP_AFTER} steps equal the uninterrupted run's"
    missing = [m for m in ("save", "load") if not callable(getattr(checkpoint, m, None))]
    if missing:
        return fail_all(report, RUNS, f"the class has no {' and no '.join(missing)} to call",
                        (weights, state, where, step))
    folder = tempfile.mkdtemp(prefix="dpcourse-dcp-")   # fresh: DCP warns when it overwrites
    try:
        got = run_checked(report, cluster, _dcp_on_rank, checkpoint, folder, items=(weights, state, where, step),
                          timeout=FSDP_TIMEOUT, warm_up=_imports, describe=_load_failure)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if got is None:
        return report
    if all(r["weights"] for r in got):
        report.add(weights, True)
    else:
        report.add(weights, False, "the resumed model's weights are not the ones saved (it was built with "
                   "other weights): does load put what it read into the model, and was the model saved?")
    problems = [r["state"] for r in got if r["state"]]
    if not problems:
        report.add(state, True)
    else:
        report.add(state, False, f"after load the optimizer's state is {problems[0]}"
                   if problems[0].startswith("empty") else f"after load, the optimizer's state differs: "
                   f"{problems[0]}. AdamW's moments and step count decide the next update: are they saved, "
                   "read back and put into the new optimizer?")
    (want_at, want_lr), (got_at, got_lr) = got[0]["saved_at"], got[0]["loaded_at"]
    if all(r["loaded_at"] == r["saved_at"] for r in got):
        report.add(where, True)
    else:
        report.add(where, False, f"after load the learning-rate schedule is at step {got_at} (rate {got_lr:.3g}), "
                   f"the saved run's was at step {want_at} ({want_lr:.3g}): the warm-up starts over, and the "
                   "resumed run trains at rates the uninterrupted one never used. Is the schedule's position "
                   "part of the checkpoint, and put back into the new scheduler?")
    worst = max(r["next"] for r in got)
    if worst < 1e-5:
        report.add(step, True)
    else:
        report.add(step, False, f"after the next {DCP_AFTER} steps the weights differ from the uninterrupted "
                   f"run's by up to {worst:.2g}: the resumed run does not continue where the saved one stopped")
    return report


# ---------------------------------------------------------------------------- gradient_sync
SYNC_SIZES = (2, 4, 6)     # samples in each of a rank's micro-batches: unequal on purpose


def _accumulate_on_rank(accumulate):
    import math as _math

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    share = sum(SYNC_SIZES)
    x, y = models.make_dataset("mlp", share * world).tensors
    mine = slice(rank * share, (rank + 1) * share)
    micro_batches = list(zip(x[mine].split(list(SYNC_SIZES)), y[mine].split(list(SYNC_SIZES))))
    reference = models.build_model("mlp", seed=0)
    models.loss_fn("mlp", reference(x), y).backward()
    want = [p.grad for p in reference.parameters()]
    equal = models.build_model("mlp", seed=0)          # each micro-batch's mean loss counted alike
    for r in range(world):
        rows = slice(r * share, (r + 1) * share)
        for xb, yb in zip(x[rows].split(list(SYNC_SIZES)), y[rows].split(list(SYNC_SIZES))):
            (models.loss_fn("mlp", equal(xb), yb) / (len(SYNC_SIZES) * world)).backward()

    mesh = init_device_mesh("cpu", (world,))
    model = models.build_model("mlp", seed=0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    units = len(model.blocks) + 1
    # the root's reduce-scatter output: its own parameters' (the head's) padded rows on one rank
    root_size = sum(_math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in model.head.parameters())
    with _Collectives() as seen:
        # a collective's phase: the micro-batch whose forward ran last (its backward follows it)
        seen.phase = -1
        counting = model.register_forward_pre_hook(lambda _module, _args: setattr(seen, "phase", seen.phase + 1))
        try:
            accumulate(model, micro_batches)
        finally:
            counting.remove()
    sizes = [n for (_, c, _), n in zip(seen.seen, seen.sizes) if c == "reduce_scatter"]
    grads = [torch.zeros(p.shape) if p.grad is None else _full(p.grad) for p in model.parameters()]
    return {"reduce_scatter": len(sizes), "root": sum(n == root_size for n in sizes), "units": units,
            "in_micro_batches": sorted({p for p, c, _ in seen.seen if c == "reduce_scatter"}),
            "grads": grads, "want": want, "equal": [p.grad for p in equal.parameters()],
            "empty": all(p.grad is None for p in model.parameters())}


@try_it("gradient_sync", "4.2f", f"micro-batches of {', '.join(map(str, SYNC_SIZES))} samples under fully_shard, "
        "one reduce-scatter")
@on_ranks(_accumulate_on_rank, "FSDP reduce-scatters each unit once per step",
          "gradients equal one process's on the global batch", timeout=FSDP_TIMEOUT, warm_up=_imports)
def check_gradient_sync(report: Report, got: list, once, same) -> None:
    r = got[0]
    blocks, n = r["units"] - 1, len(SYNC_SIZES)
    root, of_blocks = r["root"], r["reduce_scatter"] - r["root"]
    ran_in = r["in_micro_batches"]   # the micro-batches (from 0) whose backward reduce-scattered
    early = bool(ran_in) and max(ran_in) < n - 1
    if r["reduce_scatter"] == 0:
        report.add(once, False, "no reduce-scatter ran at all: every micro-batch's backward ran with the "
                   "gradient synchronisation off, so the gradients stayed unsharded on each rank, never "
                   "averaged over the ranks. Is synchronisation back on for the last backward?")
    elif (root, of_blocks) == (1, blocks) and ran_in == [n - 1]:
        report.add(once, True)
    elif (root, of_blocks) == (1, blocks):
        which = " and ".join(str(b + 1) for b in ran_in)
        report.add(once, False, f"each unit reduce-scattered once, but in the backward pass of micro-batch {which} "
                   f"of {n}, not of the last: what the later micro-batches added stayed unsharded on each rank, "
                   "never synchronised. The gradient-sync switch governs the next backward pass, the one that "
                   "runs after it is set: it must be set before the backward it applies to.")
    else:
        report.add(once, False, f"for {n} micro-batches the root's unit reduce-scattered {_times(root)} and "
                   f"the {blocks} blocks' units {_times(of_blocks)} in all: a unit that synchronised more than "
                   "once did so for micro-batches whose gradients were not final yet. Which units did the "
                   "switch reach: the root alone, or every unit below it too?")
    if all(_close(x["grads"], x["want"]) for x in got):
        report.add(same, True)
    elif r["empty"]:
        report.add(same, False, "the parameters' .grad are empty: FSDP2 keeps the accumulated unsharded "
                   "gradients aside and writes .grad only when a backward reduce-scatters them")
    elif all(_close(x["grads"], x["equal"]) for x in got):
        report.add(same, False, f"the gradients are those of the mean of the micro-batches' mean losses, each "
                   f"micro-batch counting alike, although they hold {', '.join(map(str, SYNC_SIZES))} samples: "
                   "a sample in a small micro-batch counted more than one in a large one. How much should "
                   "each micro-batch's mean loss count, if every sample is to count the same?")
    elif early:
        ratio = _ratio(r["grads"], r["want"])
        report.add(same, False, f"about {ratio:.2g} times the right size: they hold only what the micro-batches up to "
                   f"{max(ran_in) + 1} of {n} added when the reduce-scatter ran, not the whole step's gradient "
                   "(see the item above)")
    else:
        ratio = _ratio(r["grads"], r["want"])
        scale = (f"about {ratio:.2g} times the right size: how much should each micro-batch's loss count, "
                 "if the step is to see the mean over all the samples?" if abs(ratio - 1) > 0.05
                 else "they differ from it: is every micro-batch's loss part of the gradient, once, weighted "
                      "by its samples, and reduce-scattered after the last one?")
        report.add(same, False, scale)


def _times(n: int) -> str:
    return {0: "never", 1: "once", 2: "twice"}.get(n, f"{n} times")
