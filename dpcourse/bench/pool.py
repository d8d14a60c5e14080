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
  fork vs spawn  for both start methods side by side: cold start; tiny all_reduce calls in
                 the first 2 s after start (spawn: while a spare imports torch); then, once
                 the cluster has settled, two failures back to back -- a rank raises (->
                 usable again), then at once a rank is killed with SIGKILL (-> usable
                 again). Spawn: a fresh interpreter per rank, the default off Linux; its
                 restarts use spare generations, which import torch one after the other,
                 at low priority, while the cluster works.
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..pool import Cluster, RankDied, RankError
from ..pool.kernel.procs import free_port
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


def _settled(cluster, timeout: float = 120.0) -> None:
    """Wait until every spare generation has imported torch: a learner's cluster, seconds after
    its last restart (fork mode keeps no spares)."""
    deadline = time.monotonic() + timeout
    while not all(spare.warm() for spare in cluster._spares) and time.monotonic() < deadline:
        time.sleep(0.05)


def _usable_after_kill(cluster, rank: int) -> float:
    """Seconds from a SIGKILL of ``rank`` until a call has returned again (the first call may
    meet the dying rank: RankDied, after which the cluster has restarted)."""
    start = time.perf_counter()
    os.kill(cluster.pids[rank], signal.SIGKILL)  # a rank of our own cluster, by its PID
    for _ in range(3):
        try:
            cluster.run(lambda: None)
            break
        except RankDied:
            pass
    return time.perf_counter() - start


def _start_and_recover(method: str, world_size: int, rounds: int) -> dict:
    """For ``rounds`` clusters started with ``method``: cold start (s), tiny all_reduce calls in the
    2 s after it (median ms), and back-to-back failures once settled (s until usable each)."""
    out = {"cold": [], "calls": [], "error": [], "kill": []}
    for _ in range(rounds):
        start = time.perf_counter()
        with Cluster(world_size, start_method=method) as cluster:
            cluster.run(lambda: None)
            out["cold"].append(time.perf_counter() - start)
            calls, until = [], time.perf_counter() + 2.0
            while time.perf_counter() < until:
                calls += _time_calls(cluster, _tiny_all_reduce, 1)
            out["calls"].append(_median_ms(calls))
            _settled(cluster)
            start = time.perf_counter()
            try:
                cluster.run(_fail_on_rank_1)
            except RankError:
                pass
            cluster.run(lambda: None)
            out["error"].append(time.perf_counter() - start)
            out["kill"].append(_usable_after_kill(cluster, 1))  # at once: the second failure
    return out


HELP = "the worker pool: start-up, call overhead, recovery, vs spawn per call"


def add_arguments(parser) -> None:
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the slow measurements")


class _Table:
    """The benchmark's figures, a row each: name, value, what it is compared with, target, verdict."""

    HEADER = ("figure", "value", "compared with", "target", "")

    def __init__(self):
        self.rows = []

    def row(self, name, value, unit, versus="", target="", ok=None):
        verdict = "" if ok is None else ("ok" if ok else "MISSED")
        self.rows.append((name, f"{value:.3g} {unit}", versus, target, verdict))

    def print(self, world_size: int) -> None:
        widths = [max(len(r[i]) for r in self.rows + [self.HEADER]) for i in range(5)]
        print(f"pool benchmark: world_size={world_size}, backend=gloo, {os.cpu_count()} CPU cores, "
              f"torch {torch.__version__}")
        for r in [self.HEADER] + self.rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


def _cold_start(table: _Table, world_size: int, rounds: int) -> None:
    """Cluster(world_size) started and shut down, next to a bare ``import torch`` (s)."""
    cold, imports = [], []
    for _ in range(rounds):  # interleaved, so load on the machine hits both alike
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        imports.append(time.perf_counter() - start)
        start = time.perf_counter()
        Cluster(world_size).shutdown()
        cold.append(time.perf_counter() - start)
    table.row(f"cold start, {world_size} ranks", statistics.median(cold), "s",
              f"import torch: {statistics.median(imports):.2f} s "
              f"(x{statistics.median(cold) / statistics.median(imports):.2f})")


def _calls(table: _Table, cluster, world_size: int, rounds: int) -> None:
    """A no-op call and a 1-float all_reduce through the pool (ms), next to the all_reduce
    timed inside the ranks and to ``mp.spawn`` of the same all_reduce per call."""
    _time_calls(cluster, lambda: None, 20)
    noop = _median_ms(_time_calls(cluster, lambda: None, 500))
    table.row("no-op call", noop, "ms", "", "<= 2 ms", noop <= 2)

    pool_ar = _median_ms(_time_calls(cluster, _tiny_all_reduce, 300))
    single = statistics.median(max(cluster.run(_timed_tiny_all_reduce)) for _ in range(300)) * 1e3
    loop = max(r[4] for r in cluster.run(time_all_reduce, [4], 300)) * 1e3  # 1 float, back to back
    table.row("1-float all_reduce via pool", pool_ar, "ms",
              f"in ranks: {single:.3g} ms as one call (x{pool_ar / single:.2f}), "
              f"{loop:.3g} ms back to back (x{pool_ar / loop:.2f})",
              "<= 2x in-rank", pool_ar <= 2 * single)

    spawn = []
    for _ in range(rounds):
        start = time.perf_counter()
        mp.spawn(_spawned, args=(world_size, free_port()), nprocs=world_size, join=True)
        spawn.append(time.perf_counter() - start)
    speedup = statistics.median(spawn) * 1e3 / pool_ar
    table.row("same all_reduce, spawn per call", statistics.median(spawn), "s",
              f"pool is x{speedup:.0f} faster", ">= 100x", speedup >= 100)


def _recovery(table: _Table, cluster, rounds: int) -> None:
    """A rank raises while the others wait: seconds until RankError here, and until usable."""
    errors, usable = [], []
    for _ in range(max(rounds, 5)):
        try:
            cluster.run(_fail_on_rank_1)
        except RankError as err:
            errors.append(time.time() - float(err.failures[1].exception.args[0]))
        start = time.perf_counter()
        cluster.run(lambda: None)
        usable.append(time.perf_counter() - start + errors[-1])
    table.row("rank exception -> RankError", statistics.median(errors), "s",
              f"max {max(errors):.2f} s", "<= 1 s", max(errors) <= 1)
    table.row("exception -> usable pool", statistics.median(usable), "s",
              f"max {max(usable):.2f} s", "<= 3 s", max(usable) <= 3)


def _fork_vs_spawn(table: _Table, world_size: int, rounds: int) -> None:
    """``_start_and_recover`` for both start methods, spawn's figure next to fork's."""
    starts = {m: _start_and_recover(m, world_size, rounds) for m in ("fork", "spawn")}
    fork, spawn = starts["fork"], starts["spawn"]
    med = statistics.median

    def side_by_side(name, key, unit, target, ok):
        s, f = med(spawn[key]), med(fork[key])
        table.row(name, s, unit, f"fork: {f:.3g} {unit} (spawn x{s / f:.2f}); spawn max {max(spawn[key]):.3g} {unit}",
                  target, ok)

    side_by_side(f"cold start, spawn, {world_size} ranks", "cold", "s", "<= 6 s", max(spawn["cold"]) <= 6)
    side_by_side("all_reduce calls, first 2 s, spawn", "calls", "ms", "<= 2x fork",
                 med(spawn["calls"]) <= 2 * med(fork["calls"]))
    side_by_side("rank error -> usable, spawn", "error", "s", "<= 4 s", max(spawn["error"]) <= 4)
    side_by_side("then at once kill -9 -> usable, spawn", "kill", "s", "<= 4 s", max(spawn["kill"]) <= 4)


def main(args) -> int:
    world_size, rounds = args.world_size, args.rounds
    table = _Table()
    _cold_start(table, world_size, rounds)
    with Cluster(world_size) as cluster:
        _calls(table, cluster, world_size, rounds)
        _recovery(table, cluster, rounds)
    _fork_vs_spawn(table, world_size, rounds)
    table.print(world_size)
    return 0
