"""The fast ring: the same ring all-reduce as ``ring.py``, pipelined for speed.

``ring.py`` is the ring to read: one chunk per step, one send and one receive, then wait.
This module walks the same schedule (``schedule.ring_all_reduce_steps``), sends the same
bytes and gives bitwise the same results, but overlaps the steps; the benchmark
(``python -m dpcourse.bench collectives``) compares both with ``dist.all_reduce``.

How: each chunk travels in segments, and a segment moves on as soon as it has been added,
so sending the next step overlaps adding the rest of this one (the pipelined ring of
Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
JPDC 2009). Receives are posted ``AHEAD`` steps early -- a segment's slot is reposted as
soon as its add has read it -- into reused buffers (reduce-scatter) or straight into the
tensor (all-gather): no data is copied in Python. Tags tell the segments of a step apart.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import check_same_size, flat_view, group_info, reduce_op_name
from .schedule import chunk_bounds

# A chunk is split into segments of about this many bytes (at most MAX_SEGMENTS of them):
# small enough to overlap sends with adds, large enough that per-message costs stay small.
# Chosen with `python -m dpcourse.bench collectives`.
SEGMENT_BYTES = 1 << 20
MAX_SEGMENTS = 8
# Receives are posted this many steps ahead (two, like Gloo's own ring): on Gloo's TCP
# transport a send's data leaves only once the receiver has posted its receive, so a
# receive posted early lets the neighbour's send go out the moment it is made.
AHEAD = 2


def _segments(lo: int, hi: int, itemsize: int) -> list[tuple[int, int]]:
    """Segment bounds (elements) of chunk [lo, hi); both ring neighbours compute the same."""
    count = max(1, min(MAX_SEGMENTS, -(-(hi - lo) * itemsize // SEGMENT_BYTES), hi - lo))
    return [(lo + a, lo + b) for a, b in chunk_bounds(hi - lo, count)]


_SCRATCH: dict = {}  # (dtype, device) -> buffer reused by later calls on this rank


def _scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A receive buffer of ``numel`` elements, kept between calls: a fresh large buffer
    costs a page fault per 4 KiB the first time it is written, as much as the add itself."""
    key = (like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


class _Ring:
    """One rank's view of the ring for one call: neighbours, chunks, messages in flight."""

    def __init__(self, flat, group, rank, world_size, trace):
        self.flat, self.group, self.rank, self.n = flat, group, rank, world_size
        self.right, self.left = (rank + 1) % world_size, (rank - 1) % world_size
        self.bounds = chunk_bounds(flat.numel(), world_size)
        self.segs = [_segments(lo, hi, flat.element_size()) for lo, hi in self.bounds]
        self.trace = trace
        self.sends: dict[tuple[int, int], object] = {}  # (chunk, segment) -> send in flight
        self.tag = 0

    def chunk(self, c):
        lo, hi = self.bounds[c]
        return self.flat[lo:hi]

    def send(self, phase, step, c, j):
        """Post segment j of chunk c to the right-hand neighbour (tags: one per message)."""
        lo, hi = self.segs[c][j]
        self.sends[c, j] = dist.isend(self.flat[lo:hi], group=self.group, group_dst=self.right,
                                      tag=self._tag(step, j))
        if self.trace is not None and j == len(self.segs[c]) - 1:
            self.trace.sent(phase, step, self.rank, self.right, c, self.chunk(c))

    def recv(self, step, c, j, into):
        self.wait_send(c, j)  # never overwrite a segment that is still being sent
        return dist.irecv(into, group=self.group, group_src=self.left, tag=self._tag(step, j))

    def _tag(self, step, j):
        return step * MAX_SEGMENTS + j

    def wait_send(self, c, j):
        work = self.sends.pop((c, j), None)
        if work is not None:
            work.wait()

    def wait_all(self):
        for key in list(self.sends):
            self.wait_send(*key)


def _reduce_scatter(ring: _Ring, avg: bool, then_all_gather: bool) -> None:
    """The reduce-scatter phase; with ``then_all_gather`` also posts the all-gather's first
    sends, segment by segment, as soon as the own chunk's segments are complete."""
    n, r, flat = ring.n, ring.rank, ring.flat
    cap = max(hi - lo for segs in ring.segs for lo, hi in segs)
    scratch = _scratch(AHEAD * MAX_SEGMENTS * cap, flat)
    # one bank of segment slots per step in flight: step s receives into bank s % AHEAD
    # while the adds of the steps before it still read the other banks
    slot = [[scratch[(b * MAX_SEGMENTS + j) * cap:(b * MAX_SEGMENTS + j + 1) * cap]
             for j in range(MAX_SEGMENTS)] for b in range(AHEAD)]

    def arriving(step):  # the chunk that arrives at `step`; we pass it on at step + 1
        return (r - step - 2) % n

    def post_recv(step, j):
        lo, hi = ring.segs[arriving(step)][j]
        return ring.recv(step, arriving(step), j, slot[step % AHEAD][j][:hi - lo])

    recvs = {(step, j): post_recv(step, j)
             for step in range(min(AHEAD, n - 1)) for j in range(len(ring.segs[arriving(step)]))}
    for j in range(len(ring.segs[(r - 1) % n])):
        ring.send("reduce-scatter", 0, (r - 1) % n, j)
    for s in range(n - 1):
        c, later = arriving(s), s + AHEAD  # `later`: the step whose receives go out now
        later_segs = len(ring.segs[arriving(later)]) if later <= n - 2 else 0
        for j, (lo, hi) in enumerate(ring.segs[c]):
            recvs.pop((s, j)).wait()
            flat[lo:hi].add_(slot[s % AHEAD][j][:hi - lo])
            if s < n - 2:
                ring.send("reduce-scatter", s + 1, c, j)  # this segment is complete: pass it on
            else:
                if avg:
                    flat[lo:hi].div_(n)
                if then_all_gather:
                    ring.send("all-gather", n - 1, c, j)
            if j < later_segs:  # its slot is free again
                recvs[later, j] = post_recv(later, j)
        for j in range(len(ring.segs[c]), later_segs):
            recvs[later, j] = post_recv(later, j)


def _all_gather(ring: _Ring, first_step: int, first_sent: bool) -> None:
    """The all-gather phase: receive each chunk straight into place and pass it on."""
    n, r, flat = ring.n, ring.rank, ring.flat
    if not first_sent:
        for j in range(len(ring.segs[r])):
            ring.send("all-gather", first_step, r, j)

    def arriving(s):  # chunk r-s-1 arrives at step s
        return (r - s - 1) % n

    def post_recv(s, j):
        lo, hi = ring.segs[arriving(s)][j]
        return ring.recv(first_step + s, arriving(s), j, flat[lo:hi])

    recvs = {(s, j): post_recv(s, j)
             for s in range(min(AHEAD, n - 1)) for j in range(len(ring.segs[arriving(s)]))}
    for s in range(n - 1):
        c, later = arriving(s), s + AHEAD
        later_segs = len(ring.segs[arriving(later)]) if later <= n - 2 else 0
        for j in range(len(ring.segs[c])):
            recvs.pop((s, j)).wait()
            if s < n - 2:
                ring.send("all-gather", first_step + s + 1, c, j)
            if j < later_segs:
                recvs[later, j] = post_recv(later, j)
        for j in range(len(ring.segs[c]), later_segs):
            recvs[later, j] = post_recv(later, j)


def _start(tensor, group, trace, caller, algorithm):
    flat = flat_view(tensor, caller)
    group, rank, n = group_info(group)
    check_same_size(flat, group, n, caller)
    if trace is not None:
        trace.start(algorithm, n, rank, flat)
    return flat, _Ring(flat, group, rank, n, trace)


def fast_ring_reduce_scatter(tensor: torch.Tensor, op="sum", group=None, trace=None) -> torch.Tensor:
    """``ring.ring_reduce_scatter``, pipelined: the same chunks, bytes and result (the
    returned view is this rank's reduced chunk)."""
    flat, ring = _start(tensor, group, trace, "fast_ring_reduce_scatter", "ring_reduce_scatter")
    avg = reduce_op_name(op, tensor, "fast_ring_reduce_scatter") == "avg"
    if ring.n > 1:
        _reduce_scatter(ring, avg, then_all_gather=False)
        ring.wait_all()
    if trace is not None:
        trace.finish(ring.rank, flat)
    return ring.chunk(ring.rank)


def fast_ring_all_gather(tensor: torch.Tensor, group=None, trace=None) -> torch.Tensor:
    """``ring.ring_all_gather``, pipelined: the same chunks, bytes and result; returns
    ``tensor``."""
    flat, ring = _start(tensor, group, trace, "fast_ring_all_gather", "ring_all_gather")
    if ring.n > 1:
        _all_gather(ring, 0, first_sent=False)
        ring.wait_all()
    if trace is not None:
        trace.finish(ring.rank, flat)
    return tensor


def fast_ring_all_reduce(tensor: torch.Tensor, op="sum", group=None, trace=None) -> None:
    """``ring.ring_all_reduce``, pipelined: in place, like ``dist.all_reduce(tensor)``; each
    rank sends 2(N-1)/N of the tensor's bytes. op: "sum" or "avg". trace: a ``Trace`` to fill
    (recorded as "ring_all_reduce": the same schedule)."""
    avg = reduce_op_name(op, tensor, "fast_ring_all_reduce") == "avg"
    flat, ring = _start(tensor, group, trace, "fast_ring_all_reduce", "ring_all_reduce")
    if ring.n > 1:
        _reduce_scatter(ring, avg, then_all_gather=True)
        _all_gather(ring, ring.n - 1, first_sent=True)
        ring.wait_all()
    if trace is not None:
        trace.finish(ring.rank, flat)
