"""The observers watch from outside and change nothing: the same function, observed or not,
computes the same weights; every hook and wrapper an observer installs is gone after the
call; and what they report agrees with the formulas.

HYBRID_SHARD on 4 ranks is the case that once went wrong: a helper thread that waited on
Gloo's reduce-scatter work ran its reduction a second time and corrupted the gradients.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dpcourse as dpc

pytestmark = pytest.mark.timeout(240)
STEPS, BATCH = 3, 4


def _train_hsdp(shape):
    """FSDP2 on a 2-D mesh (replicate x shard), a few AdamW steps; the full weights after."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, n = dist.get_rank(), dist.get_world_size()
    model = dpc.models.build_model("mlp", seed=0)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = dpc.models.make_dataset("mlp", STEPS * BATCH * n).tensors
    for step in range(STEPS):
        rows = slice((step * n + rank) * BATCH, (step * n + rank + 1) * BATCH)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _what_is_installed():
    """Global module hooks, optimizer hooks and the point-to-point functions, on a rank."""
    from torch.nn.modules import module
    from torch.optim import optimizer

    return (len(module._global_forward_pre_hooks), len(module._global_forward_hooks),
            len(optimizer._global_optimizer_pre_hooks), len(optimizer._global_optimizer_post_hooks),
            tuple(getattr(dist, f).__module__ for f in ("send", "recv", "isend", "irecv")))


def test_observed_hybrid_training_equals_unobserved_and_leaves_nothing_installed(cluster4):
    before = cluster4.run(_what_is_installed)
    plain = cluster4.run(_train_hsdp, (2, 2))
    comm, timeline, memory = dpc.observe.Comm(), dpc.observe.Timeline(), dpc.observe.Memory()
    observed = cluster4.run(_train_hsdp, (2, 2), observe=[comm, timeline, memory])
    for mine, theirs in zip(observed, plain):
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), name   # bit for bit
    assert cluster4.run(_what_is_installed) == before
    assert before[0][:4] == (0, 0, 0, 0) and set(before[0][4]) == {"torch.distributed.distributed_c10d"}
    # what was observed is what HYBRID_SHARD sends
    mlp = dpc.models.build_model("mlp")
    theory = dpc.collectives.step_bytes("HYBRID_SHARD", 4, mlp, shard_group_size=2)
    assert comm.bytes(rank=0, step=-1) == {k: round(v) for k, v in theory.items()}
    groups = comm.groups(rank=0, step=-1)
    assert set(groups) == {(0, 1), (0, 2)} and set(groups[(0, 2)]) == {"all_reduce"}


def test_gloo_reduce_scatters_get_an_end_without_a_second_wait(cluster2):
    """Gloo's reduce-scatter work has no future and never says it completed; its end is when
    the caller's own wait() copies the result out, seen through the output's version."""
    comm, timeline = dpc.observe.Comm(), dpc.observe.Timeline()
    cluster2.run(_train_hsdp, (1, 2), observe=[comm, timeline])
    scatters = [r for r in comm.records(rank=0) if r.collective == "reduce_scatter"]
    assert scatters and all(r.end is not None and r.end >= r.start for r in scatters)
    spans = [e for e in timeline.events() if e.kind == "reduce_scatter"]
    assert len(spans) == len([r for r in comm.records(rank=0, step=-1) if r.collective == "reduce_scatter"]) * 2
    # one byte convention: the timeline's span carries the payload S Comm counts (the input)
    assert sorted(e.nbytes for e in spans if e.rank == 0) == \
        sorted(r.nbytes for r in comm.records(rank=0, step=-1) if r.collective == "reduce_scatter")


def _hooks_while_training(steps=3):
    """The rank's global hooks, counted inside a few observed training steps."""
    model = dpc.models.build_model("mlp", seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = dpc.models.make_dataset("mlp", BATCH).tensors
    for _ in range(steps):
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _what_is_installed()[:4]


def test_observers_of_one_call_share_one_step_clock(cluster2):
    """Comm and Timeline add no global hook to Memory's: one clock counts the steps for all."""
    alone = cluster2.run(_hooks_while_training, observe=[dpc.observe.Memory()])
    comm, timeline, memory = dpc.observe.Comm(), dpc.observe.Timeline(), dpc.observe.Memory()
    together = cluster2.run(_hooks_while_training, observe=[comm, timeline, memory])
    assert together == alone
    assert comm.of_rank(0)["steps"] == memory.of_rank(0)["steps"] == len(timeline.step_seconds(rank=0)) == 3


def test_a_rank_function_runs_unchanged_without_observers_and_raises_through_them(cluster2):
    def fails():
        dist.all_reduce(torch.ones(2))
        raise ValueError("the learner's bug")

    with pytest.raises(dpc.RankError, match="the learner's bug"):
        cluster2.run(fails, observe=[dpc.observe.Comm(), dpc.observe.Timeline()])
    assert cluster2.run(_what_is_installed)[0][:4] == (0, 0, 0, 0)
