"""FSDP1 and FSDP2 side by side on real ranks: the same sharding strategy sends the same bytes
and keeps the same shards; mixed precision sends what its dtypes say; a bf16 reduction costs
accuracy that grows with the ranks summed."""
from __future__ import annotations

import pytest

from dpcourse import models
from dpcourse.memory import MemoryProbe
from dpcourse.train import ConfigError, TrainConfig, migrate, precision, volume

pytestmark = pytest.mark.timeout(300)


def _mlp_param_bytes(**sizes) -> int:
    return 4 * sum(p.numel() for p in models.build_model("mlp", **sizes).parameters())


def test_the_mapping_is_pytorchs_table():
    to2 = migrate.fully_shard_equivalent
    assert to2(TrainConfig(strategy="fsdp", sharding_strategy="FULL_SHARD")).reshard_after_forward is True
    assert to2(TrainConfig(strategy="fsdp", sharding_strategy="SHARD_GRAD_OP")).reshard_after_forward is False
    hybrid = to2(TrainConfig(strategy="fsdp", sharding_strategy="HYBRID_SHARD", shard_group_size=2))
    assert (hybrid.strategy, hybrid.shard_group_size, hybrid.reshard_after_forward) == ("fully_shard", 2, True)
    assert to2(TrainConfig(strategy="fsdp", sharding_strategy="NO_SHARD")).strategy == "ddp"
    with pytest.raises(ValueError, match="maps FSDP1"):
        to2(TrainConfig(strategy="ddp"))


def test_fsdp1_and_fsdp2_do_the_same_work_at_two_ranks(cluster2):
    rows = migrate.fsdp1_vs_fsdp2(cluster2, ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    psi = _mlp_param_bytes()  # the default MLP's blocks split evenly: no padding
    for row in rows:
        fsdp1, fsdp2 = row.bytes_sent
        assert fsdp1 == fsdp2, row
        assert row.parameters_held[0] == row.parameters_held[1], row
        assert row.largest_loss_difference < 1e-5, row
    held = {r.sharding_strategy: r.parameters_held[0] for r in rows}
    assert held == {"FULL_SHARD": psi // 2, "SHARD_GRAD_OP": psi // 2, "NO_SHARD": psi}
    sent = {r.sharding_strategy: sum(r.bytes_sent[0].values()) for r in rows}
    # ring bytes at N=2: all-reduce psi; gather + reduce-scatter psi; FULL_SHARD re-gathers the blocks
    assert sent["NO_SHARD"] == sent["SHARD_GRAD_OP"] == psi
    assert psi < sent["FULL_SHARD"] < 1.5 * psi
    assert "fully_shard(reshard_after_forward=False)" in migrate.pairs_table(rows)


def test_hybrid_shard_is_fully_shard_on_a_2d_mesh(cluster4):
    (row,) = migrate.fsdp1_vs_fsdp2(cluster4, ["HYBRID_SHARD"])
    assert "2 x 2 mesh (replicate x shard)" in row.applied[0] and "2 x 2 mesh" in row.applied[1]
    assert row.bytes_sent[0] == row.bytes_sent[1] and set(row.bytes_sent[0]) == {
        "all_gather", "reduce_scatter", "all_reduce"}
    assert row.parameters_held == (_mlp_param_bytes() // 2,) * 2  # a shard group of 2
    assert row.largest_loss_difference < 1e-5


def test_mixed_precision_sends_what_its_dtypes_say(cluster2):
    rows = precision.compare_precisions(cluster2, "fsdp", hooks=[MemoryProbe()], steps=4)
    by = {r.label: r for r in rows}
    fp32, bf16, recipe = by["fp32"], by["bf16"], by["bf16, reduce fp32"]
    for r in rows:
        assert r.measured == r.theory, r
    assert bf16.measured["all_gather"] * 2 == fp32.measured["all_gather"] == recipe.measured["all_gather"] * 2
    assert bf16.measured["reduce_scatter"] * 2 == fp32.measured["reduce_scatter"] == recipe.measured["reduce_scatter"]
    psi = _mlp_param_bytes()
    # FSDP keeps fp32 master shards: the same parameter bytes at rest in every recipe
    assert {r.at_rest["parameters"] for r in rows} == {psi // 2}
    assert fp32.loss_difference < 1e-5 < bf16.loss_difference < 0.05
    fsdp2 = precision.compare_precisions(cluster2, "fully_shard", recipes=(("bf16", "fp32"),), steps=4)[0]
    assert fsdp2.measured == recipe.measured


def test_a_bf16_reduction_rounds_at_every_step_of_the_ring(cluster4):
    errors = cluster4.run(precision.reduction_error)
    assert errors[0] == errors[3]  # every rank holds the same sum
    e = errors[0]
    assert e["fp32"] < 1e-6 < e["rounded_once"] < e["bf16"] < 4 * e["rounded_once"]


def test_theory_scales_with_the_dtypes():
    fp32 = volume.step_bytes("fsdp", 2, [1000, 1000])
    assert fp32 == {"all_gather": 2000.0, "reduce_scatter": 1000.0}


@pytest.mark.parametrize("options,message", [
    (dict(strategy="ddp", shard_group_size=2), "shard_group_size applies to"),
    (dict(strategy="fsdp", sharding_strategy="FULL_SHARD", shard_group_size=2), "shard_group_size applies to"),
    (dict(strategy="fully_shard", shard_group_size=4), "silently be"),
    (dict(strategy="fsdp", reduce_dtype="fp32"), "reduce_dtype is FSDP's mixed-precision option"),
    (dict(strategy="fsdp", mixed_precision="bf16", reduce_dtype="fp64"), "unknown reduce_dtype"),
])
def test_bad_combinations_name_the_fix(options, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**options).validate(world_size=4, device_type="cpu")
