"""The course's selection rule (``dpcourse.memory.choice``), each figure derived a second way:
peaks from the ledger by hand, bytes sent from the ring's formula, step times from FLOPs, and
the rule's order checked against what it must do (checkpoint before sharding more, offload
last, HSDP and ``reshard_after_forward=<int>`` where there are nodes). Pure arithmetic."""
from __future__ import annotations

import math

import pytest

import dpcourse as dpc
from dpcourse.collectives import alpha_beta
from dpcourse.memory import choice
from dpcourse.memory.fit import equal_units
from dpcourse.memory.ledger import ledger

GB = 10**9


def _units(psi):
    return equal_units(psi, 32) + [0]


def _row(rows, name):
    return next(r for r in rows if r["name"] == name)


def test_the_order_adds_network_then_recompute_then_network_then_host():
    names = [p.name for p in choice.candidates(64, 8)]
    at = names.index
    assert names[0] == "ddp"
    zero2 = [n for n in names if "ZeRO-2" in n and " AC" not in n]
    assert zero2 == ["HSDP, ZeRO-2 in a node of 8", "SHARD_GRAD_OP (ZeRO-2)"]
    assert max(at(n) for n in names if "AC" in n and "ZeRO-2" in n) < at("HSDP, FULL_SHARD in a node of 8")
    assert at("ddp + selective AC") < at("ddp + full AC")
    assert at("HSDP, FULL_SHARD in a node of 8") < at("FULL_SHARD, reshard_after_forward=8") < at("FULL_SHARD (ZeRO-3)")
    assert [n for n in names if "offload" in n] == names[-2:]
    one_node = [p.name for p in choice.candidates(8, 8)]
    assert not [n for n in one_node if "HSDP" in n or "reshard_after_forward" in n]


def test_checkpointing_comes_before_more_sharding():
    """7.5B on 8 ranks of 80 GB with 60 GB of activations: ZeRO-2 misses only because of the
    activations, so the rule checkpoints selectively; the old rule jumped to FULL_SHARD."""
    psi, units = 7_500_000_000, _units(7_500_000_000)
    zero2 = ledger(psi, 8, "SHARD_GRAD_OP", "mixed", units=units, activation_bytes=60 * GB).peak
    kept = ledger(psi, 8, "SHARD_GRAD_OP", "mixed", units=units, activation_bytes=30 * GB).peak
    assert zero2 > 80 * GB >= kept
    name, why = dpc.memory.recommend(psi, 8, 80 * GB, units=units, activation_bytes=60 * GB)
    assert name == "SHARD_GRAD_OP (ZeRO-2) + selective AC", why
    assert "costs compute" in why


@pytest.mark.parametrize("checkpointing, kept", [("none", 1000), ("selective", 500), ("full", 63 + 125)])
def test_kept_activations(checkpointing, kept):
    # full: a sixteenth kept (62.5 -> 63) plus one of 8 units' activations while it reruns
    assert choice.kept_activations(1000, checkpointing, 8) == kept


def test_peaks_are_the_ledgers():
    psi, units, acts = 7_500_000_000, _units(7_500_000_000), 20 * GB
    rows = choice.plans(psi, 64, 80 * GB, units=units, activation_bytes=acts)
    assert _row(rows, "ddp")["peak"] == ledger(psi, 64, "ddp", "mixed", units=units, activation_bytes=acts).peak
    # HSDP holds what FULL_SHARD over one node holds: replicas do not change a rank's bytes
    assert _row(rows, "HSDP, FULL_SHARD in a node of 8")["peak"] == \
        ledger(psi, 8, "FULL_SHARD", "mixed", units=units, activation_bytes=acts).peak
    assert _row(rows, "SHARD_GRAD_OP (ZeRO-2) + selective AC")["peak"] == \
        ledger(psi, 64, "SHARD_GRAD_OP", "mixed", units=units, activation_bytes=acts // 2).peak
    # reshard_after_forward=8: FULL_SHARD's backward plus each unit's bf16 parameters at 1/8, not 1/64
    book = ledger(psi, 64, "FULL_SHARD", "mixed", units=units, activation_bytes=acts)
    backward = sum(book.phases["backward"].values()) + math.ceil(2 * psi * (1 / 8 - 1 / 64))
    assert _row(rows, "FULL_SHARD, reshard_after_forward=8")["peak"] == \
        max(backward, *(sum(p.values()) for k, p in book.phases.items() if k != "backward"))


def test_offload_keeps_only_the_step_on_the_device():
    """Offloaded: no model state at rest on the device; what remains is a gathered unit, a
    unit's gradients and the activations -- far below FULL_SHARD's peak."""
    psi, units = 70_000_000_000, _units(70_000_000_000)
    rows = choice.plans(psi, 8, 80 * GB, units=units, activation_bytes=10 * GB)
    full = ledger(psi, 8, "FULL_SHARD", "mixed", units=units, activation_bytes=10 * GB)
    offload = _row(rows, "FULL_SHARD + CPU offload")
    assert offload["peak"] == max(sum(v for c, v in p.items() if c not in full.at_rest())
                                  for p in full.phases.values())
    assert offload["peak"] < full.peak - full.total + 1
    assert offload["host"] == 3 * 2 * psi // 8  # bf16 shard in twice, gradient out once


def test_bytes_sent_are_the_rings():
    psi = 1_000_000_000
    rows = choice.plans(psi, 8, 80 * GB, units=_units(psi))
    assert _row(rows, "ddp")["sent"] == pytest.approx(2 * 7 / 8 * 2 * psi)  # bf16 gradients, 2(N-1)/N
    assert _row(rows, "SHARD_GRAD_OP (ZeRO-2)")["sent"] == pytest.approx(2 * 7 / 8 * 2 * psi)
    assert _row(rows, "FULL_SHARD (ZeRO-3)")["sent"] == pytest.approx(3 * 7 / 8 * 2 * psi)  # root is empty


def test_step_time_is_compute_when_the_network_hides():
    """1B on one node of NVLink: every collective hides, so the step is 6 x params x tokens
    FLOPs at 40 % of an H100's 989 TFLOP/s; full checkpointing adds one forward (2 x ...)."""
    psi = 1_000_000_000
    rows = choice.plans(psi, 8, 80 * GB, units=_units(psi), tokens=8192)
    compute = 6 * psi * 8192 / (989e12 * 0.4)
    assert _row(rows, "ddp")["seconds"] == pytest.approx(compute)
    assert _row(rows, "ddp + full AC")["seconds"] == pytest.approx(compute * 8 / 6)


def test_step_time_adds_what_sticks_out():
    """DDP over 8 nodes of 8 on InfiniBand with few tokens: the all-reduce outlasts backward."""
    psi = 7_000_000_000
    rows = choice.plans(psi, 64, 10**15, units=_units(psi), tokens=1024)
    forward = alpha_beta.forward_seconds(psi, 1024)
    backward = alpha_beta.backward_seconds(psi, 1024)
    link = alpha_beta.across_nodes(alpha_beta.LINKS["nvlink4"], alpha_beta.LINKS["ib_ndr"], 8, 8)
    comm = alpha_beta.step_comm_seconds("ddp", 64, _units(psi), link, param_bytes=2)["backward"]["all_reduce"]
    assert comm > backward
    assert _row(rows, "ddp")["seconds"] == pytest.approx(forward + comm)


# (billions, ranks, GB of activations per rank) on 80 GB -> the plan; reading each from the ledger
CASES = {(1, 8, 10): "ddp", (7.5, 8, 10): "SHARD_GRAD_OP (ZeRO-2)",
         (7.5, 8, 60): "SHARD_GRAD_OP (ZeRO-2) + selective AC", (30, 8, 10): "FULL_SHARD (ZeRO-3)",
         (7.5, 64, 10): "HSDP, ZeRO-2 in a node of 8", (30, 64, 10): "SHARD_GRAD_OP (ZeRO-2)",
         (70, 64, 10): "FULL_SHARD, reshard_after_forward=8", (70, 8, 10): "FULL_SHARD + CPU offload",
         (7.5, 1, 0): "single device + CPU offload", (10_000, 8, 10): "none"}


@pytest.mark.parametrize("case", list(CASES))
def test_recommend_is_the_first_plan_that_fits(case):
    billions, world, acts = case
    psi = int(billions * 1e9)
    units = _units(psi)
    name, why = dpc.memory.recommend(psi, world, 80 * GB, units=units, activation_bytes=acts * GB)
    assert name == CASES[case], why
    rows = choice.plans(psi, world, 80 * GB, units=units, activation_bytes=acts * GB)
    first = next((r["name"] for r in rows if r["peak"] <= 80 * GB), "none")
    assert name == first


def test_a_faster_plan_is_named_not_taken():
    """The rule's order is a default, the estimate its check: where a later plan is estimated
    >10 % faster, the verdict names it and says to measure both."""
    rows = [{"name": "a", "fits": True, "seconds": 1.0}, {"name": "b", "fits": True, "seconds": 0.8}]
    assert choice.choose(rows) == (rows[0], rows[1])
    rows[1]["seconds"] = 0.95
    assert choice.choose(rows) == (rows[0], None)
    assert choice.choose([{"name": "a", "fits": False, "seconds": 1}]) == (None, None)
