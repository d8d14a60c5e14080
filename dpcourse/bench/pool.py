"""How fast the pool is, next to the alternatives, measured in one run.

    python -m dpcourse.bench pool [--world-size 4] [--rounds 3]

Figures (all wall-clock; medians, with min-max over rounds where there are few):
  cold start     Cluster(world_size) ready to run  vs  `python -c "import torch"`
  no-op call     cluster.run(lambda: None)
  all_reduce     cluster.run of a 1-float all_reduce  vs  the same all_reduce timed
                 inside the ranks (back to back, and as the single call it is)
  spawn per call mp.spawn of a module-level function doing the same all_reduce
                 (start, init, all_reduce, exit)  vs  the pool's call
  error          a rank raises while the others wait in all_reduce -> RankError here
  usable again   RankError caught -> the next call has returned
  fork vs spawn  cold start and failure -> usable again, for both start methods side by side
                 (spawn: a fresh interpreter per rank, the default off Linux; its restarts
                 use the spare generation, which imports torch while the cluster works)
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..pool import Cluster, RankError
from ..pool.procs import free_port
from ..collectives.alpha_beta import time_all_reduce


def _median_ms(samples) -> float:
    return statistics.median(samples) * 1e3


def _time_calls(cluster, fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        cluster.run(fn)
        out.append(time.perf_counter() - start)
    return out


def _tiny_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _timed_tiny_all_reduce():
    t = torch.ones(1)
    start = time.perf_counter()
    dist.all_reduce(t)
    return time.perf_counter() - start


def _spawned(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    _tiny_all_reduce()
    dist.barrier()
    dist.destroy_process_group()


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise RuntimeError(repr(time.time()))
    dist.all_reduce(torch.ones(1))


def _start_and_recover(method: str, world_size: int, rounds: int) -> tuple[list, list]:
    """Cold starts and failure -> usable times of ``rounds`` clusters started with ``method``."""
    cold, usable = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        with Cluster(world_size, start_method=method) as cluster:
            cluster.run(lambda: None)
            cold.append(time.perf_counter() - start)
            for _ in range(2):
                deadline = time.monotonic() + 60
                while cluster._spare is not None and not cluster._spare.warm() and time.monotonic() < deadline:
                    time.sleep(0.05)  # as a learner's cluster is, seconds after its last restart
                start = time.perf_counter()
                try:
                    cluster.run(_fail_on_rank_1)
                except RankError:
                    pass
                cluster.run(lambda: None)
                usable.append(time.perf_counter() - start)
    return cold, usable


HELP = "the worker pool: start-up, call overhead, recovery, vs spawn per call"


def add_arguments(parser) -> None:
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the slow measurements")


def main(args) -> int:
    world_size, rounds = args.world_size, args.rounds
    rows = []

    def row(name, value, unit, versus="", target="", ok=None):
        verdict = "" if ok is None else ("ok" if ok else "MISSED")
        rows.append((name, f"{value:.3g} {unit}", versus, target, verdict))

    cold, imports = [], []
    for _ in range(rounds):  # interleaved, so load on the machine hits both alike
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        imports.append(time.perf_counter() - start)
        start = time.perf_counter()
        Cluster(world_size).shutdown()
        cold.append(time.perf_counter() - start)
    row(f"cold start, {world_size} ranks", statistics.median(cold), "s",
        f"import torch: {statistics.median(imports):.2f} s "
        f"(x{statistics.median(cold) / statistics.median(imports):.2f})")

    with Cluster(world_size) as cluster:
        _time_calls(cluster, lambda: None, 20)
        noop = _median_ms(_time_calls(cluster, lambda: None, 500))
        row("no-op call", noop, "ms", "", "<= 2 ms", noop <= 2)

        pool_ar = _median_ms(_time_calls(cluster, _tiny_all_reduce, 300))
        single = statistics.median(max(cluster.run(_timed_tiny_all_reduce)) for _ in range(300)) * 1e3
        loop = max(r[4] for r in cluster.run(time_all_reduce, [4], 300)) * 1e3  # 1 float, back to back
        row("1-float all_reduce via pool", pool_ar, "ms",
            f"in ranks: {single:.3g} ms as one call (x{pool_ar / single:.2f}), "
            f"{loop:.3g} ms back to back (x{pool_ar / loop:.2f})",
            "<= 2x in-rank", pool_ar <= 2 * single)

        spawn = []
        for _ in range(rounds):
            start = time.perf_counter()
            mp.spawn(_spawned, args=(world_size, free_port()), nprocs=world_size, join=True)
            spawn.append(time.perf_counter() - start)
        speedup = statistics.median(spawn) * 1e3 / pool_ar
        row("same all_reduce, spawn per call", statistics.median(spawn), "s",
            f"pool is x{speedup:.0f} faster", ">= 100x", speedup >= 100)

        errors, usable = [], []
        for _ in range(max(rounds, 5)):
            try:
                cluster.run(_fail_on_rank_1)
            except RankError as err:
                errors.append(time.time() - float(err.failures[1].exception.args[0]))
            start = time.perf_counter()
            cluster.run(lambda: None)
            usable.append(time.perf_counter() - start + errors[-1])
        row("rank exception -> RankError", statistics.median(errors), "s",
            f"max {max(errors):.2f} s", "<= 1 s", max(errors) <= 1)
        row("exception -> usable pool", statistics.median(usable), "s",
            f"max {max(usable):.2f} s", "<= 3 s", max(usable) <= 3)

    starts = {m: _start_and_recover(m, world_size, rounds) for m in ("fork", "spawn")}
    (fork_cold, fork_usable), (spawn_cold, spawn_usable) = starts["fork"], starts["spawn"]
    med = statistics.median
    row(f"cold start, spawn, {world_size} ranks", med(spawn_cold), "s",
        f"fork: {med(fork_cold):.2f} s (spawn x{med(spawn_cold) / med(fork_cold):.2f})",
        "<= 6 s", max(spawn_cold) <= 6)
    row("failure -> usable, spawn", med(spawn_usable), "s",
        f"fork: {med(fork_usable):.2f} s (spawn x{med(spawn_usable) / med(fork_usable):.2f}); "
        f"max {max(spawn_usable):.2f} s", "<= 4 s", max(spawn_usable) <= 4)

    widths = [max(len(r[i]) for r in rows + [("figure", "value", "compared with", "target", "")])
              for i in range(5)]
    print(f"pool benchmark: world_size={world_size}, backend=gloo, {os.cpu_count()} CPU cores, "
          f"torch {torch.__version__}")
    for r in [("figure", "value", "compared with", "target", "")] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0
