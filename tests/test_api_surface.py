"""What PyTorch's distributed tutorials do, run unchanged on the notebook's ranks.

The pool tracks every call a rank makes (so a hang names its collective) and checks what a
call leaves in flight; neither may change what a ``torch.distributed`` function accepts or
returns. Each test runs its calls several times in a row on one generation of ranks, on 2 and
on 3 ranks, and checks the values against what one process computes, and that the ranks
were kept (same PIDs): a cluster restarted behind the learner's back would hide a bug.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def cluster(request):
    with dpc.Cluster(request.param) as c:
        yield c


def kept(cluster, fn, *args, rounds: int = 3):
    """``cluster.run(fn, *args)`` ``rounds`` times; every round's results, and the ranks kept."""
    pids = cluster.pids
    results = [cluster.run(fn, *args, timeout=30) for _ in range(rounds)]
    assert cluster.pids == pids, "the ranks were restarted after a call that left nothing in flight"
    return results


# --- point-to-point ------------------------------------------------------------------------

def ping_pong():
    """The "Writing Distributed Applications" ping-pong: blocking send, recv, send."""
    rank, t = dist.get_rank(), torch.zeros(1)
    returned = []
    if rank == 0:
        t += 1
        returned.append(dist.send(t, dst=1))
        returned.append(dist.recv(t, src=1))
        returned.append(dist.send(t, dst=1))
    elif rank == 1:
        returned.append(dist.recv(t, src=0))
        t += 1
        returned.append(dist.send(t, dst=0))
        returned.append(dist.recv(t, src=0))
    return t.item(), returned


def test_blocking_ping_pong_returns_what_torch_returns(cluster):
    for values in kept(cluster, ping_pong):
        assert values[0] == (2.0, [None, 1, None])  # recv returns the sender's rank
        assert values[1] == (2.0, [0, None, 0])
        assert all(v == (0.0, []) for v in values[2:])


def ring_isend_irecv():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(3)
    send = dist.isend(torch.full((3,), float(rank)), (rank + 1) % n)
    recv = dist.irecv(out, (rank - 1) % n)
    works_ok = all(isinstance(w, dist.Work) for w in (send, recv))
    send.wait(), recv.wait()
    return out.tolist(), works_ok


def test_isend_irecv_return_works(cluster):
    n = cluster.world_size
    for values in kept(cluster, ring_isend_irecv):
        assert values == [([float((r - 1) % n)] * 3, True) for r in range(n)]


def ring_batch():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(2)
    ops = [dist.P2POp(dist.isend, torch.tensor([rank, 10.0 * rank]), (rank + 1) % n),
           dist.P2POp(dist.irecv, out, (rank - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out.tolist()


def test_batch_isend_irecv(cluster):
    n = cluster.world_size
    for values in kept(cluster, ring_batch):
        assert values == [[float((r - 1) % n), 10.0 * ((r - 1) % n)] for r in range(n)]


def from_any_source():
    """Rank 0 receives one message from every other rank, in whatever order they arrive:
    first with blocking recv, then (after a barrier) with irecv."""
    rank, n = dist.get_rank(), dist.get_world_size()
    t, senders = torch.zeros(1), []
    if rank == 0:
        for _ in range(n - 1):
            senders.append((dist.recv(t), t.item()))  # src=None: any rank; returns the sender
    else:
        dist.send(torch.tensor([float(rank)]), 0)
    dist.barrier()
    if rank != 0:
        dist.send(torch.tensor([100.0 + rank]), 0)
        return None
    works = []
    for _ in range(n - 1):
        buf = torch.zeros(1)
        works.append((dist.irecv(buf), buf))  # irecv(src=None)
    for work, _ in works:
        work.wait()
    return sorted(senders), sorted(buf.item() for _, buf in works)


def test_receives_from_any_source(cluster):
    n = cluster.world_size
    for values in kept(cluster, from_any_source):
        assert values[0] == ([(r, float(r)) for r in range(1, n)], [100.0 + r for r in range(1, n)])
        assert values[1:] == [None] * (n - 1)


# --- collectives ---------------------------------------------------------------------------

def rooted_collectives():
    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.reduce(t, dst=0)
    gathered = [torch.zeros(1) for _ in range(n)] if rank == 0 else None
    dist.gather(torch.tensor([rank * 2.0]), gathered, dst=0)
    part = torch.zeros(2)
    dist.scatter(part, [torch.tensor([r, -r], dtype=torch.float) for r in range(n)] if rank == n - 1 else None,
                 src=n - 1)
    everyone = torch.zeros(n)
    dist.all_to_all_single(everyone, torch.arange(n, dtype=torch.float) + 10 * rank)
    mine = torch.zeros(1)
    dist.reduce_scatter_tensor(mine, torch.ones(n) * (rank + 1))
    return (t.item() if rank == 0 else None, [g.item() for g in gathered] if gathered else None,
            part.tolist(), everyone.tolist(), mine.item())


def test_reduce_gather_scatter_all_to_all(cluster):
    n = cluster.world_size
    for values in kept(cluster, rooted_collectives):
        assert values[0][0] == sum(range(1, n + 1))
        assert values[0][1] == [2.0 * r for r in range(n)]
        for r, (_, gathered, part, everyone, mine) in enumerate(values):
            assert part == [float(r), float(-r)]
            assert everyone == [float(r + 10 * s) for s in range(n)]
            assert mine == sum(range(1, n + 1))
            assert r == 0 or gathered is None


def object_collectives():
    rank, n = dist.get_rank(), dist.get_world_size()
    everyone = [None] * n
    dist.all_gather_object(everyone, {"rank": rank, "text": "x" * rank})
    box = [f"from {rank}", rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(box, src=0)
    gathered = [None] * n if rank == 1 else None
    dist.gather_object(("g", rank), gathered, dst=1)
    out = [None]
    dist.scatter_object_list(out, [f"to {r}" for r in range(n)] if rank == 0 else None, src=0)
    return everyone, box, gathered, out[0]


def test_object_collectives(cluster):
    n = cluster.world_size
    for values in kept(cluster, object_collectives):
        for r, (everyone, box, gathered, out) in enumerate(values):
            assert everyone == [{"rank": s, "text": "x" * s} for s in range(n)]
            assert box == ["from 0", 0] and out == f"to {r}"
            assert gathered == ([("g", s) for s in range(n)] if r == 1 else None)


def subgroups():
    """``new_group`` on every rank; only its members use it (the rest skip, as PyTorch asks)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 1])
    evens = dist.new_group(list(range(0, n, 2)))
    t = torch.tensor([float(rank + 1)])
    if rank in (0, 1):
        dist.all_reduce(t, group=pair)
        peer = dist.get_global_rank(pair, 1 - dist.get_group_rank(pair, rank))
        got = torch.zeros(1)
        if rank == 0:
            dist.send(t * 10, group_dst=1, group=pair)
            dist.recv(got, src=peer, group=pair)
        else:
            dist.recv(got, group_src=0, group=pair)
            dist.send(got + 1, dst=peer, group=pair)
        pair_value = (t.item(), got.item())
    else:
        pair_value = None
    e = torch.ones(1)
    if rank % 2 == 0:
        dist.all_reduce(e, group=evens)
    dist.destroy_process_group(pair)
    dist.destroy_process_group(evens)
    return pair_value, e.item()


def test_new_group_subgroups(cluster):
    n = cluster.world_size
    evens = len(range(0, n, 2))
    for values in kept(cluster, subgroups):
        assert values[0] == ((3.0, 31.0), float(evens))
        assert values[1] == ((3.0, 30.0), 1.0)
        assert all(v == (None, float(evens)) for v in values[2:])


def barriers():
    dist.barrier()
    dist.monitored_barrier(timeout=__import__("datetime").timedelta(seconds=20))
    work = dist.barrier(async_op=True)
    work.wait()
    return "ok"


def test_barrier_and_monitored_barrier(cluster):
    for values in kept(cluster, barriers):
        assert values == ["ok"] * cluster.world_size


def test_a_hang_in_recv_is_still_named(cluster):
    def stuck():
        if dist.get_rank() == 0:
            dist.recv(torch.zeros(1), src=1)  # nobody sends

    with pytest.raises(dpc.RankTimeout) as err:
        cluster.run(stuck, timeout=2)
    assert "rank 0 waiting in the 1st recv of this call" in str(err.value)
    assert cluster.run(ring_isend_irecv, timeout=20)  # and the restarted ranks work


# --- a call that leaves something in flight ------------------------------------------------

def send_then_raise():
    if dist.get_rank() == 0:
        dist.isend(torch.ones(1), 1)  # never received: rank 1 raises first
    raise RuntimeError("boom")


def exchange():
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(1)
    works = [dist.isend(torch.tensor([float(rank)]), (rank + 1) % n), dist.irecv(out, (rank - 1) % n)]
    for w in works:
        w.wait()
    return out.item()


def test_a_failed_call_with_a_message_in_flight_restarts_the_ranks(cluster):
    n = cluster.world_size
    pids = cluster.pids
    with pytest.raises(dpc.RankError) as err:
        cluster.run(send_then_raise)
    text = str(err.value)
    assert "rank 0 sent 1 message to rank 1 that rank 1 did not receive" in text
    assert "So the ranks were restarted" in text and err.value.restarted
    assert err.value.in_flight == ["rank 0 sent 1 message to rank 1 that rank 1 did not receive"]
    start = time.monotonic()
    assert cluster.run(exchange, timeout=20) == [float((r - 1) % n) for r in range(n)]
    assert cluster.pids != pids
    assert time.monotonic() - start < 10  # it returns at once (the poisoned ranks hung 30 s)


def test_a_failed_call_with_nothing_in_flight_keeps_the_ranks(cluster):
    def fail_after_exchange():
        exchange()
        raise ValueError("after the exchange")

    pids = cluster.pids
    with pytest.raises(dpc.RankError) as err:
        cluster.run(fail_after_exchange)
    assert "nothing of the call is in flight, so the ranks were kept" in str(err.value)
    assert not err.value.restarted and cluster.pids == pids


def test_a_call_that_returns_with_a_receive_waiting_says_so_and_keeps_the_ranks(cluster, capfd):
    def post_and_return():
        if dist.get_rank() == 1:
            dist.irecv(torch.zeros(1), src=0)  # posted, never matched, never waited
        return "returned"

    pids = cluster.pids
    assert cluster.run(post_and_return) == ["returned"] * cluster.world_size
    err = capfd.readouterr().err
    assert "the call returned, but rank 1 waits for 1 message from rank 0 that rank 0 did not send" in err
    assert "cluster.restart() drops it" in err
    assert cluster.pids == pids  # a call that returned keeps its ranks: the next may mean to match it
    cluster.restart()  # drop it: the next test starts clean
    assert cluster.run(exchange, timeout=20)
    assert "in flight" not in capfd.readouterr().err


def test_a_message_sent_in_one_cell_is_received_in_the_next(cluster, capfd):
    """Cell by cell, as a learner may write it in %%ranks cells (the Work kept in the cell's
    namespace: a dropped Gloo Work cancels its send): the kernel counts over calls, so the
    second cell balances the first and nothing is reported (or restarted) after it."""
    pids = cluster.pids
    cluster.run_cell("if rank == 0:\n    req = dist.isend(torch.tensor([42.0]), 1)")
    assert "rank 0 sent 1 message to rank 1 that rank 1 did not receive" in capfd.readouterr().err
    got = cluster.run_cell("t = torch.zeros(1)\nif rank == 1:\n    dist.recv(t, 0)\nt.item()", timeout=20)
    assert got[1] == 42.0
    assert "dpcourse:" not in capfd.readouterr().err
    assert cluster.pids == pids
    with pytest.raises(dpc.RankError) as err:  # balanced: a later failure keeps the ranks
        cluster.run_cell("1 / 0")
    assert not err.value.restarted and cluster.pids == pids


def test_a_collective_issued_on_one_rank_only_is_reported(cluster, capfd):
    def lone_all_reduce():
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1), async_op=True)  # the others never join it

    cluster.run(lone_all_reduce)
    said = ", ".join(f"rank {r} {int(r == 0)}" for r in range(cluster.world_size))
    assert f"on the default group the ranks issued different numbers of collectives ({said})" \
        in capfd.readouterr().err
    with pytest.raises(dpc.RankError) as err:  # a failure now restarts: a collective is pending
        cluster.run(lambda: 1 / 0)
    assert err.value.restarted and "different numbers of collectives" in str(err.value)
    t = cluster.run(lambda: (dist.all_reduce(x := torch.ones(1)), x.item())[1], timeout=20)
    assert t == [float(cluster.world_size)] * cluster.world_size
