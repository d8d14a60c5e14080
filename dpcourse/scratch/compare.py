"""MiniFSDP next to PyTorch FSDP1: the collectives of a step, memory at rest, bytes sent.

The functions with a ``cfg`` run on every rank together (``cluster.run``) and return plain
data; ``expected_at_rest`` is the memory ledger's answer, computed in the kernel. Units are
one per block of the model (``dpc.models.wrap_classes``), as in ``dpc.train``'s FSDP.
"""
from __future__ import annotations

import torch.distributed as dist

from .. import models
from ..collectives import C10dMeter, measure_bytes_sent
from ..backends import rank_device
from ..train.runner import make_optimizer
from .experiment import wrap_model


def _step(cfg, wrapped, optimizer, x, y, zero_grad: bool = True) -> None:
    models.loss_fn(cfg.model, wrapped(x), y).backward()
    optimizer.step()
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)


def _setup(cfg, kind: str, **options):
    """A seeded model wrapped by ``kind``, its optimizer, and this rank's batch."""
    rank, device = dist.get_rank(), rank_device()
    model = models.build_model(cfg.model, seed=cfg.seed, **cfg.model_sizes).to(device)
    wrapped = wrap_model(kind, model, wrap=models.wrap_classes(cfg.model), **options)
    optimizer = make_optimizer(cfg, wrapped.parameters())
    data = models.make_dataset(cfg.model, cfg.batch_size * dist.get_world_size(), seed=cfg.seed + 1,
                               **cfg.model_sizes)
    x, y = (t[rank * cfg.batch_size:(rank + 1) * cfg.batch_size].to(device) for t in data.tensors)
    return model, wrapped, optimizer, x, y


def step_collectives(cfg, kinds=("mini_fsdp", "fsdp"), **fsdp_options) -> dict:
    """{kind: [(collective, bytes S), ...]}: every c10d op of one step after a warm-up step.

    MiniFSDP shards its root as FSDP1 does (``shard_root=True``), so both have the same
    units; ``fsdp_options`` go to MiniFSDP (e.g. ``compute_dtype``).
    """
    out = {}
    for kind in kinds:
        options = {"shard_root": True, **fsdp_options} if kind == "mini_fsdp" else {}
        _, wrapped, optimizer, x, y = _setup(cfg, kind, **options)
        _step(cfg, wrapped, optimizer, x, y)
        with C10dMeter() as meter:
            _step(cfg, wrapped, optimizer, x, y)
        out[kind] = [(r.collective, r.nbytes) for r in meter.records]
    return out


def memory_at_rest(cfg, **options) -> dict:
    """MiniFSDP's bytes held at rest on this rank after two steps, gradients still held
    (``memory.measure.held_bytes``), and the shapes of its sharded units and of its
    replicated parameters."""
    from ..memory.measure import held_bytes

    model, wrapped, optimizer, x, y = _setup(cfg, "mini_fsdp", **options)
    _step(cfg, wrapped, optimizer, x, y)
    _step(cfg, wrapped, optimizer, x, y, zero_grad=False)
    units = [[tuple(s) for s in u.shapes] for u in wrapped.units if u.sharded]
    replicated = [tuple(s) for u in wrapped.units if not u.sharded for s in u.shapes]
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "units": units,
            "replicated": replicated, "held": held_bytes(wrapped, optimizer)}


def expected_at_rest(measured: dict, optimizer: str = "adamw", precision: str = "fp32") -> dict:
    """The ledger's bytes at rest (per rank) for what ``memory_at_rest`` measured: its sharded
    units as FULL_SHARD, its replicated parameters (one flat tensor) as DDP with no extra
    buckets. precision: "fp32", or "mixed" for a run with ``compute_dtype``."""
    from ..memory import ledger
    from ..memory.layout import numel

    world, rank = measured["world_size"], measured["rank"]
    total = dict.fromkeys(("parameters", "gradients", "optimizer_state"), 0)
    parts = []
    if measured["units"]:
        parts.append(ledger(numel(sum(measured["units"], [])), world, "FULL_SHARD",
                            precision, optimizer, rank=rank, units=measured["units"]))
    if measured["replicated"]:
        flat = numel(measured["replicated"])
        # at rest MiniFSDP keeps these as fp32 master and fp32 gradient (a compute-dtype copy
        # exists only while computing), which is the ledger's fp32 DDP row
        parts.append(ledger(flat, world, "ddp", "fp32", optimizer, rank=rank, units=[[(flat,)]],
                            gradient_as_bucket_view=True))
    for part in parts:
        for category in total:
            total[category] += part.bytes[category]
    return total


def bytes_sent_per_step(cfg, reduce_scatter: str = "backend") -> dict:
    """Bytes this rank sends in one MiniFSDP step (after a warm-up step): on the wire (Linux
    write counters) and logically (c10d ops), with the backend's or our ring's reduce-scatter."""
    _, wrapped, optimizer, x, y = _setup(cfg, "mini_fsdp", shard_root=True, reduce_scatter=reduce_scatter)
    _step(cfg, wrapped, optimizer, x, y)
    sent = measure_bytes_sent(_step, cfg, wrapped, optimizer, x, y)
    rs = sum(r.nbytes for r in sent.records if r.collective == "reduce_scatter")
    return {"wire": sent.wire, "logical": sent.logical,
            "records": [(r.collective, r.nbytes) for r in sent.records], "reduce_scatter_bytes": rs}
