"""The course's one vocabulary: every name a learner can pass, in PyTorch's own words.

The training runner, the memory ledger, the from-scratch wrappers, the widgets, the
benchmarks and the command line all take their names from these tables, so one word means
one thing in every room (``tests/test_vocabulary.py`` checks that each room accepts them):

    wrapper             how the model is wrapped: ``ddp``, ``fsdp`` (FSDP1) or ``fully_shard`` (FSDP2)
    sharding_strategy   FSDP1's ``ShardingStrategy``: what each rank keeps only a shard of
    strategy            the memory ledger's names (``SHARDING``: what each one shards, and how)
    shard_group_size    HYBRID_SHARD's ranks per shard group (usually the GPUs of one node)
    mixed_precision     the dtype forward and backward compute in (``fp32``, ``bf16``, ``fp16``)
    precision           the ledger's byte layout: ``fp32``, ``mixed`` (ZeRO's 2+2+K), ``autocast``
    optimizer           ``sgd`` (no state), ``sgd_momentum``, ``adam``, ``adamw``
    model               ``mlp``, ``transformer``, ``tied_transformer`` (``dpcourse.models``)
"""
from __future__ import annotations

from dataclasses import dataclass

# How the model is wrapped, by the PyTorch API that does it.
WRAPPERS = {
    "ddp": "torch.nn.parallel.DistributedDataParallel",
    "fsdp": "torch.distributed.fsdp.FullyShardedDataParallel (FSDP1)",
    "fully_shard": "torch.distributed.fsdp.fully_shard (FSDP2)",
}

# The course's own teaching wrappers (dpcourse.scratch), named after what they add.
SCRATCH_WRAPPERS = {
    "naive": "NaiveDDP: one all-reduce per gradient after backward",
    "overlap": "OverlapDDP: each gradient's all-reduce starts as soon as it is ready",
    "bucketed": "BucketedDDP: gradients packed into buckets of bucket_cap_mb",
    "mini_fsdp": "MiniFSDP: parameters sharded, all-gathered per unit, gradients reduce-scattered",
}

MODEL_STATES = ("parameters", "gradients", "optimizer_state")


@dataclass(frozen=True)
class Sharding:
    """How one strategy holds a rank's model states: a row of ``SHARDING``, read by the memory ledger.

    shards: the model states divided by the shard group between steps (the optimizer state
        includes mixed precision's fp32 master weights, as the ZeRO paper counts them).
    storage: how the states are laid out -- "tensors" (one tensor per parameter; FSDP2 shards
        each on dim 0 like ``torch.chunk``), "flat_parameter" (FSDP1: one padded FlatParameter
        per unit) or "partition" (ZeRO: one flattened buffer, stepped by ZeRO's own fused
        optimizer, so no step counters and no optimizer temporaries).
    units: FSDP's units: the sharded parameters stay fp32 as the master copy, each unit is
        gathered for its compute and its gradient reduce-scattered, the root unit last.
    reshard_after_forward: fixed by FSDP1's ShardingStrategy (SHARD_GRAD_OP keeps a unit
        gathered from its forward to its backward); None where it is an option (FSDP2).
    group: the ranks one copy of the model is sharded over -- "none" (a full replica per
        rank), "world", "shard_group_size" (HYBRID_SHARD), or "world or shard_group_size"
        (FSDP2: the whole world, or the shard axis of a (replicate, shard) mesh).
    primary_only: DataParallel: only the primary device keeps model states.
    buckets: DDP's flat gradient buckets beside ``param.grad`` (unless gradient_as_bucket_view).
    autocast: the ledger models this strategy under ``torch.autocast``.
    """

    shards: tuple = ()
    storage: str = "tensors"
    units: bool = False
    reshard_after_forward: bool | None = True
    group: str = "world"
    primary_only: bool = False
    buckets: bool = False
    autocast: bool = False


# Every strategy the memory ledger accounts for: DataParallel (one process, many devices),
# DDP, the ZeRO stages, FSDP1's ShardingStrategy by its own names, and FSDP2's fully_shard.
SHARDING = {
    "dp": Sharding(group="none", primary_only=True, autocast=True),
    "ddp": Sharding(group="none", buckets=True, autocast=True),
    "zero1": Sharding(("optimizer_state",), "partition"),
    "zero2": Sharding(("gradients", "optimizer_state"), "partition"),
    "zero3": Sharding(MODEL_STATES, "partition"),
    "NO_SHARD": Sharding((), "flat_parameter", group="none"),
    "SHARD_GRAD_OP": Sharding(MODEL_STATES, "flat_parameter", units=True, reshard_after_forward=False),
    "FULL_SHARD": Sharding(MODEL_STATES, "flat_parameter", units=True),
    "HYBRID_SHARD": Sharding(MODEL_STATES, "flat_parameter", units=True, group="shard_group_size"),
    "fully_shard": Sharding(MODEL_STATES, "tensors", units=True, reshard_after_forward=None,
                            group="world or shard_group_size"),
}
SHARDING_STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")  # FSDP1's ShardingStrategy
ZERO_STAGES = ("zero1", "zero2", "zero3")
LEDGER_STRATEGIES = tuple(SHARDING)

# The training runner's options (``dpc.train.TrainConfig``) for each ledger strategy it trains:
# FSDP1 under ShardingStrategy's names, FSDP2 as fully_shard. HYBRID_SHARD also needs a
# shard_group_size that divides the world size.
TRAIN_OPTIONS = {
    "ddp": {"wrapper": "ddp"},
    **{name: {"wrapper": "fsdp", "sharding_strategy": name} for name in SHARDING_STRATEGIES},
    "fully_shard": {"wrapper": "fully_shard"},
}

AUTO_WRAP = ("block", "size", "none")  # one FSDP unit per model block | by min_num_params | one unit
MIXED_PRECISION = ("fp32", "bf16", "fp16")
PRECISIONS = ("fp32", "mixed", "autocast")
MODELS = ("mlp", "transformer", "tied_transformer")

# fp32 state tensors the optimizer keeps per parameter (each as large as the parameter).
OPTIMIZERS = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}


def shard_group(strategy: str, world_size: int, shard_group_size: int | None, error=ValueError) -> int:
    """The ranks one copy of the model is sharded over under ``strategy`` (a ``SHARDING`` name)
    -- the one check of HYBRID_SHARD's (and FSDP2's 2-D mesh's) ``shard_group_size``, with the
    arithmetic in its message.

    1 for the replicating strategies (dp, ddp, NO_SHARD); ``shard_group_size`` for
    HYBRID_SHARD and for ``fully_shard`` on a (replicate, shard) mesh; else ``world_size``.
    """
    check_name("strategy", strategy, SHARDING, error)
    group = SHARDING[strategy].group
    if group == "shard_group_size" or (group == "world or shard_group_size" and shard_group_size is not None):
        if shard_group_size is None:
            raise error("HYBRID_SHARD needs shard_group_size: the ranks that share one copy of the "
                        "model (usually the GPUs of one node), e.g. shard_group_size=8")
        if isinstance(shard_group_size, bool) or not isinstance(shard_group_size, int) or shard_group_size < 1 \
                or world_size % shard_group_size:
            raise error(f"shard_group_size={shard_group_size!r} must be a whole number that divides "
                        f"world_size={world_size}: replicas x shard group = world size")
        return shard_group_size
    if shard_group_size is not None:
        raise error(f"shard_group_size only applies to HYBRID_SHARD (and fully_shard on a 2-D mesh), "
                    f"not {strategy!r}; leave it out (other strategies shard over the whole world or not at all)")
    return 1 if group == "none" else world_size


def check_name(what: str, value, allowed, error=ValueError) -> None:
    """Raise ``error`` naming the valid choices when ``value`` is not one of ``allowed``."""
    if value not in allowed:
        raise error(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}")


def make_optimizer(name: str, params, lr: float):
    """The ``torch.optim`` optimizer a vocabulary name stands for (AdamW with torch's default
    weight decay 0.01; SGD with momentum 0.9 for ``sgd_momentum``)."""
    import torch

    check_name("optimizer", name, OPTIMIZERS)
    if name in ("sgd", "sgd_momentum"):
        return torch.optim.SGD(params, lr=lr, momentum=0.9 if name == "sgd_momentum" else 0.0)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=lr)
