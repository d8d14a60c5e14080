"""The pipelined ring of ``fast_ring.py``: its segments, its reused buffers, and that it is the
same algorithm as the plain ring (the bitwise checks against PyTorch, for both rings, are in
test_collectives.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dpcourse.collectives import fast_ring
from dpcourse.collectives.cost import bytes_sent_per_rank
from dpcourse.collectives.fast_ring import fast_ring_all_gather, fast_ring_all_reduce, fast_ring_reduce_scatter
from dpcourse.collectives.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from dpcourse.collectives.schedule import chunk_bounds
from dpcourse.collectives.trace import Trace

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("numel", [0, 1, 7, 1000, 3 * 2**20 + 5])
@pytest.mark.parametrize("itemsize", [1, 4, 8])
def test_segments_tile_the_chunk_and_stay_small(numel, itemsize):
    lo = 17
    segs = fast_ring._segments(lo, lo + numel, itemsize)
    assert segs[0][0] == lo and segs[-1][1] == lo + numel  # no gap, no overlap:
    assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
    assert 1 <= len(segs) <= fast_ring.MAX_SEGMENTS
    if len(segs) < fast_ring.MAX_SEGMENTS:  # uncapped: every segment fits SEGMENT_BYTES
        assert max(hi - a for a, hi in segs) * itemsize <= fast_ring.SEGMENT_BYTES
    assert all(hi > a for a, hi in segs) or numel == 0  # no empty segment of a full chunk


def test_scratch_buffers_are_reused_and_grow():
    like = torch.zeros(1, dtype=torch.float64)
    small = fast_ring._scratch(10, like)
    again = fast_ring._scratch(5, like)
    assert again.data_ptr() == small.data_ptr() and again.numel() == 5
    large = fast_ring._scratch(10_000, like)
    assert large.numel() == 10_000 and large.dtype == torch.float64
    other = fast_ring._scratch(10, torch.zeros(1, dtype=torch.int32))
    assert other.dtype == torch.int32  # one buffer per dtype


def _fast_equals_plain(segment_bytes):
    """Random floats (not integers): the fast ring adds in the same order as the plain ring,
    so the results are bitwise equal, and both send the same bytes per rank."""
    rank = dist.get_rank()
    saved, fast_ring.SEGMENT_BYTES = fast_ring.SEGMENT_BYTES, segment_bytes
    bad = []
    try:
        for numel in (3, 61, 1000, 4099):
            x = torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))
            pairs = ((ring_all_reduce, fast_ring_all_reduce),
                     (ring_reduce_scatter, fast_ring_reduce_scatter),
                     (ring_all_gather, fast_ring_all_gather))
            for plain, fast in pairs:
                a, b, ta, tb = x.clone(), x.clone(), Trace(), Trace()
                plain(a, trace=ta)
                fast(b, trace=tb)
                if not torch.equal(a, b) or ta.transfers != tb.transfers:
                    bad.append(f"{fast.__name__} numel={numel}")
            a, b = x.clone(), x.clone()
            ring_all_reduce(a, op="avg")
            fast_ring_all_reduce(b, op="avg")
            if not torch.equal(a, b):
                bad.append(f"avg numel={numel}")
    finally:
        fast_ring.SEGMENT_BYTES = saved
    return bad


@pytest.mark.parametrize("segment_bytes", [16, 1 << 20])
def test_fast_ring_is_the_plain_ring_bit_for_bit(cluster4, segment_bytes):
    assert cluster4.run(_fast_equals_plain, segment_bytes) == [[]] * 4


NUMEL = 3 * 2**20 + 3  # 12 MiB of float32: 3 MiB chunks, 3 segments each at the default size


def _one_ring(fn):
    fn(torch.ones(NUMEL))
    dist.barrier()  # every message written before the call ends
    return fast_ring._segments(*chunk_bounds(NUMEL, dist.get_world_size())[0], 4)


def test_segments_add_no_bytes_on_the_wire(cluster4):
    """The fast ring cuts each chunk into segments: more messages, the same payload. On the
    wire (``/proc/self/io``, as the Comm observer reads it) both rings send the formula's
    bytes, plus a little header."""
    import dpcourse as dpc

    for fn in (ring_all_reduce, fast_ring_all_reduce):
        comm = dpc.observe.Comm()
        segments = cluster4.run(_one_ring, fn, observe=[comm])
        assert len(segments[0]) > 1  # the fast ring really did cut this size into segments
        for rank in range(4):
            formula = bytes_sent_per_rank("ring_all_reduce", 4, NUMEL, 4)[rank]
            assert formula <= comm.wire(rank) <= 1.01 * formula, (fn.__name__, comm.wire(rank), formula)
