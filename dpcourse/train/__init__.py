"""A PyTorch DDP/FSDP training runner: one code path for torchrun and for the notebook's ranks.

    python -m dpcourse.train --strategy fsdp --sharding-strategy FULL_SHARD --steps 20
    torchrun --standalone --nproc_per_node=2 -m dpcourse.train --strategy ddp --measure time,bytes
    cluster.run(dpc.train.train, dpc.train.TrainConfig(strategy="fully_shard"))   # from a notebook

It is what ``launch/`` starts and what 4.2d's faults lesson kills and resumes: periodic
checkpoints that are complete or absent, ``--resume auto`` for torchrun's restarts.
Measurement attaches from outside, with ``dpc.observe``'s observers.
"""
from .config import ConfigError, TrainConfig, parse_args
from .runner import build, full_model_state, main, train, train_single_process

__all__ = ["ConfigError", "TrainConfig", "build", "full_model_state", "main", "parse_args", "train",
           "train_single_process"]
