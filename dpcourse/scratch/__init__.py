"""Data parallelism from scratch: small, readable versions of DP, DDP, ZeRO-1 and FSDP.

    ThreadedDataParallel(module, num_devices)   # nn.DataParallel, emulated on CPU threads
    NaiveDDP / OverlapDDP / BucketedDDP(module) # all-reduce after, per parameter, per bucket
    ShardedOptimizer(params, torch.optim.AdamW, lr=...)   # ZeRO-1
    MiniFSDP(module, wrap={Block}, compute_dtype=None)    # FULL_SHARD
    Timeline(rank)                              # per-rank events, recorded by observers

Each wrapper's file is only its algorithm. The DDPs expose ``grad_ready(param)`` and
``comm_hook(tensor, name)``, MiniFSDP its per-unit steps and ``comm_hook``; timelines attach
from outside through them (``observe``), as they do to PyTorch's DDP and FSDP1.

Each runs on real ranks and is checked against PyTorch's own and against single-process
training (``train_steps`` / ``reference_steps``). Modules: threaded_dp, ddp, bucketed,
zero, flat, fsdp, timeline, observe (timelines of any of them and of torch DDP/FSDP1),
experiment, sweep,
compare (MiniFSDP next to FSDP1 and the memory ledger).
"""
from . import compare, sweep, timeline
from .bucketed import Bucket, BucketManager, assign_buckets
from .ddp import BucketedDDP, NaiveDDP, OverlapDDP
from .experiment import KINDS, parameters_around_backward, reference_steps, train_steps, wrap_model
from .fsdp import MiniFSDP
from .observe import (BackwardObserver, FSDP1Observer, MiniFSDPObserver, observe_comm_hook,
                      observe_ddp_communication)
from .threaded_dp import ThreadedDataParallel, measure_speedup
from .timeline import Event, Timeline, hidden_fraction
from .zero import ShardedOptimizer

__all__ = ["Bucket", "BucketManager", "BucketedDDP", "BackwardObserver", "Event", "FSDP1Observer",
           "KINDS", "MiniFSDP", "MiniFSDPObserver", "NaiveDDP", "OverlapDDP", "ShardedOptimizer",
           "ThreadedDataParallel", "Timeline", "assign_buckets",
           "compare", "hidden_fraction", "measure_speedup", "observe_comm_hook",
           "observe_ddp_communication", "parameters_around_backward", "reference_steps", "sweep",
           "timeline", "train_steps", "wrap_model"]
