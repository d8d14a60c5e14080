"""One training loop for every strategy, run on each rank of an initialised process group.

The same function runs under ``torchrun`` (``python -m dpcourse.train``) and on the
notebook's ranks (``cluster.run(dpc.train.train, cfg)``); it never depends on the latter.
What a correct DDP/FSDP script does, it does visibly: a ``DistributedSampler`` with
``set_epoch``, identical initial weights, logging and saving on rank 0 only, checkpoints
through DCP, and the loss averaged over ranks (the loss of the global batch).
"""
from __future__ import annotations

import contextlib
import gc
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from .. import models
from ..collectives.meter import measure_bytes_sent
from . import checkpoint, parallel, volume
from .config import TrainConfig


def rank_device() -> torch.device:
    """``cuda:LOCAL_RANK`` under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build(cfg: TrainConfig, device: torch.device):
    """Model (wrapped), optimizer, sampler and loader for this rank."""
    model = models.build_model(cfg.model, seed=cfg.seed, **cfg.model_sizes).to(device)
    blocks = models.wrap_classes(cfg.model)
    if cfg.strategy == "ddp":
        model = parallel.apply_ddp(model, device, cfg)  # broadcasts rank 0's weights itself
    else:
        parallel.broadcast_module(model)
        apply = parallel.apply_fsdp if cfg.strategy == "fsdp" else parallel.apply_fsdp2
        model = apply(model, device, cfg, blocks)
    optimizer = make_optimizer(cfg, model.parameters())
    dataset = models.make_dataset(cfg.model, cfg.num_samples, seed=cfg.seed + 1, **cfg.model_sizes)
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                 shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
    return model, optimizer, sampler, loader


def make_optimizer(cfg: TrainConfig, params):
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)


def batches(loader, sampler, start_step: int, steps: int):
    """(step, batch) from ``start_step`` on, calling ``set_epoch`` at every epoch start."""
    per_epoch = len(loader)
    step = start_step
    while step < steps:
        epoch, skip = divmod(step, per_epoch)
        sampler.set_epoch(epoch)  # without it every epoch repeats the same shuffle
        for i, batch in enumerate(loader):
            if i < skip:
                continue
            yield step, batch
            step += 1
            if step >= steps:
                return


def train(cfg: TrainConfig, return_state: bool = False) -> dict:
    """Train for ``cfg.steps`` steps on this rank; return this rank's metrics.

    Metrics: ``losses`` (global-batch loss per step), ``step_time_s`` and ``step_cpu_s``
    (wall and CPU seconds per step), ``samples_per_s`` (global, median step), ``applied``.
    With ``return_state``, rank 0 also returns the full model state dict (CPU tensors).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    cfg.validate(world, device.type)
    model, optimizer, sampler, loader = build(cfg, device)
    applied = parallel.describe(model, cfg)
    start = checkpoint.load(cfg.checkpoint_dir, model, optimizer) if cfg.resume else 0
    if rank == 0:
        print(f"{applied}; steps {start}..{cfg.steps}, global batch {cfg.batch_size * world}")
    autocast = (torch.autocast(device.type, dtype=parallel._DTYPES[cfg.mixed_precision])
                if cfg.strategy == "ddp" and cfg.mixed_precision != "fp32" else contextlib.nullcontext())
    def one_step(x, y, after_optimizer_step=None):
        with autocast:
            loss = models.loss_fn(cfg.model, model(x), y)
        loss.backward()
        optimizer.step()
        if after_optimizer_step is not None:
            after_optimizer_step()  # every model state is alive here: the ledger's "at rest"
        optimizer.zero_grad(set_to_none=True)  # gradients are freed between steps
        return loss

    buckets = {}
    if cfg.measure_memory and cfg.strategy == "ddp":
        from ..memory.measure import capture_buckets

        buckets = capture_buckets(model)  # DDP's buckets live in C++; its comm hook shows them
    losses, wall, cpu, comm, memory = [], [], [], None, None
    for step, (x, y) in batches(loader, sampler, start, cfg.steps):
        x, y = x.to(device), y.to(device)
        # The last step is measured (bytes sent, memory) if it is a steady one -- DDP's first
        # step uses one bucket, its second broadcasts the rebuilt bucket order -- and not timed.
        instrumented = step + 1 == cfg.steps and step >= start + 2
        t0, c0 = time.perf_counter(), time.process_time()
        if instrumented:
            held = {}

            def measured_step():
                if not cfg.measure_memory:
                    return one_step(x, y)
                from ..memory.measure import held_bytes
                from ..memory.record import record_step

                def snapshot():
                    held["at_rest"] = held_bytes(model, optimizer, buckets)

                held["record"] = record_step(model, optimizer,
                                             lambda _: held.setdefault("loss", one_step(x, y, snapshot)),
                                             buckets=buckets, inputs=(x, y))
                return held["loss"]

            sent = measure_bytes_sent(measured_step)
            plain = models.build_model(cfg.model, seed=cfg.seed, **cfg.model_sizes)  # theory's sizes
            loss, comm = sent.result, _comm_report(cfg, model, plain, sent)
            if cfg.measure_memory:
                memory = _memory_report(cfg, plain, held["at_rest"], held["record"])
        else:
            loss = one_step(x, y)
        global_loss = loss.detach().float().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)  # mean over ranks = global batch mean
        if not instrumented:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        losses.append(global_loss.item())
        if cfg.progress and rank == 0:
            end = "\n" if step + 1 == cfg.steps else ""
            print(f"\rstep {step + 1}/{cfg.steps} loss {losses[-1]:.4f}", end=end, flush=True)
    if cfg.checkpoint_dir:
        checkpoint.save(cfg.checkpoint_dir, model, optimizer, step=cfg.steps)
    metrics = {"rank": rank, "world_size": world, "applied": applied, "first_step": start,
               "losses": losses, "step_time_s": wall, "step_cpu_s": cpu, "comm": comm, "memory": memory,
               "samples_per_s": (cfg.batch_size * world / sorted(wall)[len(wall) // 2]) if wall else 0.0}
    if return_state:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload=True segfaults for FSDP1 when the parameters already live on the CPU
        # (torch 2.13, Gloo); gather in place and copy to the CPU ourselves.
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        metrics["state"] = {k: v.detach().cpu() for k, v in full.items()} if rank == 0 else None
    return metrics


def unit_names(model) -> list[str]:
    """Names (in the unwrapped model) of the modules FSDP made units of; "" is the root."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    names = []
    for name, module in model.named_modules():
        if isinstance(module, (FullyShardedDataParallel, FSDPModule)):
            names.append(name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "").rstrip("."))
    return names


def _comm_report(cfg: TrainConfig, model, plain, sent) -> dict:
    """Bytes this rank sent in one step: measured (logical, by collective; wire) next to theory
    computed from ``plain``, the unwrapped model."""
    itemsize = 4  # fp32 parameters
    if cfg.strategy == "ddp":
        units, root = [itemsize * sum(p.numel() for p in plain.parameters())], 0
    else:
        names = unit_names(model)
        sizes = {n: itemsize * sum(p.numel() for p in plain.get_submodule(n).parameters()) for n in names}
        nested = {n: sum(sizes[m] for m in names if m != n and (n == "" or m.startswith(n + "."))) for n in names}
        own = {n: sizes[n] - nested[n] for n in names}
        root, units = own.pop("", 0), list(own.values())
    world = dist.get_world_size()
    theory = volume.step_bytes(cfg.strategy, world, units, root, cfg.sharding_strategy,
                               cfg.reshard_after_forward, cfg.hybrid_shard_size)
    measured: dict[str, int] = {}
    for record in sent.records:
        if record.logical_sent:
            measured[record.collective] = measured.get(record.collective, 0) + record.logical_sent
    return {"param_bytes": root + sum(units), "theory": theory, "measured": measured,
            "wire": sent.wire, "gloo_wire_theory": volume.gloo_wire_bytes(theory)}


def _memory_report(cfg: TrainConfig, plain, at_rest: dict, record: dict) -> dict:
    """Bytes this rank holds at rest (after the optimizer step, before zero_grad) and at the
    step's peak, next to the memory ledger.

    Builds the record ``dpcourse.memory.report.compare`` reads, so the runner and the memory
    lessons compare theory and measurement with the same code. The theory is exact for
    one unit per block (``auto_wrap="block"``) and fp32; otherwise only measurements.
    """
    from ..memory import report
    from ..memory.layout import unit_shapes
    if cfg.strategy == "ddp":
        strategy, options = "ddp", {"gradient_as_bucket_view": cfg.gradient_as_bucket_view}
    elif cfg.strategy == "fsdp2":
        strategy, options = "fully_shard", {"reshard_after_forward": cfg.reshard_after_forward}
    else:
        strategy = cfg.sharding_strategy
        options = {"shard_group_size": cfg.hybrid_shard_size} if strategy == "HYBRID_SHARD" else {}
    result = {"strategy": strategy, "options": options, "rank": dist.get_rank(),
              "world_size": dist.get_world_size(), "model": cfg.model, "sizes": dict(cfg.model_sizes),
              "batch_size": cfg.batch_size, "optimizer": "adamw" if cfg.optimizer == "adamw" else "sgd_momentum",
              "num_params": sum(p.numel() for p in plain.parameters()),
              "units": unit_shapes(plain, models.wrap_classes(cfg.model)),
              "at_rest": at_rest, "frames": record["frames"]}
    exact = (cfg.auto_wrap == "block" or cfg.strategy == "ddp") and cfg.mixed_precision == "fp32"
    return {"at_rest": result["at_rest"], "peak_bytes": record["peak_bytes"], "tool": record["tool"],
            "compare": report.compare(result) if exact else None}


def train_single_process(cfg: TrainConfig, world_size: int, accumulation: int = 1) -> dict:
    """The reference: one process, no process group, on the same global batches.

    Step s's global batch is the concatenation of what each rank's ``DistributedSampler``
    gives it over the step's ``accumulation`` micro-batches, so a correct data-parallel run
    must reproduce these losses. Returns ``losses`` (per step), the final ``state`` dict and
    ``params`` ({name: tensor}).
    """
    model = models.build_model(cfg.model, seed=cfg.seed, **cfg.model_sizes)
    optimizer = make_optimizer(cfg, model.parameters())
    dataset = models.make_dataset(cfg.model, cfg.num_samples, seed=cfg.seed + 1, **cfg.model_sizes)
    streams = []
    for r in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=r, shuffle=True,
                                     seed=cfg.seed, drop_last=True)
        loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
        streams.append(batches(loader, sampler, 0, cfg.steps * accumulation))
    losses = []
    for _ in range(cfg.steps):
        micro = [next(stream)[1] for _ in range(accumulation) for stream in streams]
        x, y = torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro])
        loss = models.loss_fn(cfg.model, model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def main(argv=None) -> int:
    """``python -m dpcourse.train``: run under torchrun (or alone as world size 1)."""
    import json
    import os

    from .config import ConfigError, parse_args

    cfg = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
    try:
        if backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("backend nccl needs CUDA GPUs; use --backend gloo on CPUs")
        cfg.validate(world, "cuda" if backend == "nccl" else "cpu")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:  # plain `python -m dpcourse.train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group(backend)
    try:
        metrics = train(cfg)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, metrics)
        if dist.get_rank() == 0 and cfg.metrics_path:  # only rank 0 writes files
            with open(cfg.metrics_path, "w") as f:
                json.dump({"config": vars(cfg), "ranks": everyone}, f, indent=1)
    finally:
        # Every rank must reach this point before the group goes away: without the barrier,
        # agents on different "nodes" tear down while peers still talk (seen as SIGABRT).
        dist.barrier()
        # The model and optimizer sit in reference cycles (module hooks) that hold the process
        # group; left to the interpreter's teardown, the group's threads are destroyed out of
        # order and a rank can abort at exit ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()
    return 0
