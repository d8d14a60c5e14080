"""Each common pitfall on real ranks: the bug shows, and the fix matches single-process training."""
from __future__ import annotations

import pytest
import torch

import dpcourse as dpc
from dpcourse import pitfalls

pytestmark = pytest.mark.timeout(180)


def test_set_epoch_changes_the_shuffle_and_ranks_never_overlap(cluster2):
    without = cluster2.run(pitfalls.sampler_indices, False)
    with_epoch = cluster2.run(pitfalls.sampler_indices, True)
    for per_rank in without:
        assert per_rank[0] == per_rank[1]  # the bug: every epoch the same order
    for per_rank in with_epoch:
        assert per_rank[0] != per_rank[1]
    for result in (without, with_epoch):
        for epoch in (0, 1):  # a partition of the dataset every epoch
            assert sorted(result[0][epoch] + result[1][epoch]) == list(range(8))
    # epoch 0 is the same shuffle either way: set_epoch(0) is the default seed
    assert [r[0] for r in without] == [r[0] for r in with_epoch]


def test_logging_and_saving_on_rank_0_only(cluster2, tmp_path):
    every = cluster2.run(pitfalls.log_and_save, str(tmp_path / "every.pt"), False)
    assert [r["wrote"] for r in every] == [True, True]
    assert [len(r["logged"]) for r in every] == [1, 1]
    fixed = cluster2.run(pitfalls.log_and_save, str(tmp_path / "rank0.pt"), True)
    assert [r["wrote"] for r in fixed] == [True, False]
    assert [len(r["logged"]) for r in fixed] == [1, 0]
    expected = len(dpc.models.build_model("mlp").state_dict())
    assert [r["read_back"] for r in fixed] == [expected, expected]


def test_saving_the_ddp_wrapper_prefixes_module(cluster2, tmp_path):
    bug = cluster2.run(pitfalls.save_ddp_state, str(tmp_path / "wrapper.pt"), False)
    fix = cluster2.run(pitfalls.save_ddp_state, str(tmp_path / "module.pt"), True)
    plain_first = next(iter(dpc.models.build_model("mlp").state_dict()))
    for r in bug:
        assert r["first_key"] == "module." + plain_first
        assert r["error"][0].startswith("RuntimeError: Error(s) in loading state_dict for MLP")
        assert "Missing key(s)" in r["error"][1]
    for r in fix:
        assert r["first_key"] == plain_first and r["error"] is None


def test_fsdp_without_broadcast_trains_a_mixture(cluster2):
    cfg = dpc.train.TrainConfig(steps=3, batch_size=8, num_samples=64)
    single = dpc.train.train_single_process(cfg, world_size=2)["losses"]
    assert "requires them to be on GPU" in cluster2.run(pitfalls.sync_module_states_error)[0]
    ddp = cluster2.run(pitfalls.train_from_rank_seeds, cfg, False)
    assert ddp[0]["initial_sum"] != ddp[1]["initial_sum"]  # the ranks did start differently
    fsdp = dpc.train.TrainConfig(strategy="fsdp", steps=3, batch_size=8, num_samples=64)
    mixture = cluster2.run(pitfalls.train_from_rank_seeds, fsdp, False)
    fixed = cluster2.run(pitfalls.train_from_rank_seeds, fsdp, True)
    for r in ddp + fixed:
        torch.testing.assert_close(r["losses"], single, rtol=1e-5, atol=1e-6)
    assert abs(mixture[0]["losses"][0] - single[0]) > 1e-3


def test_unused_parameters_raise_until_find_unused_parameters(cluster2):
    single = pitfalls.train_two_heads_single_process(world_size=2)
    bug = cluster2.run(pitfalls.train_two_heads, False)
    for r in bug:
        assert r["error"] == ("RuntimeError: Expected to have finished reduction in the prior "
                              "iteration before starting a new one.")
        assert len(r["losses"]) == 1  # the first iteration ran; the second forward raised
        torch.testing.assert_close(r["losses"], single[:1])
    fix = cluster2.run(pitfalls.train_two_heads, True)
    for r in fix:
        assert r["error"] is None and not r["b_grad"]
        torch.testing.assert_close(r["losses"], single, rtol=1e-5, atol=1e-6)


def test_uneven_inputs_hang_and_both_fixes(cluster2):
    with pytest.raises(dpc.RankTimeout) as info:
        cluster2.run(pitfalls.train_uneven, None, timeout=3)
    reports = info.value.reports
    assert reports[1].state == "finished"
    assert reports[0].state == "running" and "backward" in reports[0].traceback
    drop = cluster2.run(pitfalls.train_uneven, "drop_last")
    assert [r["batches"] for r in drop] == [2, 2]
    joined = cluster2.run(pitfalls.train_uneven, "join")
    assert [r["batches"] for r in joined] == [3, 2]
    for result in (drop, joined):
        assert result[0]["weight_sum"] == result[1]["weight_sum"]  # replicas still identical


def test_batchnorm_statistics_per_rank_vs_global(cluster2):
    single = pitfalls.batchnorm_step_single_process(world_size=2)
    local = cluster2.run(pitfalls.batchnorm_step, "local")
    synced = cluster2.run(pitfalls.batchnorm_step, "all_reduce")
    sync_bn = cluster2.run(pitfalls.batchnorm_step, "sync_batchnorm")
    assert not torch.allclose(torch.cat([r["out"] for r in local]), single["out"], atol=1e-3)
    assert not torch.allclose(local[0]["mean"], local[1]["mean"])
    for key in ("out", "x_grad"):
        torch.testing.assert_close(torch.cat([r[key] for r in synced]), single[key])
    for r in synced:  # the statistics of the global batch, on every rank
        torch.testing.assert_close(r["mean"], single["mean"])
        torch.testing.assert_close(r["var"], single["var"])
    # independently: the global batch's own mean and unbiased variance
    x, _ = pitfalls._bn_batch(world_size=2)
    torch.testing.assert_close(single["mean"], x.mean(0))
    torch.testing.assert_close(single["var"], x.var(0))
    # these are CPU tensors: SyncBatchNorm refuses them before any collective
    assert all("SyncBatchNorm expected input tensor to be on GPU" in r["error"] for r in sync_bn)
