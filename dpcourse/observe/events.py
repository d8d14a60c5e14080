"""Timeline events: what each rank computed and communicated, and when. Pure data.

The ``Timeline`` observer records them on the ranks (compute spans: a layer's forward or
backward, the optimizer, time spent waiting for communication; communication spans: a
collective from launch to completion); the kernel merges the ranks' events and draws them
(``dpcourse.viz``). The functions here only compute on them, e.g. how much communication
backward hid.

Times are ``time.perf_counter()`` seconds. On Linux that is CLOCK_MONOTONIC, one clock for
every process of the machine, so events of different ranks on one machine line up (across
machines they would not).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

COMPUTE, COMM = "compute", "comm"
# kinds of compute events that mean "this rank's compute thread is blocked on communication"
WAIT = "wait"


@dataclass(frozen=True)
class Event:
    """One span on one rank: ``lane`` "compute" or "comm", ``kind`` (forward, backward,
    wait, all_reduce, all_gather, reduce_scatter, free, ...), ``name`` (a layer, bucket or
    unit), ``start``/``end`` in seconds, ``nbytes``: the collective's payload S in bytes
    (``payload.payload_bytes``, as ``Comm`` counts it; 0 for compute), ``step``: the training step (optimizer steps completed before it began)."""
    rank: int
    lane: str
    kind: str
    name: str
    start: float
    end: float
    nbytes: int = 0
    step: int = 0

    @property
    def duration(self) -> float:
        """Seconds."""
        return self.end - self.start


def from_lists(per_rank) -> list[Event]:
    """Merge ranks' ``to_list()`` results into one event list, times relative to the earliest
    event (seconds)."""
    events = [Event(**d) for lst in per_rank for d in lst]
    if not events:
        return []
    t0 = min(e.start for e in events)
    return sorted((replace(e, start=e.start - t0, end=e.end - t0) for e in events),
                  key=lambda e: (e.rank, e.start))


def union(intervals) -> list[tuple[float, float]]:
    """Disjoint, sorted (start, end) intervals covering the same time as ``intervals``."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def total(intervals) -> float:
    """Seconds covered by ``intervals`` (overlaps counted once)."""
    return sum(b - a for a, b in union(intervals))


def intersection(xs, ys) -> float:
    """Seconds covered by both interval sets."""
    xs, ys = union(xs), union(ys)
    i = j = 0
    covered = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        covered += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return covered


def comm_seconds(events, rank: int | None = None) -> float:
    """Seconds during which at least one collective of ``rank`` was in flight."""
    return total((e.start, e.end) for e in events if e.lane == COMM and rank in (None, e.rank))


def exposed_seconds(events, rank: int | None = None) -> float:
    """Seconds during which communication of ``rank`` was in flight and the rank computed
    nothing (no forward, backward or optimizer span): what the step paid for communication."""
    comm = [(e.start, e.end) for e in events if e.lane == COMM and rank in (None, e.rank)]
    compute = [(e.start, e.end) for e in events if e.lane == COMPUTE and e.kind != WAIT
               and rank in (None, e.rank)]
    return total(comm) - intersection(comm, compute)


def hidden_fraction(events, rank: int | None = None) -> float:
    """Share of communication time (0..1) that ran under compute: 1 - exposed / in flight.
    1.0 when there was no communication at all."""
    busy = comm_seconds(events, rank)
    return 1.0 if busy == 0 else max(0.0, 1.0 - exposed_seconds(events, rank) / busy)
