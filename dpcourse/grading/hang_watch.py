"""Where each rank of a running torchrun launch waits, read from its log while it runs, and
when the ranks can no longer meet.

A rank logs every collective as it issues it and again when it completes (``events``: a
``Comm``, then its ``Done``), so the oldest collective without its ``Done`` is the one it
waits in. Two ranks
that wait in different collectives, or one that waits while the other has ended or left the
process group, will wait forever: the checker stops such a run after ``STUCK_S`` seconds
instead of its whole timeout, and says where each rank was, e.g. "rank 0 waits in its 3rd
all_gather since optimizer step 4 (for 15 s); rank 1 has left the process group".
"""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass

from ..tracking.records import ordinal
from .events import Comm, Destroy, Done, Pid, Wait, read_events


@dataclass(frozen=True)
class Waiting:
    """Where one rank is, read from its log while the run goes on.

    ``pid``: its process (None before it logged); ``left``: it returned from
    ``destroy_process_group``; ``waiting``: the oldest collective it issued that has not
    completed, as (number, collective, its ordinal among that collective's calls since the
    last optimizer step, that step), or None."""

    pid: int | None
    left: bool
    waiting: tuple[int, str, int, int] | None

    def describe(self, rank: int, ended: bool, seconds: float | None = None) -> str:
        """E.g. "rank 0 waits in its 3rd all_gather since optimizer step 4 (for 16 s)"."""
        if self.waiting is not None and not ended:
            _, name, nth, step = self.waiting
            since = f"since optimizer step {step}" if step else "before its first optimizer step"
            held = f" (for {seconds:.0f} s)" if seconds is not None else ""
            return f"rank {rank} waits in its {ordinal(nth)} {name} {since}{held}"
        if self.left:
            return f"rank {rank} has left the process group" + (" and ended" if ended else "")
        if ended:
            return f"rank {rank} has ended without leaving the process group"
        return f"rank {rank} is in no collective (running its own code)"


def where_ranks_wait(directory: str, nproc: int) -> list[Waiting]:
    """Each rank's ``Waiting``, from the events its log holds so far."""
    return [_where(read_events(directory, rank)) for rank in range(nproc)]


def _where(events: list) -> Waiting:
    pid, left, open_, counts, issued = None, False, {}, {}, {}
    for e in events:
        match e:
            case Pid():
                pid = e.pid
            case Comm():
                counts[(e.step, e.collective)] = counts.get((e.step, e.collective), 0) + 1
                issued[e.number] = (e.number, e.collective, counts[(e.step, e.collective)], e.step)
                if e.kind != "functional":  # a Work in flight: waited in until it completes
                    open_[e.number] = issued[e.number]
            case Wait() if e.number in issued:  # a functional one: waited in from here
                open_[e.number] = issued[e.number]
            case Done():
                open_.pop(e.number, None)
            case Destroy():
                left = True
    return Waiting(pid, left, open_[min(open_)] if open_ else None)


class Watch:
    """Reads the ranks' logs while they run and says when they can no longer finish."""

    def __init__(self, observed: str, nproc: int, stuck_s: float):
        self.observed, self.nproc, self.stuck_s = observed, nproc, stuck_s
        self.since: dict[tuple, float] = {}  # (rank, collective number) -> first seen waiting

    def _read(self):
        ranks = where_ranks_wait(self.observed, self.nproc)
        now = time.monotonic()
        held = []
        for rank, state in enumerate(ranks):
            key = (rank, state.waiting[0]) if state.waiting else None
            if key is not None:
                self.since.setdefault(key, now)
            held.append(now - self.since[key] if key is not None else None)
        ended = [state.pid is not None and not alive(state.pid) for state in ranks]
        return ranks, held, ended

    def check(self) -> tuple[bool, str]:
        """(hung, where each rank is)."""
        ranks, held, ended = self._read()
        for rank, state in enumerate(ranks):
            if held[rank] is None or held[rank] < self.stuck_s or ended[rank]:
                continue
            mine = state.waiting[1:]  # (collective, ordinal, step)
            for other, theirs in enumerate(ranks):
                if other == rank:
                    continue
                gone = ended[other] or (theirs.left and theirs.waiting is None)
                elsewhere = theirs.waiting is not None and theirs.waiting[1:] != mine
                if gone or elsewhere:
                    return True, self._words(ranks, held, ended)
        return False, ""

    def describe(self) -> str:
        return self._words(*self._read())

    @staticmethod
    def _words(ranks, held, ended) -> str:
        return "; ".join(state.describe(rank, ended[rank], held[rank]) for rank, state in enumerate(ranks))


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended but not yet reaped, has ended)."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout
    return bool(state.strip()) and not state.strip().startswith("Z")
