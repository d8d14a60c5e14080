"""Training options, their command line, and the checks that run before any rank works."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

STRATEGIES = ("ddp", "fsdp", "fsdp2")
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
AUTO_WRAP = ("block", "size", "none")
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "sgd")


class ConfigError(ValueError):
    """A training option that cannot work; the message names the fix."""


@dataclass
class TrainConfig:
    """Everything one training run needs. Sizes are per rank unless named global."""

    strategy: str = "ddp"                  # ddp | fsdp (FSDP1) | fsdp2 (fully_shard)
    sharding_strategy: str = "FULL_SHARD"  # FSDP1 only
    hybrid_shard_size: int | None = None   # HYBRID_SHARD: ranks per shard group ("node")
    reshard_after_forward: bool = True     # FSDP2 only
    auto_wrap: str = "block"               # one FSDP unit per block | by size | none
    min_num_params: int = 2000             # auto_wrap="size": parameters per unit (elements)
    mixed_precision: str = "fp32"          # fp32 | bf16 | fp16
    gradient_as_bucket_view: bool = False  # DDP only
    model: str = "mlp"                     # mlp | transformer
    model_sizes: dict = field(default_factory=dict)
    num_samples: int = 512                 # dataset size (samples, global)
    batch_size: int = 8                    # micro-batch per rank (samples)
    steps: int = 10                        # optimizer steps (global count, resumes included)
    lr: float = 1e-2
    optimizer: str = "adamw"
    seed: int = 0
    checkpoint_dir: str | None = None      # save here at the end (torch.distributed.checkpoint)
    resume: bool = False                   # continue from checkpoint_dir
    backend: str = "auto"                  # CLI only: gloo | nccl | auto
    metrics_path: str | None = None        # CLI only: write per-rank metrics as JSON
    progress: bool = True                  # progress bar on rank 0
    measure_memory: bool = False           # record the last step's memory (slower step, not timed)

    def validate(self, world_size: int, device_type: str) -> None:
        """Raise ConfigError for anything that would fail (or silently mislead) later."""
        def one_of(name, value, allowed):
            if value not in allowed:
                raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}")

        one_of("strategy", self.strategy, STRATEGIES)
        one_of("sharding_strategy", self.sharding_strategy, SHARDING_STRATEGIES)
        one_of("auto_wrap", self.auto_wrap, AUTO_WRAP)
        one_of("mixed_precision", self.mixed_precision, PRECISIONS)
        one_of("optimizer", self.optimizer, OPTIMIZERS)
        if self.model not in ("mlp", "transformer"):
            raise ConfigError(f"unknown model {self.model!r}; choose one of mlp, transformer")
        for name in ("batch_size", "steps", "num_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)}")
        per_rank = self.num_samples // world_size
        if per_rank < self.batch_size:
            raise ConfigError(f"num_samples={self.num_samples} gives each of {world_size} ranks "
                              f"{per_rank} samples, fewer than batch_size={self.batch_size}")
        if self.strategy == "fsdp" and self.sharding_strategy == "HYBRID_SHARD":
            self.hybrid_mesh_shape(world_size)
        if self.mixed_precision == "bf16" and device_type == "cuda":
            import torch

            if not torch.cuda.is_bf16_supported():
                raise ConfigError("bf16 needs a GPU with bfloat16 support (Ampere or newer); "
                                  "use --mixed-precision fp16 or fp32")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume needs checkpoint_dir (the folder a run saved to)")

    def hybrid_mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(replicate, shard) sizes of HYBRID_SHARD's 2-D mesh."""
        shard = self.hybrid_shard_size
        if shard is None or shard < 1 or world_size % shard:
            raise ConfigError(
                f"HYBRID_SHARD needs hybrid_shard_size dividing world_size={world_size} (ranks per "
                f"shard group, usually GPUs per node), got {shard}")
        if shard == world_size:
            raise ConfigError(
                f"hybrid_shard_size={shard} equals world_size: HYBRID_SHARD would silently be "
                "FULL_SHARD (one shard group, nothing to replicate). Use a smaller shard group, "
                "e.g. 2 ranks per 'node', or choose FULL_SHARD")
        return world_size // shard, shard


def parse_args(argv=None) -> TrainConfig:
    """Command line -> TrainConfig (flags are the field names with dashes)."""
    parser = argparse.ArgumentParser(prog="python -m dpcourse.train",
                                     description="Train a demo model with DDP, FSDP or FSDP2.")
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        if f.name == "model_sizes":
            parser.add_argument(flag, default="", help="model sizes, e.g. d_hidden=128,depth=6")
        elif isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            kind = int if f.name in ("hybrid_shard_size",) else (type(value) if value is not None else str)
            parser.add_argument(flag, type=kind, default=value)
    args = vars(parser.parse_args(argv))
    sizes = args.pop("model_sizes")
    cfg = TrainConfig(**args)
    for item in filter(None, sizes.split(",")):
        key, _, val = item.partition("=")
        cfg.model_sizes[key.strip()] = int(val)
    return cfg
