"""Debugging a hang with PyTorch's own tools, run for real on Gloo ranks.

The bug is the one of *Common pitfalls*: rank 0 calls ``all_reduce`` while rank 1 calls
``broadcast`` (or both call ``all_reduce`` on tensors of different shapes). What PyTorch
offers a learner at work, and what each prints here:

* ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: every collective is first checked against the other
  ranks' (op type, shapes, dtypes: a "fingerprint"), so a mismatch raises at once with both
  fingerprints instead of hanging. Read at ``import torch.distributed``: set it in the
  environment of the launch. It costs an extra collective per call: for debugging only.
* ``TORCH_CPP_LOG_LEVEL=INFO``: c10d's own log lines (the debug level, the store, the
  rendezvous); read when torch is imported.
* ``init_process_group(timeout=timedelta(...))``: how long a collective may wait (Gloo's
  default: 30 minutes; NCCL's: 10 minutes); past it, Gloo raises "Timed out waiting ...".
* The flight recorder (``TORCH_FR_BUFFER_SIZE=N``, formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``):
  each rank keeps its last N collectives (op, sequence number, sizes, state); dumped after a
  timeout it shows which rank is at which collective. On Gloo here we dump it ourselves.
* ``py-spy dump --pid PID``: the Python stack of a stuck process, from outside, without
  stopping it. Without py-spy: ``faulthandler.register(signal.SIGUSR1, all_threads=True)``
  in the script, then ``kill -USR1 PID`` prints the stacks to the rank's stderr.

Run the demos under torchrun or on the notebook's ranks::

    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --nproc_per_node=2 -m dpcourse.hangs mismatch
    cluster.run_script(dpc.hangs.__file__, "timeout", "--out", "hang.json")

Every demo passes a ``timeout`` to ``init_process_group`` (2 s for "timeout", 30 s otherwise),
so nothing can hang for long.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

# NCCL only (no NCCL here): what to set on a GPU cluster, and what it does.
NCCL_SETTINGS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING=3": "what the watchdog thread does when a collective times out or "
                                         "NCCL fails: 3 (the default) ends the process without aborting "
                                         "the communicator, 1 aborts it and ends the process, 2 only "
                                         "aborts it, 0 does nothing (the job hangs)",
    "TORCH_NCCL_BLOCKING_WAIT=1": "wait() blocks the calling thread and raises the timeout there",
    "TORCH_FR_BUFFER_SIZE=2000": "the flight recorder keeps each rank's last 2000 collectives "
                                 "(older name: TORCH_NCCL_TRACE_BUFFER_SIZE)",
    "TORCH_NCCL_DUMP_ON_TIMEOUT=1": "on a timeout every rank writes its flight-recorder buffer to a file",
    "TORCH_FR_DUMP_TEMP_FILE=/shared/fr/rank_": "the file prefix; the rank is appended "
                                                "(older name: TORCH_NCCL_DEBUG_INFO_TEMP_FILE)",
    "TORCH_NCCL_DESYNC_DEBUG=1": "on a timeout, report which rank has not joined the collective",
    "NCCL_DEBUG=INFO": "NCCL's own log: rings, transports (NVLink, InfiniBand, sockets), errors",
}
# Reading all ranks' dumps side by side: `torchfrtrace /shared/fr --prefix rank_` (the module
# torch.distributed.flight_recorder.fr_trace) reports the first collective the ranks disagree on.


# --- rank side: the bug --------------------------------------------------------------------
def mismatched_collectives(what: str = "op") -> torch.Tensor:
    """On every rank: "op": rank 0 all_reduce, the others broadcast; "shape": all_reduce of
    4 + rank elements. Either way the ranks wait for each other forever (or the timeout)."""
    rank = dist.get_rank()
    t = torch.ones(4 + (rank if what == "shape" else 0))
    if what == "op" and rank != 0:
        dist.broadcast(t, src=0)
    else:
        dist.all_reduce(t)
    return t


def flight_recorder() -> list[dict]:
    """This rank's flight-recorder entries: collective, sequence number, input sizes, state."""
    dump = json.loads(torch._C._distributed_c10d._dump_fr_trace_json())
    return [{"collective": e["profiling_name"], "seq": e["collective_seq_id"],
             "sizes": e["input_sizes"], "state": e["state"]} for e in dump.get("entries", [])]


def run_demo(demo: str, out: str | None = None, timeout_s: float | None = None) -> None:
    """A torchrun-style script body: init with a ``timeout_s`` (seconds) timeout, run the bug.

    The timeout defaults to 2 s for "timeout" and 30 s otherwise (DETAIL's own check runs
    under the same timeout, and must not expire on a busy machine before the ranks meet).

    "mismatch"/"shape": the bug as is (under DETAIL it raises the fingerprint mismatch).
    "timeout": the flight recorder on, the bug, then on Gloo's timeout error each rank writes
    the error and its flight recorder to ``out`` + ".rank<N>.json".
    """
    if timeout_s is None:
        timeout_s = 2.0 if demo == "timeout" else 30.0
    if demo == "timeout":  # must be set before the process group is created
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        mismatched_collectives("shape" if demo == "shape" else "op")
    except RuntimeError as err:
        if demo != "timeout":
            raise
        record = {"rank": dist.get_rank(), "error": str(err), "flight_recorder": flight_recorder()}
        with open(f"{out}.rank{dist.get_rank()}.json", "w") as f:
            json.dump(record, f)
        _wait_for_all_ranks(timeout_s)
    finally:
        dist.destroy_process_group()


def _wait_for_all_ranks(timeout_s: float) -> None:
    """Meet the other ranks through the rendezvous store (the process group is broken):
    a rank that tore its group down first would close the sockets under a rank still
    waiting, which then reports "Connection closed by peer" instead of its own timeout."""
    store, n = dist.distributed_c10d._get_default_store(), dist.get_world_size()
    deadline = time.monotonic() + 5 * timeout_s
    store.add("hang-demo-done", 1)
    while store.add("hang-demo-done", 0) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    store.add("hang-demo-leaving", 1)
    if dist.get_rank() == 0:  # the store lives in rank 0's process: it leaves last
        while store.add("hang-demo-leaving", 0) < n and time.monotonic() < deadline:
            time.sleep(0.05)


def main(argv=None) -> None:
    """Command line: ``python -m dpcourse.hangs {mismatch,shape,timeout} [--out PATH] [--timeout S]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo", choices=["mismatch", "shape", "timeout"])
    parser.add_argument("--out", help="path prefix of the timeout demo's per-rank JSON files")
    parser.add_argument("--timeout", type=float, default=None,
                        help="process-group timeout, seconds (default: 2 for timeout, 30 otherwise)")
    args = parser.parse_args(argv)
    run_demo(args.demo, args.out, args.timeout)


# --- kernel side: launch, look inside ---------------------------------------------------------
def torchrun(demo: str, *args: str, env: dict | None = None, nproc: int = 2, timeout: float = 90.0):
    """Run ``torchrun --nproc_per_node=nproc -m dpcourse.hangs demo args`` with extra ``env``;
    (exit code, output lines). Killed with all its workers after ``timeout`` seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "dpcourse.hangs", demo, *args]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers share its session
        output, _ = proc.communicate()
    return proc.returncode, output.splitlines()


def py_spy_path() -> str | None:
    """The py-spy program: beside this Python first (where pip puts it, on PATH or not, as in
    a virtual environment used without activating it), else on PATH; None if neither."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def py_spy_dump(pid: int, timeout: float = 30.0) -> str:
    """``py-spy dump --pid pid``: the Python stack of every thread of a running process."""
    tool = py_spy_path()
    if tool is None:
        return "py-spy is not installed: pip install py-spy (or use faulthandler, see dpc.hangs)"
    done = subprocess.run([tool, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout)
    return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)  # py-spy colours a terminal's output


def dump_stacks_during(run, pids, after: float = 1.0) -> tuple[list[str], BaseException | None]:
    """Call ``run()`` in a thread; ``after`` seconds later, py-spy-dump each of ``pids``.

    Returns the dumps (by pid, main thread first as py-spy prints it) and what ``run``
    raised (None if it returned). ``run`` must end by itself, e.g. through a timeout.
    """
    raised = []

    def target():
        try:
            run()
        except BaseException as err:  # noqa: BLE001 - handed back to the caller
            raised.append(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    time.sleep(after)
    dumps = [py_spy_dump(pid) for pid in pids]
    thread.join()
    return dumps, (raised[0] if raised else None)


def main_thread_stack(dump: str) -> list[str]:
    """The frames of the "MainThread" section of a py-spy dump, innermost first."""
    lines = dump.splitlines()
    start = next((i for i, line in enumerate(lines) if '"MainThread"' in line), None)
    if start is None:
        return []
    frames = []
    for line in lines[start + 1:]:
        if not line.startswith(" "):
            break
        frames.append(line.strip())
    return frames


if __name__ == "__main__":
    main()
