"""A PyTorch DDP/FSDP training runner: one code path for torchrun and for the notebook's ranks.

    python -m dpcourse.train --strategy fsdp --sharding-strategy FULL_SHARD --steps 20
    torchrun --standalone --nproc_per_node=2 -m dpcourse.train --strategy ddp
    cluster.run(dpc.train.train, dpc.train.TrainConfig(strategy="fully_shard"))   # from a notebook
"""
from .config import ConfigError, TrainConfig, parse_args
from .hooks import FullState, Run, StepHook, StepTimer
from .measure import CommMeter
from . import compare, migrate, precision
from .runner import build, main, train, train_single_process

__all__ = ["CommMeter", "ConfigError", "FullState", "Run", "StepHook", "StepTimer", "TrainConfig", "build",
           "main", "parse_args", "train", "train_single_process"]
