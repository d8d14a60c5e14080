"""Pure parts of the collectives lab: chunks, schedules, simulator, traces, formulas, drawing."""
from __future__ import annotations

import matplotlib
import pytest
import torch

import dpcourse as dpc
from dpcourse.collectives import cost
from dpcourse.collectives.cost import bytes_sent_per_rank, num_steps
from dpcourse.collectives.ring import ring_all_reduce
from dpcourse.collectives.schedule import ALGORITHMS, algorithm_steps, chunk_bounds, simulate
from dpcourse.collectives.trace import Trace
from dpcourse.viz.ring import render_frame_png
from dpcourse.collectives.live import contributions, expected_after

matplotlib.use("Agg")
SIZES = [(n, numel) for n in (1, 2, 3, 4, 5) for numel in (0, 1, n - 1, 7, 64)]


@pytest.mark.parametrize("n, numel", SIZES)
def test_chunks_are_torch_tensor_split(n, numel):
    x = torch.arange(numel)
    assert [x[lo:hi].tolist() for lo, hi in chunk_bounds(numel, n)] == \
        [c.tolist() for c in x.tensor_split(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_every_ring_step_is_a_permutation(n):
    for sends in algorithm_steps("ring_all_reduce", n):
        assert sorted(s.src for s in sends) == list(range(n))
        assert sorted(s.dst for s in sends) == list(range(n))
        assert all(s.dst == (s.src + 1) % n for s in sends)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n, numel", SIZES)
def test_simulated_results_bytes_and_steps_match_the_formulas(algorithm, n, numel):
    g = torch.Generator().manual_seed(n * 100 + numel)
    inputs = [torch.randint(-9, 10, (numel,), generator=g) for _ in range(n)]
    trace = simulate(algorithm, n, numel, 8, inputs)
    total = sum(inputs)
    bounds = chunk_bounds(numel, n)
    for r in range(n):
        out = trace.outputs[r]
        if algorithm == "ring_reduce_scatter":
            lo, hi = bounds[r]
            assert torch.equal(out[lo:hi], total[lo:hi])
        elif algorithm == "ring_all_gather":
            assert torch.equal(out, torch.cat([inputs[k][slice(*bounds[k])] for k in range(n)]))
        else:
            assert torch.equal(out, total)
    assert trace.bytes_sent() == bytes_sent_per_rank(algorithm, n, numel, 8)
    assert trace.num_steps == num_steps(algorithm, n)
    frames = trace.frames()
    assert len(frames) == num_steps(algorithm, n) + 1
    assert all(torch.equal(a, b) for a, b in zip(frames[-1].values, trace.outputs.values()))
    assert frames[-1].bytes_sent == trace.bytes_sent()


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_volume_is_2_n_minus_1_over_n_and_holdings_end_full(n):
    numel = 60 * n
    trace = simulate("ring_all_reduce", n, numel, 4)
    assert len(trace) == 2 * n * (n - 1)
    assert set(trace.bytes_sent()) == {2 * (n - 1) * numel * 4 // n}
    everyone = frozenset(range(n))
    frames = trace.frames()
    after_rs = frames[n - 1].holding
    assert all(after_rs[r][r] == everyone for r in range(n))  # rank r owns chunk r
    assert all(h == everyone for row in frames[-1].holding for h in row)
    naive = simulate("naive_all_reduce", n, numel, 4).bytes_sent()
    assert naive[0] == (n - 1) * numel * 4 and max(naive[1:]) == numel * 4
    assert set(simulate("whole_ring_all_reduce", n, numel, 4).bytes_sent()) == {(n - 1) * numel * 4}


def test_bus_factors_and_alpha_beta():
    c = cost  # the formulas' module
    assert c.bus_factor("all_reduce", 4) == 1.5 and c.bus_factor("all_gather", 4) == 0.75
    assert c.busbw("all_reduce", 1e9, 1.0, 4) == 1.5e9
    alpha, beta = 50e-6, 1e9
    small, large = (c.ring_all_reduce_busbw(s, 4, alpha, beta) for s in (1e3, 1e9))
    assert small < 0.05 * beta and 0.99 * beta < large < beta
    assert c.ring_all_reduce_seconds(0, 4, alpha, beta) == pytest.approx(6 * alpha)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        algorithm_steps("tree", 4)
    with pytest.raises(ValueError, match="world_size must be"):
        algorithm_steps("ring_all_reduce", 0)
    with pytest.raises(ValueError, match="different calls"):
        Trace.merge([simulate("ring_all_reduce", 2, 4), simulate("ring_all_reduce", 2, 6)])
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_all_reduce(torch.ones(3))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_expected_after_follows_the_definitions(n):
    before = [10 * (r + 1) + torch.arange(2 * n) for r in range(n)]
    after = expected_after("all_to_all_single(got, t)", before)
    assert all(after[r][2 * k:2 * k + 2].tolist() == before[k][2 * r:2 * r + 2].tolist()
               for r in range(n) for k in range(n))
    who = contributions("reduce_scatter_single(part, t)", before)
    assert all(w == frozenset(range(n)) for row in who for w in row)
    small = [torch.arange(2) for _ in range(n)]
    assert contributions("gather(t, parts, dst=0)", small)[0] == [frozenset([k]) for k in range(n) for _ in range(2)]


def test_drawings_never_need_processes():
    trace = simulate("ring_all_reduce", 4, 8, 8, [torch.arange(8) * (r + 1) for r in range(4)])
    fig = dpc.viz.plot_ring_trace(trace)
    assert len([ax for ax in fig.axes if ax.patches]) == 7  # start + 6 steps
    assert render_frame_png(trace, trace.frames()[3])[:4] == b"\x89PNG"
    calls = ["broadcast(t, src=1)", "all_reduce(t)", "all_gather(parts, t)", "reduce_scatter_single(part, t)",
             "gather(t, parts, dst=0)"]
    before = [10 * (r + 1) + torch.arange(6) for r in range(3)]
    per_rank = [{} for _ in range(3)]
    for call in calls:
        for r, after in enumerate(expected_after(call, before)):
            per_rank[r][call] = (before[r], after)
    assert len(dpc.viz.draw_collectives(per_rank).subfigs) == len(calls)


def test_player_steps_and_reruns_through_its_callable():
    calls = []

    def make_trace(world_size, numel):  # the course passes a real traced run here
        calls.append((world_size, numel))
        return simulate("ring_all_reduce", world_size, numel, 8,
                        [torch.full((numel,), 1 << r) for r in range(world_size)])

    player = dpc.viz.RingPlayer(make_trace, world_size=3, numel=4)
    assert calls == [(3, 4)] and player.slider.max == 4 and player.play.max == 4
    player.slider.value = 4
    assert bytes(player.image.value).startswith(b"<svg")
    assert all(v.tolist() == [7] * 4 for v in player.frames[-1].values)
    player.world_size.value = 5
    assert calls[-1] == (5, 4) and player.slider.max == 8 and player.slider.value == 0
