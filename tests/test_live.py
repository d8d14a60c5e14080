"""PyTorch's own collectives on real ranks: the live tour and the byte meter."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc
from dpcourse.collectives import (COLLECTIVES, Trace, bytes_sent_per_rank, expected_after,
                                  measure_bytes_sent, ring_reduce_scatter, run_collective)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"N{n}")
def cluster(request):
    with dpc.Cluster(world_size=request.param, timeout=60) as c:
        yield c


@pytest.mark.parametrize("collective", [c for c in COLLECTIVES if c != "barrier"])
def test_every_collective_live_matches_its_definition(cluster, collective):
    result = run_collective(cluster, collective, numel=3, root=1)
    want = expected_after(collective, result.before, root=1)
    for got, expected in zip(result.after, want):
        assert (got is None) == (expected is None)
        if got is not None:
            assert torch.equal(got, expected), (collective, got, expected)


def test_barrier_lets_no_rank_leave_before_the_last_arrives(cluster):
    result = run_collective(cluster, "barrier")
    last_arrival = max(b.item() for b in result.before)
    assert last_arrival >= 50 * (cluster.world_size - 1) * 0.9  # ranks arrive 50 ms apart
    assert all(a.item() >= last_arrival for a in result.after)


def test_live_input_errors(cluster):
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        run_collective(cluster, "allreduce")
    with pytest.raises(ValueError, match="root must be a rank"):
        run_collective(cluster, "broadcast", root=cluster.world_size)


NUMEL = 60 * 4096  # 960 KiB of float32, divisible by 2, 3, 4, 5


def _bytes_of_each():
    n = dist.get_world_size()
    x = torch.ones(NUMEL)
    out = {}
    out["all_reduce"] = measure_bytes_sent(dist.all_reduce, x.clone())
    out["reduce_scatter"] = measure_bytes_sent(
        dist.reduce_scatter, torch.empty(NUMEL // n), list(x.clone().chunk(n)))
    out["all_gather"] = measure_bytes_sent(
        dist.all_gather, [torch.empty(NUMEL // n) for _ in range(n)], x[:NUMEL // n].clone())
    trace = Trace()
    out["ring_reduce_scatter"] = measure_bytes_sent(ring_reduce_scatter, x.clone(), trace=trace)
    return out, sum(t.nbytes for t in trace.transfers)


def test_byte_meter_gloo_reduce_scatter_sends_like_all_reduce_ours_half(cluster):
    n, size = cluster.world_size, NUMEL * 4
    for rank, (out, traced) in enumerate(cluster.run(_bytes_of_each)):
        wire = {k: v.wire for k, v in out.items()}
        # the wire, measured: Gloo's reduce_scatter moves what its all_reduce moves ...
        assert wire["all_reduce"] == pytest.approx(2 * (n - 1) / n * size, rel=0.02)
        assert wire["reduce_scatter"] == pytest.approx(wire["all_reduce"], rel=0.05)
        assert wire["all_gather"] == pytest.approx((n - 1) / n * size, rel=0.02)
        # ... while our ring reduce-scatter sends (N-1)/N, on the wire and in its trace
        assert wire["ring_reduce_scatter"] == pytest.approx((n - 1) / n * size, rel=0.02)
        assert wire["ring_reduce_scatter"] < 0.6 * wire["reduce_scatter"]
        assert traced == bytes_sent_per_rank("ring_reduce_scatter", n, NUMEL, 4)[rank]
        # logical bytes from the c10d ops: what a bandwidth-optimal algorithm sends
        assert out["all_reduce"].logical == round(2 * (n - 1) / n * size)
        assert out["reduce_scatter"].logical == round((n - 1) / n * size)
        assert [r.collective for r in out["all_reduce"].records] == ["all_reduce"]
        sends = [r for r in out["ring_reduce_scatter"].records if r.collective == "send"]
        assert sum(r.nbytes for r in sends) == traced  # the c10d ops see what the trace says
