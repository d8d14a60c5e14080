"""The memory ledger measured on real ranks next to the theory, every strategy, one run.

    python -m dpcourse.bench memory [--world-size 4] [--model mlp] [--batch-size 8]

Per strategy (rank 0's figures; every rank is checked): bytes held at rest by category,
theory / measured, and the peak over one recorded step with its ratio measured / theory,
which tool measured what, whether every rank's at-rest categories equal the theory
exactly, and how long the calculator widget takes to redraw.
"""
from __future__ import annotations

import time

from ..memory import experiment, report
from ..pool import Cluster

HELP = "memory ledger: measured vs theory per strategy at one world size, calculator redraw time"


def add_arguments(parser) -> None:
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank")
    parser.add_argument("--unit", default="KiB", choices=["B", "KiB", "MiB", "KB", "MB"])


def main(args) -> int:
    configs = experiment.configurations(args.world_size)
    start = time.perf_counter()
    with Cluster(world_size=args.world_size) as cluster:
        results = experiment.measure_all(cluster, configs, model=args.model, batch_size=args.batch_size)
    took = time.perf_counter() - start
    first = results[0][0]
    print(f"{args.model} ({first['num_params']:,} parameters, Adam, fp32), batch {args.batch_size} per rank, "
          f"world_size {args.world_size}; measured in {took:.1f} s")
    print(report.table([r[0] for r in results], args.unit))
    exact = all(report.at_rest_matches(x) for r in results for x in r)
    print(f"at rest, every rank, every category: measured == theory: {exact}")
    from ..viz.calculator import ZERO_PRESET, MemoryCalculator

    calculator = MemoryCalculator(**ZERO_PRESET)
    times = []
    for world in (8, 16, 32, 64, 128):
        t0 = time.perf_counter()
        calculator.apply(world_size=world)
        times.append(time.perf_counter() - t0)
    print(f"calculator redraw: median {sorted(times)[len(times) // 2] * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms")
    return 0 if exact else 1
