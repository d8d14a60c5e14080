"""All-reduce algorithms side by side, nccl-tests style: PyTorch's vs ours, in one run.

    python -m dpcourse.bench collectives [--world-sizes 2 4] [--sizes-mib 1 16 64] [--rounds 21]

For each world size, one cluster; for each size, every variant runs once to warm up, then
``rounds`` interleaved rounds (the order rotates each round, so load on the machine hits
all variants alike). Time: from leaving a barrier to the slowest rank's return, median over
rounds. algbw = S / time, busbw = algbw * 2(N-1)/N (nccl-tests' definitions, S the tensor's
bytes). "vs dist": busbw relative to dist.all_reduce's, taken round by round (the two ran
in the same round, so a drift in the machine's speed cancels), median over rounds; the
verdict line adds the quartiles. Then, per rank: bytes sent on the wire (``/proc/self/io``),
from our trace, and the formula (``cost.bytes_sent_per_rank``; for dist.all_reduce the
bandwidth-optimal 2(N-1)/N*S), and what the ring's size check costs per call.
Two rings of ours: ``fast_ring_all_reduce`` (pipelined, ``collectives/fast_ring.py``) and the
plain ``ring_all_reduce`` the course shows (``collectives/ring.py``; no target).
The target: the fast ring's busbw >= 0.8x dist.all_reduce's at >= 16 MiB.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from ..collectives.cost import busbw, bytes_sent_per_rank
from ..collectives.fast_ring import fast_ring_all_reduce
from ..collectives.naive import naive_all_reduce, whole_ring_all_reduce
from ..collectives.ring import ring_all_reduce
from ..collectives.trace import Trace
from ..collectives.checks import check_same_size
from ..observe.comm import wire_bytes_written
from ..pool import Cluster

HELP = "all-reduce: dist.all_reduce vs our rings vs naive variants (time, algbw, busbw, bytes)"
VARIANTS = {"dist.all_reduce": dist.all_reduce, "fast_ring_all_reduce": fast_ring_all_reduce,
            "ring_all_reduce": ring_all_reduce, "naive_all_reduce": naive_all_reduce,
            "whole_ring_all_reduce": whole_ring_all_reduce}
# the schedule (cost.bytes_sent_per_rank's name) each variant follows
SCHEDULE = {"dist.all_reduce": "ring_all_reduce", "fast_ring_all_reduce": "ring_all_reduce"}
TARGET = 0.8  # the fast ring's busbw relative to dist.all_reduce's, at >= 16 MiB
TARGET_VARIANT = "fast_ring_all_reduce"


def add_arguments(parser) -> None:
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=21)


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
            out[nbytes, name] = (times[name], _wire_of(VARIANTS[name], t, **kwargs),
                                 sum(x.nbytes for x in trace.transfers))
    out["size check"] = _time_size_checks(50)
    return out


def _wire_of(fn, *args, **kwargs) -> int | None:
    """Bytes this rank wrote while every rank ran ``fn`` once, between barriers (one barrier's
    own bytes, measured just before, taken off); None off Linux."""
    dist.barrier()
    start = wire_bytes_written()
    dist.barrier()
    barrier = wire_bytes_written() - start if start is not None else None
    start = wire_bytes_written()
    fn(*args, **kwargs)
    dist.barrier()
    end = wire_bytes_written()
    return None if start is None else end - start - barrier


def _time_size_checks(calls):
    """Seconds per call, back to back, of the size check every ring call starts with, and
    of an all_gather of (numel, dtype), which it runs only when the sizes differ."""
    n, small = dist.get_world_size(), torch.ones(1000)
    checks = {"all_reduce": lambda: check_same_size(small, dist.group.WORLD, n, "bench"),
              "all_gather": lambda: dist.all_gather([torch.empty(2, dtype=torch.int64) for _ in range(n)],
                                                    torch.zeros(2, dtype=torch.int64))}
    per_call = {}
    for name, check in checks.items():
        check()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            check()
        per_call[name] = (time.perf_counter() - start) / calls
    return per_call


def main(args) -> int:
    print(f"all-reduce benchmark: backend=gloo, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
          f"float32, {args.rounds} interleaved rounds, medians")
    header = ("N", "size", "variant", "time ms", "algbw GB/s", "busbw GB/s", "vs dist",
              "sent/rank MiB: wire", "trace", "formula")
    rows, verdicts, checks = [header], {TARGET_VARIANT: [], "ring_all_reduce": []}, []
    sizes = [int(mib * 2**20) // 4 * 4 for mib in args.sizes_mib]
    for n in args.world_sizes:
        with Cluster(world_size=n, timeout=1800) as cluster:
            per_rank = cluster.run(_measure, sizes, args.rounds)
        checks.append((n, *(max(r["size check"][name] for r in per_rank)
                            for name in ("all_reduce", "all_gather"))))
        for nbytes in sizes:
            # per round: the slowest rank's time; the table shows the median over rounds
            slowest = {name: [max(r[nbytes, name][0][i] for r in per_rank) for i in range(args.rounds)]
                       for name in VARIANTS}
            for name in VARIANTS:
                seconds = statistics.median(slowest[name])
                bus = busbw("all_reduce", nbytes, seconds, n)
                # "vs dist": round by round, then the median (and quartiles for the verdict)
                ratios = sorted(d / t for d, t in zip(slowest["dist.all_reduce"], slowest[name]))
                ratio = statistics.median(ratios)
                quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
                wire = max(r[nbytes, name][1] or 0 for r in per_rank)
                traced = max(r[nbytes, name][2] for r in per_rank)
                formula = max(bytes_sent_per_rank(SCHEDULE.get(name, name), n, nbytes // 4, 4))
                rows.append((str(n), f"{nbytes / 2**20:g} MiB", name, f"{seconds * 1e3:.1f}",
                             f"{nbytes / seconds / 1e9:.2f}", f"{bus / 1e9:.2f}", f"{ratio:.2f}x",
                             f"{wire / 2**20:.2f}", f"{traced / 2**20:.2f}" if traced else "-",
                             f"{formula / 2**20:.2f}"))
                if name in verdicts and nbytes >= 16 * 2**20:
                    verdicts[name].append((n, nbytes, ratio, quartiles[0], quartiles[2]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.rjust(w) if i != 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print("sent/rank: the busiest rank (the root, for naive_all_reduce); "
          "formula for dist.all_reduce: a bandwidth-optimal all-reduce, 2(N-1)/N*S")
    for n, reduce_s, gather_s in checks:
        print(f"N={n}: the size check before each ring call, one all_reduce(MAX) of [key, -key]: "
              f"{reduce_s * 1e3:.2f} ms per call (50 back to back); an all_gather of (numel, dtype) "
              f"instead: {gather_s * 1e3:.2f} ms")
    worst = {name: min(v, key=lambda x: x[2], default=None) for name, v in verdicts.items()}
    if worst["ring_all_reduce"]:
        n, nbytes, ratio, _, _ = worst["ring_all_reduce"]
        print(f"ring_all_reduce, the plain ring the course shows (no target): lowest {ratio:.2f}x "
              f"dist.all_reduce's busbw at >= 16 MiB (N={n}, {nbytes / 2**20:g} MiB)")
    if worst[TARGET_VARIANT]:
        n, nbytes, ratio, low, high = worst[TARGET_VARIANT]
        print(f"target: {TARGET_VARIANT} busbw >= {TARGET}x dist.all_reduce's at >= 16 MiB: "
              f"{'ok' if ratio >= TARGET else 'MISSED'} (lowest {ratio:.2f}x, N={n}, "
              f"{nbytes / 2**20:g} MiB; round-by-round quartiles {low:.2f}-{high:.2f}x)")
    return 0
