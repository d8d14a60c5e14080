"""PyTorch's own collectives on real ranks: each by its definition, and the Comm observer's bytes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc
from dpcourse.collectives.cost import bytes_sent_per_rank
from dpcourse.collectives.live import expected_after
from dpcourse.collectives.ring import ring_reduce_scatter
from dpcourse.collectives.trace import Trace

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"N{n}")
def cluster(request):
    with dpc.Cluster(world_size=request.param, timeout=60) as c:
        yield c


def _tour(root):
    """On every rank: (before, after) of every collective, keyed by the call as written."""
    rank, n = dist.get_rank(), dist.get_world_size()

    def mine(k=3):
        return 10 * (rank + 1) + torch.arange(k)

    tour = {}
    t = mine()
    dist.broadcast(t, src=root)
    tour[f"broadcast(t, src={root})"] = (mine(), t)
    t = mine()
    dist.reduce(t, dst=root)
    tour[f"reduce(t, dst={root})"] = (mine(), t if rank == root else None)
    t = mine()
    dist.all_reduce(t)
    tour["all_reduce(t)"] = (mine(), t)
    parts = [torch.zeros(3, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(parts, mine())
    tour["all_gather(parts, t)"] = (mine(), torch.cat(parts))
    part = torch.zeros(3, dtype=torch.int64)
    dist.reduce_scatter_tensor(part, mine(3 * n))
    tour["reduce_scatter_tensor(part, t)"] = (mine(3 * n), part)
    got = torch.zeros(n, dtype=torch.int64)
    dist.all_to_all_single(got, mine(n))
    tour["all_to_all_single(got, t)"] = (mine(n), got)
    parts = [torch.zeros(3, dtype=torch.int64) for _ in range(n)] if rank == root else None
    dist.gather(mine(), parts, dst=root)
    tour[f"gather(t, parts, dst={root})"] = (mine(), torch.cat(parts) if parts else None)
    part = torch.zeros(3, dtype=torch.int64)
    dist.scatter(part, list(mine(3 * n).chunk(n)) if rank == root else None, src=root)
    tour[f"scatter(part, pieces, src={root})"] = (mine(3 * n) if rank == root else None, part)
    return tour


@pytest.mark.parametrize("root", [0, 1])
def test_every_collective_matches_its_definition(cluster, root):
    tour = cluster.run(_tour, root)
    for call in tour[0]:
        before, after = [r[call][0] for r in tour], [r[call][1] for r in tour]
        for got, want in zip(after, expected_after(call, before)):
            assert (got is None) == (want is None), call
            if got is not None:
                assert torch.equal(got, want), (call, got, want)


def test_a_wrong_call_text_is_named():
    with pytest.raises(ValueError, match="not a torch.distributed collective call: 'allreduce"):
        expected_after("allreduce(t)", [torch.ones(1)])
    with pytest.raises(ValueError, match="root 3 of 'broadcast"):
        expected_after("broadcast(t, src=3)", [torch.ones(1)] * 2)


NUMEL = 60 * 4096  # 960 KiB of float32, divisible by 2, 3, 4, 5


def _each_collective():
    n, x = dist.get_world_size(), torch.ones(NUMEL)
    dist.all_reduce(x.clone())
    dist.reduce_scatter(torch.empty(NUMEL // n), list(x.clone().chunk(n)))
    dist.all_gather([torch.empty(NUMEL // n) for _ in range(n)], x[:NUMEL // n].clone())
    trace = Trace()
    ring_reduce_scatter(x.clone(), trace=trace)
    return sum(t.nbytes for t in trace.transfers)


def test_comm_observer_gloo_reduce_scatter_sends_like_all_reduce_ours_half(cluster):
    """Logical bytes: what the c10d ops were asked to move, as a ring moves them. On the wire
    (measured with per-collective steps): Gloo's reduce_scatter moves what its all_reduce moves,
    our ring reduce-scatter (N-1)/N."""
    n, size = cluster.world_size, NUMEL * 4
    comm = dpc.observe.Comm()
    traced = cluster.run(_each_collective, observe=[comm])
    for rank in range(n):
        records = comm.records(rank)
        collectives = [r.collective for r in records if r.collective not in ("send", "recv")]
        assert collectives[:3] == ["all_reduce", "reduce_scatter", "all_gather"]
        logical = {r.collective: r.logical_sent for r in records[:3]}
        assert logical == {"all_reduce": round(2 * (n - 1) / n * size), "reduce_scatter": round((n - 1) / n * size),
                           "all_gather": round((n - 1) / n * size)}
        sends = [r for r in records if r.collective == "send"]
        assert sum(r.nbytes for r in sends) == traced[rank]
        assert traced[rank] == bytes_sent_per_rank("ring_reduce_scatter", n, NUMEL, 4)[rank]
        assert all(r.end is not None and r.end >= r.start for r in records[:3])


def _wire_of(what):
    n, x = dist.get_world_size(), torch.ones(NUMEL)
    model = torch.nn.Linear(1, 1)  # one optimizer step per collective: the observer splits by step
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for name in what:
        if name == "all_reduce":
            dist.all_reduce(x.clone())
        elif name == "reduce_scatter":
            dist.reduce_scatter(torch.empty(NUMEL // n), list(x.clone().chunk(n)))
        elif name == "ring_reduce_scatter":
            ring_reduce_scatter(x.clone())
        dist.barrier()  # every message written before the step ends
        opt.step()


def test_wire_bytes_per_step_show_gloos_reduce_scatter(cluster):
    n, size = cluster.world_size, NUMEL * 4
    comm = dpc.observe.Comm()
    what = ["all_reduce", "reduce_scatter", "ring_reduce_scatter"]
    cluster.run(_wire_of, what, observe=[comm])
    for rank in range(n):
        wire = dict(zip(what, (comm.wire(rank, step) for step in range(3))))
        assert wire["all_reduce"] == pytest.approx(2 * (n - 1) / n * size, rel=0.03)
        assert wire["reduce_scatter"] == pytest.approx(wire["all_reduce"], rel=0.05)
        assert wire["ring_reduce_scatter"] == pytest.approx((n - 1) / n * size, rel=0.03)


def test_observers_are_checked_before_anything_runs(cluster):
    with pytest.raises(TypeError, match="observe= takes observers"):
        cluster.run(lambda: None, observe=[object()])
    with pytest.raises(RuntimeError, match="nothing observed yet"):
        dpc.observe.Comm().bytes()
