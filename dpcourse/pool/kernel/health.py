"""What a cluster is doing right now, for a status display: read-only, never a call to the ranks.

    cluster.status()    # -> ClusterStatus: backend, world size, each rank's pid, device and state

Runs in the kernel. Each cluster keeps a ``Record`` of two facts as calls pass through it:
whether a call is in flight, and how the last call that failed ended. Everything else is
read from what the kernel already knows (the launcher's exit reports, the current
generation's PIDs), so asking never disturbs the ranks and works while they are busy, after
a failure, and after ``shutdown``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ...backends import uses_cuda
from ..errors import ClusterError, RankError, RankTimeout
from .procs import Generation, LauncherProcess


@dataclass
class Record:
    """What one cluster's calls did, as far as a status display needs (see ``status``)."""

    busy_since: float | None = None      # time.monotonic() when the call in flight started
    calls: int = 0                       # calls started, ok or not
    last_error: str = ""                 # the first line of the last failed call's error
    failed: dict = field(default_factory=dict)  # rank -> one line, if the last call failed

    def start(self) -> None:
        """A call goes out."""
        self.busy_since, self.calls = time.monotonic(), self.calls + 1

    def end(self, err: BaseException | None) -> None:
        """The call came back, fine (``err`` None: no rank has failed in it) or raising ``err``."""
        self.busy_since = None
        self.failed = {}
        if err is None:
            return
        text = str(err).strip().splitlines()
        self.last_error = f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
        if isinstance(err, RankError):
            self.failed = {r: f.summary for r, f in err.failures.items()}
        elif isinstance(err, RankTimeout):
            self.failed = {r: f.summary for r, f in err.reports.items() if f.state == "running"}
        elif isinstance(err, KeyboardInterrupt):
            self.last_error = "KeyboardInterrupt: the call was interrupted (stop button)"


@dataclass
class RankStatus:
    """One rank as the kernel sees it. state: "idle", "busy", "dead" or "closed"."""

    rank: int
    pid: int | None
    device: str
    state: str
    failed_last: str = ""  # how it failed in the last call ("" if that call went well for it)


@dataclass
class ClusterStatus:
    """A snapshot of a cluster: see ``status``."""

    backend: str
    world_size: int
    closed: bool
    busy_s: float | None          # seconds the call in flight has run (None: no call)
    calls: int                    # calls started so far
    last_error: str               # "" if no call failed yet
    ranks: list[RankStatus]

    @property
    def alive(self) -> list[int]:
        """Ranks whose process is running (idle or busy)."""
        return [r.rank for r in self.ranks if r.state in ("idle", "busy")]


def rank_device(backend: str, rank: int) -> str:
    """The device rank ``rank`` computes on: its own GPU under NCCL (one per rank), else the CPU."""
    return f"cuda:{rank}" if uses_cuda(backend) else "cpu"


def status(record: Record, backend: str, world_size: int, gen: Generation | None,
           launcher: LauncherProcess, closed: bool) -> ClusterStatus:
    """A cluster's state from the kernel's side, without a call to the ranks: ``record`` of its
    calls, its current generation ``gen`` (None: none, or ``closed``) and its ``launcher``."""
    gen = None if closed else gen
    exited = {}
    if gen is not None:
        try:
            while launcher.conn.poll(0):  # exit reports the launcher sent meanwhile
                launcher.poll_one()
        except (ClusterError, OSError):
            pass
        exited = launcher.exited
    busy = record.busy_since is not None
    ranks = []
    for r in range(world_size):
        pid = gen.pids[r] if gen is not None else None
        if gen is None:
            state = "closed"
        elif pid in exited:
            state = "dead"
        else:
            state = "busy" if busy else "idle"
        failed = record.failed.get(r, "")
        ranks.append(RankStatus(r, pid, rank_device(backend, r), state, failed))
    return ClusterStatus(backend, world_size, closed,
                         time.monotonic() - record.busy_since if busy else None, record.calls,
                         record.last_error, ranks)
