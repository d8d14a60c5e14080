"""The alpha-beta model of a ring all-reduce, projected onto real interconnects.

A ring all-reduce of n bytes over N ranks is 2(N-1) messages of n/N bytes, each costing
alpha + (n/N)/beta (``cost.ring_seconds``): a straight line in n whose intercept
gives alpha (seconds per message) and whose slope gives beta (bytes/s); 4.1b fits it to
timings of ``time_all_reduce`` on its ranks.

The same model projects a step's communication onto named interconnects (``LINKS``, each
figure with its source) and asks when it hides behind backward compute (``hiding_rows``):

    rows = alpha_beta.hiding_rows([("NVLink 4, 8 GPUs", "ddp", 8, alpha_beta.LINKS["nvlink4"], {})])
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import vocab
from .cost import bus_factor, ring_seconds, step_bytes


def time_all_reduce(sizes_bytes, repeats: int = 20) -> dict:
    """On every rank together: median seconds of a float32 all-reduce per size (bytes)."""
    out = {}
    for nbytes in sizes_bytes:
        t = torch.ones(max(1, nbytes // 4))
        dist.barrier()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - start)
        out[nbytes] = statistics.median(samples)
    return out


# ---- Projection: the alpha-beta model on named interconnects, at the size of real models ----
#
# Each link is what one GPU sends on in a ring, one direction (bytes/s), and a latency per
# ring step (message). Bandwidths are the vendors' peak figures, so real collectives are
# slower (nccl-tests' busbw stays below them); latencies are the per-step hardware latencies
# of NCCL's own cost model for a ring with its Simple protocol (src/graph/tuning.cc, hwLat; the
# same NVLink 3.4, PCI 5.7 and NET 14.0 us from NCCL 2.18 (tag v2.18.1-1) through 2.30 (v2.30.7-1),
# where the table moved into ncclTunerConstantsDefaults). NET was not always 14.0: 28 us in
# v2.12.7-1 and v2.13.4-1, 9.6 us from v2.14.3-1 to v2.17.1-1; NVLink and PCI stayed. NCCL also
# adds a base latency per collective, baseLat, 8.4 us for ring/Simple in all of them: left out
# here, since it is paid once per collective, not per ring step.


@dataclass(frozen=True)
class Link:
    """An interconnect in the alpha-beta model: ``alpha`` seconds per ring step, ``beta``
    bytes/s one rank sends (one direction); ``source`` says where both figures come from."""

    name: str
    alpha: float
    beta: float
    source: str


LINKS = {
    "pcie4": Link("PCIe 4.0 x16", 5.7e-6, 31.5e9,
                  "PCI-SIG PCIe 4.0: 16 GT/s per lane, 128b/130b encoding -> 31.5 GB/s per direction "
                  "for 16 lanes; alpha: NCCL tuning.cc hwLat, PCI, ring/Simple, 5.7 us"),
    "nvlink4": Link("NVLink 4 (H100 SXM)", 3.4e-6, 450e9,
                    "NVIDIA H100 datasheet: NVLink 900 GB/s per GPU, both directions together -> "
                    "450 GB/s per direction; alpha: NCCL tuning.cc hwLat, NVLink, ring/Simple, 3.4 us"),
    "ib_ndr": Link("InfiniBand NDR 400 Gb/s", 14.0e-6, 50e9,
                   "NVIDIA ConnectX-7 / Quantum-2 NDR: 400 Gb/s = 50 GB/s per port and direction, one "
                   "port per GPU as in a DGX H100; alpha: NCCL tuning.cc hwLat, NET, ring/Simple, 14.0 us"),
}
# Dense BF16 tensor-core peak of one H100 SXM, FLOP/s (its datasheet: 1,979 TFLOPS with sparsity).
H100_BF16_FLOPS = 989e12
# Parameters and blocks (FSDP units), rounded sizes with the depths of Llama 3.2 1B, Llama 2 7B, 70B.
REFERENCE_MODELS = {"1B": (1e9, 16), "7B": (7e9, 32), "70B": (70e9, 80)}
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb=25: one all-reduce per bucket


def across_nodes(intra: Link, inter: Link, nodes: int, per_node: int) -> Link:
    """One ring over ``nodes`` x ``per_node`` ranks: of its N-1 hops per pass, nodes-1 cross
    ``inter`` and the rest stay on ``intra`` (NCCL's model weighs the latencies the same way);
    the ring moves at ``inter``'s bandwidth, the slowest hop."""
    n = nodes * per_node
    alpha = ((n - nodes) * intra.alpha + (nodes - 1) * inter.alpha) / (n - 1)
    return Link(f"{inter.name} across {nodes} nodes x {per_node} ({intra.name} inside)", alpha, inter.beta,
                f"alpha: {n - nodes} of {n - 1} hops at {intra.name}'s, {nodes - 1} at {inter.name}'s")


def step_comm_seconds(strategy: str, world_size: int, units, link: Link, *, shard_group_size: int | None = None,
                      inter_link: Link | None = None, param_bytes: int = 2, reduce_bytes: int | None = None,
                      bucket_bytes: int = DDP_BUCKET_BYTES) -> dict[str, dict[str, float]]:
    """Seconds one step spends communicating, per phase and collective (ring, alpha-beta):
    {"forward": {collective: s}, "backward": {...}}.

    The bytes are ``cost.step_bytes``'s (``units``: the FSDP units' parameter counts, the
    root last; param_bytes 2 for bf16); each collective pays, besides bytes / beta, alpha per
    ring step of every call: DDP all-reduces one bucket of ``bucket_bytes`` at a time, FSDP
    gathers and reduces one unit at a time. HYBRID_SHARD's gathers and reductions run inside
    a shard group on ``link``, its all_reduce across groups on ``inter_link``.
    """
    numels = [int(u) for u in units]
    n, psi = world_size, sum(numels) * param_bytes
    if strategy == "HYBRID_SHARD" and inter_link is None:
        raise ValueError("HYBRID_SHARD needs inter_link, the link between the shard groups (nodes)")
    phases = step_bytes(strategy, n, numels, shard_group_size=shard_group_size, param_bytes=param_bytes,
                        reduce_bytes=reduce_bytes, by_phase=True)
    group = vocab.shard_group(strategy, n, shard_group_size)
    blocks = sum(1 for u in numels[:-1] if u) + (1 if numels[-1] else 0)
    calls = {("forward", "all_gather"): blocks, ("backward", "all_gather"): blocks - (1 if numels[-1] else 0),
             ("backward", "reduce_scatter"): blocks,
             ("backward", "all_reduce"): math.ceil(psi / bucket_bytes) if strategy in ("ddp", "NO_SHARD") else blocks}
    out: dict[str, dict[str, float]] = {}
    for phase, volume in phases.items():
        out[phase] = {}
        for collective, sent in volume.items():
            across = collective == "all_reduce" and strategy not in ("ddp", "NO_SHARD")
            ranks, on = (n // group, inter_link) if across else (group if strategy != "ddp" else n, link)
            if strategy in ("ddp", "NO_SHARD"):
                ranks = n
            factor = bus_factor(collective, ranks)  # step_bytes sends factor x S per rank
            out[phase][collective] = ring_seconds(collective, sent / factor if factor else 0.0, ranks,
                                                  on.alpha, on.beta, calls[phase, collective])
    return out


def forward_seconds(num_params: float, tokens: int, flops: float = H100_BF16_FLOPS, mfu: float = 0.4) -> float:
    """Seconds of one rank's forward pass: 2 x params x tokens FLOPs at ``mfu`` of ``flops``."""
    return 2 * num_params * tokens / (flops * mfu)


def backward_seconds(num_params: float, tokens: int, flops: float = H100_BF16_FLOPS, mfu: float = 0.4) -> float:
    """Seconds of one rank's backward pass: 4 x params x tokens FLOPs (twice the forward's
    2 x params x tokens) at ``mfu`` of ``flops`` (FLOP/s peak)."""
    return 4 * num_params * tokens / (flops * mfu)


def hiding_rows(setups, models=REFERENCE_MODELS, tokens: int = 4096, grad_bytes: int = 2,
                flops: float = H100_BF16_FLOPS, mfu: float = 0.4) -> list[dict]:
    """Can each strategy's communication hide behind compute? One row per model and setup.

    setups: (label, strategy, world_size, link, options for ``step_comm_seconds``) tuples;
    models: {name: (parameters, FSDP units)}; tokens per rank and step; grad_bytes: 2 for
    bf16. Communication hides phase by phase: what a phase sends runs while that phase
    computes -- FSDP's forward all-gathers under forward (2 x params x tokens FLOPs: the next
    unit's gather is prefetched while the current one computes), backward's gathers,
    reduce-scatters and all-reduces under backward (4 x params x tokens). ``min tokens`` is
    the smallest tokens per rank and step at which every phase's communication fits in its
    compute: the largest of comm x tokens / compute over the phases.
    """
    rows = []
    for model, (params, blocks) in models.items():
        units = [params / blocks] * blocks + [0]  # equal blocks; the root's own share is negligible
        compute = {"forward": forward_seconds(params, tokens, flops, mfu),
                   "backward": backward_seconds(params, tokens, flops, mfu)}
        for label, strategy, world, link, options in setups:
            comm = step_comm_seconds(strategy, world, units, link, param_bytes=grad_bytes, **options)
            need = max(sum(comm[phase].values()) / compute[phase] for phase in compute)
            total = sum(sum(v.values()) for v in comm.values())
            rows.append({"model": model, "setup": label, "strategy": strategy, "comm ms": round(total * 1e3, 1),
                         "compute ms": round(sum(compute.values()) * 1e3, 1), "hides": need <= 1,
                         "min tokens": math.ceil(need * tokens)})
    return rows
