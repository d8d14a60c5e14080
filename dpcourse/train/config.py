"""Training options, their command line, and the checks that run before any rank works."""
from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass, field

from .. import vocab


class ConfigError(ValueError):
    """A training option that cannot work; the message names the fix."""


@dataclass
class TrainConfig:
    """Everything one training run needs. Sizes are per rank unless named global."""

    wrapper: str = "ddp"                   # ddp | fsdp (FSDP1) | fully_shard (FSDP2): vocab.WRAPPERS
    sharding_strategy: str = "FULL_SHARD"  # FSDP1 only
    shard_group_size: int | None = None    # HYBRID_SHARD / fully_shard on a 2-D mesh: ranks per group
    reshard_after_forward: bool = True     # fully_shard only
    auto_wrap: str = "block"               # one FSDP unit per block | by size | none
    min_num_params: int = 2000             # auto_wrap="size": parameters per unit (elements)
    mixed_precision: str = "fp32"          # fp32 | bf16 | fp16: the compute (parameter) dtype
    reduce_dtype: str | None = None        # FSDP: gradients reduced in (default: mixed_precision)
    gradient_as_bucket_view: bool = False  # DDP only
    model: str = "mlp"                     # mlp | transformer | tied_transformer
    model_sizes: dict = field(default_factory=dict)
    num_samples: int = 512                 # dataset size (samples, global)
    batch_size: int = 8                    # micro-batch per rank (samples)
    steps: int = 10                        # optimizer steps (global count, resumes included)
    lr: float = 1e-2
    optimizer: str = "adamw"
    seed: int = 0
    checkpoint_dir: str | None = None      # save step-NNNNNN/ checkpoints here (DCP), always at the end
    checkpoint_every: int = 0              # also save every N steps (0: only at the end)
    keep_checkpoints: int = 2              # complete checkpoints kept (the newest)
    resume: str | bool | None = None       # None | "auto" | "latest" (True) | a checkpoint path
    backend: str = "auto"                  # CLI only: gloo | nccl | auto
    metrics_path: str | None = None        # CLI only: write per-rank metrics as JSON
    progress: bool = True                  # progress bar on rank 0
    measure: str = ""                      # CLI only: "time", "bytes" or "time,bytes" (metrics)
    pg_timeout: float = 300.0              # CLI only: seconds a rank waits to join, or in a collective

    def validate(self, world_size: int, device_type: str) -> None:
        """Raise ConfigError for anything that would fail (or silently mislead) later."""
        for name, allowed in CHOICES.items():
            vocab.check_name(name, getattr(self, name), allowed, ConfigError)
        for name in ("batch_size", "steps", "num_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)}")
        per_rank = self.num_samples // world_size
        if per_rank < self.batch_size:
            raise ConfigError(f"num_samples={self.num_samples} gives each of {world_size} ranks "
                              f"{per_rank} samples, fewer than batch_size={self.batch_size}")
        if self.shard_group_size is not None or self.ledger_strategy() == "HYBRID_SHARD":
            self.hybrid_mesh_shape(world_size)
        if self.reduce_dtype is not None:
            vocab.check_name("reduce_dtype", self.reduce_dtype, vocab.MIXED_PRECISION, ConfigError)
            if self.wrapper == "ddp" or self.mixed_precision == "fp32":
                raise ConfigError("reduce_dtype is FSDP's mixed-precision option (MixedPrecision, "
                                  "MixedPrecisionPolicy): use it with wrapper='fsdp' or 'fully_shard' "
                                  "and mixed_precision='bf16' or 'fp16'")
        if self.mixed_precision == "bf16" and device_type == "cuda":
            import torch

            # The default, including_emulation=True, also says True on V100 and T4, which
            # only emulate bf16: ask for the hardware's own bf16 units.
            if not torch.cuda.is_bf16_supported(including_emulation=False):
                raise ConfigError("bf16 needs a GPU with bfloat16 support (Ampere or newer); "
                                  "use --mixed-precision fp16 or fp32")
        self.validate_checkpointing()

    def validate_checkpointing(self) -> None:
        """Checkpoint options: every N >= 0 steps, keep >= 1, resume needs a place to look."""
        if not self.pg_timeout > 0:
            raise ConfigError(f"pg_timeout must be > 0 seconds, not {self.pg_timeout}")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ConfigError(f"checkpoint_every must be >= 0 (0: only at the end) and keep_checkpoints "
                              f">= 1, not {self.checkpoint_every} and {self.keep_checkpoints}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError("checkpoint_every needs checkpoint_dir (the folder to save into)")
        if self.resume in (True, "auto", "latest") and not self.checkpoint_dir:
            raise ConfigError(f"resume={self.resume!r} needs checkpoint_dir (the folder a run saved to), "
                              "or pass resume=<path of a checkpoint>")

    def ledger_strategy(self) -> str:
        """This run's name in ``vocab.SHARDING``: FSDP1 by its sharding_strategy, else the wrapper's."""
        return self.sharding_strategy if self.wrapper == "fsdp" else self.wrapper

    def __getattr__(self, name):
        # called only for a missing attribute: an old field's name says where it went
        if name in RENAMED:
            raise AttributeError(_renamed_message(name))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def hybrid_mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(replicate, shard) sizes of HYBRID_SHARD's 2-D mesh; ``vocab.shard_group`` checks
        shard_group_size (it applies to HYBRID_SHARD and to fully_shard on a 2-D mesh only)."""
        shard = vocab.shard_group(self.ledger_strategy(), world_size, self.shard_group_size, ConfigError)
        if shard == world_size:
            raise ConfigError(
                f"shard_group_size={shard} equals world_size: HYBRID_SHARD would silently be "
                "FULL_SHARD (one shard group, nothing to replicate). Use a smaller shard group, "
                "e.g. 2 ranks per 'node', or choose FULL_SHARD")
        return world_size // shard, shard


# Fields that changed name: old -> new. "strategy" was the wrapper; in the rest of the course
# (vocab.SHARDING, the memory ledger, step_bytes) a strategy is what gets sharded.
RENAMED = {"strategy": "wrapper"}


def _renamed_message(old: str) -> str:
    return (f"TrainConfig.{old} is now TrainConfig.{RENAMED[old]}: how the model is wrapped "
            f"({', '.join(vocab.WRAPPERS)}); a strategy is what gets sharded (sharding_strategy, "
            "and the memory ledger's names)")


def _refuse_renamed(init):
    """``TrainConfig.__init__``, with a clear TypeError for a field's old name."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        renamed = sorted(RENAMED.keys() & kwargs.keys())
        if renamed:
            raise TypeError(f"TrainConfig({renamed[0]}=...): {_renamed_message(renamed[0])}")
        init(self, *args, **kwargs)
    return __init__


TrainConfig.__init__ = _refuse_renamed(TrainConfig.__init__)


# One line per option for --help: what it means and its units; "%(default)s" shows the default.
HELP = {
    "wrapper": "data-parallel wrapper: ddp (DistributedDataParallel), fsdp (FSDP1 "
               "FullyShardedDataParallel), fully_shard (FSDP2); --strategy is its older name; "
               "default %(default)s",
    "sharding_strategy": "FSDP1 only: what is sharded -- FULL_SHARD (params, grads, optimizer "
                         "state), SHARD_GRAD_OP (grads, optimizer state), HYBRID_SHARD (FULL_SHARD "
                         "within a node, replicated across), NO_SHARD (like DDP); default %(default)s",
    "shard_group_size": "HYBRID_SHARD, or fully_shard on a (replicate, shard) mesh: ranks per shard "
                        "group, usually GPUs per node; must divide "
                         "the world size; default %(default)s",
    "reduce_dtype": "FSDP mixed precision: the dtype gradients are reduced in (fp32 sums more "
                    "exactly at twice the bytes); default %(default)s (the --mixed-precision dtype)",
    "reshard_after_forward": "fully_shard only: free gathered parameters after forward (gather again in "
                             "backward); default %(default)s",
    "auto_wrap": "FSDP units: block (one per model block), size (by --min-num-params), none (one "
                 "unit for the whole model); default %(default)s",
    "min_num_params": "auto-wrap=size: parameters (elements) per FSDP unit; default %(default)s",
    "mixed_precision": "compute dtype: fp32, bf16 or fp16 (bf16 is slow on CPUs without bf16 "
                       "units); default %(default)s",
    "gradient_as_bucket_view": "DDP only: gradients are views into the all-reduce buckets (saves "
                               "one gradient copy); default %(default)s",
    "model": "demo model: mlp (regression), transformer (tiny language model) or tied_transformer "
             "(the same with tied embeddings and a frozen position table); default %(default)s",
    "model_sizes": "model sizes as key=value pairs, e.g. d_hidden=128,depth=6 (mlp) or "
                   "d_model=64,n_layers=4 (transformer); default: the model's own (%(default)r)",
    "num_samples": "synthetic dataset size (samples, all ranks together); default %(default)s",
    "batch_size": "micro-batch per rank (samples); the global batch is this x world size; "
                  "default %(default)s",
    "steps": "optimizer steps in total, steps done before a resume included; default %(default)s",
    "lr": "learning rate; default %(default)s",
    "optimizer": "sgd (no momentum), sgd_momentum (0.9), adam or adamw (weight decay 0.01); "
                 "default %(default)s",
    "seed": "seed of the weights, the data and the sampler's shuffle; default %(default)s",
    "checkpoint_dir": "folder for DCP checkpoints (one step-NNNNNN/ folder each, published "
                      "atomically once complete); a checkpoint is always saved at the end; "
                      "default %(default)s (no checkpoints)",
    "checkpoint_every": "also save a checkpoint every N optimizer steps (0: only at the end); "
                        "default %(default)s",
    "keep_checkpoints": "complete checkpoints to keep, the newest; default %(default)s",
    "resume": "auto (newest complete checkpoint in --checkpoint-dir, or start fresh if none: what "
              "torchrun --max-restarts needs), latest (the newest, which must exist; also a bare "
              "--resume), or the path of a checkpoint; default %(default)s (start fresh)",
    "backend": "process-group backend: gloo (CPU), nccl (CUDA GPUs only), auto (with one GPU per "
               "local rank cpu:gloo,cuda:nccl -- NCCL for CUDA tensors, Gloo for CPU ones -- else "
               "gloo); default %(default)s",
    "metrics_path": "rank 0 writes every rank's metrics (losses, and what --measure adds) to this "
                    "JSON file; default %(default)s (none)",
    "progress": "print a progress line on rank 0; default %(default)s",
    "measure": "what to measure into the metrics, comma-separated: time (seconds per step), "
               "bytes (bytes sent in the last step, by collective, next to the theory); default "
               "%(default)r (nothing: a plain training loop)",
    "pg_timeout": "seconds a rank waits to join the process group, or for its peers in a collective, "
                  "before it fails with a message (torchrun --max-restarts can then restart it; "
                  "PyTorch's default is 30 minutes); default %(default)s",
}
CHOICES = {"wrapper": tuple(vocab.WRAPPERS), "sharding_strategy": tuple(vocab.SHARDING_STRATEGIES),
           "auto_wrap": vocab.AUTO_WRAP, "mixed_precision": vocab.MIXED_PRECISION,
           "optimizer": tuple(vocab.OPTIMIZERS), "model": vocab.MODELS}


def make_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m dpcourse.train``: one flag per TrainConfig field."""
    parser = argparse.ArgumentParser(
        prog="python -m dpcourse.train", description="Train a demo model with DDP, FSDP1 or FSDP2 (fully_shard).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Under torchrun --max-restarts, add --checkpoint-dir DIR --checkpoint-every N\n"
               "--resume auto: restarted workers continue from the newest complete checkpoint.")
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        flag, value = "--" + f.name.replace("_", "-"), getattr(defaults, f.name)
        kwargs = {"help": HELP[f.name], "default": value}  # KeyError: a new field needs its help
        if f.name == "model_sizes":
            kwargs.update(default="", metavar="KEY=N,...")
        elif f.name == "measure":
            kwargs["metavar"] = "time,bytes"
        elif f.name == "resume":
            kwargs.update(nargs="?", const="latest", metavar="auto|latest|PATH")
        elif isinstance(value, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name in CHOICES or f.name in ("backend", "reduce_dtype"):
            kwargs["choices"] = CHOICES.get(f.name, {"backend": ("gloo", "nccl", "auto"),
                                                     "reduce_dtype": vocab.MIXED_PRECISION}.get(f.name))
        else:
            kwargs["type"] = int if f.name == "shard_group_size" else (type(value) if value is not None else str)
            kwargs["metavar"] = {int: "N", float: "X"}.get(kwargs["type"], "DIR" if "dir" in f.name else "FILE")
        # --strategy: the wrapper's older name on the command line, kept so old commands run
        old = [f"--{o}" for o, new in RENAMED.items() if new == f.name]
        parser.add_argument(flag, *old, dest=f.name, **kwargs)
    return parser


def parse_args(argv=None) -> TrainConfig:
    """Command line -> TrainConfig (flags are the field names with dashes)."""
    args = vars(make_parser().parse_args(argv))
    sizes = args.pop("model_sizes")
    cfg = TrainConfig(**args)
    for item in filter(None, sizes.split(",")):
        key, _, val = item.partition("=")
        cfg.model_sizes[key.strip()] = int(val)
    return cfg
