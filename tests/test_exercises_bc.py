"""Exercises B and C on real ranks: the reference and solutions written differently pass, each
typical mistake fails with the idea named and no line of the reference in the report, a
formula that calls the course's own calculators is refused, and no report prints a measured
value a prediction is judged against.

A mistake in a formula changes nothing the ranks do: those reports are judged in the kernel
against the reference set-ups' measurement, taken once (``exercise_b._measure``)."""
from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import dpcourse as dpc
from dpcourse.exercises import exercise_b, exercise_c, setups
from dpcourse.grading.report import Report

pytestmark = pytest.mark.timeout(900)
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks" / "exercises"
B = dpc.exercises.solution("B")
C = dpc.exercises.solution("C")


def assert_teaches(report, reference: str) -> None:
    """The rule of test_exercises.assert_teaches: a failed report names behaviours and ideas,
    never a line of the reference (over 12 characters); the reference is on request."""
    lines = {line.strip() for line in reference.splitlines()
             if len(line.strip()) > 12 and not line.strip().startswith("#")}
    given_away = [line for line in lines if line in str(report)]
    assert not given_away, f"the report gives the reference's line away: {given_away}\n{report}"
    assert "report.fix()" in report.note and report.fix() == reference


def define(source: str, *names):
    namespace = {"__name__": "exercise_cell"}
    exec(compile(source, "<exercise cell>", "exec"), namespace)  # noqa: S102 -- the learner's cell
    return [namespace[n] for n in names]


def item(report, start: str):
    return next(i for i in report.items if i.name.startswith(start))


def edited(text: str, *edits) -> str:
    for old, new in edits:
        assert old in text, f"the reference changed: {old!r} is no longer in it"
        text = text.replace(old, new)
    return text


def measured_once(module, run):
    """Call ``run()`` with ``module._measure`` recording what it measured: (result, measured)."""
    real, seen = module._measure, []

    def recording(*args):
        seen.append(real(*args))
        return seen[-1]

    module._measure = recording
    try:
        return run(), seen[0]
    finally:
        module._measure = real


# --- Exercise B ----------------------------------------------------------------------------------

# Written apart from the reference: FSDP1 with an auto-wrap policy, DDP with bucket views, and
# the formulas summed unit by unit, per category, instead of whole-model products.
B_INDEPENDENT = textwrap.dedent('''
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.nn.parallel import DistributedDataParallel

    FLOAT32 = 4
    COPIES = {"parameters": 1, "gradients": 1, "optimizer_state": 2}   # Adam: exp_avg, exp_avg_sq

    def wrap_ddp(model):
        return DistributedDataParallel(model, gradient_as_bucket_view=True)

    def wrap_fsdp(model):
        return FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=next(model.parameters()).device,
                    auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}))

    def held(units, world_size, setup):
        out = {}
        for category, copies in COPIES.items():
            per_unit = [FLOAT32 * copies * (-(-u // world_size) if setup == "fsdp" else u) for u in units]
            out[category] = sum(per_unit)
        return out

    def sent_per_step(units, world_size, setup):
        n = world_size
        if setup == "ddp":
            reduce_scatter = all_gather = sum(FLOAT32 * u * (n - 1) / n for u in units)
            return reduce_scatter + all_gather
        total = 0.0
        for i, u in enumerate(units):
            gathers = 1 if i == len(units) - 1 else 2   # the root stays gathered for backward
            total += (gathers + 1) * FLOAT32 * u * (n - 1) / n
        return total

    predicted = {"held": held, "sent_per_step": sent_per_step}
''')


@pytest.fixture(scope="module")
def b_clusters(cluster2, cluster3, cluster4):
    return [cluster2, cluster3, cluster4]


@pytest.fixture(scope="module")
def b_reference(b_clusters):
    wrap_ddp, wrap_fsdp, predicted = define(B, "wrap_ddp", "wrap_fsdp", "predicted")
    start = time.monotonic()
    report, measured = measured_once(exercise_b, lambda: dpc.exercises.check_b(wrap_ddp, wrap_fsdp, predicted,
                                                                              cluster=b_clusters))
    print(f"exercise B checked in {time.monotonic() - start:.1f} s")
    return report, measured


def test_b_reference_passes_and_prints_no_judged_value(b_reference, cluster2):
    report, measured = b_reference
    assert report.passed and f"passed ({len(report.items)} of {len(report.items)} checks)" in str(report), str(report)
    assert len(report.items) == 14
    shown = str(report)
    for case in measured.cases:
        for key in ("ddp", "fsdp"):
            for what in exercise_b.CATEGORIES + ("sent_per_step",):
                value = case.measured(key, what)
                assert f"{round(value):,}" not in shown and str(round(value)) not in shown, (case.n, key, what)
    assert "steps/s" in report.note and "peak" in report.note and "collective" in report.note
    assert cluster2.run(lambda: 1) == [1, 1]  # usable after the large model's failure


def test_b_the_large_model_runs_out_of_the_budget_under_ddp_and_fits_under_full_shard(b_reference):
    report, measured = b_reference
    ddp = item(report, f"the large model in {exercise_b.BUDGET_MIB} MiB per rank: DDP")
    fsdp = item(report, f"the large model in {exercise_b.BUDGET_MIB} MiB per rank: FULL_SHARD")
    if exercise_b.budget_enforced():
        assert re.search(r"DDP ran out of the 64 MiB budget on rank \d \(RuntimeError: the allocator refused "
                         r"[\d.]+ MiB more\): every rank holds the whole model, its gradients and Adam's two "
                         r"moments", ddp.detail), ddp.detail
        assert fsdp.detail.startswith("FULL_SHARD fits in 64 MiB on both ranks (its peak added"), fsdp.detail
        large = measured.large
        assert large["ddp"]["outcome"] == "out of memory" and large["fsdp"]["outcome"] == "fits"
        # measured without a budget, DDP needs far more than the budget; FULL_SHARD keeps a margin
        assert large["ddp"]["peak"] > 1.2 * (exercise_b.BUDGET_MIB << 20) > 1.4 * large["fsdp"]["peak"]
    assert ddp.status == "pass" and fsdp.status == "pass"
    assert "your formulas say 64.7 MiB between steps" in ddp.detail
    assert "your formulas say 32.4 MiB between steps" in fsdp.detail


def test_b_independent_set_ups_and_formulas_pass(b_clusters):
    report = dpc.exercises.check_b(*define(B_INDEPENDENT, "wrap_ddp", "wrap_fsdp", "predicted"), cluster=b_clusters)
    assert report.passed, str(report)


B_FORMULA_MISTAKES = [
    ("FSDP's parameters not divided by N",
     [('    return {"parameters": 4 * share,', '    return {"parameters": 4 * P,')],
     "prediction: FULL_SHARD parameters per rank", "too high by a factor of about 2 -- FULL_SHARD keeps 1/N"),
    ("Adam's state as one moment",
     [('"optimizer_state": 8 * share}', '"optimizer_state": 4 * share}')],
     "prediction: DDP optimizer state per rank", "how many tensors the size of the parameters does Adam keep"),
    ("the ring sends everything",
     [("    ring = (N - 1) / N ", "    ring = 1  ")],
     "prediction: DDP sent per step", "a rank sends (N-1)/N of the data per phase"),
    ("FSDP sends 2 psi",
     [("    return ring * (psi + (psi - root) + psi)", "    return ring * 2 * psi")],
     "prediction: FULL_SHARD sent per step", "too low by 20 % to 75 % -- count FULL_SHARD's collectives"),
    ("a formula of one model",
     [("    P = sum(units) ", "    P = 54792      ")],
     "prediction: FULL_SHARD gradients per rank", "on 3 ranks with units=[3168, 9312, 9312, 776]: too high"),
]


@pytest.mark.parametrize("mistake, edits, failing, words", B_FORMULA_MISTAKES, ids=[m[0] for m in B_FORMULA_MISTAKES])
def test_b_each_formula_mistake_fails_with_its_idea_named(b_reference, monkeypatch, mistake, edits, failing, words):
    monkeypatch.setattr(exercise_b, "_measure", lambda *args: b_reference[1])
    report = dpc.exercises.check_b(*define(edited(B, *edits), "wrap_ddp", "wrap_fsdp", "predicted"))
    bad = item(report, failing)
    assert bad.status == "fail" and words in bad.detail, str(report)
    assert_teaches(report, B)
    if mistake == "a formula of one model":
        assert "does it use units and world_size everywhere" in bad.detail


B_CALCULATORS = textwrap.dedent('''
    import dpcourse as dpc
    from dpcourse.collectives import step_bytes

    def held(units, world_size, setup):
        book = dpc.memory.ledger(sum(units), world_size, "FULL_SHARD" if setup == "fsdp" else "ddp", units=units)
        return {c: book.bytes[c] for c in ("parameters", "gradients", "optimizer_state")}

    def sent_per_step(units, world_size, setup):
        return sum(step_bytes("FULL_SHARD" if setup == "fsdp" else "ddp", world_size, units).values())

    predicted = {"held": held, "sent_per_step": sent_per_step}
''')


def test_b_a_formula_that_calls_the_course_calculators_is_refused(b_reference, monkeypatch):
    monkeypatch.setattr(exercise_b, "_measure", lambda *args: b_reference[1])
    wrap_ddp, wrap_fsdp = define(B, "wrap_ddp", "wrap_fsdp")
    report = dpc.exercises.check_b(wrap_ddp, wrap_fsdp, *define(B_CALCULATORS, "predicted"))
    for key in ("DDP", "FULL_SHARD"):
        for what in ("parameters per rank", "gradients per rank", "optimizer state per rank"):
            refused = item(report, f"prediction: {key} {what}")
            assert refused.status == "fail" and refused.detail.startswith(
                "refused: held() uses dpc.memory.ledger, the course's own calculator"), str(report)
        sent = item(report, f"prediction: {key} sent per step")
        assert sent.status == "fail" and "sent_per_step() uses dpc.collectives.step_bytes" in sent.detail
    assert "your formulas say" not in str(report)


def test_the_calculators_are_found_in_every_spelling_without_running_the_formula():
    source = textwrap.dedent('''
        import dpcourse as dpc
        import dpcourse.memory as m
        from dpcourse.memory import ledger, recommend
        from dpcourse import collectives

        def direct(u, n, s): return dpc.memory.ledger(sum(u), n, "ddp").bytes
        def aliased(u, n, s): return m.ledger(sum(u), n, "ddp").bytes
        def imported(u, n, s): return ledger(sum(u), n, "ddp").bytes
        def sent(u, n, s): return collectives.step_bytes("ddp", n, u)
        def rule(u, n, s): return recommend(sum(u), n, 2**30)
        def helper(u, n): return ledger(sum(u), n, "ddp")
        def via_helper(u, n, s): return helper(u, n).bytes
        def closure():
            calc = dpc.memory.ledger
            return lambda u, n, s: calc(sum(u), n, "ddp").bytes
        book = dpc.memory.ledger(1000, 2, "ddp")
        def result(u, n, s): return book.bytes
        def comprehension(u, n, s): return [dpc.collectives.step_bytes("ddp", n, [x]) for x in u]
        def honest(u, n, s): return {"parameters": 4 * sum(u) / (n if s == "fsdp" else 1)}
        def uses_models(u, n, s): return sum(dpc.models.unit_numels(dpc.models.build_model("mlp")))
    ''')
    space = {"__name__": "exercise_cell"}
    exec(source, space)  # noqa: S102
    found = {name: setups.calculator_in(space[name] if name != "closure" else space[name]())
             for name in ("direct", "aliased", "imported", "sent", "rule", "via_helper", "closure", "result",
                          "comprehension", "honest", "uses_models")}
    assert found == {"direct": "dpc.memory.ledger", "aliased": "dpc.memory.ledger", "imported": "dpc.memory.ledger",
                     "sent": "dpc.collectives.step_bytes", "rule": "dpc.memory.recommend",
                     "via_helper": "dpc.memory.ledger", "closure": "dpc.memory.ledger",
                     "result": "a Ledger made by the course's calculators (dpc.memory.ledger)", "comprehension": "dpc.collectives.step_bytes",
                     "honest": None, "uses_models": None}


def test_b_a_wrong_set_up_leaves_its_predictions_not_judged_and_the_ratio_unsaid(b_clusters):
    source = edited(B, ("        fully_shard(block)      # reshard_after_forward=True: FULL_SHARD",
                        "        fully_shard(block, reshard_after_forward=False)"),
                    ("    return fully_shard(model)   # ... then the root",
                     "    return fully_shard(model, reshard_after_forward=False)"),
                    ("    ring = (N - 1) / N ", "    ring = 1  "))
    report = dpc.exercises.check_b(*define(source, "wrap_ddp", "wrap_fsdp", "predicted"), cluster=b_clusters)
    wrong = item(report, "your FSDP set-up is FULL_SHARD")
    assert wrong.status == "fail" and "SHARD_GRAD_OP" in wrong.detail, str(report)
    for what in ("parameters per rank", "gradients per rank", "optimizer state per rank", "sent per step"):
        fsdp = item(report, f"prediction: FULL_SHARD {what}")
        assert fsdp.status == "skip" and fsdp.detail == "not judged: the set-up is not FULL_SHARD", str(report)
    large = item(report, "the large model in 64 MiB per rank: FULL_SHARD")
    assert large.status == "skip" and large.detail == "not judged: the set-up is not FULL_SHARD"
    assert item(report, "prediction: DDP sent per step").status == "fail"
    assert "times DDP's bytes" not in report.note, report.note   # the ratio would give FSDP's figure away
    assert_teaches(report, B)


def test_b_no_ddp_at_all_fails_its_set_up_item(b_clusters):
    source = edited(B, ("    return DDP(model)", "    return model"))
    report = dpc.exercises.check_b(*define(source, "wrap_ddp", "wrap_fsdp", "predicted"), cluster=b_clusters)
    bad = item(report, "your DDP set-up trains like one process")
    assert bad.status == "fail" and "average (not sum) the gradients" in bad.detail, str(report)
    assert_teaches(report, B)


def test_b_where_no_budget_can_be_enforced_the_peak_is_compared_and_the_report_says_so():
    entry = {"enforced": False, "steps_per_second": 5.0, "why": ""}
    large = {"ddp": dict(entry, outcome="over", peak=106 << 20), "fsdp": dict(entry, outcome="fits", peak=47 << 20)}
    report = Report("Exercise B")
    exercise_b._judge_large(report, large, {"held": (None, "no prediction yet")})
    ddp, fsdp = report.items
    assert ddp.status == fsdp.status == "pass"
    assert "DDP's measured peak, 106.0 MiB per rank, is over the 64 MiB budget" in ddp.detail
    assert "FULL_SHARD's measured peak, 47.0 MiB per rank, is within the 64 MiB budget" in fsdp.detail
    assert all("cannot refuse a process memory beyond a budget" in i.detail for i in report.items)


def test_b_an_out_of_memory_error_is_told_from_another_failure():
    from dpcourse.pool.errors import RankError, RankReport

    oom = RankError([RankReport(0, "finished"), RankReport(1, "raised", "raised RuntimeError: [enforce fail at "
                     "alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                     "4194304 bytes. Error code 12 (Cannot allocate memory)")], restarted=True)
    assert exercise_b._out_of_memory(oom) == (1, "RuntimeError: the allocator refused 4.0 MiB more")
    on_gpu = RankError([RankReport(0, "raised", "raised OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                                "4.00 MiB. GPU 0 has a total capacity of 139.81 GiB")], restarted=True)
    assert exercise_b._out_of_memory(on_gpu) == (0, "OutOfMemoryError: the allocator refused 4.00 MiB more")
    other = RankError([RankReport(0, "raised", "raised ValueError: bad shape")], restarted=False)
    assert exercise_b._out_of_memory(other) is None


def test_b_untouched_starter_is_not_attempted():
    nb = nbformat.read(NOTEBOOKS / "B-ddp-vs-fsdp.ipynb", as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code" and
                       ("def wrap_ddp" in c.source or "predicted = {" in c.source))
    wrap_ddp, wrap_fsdp, predicted = define("import dpcourse as dpc\n" + source, "wrap_ddp", "wrap_fsdp", "predicted")
    report = dpc.exercises.check_b(wrap_ddp, wrap_fsdp, predicted)
    assert not report.attempted and "wrap_ddp and wrap_fsdp" in str(report)
    held, sent = predicted["held"], predicted["sent_per_step"]
    assert setups.calculator_in(held) is None and held([1, 2], 2, "ddp")["parameters"] is ...
    assert sent([1, 2], 2, "ddp") is ...


def test_b_a_miss_is_told_coarsely():
    assert dpc.exercises.setups.miss(104, 100, 0.05) == (True, "within 5%")
    assert dpc.exercises.setups.miss(112, 100, 0.05) == (False, "too high by less than 20 %")
    assert dpc.exercises.setups.miss(60, 100, 0.05) == (False, "too low by 20 % to 75 %")
    assert dpc.exercises.setups.miss(400, 100, 0.05) == (False, "too high by a factor of about 4")


def test_b_steps_per_second_are_medians_with_their_range_and_compared_only_beyond_noise():
    # synthetic step times (seconds), as a loaded machine gives them: one step slowed a lot
    rate = setups.throughput([0.010, 0.012, 0.050, 0.011, 0.0125])
    assert rate == {"median": pytest.approx(1 / 0.012), "low": pytest.approx(20.0), "high": pytest.approx(100.0),
                    "steps": 5}
    assert setups.said_rate(rate) == "median 83 steps/s, range 20–100 over 5 steps"
    assert setups.throughput([]) is None and setups.throughput([0.0]) is None
    # DDP's steps all faster than FULL_SHARD's, taken in turn: the direction, the ratio and its spread
    ddp, fsdp = [0.004, 0.005, 0.020, 0.004], [0.030, 0.040, 0.032, 0.036]
    both = exercise_b._compare(ddp, fsdp)
    assert both["faster"] == "ddp" and both["ratio"] == pytest.approx(0.034 / 0.0045)
    assert (both["low"], both["high"], both["pairs"]) == (pytest.approx(1.6), pytest.approx(9.0), 4)
    said = exercise_b._said_side_by_side(both)
    assert "DDP is faster, 7.6 times FULL_SHARD's steps/s at the median (1.6–9.0 times step by step" in said, said
    assert "DDP median 222 steps/s, range 50–250 over 4 steps" in said, said
    # the other way round: the ratio is the faster one's over the other's
    assert exercise_b._compare(fsdp, ddp)["faster"] == "fsdp"
    assert "FULL_SHARD is faster, 7.6 times DDP's" in exercise_b._said_side_by_side(exercise_b._compare(fsdp, ddp))
    # overlapping ranges: within noise, no direction
    close = exercise_b._compare([0.010, 0.030, 0.012], [0.011, 0.015, 0.031])
    assert close["faster"] is None
    said = exercise_b._said_side_by_side(close)
    assert "within noise" in said and " is faster" not in said, said
    assert exercise_b._compare([], fsdp) is None


# --- Exercise C ----------------------------------------------------------------------------------

# Written apart from the reference: FSDP1, and the figures from a table of what each
# configuration shards over and gathers, with FSDP1's padded flat units.
C_FSDP1 = textwrap.dedent('''
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def fsdp1(model, strategy, wrap=True, **options):
        policy = ModuleWrapPolicy({type(model.blocks[0])}) if wrap else None
        return FSDP(model, sharding_strategy=strategy, auto_wrap_policy=policy,
                    device_id=next(model.parameters()).device, **options)

    configs = {
        "FULL_SHARD": lambda m: fsdp1(m, ShardingStrategy.FULL_SHARD),
        "SHARD_GRAD_OP": lambda m: fsdp1(m, ShardingStrategy.SHARD_GRAD_OP),
        "HYBRID_SHARD": lambda m: fsdp1(m, ShardingStrategy.HYBRID_SHARD, device_mesh=init_device_mesh(
            next(m.parameters()).device.type, (2, 2), mesh_dim_names=("replicate", "shard"))),
        "one unit": lambda m: fsdp1(m, ShardingStrategy.FULL_SHARD, wrap=False),
    }

    # config: (ranks a unit is sharded over, units gathered at the fullest moment, gathers per unit per step)
    TABLE = {"FULL_SHARD": (4, "one", 2), "SHARD_GRAD_OP": (4, "all", 1), "HYBRID_SHARD": (2, "one", 2),
             "one unit": (4, "whole", 1)}

    def predict(units, world_size, config):
        shard, gathered, gathers = TABLE[config]
        if config == "one unit":
            units = [sum(units)]
        flat = [-(-u // shard) * shard for u in units]          # FSDP1 pads each flat unit
        at_rest = sum(4 * 4 * f // shard for f in flat)
        biggest = max(flat)
        peak = at_rest + {"one": 2 * 4 * biggest, "all": 4 * sum(flat) + 4 * biggest,
                          "whole": 2 * 4 * sum(flat)}[gathered]
        sent = 0.0
        for i, f in enumerate(flat):
            again = gathers if i < len(flat) - 1 else 1         # the root stays gathered for backward
            sent += (again + 1) * 4 * f * (shard - 1) / shard
        if shard < world_size:
            sent += 4 * sum(flat) / shard                       # all-reduce of each shard across 2 groups
        return {"at_rest": at_rest, "peak": peak, "sent_per_step": sent}
''')


@pytest.fixture(scope="module")
def c_reference(cluster4):
    configs, predict = define(C, "configs", "predict")
    start = time.monotonic()
    report, measured = measured_once(exercise_c, lambda: dpc.exercises.check_c(configs, predict, cluster=cluster4))
    print(f"exercise C checked in {time.monotonic() - start:.1f} s")
    return report, measured


def test_c_reference_passes_and_prints_no_judged_value(c_reference):
    report, (_, runs, _) = c_reference
    assert report.passed and len(report.items) == 11, str(report)
    assert report.note.startswith("The machine's run") and not re.search(r"\d{4,}", report.note)
    shown = str(report)
    for held, comm, _ in runs.values():
        for value in (sum(held.at_rest(0).values()), held.peak(0)[0], sum(comm.bytes(rank=0, step=-1).values())):
            assert str(round(value)) not in shown and f"{round(value):,}" not in shown
    assert "HYBRID_SHARD < one unit" in item(report, "prediction: the order at the fullest").detail


def test_c_fsdp1_configurations_and_figures_written_differently_pass(cluster4):
    report = dpc.exercises.check_c(*define(C_FSDP1, "configs", "predict"), cluster=cluster4)
    assert report.passed, str(report)


def blank(model):
    ...


C_SET_UP_MISTAKES = [
    ("FULL_SHARD kept gathered", "FULL_SHARD",
     [("def full_shard(model):      # FSDP1: FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD,\n"
       "    return per_block(model)",
       "def full_shard(model):\n    return per_block(model, reshard_after_forward=False)")],
     "gathered only once"),
    ("HYBRID on a 1-D mesh", "HYBRID_SHARD",
     [("    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=(\"replicate\", \"shard\"))",
       "    mesh = init_device_mesh(device, (4,))")],
     "a 2-D mesh"),
    ("one unit per block", "one unit",
     [("def one_unit(model):         # FSDP1: FULL_SHARD without an auto_wrap_policy\n    return fully_shard(model)",
       "def one_unit(model):\n    return per_block(model)")],
     "no auto-wrap policy"),
]


@pytest.mark.parametrize("mistake, name, edits, words", C_SET_UP_MISTAKES, ids=[m[0] for m in C_SET_UP_MISTAKES])
def test_c_each_set_up_mistake_fails_and_leaves_its_figures_not_judged(cluster4, mistake, name, edits, words):
    configs, predict = define(edited(C, *edits), "configs", "predict")
    only = {n: (wrap if n == name else blank) for n, wrap in configs.items()}   # the others: not run
    report = dpc.exercises.check_c(only, predict, cluster=cluster4)
    bad = item(report, f"{name}: trains")
    assert bad.status == "fail" and words in bad.detail, str(report)
    figures = item(report, f"prediction: {name} per rank")
    assert figures.status == "skip" and figures.detail == f"not judged: the set-up is not {name}", str(report)
    assert_teaches(report, C)


C_FIGURE_MISTAKES = [
    ("HYBRID counted as FULL_SHARD",
     [('    shard = 2 if config == "HYBRID_SHARD" else world_size', "    shard = world_size")],
     "prediction: HYBRID_SHARD per rank", "held between steps too low by a factor of about 2 (HYBRID_SHARD shards "
                                          "over a group of 2 and keeps one replica per group)",
     "prediction: the order between steps", "HYBRID_SHARD"),
    ("one unit's peak as one block",
     [("        gathered = 4 * P + 4 * P", "        gathered = 4 * (block + root) + 4 * block")],
     "prediction: one unit per rank", "at the fullest moment of a step too low by a factor of about 2 (with one "
                                      "unit, what is gathered is the whole model)",
     "prediction: the order at the fullest moment", "one unit"),
    ("SHARD_GRAD_OP gathered again for backward",
     [('    if config in ("SHARD_GRAD_OP", "one unit"):', '    if config == "one unit":')],
     "prediction: SHARD_GRAD_OP per rank", "bytes sent per step too high by 20 % to 75 % (how often is each unit",
     "prediction: the order of bytes sent per step", "SHARD_GRAD_OP"),
]


@pytest.mark.parametrize("mistake, edits, failing, words, order, named", C_FIGURE_MISTAKES,
                         ids=[m[0] for m in C_FIGURE_MISTAKES])
def test_c_each_figure_mistake_fails_with_its_idea_named(c_reference, monkeypatch, mistake, edits, failing, words,
                                                         order, named):
    monkeypatch.setattr(exercise_c, "_measure", lambda *args: c_reference[1])
    report = dpc.exercises.check_c(*define(edited(C, *edits), "configs", "predict"))
    bad = item(report, failing)
    assert bad.status == "fail" and words in bad.detail, str(report)
    wrong = item(report, order)
    assert wrong.status == "fail" and named in wrong.detail, str(report)
    assert_teaches(report, C)


def test_c_an_order_without_figures_does_not_pass(c_reference, monkeypatch):
    """Swapping pairs until the orders hold is no way through: each figure is judged too."""
    monkeypatch.setattr(exercise_c, "_measure", lambda *args: c_reference[1])
    places = {"at_rest": ["FULL_SHARD", "SHARD_GRAD_OP", "one unit", "HYBRID_SHARD"],
              "peak": ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "one unit"],
              "sent_per_step": ["SHARD_GRAD_OP", "one unit", "HYBRID_SHARD", "FULL_SHARD"]}

    def predict(units, world_size, config):
        return {key: 1000.0 * (order.index(config) + 1) for key, order in places.items()}

    report = dpc.exercises.check_c(define(C, "configs")[0], predict)
    assert not report.passed
    assert all(item(report, f"prediction: {n} per rank").status == "fail" for n in exercise_c.CONFIGS), str(report)
    assert "too low by a factor of about" in item(report, "prediction: HYBRID_SHARD per rank").detail


def test_c_a_predict_that_calls_the_ledger_is_refused(c_reference, monkeypatch):
    monkeypatch.setattr(exercise_c, "_measure", lambda *args: c_reference[1])
    source = textwrap.dedent('''
        import dpcourse as dpc

        def predict(units, world_size, config):
            strategy = {"one unit": "FULL_SHARD"}.get(config, config)
            book = dpc.memory.ledger(sum(units), world_size, strategy, units=units)
            return {"at_rest": book.total, "peak": book.peak, "sent_per_step": 0}
    ''')
    report = dpc.exercises.check_c(define(C, "configs")[0], *define(source, "predict"))
    for name in exercise_c.CONFIGS:
        refused = item(report, f"prediction: {name} per rank")
        assert refused.status == "fail" and refused.detail.startswith(
            "refused: predict() uses dpc.memory.ledger, the course's own calculator"), str(report)
    assert item(report, "prediction: the order between steps").status == "skip"


def test_c_untouched_starter_is_not_attempted():
    nb = nbformat.read(NOTEBOOKS / "C-sharding-strategies.ipynb", as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code" and
                       ("def full_shard" in c.source or "def predict" in c.source))
    configs, predict = define("import dpcourse as dpc\n" + source, "configs", "predict")
    report = dpc.exercises.check_c(configs, predict)
    assert not report.attempted and "four wrap functions" in str(report)
    assert exercise_c._figures(predict, [1, 2]) == ({}, "no prediction yet")


def test_b_and_c_check_only_what_they_are_given():
    with pytest.raises(ValueError, match="its keys are"):
        dpc.exercises.check_c({"ZERO": lambda m: m}, None)
    assert exercise_b.SIZES == exercise_c.SIZES  # the same MLP in both exercises
    assert [n for n, _ in exercise_b.CASES] == [2, 3, 4]
    assert len({tuple(sorted(s.items())) for _, s in exercise_b.CASES}) == 3


@pytest.mark.parametrize("name, solution, checker, starters", [
    ("B-ddp-vs-fsdp.ipynb", "B", "check_b(", ("def wrap_ddp", "predicted = {")),
    ("C-sharding-strategies.ipynb", "C", "check_c(", ("def full_shard", "def predict"))])
def test_notebook_with_the_solution_filled_in(name, solution, checker, starters):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and any(s in c.source for s in starters)]
    cells[0].source = dpc.exercises.solution(solution)
    for cell in cells[1:]:
        cell.source = "pass"
    NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    shown = [o["data"]["text/plain"] for c in nb.cells if c.cell_type == "code" and checker in c.source
             for o in c.get("outputs", []) if o.get("output_type") == "execute_result"]
    assert shown and "passed" in shown[0], shown


def test_the_notebooks_say_what_the_checkers_do():
    text_b = " ".join("".join(c.source) for c in nbformat.read(NOTEBOOKS / "B-ddp-vs-fsdp.ipynb", as_version=4).cells)
    text_b = re.sub(r"\s+", " ", text_b)
    P = sum(p.numel() for p in dpc.models.build_model("mlp", **exercise_b.LARGE).parameters())
    for said in (f"for {exercise_b.STEPS} steps", f"**{exercise_b.BUDGET_MIB} MiB**",
                 f"width {exercise_b.LARGE['d_hidden']}, {exercise_b.LARGE['depth']} blocks",
                 f"{P / 1e6:.1f} million parameters", f"{round(exercise_b.TOLERANCE * 100)} %", "RLIMIT_DATA"):
        assert said in text_b, said
    text_c = " ".join("".join(c.source) for c in
                      nbformat.read(NOTEBOOKS / "C-sharding-strategies.ipynb", as_version=4).cells)
    text_c = re.sub(r"\s+", " ", text_c)
    for said in (f"peak within {round(exercise_c.PEAK_TOLERANCE * 100)} %",
                 f"at rest and bytes within {round(exercise_c.TOLERANCE * 100)} %",
                 f"more than {round(exercise_c.TIE * 100)} %", f"trained {setups.STEPS} steps"):
        assert said in text_c, said


# --- routes round the refusal: each one refused or told, by what the formula does ------------------

B_TABLE = textwrap.dedent('''
    import dpcourse as dpc
    from dpcourse.exercises import exercise_b
    TABLE = {}
    for n, sizes in exercise_b.CASES:
        units = dpc.models.unit_numels(dpc.models.build_model("mlp", **sizes))
        for setup in ("ddp", "fsdp"):
            book = dpc.memory.ledger(sum(units), n, "FULL_SHARD" if setup == "fsdp" else "ddp", units=units)
            TABLE[tuple(units), n, setup] = (
                {c: float(book.bytes[c]) for c in ("parameters", "gradients", "optimizer_state")},
                float(sum(dpc.collectives.step_bytes("FULL_SHARD" if setup == "fsdp" else "ddp", n, units).values())))
    del dpc, exercise_b, book

    def held(units, world_size, setup):
        return dict(TABLE[tuple(units), world_size, setup][0])

    def sent_per_step(units, world_size, setup):
        return TABLE[tuple(units), world_size, setup][1]

    predicted = {"held": held, "sent_per_step": sent_per_step}
''')

B_IMPORTLIB = textwrap.dedent('''
    import importlib

    def held(units, world_size, setup):
        memory = importlib.import_module("dp" + "course.memory")
        book = getattr(memory, "led" + "ger")(sum(units), world_size, "FULL_SHARD" if setup == "fsdp" else "ddp",
                                              units=units)
        return {c: book.bytes[c] for c in ("parameters", "gradients", "optimizer_state")}

    def sent_per_step(units, world_size, setup):
        cost = importlib.import_module("dp" + "course.collectives")
        return sum(getattr(cost, "step_" + "bytes")("FULL_SHARD" if setup == "fsdp" else "ddp", world_size, units).values())

    predicted = {"held": held, "sent_per_step": sent_per_step}
''')

B_EXEC = textwrap.dedent('''
    CODE = "import dpcourse as d\\nbook = d.memory.ledger(P, N, S, units=U)"

    def held(units, world_size, setup):
        space = {"P": sum(units), "N": world_size, "S": "FULL_SHARD" if setup == "fsdp" else "ddp", "U": units}
        exec(CODE, space)
        return {c: space["book"].bytes[c] for c in ("parameters", "gradients", "optimizer_state")}

    def sent_per_step(units, world_size, setup):
        space = {}
        exec("import dpcourse.collectives as c\\nf = c.step_bytes", space)
        return sum(space["f"]("FULL_SHARD" if setup == "fsdp" else "ddp", world_size, units).values())

    predicted = {"held": held, "sent_per_step": sent_per_step}
''')

B_READS_THE_FILE = textwrap.dedent('''
    LEDGER = "LEDGER_PATH"   # found in the kernel

    def held(units, world_size, setup):
        exec(open(LEDGER).read(), {})
        return {}

    sent_per_step = held
    predicted = {"held": held, "sent_per_step": sent_per_step}
''').replace("LEDGER_PATH", str(Path(dpc.__file__).parent / "memory" / "ledger.py"))


def _copied_ledger(folder) -> str:
    """The course's memory calculator copied into a package of the learner's, imports mended."""
    package = folder / "my_ledger"
    package.mkdir()
    root = Path(dpc.__file__).parent
    # the ledger and what it imports; the rule (choice.py) also needs the collectives, left out
    for f in [*(root / "memory").glob("*.py"), root / "vocab.py", root / "models.py"]:
        if f.name != "choice.py":
            (package / f.name).write_text(f.read_text().replace("from .. import", "from . import")
                                          .replace("from ..models", "from .models")
                                          .replace("from .choice import recommend\n", ""))
    return textwrap.dedent('''
        import my_ledger

        def held(units, world_size, setup):
            book = my_ledger.ledger(sum(units), world_size, "FULL_SHARD" if setup == "fsdp" else "ddp", units=units)
            return {c: book.bytes[c] for c in ("parameters", "gradients", "optimizer_state")}

        predicted = {"held": held, "sent_per_step": lambda units, world_size, setup: 0.0}
    ''')


@pytest.mark.parametrize("route", ["table", "importlib", "exec", "reads the file", "a copy in a module"])
def test_b_every_route_to_the_calculators_is_refused_or_fails(route, b_reference, monkeypatch, tmp_path):
    monkeypatch.setattr(exercise_b, "_measure", lambda *args: b_reference[1])
    source = {"table": B_TABLE, "importlib": B_IMPORTLIB, "exec": B_EXEC, "reads the file": B_READS_THE_FILE}.get(route)
    if route == "a copy in a module":
        monkeypatch.syspath_prepend(str(tmp_path))
        source = _copied_ledger(tmp_path)
    wrap_ddp, wrap_fsdp = define(B, "wrap_ddp", "wrap_fsdp")
    report = dpc.exercises.check_b(wrap_ddp, wrap_fsdp, *define(source, "predicted"))
    held = item(report, "prediction: FULL_SHARD parameters per rank")
    assert held.status == "fail", str(report)
    words = {"table": "a model no rank ran", "importlib": "refused: held() reaches for the course's code",
             "exec": "refused: held() reaches for the course's code",
             "reads the file": "refused: held() reaches for the course's code",
             "a copy in a module": "refused: held()'s code is a copy of dpc.memory"}[route]
    assert words in held.detail, str(report)
    if route != "a copy in a module":
        sent = item(report, "prediction: FULL_SHARD sent per step")
        assert sent.status == "fail", str(report)


C_TABLE = textwrap.dedent('''
    import dpcourse as dpc
    from dpcourse.exercises import exercise_c
    _units = tuple(dpc.models.unit_numels(dpc.models.build_model("mlp", **exercise_c.SIZES)))
    _reference = {}
    exec(dpc.exercises.solution("C"), _reference)
    TABLE = {(_units, name): _reference["predict"](list(_units), 4, name) for name in exercise_c.CONFIGS}
    del dpc, exercise_c, _reference

    def predict(units, world_size, config):
        return TABLE[tuple(units), config]
''')


def test_c_a_table_of_the_judged_model_fails_on_a_model_no_rank_ran_and_is_flagged(c_reference, monkeypatch):
    monkeypatch.setattr(exercise_c, "_measure", lambda *args: c_reference[1])
    report = dpc.exercises.check_c(define(C, "configs")[0], *define(C_TABLE, "predict"))
    for name in exercise_c.CONFIGS:
        bad = item(report, f"prediction: {name} per rank")
        assert bad.status == "fail" and "a model no rank ran" in bad.detail, str(report)
    assert report.used_reference and "Used the reference: solution('C')" in str(report)


def test_c_a_configuration_built_by_the_course_training_code_is_refused(cluster4):
    source = textwrap.dedent('''
        import torch
        import dpcourse as dpc
        from dpcourse.train.parallel import apply_fsdp

        def full_shard(model):
            cfg = dpc.train.TrainConfig(model="mlp", sharding_strategy="FULL_SHARD")
            return apply_fsdp(model, torch.device("cpu"), cfg, (type(model.blocks[0]),))
    ''')
    configs = {**define(C, "configs")[0], "FULL_SHARD": define(source, "full_shard")[0]}
    report = dpc.exercises.check_c({"FULL_SHARD": configs["FULL_SHARD"], "SHARD_GRAD_OP": ..., "HYBRID_SHARD": ...,
                                    "one unit": ...}, ..., cluster=cluster4)
    bad = item(report, "FULL_SHARD: trains like one process")
    assert bad.status == "fail" and "refused: the wrap function calls the course's own code" in bad.detail, str(report)
    assert "dpc.train.parallel.apply_fsdp" in bad.detail


def test_a_set_up_reaching_the_course_through_a_thread_or_the_standard_library_is_refused():
    from dpcourse.exercises import setups

    def through_a_thread():
        import threading

        from dpcourse.memory import ledger
        out = []
        t = threading.Thread(target=lambda: out.append(ledger(1000, 2, "ddp")))
        t.start()
        t.join()

    def through_functools():
        import functools

        from dpcourse.train import parallel
        functools.singledispatch(parallel.mixed_precision_dtypes)(dpc.train.TrainConfig())

    for route in (through_a_thread, through_functools):
        with setups.course_code_called() as called:
            route()
        assert called and called[0].startswith(("dpc.memory", "dpc.train.parallel")), (route.__name__, called)
    with setups.course_code_called() as called:
        dpc.models.build_model("mlp")     # the models room is the learner's to use
    assert not called, called
