"""Train with a from-scratch wrapper or its PyTorch counterpart, on the ranks; and the reference.

    cluster.run(dpc.scratch.train_steps, cfg, "bucketed", bucket_cap_mb=0.01, record=True)
    dpc.scratch.reference_steps(cfg, world_size)          # one process, concatenated batches

Both read a ``dpc.train.TrainConfig`` (model, sizes, data, batch size per rank, steps,
optimizer, lr, seed) and draw their batches exactly as ``dpc.train`` does
(``DistributedSampler`` per rank; the reference concatenates the ranks' batches), so a
correct data-parallel run ends with the reference's parameters. Runs on the ranks and
returns plain data; never draws.
"""
from __future__ import annotations

import contextlib
import inspect
import time

import torch
import torch.distributed as dist

from .. import models
from ..train import parallel
from ..backends import rank_device
from ..train.runner import batches, make_loader, make_optimizer
from .ddp import BucketedDDP, NaiveDDP, OverlapDDP
from .fsdp import MiniFSDP
from .observe import (BackwardObserver, FSDP1Observer, MiniFSDPObserver, observe_comm_hook,
                      observe_ddp_communication)
from .timeline import COMPUTE, Timeline
from .zero import ShardedOptimizer

SCRATCH = {"naive": NaiveDDP, "overlap": OverlapDDP, "bucketed": BucketedDDP, "mini_fsdp": MiniFSDP}
KINDS = tuple(SCRATCH) + ("ddp", "fsdp")
DDP_LIKE = ("naive", "overlap", "bucketed", "ddp")


def ring_reduce_scatter_hook(fsdp):
    """A comm hook for MiniFSDP: gradients reduce-scattered by ``dpcourse.collectives``' ring
    (blocking; sends (N-1)/N of the gradient where Gloo's sends 2(N-1)/N), every other
    collective left to ``fsdp``'s current hook.
    Install it with ``fsdp.comm_hook = ring_reduce_scatter_hook(fsdp)``."""
    from ..collectives import ring_reduce_scatter

    default = fsdp.comm_hook

    def hook(collective, output, input, name):
        if collective != "reduce_scatter":
            return default(collective, output, input, name)
        output.copy_(ring_reduce_scatter(input, op="sum", group=fsdp.group))  # in place, then ours
        done = torch.futures.Future()
        done.set_result(output)
        return done

    return hook


def wrap_model(kind: str, model, *, bucket_cap_mb: float | None = None,
               first_bucket_cap_mb: float | None = None, wrap=None,
               compute_dtype=None, reduce_scatter: str = "backend", shard_root: bool = False):
    """``model`` wrapped by ``kind`` (one of ``KINDS``, or a wrapper class taking ``(model)``,
    e.g. your own subclass of OverlapDDP); torch's wrappers are built with
    ``dpc.train.parallel`` (torch DDP with its defaults unless ``bucket_cap_mb`` is given;
    ``first_bucket_cap_mb`` is BucketedDDP's only). ``reduce_scatter="ring"``: MiniFSDP
    with ``ring_reduce_scatter_hook``."""
    if isinstance(kind, type):
        return kind(model)
    if kind not in KINDS:
        raise ValueError(f"unknown wrapper {kind!r}; choose one of {', '.join(KINDS)}")
    if reduce_scatter not in ("backend", "ring"):
        raise ValueError(f"reduce_scatter must be 'backend' (the process group's) or 'ring' "
                         f"(dpcourse.collectives), not {reduce_scatter!r}")
    if kind == "bucketed":
        return BucketedDDP(model, bucket_cap_mb=25 if bucket_cap_mb is None else bucket_cap_mb,
                           first_bucket_cap_mb=first_bucket_cap_mb)
    if kind in ("naive", "overlap"):
        return SCRATCH[kind](model)
    if kind == "mini_fsdp":
        fsdp = MiniFSDP(model, wrap=wrap, compute_dtype=compute_dtype, shard_root=shard_root)
        if reduce_scatter == "ring":
            fsdp.comm_hook = ring_reduce_scatter_hook(fsdp)
        return fsdp
    from ..train import TrainConfig

    device = next(model.parameters()).device
    if kind == "ddp":
        if bucket_cap_mb is None:
            return parallel.apply_ddp(model, device, TrainConfig())
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                   bucket_cap_mb=bucket_cap_mb)
    parallel.broadcast_module(model)  # FSDP1 cannot sync weights on CPU itself
    cfg = TrainConfig(strategy="fsdp", sharding_strategy="FULL_SHARD", auto_wrap="block")
    return parallel.apply_fsdp(model, device, cfg, wrap)


def observe(kind, wrapped, model, timeline):
    """Attach this rank's timeline to ``wrapped`` from outside; returns (backward observer or
    None, context manager around each step). DDP-like wrappers, torch's and ours alike, are
    observed the same way: per-layer backward from tensor hooks, then every collective
    through the comm hook, then the wait after backward (``backward_returned()``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(wrapped, MiniFSDP):
        MiniFSDPObserver(wrapped, timeline)
        return None, contextlib.nullcontext()
    if kind == "fsdp":
        return None, FSDP1Observer(wrapped, timeline)
    if isinstance(wrapped, DDP):
        observe_ddp_communication(wrapped, timeline)
    else:
        observe_comm_hook(wrapped, timeline)
    return BackwardObserver(model, timeline), contextlib.nullcontext()


def full_parameters(kind, wrapped, names) -> dict:
    """{name: full tensor} for the unwrapped model's parameter ``names`` (a collective for FSDP)."""
    if kind == "mini_fsdp":
        return wrapped.gather_full_params()
    if kind == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
        return {n: state[n].detach().clone() for n in names}
    return {n: p.detach().clone() for n, p in wrapped.module.named_parameters()}


def train_steps(cfg, kind: str, *, accumulation: int = 1, seed_per_rank: bool = False,
                sharded_optimizer: bool = False, record: bool = False, record_steps: int = 1,
                **options) -> dict:
    """On this rank: ``cfg.steps`` optimizer steps of ``cfg.model`` wrapped by ``kind``.

    accumulation: micro-batches per step (all but the last under ``no_sync()``).
    seed_per_rank: build rank r's model with seed ``cfg.seed + r`` (the wrapper must fix it).
    sharded_optimizer: True: ``ShardedOptimizer`` with the optimizer ``dpc.train`` would make;
    "torch": PyTorch's ``ZeroRedundancyOptimizer`` with the same.
    record: return the timeline (events of this rank) of the last ``record_steps`` steps.
    options: ``wrap_model``'s.
    Returns losses (this rank's, per step), full parameters, step_time_s / step_cpu_s
    (seconds per step), timeline, and the wrapper's buckets or units.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()  # the CPU under Gloo, this rank's GPU under NCCL
    model = models.build_model(cfg.model, seed=cfg.seed + (rank if seed_per_rank else 0),
                               **cfg.model_sizes).to(device)
    names = [n for n, _ in model.named_parameters()]
    timeline = Timeline(rank) if record else None
    if kind in ("mini_fsdp", "fsdp") and options.get("wrap") is None:
        options["wrap"] = models.wrap_classes(cfg.model)
    wrapped = wrap_model(kind, model, **options)
    observer, around_step = observe(kind, wrapped, model, timeline) if record else (None, None)
    if sharded_optimizer:
        template = make_optimizer(cfg, [torch.zeros(1, requires_grad=True)])  # dpc.train's choice
        accepted = inspect.signature(type(template)).parameters
        defaults = {k: v for k, v in template.defaults.items() if k in accepted}
        if sharded_optimizer == "torch":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), type(template), **defaults)
        else:
            optimizer = ShardedOptimizer(wrapped.parameters(), type(template), **defaults)
    else:
        optimizer = make_optimizer(cfg, wrapped.parameters())
    ddp_like = isinstance(kind, type) or kind in DDP_LIKE
    sampler, loader = make_loader(cfg, rank, world)
    stream = batches(loader, sampler, 0, cfg.steps * accumulation)
    losses, wall, cpu = [], [], []
    for step in range(cfg.steps):
        if timeline is not None:
            if step <= cfg.steps - record_steps:
                timeline.clear()  # keep the last record_steps steps only
            dist.barrier()  # recorded steps start together: no rank's lateness shows as comm
        t0, c0 = time.perf_counter(), time.process_time()
        total = 0.0
        with around_step or contextlib.nullcontext():
            for micro in range(accumulation):
                _, (x, y) = next(stream)
                x, y = x.to(device), y.to(device)
                sync = micro == accumulation - 1
                with contextlib.nullcontext() if sync else wrapped.no_sync():
                    start = time.perf_counter()
                    out = wrapped(x)
                    if timeline is not None and ddp_like:
                        timeline.add(COMPUTE, "forward", "model", start)
                    loss = models.loss_fn(cfg.model, out, y) / accumulation
                    loss.backward()
                    if observer is not None and sync:
                        observer.backward_returned()
                total += loss.item()
            start = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if timeline is not None:
                timeline.add(COMPUTE, "optimizer", "step", start)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(total)
    result = {"rank": rank, "world_size": world, "kind": getattr(kind, "__name__", kind), "losses": losses,
              "step_time_s": wall, "step_cpu_s": cpu, "params": full_parameters(kind, wrapped, names),
              "timeline": timeline.to_list() if timeline is not None else None}
    if kind == "bucketed":
        result["buckets"] = wrapped.buckets.describe()
    if kind == "mini_fsdp":
        result["units"] = wrapped.describe_units()
    return result


def reference_steps(cfg, world_size: int, accumulation: int = 1) -> dict:
    """One process, no process group: each step trains on the concatenation of what every
    rank's sampler gives it over the step's ``accumulation`` micro-batches (the runner's
    reference). Returns losses (mean loss of each global batch) and the final parameters."""
    from ..train import train_single_process

    return train_single_process(cfg, world_size, accumulation)


def parameters_around_backward(cfg, kind, steps: int = 2) -> list[dict]:
    """On this rank: all parameters as one flat vector just before and just after each
    step's backward, over ``steps`` optimizer steps of ``cfg.model`` (seed ``cfg.seed`` on
    every rank) wrapped by ``kind`` (a ``KINDS`` name or a wrapper class), each rank on its
    own ``cfg.batch_size`` samples. Shows what a wrapper's communication does to the
    weights: a correct DDP leaves them alone during backward.
    Returns one {"before_backward", "after_backward"} dict of CPU tensors per step."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    model = models.build_model(cfg.model, seed=cfg.seed, **cfg.model_sizes).to(device)
    wrapped = wrap_model(kind, model)
    optimizer = make_optimizer(cfg, wrapped.parameters())
    data = models.make_dataset(cfg.model, cfg.batch_size * world, seed=cfg.seed + 1, **cfg.model_sizes)
    x, y = (t[rank * cfg.batch_size:(rank + 1) * cfg.batch_size].to(device) for t in data.tensors)

    def flat():
        return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])

    out = []
    for _ in range(steps):
        before = flat()
        models.loss_fn(cfg.model, wrapped(x), y).backward()
        out.append({"before_backward": before, "after_backward": flat()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out
