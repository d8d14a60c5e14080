"""Large-model practice on 2 real Gloo ranks, each property against a one-process computation."""
from __future__ import annotations

import pytest
import torch

from dpcourse import models
from dpcourse.practice import checkpointing, clipping, common, measure, meta_init, offload, prefetch

pytestmark = pytest.mark.timeout(240)
WORLD = 2
FP32 = 4


def test_meta_init_never_holds_the_whole_model_and_trains_like_one_process(cluster2):
    runs = cluster2.run(meta_init.train_from_meta, observe=measure.parameter_bytes, timeout=120)
    whole = models.MLP()
    total = sum(p.numel() for p in whole.parameters()) * FP32
    # the shards: dim 0 of every parameter split in two (this MLP splits evenly)
    shard = sum(p.numel() // WORLD for p in whole.parameters()) * FP32
    for run in runs:
        assert run["observed"] == {"built on meta": 0, "sharded": 0, "materialised": shard,
                                   "after one step": shard}
        assert shard == total // WORLD
    # init_weights keeps at most one whole parameter at a time, never the model
    assert max(p.numel() for p in whole.parameters()) * FP32 < total // 2
    got = common.assemble([r["shards"] for r in runs])
    want = meta_init.train_whole()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)


def test_init_weights_is_the_same_model_sharded_or_whole():
    torch.manual_seed(123)  # init_weights must not depend on the global generator
    a = meta_init.init_weights(models.MLP(), seed=3)
    torch.manual_seed(7)
    b = meta_init.init_weights(models.MLP(), seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        fan_in = p.shape[-1] if p.dim() == 2 else dict(a.named_parameters())[name[:-4] + "weight"].shape[1]
        assert p.abs().max() <= fan_in ** -0.5
    with pytest.raises(ValueError, match="nn.Linear only"):
        meta_init.init_weights(models.TinyTransformer())


def test_reset_parameters_on_a_cpu_mesh_repeats_rows_across_ranks(cluster2):
    shards = cluster2.run(meta_init.reset_parameter_shards, timeout=120)
    for name in shards[0]:
        assert torch.equal(shards[0][name], shards[1][name]), name  # every rank drew the same rows


def _saved_theory(checkpoint: bool, batch: int, depth: int, d_in=32, hidden=64, d_out=8) -> int:
    """Bytes autograd keeps at the end of forward for this rank's batch, counted by hand:
    a Linear keeps its input, GELU its input; the head keeps its input; MSE keeps the
    output and the target. Checkpointed blocks keep only their input."""
    per_block_inside = batch * hidden  # GELU's input
    inputs = batch * d_in + (depth - 1) * batch * hidden  # each block's input
    head = batch * hidden + 2 * batch * d_out
    inside = 0 if checkpoint else depth * per_block_inside
    return FP32 * (inputs + inside + head)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_activation_checkpointing_saves_less_and_gives_the_same_gradients(cluster2, checkpoint):
    batch, depth = 64, 8
    runs = cluster2.run(checkpointing.train_checkpointed, checkpoint, batch, depth,
                        observe=measure.SavedTensors(), timeout=120)
    for run in runs:
        assert run["observed"].peak == _saved_theory(checkpoint, batch // WORLD, depth)
        assert run["observed"].live == 0  # backward released everything
    got = common.assemble([r["grads"] for r in runs])
    want = checkpointing.whole_gradients(batch, depth)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)


def test_checkpointing_halves_what_this_mlp_keeps():
    without, with_ = _saved_theory(False, 32, 8), _saved_theory(True, 32, 8)
    assert with_ < 0.55 * without


def _where(model, optimizer):
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {"parameters": measure.bytes_by_device(model.parameters()),
            "gradients": measure.bytes_by_device(p.grad for p in model.parameters()),
            "optimizer": measure.bytes_by_device(states)}


def test_cpu_offload_runs_unpinned_and_trains_exactly_as_without(cluster2):
    on = cluster2.run(offload.train_offloaded, True, observe=_where, timeout=120)
    off = cluster2.run(offload.train_offloaded, False, observe=_where, timeout=120)
    n = sum(p.numel() for p in models.MLP().parameters())
    # Adam: exp_avg and exp_avg_sq per shard, and a 4-byte "step" per parameter (10 of them)
    for a, b in zip(on, off):
        assert a["observed"] == b["observed"] == {"parameters": {"cpu": n // WORLD * FP32},
                                                  "gradients": {"cpu": n // WORLD * FP32},
                                                  "optimizer": {"cpu": 2 * n // WORLD * FP32 + 10 * 4}}
    got, want = common.assemble([r["shards"] for r in on]), common.assemble([r["shards"] for r in off])
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_pinned_offload_needs_an_accelerator(cluster2):
    errors = cluster2.run(offload.pinned_offload_error, timeout=120)[0]
    if torch.cuda.is_available():
        pytest.skip("this machine has an accelerator")
    assert set(errors.values()) == {"RuntimeError: Cannot access accelerator device when none is available."}
    assert offload.offload_policy(torch.device("cpu")).pin_memory is False
    assert offload.offload_policy(torch.device("cuda", 0)).pin_memory is True


def test_clip_grad_norm_on_fully_shard_equals_one_process(cluster2):
    want = clipping.clip_whole(max_norm=0.1)
    runs = cluster2.run(clipping.clip_fully_shard, 0.1, timeout=120)
    assert want["total_norm"] > 0.1  # so clipping really scales
    for run in runs:
        assert run["total_norm"] == pytest.approx(want["total_norm"], rel=1e-6)
    got = common.assemble([r["grads"] for r in runs])
    for name in want["grads"]:
        torch.testing.assert_close(got[name], want["grads"][name], rtol=1e-5, atol=1e-8)
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in got.values()]))
    assert norm.item() == pytest.approx(0.1, rel=1e-5)


def test_fsdp1_needs_its_own_clip_grad_norm(cluster2):
    want = clipping.clip_whole(max_norm=0.1)
    right = cluster2.run(clipping.clip_fsdp1, "fsdp", 0.1, timeout=120)
    wrong = cluster2.run(clipping.clip_fsdp1, "torch", 0.1, timeout=120)
    for run in right:
        assert run["total_norm"] == pytest.approx(want["total_norm"], rel=1e-6)
        for name, g in want["grads"].items():
            torch.testing.assert_close(run["grads"][name], g, rtol=1e-5, atol=1e-8)
    local = [r["total_norm"] for r in wrong]  # each rank: the norm of its own shard only
    assert local[0] != local[1] and max(local) < want["total_norm"]
    assert sum(x * x for x in local) == pytest.approx(want["total_norm"] ** 2, rel=1e-5)


BLOCKS = [f"blocks.{i}" for i in range(4)]


@pytest.mark.parametrize("forward, backward", [(False, None), (True, None), (True, 2)])
def test_prefetch_knobs_change_when_all_gathers_are_issued(cluster2, forward, backward):
    traces = cluster2.run(prefetch.prefetch_step, forward, backward, observe=measure.fsdp2_events, timeout=120)
    for events in traces:
        order = prefetch.issue_order(events)
        # every block is gathered once in forward and once in backward, and computes once in each
        assert sorted(order) == sorted([f"{v} {b}" for b in BLOCKS for v in ("gather", "gather", "forward",
                                                                            "backward")])
        ahead_fw = prefetch.gathered_ahead(events, "forward")
        ahead_bw = prefetch.gathered_ahead(events, "backward")
        nxt = dict(zip(BLOCKS, BLOCKS[1:] + [None]))
        assert ahead_fw == {b: [nxt[b]] if forward and nxt[b] else [] for b in BLOCKS}
        depth = backward or 1  # FSDP2's default: one block ahead in backward
        assert ahead_bw["blocks.3"] == BLOCKS[3 - depth:3][::-1]
        assert ahead_bw["blocks.0"] == []
        for e in events:
            assert 0 <= e["start"] <= e["end"]


@pytest.mark.parametrize("backward_prefetch", [None, "BACKWARD_PRE"])
def test_fsdp1_backward_prefetch_through_the_course_observer(cluster2, backward_prefetch):
    traces = cluster2.run(prefetch.fsdp1_prefetch_step, backward_prefetch, observe=measure.fsdp1_events,
                          timeout=120)
    for events in traces:
        ahead = prefetch.gathered_ahead(events, "backward")
        if backward_prefetch is None:  # each unit gathered only when its own backward needs it
            assert ahead == {b: [] for b in BLOCKS[::-1]}
        else:
            assert ahead == {"blocks.3": ["blocks.2"], "blocks.2": ["blocks.1"], "blocks.1": ["blocks.0"],
                             "blocks.0": []}


def test_backward_prefetch_cannot_be_switched_off_in_fsdp2():
    class Fake:
        blocks = [object(), object()]
    with pytest.raises(ValueError, match="at least one block"):
        prefetch.set_prefetch(Fake(), False, 0)


def test_gathered_ahead_reads_a_hand_made_trace():
    ev = lambda kind, name, s, e: {"kind": kind, "name": name, "start": s, "end": e}  # noqa: E731
    events = [ev("all_gather", "a", 0, 1), ev("all_gather", "b", 1.5, 2), ev("forward", "a", 1, 3),
              ev("forward", "b", 3, 4), ev("all_gather", "b", 5, 6), ev("backward", "b", 6, 7),
              ev("all_gather", "a", 8, 9), ev("backward", "a", 9, 10)]
    assert prefetch.gathered_ahead(events, "forward") == {"a": ["b"], "b": []}
    assert prefetch.gathered_ahead(events, "backward") == {"b": [], "a": []}
    assert prefetch.issue_order(events)[:3] == ["gather a", "forward a", "gather b"]
