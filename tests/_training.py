"""A training loop for the tests: any wrapper, from scratch or PyTorch's, on each rank.

The course's package has one training loop (``dpcourse.train``); the tests need another
that takes any wrapper -- the from-scratch ones, a subclass a test writes, torch DDP and
FSDP1 -- and returns the full parameters to compare with one process
(``reference_steps``, the runner's single-process reference on the same global batches).
Measurement attaches from outside, as in the notebooks: ``cluster.run(train_steps, ...,
observe=[dpc.observe.Timeline()])``.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist

from dpcourse import models
from dpcourse.backends import rank_device
from dpcourse.scratch import BucketedDDP, MiniFSDP, NaiveDDP
from dpcourse.scratch.ddp import OverlapDDP, broadcast_module
from dpcourse.scratch.zero import ShardedOptimizer
from dpcourse.train import TrainConfig
from dpcourse.train.runner import batches, make_loader, make_optimizer, train_single_process

SCRATCH = {"naive": NaiveDDP, "overlap": OverlapDDP, "bucketed": BucketedDDP, "mini_fsdp": MiniFSDP}


class RingReduceScatterFSDP(MiniFSDP):
    """MiniFSDP whose gradients are reduce-scattered by ``dpcourse.collectives``' ring
    (blocking; it sends (N-1)/N of the gradient where Gloo's sends 2(N-1)/N)."""

    def comm_hook(self, collective, output, input, name):
        if collective != "reduce_scatter":
            return super().comm_hook(collective, output, input, name)
        from dpcourse.collectives.ring import ring_reduce_scatter

        output.copy_(ring_reduce_scatter(input, op="sum", group=self.group))
        done = torch.futures.Future()
        done.set_result(output)
        return done


def wrap_model(kind, model, *, bucket_cap_mb=None, first_bucket_cap_mb=None, wrap=None,
               compute_dtype=None, shard_root=False, reduce_scatter="backend"):
    """``model`` wrapped by ``kind``: a name of ``SCRATCH``, "ddp" (torch DDP), "fsdp"
    (FSDP1 FULL_SHARD, one unit per block), or a wrapper class taking ``(model)``."""
    if isinstance(kind, type):
        return kind(model)
    if kind == "bucketed":
        return BucketedDDP(model, bucket_cap_mb=25 if bucket_cap_mb is None else bucket_cap_mb,
                           first_bucket_cap_mb=first_bucket_cap_mb)
    if kind in ("naive", "overlap"):
        return SCRATCH[kind](model)
    if kind == "mini_fsdp":
        cls = RingReduceScatterFSDP if reduce_scatter == "ring" else MiniFSDP
        return cls(model, wrap=wrap, compute_dtype=compute_dtype, shard_root=shard_root)
    device = next(model.parameters()).device
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                   **({} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}))
    if kind == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        broadcast_module(model)  # FSDP1 cannot sync weights on CPU itself
        return FSDP(model, device_id=device, auto_wrap_policy=ModuleWrapPolicy(wrap))
    raise ValueError(f"unknown wrapper {kind!r}")


def full_parameters(kind, wrapped, names) -> dict:
    """{name: full tensor} for the plain model's parameter ``names`` (a collective for FSDP)."""
    if kind == "mini_fsdp":
        return wrapped.gather_full_params()
    if kind == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
        return {n: state[n].detach().clone() for n in names}
    return {n: p.detach().clone() for n, p in wrapped.module.named_parameters()}


def train_steps(cfg: TrainConfig, kind, *, accumulation: int = 1, seed_per_rank: bool = False,
                sharded_optimizer=False, **options) -> dict:
    """On this rank: ``cfg.steps`` optimizer steps of ``cfg.model`` wrapped by ``kind``, on the
    batches the runner's ``DistributedSampler`` gives this rank (all micro-batches but the last
    of a step under ``no_sync()``). Returns losses, the full parameters, and the wrapper's
    buckets or units."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    model = models.build_model(cfg.model, seed=cfg.seed + (rank if seed_per_rank else 0),
                               **cfg.model_sizes).to(device)
    names = [n for n, _ in model.named_parameters()]
    if kind in ("mini_fsdp", "fsdp") and options.get("wrap") is None:
        options["wrap"] = models.wrap_classes(cfg.model)
    wrapped = wrap_model(kind, model, **options)
    if sharded_optimizer:
        template = make_optimizer(cfg, [torch.zeros(1, requires_grad=True)])
        accepted = inspect.signature(type(template)).parameters
        defaults = {k: v for k, v in template.defaults.items() if k in accepted}
        if sharded_optimizer == "torch":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), type(template), **defaults)
        else:
            optimizer = ShardedOptimizer(wrapped.parameters(), type(template), **defaults)
    else:
        optimizer = make_optimizer(cfg, wrapped.parameters())
    sampler, loader = make_loader(cfg, rank, world)
    stream = batches(loader, sampler, 0, cfg.steps * accumulation)
    losses = []
    for _ in range(cfg.steps):
        total = 0.0
        for micro in range(accumulation):
            _, (x, y) = next(stream)
            sync = micro == accumulation - 1
            with contextlib.nullcontext() if sync else wrapped.no_sync():
                loss = models.loss_fn(cfg.model, wrapped(x.to(device)), y.to(device)) / accumulation
                loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    result = {"rank": rank, "losses": losses, "params": full_parameters(kind, wrapped, names)}
    if kind == "bucketed":
        result["buckets"] = wrapped.buckets.describe()
    if kind == "mini_fsdp":
        result["units"] = wrapped.describe_units()
    return result


def reference_steps(cfg: TrainConfig, world_size: int, accumulation: int = 1) -> dict:
    """One process on the same global batches (the runner's reference): losses, params."""
    return train_single_process(cfg, world_size, accumulation)


def parameters_around_backward(cfg: TrainConfig, kind, steps: int = 2) -> list[dict]:
    """On this rank: all parameters as one flat vector just before and just after each
    step's backward (every rank seeded alike, each on its own batch)."""
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
