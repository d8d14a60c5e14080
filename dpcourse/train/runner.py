"""One training loop for every wrapper, run on each rank of an initialised process group.

The same function runs under ``torchrun`` (``python -m dpcourse.train``) and on the
notebook's ranks (``cluster.run(dpc.train.train, cfg)``); it needs no cluster. ``main`` arms
a death signal (``dpcourse.processes``) so a torchrun worker dies with its agent, and leaves
the process group the one way the package does (``processes.leave_process_group``);
``--measure``'s observers listen to the collective tracker (``dpcourse.tracking``), which runs
in any process.

What a correct DDP/FSDP script does, it does visibly: a ``DistributedSampler`` with
``set_epoch``, identical initial weights, logging and saving on rank 0 only, checkpoints
through DCP, and the loss averaged over ranks (the loss of the global batch).
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from .. import models, vocab
from ..backends import BackendError, choose_backend, rank_device, uses_cuda
from . import checkpoint, parallel
from .config import TrainConfig


def build(cfg: TrainConfig, device: torch.device, wrap=None, optimizer_for=None):
    """Model (wrapped), optimizer, sampler and loader for this rank.

    wrap: a callable that wraps the model instead of ``cfg.wrapper`` (a from-scratch
    one, a learner's); optimizer_for: ``params -> optimizer`` instead of ``cfg.optimizer``'s.
    """
    model = models.build_model(cfg.model, seed=cfg.seed, **cfg.model_sizes).to(device)
    blocks = models.wrap_classes(cfg.model)
    # Every rank built the same seeded weights: FSDP does not broadcast them (DDP would).
    if wrap is not None:
        model = wrap(model)
    elif cfg.wrapper == "ddp":
        model = parallel.apply_ddp(model, device, cfg)
    else:
        apply = parallel.apply_fsdp if cfg.wrapper == "fsdp" else parallel.apply_fsdp2
        model = apply(model, device, cfg, blocks)
    optimizer = optimizer_for(model.parameters()) if optimizer_for else make_optimizer(cfg, model.parameters())
    sampler, loader = make_loader(cfg, dist.get_rank(), dist.get_world_size())
    return model, optimizer, sampler, loader


def make_loader(cfg: TrainConfig, rank: int, world_size: int):
    """(sampler, loader) of rank ``rank``'s share of ``cfg``'s dataset: ``cfg.batch_size``
    samples per batch, shuffled by ``cfg.seed``, the last uneven samples dropped."""
    dataset = models.make_dataset(cfg.model, cfg.num_samples, seed=cfg.seed + 1, **cfg.model_sizes)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=cfg.seed, drop_last=True)
    return sampler, DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)


def make_optimizer(cfg: TrainConfig, params):
    """The optimizer ``cfg.optimizer`` names (``dpcourse.vocab.OPTIMIZERS``), at ``cfg.lr``."""
    return vocab.make_optimizer(cfg.optimizer, params, cfg.lr)


def batches(loader, sampler, start_step: int, steps: int, epoch: int | None = None, skip: int = 0):
    """(step, batch) from ``start_step`` on, calling ``set_epoch`` at every epoch start.

    ``epoch``/``skip``: where ``start_step`` is in the data (a checkpoint's record: the
    sampler epoch and the index of the next batch in it); by default derived from the step.
    """
    per_epoch = len(loader)
    if epoch is None:
        epoch, skip = divmod(start_step, per_epoch)
    step = start_step
    while step < steps:
        sampler.set_epoch(epoch)  # without it every epoch repeats the same shuffle
        for i, batch in enumerate(loader):
            if i < skip:
                continue
            yield step, batch
            step += 1
            if step >= steps:
                return
        epoch, skip = epoch + 1, 0


def train(cfg: TrainConfig, full_state: bool = False, wrap=None, optimizer_for=None) -> dict:
    """Train for ``cfg.steps`` steps on this rank; return this rank's metrics.

    Metrics: ``losses`` (the global batch's loss per step), ``applied`` (what was wrapped how),
    ``first_step`` and ``resumed_from``; with ``full_state``, ``state``: the full (unsharded)
    model state dict on rank 0, None elsewhere. Measurement attaches from outside
    (``cluster.run(train, cfg, observe=[...])``, ``--measure`` on the command line).
    wrap, optimizer_for: see ``build`` (e.g. ``wrap=dpc.scratch.BucketedDDP``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    cfg.validate(world, device.type)
    model, optimizer, sampler, loader = build(cfg, device, wrap, optimizer_for)
    applied = parallel.describe(model, cfg) if wrap is None else f"{type(model).__name__} over {world} ranks"
    begin, resumed_from = checkpoint.resume(cfg.resume, cfg.checkpoint_dir, model, optimizer,
                                            cfg.batch_size * world, per_epoch=len(loader))
    if rank == 0 and cfg.progress:
        origin = f" (resumed from {resumed_from})" if resumed_from else ""
        print(f"{applied}; steps {begin.step}..{cfg.steps}{origin}, global batch {cfg.batch_size * world}",
              flush=True)  # seen even if this attempt is killed
    # DDP + autocast: fp32 weights, low-precision compute (FSDP's MixedPrecision is in the wrap)
    autocast = (torch.autocast(device.type, dtype=parallel._DTYPES[cfg.mixed_precision])
                if cfg.wrapper == "ddp" and cfg.mixed_precision != "fp32" else contextlib.nullcontext())
    losses = []
    for step, (x, y) in batches(loader, sampler, begin.step, cfg.steps, begin.epoch, begin.batch):
        x, y = x.to(device), y.to(device)
        with autocast:
            loss = models.loss_fn(cfg.model, model(x), y)
        loss.backward()  # DDP all-reduces / FSDP reduce-scatters the gradients here
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # gradients are freed between steps
        loss = loss.detach().float().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # mean over ranks = the global batch's loss
        losses.append(loss.item())
        if cfg.progress and rank == 0:
            end = "\n" if step + 1 == cfg.steps else ""
            print(f"\rstep {step + 1}/{cfg.steps} loss {losses[-1]:.4f}", end=end, flush=True)
        every = cfg.checkpoint_every
        if cfg.checkpoint_dir and (step + 1 == cfg.steps or (every and (step + 1) % every == 0)):
            checkpoint.save(cfg.checkpoint_dir, model, optimizer,
                            begin.advanced(step + 1 - begin.step, len(loader)), keep=cfg.keep_checkpoints)
    metrics = {"rank": rank, "world_size": world, "applied": applied, "first_step": begin.step,
               "resumed_from": resumed_from, "losses": losses}
    if full_state:
        metrics["state"] = full_model_state(model)
    return metrics


def full_model_state(model) -> dict | None:
    """Rank 0's full (unsharded) model state dict as CPU tensors (None on other ranks); a
    collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ..torch_private import is_fsdp1_wrapper

    if hasattr(model, "gather_full_params"):  # the from-scratch MiniFSDP
        full = model.gather_full_params()
    elif isinstance(getattr(model, "module", None), torch.nn.Module) and not is_fsdp1_wrapper(model):
        full = get_model_state_dict(model.module)  # DDP or a wrapper with DDP's surface: the plain model
    else:
        # cpu_offload=True segfaults for FSDP1 when the parameters already live on the CPU
        # (torch 2.13, Gloo); gather in place and copy to the CPU ourselves.
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu() for k, v in full.items()} if dist.get_rank() == 0 else None


def train_single_process(cfg: TrainConfig, world_size: int, accumulation: int = 1) -> dict:
    """The reference: one process, no process group, on the same global batches.

    Step s's global batch is the concatenation of what each rank's ``DistributedSampler``
    gives it over the step's ``accumulation`` micro-batches, so a correct data-parallel run
    must reproduce these losses. Returns ``losses`` (per step), the final ``state`` dict and
    ``params`` ({name: tensor}).
    """
    model = models.build_model(cfg.model, seed=cfg.seed, **cfg.model_sizes)
    optimizer = make_optimizer(cfg, model.parameters())
    streams = []
    for r in range(world_size):
        sampler, loader = make_loader(cfg, r, world_size)
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


def observers_for(measure: str) -> list:
    """``--measure time,bytes`` -> the observers that measure them (``dpc.observe``)."""
    from ..observe import Comm, Timeline

    known = {"time": Timeline, "bytes": Comm}
    names = [m.strip() for m in measure.split(",") if m.strip()]
    unknown = [m for m in names if m not in known]
    if unknown:
        raise ValueError(f"--measure {','.join(unknown)}: choose from {', '.join(known)}")
    return [known[m]() for m in names]


def measured(observers: list) -> dict:
    """What ``--measure``'s observers saw on this rank, for the metrics file: the last step's
    bytes by collective (logical and on the wire), and each step's seconds."""
    from ..observe import Comm, Timeline

    out = {}
    for observer in observers:
        observer.collect([observer.result()])  # this rank's own view
        if isinstance(observer, Comm):
            steps = observer.per_rank[0]["steps"]
            out["comm"] = {"bytes": observer.bytes(0, -1) if steps else observer.bytes(0),
                           "wire": _measured(observer.wire(0, -1) if steps else observer.wire(0))}
        elif isinstance(observer, Timeline):
            out["step_time_s"] = observer.step_seconds(rank=0)
    return out


def _measured(nbytes):
    """Bytes, or None where the wire is not measured (JSON has no NotMeasured)."""
    return nbytes if isinstance(nbytes, int) else None


def main(argv=None, parent: int | None = None) -> int:
    """``python -m dpcourse.train``: run under torchrun (or alone as world size 1).

    Under torchrun the process dies with its agent (``parent``: the agent's PID, read at
    start-up), so no worker outlives a killed ``torchrun``."""
    import json
    import os

    from ..processes import leave_process_group, set_death_signal
    from .config import ConfigError, parse_args
    from .join import JoinError, join

    if parent is not None and "TORCHELASTIC_RUN_ID" in os.environ:
        set_death_signal(parent)

    cfg = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        backend = choose_backend(cfg.backend, local_world)  # one GPU per local rank, or Gloo
        cfg.validate(world, "cuda" if uses_cuda(backend) else "cpu")
        observers = observers_for(cfg.measure)
    except (BackendError, ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:  # plain `python -m dpcourse.train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    if uses_cuda(backend):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    try:
        join(backend, cfg.pg_timeout)  # dist.init_process_group, safe across torchrun's restarts
    except JoinError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    try:
        with contextlib.ExitStack() as stack:
            for observer in observers:
                stack.enter_context(observer)
            metrics = train(cfg)
        metrics.update(measured(observers))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, metrics)
        if dist.get_rank() == 0 and cfg.metrics_path:  # only rank 0 writes files
            with open(cfg.metrics_path, "w") as f:
                json.dump({"config": vars(cfg), "ranks": everyone}, f, indent=1)
    finally:
        leave_process_group()  # together, after a barrier (__main__.py then skips Python's shutdown)
    return 0
