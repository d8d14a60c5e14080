"""Measure one strategy's memory ledger on the ranks: at rest, and over one recorded step.

    cluster.run(dpc.memory.experiment.measure_strategy, "FULL_SHARD", model="mlp")

Each rank builds the same seeded model, wraps it, trains ``warmup_steps`` steps (DDP
rebuilds its buckets after the first; Adam creates its state in the first), measures what
it holds (``held_bytes``) and records one more step (``StepRecorder``). The result is plain
data for the kernel, which compares it with ``ledger`` and draws it.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from .. import models, vocab
from .layout import unit_shapes
from .measure import capture_buckets, held_bytes
from .record import StepRecorder

MEASURED = ("ddp", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "fully_shard")
FSDP1 = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")


def wrap(model, strategy: str, device: torch.device, unit_classes, *, gradient_as_bucket_view=False,
         reshard_after_forward=True, shard_group_size=None):
    """``model`` wrapped for the ledger's ``strategy`` by the training runner's own functions
    (``dpcourse.train.parallel``), so what is measured here is what the runner trains.

    Weights must already match rank 0's. FSDP1 keeps FlatParameters (``use_orig_params=False``):
    they are what the ledger counts, and ``MemTracker`` cannot follow the original-parameter
    views. HYBRID_SHARD gets an explicit (replicate, shard) mesh.
    """
    from ..train import TrainConfig, parallel

    if strategy == "ddp":
        cfg = TrainConfig(strategy="ddp", gradient_as_bucket_view=gradient_as_bucket_view)
        return parallel.apply_ddp(model, device, cfg)
    if strategy in FSDP1:
        cfg = TrainConfig(strategy="fsdp", sharding_strategy=strategy, shard_group_size=shard_group_size)
        if strategy == "HYBRID_SHARD":
            cfg.hybrid_mesh_shape(dist.get_world_size())  # a clear error before any collective
        return parallel.apply_fsdp(model, device, cfg, set(unit_classes))
    if strategy == "fully_shard":
        cfg = TrainConfig(strategy="fully_shard", reshard_after_forward=reshard_after_forward)
        return parallel.apply_fsdp2(model, device, cfg, set(unit_classes))
    raise ValueError(f"cannot measure strategy {strategy!r}; choose one of {', '.join(MEASURED)}")


def _unit_modules(wrapped, blocks: dict, strategy: str) -> dict:
    """{module whose forward starts a unit: unit name}; FSDP1's are the wrappers (they gather)."""
    if strategy in FSDP1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        found = {m: blocks.get(id(m.module), "root") for m in wrapped.modules() if isinstance(m, FSDP)}
        return found
    inner = wrapped.module if strategy == "ddp" else wrapped
    return {**{m: name for m in inner.modules() for name in [blocks.get(id(m))] if name}, inner: "root"}


def measure_strategy(strategy: str, model: str = "mlp", sizes: dict | None = None, batch_size: int = 8,
                     optimizer: str = "adam", warmup_steps: int = 2, record: bool = True, seed: int = 0,
                     precision: str = "fp32", **options) -> dict:
    """On this rank: bytes held at rest by role, and the recorded step's frames (all per rank).

    precision: "fp32", or "autocast" (ddp only: forward and loss under ``torch.autocast``
    in bfloat16, as the training runner does). options: gradient_as_bucket_view (ddp),
    reshard_after_forward (fully_shard), shard_group_size (HYBRID_SHARD).
    """
    from ..train.parallel import broadcast_module

    if precision not in ("fp32", "autocast") or (precision == "autocast" and strategy != "ddp"):
        raise ValueError(f"cannot measure precision {precision!r} with {strategy!r}; measured are fp32 "
                         "(every strategy) and autocast (ddp)")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    sizes = dict(sizes or {})
    net = models.build_model(model, seed=seed, **sizes).to(device)
    classes = models.wrap_classes(model)
    units = unit_shapes(net, classes)
    blocks = {id(m): name for name, m in net.named_modules() if isinstance(m, tuple(classes))}
    num_params = sum(p.numel() for p in net.parameters())
    broadcast_module(net)  # identical weights everywhere (FSDP on CPU cannot sync them itself)
    wrapped = wrap(net, strategy, device, classes, **options)
    buckets = capture_buckets(wrapped) if strategy == "ddp" else {}
    opt = vocab.make_optimizer(optimizer, wrapped.parameters(), lr=1e-3)
    data = models.make_dataset(model, batch_size * world, seed=seed + 1, **sizes)
    x, y = (t[rank * batch_size:(rank + 1) * batch_size].to(device).clone() for t in data.tensors)

    def step(recorder=None):
        mark = recorder.phase if recorder else (lambda name: None)
        mark("zero_grad")
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "autocast"):
            out = wrapped(x)
            mark("loss")
            loss = models.loss_fn(model, out, y)
        mark("backward loss")  # the loss's own backward runs before any module's
        loss.backward()
        mark("optimizer step")
        opt.step()

    for _ in range(warmup_steps):
        step()
    result = {"strategy": strategy, "options": options, "rank": rank, "world_size": world,
              "device": device.type, "model": model, "sizes": sizes, "batch_size": batch_size,
              "optimizer": optimizer, "precision": precision, "num_params": num_params, "units": units,
              "at_rest": held_bytes(wrapped, opt, buckets), "frames": None, "tool": None,
              "tool_peak": None, "cuda": None}
    if record:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        recorder = StepRecorder(wrapped, opt, _unit_modules(wrapped, blocks, strategy), buckets, (x, y))
        with recorder:
            step(recorder)
        result.update(frames=recorder.frames(), tool=recorder.tool, tool_peak=recorder.tool_peak())
        if device.type == "cuda":
            torch.cuda.synchronize()
            result["cuda"] = {"at_rest": before, "peak": torch.cuda.max_memory_allocated()}
    dist.barrier()
    return result


def configurations(world_size: int) -> list[tuple[str, dict]]:
    """Every measurable (strategy, options); HYBRID_SHARD when the world splits in 2-rank groups."""
    configs = [("ddp", {}), ("ddp", {"gradient_as_bucket_view": True}), ("NO_SHARD", {}),
               ("SHARD_GRAD_OP", {}), ("FULL_SHARD", {}),
               ("fully_shard", {"reshard_after_forward": True}),
               ("fully_shard", {"reshard_after_forward": False})]
    if world_size >= 4 and world_size % 2 == 0:
        configs.append(("HYBRID_SHARD", {"shard_group_size": 2}))
    return configs


def measure_all(cluster, configs, timeout: float = 120, **kwargs) -> list[list[dict]]:
    """Run ``measure_strategy`` for each (strategy, options) on ``cluster``: per config, per rank."""
    return [cluster.run(measure_strategy, strategy, timeout=timeout, **kwargs, **options)
            for strategy, options in configs]
