"""What collectives cost on paper: bytes each rank sends, bus bandwidth, the alpha-beta model.

Bandwidth as nccl-tests reports it (nccl-tests, doc/PERFORMANCE.md): for a collective on S
bytes that takes t seconds, algbw = S / t, and busbw = algbw * factor, where the factor is
what a bandwidth-optimal algorithm makes each rank send, as a share of S:
2(N-1)/N for all_reduce, (N-1)/N for all_gather, reduce_scatter and all_to_all, 1 for
broadcast and reduce. busbw is comparable across world sizes and with the link's speed.
(S is the size of the full tensor: the all_gather output, the reduce_scatter input.)

The alpha-beta model (Hockney 1994; Thakur, Rabenseifner & Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005): a message of n bytes takes
alpha + n / beta seconds -- alpha a fixed latency per message, beta the bandwidth in bytes/s.
"""
from __future__ import annotations

from .schedule import algorithm_steps, chunk_bounds

BUS_FACTOR = {  # per-rank bytes of a bandwidth-optimal algorithm, as a share of S
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_factor(collective: str, world_size: int) -> float:
    """busbw / algbw for ``collective`` on ``world_size`` ranks (nccl-tests' factor)."""
    if collective not in BUS_FACTOR:
        raise ValueError(f"no bus factor for {collective!r}; known: {', '.join(BUS_FACTOR)}")
    return BUS_FACTOR[collective](world_size) if world_size > 1 else 0.0


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: tensor bytes S over the time of the collective."""
    return nbytes / seconds


def busbw(collective: str, nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth in bytes/s: algbw times ``bus_factor(collective, world_size)``."""
    return algbw(nbytes, seconds) * bus_factor(collective, world_size)


def bytes_sent_per_rank(algorithm: str, world_size: int, numel: int, itemsize: int) -> list[int]:
    """Exact payload bytes each rank sends in ``algorithm`` (a ``schedule.ALGORITHMS`` name),
    by rank, for a tensor of ``numel`` elements of ``itemsize`` bytes.

    Ring: N-1 chunks per phase -- all but its own chunk r in reduce-scatter, all but chunk
    r+1 in all-gather: 2(N-1)/N*S when N divides numel.
    """
    n, bounds = world_size, chunk_bounds(numel, world_size)
    size = [(hi - lo) * itemsize for lo, hi in bounds]
    whole = numel * itemsize
    if algorithm == "ring_reduce_scatter":
        return [whole - size[r] if n > 1 else 0 for r in range(n)]
    if algorithm == "ring_all_gather":
        return [whole - size[(r + 1) % n] if n > 1 else 0 for r in range(n)]
    if algorithm == "ring_all_reduce":
        rs = bytes_sent_per_rank("ring_reduce_scatter", n, numel, itemsize)
        ag = bytes_sent_per_rank("ring_all_gather", n, numel, itemsize)
        return [a + b for a, b in zip(rs, ag)]
    if algorithm == "naive_all_reduce":
        return [(n - 1) * whole if r == 0 else whole for r in range(n)]
    if algorithm == "whole_ring_all_reduce":
        return [(n - 1) * whole] * n
    algorithm_steps(algorithm, n)  # raises the error that names the known algorithms
    raise AssertionError(algorithm)


def num_steps(algorithm: str, world_size: int) -> int:
    """Communication steps of ``algorithm``: 2(N-1) for the ring all-reduce, N-1 for each of
    its phases and for the whole-tensor ring, 2 for reduce+broadcast (0 on one rank)."""
    n = world_size
    return {"ring_all_reduce": 2 * (n - 1), "ring_reduce_scatter": n - 1,
            "ring_all_gather": n - 1, "whole_ring_all_reduce": n - 1,
            "naive_all_reduce": 2 if n > 1 else 0}[algorithm]


def ring_seconds(collective: str, nbytes: float, world_size: int, alpha: float, beta: float,
                 calls: int = 1) -> float:
    """alpha-beta time (seconds) of ``calls`` ring ``collective``s ("all_reduce", "all_gather",
    "reduce_scatter") that together move S = ``nbytes`` over ``world_size`` ranks: each call
    takes ``num_steps`` messages of alpha seconds, and each rank sends bus_factor x S bytes at
    beta bytes/s: calls x steps x alpha + bus_factor x S / beta (0 on one rank)."""
    if world_size < 2:
        return 0.0
    return (calls * num_steps("ring_" + collective, world_size) * alpha
            + bus_factor(collective, world_size) * nbytes / beta)


def ring_all_reduce_seconds(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """alpha-beta time of one ring all-reduce of ``nbytes``: 2(N-1) messages of nbytes/N,
    2(N-1)*alpha + 2(N-1)/N * nbytes / beta (alpha: seconds, beta: bytes/s); ``ring_seconds``."""
    return ring_seconds("all_reduce", nbytes, world_size, alpha, beta)


def ring_all_reduce_busbw(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Bus bandwidth (bytes/s) the alpha-beta model predicts for a ring all-reduce: it
    approaches beta for large messages; small ones are dominated by 2(N-1)*alpha."""
    return busbw("all_reduce", nbytes, ring_all_reduce_seconds(nbytes, world_size, alpha, beta),
                 world_size)


def _unit_numels(units) -> list[int]:
    """Elements per FSDP unit, the root last: from a model (one unit per block), from lists of
    parameter shapes, or as given."""
    import math

    if hasattr(units, "named_parameters"):
        from ..models import unit_numels

        return unit_numels(units)
    return [u if isinstance(u, int) else sum(math.prod(s) for s in u) for u in units]


def step_bytes(strategy: str, world_size: int, units, *, reshard_after_forward: bool = True,
               shard_group_size: int | None = None, param_bytes: int = 4,
               reduce_bytes: int | None = None, by_phase: bool = False) -> dict:
    """Bytes one rank sends per training step, by collective, as a ring sends them.

    strategy: the vocabulary's names -- "ddp", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD",
    "HYBRID_SHARD" (FSDP1) or "fully_shard" (FSDP2, with ``reshard_after_forward`` and, for
    HSDP, ``shard_group_size``). units: the model (one FSDP unit per block, the rest the
    root), or each unit's parameter count with the root last. param_bytes: bytes per
    parameter as gathered (2 under a bf16 ``param_dtype``); reduce_bytes: per gradient element
    as reduced (default: ``param_bytes``). by_phase: {"forward": {...}, "backward": {...}}
    instead of the step's totals. With Ψ the parameters' bytes and N ranks:

      ddp, NO_SHARD        all_reduce of the gradients (backward)        2(N-1)/N Ψ  ("≈ 2Ψ")
      FULL_SHARD           all_gather in forward; in backward again for every unit but the
      (fully_shard)        root (kept gathered between them), and a reduce_scatter of the
                           gradients                                     (3Ψ - root)(N-1)/N  ("≈ 3Ψ")
      SHARD_GRAD_OP        one all_gather (forward), one reduce_scatter   2(N-1)/N Ψ
      (reshard_after_forward=False)
      HYBRID_SHARD (R x F) FULL_SHARD inside each group of F ranks, then (backward) an
                           all_reduce of each rank's 1/F shard across the R groups
    """
    numels = _unit_numels(units)
    reduce_bytes = param_bytes if reduce_bytes is None else reduce_bytes
    total, root = sum(numels), numels[-1]  # the root unit: gathered once, kept for backward
    n = world_size
    if strategy in ("ddp", "NO_SHARD"):
        phases = {"forward": {}, "backward": {"all_reduce": reduce_bytes * total * bus_factor("all_reduce", n)}}
    elif strategy in ("SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "fully_shard"):
        from .. import vocab

        group = vocab.shard_group(strategy, n, shard_group_size)
        reshard = reshard_after_forward and strategy != "SHARD_GRAD_OP"
        phases = {"forward": {"all_gather": param_bytes * total * bus_factor("all_gather", group)},
                  "backward": {"reduce_scatter": reduce_bytes * total * bus_factor("reduce_scatter", group)}}
        if reshard:  # backward gathers every unit again, all but the root
            phases["backward"]["all_gather"] = param_bytes * (total - root) * bus_factor("all_gather", group)
        if n // group > 1:
            phases["backward"]["all_reduce"] = reduce_bytes * total / group * bus_factor("all_reduce", n // group)
    else:
        raise ValueError(f"no step_bytes for strategy {strategy!r}; choose one of ddp, NO_SHARD, "
                         "SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, fully_shard")
    if by_phase:
        return phases
    out: dict[str, float] = {}
    for volume in phases.values():
        for collective, nbytes in volume.items():
            out[collective] = out.get(collective, 0.0) + nbytes
    return out
