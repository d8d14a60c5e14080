"""DDP vs FSDP on one real step, the selection guide, and the alpha-beta projection.

Each number the notebook shows is derived a second way here: bytes measured on real ranks
against the closed-form ring formulas, the per-group split against HYBRID_SHARD's formula,
the FSDP/DDP ratio against 1.5 - root/2Ψ, the projection's arithmetic against hand-computed
cases, and the selection table against the ledger it is filled from.
"""
from __future__ import annotations

import math

import pytest
import torch

import dpcourse as dpc
from dpcourse.collectives import alpha_beta as ab
from dpcourse.memory.fit import equal_units
from dpcourse.train import TrainConfig, compare, train_single_process

pytestmark = pytest.mark.timeout(300)
GiB = 2**30


@pytest.fixture(scope="module")
def records4(cluster4):
    """Every rank's record of every compared run on 4 ranks (HYBRID_SHARD: 2 groups of 2)."""
    return {name: cluster4.run(compare.measure_step, name, timeout=240) for name in compare.STEP_RUNS}


def test_one_step_bytes_equal_the_ring_formulas(records4):
    mlp = dpc.models.build_model("mlp")
    psi = 4 * sum(p.numel() for p in mlp.parameters())  # fp32
    root = 4 * sum(p.numel() for p in mlp.head.parameters())  # the root unit owns only the head
    for name, ranks in records4.items():
        for r in ranks:
            assert (r.param_bytes, r.world_size) == (psi, 4)
            assert r.root_bytes == (0 if name == "DDP" else root)
            assert r.measured == pytest.approx(r.theory, abs=1)  # the runner's unit-by-unit theory
            formula = compare.ring_formula(name, psi, root if name != "DDP" else 0, 4, r.shard_group_size)
            assert r.logical == pytest.approx(sum(formula.values()), abs=1), name
            assert compare.split_by_group(r) == pytest.approx(formula, abs=1), name
            # Gloo's wire: its reduce_scatter sends an all_reduce's bytes; plus message headers
            assert 0.98 * r.wire_theory <= r.wire <= 1.15 * r.wire_theory, (name, r.wire, r.wire_theory)
            assert r.samples_per_s > 0
    by_name = {n: ranks[0] for n, ranks in records4.items()}
    assert by_name["DDP"].logical == pytest.approx(2 * 3 / 4 * psi, abs=1)  # 2(N-1)/N Ψ
    assert by_name["SHARD_GRAD_OP"].logical == by_name["DDP"].logical
    assert by_name["fully_shard"].measured == by_name["FULL_SHARD"].measured


def test_full_shard_over_ddp_is_one_and_a_half_minus_the_root(records4):
    ddp, full = records4["DDP"][0], records4["FULL_SHARD"][0]
    logical, wire = compare.fsdp_over_ddp(full.param_bytes, full.root_bytes)
    assert full.logical / ddp.logical == pytest.approx(logical, rel=1e-5)
    assert full.wire_theory / ddp.wire_theory == pytest.approx(wire, rel=1e-9)
    assert full.wire / ddp.wire == pytest.approx(wire, abs=0.15)  # measured, headers included
    assert 1.45 < logical < 1.5 and 1.95 < wire < 2.0


def test_hybrid_shard_bytes_inside_and_across_groups(records4):
    for r in records4["HYBRID_SHARD"]:
        groups = {tuple(g): sent for g, sent in r.by_group.items()}
        base = r.rank // 2 * 2
        inside, across = groups[(base, base + 1)], groups[tuple(sorted({r.rank % 2, r.rank % 2 + 2}))]
        assert set(inside) == {"all_gather", "reduce_scatter"} and set(across) == {"all_reduce"}
        assert across["all_reduce"] == pytest.approx(r.param_bytes / 2 * 2 * 1 / 2, abs=1)  # Ψ/F over R=2


def test_every_compared_run_is_single_process_training(records4):
    cfg = TrainConfig(**compare.COMMON)
    single = train_single_process(cfg, world_size=4)["losses"]
    for name, ranks in records4.items():
        torch.testing.assert_close(ranks[0].losses, single, rtol=1e-5, atol=1e-6, msg=name)


def test_ring_formulas_by_hand():
    assert compare.ring_formula("DDP", 1000, 0, 4) == {"world": 1500}
    assert compare.ring_formula("FULL_SHARD", 1000, 100, 4) == {"world": 2900 * 3 / 4}
    assert compare.ring_formula("HYBRID_SHARD", 1000, 100, 4, 2) == {"inside": 1450, "across": 500}
    assert compare.ring_formula("HYBRID_SHARD", 1200, 0, 8, 2) == {"inside": 1800, "across": 2 * 3 / 4 * 600}
    assert compare.fsdp_over_ddp(1000, 100) == (1.45, 1.95)
    with pytest.raises(ValueError, match="choose one of DDP"):
        compare.ring_formula("zero", 1, 0, 2)


def test_two_ranks_too(cluster2):
    ddp, full = (cluster2.run(compare.measure_step, n, steps=3)[0] for n in ("DDP", "FULL_SHARD"))
    assert ddp.logical == pytest.approx(ddp.param_bytes, abs=1)  # 2(N-1)/N Ψ = Ψ at N = 2
    assert full.logical == pytest.approx((3 * full.param_bytes - full.root_bytes) / 2, abs=1)


def test_code_lines_skip_comments_docstrings_and_blank_lines():
    source = '"""Doc\nstring."""\nimport os  # why\n\n# a comment\ndef f():\n    """Doc."""\n    return 1\n'
    assert compare.code_lines(source) == ["import os", "def f():", "return 1"]
    assert compare.lines_added(source, source) == 0
    assert compare.lines_added(source, source + "x = 2  # new\n") == 1
    assert compare.lines_added(source, source.replace("return 1", "return 2")) == 1


def test_lines_the_scripts_add_to_one_device_training():
    text = {n: open(dpc.scripts.path(n)).read() for n in dpc.scripts.NAMES}
    ddp = compare.lines_added(text["train_single"], text["train_ddp"])
    fsdp = compare.lines_added(text["train_single"], text["train_fsdp"])
    new_in_fsdp = set(compare.code_lines(text["train_fsdp"])) - set(compare.code_lines(text["train_single"]))
    assert fsdp >= len(new_in_fsdp) > 0  # every distinct new line is counted at least once
    assert any("fully_shard(" in line for line in new_in_fsdp)
    assert 0 < ddp < fsdp  # FSDP2 adds a mesh, the per-block sharding and gathering the weights


def test_the_rule_comes_out_of_recommend():
    def pick(billions, world):
        num_params = int(billions * 1e9)
        return dpc.memory.recommend(num_params, world, 80 * GiB, units=equal_units(num_params, 64))[0]

    assert [pick(b, 8) for b in (1, 7, 34)] == ["ddp", "SHARD_GRAD_OP", "FULL_SHARD"]
    assert [pick(b, 64) for b in (1, 13, 70)] == ["ddp", "HYBRID_SHARD", "FULL_SHARD"]
    ranges = compare.scale_ranges({1: "ddp", 3: "ddp", 7: "SHARD_GRAD_OP", 34: "FULL_SHARD", 40: "none"})
    assert ranges == {"ddp": (1, 3), "SHARD_GRAD_OP": (7, 7), "FULL_SHARD": (34, 34), "none": (40, 40)}
    text = compare.scale_text({8: {"ddp": (1e9, 4e9)}, 64: {"ddp": (1e9, 4e9), "HYBRID_SHARD": (7e9, 7e9)}})
    assert text == {"ddp": "1-4B on 8; 1-4B on 64", "HYBRID_SHARD": "7B on 64"}


def _record(name, psi, logical):
    return compare.StepRecord(name, 0, 4, 2 if name == "HYBRID_SHARD" else None, "adamw", psi // 4, psi, 0,
                              {"all_reduce": logical}, {}, {}, None, 0.0, 1.0)


def test_the_selection_table_follows_the_ledger_and_the_measurements():
    def table(num_params):
        records = {n: _record(n, 4 * num_params, k * num_params) for n, k in (("DDP", 6), ("FULL_SHARD", 9))}
        books = {n: dpc.memory.ledger(num_params, 4, r.ledger_args[0], optimizer="adamw", **r.ledger_args[1])
                 for n, r in records.items()}
        return compare.selection_rows(records, books, {"DDP": 5}, {"ddp": "up to 3B"}), books

    small, books = table(1000)
    big, _ = table(2000)
    assert [r["at rest kB/rank"] for r in small] == [round(b.total / 1e3, 1) for b in books.values()]
    assert [r["at rest kB/rank"] for r in big] != [r["at rest kB/rank"] for r in small]
    assert [r["bytes x DDP"] for r in small] == [1.0, 1.5]
    assert small[0]["lines added"] == 5 and small[1]["lines added"] == "-"
    assert small[0]["suits"] == "up to 3B" and small[1]["suits"] == "-"
    assert [r["can go wrong"] for r in small] == [len(compare.WHAT_CAN_GO_WRONG[k]) for k in ("DDP", "FSDP")]
    assert "at rest kB/rank" in compare.format_rows(small).splitlines()[0]


def test_projection_arithmetic_by_hand():
    link = ab.Link("test", alpha=1e-6, beta=1e9, source="by hand")
    # all_reduce of 8 GB on 8 ranks: 14 steps x 1 us + 2 x 7/8 x 8 GB / (1 GB/s)
    assert ab.collective_seconds("all_reduce", 8e9, 8, link) == pytest.approx(14e-6 + 14.0)
    assert ab.collective_seconds("all_gather", 8e9, 8, link, calls=3) == pytest.approx(21e-6 + 7.0)
    assert ab.collective_seconds("all_reduce", 8e9, 1, link) == 0.0
    free = ab.Link("no latency", 0.0, 1e9, "by hand")
    ddp = sum(ab.step_comm_seconds("ddp", 1e9, 4, free).values())
    full = sum(ab.step_comm_seconds("FULL_SHARD", 1e9, 4, free).values())
    assert (ddp, full) == (pytest.approx(1.5), pytest.approx(2.25))  # 2(N-1)/N Ψ/β and 1.5 x that
    assert sum(ab.step_comm_seconds("SHARD_GRAD_OP", 1e9, 4, free).values()) == pytest.approx(ddp)
    hybrid = ab.step_comm_seconds("HYBRID_SHARD", 8e9, 16, ab.Link("in", 0, 100e9, ""),
                                  shard_group_size=8, inter_link=ab.Link("out", 0, 10e9, ""))
    assert sum(v for k, v in hybrid.items() if "inside" in k) == pytest.approx(3 * 8e9 * 7 / 8 / 100e9)
    assert hybrid["all_reduce across"] == pytest.approx(2 * 1 / 2 * 1e9 / 10e9)
    with pytest.raises(ValueError, match="inter_link"):
        ab.step_comm_seconds("HYBRID_SHARD", 1e9, 16, free, shard_group_size=8)
    assert ab.backward_seconds(1e9, 1000, flops=1e15, mfu=0.5) == pytest.approx(8e-3)  # 4e12 / 5e14


def test_across_nodes_weighs_the_hops():
    ring = ab.across_nodes(ab.Link("a", 1e-6, 100e9, ""), ab.Link("b", 10e-6, 10e9, ""), nodes=2, per_node=4)
    assert ring.alpha == pytest.approx((6 * 1e-6 + 1 * 10e-6) / 7) and ring.beta == 10e9


def test_hiding_rows_by_hand():
    link = ab.Link("test", 0.0, 1e9, "by hand")
    rows = ab.hiding_rows([("toy", "ddp", 2, link, {})], models={"toy": (1e6, 1)}, tokens=1000,
                          grad_bytes=2, flops=1e12, mfu=0.5)
    # comm: 2(N-1)/N x 2 MB / 1 GB/s = 2 ms; backward: 4 x 1e6 x 1000 / 5e11 = 8 ms
    assert rows == [{"model": "toy", "setup": "toy", "strategy": "ddp", "comm ms": 2.0, "backward ms": 8.0,
                     "hides": True, "min tokens": 250}]


def test_the_named_links_match_their_sources():
    pcie = 16e9 * 16 * 128 / 130 / 8  # 16 GT/s per lane, 16 lanes, 128b/130b, bits -> bytes
    assert ab.LINKS["pcie4"].beta == pytest.approx(pcie, rel=1e-3)
    assert ab.LINKS["nvlink4"].beta == 900e9 / 2  # 900 GB/s both directions together
    assert ab.LINKS["ib_ndr"].beta == 400e9 / 8  # 400 Gb/s
    assert all(link.source and 1e-6 < link.alpha < 1e-5 for link in ab.LINKS.values())
    assert math.isclose(ab.H100_BF16_FLOPS * 2, 1979e12, rel_tol=1e-3)  # the datasheet's sparse figure
