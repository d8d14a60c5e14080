"""A PyTorch DDP/FSDP training runner: one code path for torchrun and for the notebook's ranks.

    python -m dpcourse.train --wrapper fsdp --sharding-strategy FULL_SHARD --steps 20
    torchrun --standalone --nproc_per_node=2 -m dpcourse.train --wrapper ddp --measure time,bytes
    cluster.run(dpc.train.train, dpc.train.TrainConfig(wrapper="fully_shard"))   # from a notebook

It is what ``launch/`` starts and what 4.2d's faults lesson kills and resumes: periodic
checkpoints that are complete or absent, ``--resume auto`` for torchrun's restarts.
Measurement attaches from outside, with ``dpc.observe``'s observers. The other names are
imported from their modules: config (``ConfigError``, ``parse_args``), runner (``main``,
``train_single_process``, the single-process reference the tests compare against).
"""
from .config import TrainConfig
from .runner import train

__all__ = ["TrainConfig", "train"]
