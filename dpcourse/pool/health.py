"""What a cluster is doing right now, for a status display: read-only, never a call to the ranks.

    cluster.status()    # -> ClusterStatus: backend, world size, each rank's pid, device and state

The pool records two facts as calls pass through it (``track``): whether a call is in flight,
and how the last call that failed ended. Everything else is read from what the kernel
already knows (the launcher's exit reports, the current generation's PIDs), so asking never
disturbs the ranks and works while they are busy, after a failure, and after ``shutdown``.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

from ..backends import uses_cuda
from .errors import ClusterError, RankError, RankTimeout


@dataclass
class _Record:
    busy_since: float | None = None      # time.monotonic() when the call in flight started
    calls: int = 0                       # calls started, ok or not
    last_error: str = ""                 # the first line of the last failed call's error
    failed: dict = field(default_factory=dict)  # rank -> one line, if the last call failed


_RECORDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _record(cluster) -> _Record:
    return _RECORDS.setdefault(cluster, _Record())


def track(cluster, call, message: bytes) -> list:
    """``call.run(message)``, noting that a call is in flight and how it failed, if it does."""
    __tracebackhide__ = True
    record = _record(cluster)
    record.busy_since, record.calls = time.monotonic(), record.calls + 1
    try:
        results = call.run(message)
        record.failed = {}  # the last call went well: no rank has failed in it
        return results
    except BaseException as err:
        note(cluster, err)
        raise
    finally:
        record.busy_since = None


def note(cluster, err: BaseException) -> None:
    """Remember ``err`` as the cluster's last error (first line; per rank where known)."""
    record = _record(cluster)
    text = str(err).strip().splitlines()
    record.last_error = f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
    if isinstance(err, RankError):
        record.failed = {r: f.summary for r, f in err.failures.items()}
    elif isinstance(err, RankTimeout):
        record.failed = {r: f.summary for r, f in err.reports.items() if f.state == "running"}
    elif isinstance(err, KeyboardInterrupt):
        record.failed = {}
        record.last_error = "KeyboardInterrupt: the call was interrupted (stop button)"
    else:
        record.failed = {}


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


def status(cluster) -> ClusterStatus:
    """``cluster``'s state from the kernel's side, without a call to the ranks."""
    record = _RECORDS.get(cluster) or _Record()
    gen = None if cluster.closed else cluster._gen
    exited = {}
    if gen is not None:
        try:
            while cluster._launcher.conn.poll(0):  # exit reports the launcher sent meanwhile
                cluster._launcher.poll_one()
        except (ClusterError, OSError):
            pass
        exited = cluster._launcher.exited
    busy = record.busy_since is not None
    ranks = []
    for r in range(cluster.world_size):
        pid = gen.pids[r] if gen is not None else None
        if gen is None:
            state = "closed"
        elif pid in exited:
            state = "dead"
        else:
            state = "busy" if busy else "idle"
        failed = record.failed.get(r, "")
        ranks.append(RankStatus(r, pid, rank_device(cluster.backend, r), state, failed))
    return ClusterStatus(cluster.backend, cluster.world_size, cluster.closed,
                         time.monotonic() - record.busy_since if busy else None, record.calls,
                         record.last_error, ranks)
