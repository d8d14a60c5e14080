"""The from-scratch wrappers next to their PyTorch counterparts, measured side by side.

    python -m dpcourse.bench scratch [--world-sizes 2 4] [--rounds 3] [--steps 8]

For each world size every wrapper trains the same model on the same data with the course's
runner (``dpc.train.train(cfg, wrap=...)``), observed by a ``Timeline``; rounds are
interleaved (all wrappers, then all again) so load on the machine hits all alike. Per step the slowest rank counts; figures are medians over the
steps after the first two (warm-up; torch DDP rebuilds its buckets after step 1) and
over rounds: wall and CPU seconds per step, and throughput ratios scratch / PyTorch
(> 1: ours is faster). Both DDPs use torch DDP's default buckets (25 MiB, the first one
1 MiB); MiniFSDP shards its root as FSDP1 does. "hidden" is the share of communication
time during which the rank kept computing (``Timeline.hidden_fraction``), over the same runs. ThreadedDataParallel runs in this process: its replicas in
threads vs one after another.
"""
from __future__ import annotations

import os
import statistics

import torch

from ..models import build_model, wrap_classes
from ..observe import Timeline
from ..pool import Cluster
from ..scratch import BucketedDDP, MiniFSDP, NaiveDDP
from ..scratch.ddp import OverlapDDP
from ..scratch.zero import ShardedOptimizer
from ..scratch.threaded_dp import measure_speedup
from ..train import TrainConfig, train

HELP = "from-scratch DDP / ZeRO-1 / FSDP vs PyTorch's: time per step, hidden communication"

VARIANTS = {  # name -> (kind, options of _wrapper)
    "NaiveDDP": ("naive", {}),
    "OverlapDDP": ("overlap", {}),
    "BucketedDDP": ("bucketed", {"first_bucket_cap_mb": 1}),  # torch DDP's default buckets
    "torch DDP": ("ddp", {}),
    "BucketedDDP + ShardedOptimizer": ("bucketed", {"first_bucket_cap_mb": 1, "sharded_optimizer": True}),
    "torch DDP + ZeroRedundancyOptimizer": ("ddp", {"sharded_optimizer": "torch"}),
    "MiniFSDP": ("mini_fsdp", {"shard_root": True}),
    "torch FSDP1 FULL_SHARD": ("fsdp", {}),
}
PAIRS = [  # (ours, PyTorch's, target throughput ratio or None)
    ("NaiveDDP", "torch DDP", None),
    ("OverlapDDP", "torch DDP", None),
    ("BucketedDDP", "torch DDP", 0.9),
    ("BucketedDDP + ShardedOptimizer", "torch DDP + ZeroRedundancyOptimizer", None),
    ("MiniFSDP", "torch FSDP1 FULL_SHARD", 0.8),
]


def add_arguments(parser) -> None:
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first 2 are warm-up)")
    parser.add_argument("--d-model", type=int, default=128, help="transformer width")
    parser.add_argument("--n-layers", type=int, default=4)


def _table(rows) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


def _threaded_dp() -> list:
    """ThreadedDataParallel on 2 "devices": threads vs sequential, Python- vs compute-bound."""
    rows = []
    mse = torch.nn.functional.mse_loss
    for label, sizes, batch in (("many small layers", dict(d_hidden=16, depth=16), 64),
                                ("few wide layers", dict(d_hidden=512, depth=4), 256)):
        x, y = torch.randn(batch, 32), torch.randn(batch, 8)
        r = measure_speedup(lambda sizes=sizes: build_model("mlp", **sizes), x, y, mse, num_devices=2, rounds=3)
        rows.append((f"ThreadedDataParallel, {label}", f"{r['threads'] * 1e3:.2f}",
                     f"sequential {r['sequential'] * 1e3:.2f} ms", f"speed-up x{r['speedup']:.2f} (ideal x2)"))
    return rows


def _wrapper(kind: str, first_bucket_cap_mb=None, sharded_optimizer=False, shard_root=False):
    """(wrap, optimizer_for) for the runner: a from-scratch wrapper, or torch's (None: the runner's)."""
    import functools

    import torch

    wraps = {"naive": NaiveDDP, "overlap": OverlapDDP,
             "bucketed": functools.partial(BucketedDDP, first_bucket_cap_mb=first_bucket_cap_mb),
             "mini_fsdp": lambda m: MiniFSDP(m, wrap=wrap_classes("transformer"), shard_root=shard_root)}
    optimizer_for = None
    if sharded_optimizer == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer_for = functools.partial(ZeroRedundancyOptimizer, optimizer_class=torch.optim.AdamW, lr=1e-2)
    elif sharded_optimizer:
        optimizer_for = functools.partial(ShardedOptimizer, optimizer_class=torch.optim.AdamW, lr=1e-2)
    return wraps.get(kind), optimizer_for


def main(args) -> int:
    sizes = {"d_model": args.d_model, "n_layers": args.n_layers, "seq_len": 32, "vocab_size": 256}
    base = dict(model="transformer", model_sizes=sizes, optimizer="adamw", steps=args.steps,
                batch_size=16, num_samples=4096, progress=False)
    warmup = 2
    print(f"scratch benchmark: transformer {sizes}, batch {base['batch_size']} per rank, AdamW; gloo, "
          f"{os.cpu_count()} CPU cores, torch {torch.__version__}")
    print()
    _table([("figure", "ms/step", "compared with", "")] + _threaded_dp())
    for world in args.world_sizes:
        wall = {n: [] for n in VARIANTS}
        cpu = {n: [] for n in VARIANTS}
        hidden = {n: [] for n in VARIANTS}
        with Cluster(world_size=world) as cluster:
            for _ in range(args.rounds):
                for name, (kind, options) in VARIANTS.items():
                    cfg = TrainConfig(wrapper="fsdp" if kind == "fsdp" else "ddp", **base)
                    wrap, optimizer_for = _wrapper(kind, **options)
                    timeline = Timeline()
                    cluster.run(train, cfg, wrap=wrap, optimizer_for=optimizer_for, timeout=600, observe=[timeline])
                    for s in range(warmup, cfg.steps):
                        wall[name].append(max(timeline.step_seconds(r)[s] for r in range(world)))
                        cpu[name].append(max(timeline.step_seconds(r, cpu=True)[s] for r in range(world)))
                    hidden[name].append(statistics.fmean(timeline.hidden_fraction(step=-1, rank=r)
                                                         for r in range(world)))
        med = {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in VARIANTS}
        print(f"\nworld_size {world}: medians over {args.rounds} rounds x {args.steps - warmup} steps, "
              "slowest rank per step (the Timeline observer adds its own time to every row alike)")
        _table([("wrapper", "wall ms/step", "CPU ms/step", "hidden comm")] +
               [(n, f"{w * 1e3:.1f}", f"{c * 1e3:.1f}", f"{statistics.median(hidden[n]):.0%}")
                for n, (w, c) in med.items()])
        print()
        rows = [("ours", "PyTorch's", "throughput ratio (wall)", "(CPU)", "target", "")]
        for ours, theirs, target in PAIRS:
            ratio_wall, ratio_cpu = med[theirs][0] / med[ours][0], med[theirs][1] / med[ours][1]
            verdict = "" if target is None else ("ok" if ratio_wall >= target else "MISSED")
            rows.append((ours, theirs, f"x{ratio_wall:.2f}", f"x{ratio_cpu:.2f}",
                         "" if target is None else f">= x{target}", verdict))
        _table(rows)
    return 0
