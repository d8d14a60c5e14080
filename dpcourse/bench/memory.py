"""The memory ledger measured on real ranks next to the theory, every strategy, one run.

    python -m dpcourse.bench memory [--world-size 4] [--model mlp] [--batch-size 8]

Per strategy (rank 0's figures; every rank is checked): bytes held at rest by category,
ledger / measured, and the peak over the last step with its ratio measured / ledger,
whether every rank's at-rest categories equal the ledger exactly, and how long the
calculator widget takes to redraw. Each strategy trains with the course's runner under the
``Memory`` observer.
"""
from __future__ import annotations

import time

from ..memory import ledger
from ..memory.activations import activation_bytes
from ..memory.ledger import AT_REST
from ..memory.sizes import format_bytes
from ..models import build_model
from ..observe import Memory
from ..pool import Cluster
from ..train import TrainConfig, train
from ..vocab import TRAIN_OPTIONS

HELP = "memory ledger: measured vs theory per strategy at one world size, calculator redraw time"


def add_arguments(parser) -> None:
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank")
    parser.add_argument("--unit", default="KiB", choices=["B", "KiB", "MiB", "KB", "MB"])


def main(args) -> int:
    world = args.world_size
    configs = {name: dict(options) for name, options in TRAIN_OPTIONS.items()}
    if world >= 4 and world % 2 == 0:
        configs["HYBRID_SHARD"]["shard_group_size"] = 2
    else:
        configs.pop("HYBRID_SHARD")
    model = build_model(args.model)
    acts = activation_bytes(args.model, args.batch_size)
    start = time.perf_counter()
    measured = {}
    with Cluster(world_size=world) as cluster:
        for name, options in configs.items():
            measured[name] = Memory()
            cfg = TrainConfig(model=args.model, steps=4, batch_size=args.batch_size, optimizer="adam",
                              progress=False, **options)
            cluster.run(train, cfg, observe=[measured[name]], timeout=300)
    took = time.perf_counter() - start
    print(f"{args.model} ({sum(p.numel() for p in model.parameters()):,} parameters, Adam, fp32), batch "
          f"{args.batch_size} per rank, world_size {world}; measured in {took:.1f} s")
    print(f"{args.unit} per rank (rank 0), ledger / measured")
    exact = True
    for name, memory in measured.items():
        group = {"shard_group_size": 2} if name == "HYBRID_SHARD" else {}
        books = [ledger(model, world, name, "fp32", "adam", rank=r, activation_bytes=acts, **group)
                 for r in range(world)]
        exact &= all(memory.at_rest(r).get(c, 0) == books[r].bytes[c] for r in range(world) for c in AT_REST)
        held = memory.at_rest(0)
        cells = "  ".join(f"{c[:10]} {format_bytes(books[0].bytes[c], args.unit, 4).split()[0]}/"
                          f"{format_bytes(held.get(c, 0), args.unit, 4).split()[0]}"
                          for c in ("parameters", "gradients", "optimizer_state", "bucket_buffers"))
        print(f"{name:14} {cells}  peak {memory.peak(0)[0] / books[0].peak:.3f}")
    print(f"at rest, every rank, every category: measured == ledger: {exact}")
    from ..viz.calculator import ZERO_PRESET, MemoryCalculator

    calculator = MemoryCalculator(**ZERO_PRESET)
    times = []
    for w in (8, 16, 32, 64, 128):
        t0 = time.perf_counter()
        calculator.apply(world_size=w)
        times.append(time.perf_counter() - t0)
    print(f"calculator redraw: median {sorted(times)[len(times) // 2] * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms")
    return 0 if exact else 1
