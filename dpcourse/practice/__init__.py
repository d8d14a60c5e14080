"""Large-model practice with FSDP2, each idea run on real ranks and compared with one process.

| module | idea |
|---|---|
| ``meta_init`` | build on the meta device, shard, then materialise only the shards (``to_empty`` + init) |
| ``checkpointing`` | activation checkpointing (``checkpoint_wrapper`` under ``fully_shard``) |
| ``offload`` | CPU offload of parameter, gradient and optimizer-state shards (``CPUOffloadPolicy``) |
| ``clipping`` | ``clip_grad_norm_`` on sharded gradients (FSDP2, and FSDP1's own method) |
| ``prefetch`` | forward/backward prefetch knobs and the order of all-gathers they produce |
| ``measure`` | the observers: parameter bytes held, bytes saved for backward, FSDP2's profiler trace |

Functions named "On every rank: ..." run on the ranks (``cluster.run``) and return plain data
(numbers, this rank's shards); ``common.assemble`` glues shards together in the kernel, and
the ``*_whole`` functions are the one-process references.
"""
from . import checkpointing, clipping, common, measure, meta_init, offload, prefetch

__all__ = ["checkpointing", "clipping", "common", "measure", "meta_init", "offload", "prefetch"]
