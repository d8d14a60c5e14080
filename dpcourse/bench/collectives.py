"""All-reduce algorithms side by side, nccl-tests style: PyTorch's vs ours, in one run.

    python -m dpcourse.bench collectives [--world-sizes 2 4] [--sizes-mib 1 16 64] [--rounds 9]

For each world size, one cluster; for each size, every variant runs once to warm up, then
``rounds`` interleaved rounds (the order rotates each round, so load on the machine hits
all variants alike). Time: from leaving a barrier to the slowest rank's return, median over
rounds. algbw = S / time, busbw = algbw * 2(N-1)/N (nccl-tests' definitions, S the tensor's
bytes). Then, per rank: bytes sent on the wire (``/proc/self/io``), from our trace, and the
formula (``cost.bytes_sent_per_rank``; for dist.all_reduce the bandwidth-optimal 2(N-1)/N*S).
The target: our ring's busbw >= 0.8x dist.all_reduce's at >= 16 MiB.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from ..collectives import (Trace, busbw, bytes_sent_per_rank, measure_bytes_sent,
                           naive_all_reduce, ring_all_reduce, whole_ring_all_reduce)
from ..pool import Cluster

HELP = "all-reduce: dist.all_reduce vs our ring vs naive variants (time, algbw, busbw, bytes)"
VARIANTS = {"dist.all_reduce": dist.all_reduce, "ring_all_reduce": ring_all_reduce,
            "naive_all_reduce": naive_all_reduce, "whole_ring_all_reduce": whole_ring_all_reduce}
TARGET = 0.8  # our ring's busbw relative to dist.all_reduce's, at >= 16 MiB


def add_arguments(parser) -> None:
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=9)


def _measure(sizes_bytes, rounds):
    """On every rank: per size and variant, the seconds of each round and bytes sent."""
    out = {}
    for nbytes in sizes_bytes:
        t = torch.ones(nbytes // 4)
        names = list(VARIANTS)
        times = {name: [] for name in names}
        for round_ in range(rounds + 1):  # round 0 warms up every variant
            for k in range(len(names)):
                name = names[(k + round_) % len(names)]
                t.fill_(1.0)
                dist.barrier()
                start = time.perf_counter()
                VARIANTS[name](t)
                if round_:
                    times[name].append(time.perf_counter() - start)
        for name in names:
            trace = Trace()
            kwargs = {"trace": trace} if name != "dist.all_reduce" else {}
            sent = measure_bytes_sent(VARIANTS[name], t, **kwargs)
            out[nbytes, name] = (times[name], sent.wire, sum(x.nbytes for x in trace.transfers))
    return out


def main(args) -> int:
    print(f"all-reduce benchmark: backend=gloo, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
          f"float32, {args.rounds} interleaved rounds, medians")
    header = ("N", "size", "variant", "time ms", "algbw GB/s", "busbw GB/s", "vs dist",
              "sent/rank MiB: wire", "trace", "formula")
    rows, verdicts = [header], []
    sizes = [int(mib * 2**20) // 4 * 4 for mib in args.sizes_mib]
    for n in args.world_sizes:
        with Cluster(world_size=n, timeout=1800) as cluster:
            per_rank = cluster.run(_measure, sizes, args.rounds)
        for nbytes in sizes:
            reference = None
            for name in VARIANTS:
                # per round: the slowest rank's time; then the median over rounds
                slowest = [max(r[nbytes, name][0][i] for r in per_rank) for i in range(args.rounds)]
                seconds = statistics.median(slowest)
                bus = busbw("all_reduce", nbytes, seconds, n)
                reference = bus if name == "dist.all_reduce" else reference
                ratio = bus / reference if reference else float("nan")
                wire = max(r[nbytes, name][1] or 0 for r in per_rank)
                traced = max(r[nbytes, name][2] for r in per_rank)
                algorithm = "ring_all_reduce" if name == "dist.all_reduce" else name
                formula = max(bytes_sent_per_rank(algorithm, n, nbytes // 4, 4))
                rows.append((str(n), f"{nbytes / 2**20:g} MiB", name, f"{seconds * 1e3:.1f}",
                             f"{nbytes / seconds / 1e9:.2f}", f"{bus / 1e9:.2f}", f"{ratio:.2f}x",
                             f"{wire / 2**20:.2f}", f"{traced / 2**20:.2f}" if traced else "-",
                             f"{formula / 2**20:.2f}"))
                if name == "ring_all_reduce" and nbytes >= 16 * 2**20:
                    verdicts.append((n, nbytes, ratio))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.rjust(w) if i != 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print("sent/rank: the busiest rank (the root, for naive_all_reduce); "
          "formula for dist.all_reduce: a bandwidth-optimal all-reduce, 2(N-1)/N*S")
    worst = min((v for v in verdicts), key=lambda v: v[2], default=None)
    if worst:
        ok = worst[2] >= TARGET
        print(f"target: ring_all_reduce busbw >= {TARGET}x dist.all_reduce's at >= 16 MiB: "
              f"{'ok' if ok else 'MISSED'} (lowest {worst[2]:.2f}x, N={worst[0]}, "
              f"{worst[1] / 2**20:g} MiB)")
    return 0
