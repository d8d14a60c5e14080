"""``CommMeter``: the bytes one training step sends, by collective, next to the theory."""
from __future__ import annotations

import torch.distributed as dist

from .. import models
from ..collectives.meter import measure_bytes_sent
from . import parallel, volume
from .hooks import Run, StepHook


class CommMeter(StepHook):
    """``metrics["comm"]``: bytes this rank sent in the measured step -- logical (per c10d op
    PyTorch called, by collective, and by process group in ``by_group``) and on Gloo's wire --
    next to ``volume.step_bytes``."""

    def start(self, run: Run) -> None:
        self.report = None

    def around_step(self, run: Run, step: int, batch, do_step):
        if step != run.measured_step:
            return do_step()
        sent = measure_bytes_sent(do_step)
        self.report = comm_report(run, sent)
        return sent.result

    def finish(self, run: Run, metrics: dict) -> None:
        metrics["comm"] = self.report


def unit_names(model) -> list[str]:
    """Names (in the unwrapped model) of the modules FSDP made units of; "" is the root."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    names = []
    for name, module in model.named_modules():
        if isinstance(module, (FullyShardedDataParallel, FSDPModule)):
            names.append(name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "").rstrip("."))
    return names


def comm_report(run: Run, sent) -> dict:
    """Measured bytes (logical by collective; wire) next to the theory for this model's units."""
    cfg, itemsize = run.cfg, 4  # fp32 parameters
    plain = models.build_model(cfg.model, seed=cfg.seed, **cfg.model_sizes)  # the theory's sizes
    if cfg.strategy == "ddp":
        units, root = [itemsize * sum(p.numel() for p in plain.parameters())], 0
    else:
        names = unit_names(run.model)
        sizes = {n: itemsize * sum(p.numel() for p in plain.get_submodule(n).parameters()) for n in names}
        nested = {n: sum(sizes[m] for m in names if m != n and (n == "" or m.startswith(n + "."))) for n in names}
        own = {n: sizes[n] - nested[n] for n in names}
        root, units = own.pop("", 0), list(own.values())
    theory = volume.step_bytes(cfg.strategy, dist.get_world_size(), units, root, cfg.sharding_strategy,
                               cfg.reshard_after_forward, cfg.shard_group_size)
    dtypes = parallel.mixed_precision_dtypes(cfg) if cfg.strategy != "ddp" else None
    if dtypes:  # FSDP mixed precision gathers in param_dtype and reduces in reduce_dtype
        gather, reduce = (d.itemsize / itemsize for d in dtypes)
        theory = {c: b * (gather if c == "all_gather" else reduce) for c, b in theory.items()}
    measured: dict[str, int] = {}
    calls: dict[str, int] = {}  # how many of each collective the step launched
    by_group: dict[tuple, dict[str, int]] = {}  # the same bytes, split by process group (its ranks)
    for record in sent.records:
        if record.logical_sent:
            measured[record.collective] = measured.get(record.collective, 0) + record.logical_sent
            calls[record.collective] = calls.get(record.collective, 0) + 1
            group = by_group.setdefault(record.group_ranks, {})
            group[record.collective] = group.get(record.collective, 0) + record.logical_sent
    return {"param_bytes": root + sum(units), "root_bytes": root, "theory": theory, "measured": measured, "calls": calls,
            "by_group": by_group, "wire": sent.wire, "gloo_wire_theory": volume.gloo_wire_bytes(theory)}
