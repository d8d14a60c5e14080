"""Run a learner's script under torchrun for a checker: observed, time-limited, nothing left behind.

The workers start with ``site`` first on their path: the checker's folder whose
``sitecustomize`` records what the script does as an event log (``events``) in the folder
``DPCOURSE_OBSERVE_DIR`` names; the harness reads the log while the run goes on to tell a hang
(``hang_watch``)."""
from __future__ import annotations

import glob
import os
import subprocess
import threading
import time
from dataclasses import dataclass

from ..processes import PACKAGE_ROOT, end_tree, launch_env, start_process, torchrun_command
from .hang_watch import Watch


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


STUCK_S = 15.0  # seconds a rank may wait in one collective while its peer cannot join it
POLL_S = 0.5
STOP_GRACE_S = 10.0  # after SIGTERM, torchrun's agent has this long to stop its workers


def torchrun(script: str, args: list[str], workdir: str, nproc: int, timeout: float, site: str,
             stuck_s: float = STUCK_S) -> Run:
    """``torchrun --standalone --nproc_per_node=nproc script *args`` in ``workdir``, observed.

    While it runs, the ranks' event logs say which collective each waits in. The
    launch is stopped early, as hung, once a rank has waited in one collective for
    ``stuck_s`` seconds while another rank has ended, has left the process group, or waits
    in a different collective: no peer can ever join it. Otherwise it is stopped after
    ``timeout`` seconds. Either way it is stopped as a whole: torchrun first (it stops its
    workers, which run in sessions of their own), then anything of it still alive.
    """
    observed = os.path.join(workdir, ".observed")
    logs = os.path.join(workdir, ".logs")
    os.makedirs(observed, exist_ok=True)
    path = [site, PACKAGE_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = launch_env(DPCOURSE_OBSERVE_DIR=observed, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    cmd = torchrun_command(nproc, "--redirects", "1", "--log-dir", logs, os.path.abspath(script), *args)
    start = time.monotonic()
    proc = start_process(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    code = end_tree(proc, grace_s=STOP_GRACE_S)  # None: it was stopped
    if code is not None:
        where = ""
    reader.join(10)
    stdout = {}
    for rank in range(nproc):
        files = glob.glob(os.path.join(logs, "**", str(rank), "stdout.log"), recursive=True)
        stdout[rank] = "".join(open(f, errors="replace").read() for f in files)
    return Run(os.path.abspath(script), code, "".join(chunks), stdout, workdir, observed, hung, where,
               time.monotonic() - start)
