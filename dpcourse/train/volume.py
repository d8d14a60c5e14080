"""How many bytes each rank sends per training step, by collective: theory for each strategy.

Counted the way nccl-tests counts a bandwidth-optimal (ring) implementation: for a payload
of S bytes over N ranks, all_reduce sends 2(N-1)/N * S per rank, all_gather and
reduce_scatter (N-1)/N * S each. Ψ is the model's parameter bytes.

  DDP, NO_SHARD          all_reduce of the gradients              2(N-1)/N Ψ   ("≈ 2Ψ")
  FULL_SHARD, FSDP2      all_gather in forward and again in backward, reduce_scatter of the
                         gradients                                3(N-1)/N Ψ   ("≈ 3Ψ")
  SHARD_GRAD_OP, FSDP2 without resharding after forward
                         one all_gather, one reduce_scatter       2(N-1)/N Ψ
  HYBRID_SHARD (R x F)   FULL_SHARD inside each group of F ranks, then an all_reduce of each
                         rank's 1/F shard across the R groups

One refinement makes the theory exact: the root unit (parameters outside any wrapped block)
is not freed after forward, since backward needs it at once, so it is gathered only once.
Gloo sends more than this for reduce_scatter (as much as an all_reduce); the runner reports
the wire bytes next to these figures.
"""
from __future__ import annotations

from ..collectives.cost import bus_factor


def _ring(collective: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in a bandwidth-optimal ``collective`` of ``nbytes`` over n ranks."""
    return nbytes * bus_factor(collective, n)


def step_bytes(strategy: str, world_size: int, unit_bytes: list[int], root_bytes: int = 0,
               sharding_strategy: str = "FULL_SHARD", reshard_after_forward: bool = True,
               shard_group_size: int | None = None) -> dict[str, float]:
    """Bytes one rank sends per step, by collective (ring algorithms).

    unit_bytes: parameter bytes of each wrapped unit (FSDP) — for DDP, pass all parameter
    bytes as one entry; root_bytes: bytes of the root unit's own parameters (FSDP only).
    """
    n = world_size
    total = sum(unit_bytes) + root_bytes
    if strategy == "ddp" or (strategy == "fsdp" and sharding_strategy == "NO_SHARD"):
        return {"all_reduce": _ring("all_reduce", total, n)}
    group, replicas = n, 1
    if (strategy == "fsdp" and sharding_strategy == "HYBRID_SHARD"
            or strategy == "fully_shard" and shard_group_size is not None):
        group = shard_group_size
        replicas = n // group
    reshard = reshard_after_forward if strategy == "fully_shard" else sharding_strategy != "SHARD_GRAD_OP"
    gathered = total + (sum(unit_bytes) if reshard else 0)  # backward re-gathers freed units
    volume = {"all_gather": _ring("all_gather", gathered, group),
              "reduce_scatter": _ring("reduce_scatter", total, group)}
    if replicas > 1:
        volume["all_reduce"] = _ring("all_reduce", total / group, replicas)
    return volume


def gloo_wire_bytes(volume: dict[str, float]) -> float:
    """What Gloo's CPU algorithms send per rank for a ``step_bytes`` volume (bytes).

    Gloo's reduce_scatter is an all_reduce that keeps one chunk, so it sends 2(N-1)/N * S
    where a ring sends (N-1)/N * S -- twice the bytes, whatever N is (measured with
    /proc/self/io write counters); its all_reduce and all_gather send what a ring sends.
    """
    return sum(nbytes * (2 if collective == "reduce_scatter" else 1) for collective, nbytes in volume.items())
