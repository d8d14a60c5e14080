"""Exercises B (DDP vs FSDP) and C (sharding strategies, auto-wrap): each checker passes the
reference, says "not attempted" for the notebook's untouched starter, and fails, naming the
right item, on typical mistakes. The runs are real training runs on Gloo ranks, made once
per module and shared by the tests."""
from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import dpcourse as dpc
from dpcourse.exercises import exercise_b, exercise_c
from dpcourse.exercises.solutions import answers_c, table_b

pytestmark = pytest.mark.timeout(300)

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks" / "exercises"


def starter(notebook: str, marker: str) -> dict:
    """Run the notebook's code cell that contains ``marker``; return the names it defines."""
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code" and marker in c.source]
    assert len(cells) == 1, f"{notebook}: expected one cell with {marker!r}"
    namespace = {"dpc": dpc}
    exec(compile(cells[0], "<starter cell>", "exec"), namespace)
    return namespace


def item(report, start: str):
    return next(i for i in report.items if i.name.startswith(start))


def failed(report) -> list[str]:
    return [i.name for i in report.items if i.status == "fail"]


@pytest.fixture(scope="module")
def records_b(cluster2):
    return dpc.exercises.run_b(2, d_hidden=128, batch_size=16, cluster=cluster2)


@pytest.fixture(scope="module")
def records_c(cluster4):
    return dpc.exercises.run_c(world_size=4, d_hidden=64, batch_size=8, cluster=cluster4)


# --- Exercise B --------------------------------------------------------------------------------

def test_b_reference_passes_and_its_figures_are_what_the_ranks_measured(records_b):
    table = table_b.fill_table(records_b)
    report = dpc.exercises.check_b(records_b, table, table_b.answers)
    assert report.passed and "passed (8 of 8 checks)" in str(report), str(report)
    ddp, fsdp = records_b["ddp"], records_b["fsdp"]
    assert len(ddp) == len(fsdp) == 2 and ddp[0]["losses"] == pytest.approx(fsdp[0]["losses"], abs=1e-5)
    for name, metrics in (("ddp", ddp), ("fsdp", fsdp)):
        rank0 = metrics[0]
        # throughput is the global batch over the median wall time of a step
        median = statistics.median_high(rank0["step_time_s"])
        assert table[name]["samples_per_s"] == pytest.approx(16 * 2 / median)
        # the measured peak is the ledger's prediction for this very run, within 10 %
        theory, measured = rank0["memory"]["compare"]["peak"]
        assert measured == rank0["memory"]["peak_bytes"] and measured == pytest.approx(theory, rel=0.10)
    # FSDP keeps half of every model state per rank at 2 ranks: less at rest and at peak
    assert sum(fsdp[0]["memory"]["at_rest"].values()) * 2 == pytest.approx(
        sum(ddp[0]["memory"]["at_rest"].values()) - ddp[0]["memory"]["at_rest"]["bucket_buffers"], rel=0.01)
    assert table["fsdp"]["peak_mb"] < table["ddp"]["peak_mb"]
    assert "the ledger predicts" in item(report, "FSDP FULL_SHARD: peak").detail


def test_b_untouched_starter_is_not_attempted():
    table = starter("B-ddp-vs-fsdp.ipynb", "table = {")["table"]
    answers = starter("B-ddp-vs-fsdp.ipynb", "answers = {")["answers"]
    start = time.monotonic()
    report = dpc.exercises.check_b(None, table, answers)  # judged without looking at any run
    assert time.monotonic() - start < 1
    assert not report.attempted and not report.passed and "not attempted yet" in str(report)
    assert set(table) == set(exercise_b.RUNS) and set(answers) == set(exercise_b.QUESTIONS)


def test_b_swapped_memory_figures_are_named(records_b):
    table = table_b.fill_table(records_b)
    table["ddp"]["peak_mb"], table["fsdp"]["peak_mb"] = table["fsdp"]["peak_mb"], table["ddp"]["peak_mb"]
    report = dpc.exercises.check_b(records_b, table, table_b.answers)
    assert failed(report) == ["DDP: peak memory (MB)", "FSDP FULL_SHARD: peak memory (MB)"], str(report)
    assert "swapped" in item(report, "DDP: peak").detail


def test_b_a_throughput_off_by_2x_is_named(records_b):
    table = table_b.fill_table(records_b)
    table["fsdp"]["samples_per_s"] *= 2
    report = dpc.exercises.check_b(records_b, table, table_b.answers)
    assert failed(report) == ["FSDP FULL_SHARD: throughput (samples/s)"], str(report)
    assert "factor 2" in item(report, "FSDP FULL_SHARD: throughput").detail


def test_b_a_wrong_letter_and_a_blank_are_named(records_b):
    answers = dict(table_b.answers, why_slower_here="a")
    table = table_b.fill_table(records_b)
    table["ddp"]["cpu_ms_per_step"] = ...
    report = dpc.exercises.check_b(records_b, table, answers)
    assert failed(report) == [exercise_b.QUESTIONS["why_slower_here"][0]], str(report)
    assert item(report, "DDP: CPU time").status == "skip" and not report.passed
    bad = dpc.exercises.check_b(records_b, table_b.fill_table(records_b), dict(answers, why_slower_here="z"))
    assert "'z' is not one of a, b, c, d" in item(bad, "Why is FSDP slower").detail


def test_b_notebook_with_the_solution_filled_in_passes():
    """The whole notebook on its own ranks, the starter cells replaced by the reference."""
    nb = nbformat.read(NOTEBOOKS / "B-ddp-vs-fsdp.ipynb", as_version=4)
    cells = {m: next(c for c in nb.cells if c.cell_type == "code" and m in c.source)
             for m in ("table = {", "answers = {")}
    cells["table = {"].source = dpc.exercises.solution("B") + "\ntable = fill_table(records)"
    cells["answers = {"].source = "assert answers['why_slower_here'] == 'c'"  # set by the solution
    NotebookClient(nb, timeout=240, resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             if "check_b" in c.source and o.get("output_type") == "execute_result"]
    assert shown and "passed (8 of 8 checks)" in shown[0]["data"]["text/plain"], shown


def test_b_world_size_is_validated_before_starting_ranks():
    with pytest.raises(ValueError, match="2 to 4 ranks"):
        dpc.exercises.run_b(world_size=5)


# --- Exercise C --------------------------------------------------------------------------------

def test_c_reference_passes_and_the_records_follow_the_theory(records_c):
    report = dpc.exercises.check_c(records_c, answers_c.answers)
    assert report.passed and "passed (11 of 11 checks)" in str(report), str(report)
    fig = exercise_c.figures(records_c)
    # bytes per step, derived here from the parameter count alone: the flat all-reduce of
    # NO_SHARD and SHARD_GRAD_OP's one all-gather + one reduce-scatter are both 2(N-1)/N Ψ
    psi = 4 * sum(p.numel() for p in dpc.models.build_model("mlp", d_hidden=64, depth=4).parameters())
    for name in ("NO_SHARD", "SHARD_GRAD_OP", "fully_shard (no reshard)"):
        assert fig[name]["sent"] == pytest.approx(2 * 3 / 4 * psi)
    assert 2.5 * 3 / 4 * psi < fig["FULL_SHARD"]["sent"] < 3 * 3 / 4 * psi  # the root is gathered once
    assert fig["FULL_SHARD"]["sent"] == fig["fully_shard"]["sent"]
    peaks = {n: fig[n]["peak"] for n in exercise_c.SHARDING}
    assert peaks["FULL_SHARD"] < peaks["SHARD_GRAD_OP"] < peaks["NO_SHARD"]
    # one unit: the whole model is gathered at once, so the peak is far above per-block units
    assert fig[exercise_c.WRAPS["none"]]["peak"] > 1.5 * fig["FULL_SHARD"]["peak"]
    assert exercise_c.one_unit_ledger(records_c).bytes["unsharded_parameters"] == psi


def test_c_untouched_starter_is_not_attempted():
    answers = starter("C-sharding-strategies.ipynb", "answers = {")["answers"]
    report = dpc.exercises.check_c(None, answers)
    assert not report.attempted and "not attempted yet" in str(report)
    assert set(answers) == {"peak_order", "bytes_order"} | set(exercise_c.QUESTIONS)


def test_c_a_wrong_ordering_claim_is_named_and_ties_are_either_way(records_c):
    claim = ["FULL_SHARD", "NO_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP"]
    report = dpc.exercises.check_c(records_c, dict(answers_c.answers, peak_order=claim))
    assert failed(report) == ["your order of peak memory per rank, smallest first"], str(report)
    detail = item(report, "your order of peak").detail
    assert "FULL_SHARD < SHARD_GRAD_OP < HYBRID_SHARD < NO_SHARD" in detail
    assert "HYBRID_SHARD holds less than NO_SHARD" in detail
    tie = ["FULL_SHARD", "HYBRID_SHARD", "NO_SHARD", "SHARD_GRAD_OP"]  # equal bytes: either order
    assert dpc.exercises.check_c(records_c, dict(answers_c.answers, bytes_order=tie)).passed
    short = dpc.exercises.check_c(records_c, dict(answers_c.answers, bytes_order=["FULL_SHARD"]))
    assert "list each of" in item(short, "your order of bytes").detail


def test_c_a_wrong_auto_wrap_answer_is_named(records_c):
    report = dpc.exercises.check_c(records_c, dict(answers_c.answers, wrap="d"))
    assert failed(report) == [exercise_c.QUESTIONS["wrap"][0]], str(report)


def test_c_records_that_contradict_the_ledger_fail(records_c):
    broken = copy.deepcopy(records_c)
    broken["NO_SHARD"][0]["memory"]["peak_bytes"] = 1  # as if NO_SHARD peaked below everything
    broken["SHARD_GRAD_OP"][0]["memory"]["at_rest"]["gradients"] += 4
    report = dpc.exercises.check_c(broken, answers_c.answers)
    assert set(failed(report)) == {"measured peaks follow the ledger's order",
                                   "measured at rest: every strategy holds exactly what the ledger says"}
    assert "SHARD_GRAD_OP" in item(report, "measured at rest").detail


def test_c_world_size_is_validated_before_starting_ranks():
    with pytest.raises(ValueError, match="even world_size >= 4"):
        dpc.exercises.run_c(world_size=2)


def test_solutions_are_served():
    assert "def fill_table" in dpc.exercises.solution("B")
    assert '"wrap": "a"' in dpc.exercises.solution("c")
