"""What the pool says back, next to what torchrun says on the same code, measured in one run.

    python -m dpcourse.bench verdicts [--world-sizes 2 3] [--start-methods fork spawn]
                                      [--timeout 300] [--big-mib 256] [--cases ...]

Each case is a torchrun-style script, run with ``cluster.run_script`` on a cluster of the
given size and start method, and with ``torchrun --standalone`` on the same file. Printed per
run: how it ended (the error's class, or the exit codes), the seconds until the call returned
or raised, and the first line of the message. What is right for each case is said with it:

  raises        rank 1 raises ValueError at step 3 while the others wait in all_reduce:
                the error, with its traceback, as fast as torchrun or faster
  exits         rank 1 sys.exit(3) while the others wait in barrier: exit code 3, as fast
  future        irecv posted early, then a Future a timer completes, then send: finishes
  waited        irecv posted early, then a large all_reduce(async_op=True).wait(): finishes
  inference     rank 0 alone all_reduces a tensor made under torch.inference_mode: an error
                (torchrun: when rank 1's process ends; the pool: a certain deadlock)
  fresh         a script chdirs, sets float64, seeds, configures logging; the next script
                must see a new process's state (what it sees is printed)
  streams       torch.rand on every rank: different numbers, as separate processes draw
  orphans       a process the ranks started, after the kernel is killed with SIGKILL: none
                may survive (the pool only; torchrun's agent sets no death signal)
  helpers       a script with a spawn-context process and persistent DataLoader workers,
                twice: nothing reported as left running, no resource_tracker warning

The pool's timeout is ``--timeout`` (the learner's default, 300 s); ``torchrun`` gets the same
as a wall-clock limit.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

HELP = "each failure, hang and leak case: the pool next to torchrun, time to report and message"

_EXCHANGED = """
        if rank < 2:
            dist.send(torch.full((1,), float(rank)), dst=1 - rank)
            req.wait()
            print("received", buf.item())
        dist.barrier()
        dist.destroy_process_group()
"""

SCRIPTS = {
    "raises": '''
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        for step in range(5):
            if dist.get_rank() == 1 and step == 3:
                raise ValueError(f"bad batch at step {step}")
            dist.all_reduce(torch.ones(1))
        dist.destroy_process_group()
    ''',
    "exits": '''
        import sys, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            sys.exit(3)
        dist.barrier()
        dist.destroy_process_group()
    ''',
    # the two correct programs that were called deadlocked: an irecv posted early, a wait
    # on something else, then the matching send (_EXCHANGED ends both)
    "future": """
        import threading, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        rank, buf = dist.get_rank(), torch.zeros(1)
        if rank < 2:
            req = dist.irecv(buf, src=1 - rank)
            done = torch.futures.Future()
            threading.Timer(2.0, done.set_result, args=(None,)).start()
            done.wait()
    """ + _EXCHANGED,
    "waited": """
        import os, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        rank, buf = dist.get_rank(), torch.zeros(1)
        if rank < 2:
            req = dist.irecv(buf, src=1 - rank)
        dist.all_reduce(torch.ones(int(os.environ["BIG_MIB"]) * 2**18), async_op=True).wait()
    """ + _EXCHANGED,
    "inference": '''
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        with torch.inference_mode():
            t = torch.ones(1)
        if dist.get_rank() == 0:
            dist.all_reduce(t)
        dist.destroy_process_group()
    ''',
    "fresh": '''
        import logging, os, torch
        print("sees", os.path.basename(os.getcwd()), torch.get_default_dtype(), len(logging.root.handlers),
              round(torch.rand(1).item(), 4))
        os.chdir("..")
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(0)
        logging.basicConfig(level=logging.INFO)
    ''',
    "streams": '''
        import torch
        print("draws", round(torch.rand(1).item(), 6))
    ''',
    "helpers": '''
        import multiprocessing as mp
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        def child():
            pass

        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=child)
            p.start()
            p.join()
            loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, num_workers=1,
                                persistent_workers=True)
            for epoch in range(2):
                for batch in loader:
                    pass
    ''',
}

ORPHAN_KERNEL = '''
import subprocess, sys, time
import dpcourse as dpc
cluster = dpc.Cluster({n}, start_method="{method}")
pids = cluster.run(lambda: subprocess.Popen(["sleep", "600"]).pid)
print("STARTED", *pids, flush=True)
time.sleep(600)
'''


def add_arguments(parser) -> None:
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--start-methods", nargs="+", default=["fork", "spawn"])
    parser.add_argument("--timeout", type=float, default=300.0, help="the pool's timeout, torchrun's limit")
    parser.add_argument("--big-mib", type=int, default=256, help="the 'waited' case's all_reduce")
    parser.add_argument("--cases", nargs="+", default=list(SCRIPTS) + ["orphans"])
    parser.add_argument("--no-torchrun", action="store_true", help="the pool's runs only")


def _first_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 150 else text[:147] + "..."


def _pool_run(cluster, path: str, timeout: float, capture) -> tuple[str, float, str]:
    start = time.monotonic()
    try:
        codes = cluster.run_script(path, timeout=timeout)
        outcome, message = f"exit {codes}", ""
    except Exception as err:  # noqa: BLE001 -- the outcome is what is measured
        outcome, message = type(err).__name__, str(err)
    took = time.monotonic() - start
    said = capture()
    return outcome, took, message or said


def _torchrun(n: int, path: str, timeout: float, env: dict) -> tuple[str, float, str]:
    from ..processes import launch_env, run_process, torchrun_command

    start = time.monotonic()
    try:
        proc = run_process(torchrun_command(n, path), timeout=timeout, env=launch_env(**env),
                           stderr=subprocess.STDOUT, text=True, cwd=os.path.dirname(path))
        outcome, text = f"exit {proc.returncode}", proc.stdout
    except subprocess.TimeoutExpired as err:
        outcome, text = "killed at the limit", (err.stdout or "")
    took = time.monotonic() - start
    lines = [line for line in text.splitlines() if re.search(r"Error|error|exitcode|Exception|sees|draws|received", line)]
    return outcome, took, "; ".join(lines[:3]) or text[-300:]


class _Captured:
    """What the ranks print while a case runs (the pool writes to this process's fds 1 and 2)."""

    def __init__(self, folder: str):
        self.path = os.path.join(folder, "captured.txt")

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = os.dup(1), os.dup(2)
        self.file = open(self.path, "w+")
        os.dup2(self.file.fileno(), 1)
        os.dup2(self.file.fileno(), 2)
        return self

    def read(self) -> str:
        sys.stdout.flush()
        sys.stderr.flush()
        self.file.seek(0)
        text = self.file.read()
        self.file.seek(0)
        self.file.truncate()
        return text

    def __exit__(self, *exc):
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.saved[0], 1)
        os.dup2(self.saved[1], 2)
        os.close(self.saved[0])
        os.close(self.saved[1])
        self.file.close()


def _summary(case: str, outcome: str, output: str) -> str:
    """What the run says for the case, short: the error's first line, or what the ranks printed."""
    if case == "fresh":
        return "; ".join(sorted(set(re.findall(r"sees [^\n]*", output))))
    if case == "streams":
        draws = re.findall(r"draws ([\d.]+)", output)
        return f"{len(set(draws))} different numbers on {len(draws)} ranks"
    if case == "helpers":
        left = len(re.findall(r"left \d+ process", output))
        warned = output.count("resource_tracker")
        return f"{left} 'left running' reports, {warned} resource_tracker warnings"
    return _first_line(output)


def _orphans(n: int, method: str) -> tuple[str, float, str]:
    """A kernel that started a cluster whose ranks each started a `sleep`, killed with SIGKILL:
    how many sleeps survive 5 s later."""
    import signal

    import psutil

    code = ORPHAN_KERNEL.format(n=n, method=method)
    kernel = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = ""
    while not line.startswith("STARTED"):
        line = kernel.stdout.readline()
        if not line and kernel.poll() is not None:
            return "kernel failed", 0.0, ""
    sleeps = [int(p) for p in line.split()[1:]]
    start = time.monotonic()
    os.kill(kernel.pid, signal.SIGKILL)
    kernel.wait()
    time.sleep(5)
    alive = [p for p in sleeps if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    for pid in alive:  # started below our child a moment ago: ours to end
        os.kill(pid, signal.SIGKILL)
    return f"{len(alive)} of {len(sleeps)} survived", time.monotonic() - start, ""


def main(args) -> int:
    import torch  # noqa: F401 -- measured runs do not pay for the import

    from ..pool import Cluster

    cases = [c for c in args.cases if c in SCRIPTS or c == "orphans"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpcourse-verdicts-") as folder:
        work = os.path.join(folder, "project")
        os.makedirs(work)
        paths = {}
        for case in cases:
            if case in SCRIPTS:
                paths[case] = os.path.join(work, f"{case}.py")
                with open(paths[case], "w") as f:
                    f.write(textwrap.dedent(SCRIPTS[case]))
        env = {"BIG_MIB": str(args.big_mib)}
        os.environ.update(env)
        here = os.getcwd()
        os.chdir(work)
        try:
            with _Captured(folder) as captured:
                for n in args.world_sizes:
                    for method in args.start_methods:
                        rows += _pool_rows(Cluster, n, method, cases, paths, args.timeout, captured)
                    if not args.no_torchrun:
                        for case in cases:
                            if case in SCRIPTS and case != "helpers":
                                outcome, took, text = _torchrun(n, paths[case], args.timeout, env)
                                rows.append((case, "torchrun", n, outcome, took, _summary(case, outcome, text)))
        finally:
            os.chdir(here)
    _print(rows)
    return 0


def _pool_rows(cluster_class, n, method, cases, paths, timeout, captured) -> list:
    rows = []
    with cluster_class(n, start_method=method, timeout=timeout) as cluster:
        cluster.run(lambda: None)
        captured.read()
        for case in cases:
            if case == "orphans":
                continue
            if case == "streams":  # as a call too: the same numbers on every rank is the old fault
                start = time.monotonic()
                got = cluster.run(_draw)
                took = time.monotonic() - start
                rows.append((case + " (run)", f"pool {method}", n, "returned", took,
                             f"{len(set(got))} different numbers on {n} ranks"))
            if case in _AS_CALLS:  # the same code as cluster.run, where a returned rank's group lives on
                outcome, took, message = _call(cluster, _AS_CALLS[case], timeout, captured.read)
                rows.append((case + " (run)", f"pool {method}", n, outcome, took, _first_line(message)))
            repeats = 2 if case in ("fresh", "helpers") else 1
            output, outcome, took, message = "", "", 0.0, ""
            for _ in range(repeats):
                outcome, took, message = _pool_run(cluster, paths[case], timeout, captured.read)
                output += message + "\n"
            rows.append((case, f"pool {method}", n, outcome, took, _summary(case, outcome, output)))
    if "orphans" in cases:
        outcome, took, _ = _orphans(n, method)
        rows.append(("orphans", f"pool {method}", n, outcome, took, "after the kernel's kill -9, 5 s"))
    return rows


def _call(cluster, fn, timeout: float, capture) -> tuple[str, float, str]:
    start = time.monotonic()
    try:
        got = cluster.run(fn, timeout=timeout)
        outcome, message = "returned", f"returned {got}"
    except Exception as err:  # noqa: BLE001 -- the outcome is what is measured
        outcome, message = type(err).__name__, str(err)
    took = time.monotonic() - start
    capture()
    return outcome, took, message


def _inference_all_reduce_alone():
    import torch
    import torch.distributed as dist

    with torch.inference_mode():
        t = torch.ones(1)
    if dist.get_rank() == 0:
        dist.all_reduce(t)


def _irecv_then_a_future():
    import threading

    import torch
    import torch.distributed as dist

    rank, buf = dist.get_rank(), torch.zeros(1)
    if rank > 1:
        return None
    req = dist.irecv(buf, src=1 - rank)
    done = torch.futures.Future()
    threading.Timer(2.0, done.set_result, args=(None,)).start()
    done.wait()
    dist.send(torch.full((1,), float(rank)), dst=1 - rank)
    req.wait()
    return buf.item()


_AS_CALLS = {"inference": _inference_all_reduce_alone, "future": _irecv_then_a_future}


def _draw():
    import torch

    return round(torch.rand(1).item(), 6)


def _print(rows) -> None:
    print(f"{'case':<16} {'runner':<12} {'N':>2}  {'outcome':<24} {'seconds':>8}  says")
    for case, runner, n, outcome, took, says in sorted(rows, key=lambda r: (r[0], r[2], r[1])):
        print(f"{case:<16} {runner:<12} {n:>2}  {outcome[:24]:<24} {took:8.1f}  {says}")
    torchrun = {(case, n): took for case, runner, n, _, took, _ in rows if runner == "torchrun"}
    ratios = [f"{case} {runner.split()[1]} N={n} {took / torchrun[case, n]:.2f}x"
              for case, runner, n, _, took, _ in sorted(rows) if runner != "torchrun"
              and case in ("raises", "exits", "inference") and torchrun.get((case, n))]
    if ratios:
        print("time to report a failure, the pool over torchrun (same run): " + "; ".join(ratios))
