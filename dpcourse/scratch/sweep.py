"""The bucket-size sweep and the alpha-beta model behind it.

On the ranks: ``bucket_sweep`` trains with BucketedDDP and torch DDP at several
``bucket_cap_mb`` and reports, per cap, the buckets, seconds per step, and communication in
flight and exposed. In the kernel: ``predict_comm_seconds`` says what one step's buckets
should cost under the alpha-beta model fitted by ``dpcourse.collectives.alpha_beta``: small
buckets pay alpha many times, one huge bucket cannot start before backward ends.
"""
from __future__ import annotations

import statistics

from ..collectives.cost import ring_all_reduce_seconds
from .bucketed import assign_buckets
from .experiment import train_steps
from .timeline import Event, comm_seconds, exposed_seconds


def predict_comm_seconds(bucket_bytes, world_size: int, alpha: float, beta: float) -> float:
    """alpha-beta seconds of all-reducing buckets of these sizes (bytes) one after another."""
    return sum(ring_all_reduce_seconds(b, world_size, alpha, beta) for b in bucket_bytes)


def bucket_bytes(param_numels, bucket_cap_mb: float, itemsize: int = 4) -> list[int]:
    """Bytes of each bucket for parameters of these sizes (elements, registration order)."""
    numels = list(param_numels)[::-1]
    return [sum(numels[i] for i in b) * itemsize
            for b in assign_buckets(numels, [itemsize] * len(numels), bucket_cap_mb)]


def torch_ddp_buckets(cfg, iterations: int = 2, bucket_cap_mb: float | None = None) -> list[list[list[str]]]:
    """On every rank together: the buckets torch DDP all-reduces in each of ``iterations``
    backward passes of ``cfg.model``, as lists of parameter names (bucket 0 first), seen
    by a comm hook that does what the default hook does. ``bucket_cap_mb=None``: DDP's
    defaults (25 MiB, and ``dist._DEFAULT_FIRST_BUCKET_BYTES`` for the first bucket)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .. import models
    from ..backends import rank_device

    device = rank_device()  # the CPU under Gloo, this rank's GPU under NCCL
    model = models.build_model(cfg.model, seed=cfg.seed, **cfg.model_sizes).to(device)
    names = {p: n for n, p in model.named_parameters()}
    seen: dict[int, list[str]] = {}

    def hook(state, bucket):
        seen[bucket.index()] = [names[p] for p in bucket.parameters()]
        return allreduce_hook(state, bucket)  # what DDP does without a hook

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(None, hook)
    x, y = models.make_dataset(cfg.model, cfg.batch_size, seed=cfg.seed + 1, **cfg.model_sizes).tensors
    per_iteration = []
    for _ in range(iterations):
        seen.clear()
        models.loss_fn(cfg.model, ddp(x.to(device)), y.to(device)).backward()
        per_iteration.append([seen[i] for i in sorted(seen)])
    return per_iteration


def bucket_sweep(cfg, caps_mb, kinds=("bucketed", "ddp"), record_steps: int = 3) -> list[dict]:
    """On every rank together: per (kind, cap), train ``cfg.steps`` steps recording the last
    ``record_steps``; this rank's figures per step: seconds (median over the recorded
    steps), communication in flight and exposed (seconds), and the number of buckets."""
    rows = []
    for cap in caps_mb:
        for kind in kinds:
            r = train_steps(cfg, kind, record=True, record_steps=record_steps, bucket_cap_mb=cap)
            events = [Event(**e) for e in r["timeline"]]
            buckets = {e.name for e in events if e.kind == "all_reduce"}
            rows.append({"kind": kind, "bucket_cap_mb": cap, "num_buckets": len(buckets),
                         "step_s": statistics.median(r["step_time_s"][-record_steps:]),
                         "comm_s": comm_seconds(events) / record_steps,
                         "exposed_s": exposed_seconds(events) / record_steps})
    return rows
