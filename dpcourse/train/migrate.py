"""FSDP1 to FSDP2: the same sharding strategy in both APIs, trained side by side.

    rows = dpc.train.migrate.fsdp1_vs_fsdp2(cluster, ["FULL_SHARD", "SHARD_GRAD_OP"])

New code should use FSDP2 (``fully_shard``): PyTorch's FSDP documentation recommends it to
newcomers; parameters are DTensors sharded per parameter on dim 0 (easy to inspect, to save
without gathering, and to combine with tensor parallelism on a 2-D mesh), and frozen
parameters need no special case. FSDP1 (``FullyShardedDataParallel``) is what many code
bases still run, so the course keeps both and shows they do the same work.
"""
from __future__ import annotations

import dataclasses

from .config import TrainConfig
from .hooks import Run, StepHook


def fully_shard_equivalent(cfg: TrainConfig) -> TrainConfig:
    """The FSDP2 configuration that does what FSDP1's ``cfg.sharding_strategy`` does:

        FULL_SHARD     fully_shard(reshard_after_forward=True)   on a 1-D mesh   (ZeRO-3)
        SHARD_GRAD_OP  fully_shard(reshard_after_forward=False)  on a 1-D mesh   (ZeRO-2)
        HYBRID_SHARD   fully_shard(reshard_after_forward=True)   on a 2-D mesh (replicate, shard)
        NO_SHARD       no FSDP2 form: DDP (strategy="ddp")
    """
    if cfg.strategy != "fsdp":
        raise ValueError(f"fully_shard_equivalent maps FSDP1 (strategy='fsdp'), not {cfg.strategy!r}")
    changes = {"strategy": "fully_shard", "sharding_strategy": TrainConfig.sharding_strategy,
               "reshard_after_forward": cfg.sharding_strategy != "SHARD_GRAD_OP"}
    if cfg.sharding_strategy == "NO_SHARD":
        changes = {"strategy": "ddp", "sharding_strategy": TrainConfig.sharding_strategy}
    if cfg.sharding_strategy != "HYBRID_SHARD":
        changes["shard_group_size"] = None
    return dataclasses.replace(cfg, **changes)


class ParameterBytes(StepHook):
    """Bytes of parameter storage this rank holds at rest (``parameter_bytes``): FSDP1's
    FlatParameter shards, FSDP2's DTensor local shards, DDP's full replica."""

    def finish(self, run: Run, metrics: dict) -> None:
        local = [getattr(p, "_local_tensor", p) for p in run.model.parameters()]
        metrics["parameter_bytes"] = sum(t.numel() * t.element_size() for t in local)


@dataclasses.dataclass(frozen=True)
class PairRun:
    """One sharding strategy trained by FSDP1 and by its FSDP2 equivalent (rank 0's figures)."""

    sharding_strategy: str
    fsdp2_form: str                       # how the FSDP2 side is written
    applied: tuple[str, str]              # what each run printed it applied (FSDP1, FSDP2)
    bytes_sent: tuple[dict, dict]         # bytes rank 0 sent in one step, by collective
    parameters_held: tuple[int, int]      # parameter bytes rank 0 holds at rest
    largest_loss_difference: float        # over both runs, against single-process training


def fsdp2_form(cfg: TrainConfig) -> str:
    """How a configuration reads in FSDP2's words, e.g. 'fully_shard(reshard_after_forward=False)'."""
    if cfg.strategy == "ddp":
        return "DDP (FSDP2 has no NO_SHARD)"
    mesh = ", 2-D mesh" if cfg.shard_group_size else ""
    return f"fully_shard(reshard_after_forward={cfg.reshard_after_forward}{mesh})"


def fsdp1_vs_fsdp2(cluster, sharding_strategies, **options) -> list[PairRun]:
    """Train each FSDP1 ``sharding_strategies`` entry and its ``fully_shard_equivalent`` on
    ``cluster``'s ranks, measuring one step's bytes and the parameters held at rest."""
    from .measure import CommMeter
    from .runner import train, train_single_process

    rows = []
    for strategy in sharding_strategies:
        group = cluster.world_size // 2 if strategy == "HYBRID_SHARD" else None
        fsdp1 = TrainConfig(**{"steps": 3, "batch_size": 4, "num_samples": 64, "progress": False, **options,
                               "strategy": "fsdp", "sharding_strategy": strategy, "shard_group_size": group})
        reference = train_single_process(fsdp1, cluster.world_size)["losses"]
        runs = [cluster.run(train, cfg, [CommMeter(), ParameterBytes()], timeout=180)[0]
                for cfg in (fsdp1, fully_shard_equivalent(fsdp1))]
        difference = max(abs(a - b) for run in runs for a, b in zip(run["losses"], reference))
        rows.append(PairRun(strategy, fsdp2_form(fully_shard_equivalent(fsdp1)), tuple(r["applied"] for r in runs),
                            tuple({c: int(n) for c, n in r["comm"]["measured"].items()} for r in runs),
                            tuple(r["parameter_bytes"] for r in runs), difference))
    return rows


def pairs_table(rows: list[PairRun]) -> str:
    """One line per strategy: both APIs' bytes per step and parameter bytes held (rank 0)."""
    lines = [f"{'FSDP1 sharding_strategy':24} {'FSDP2':48} {'bytes sent/step':>21} {'params held (B)':>17}"]
    for r in rows:
        sent = " = ".join(f"{sum(b.values()):,}" for b in r.bytes_sent)
        held = " = ".join(f"{b:,}" for b in r.parameters_held)
        lines.append(f"{r.sharding_strategy:24} {r.fsdp2_form:48} {sent:>21} {held:>17}")
    return "\n".join(lines)
