"""Our collectives on real ranks (N = 1..5) against PyTorch's, their traces, and misuse.

Both rings run every check: the plain one of ``ring.py`` (the one the course shows) and the
pipelined one of ``fast_ring.py`` (the benchmark's)."""
from __future__ import annotations

import ast
import inspect
import time

import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc
from dpcourse.collectives import fast_ring, ring
from dpcourse.collectives.cost import bytes_sent_per_rank, num_steps
from dpcourse.collectives.fast_ring import fast_ring_all_gather, fast_ring_all_reduce, fast_ring_reduce_scatter
from dpcourse.collectives.naive import naive_all_reduce, whole_ring_all_reduce
from dpcourse.collectives.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from dpcourse.collectives.schedule import chunk_bounds, simulate
from dpcourse.collectives.trace import Trace

pytestmark = pytest.mark.timeout(180)
NUMELS = (0, 1, 2, 3, 7, 100, 1001)
DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32)
# (all_reduce, reduce_scatter, all_gather) of each ring
RINGS = {"plain": (ring_all_reduce, ring_reduce_scatter, ring_all_gather),
         "fast": (fast_ring_all_reduce, fast_ring_reduce_scatter, fast_ring_all_gather)}


# 4 and 5 ranks in the full suite only: 1 to 3 already hold an odd ring and an uneven split
@pytest.fixture(scope="module", params=[1, 2, 3, pytest.param(4, marks=pytest.mark.slow),
                                        pytest.param(5, marks=pytest.mark.slow)], ids=lambda n: f"N{n}")
def cluster(request):
    with dpc.Cluster(world_size=request.param, timeout=60) as c:
        yield c


def _input(rank, numel, dtype, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)  # integer-valued


def _compare_with_pytorch(which):
    """On every rank: each of our collectives vs PyTorch's on the same data, bitwise
    (``which`` ring; the plain run also checks the naive all-reduces)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    ring_all_reduce, ring_reduce_scatter, ring_all_gather = RINGS[which]
    all_reduces = (ring_all_reduce,) + ((naive_all_reduce, whole_ring_all_reduce)
                                        if which == "plain" else ())
    bad = []
    for numel in NUMELS + (n - 1,):
        for dtype in DTYPES:
            x = _input(rank, numel, dtype)
            want = x.clone()
            dist.all_reduce(want)
            for fn in all_reduces:
                got = x.clone()
                fn(got)
                if not torch.equal(got, want):
                    bad.append(f"{fn.__name__} numel={numel} {dtype}")
            lo, hi = chunk_bounds(numel, n)[rank]
            mine = torch.empty(hi - lo, dtype=dtype)  # Gloo's list form takes uneven chunks
            dist.reduce_scatter(mine, list(x.tensor_split(n)))
            if not torch.equal(ring_reduce_scatter(x.clone()), mine):
                bad.append(f"ring_reduce_scatter numel={numel} {dtype}")
            everyone = [_input(r, numel, dtype) for r in range(n)]
            expected = torch.cat([everyone[r][slice(*chunk_bounds(numel, n)[r])] for r in range(n)])
            if not torch.equal(ring_all_gather(x.clone()), expected):
                bad.append(f"ring_all_gather numel={numel} {dtype}")
            if numel % n == 0 and numel:
                gathered = [torch.empty(numel // n, dtype=dtype) for _ in range(n)]
                dist.all_gather(gathered, x.tensor_split(n)[rank].contiguous())
                if not torch.equal(torch.cat(gathered), expected):
                    bad.append(f"dist.all_gather disagrees numel={numel} {dtype}")
        x = torch.randn(numel + 5, generator=torch.Generator().manual_seed(rank))
        want, got = x.clone(), x.clone()
        dist.all_reduce(want, op=dist.ReduceOp.AVG)
        ring_all_reduce(got, op="avg")
        if not torch.allclose(got, want, rtol=1e-6, atol=1e-6):
            bad.append(f"avg numel={numel}")
    matrix = _input(rank, 24, torch.float32).view(4, 6)  # any shape: flattened in place
    want = matrix.clone()
    dist.all_reduce(want)
    ring_all_reduce(matrix, op=dist.ReduceOp.SUM)
    if not torch.equal(matrix, want):
        bad.append("2-D tensor")
    return bad


@pytest.mark.parametrize("which", RINGS)
def test_every_variant_equals_pytorch_bitwise(cluster, which):
    assert cluster.run(_compare_with_pytorch, which) == [[]] * cluster.world_size


def _compare_in_small_segments(which, segment_bytes):
    """Like _compare_with_pytorch, on more sizes, with a trace. For the fast ring, with
    segments of a few bytes, so that every chunk travels in several segments (up to
    MAX_SEGMENTS, and neighbouring chunks in different numbers) and the receives posted steps
    ahead, with their reused slots, are all exercised. (The plain ring has no segments.)"""
    rank, n = dist.get_rank(), dist.get_world_size()
    ring_all_reduce, ring_reduce_scatter, ring_all_gather = RINGS[which]
    saved = fast_ring.SEGMENT_BYTES
    fast_ring.SEGMENT_BYTES = segment_bytes or saved
    bad = []
    try:
        for numel in (5, 7, 29, 64, 257, 1001):
            bounds = chunk_bounds(numel, n)
            x = _input(rank, numel, torch.int64, seed=2)
            want = x.clone()
            dist.all_reduce(want)
            got = x.clone()
            trace = Trace()
            ring_all_reduce(got, trace=trace)
            if not torch.equal(got, want):
                bad.append(f"ring_all_reduce numel={numel}")
            if trace.bytes_sent()[rank] != bytes_sent_per_rank("ring_all_reduce", n, numel, 8)[rank]:
                bad.append(f"bytes numel={numel}")
            if not torch.equal(ring_reduce_scatter(x.clone()), want[slice(*bounds[rank])]):
                bad.append(f"ring_reduce_scatter numel={numel}")
            mine = want.clone()
            for r in range(n):
                if r != rank:
                    mine[slice(*bounds[r])] = -1  # must be overwritten by rank r's chunk
            if not torch.equal(ring_all_gather(mine), want):
                bad.append(f"ring_all_gather numel={numel}")
            y = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
            want_avg, got_avg = y.clone(), y.clone()
            dist.all_reduce(want_avg, op=dist.ReduceOp.AVG)
            ring_all_reduce(got_avg, op="avg")
            if not torch.allclose(got_avg, want_avg, rtol=1e-6, atol=1e-6):
                bad.append(f"avg numel={numel}")
    finally:
        fast_ring.SEGMENT_BYTES = saved
    return bad


@pytest.mark.parametrize("which, segment_bytes",
                         [("plain", None), ("fast", 8), ("fast", 24), ("fast", 200)])
def test_many_segments_per_chunk_equal_pytorch(cluster, which, segment_bytes):
    out = cluster.run(_compare_in_small_segments, which, segment_bytes)
    assert out == [[]] * cluster.world_size


def _traced(which, algorithm, numel):
    fns = dict(zip(("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather"), RINGS[which]))
    fns.update(naive_all_reduce=naive_all_reduce, whole_ring_all_reduce=whole_ring_all_reduce)
    trace = Trace(record_values=True)
    fns[algorithm](_input(dist.get_rank(), numel, torch.int64, seed=1), trace=trace)
    return trace


@pytest.mark.parametrize("which", RINGS)
@pytest.mark.parametrize("numel", [0, 2, 13, 3000])
def test_traces_equal_simulator_and_formulas(cluster, numel, which):
    n = cluster.world_size
    inputs = [_input(r, numel, torch.int64, seed=1) for r in range(n)]
    algorithms = ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather"]
    for algorithm in algorithms + (["naive_all_reduce", "whole_ring_all_reduce"]
                                   if which == "plain" else []):
        trace = Trace.merge(cluster.run(_traced, which, algorithm, numel))
        sim = simulate(algorithm, n, numel, 8, inputs)
        assert trace.transfers == sim.transfers, algorithm  # step, src, dst, chunk, bytes
        assert all(torch.equal(a.values, b.values) for a, b in zip(trace.transfers, sim.transfers))
        assert trace.bytes_sent() == bytes_sent_per_rank(algorithm, n, numel, 8)
        assert trace.num_steps == num_steps(algorithm, n)
        if algorithm.startswith("ring"):
            assert len(trace) == n * num_steps(algorithm, n)
        last = trace.frames()[-1]
        assert all(torch.equal(last.values[r], trace.outputs[r]) for r in range(n))
        assert all(torch.equal(trace.outputs[r], sim.outputs[r]) for r in range(n))


def test_traced_run_ends_equal_to_dist_all_reduce(cluster):
    run = dpc.collectives.trace_all_reduce(cluster, numel=10)
    assert all(torch.equal(v, ref) for v, ref in zip(run.trace.frames()[-1].values, run.reference))
    assert sum(run.trace.bytes_sent()) == 2 * (cluster.world_size - 1) * 10 * 8
    # the ranks ran the plain ring, the function the course prints
    assert run.function == "dpcourse.collectives.ring.ring_all_reduce"
    assert dpc.collectives.traced.qualified_name(ring_all_reduce) == run.function


def _mismatched(which, kind):
    rank = dist.get_rank()
    numel = 10 + (rank == 1) if kind == "numel" else 10
    dtype = torch.int64 if kind == "dtype" and rank == 1 else torch.float32
    RINGS[which][0](torch.ones(numel, dtype=dtype))


@pytest.mark.parametrize("which", RINGS)
@pytest.mark.parametrize("kind", ["numel", "dtype"])
def test_mismatched_tensors_raise_on_every_rank_instead_of_hanging(cluster, kind, which):
    n = cluster.world_size
    if n == 1:
        pytest.skip("needs two ranks")
    start = time.monotonic()
    with pytest.raises(dpc.RankError) as info:
        cluster.run(_mismatched, which, kind, timeout=20)
    assert time.monotonic() - start < 10
    assert set(info.value.failures) == set(range(n))
    message = str(info.value.failures[0].exception)
    assert isinstance(info.value.failures[0].exception, ValueError)
    if kind == "numel":
        assert "rank 0: 10 elements of float32, rank 1: 11 elements of float32" in message
    else:
        assert "rank 1: 10 elements of int64" in message
    assert "same number of elements and dtype on every rank" in message


def _bad_arguments(which):
    ring_all_reduce = RINGS[which][0]
    errors = []
    for call in (lambda: ring_all_reduce(torch.ones(4), op="max"),
                 lambda: ring_all_reduce(torch.ones(4, dtype=torch.int64), op="avg"),
                 lambda: ring_all_reduce(torch.ones(4, 4).t()),
                 lambda: naive_all_reduce(torch.ones(4), root=99)):
        try:
            call()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


@pytest.mark.parametrize("which", RINGS)
def test_bad_arguments_are_named(cluster, which):
    op, avg_int, strided, root = cluster.run(_bad_arguments, which)[0]
    assert f"{RINGS[which][0].__name__} supports op='sum' or op='avg'" in op and "'max'" in op
    assert "needs a floating-point tensor" in avg_int
    assert "contiguous" in strided
    assert "root must be a rank" in root


def _in_subgroup(which):
    rank, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(0, n, 2)))  # every rank must call new_group
    if rank % 2:
        return None
    x = _input(rank, 33, torch.int64)
    want = x.clone()
    dist.all_reduce(want, group=group)
    trace = Trace()
    RINGS[which][0](x, group=group, trace=trace)
    return torch.equal(x, want), trace.world_size


@pytest.mark.parametrize("which", RINGS)
def test_ring_on_a_subgroup(cluster, which):
    n = cluster.world_size
    if n < 3:
        pytest.skip("needs a proper subgroup of two or more ranks")
    out = cluster.run(_in_subgroup, which)
    assert out[0::2] == [(True, len(range(0, n, 2)))] * len(range(0, n, 2))


def _subgroup_all_reduce():
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dist.all_reduce(torch.ones(8), group=pairs[dist.get_rank() // 2])


def test_comm_counts_a_subgroup_collective_with_the_subgroup_size(cluster4):
    # 8 floats all-reduced among 2 ranks: each sends 2(2-1)/2 * 32 bytes, not 2(4-1)/4 * 32.
    comm = dpc.observe.Comm()
    cluster4.run(_subgroup_all_reduce, observe=[comm])
    for rank in range(4):
        seen = [(r.collective, r.world_size, r.logical_sent, r.group_ranks) for r in comm.records(rank)
                if r.collective == "all_reduce"]
        assert seen == [("all_reduce", 2, 32, (0, 1) if rank < 2 else (2, 3))]


# --- the teaching ring stays plain: what the course prints fits one screen ------------------
PRINTED = (ring.ring_all_reduce, ring.reduce_scatter_phase, ring.all_gather_phase)


def _calls(node) -> list[str]:
    """Dotted names of the functions called inside ``node``, e.g. "dist.isend"."""
    return [ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)]


def test_the_printed_ring_fits_one_screen():
    lines = {fn.__name__: len(inspect.getsource(fn).splitlines()) for fn in PRINTED}
    assert all(n <= 40 for n in lines.values()), lines
    assert sum(lines.values()) <= 60, lines  # all three printed together: one screen
    assert "reduce_scatter_phase" in _calls(ast.parse(inspect.getsource(ring.ring_all_reduce)))
    assert "all_gather_phase" in _calls(ast.parse(inspect.getsource(ring.ring_all_reduce)))


@pytest.mark.parametrize("phase, schedule",
                         [(ring.reduce_scatter_phase, "ring_reduce_scatter_steps"),
                          (ring.all_gather_phase, "ring_all_gather_steps")])
def test_each_ring_step_is_one_send_one_receive_and_a_wait(phase, schedule):
    tree = ast.parse(inspect.getsource(phase))
    loops = [node for node in ast.walk(tree) if isinstance(node, (ast.For, ast.While))]
    assert len(loops) == 1, "one loop: one iteration per step of the schedule"
    assert _calls(loops[0].iter)[0] == schedule  # the simulator's schedule, walked as it is
    calls = _calls(loops[0])
    assert calls.count("dist.isend") == 1 and calls.count("dist.irecv") == 1
    assert calls.count("send.wait") == calls.count("recv.wait") == 1
    assert not any(name.startswith(("time.", "torch.cuda")) for name in calls)  # no timing
