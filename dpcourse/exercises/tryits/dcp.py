"""4.2f's try-it ``dcp``: a DCP checkpoint of model, optimizer and schedule, resumed sharded
otherwise. Its set-up on the ranks, its items and the mistakes it names."""
from __future__ import annotations

import re
import shutil
import tempfile

import torch
import torch.distributed as dist

from ... import models
from ...grading.compare import ATOL, RTOL, close
from ...grading.judging import RUNS, RankFailure, run_checked
from ...grading.registry import try_it
from ...grading.report import Report
from .fsdp import TIMEOUT as FSDP_TIMEOUT
from .shared import fsdp_imports, quiet_fsdp1

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
    with quiet_fsdp1():
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
    return {"weights": close([weights.get(k, torch.full_like(v, float("nan"))) for k, v in saved_weights.items()],
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
        return report.fail(RUNS, f"the class has no {' and no '.join(missing)} to call",
                           (weights, state, where, step))
    folder = tempfile.mkdtemp(prefix="dpcourse-dcp-")   # fresh: DCP warns when it overwrites
    try:
        got = run_checked(report, cluster, _dcp_on_rank, checkpoint, folder, items=(weights, state, where, step),
                          timeout=FSDP_TIMEOUT, warm_up=fsdp_imports, describe=_load_failure)
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
