"""Per-rank timelines: what each rank computed and communicated, and when. Pure data.

Observers (``dpcourse.scratch.observe``) append ``Event``s to a ``Timeline`` while a
wrapper works, attached from outside through its hooks: compute spans (a layer's
backward, a unit's forward, time blocked waiting for communication) and communication
spans (a bucket's all-reduce from launch to completion, an FSDP unit's all-gather or
reduce-scatter). The kernel merges the ranks' events and draws them (``dpcourse.viz``);
the functions here only compute on them, e.g. how much communication backward hid.

Times are ``time.perf_counter()`` seconds. On Linux that is CLOCK_MONOTONIC, one clock for
every process of the machine, so events of different ranks on one machine line up (across
machines they would not).
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import asdict, dataclass, replace

COMPUTE, COMM = "compute", "comm"
# kinds of compute events that mean "this rank's compute thread is blocked on communication"
WAIT = "wait"


@dataclass(frozen=True)
class Event:
    """One span on one rank: ``lane`` "compute" or "comm", ``kind`` (forward, backward,
    wait, all_reduce, all_gather, reduce_scatter, free, ...), ``name`` (a layer, bucket or
    unit), ``start``/``end`` in seconds, ``nbytes``: bytes of the communicated tensor (0 for
    compute)."""
    rank: int
    lane: str
    kind: str
    name: str
    start: float
    end: float
    nbytes: int = 0

    @property
    def duration(self) -> float:
        """Seconds."""
        return self.end - self.start


class Timeline:
    """The events of one rank. Safe to append to from communication threads (list.append)."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.events: list[Event] = []
        self.since = float("-inf")  # events that began before the last clear() are dropped
        self._waiters: list[threading.Thread] = []

    def add(self, lane: str, kind: str, name: str, start: float, end: float | None = None,
            nbytes: int = 0) -> None:
        """Append one span (``end`` defaults to now; an instant event has start == end).

        A span that began before the last ``clear()`` is ignored: a collective of an earlier
        step may finish (and report) after the clear."""
        if start < self.since:
            return
        self.events.append(Event(self.rank, lane, kind, name, start,
                                 time.perf_counter() if end is None else end, nbytes))

    @contextlib.contextmanager
    def span(self, lane: str, kind: str, name: str, nbytes: int = 0):
        """``with timeline.span("compute", "optimizer", "step"):`` records the block's span."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, kind, name, start, nbytes=nbytes)

    def comm(self, work, kind: str, name: str, nbytes: int, start: float):
        """Record an async collective's span when it completes; returns ``work``.

        The end is taken in the future's callback, which the backend runs as soon as the
        operation is done -- not when somebody finally waits for it. Where the backend
        gives no future (Gloo's reduce-scatter), a helper thread waits for the work.
        """
        record = lambda *_: self.add(COMM, kind, name, start, nbytes=nbytes)  # noqa: E731
        if not hasattr(work, "get_future"):  # a hook may return a torch.futures.Future itself
            work.then(record)
            return work
        try:
            work.get_future().then(record)
        except RuntimeError:  # Gloo's reduce-scatter has no future: a thread waits instead
            waiter = threading.Thread(target=lambda: (work.wait(), record()), daemon=True)
            waiter.start()
            self._waiters.append(waiter)
        return work

    def clear(self) -> None:
        """Forget the events so far, and any that began before now but report later."""
        self.since = time.perf_counter()
        self.events.clear()

    def to_list(self) -> list[dict]:
        """The events as plain dicts (cheap to send to the kernel), once every collective
        still being waited for by a helper thread has reported."""
        for waiter in self._waiters:
            waiter.join(timeout=10)
        self._waiters = [w for w in self._waiters if w.is_alive()]
        return [asdict(e) for e in sorted(self.events, key=lambda e: (e.start, e.end))]


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
    """Seconds of communication the compute thread sat waiting for (``wait`` spans)."""
    comm = [(e.start, e.end) for e in events if e.lane == COMM and rank in (None, e.rank)]
    waits = [(e.start, e.end) for e in events if e.kind == WAIT and rank in (None, e.rank)]
    return intersection(comm, waits)


def hidden_fraction(events, rank: int | None = None) -> float:
    """Share of communication time (0..1) during which the rank kept computing instead of
    waiting: 1 - exposed / in flight. 1.0 when there was no communication at all."""
    busy = comm_seconds(events, rank)
    return 1.0 if busy == 0 else max(0.0, 1.0 - exposed_seconds(events, rank) / busy)
