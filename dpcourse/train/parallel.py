"""Wrap a model for data parallelism: DDP, FSDP1 (four sharding strategies) or FSDP2.

Order matters and is the same for every wrapper:
  1. build the model on this rank's device from the same seed on every rank -- DDP would
     broadcast rank 0's weights itself, FSDP1's ``sync_module_states`` needs an accelerator,
     and FSDP2 does not do it at all; with different weights FSDP silently trains a mixture
     of the ranks' shards;
  2. wrap (``apply_ddp`` / ``apply_fsdp`` / ``apply_fsdp2``);
  3. only then build the optimizer, over the wrapped model's parameters.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn

from .config import TrainConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision_dtypes(cfg: TrainConfig) -> tuple[torch.dtype, torch.dtype] | None:
    """(param_dtype, reduce_dtype) for FSDP1's ``MixedPrecision`` and FSDP2's
    ``MixedPrecisionPolicy`` alike, or None in fp32.

    By default gradients are reduced in the compute dtype (both APIs' default when
    reduce_dtype is left out): half the bytes of fp32 on the wire, and what the memory
    ledger's "mixed" row counts (2-byte unsharded gradients; the sharded gradient is then kept
    in fp32). ``cfg.reduce_dtype="fp32"`` sums more exactly at twice the bytes, plus a 4-byte
    copy of each unit's gradients before its reduce-scatter.
    """
    if cfg.mixed_precision == "fp32":
        return None
    return _DTYPES[cfg.mixed_precision], _DTYPES[cfg.reduce_dtype or cfg.mixed_precision]


def apply_ddp(model: nn.Module, device: torch.device, cfg: TrainConfig) -> nn.Module:
    """DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, gradient_as_bucket_view=cfg.gradient_as_bucket_view)


def _wrap_policy(cfg: TrainConfig, block_classes):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    if cfg.auto_wrap == "block":
        return ModuleWrapPolicy(block_classes)
    if cfg.auto_wrap == "size":
        return functools.partial(size_based_auto_wrap_policy, min_num_params=cfg.min_num_params)
    return None


def device_mesh(device: torch.device, cfg: TrainConfig, hybrid: bool):
    """The one place the runner builds a ``DeviceMesh``: for hybrid sharding (FSDP1's
    HYBRID_SHARD, FSDP2's HSDP) a 2-D mesh, replicate x shard, of ``cfg.hybrid_mesh_shape``;
    otherwise one dimension over the whole world."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if hybrid:
        return init_device_mesh(device.type, cfg.hybrid_mesh_shape(world), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,))


def apply_fsdp(model: nn.Module, device: torch.device, cfg: TrainConfig, block_classes) -> nn.Module:
    """FSDP1 with the configured sharding strategy, auto-wrap policy and mixed precision.

    HYBRID_SHARD gets an explicit 2-D mesh (replicate x shard): on one machine the default
    would make the whole world one shard group, i.e. FULL_SHARD under another name.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    kwargs = {}
    if cfg.sharding_strategy == "HYBRID_SHARD":
        kwargs["device_mesh"] = device_mesh(device, cfg, hybrid=True)
    dtypes = mixed_precision_dtypes(cfg)
    if dtypes:
        param_dtype, reduce_dtype = dtypes
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                   buffer_dtype=param_dtype)
    with warnings.catch_warnings():
        # PyTorch deprecates NO_SHARD in favour of DDP; the course compares them on purpose.
        warnings.filterwarnings("ignore", "The `NO_SHARD` sharding strategy is deprecated", FutureWarning)
        # use_orig_params=False: the optimizer steps the FlatParameters, which is what the
        # memory ledger counts and what MemTracker can follow (it fails on the views). A
        # FlatParameter has one requires_grad, so a model with frozen parameters
        # (tied_transformer's position table) keeps its original parameters instead.
        frozen_and_trained = len({p.requires_grad for p in model.parameters()}) > 1
        return FSDP(model, sharding_strategy=ShardingStrategy[cfg.sharding_strategy],
                    auto_wrap_policy=_wrap_policy(cfg, block_classes), device_id=device,
                    use_orig_params=frozen_and_trained, **kwargs)


def apply_fsdp2(model: nn.Module, device: torch.device, cfg: TrainConfig, block_classes) -> nn.Module:
    """FSDP2: ``fully_shard`` each block, then the root; parameters become DTensor shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # HSDP when a shard group is set: shard within each group, replicate across groups
    mesh = device_mesh(device, cfg, hybrid=cfg.shard_group_size is not None)
    kwargs = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    dtypes = mixed_precision_dtypes(cfg)
    if dtypes:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1])
    if cfg.auto_wrap != "none":
        # Children before parents, as fully_shard requires. By size, like FSDP1's
        # size_based_auto_wrap_policy: a module whose parameters not yet in a unit reach
        # min_num_params; containers without a forward (ModuleList) cannot be units.
        in_units: set[int] = set()
        for module in reversed(list(model.modules())):
            if module is model or type(module).forward is nn.Module.forward:
                continue
            own = sum(p.numel() for p in module.parameters() if id(p) not in in_units)
            if (isinstance(module, tuple(block_classes)) if cfg.auto_wrap == "block"
                    else own >= cfg.min_num_params):
                fully_shard(module, **kwargs)
                in_units.update(id(p) for p in module.parameters())  # now DTensor shards
    # None lets FSDP2 keep the root gathered after forward (backward needs it at once), as
    # FSDP1 does; an explicit True would free it and all-gather it again.
    fully_shard(model, **{**kwargs, "reshard_after_forward": None if cfg.reshard_after_forward else False})
    return model


def describe(model: nn.Module, cfg: TrainConfig) -> str:
    """One line saying what was actually applied (printed by rank 0)."""
    world = dist.get_world_size()
    if cfg.wrapper == "ddp":
        return f"DDP over {world} ranks (gradient_as_bucket_view={cfg.gradient_as_bucket_view})"
    if cfg.wrapper == "fully_shard":
        units = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))
        over = f"{world} ranks"
        if cfg.shard_group_size is not None:
            over = "a {} x {} mesh (replicate x shard)".format(*cfg.hybrid_mesh_shape(world))
        return (f"FSDP2 fully_shard over {over}, {units} units, "
                f"reshard_after_forward={cfg.reshard_after_forward}")
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = [m for m in model.modules() if isinstance(m, FSDP)]
    applied = units[0].sharding_strategy.name
    mesh = ""
    if applied == "HYBRID_SHARD":
        rep, shard = cfg.hybrid_mesh_shape(world)
        mesh = f" on a {rep} x {shard} mesh (replicate x shard)"
    return f"FSDP1 {applied}{mesh}, {len(units)} units, mixed precision {cfg.mixed_precision}"
