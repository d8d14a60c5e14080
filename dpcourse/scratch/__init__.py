"""Data parallelism from scratch: small, readable versions of DP, DDP, ZeRO-1 and FSDP.

    ThreadedDataParallel(module, num_devices)   # nn.DataParallel, emulated on CPU threads
    NaiveDDP / OverlapDDP / BucketedDDP(module) # all-reduce after, per parameter, per bucket
    ShardedOptimizer(params, torch.optim.AdamW, lr=...)   # ZeRO-1
    MiniFSDP(module, wrap={Block}, compute_dtype=None)    # FULL_SHARD

Each wrapper's file is only its algorithm. The DDPs expose ``grad_ready(param)`` and
``comm_hook(tensor, name)``, MiniFSDP its per-unit steps and ``comm_hook``, so a subclass can
change one step; measurement attaches from outside (``dpc.observe``), as it does to
PyTorch's DDP and FSDP. Each runs on real ranks and is checked against PyTorch's own and
against single-process training (the notebooks and ``tests/test_scratch_*.py``). Modules:
threaded_dp, ddp (``OverlapDDP`` too), bucketed, zero (``ShardedOptimizer``), flat, fsdp; a name
the notebooks do not use is imported from its module. None of them imports the training runner.
"""
from .ddp import BucketedDDP, NaiveDDP
from .fsdp import MiniFSDP
from .threaded_dp import ThreadedDataParallel

__all__ = ["BucketedDDP", "MiniFSDP", "NaiveDDP", "ThreadedDataParallel"]
