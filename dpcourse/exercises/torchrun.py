"""Run a learner's script under torchrun for a checker: observed, time-limited, nothing left behind."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from .hang_watch import Watch

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Run:
    """What one torchrun launch did: exit code (None: stopped), output, per-rank stdout.

    ``hung``: True when it was stopped early because its ranks waited in collectives that
    can never complete; ``where``: then, and after a timeout, where each rank was, e.g.
    "rank 0 waits in its 3rd all_gather since optimizer step 4 (for 15 s); rank 1 has left
    the process group"; ``seconds``: how long it ran."""

    script: str
    returncode: int | None
    output: str
    rank_stdout: dict[int, str]
    workdir: str
    observed: str
    hung: bool = False
    where: str = ""
    seconds: float = 0.0

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


EXIT_ABORT = "terminate called without an active exception"


def aborted_at_exit(returncode: int | None, output: str, work_done: bool) -> bool:
    """Whether torchrun failed only because a worker aborted as Python exited, its work done.

    PyTorch's Gloo teardown can race the interpreter's exit: a Gloo thread still needs the GIL
    to free the last collective's tensors, is ended inside a C++ destructor, and the process
    aborts. The one recogniser for it (the checkers and the tests use it) asks for all three:
    torchrun names a worker ended by SIGABRT; a worker's stderr has the C++ runtime's words
    for it ("terminate called without an active exception"); and the caller's own evidence
    that the script's work was done (``work_done``: every rank returned from
    ``destroy_process_group``, or rank 0 printed its save). A timeout (``None``) never is.
    """
    return (returncode not in (0, None) and work_done and "(SIGABRT)" in output
            and EXIT_ABORT in output)


STUCK_S = 15.0  # seconds a rank may wait in one collective while its peer cannot join it
POLL_S = 0.5


def torchrun(script: str, args: list[str], workdir: str, nproc: int, timeout: float,
             stuck_s: float = STUCK_S) -> Run:
    """``torchrun --standalone --nproc_per_node=nproc script *args`` in ``workdir``, observed.

    While it runs, the ranks' logs say which collective each waits in (``observe.py``). The
    launch is stopped early, as hung, once a rank has waited in one collective for
    ``stuck_s`` seconds while another rank has ended, has left the process group, or waits
    in a different collective: no peer can ever join it. Otherwise it is stopped after
    ``timeout`` seconds. Either way it is stopped as a whole: torchrun first (it stops its
    workers, which run in sessions of their own), then anything of it still alive.
    """
    observed = os.path.join(workdir, ".observed")
    logs = os.path.join(workdir, ".logs")
    os.makedirs(observed, exist_ok=True)
    env = {**os.environ, "DPCOURSE_OBSERVE_DIR": observed, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([SITE, PACKAGE_ROOT] + [p for p in
                                                             os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--redirects", "1", "--log-dir", logs, os.path.abspath(script), *args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    watch = Watch(observed, nproc, stuck_s)
    hung, where = False, ""
    while proc.poll() is None:
        if time.monotonic() - start > timeout:
            where = watch.describe()
            break
        hung, where = watch.check()
        if hung:
            break
        time.sleep(POLL_S)
    if proc.poll() is None:
        _stop(proc)
        code = None
    else:
        code = proc.returncode
        where = ""
    proc.wait()
    reader.join(10)
    stdout = {}
    for rank in range(nproc):
        files = glob.glob(os.path.join(logs, "**", str(rank), "stdout.log"), recursive=True)
        stdout[rank] = "".join(open(f, errors="replace").read() for f in files)
    return Run(os.path.abspath(script), code, "".join(chunks), stdout, workdir, observed, hung, where,
               time.monotonic() - start)


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop torchrun ``proc`` and every process it started (found through /proc, or `ps`)."""
    family = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)  # torchrun's agent then terminates its workers
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid] + family:  # collected a moment ago: ours, not reused
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


PROC = "/proc"  # where Linux lists processes; elsewhere `ps` says the same


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process: from /proc where it exists, else from `ps` (macOS)."""
    parents = {}
    if os.path.isdir(PROC):
        for entry in os.listdir(PROC):
            if entry.isdigit():
                try:
                    with open(f"{PROC}/{entry}/stat") as f:
                        parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    pass
        return parents
    listing = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        pid, _, ppid = line.strip().partition(" ")
        if pid.isdigit() and ppid.strip().isdigit():
            parents[int(pid)] = int(ppid.strip())
    return parents


def _descendants(root: int) -> list[int]:
    parents = _parents()
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += children
        frontier = children
    return found
