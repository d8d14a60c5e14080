"""Exercise B: the learner writes a DDP and an FSDP ``FULL_SHARD`` set-up, and the formulas
for what one rank holds and sends under each; the checker runs both and judges.

    predicted = {"held": held, "sent_per_step": sent_per_step}
    report = dpc.exercises.check_b(wrap_ddp, wrap_fsdp, predicted)

``held(units, world_size, setup)`` returns {"parameters", "gradients", "optimizer_state"}:
bytes one rank holds right after ``optimizer.step()``; ``sent_per_step(units, world_size,
setup)`` the bytes one rank sends in one training step, as a bandwidth-optimal ring sends
them. ``units``: parameters (elements) per FSDP unit -- each block, then the root (what is
left: the head) -- a list of ints; ``world_size``: ranks; ``setup``: "ddp" or "fsdp".

Both set-ups train the course's MLP at three sizes on 2, 3 and 4 ranks (``CASES``) under the
course's observers: ``setups.AtRest`` (what each rank holds after each step: the
``Memory`` observer's at-rest walk) and ``Comm`` (the bytes each collective makes a rank
send). Judged: each set-up trains like one process and is what it says (DDP replicates and
all-reduces; FULL_SHARD holds 1/N and gathers every unit again for backward); each formula
on every case, within ``TOLERANCE``, said as too high / too low and roughly by how much,
never as the measured value, and on models no rank ran, drawn at each check, next to the
reference's. The formulas run where the course cannot be reached (``sandbox``): one that uses
the course's own calculators (``dpc.memory.ledger``, ``dpc.collectives.step_bytes``, ...), by
name or by any other route, or copies their code, is refused.

Then the large model (``LARGE``) on 2 ranks with a memory budget of ``BUDGET_MIB`` per rank:
on Linux the budget is enforced for real -- the rank's data-segment limit
(``RLIMIT_DATA``, soft limit only, restored after) is set to what it already uses plus the
budget, so the allocator itself refuses, and the rank's ``RuntimeError`` reaches the kernel as
a ``RankError``. On GPU ranks the CUDA caching allocator's limit does the same
(``set_per_process_memory_fraction``). DDP runs out of it, FULL_SHARD fits. Elsewhere (no
enforceable limit, e.g. macOS) the report says so and compares the ``Memory`` observer's peak
with the budget. The note gives each set-up's peak memory and steps per second: the median
step's, with the range of all; the two set-ups compared by a ratio measured side by side (the
course's MLP, their steps taken in turn on the same ranks: ``_side_by_side``), said as a
direction only when their ranges do not overlap, and as within noise when they do.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping

from .. import models
from ..observe import Comm, Memory
from ..pool import RankError, RankTimeout
from . import setups
from ..grading.judging import RankFailure, blanks_in, clusters_for, run_or_failure, warm_up
from ..grading import provenance
from ..grading.report import Report

# (world size, the MLP's sizes): three models on three world sizes
CASES = ((2, {"d_hidden": 128, "depth": 4}), (3, {"d_hidden": 96, "depth": 3}), (4, {"d_hidden": 160, "depth": 5}))
SIZES = CASES[0][1]   # the course's MLP
STEPS = 5             # Adam steps per run: judged after the last; the first warms up
TOLERANCE = 0.05
CATEGORIES = ("parameters", "gradients", "optimizer_state")
NAMES = {"ddp": "DDP", "fsdp": "FULL_SHARD"}
# the model that does not fit under DDP and fits under FULL_SHARD on 2 ranks: 4.2 M parameters,
# 16 MiB of float32. DDP needs about 90 MiB per rank, FULL_SHARD about 46 (measured here).
LARGE = {"d_hidden": 1024, "depth": 5}
LARGE_STEPS = 4
BUDGET_MIB = 64
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


@provenance.judged("B")
def check_b(wrap_ddp, wrap_fsdp, predicted, cluster=None, timeout: float = 120.0) -> Report:
    """Run the learner's two set-ups on 2, 3 and 4 ranks, judge them and the formulas, and run
    them on the large model within a memory budget.

    predicted: {"held": held, "sent_per_step": sent_per_step}, two functions of (units,
    world_size, setup) -- see the module's docstring. cluster: a ``dpc.Cluster`` (or a list
    of them) to reuse where its size fits; others are started and shut down.
    """
    report = Report("Exercise B", key="B")
    wraps = {"ddp": wrap_ddp, "fsdp": wrap_fsdp}
    blanks = [fn.__name__ for fn in wraps.values() if blanks_in(fn)]
    if blanks:
        report.attempted = False
        report.note = f"Write the wrapping lines in {' and '.join(blanks)} (replace the `...`), then run this cell again."
        return report
    formulas = _formulas(predicted)
    measured = _measure(wraps, cluster, timeout)
    answers = _answers(formulas, measured.cases)
    for name, ok, detail in measured.set_ups:
        report.add(name, ok, detail)
    judged = {}
    for key in NAMES:
        for what in CATEGORIES + ("sent_per_step",):
            name = (f"prediction: {NAMES[key]} {what.replace('_', ' ')}"
                    + ("" if what == "sent_per_step" else " per rank"))
            ok, detail = _judge_prediction(key, what, formulas, measured.cases, measured.kinds[key], answers)
            judged[key, what] = ok is True
            report.add(name, ok, detail)
    _judge_large(report, measured.large, formulas, answers)
    report.note = _explain(measured.cases, measured.large,
                           judged.get(("ddp", "sent_per_step")) and judged.get(("fsdp", "sent_per_step")))
    if not report.passed:
        report.note = (report.note + " Each failed item says what the ranks did. To compare with a reference: "
                       "report.fix().").strip()
    return report


class _Measured:
    """What the ranks did with the two set-ups: ``cases`` (each with its runs), ``set_ups``
    (the set-up items: name, ok, detail), ``kinds`` ({"ddp"/"fsdp": whether it is what it
    says, None: it did not run}) and ``large`` (see ``_large_model``). Nothing of the
    learner's formulas: they are judged against it in the kernel."""

    def __init__(self, cases, set_ups, kinds, large):
        self.cases, self.set_ups, self.kinds, self.large = cases, set_ups, kinds, large


def _measure(wraps: dict, cluster, timeout: float) -> _Measured:
    """Run both set-ups on every case, judge what they are, then the large model."""
    cases = [_Case(n, sizes) for n, sizes in CASES]
    with clusters_for(cluster, sorted({n for n, _ in CASES})) as clusters:
        for case in cases:
            for key, wrap in wraps.items():
                if any(isinstance(c.runs.get(key), RankFailure) for c in cases):
                    continue  # it failed on a smaller case already: the same error again
                held, comm = setups.AtRest(), Comm()
                out = run_or_failure(clusters[case.n], setups.train_wrapped, wrap, case.sizes, STEPS,
                                     timeout=timeout, observe=[held, comm])
                case.runs[key] = out if isinstance(out, RankFailure) else (out, held, comm)
        set_ups, kinds = _judge_set_ups(cases)
        large = _large_model(clusters[2], wraps, kinds, timeout)
    return _Measured(cases, set_ups, kinds, large)


class _Case:
    """One model on one world size: its units, and each set-up's run."""

    def __init__(self, n: int, sizes: dict):
        self.n, self.sizes = n, sizes
        self.model = models.build_model("mlp", **sizes)
        self.units = models.unit_numels(self.model)
        self.runs: dict = {}  # "ddp"/"fsdp" -> (results, AtRest, Comm) or a RankFailure

    @property
    def where(self) -> str:
        return f"on {self.n} ranks with units={self.units}"

    def measured(self, key: str, what: str) -> float:
        _, held, comm = self.runs[key]
        return sum(comm.bytes(rank=0, step=-1).values()) if what == "sent_per_step" else held.at_rest(0)[what]


# --- the set-ups ---------------------------------------------------------------------------------

def _judge_set_ups(cases: list) -> tuple[list, dict]:
    """The set-up items [(name, ok, detail)], and {"ddp": True/False/None, "fsdp": ...}:
    whether each is what it says (None: it did not run)."""
    items, references = [], {}
    for key in NAMES:
        ok, detail, worst = True, "", 0.0
        for case in cases:
            run = case.runs.get(key)
            if isinstance(run, RankFailure):
                ok, detail = False, f"on {case.n} ranks: {run.describe(120)}"
                break
            if run is None:
                continue
            if case.n not in references:
                references[case.n] = setups.one_process(case.sizes, case.n, STEPS)
            fine, said = setups.weights_verdict(run[0], references[case.n])
            if not fine:
                ok, detail = False, f"on {case.n} ranks: {said}"
                break
            worst = max(worst, float(said.rsplit(" ", 1)[1]))
        if ok:
            detail = f"on {setups.many([c.n for c in cases])} ranks, largest difference {worst:.1e}"
        items.append((f"your {NAMES[key]} set-up trains like one process", ok, detail))
    kinds = {}
    for key, judge, name in (("ddp", _judge_ddp, "your DDP set-up replicates: every rank holds all parameters and "
                                                  "all-reduces the gradients"),
                             ("fsdp", _judge_full_shard, "your FSDP set-up is FULL_SHARD: 1/N of the parameters per "
                                                         "rank, every unit gathered again for backward")):
        verdict = (None, "judged once it runs")
        for case in cases:
            run = case.runs.get(key)
            if not isinstance(run, tuple):
                verdict = (None, "judged once it runs")
                break
            verdict = judge(run, case)
            if verdict[0] is False:
                verdict = (False, f"on {case.n} ranks: {verdict[1]}")
                break
        kinds[key] = verdict[0]
        items.append((name, *verdict))
    return items, kinds


def _judge_ddp(run, case) -> tuple[bool, str]:
    _, held, comm = run
    full = 4 * sum(case.units)
    calls = comm.calls(rank=0, step=-1)
    if any(held.at_rest(r)["parameters"] < full for r in range(case.n)):
        return False, "a rank holds only part of the parameters: that is sharding, not DDP"
    if "all_reduce" not in calls or "all_gather" in calls:
        return False, (f"a step's collectives were {dict(calls)}: a replica's gradients are averaged by "
                       "all-reduce, and nothing is gathered, in a DDP step")
    return True, "a full replica on every rank; the gradients all-reduced"


def _judge_full_shard(run, case) -> tuple[bool, str]:
    _, held, comm = run
    full = 4 * sum(case.units)
    shares = [held.at_rest(r)["parameters"] / full for r in range(case.n)]
    calls = comm.calls(rank=0, step=-1)
    if any(abs(s - 1 / case.n) > 0.05 for s in shares):
        return False, (f"the ranks hold {', '.join(f'{s:.0%}' for s in shares)} of the parameters between steps: "
                       "FULL_SHARD shards them over all ranks")
    gathers, scatters = calls.get("all_gather", 0), calls.get("reduce_scatter", 0)
    if not scatters:
        return False, f"a step's collectives were {dict(calls)}: FSDP reduce-scatters the gradients"
    if gathers <= scatters:
        return False, (f"{gathers} all-gather(s) for {scatters} unit(s) per step: every unit was gathered "
                       "only once, so the parameters stayed gathered from forward to backward -- that is "
                       "SHARD_GRAD_OP (reshard_after_forward=False), or a single unit for the whole model, "
                       "which FSDP keeps gathered: make each block a unit of its own")
    return True, "sharded over all ranks; every unit gathered again for backward"


# --- the formulas --------------------------------------------------------------------------------

def _formulas(predicted) -> dict:
    """{"held": (fn, problem), "sent_per_step": (fn, problem)}: problem "" when fn can be judged."""
    out = {}
    for part in ("held", "sent_per_step"):
        fn = predicted.get(part, ...) if isinstance(predicted, Mapping) else ...
        if fn is ... or fn is None:
            out[part] = (None, "no prediction yet" if isinstance(predicted, Mapping) else
                         'predicted = {"held": held, "sent_per_step": sent_per_step}: two functions, please')
        elif not callable(fn):
            out[part] = (None, f"predicted[{part!r}] is a {type(fn).__name__}: a function of (units, world_size, "
                               "setup), please")
        else:
            used = setups.calculator_in(fn)
            out[part] = (fn, f"refused: {getattr(fn, '__name__', part)}() uses {used}, the course's own calculator "
                             "-- write the formula yourself, from units, world_size and setup" if used else "")
    return out


UNSEEN = 3   # models no rank ran, drawn at each check: a formula is judged on them too, against the reference's


def _unseen(draw=None) -> list[tuple[list, int]]:
    """(units, world_size) of ``UNSEEN`` models drawn now, from a space no table covers: 3 to 8
    blocks of 1,000 to 10 million parameters each, a root of 1 to 5 % of them (the head, as in
    the course's MLP, where leaving the root out of FULL_SHARD's sum is within tolerance), on
    2 to 1,024 ranks."""
    import random

    draw = draw or random.Random()
    out = []
    for _ in range(UNSEEN):
        blocks = [draw.randint(1_000, 10_000_000) for _ in range(draw.randint(3, 8))]
        out.append((blocks + [max(1, int(sum(blocks) * draw.uniform(0.01, 0.05)))], draw.randint(2, 1024)))
    return out


def _answers(formulas: dict, cases: list) -> setups.Answers:
    """The learner's formulas on every case, the large model and ``_unseen`` models, computed
    where the course cannot be reached; a formula refused there gets its reason as problem."""
    fns = {part: fn for part, (fn, problem) in formulas.items() if fn is not None and not problem}
    units_large = models.unit_numels(models.build_model("mlp", **LARGE))
    shapes = [(list(c.units), c.n) for c in cases] + [(units_large, 2)] + _unseen()
    calls = [(part, (units, n, key)) for part in fns for units, n in shapes for key in NAMES]
    answers = setups.Answers(fns, calls, "from units, world_size and setup")
    answers.unseen = shapes[len(cases) + 1:]
    for part, fn in fns.items():
        refused = answers.refusal(part)
        if refused:
            formulas[part] = (fn, refused)
    return answers


def _reference_formulas() -> dict:
    """The reference's held() and sent_per_step(), read by the course (not the learner's read)."""
    import importlib

    from ..grading import provenance

    with provenance.quiet():
        return importlib.import_module(f"{__package__}.solutions.setups_b").predicted


def _judge_unseen(key: str, what: str, part: str, fname: str, answers) -> tuple[bool, str] | None:
    """None when the formula agrees with the reference's on every unseen model (within twice
    ``TOLERANCE``: both are judged against measurements within it), else the failed verdict."""
    reference = _reference_formulas()[part]
    for units, n in answers.unseen:
        value, error = answers(part, units, n, key)
        if error:
            return False, f"{fname}(units, {n}, {key!r}) raised {error} (units={units}, a model no rank ran)"
        if part == "held":
            value = value.get(what, ...) if isinstance(value, Mapping) else value
        want = reference(units, n, key)
        want = want[what] if part == "held" else want
        ok, detail = setups.miss(setups.as_bytes(value), want, 2 * TOLERANCE)
        if ok is not True:
            return False, (f"on {n} ranks with units={units}, a model no rank ran, it is {detail} next to what "
                           "the set-up holds and sends there: a formula follows from units and world_size alone, "
                           "for any model and any number of ranks")
    return None


def _judge_prediction(key: str, what: str, formulas: dict, cases: list, kind, answers) -> tuple[bool | None, str]:
    part = "sent_per_step" if what == "sent_per_step" else "held"
    fn, problem = formulas[part]
    if fn is None:
        return (None if problem == "no prediction yet" else False), problem
    if problem:
        return False, problem
    if kind is None:
        return None, "judged once the set-up runs"
    if kind is False:  # its measurement is of another set-up than the one predicted
        return None, f"not judged: the set-up is not {NAMES[key]}"
    fname = getattr(fn, "__name__", part)
    verdicts = []
    for case in cases:
        value, error = answers(part, list(case.units), case.n, key)
        if error:
            return False, f"{fname}(units, {case.n}, {key!r}) raised {error} (units={case.units})"
        if part == "held" and value is not ... and not isinstance(value, Mapping):
            return False, (f"{fname}() returned a {type(value).__name__}: a dict of "
                           f"{', '.join(repr(c) for c in CATEGORIES)}, in bytes")
        if part == "held" and value is not ...:
            value = value.get(what, ...)
        value = setups.as_bytes(value)
        measured = case.measured(key, what)
        ok, detail = setups.miss(value, measured, TOLERANCE)
        if ok is None:
            return None, detail
        verdicts.append((case, ok, detail, value / measured if ok is False and isinstance(value, float) and measured
                         else None))
    failed = [v for v in verdicts if v[1] is False]
    if not failed:
        unseen = _judge_unseen(key, what, part, fname, answers)
        if unseen:
            return unseen
        return True, (f"within {TOLERANCE:.0%} on {setups.many([c.n for c in cases])} ranks, three model sizes "
                      f"(and on {len(answers.unseen)} models drawn at random)")
    case, _, detail, ratio = failed[0]
    why = _why(key, what, ratio, case.n) if ratio else ""
    if not why and len(failed) < len(verdicts):
        held_on = [v[0].n for v in verdicts if v[1]]
        why = (f" -- it holds on {setups.many(held_on)} ranks, for another model: does it use units and "
               "world_size everywhere, and no number of one model?")
    return False, f"{case.where}: {detail}{why}"


def _why(key: str, what: str, ratio: float, n: int) -> str:
    """A hint for a formula off by a telling factor (from the factor alone, not the value)."""
    near = lambda x: abs(ratio - x) < 0.1 * x  # noqa: E731
    if what == "optimizer_state" and any(near(x) for x in (0.5, 2, 0.25, 4)):
        keeps = "a full replica" if key == "ddp" else "1/N of it"
        return (f" -- {NAMES[key]} keeps {keeps} per rank; and how many tensors the size of the parameters "
                "does Adam keep per parameter?")
    if key == "fsdp" and what in CATEGORIES and near(n):
        return " -- FULL_SHARD keeps 1/N of it per rank, between steps too"
    if key == "ddp" and what in CATEGORIES and near(1 / n):
        return " -- DDP keeps a full replica on every rank"
    if what == "sent_per_step" and (near(n / (n - 1)) or near(2 * n / (n - 1))):
        return " -- in a ring, a rank sends (N-1)/N of the data per phase, not all of it"
    if what == "sent_per_step" and key == "fsdp" and (near(2 / 3) or near(1.5)):
        return " -- count FULL_SHARD's collectives: how often is each unit gathered in a step?"
    if what == "sent_per_step" and key == "ddp" and near(0.5):
        return " -- an all-reduce in a ring is two phases: a reduce-scatter, then an all-gather"
    if what in CATEGORIES and (near(0.5) or near(2) or near(0.25) or near(4)):
        return " -- bytes, for float32 elements"
    return ""


# --- the large model in a budget -----------------------------------------------------------------

def budget_enforced() -> bool:
    """Can a rank's allocations be refused beyond a budget here? On Linux (4.7 or later),
    ``RLIMIT_DATA`` covers the heap and every private writable mapping: every tensor."""
    import resource

    return sys.platform.startswith("linux") and hasattr(resource, "RLIMIT_DATA")


def _status(key: str) -> int | None:
    """A line of /proc/self/status in bytes (VmData, VmRSS, VmHWM), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _libc():
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _heap_free(libc) -> int:
    """Bytes free inside malloc's heaps: memory the rank already has mapped and may reuse."""
    import ctypes

    if libc is None or not hasattr(libc, "mallinfo2"):
        return 0

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = Mallinfo2
    return int(libc.mallinfo2().fordblks)


def _run_large(wrap, sizes: dict, steps: int, budget: int | None) -> dict:
    """On each rank: train ``sizes`` under ``wrap``; with ``budget`` (bytes), inside a data
    limit of what the rank uses now plus ``budget``. Returns {"peak_added": bytes the run
    added to the rank's resident memory at its fullest (None where that is not measured)}.

    Large tensors are mapped and unmapped one by one (``mallopt``, for this process, which
    the checker restarts afterwards), so the limit sees each; memory free in malloc's heaps
    is subtracted, since the run may reuse it without asking. The soft limit is restored
    before the error leaves the function. (Not ``RLIMIT_AS``: it counts address space malloc
    reserved and never touched -- each thread arena's 64 MiB heap -- which a run then grows
    into unseen; measured here, DDP then fitted a 64 MiB budget it needs 90 MiB for.)"""
    import gc
    import resource

    from ..backends import rank_device

    device = rank_device()
    if device.type == "cuda":
        return _run_large_on_gpu(wrap, sizes, steps, budget, device)
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
        libc.malloc_trim(0)
    start = _status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the resident high-water mark starts again from here
    except OSError:
        start = None
    limits = None
    if budget is not None:
        limits = resource.getrlimit(resource.RLIMIT_DATA)
        limit = _status("VmData") + budget - _heap_free(libc)
        if limits[1] != resource.RLIM_INFINITY:
            limit = min(limit, limits[1])
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limits[1]))
    try:
        setups.train_wrapped(wrap, sizes, steps, weights=False)
    finally:
        if limits is not None:
            resource.setrlimit(resource.RLIMIT_DATA, limits)
    gc.collect()
    peak = _status("VmHWM")
    return {"peak_added": peak - start if start is not None and peak is not None else None}


def _run_large_on_gpu(wrap, sizes: dict, steps: int, budget: int | None, device) -> dict:
    """``_run_large`` where the ranks train on GPUs: the budget is the caching allocator's
    (``set_per_process_memory_fraction``: what it holds now plus ``budget``, restored after),
    the peak its most allocated bytes."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    if budget is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved(device) + budget) / total),
                                                   device)
    try:
        setups.train_wrapped(wrap, sizes, steps, weights=False)
    finally:
        if budget is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    gc.collect()
    torch.cuda.empty_cache()
    return {"peak_added": torch.cuda.max_memory_allocated(device) - start}


def _out_of_memory(err: RankError) -> tuple[int, str] | None:
    """(the first rank the allocator refused, what it raised, in a few words), or None for
    another failure."""
    import re

    for rank in sorted(err.failures):
        summary = err.failures[rank].summary
        if any(s in summary for s in ("can't allocate memory", "not enough memory", "MemoryError",
                                      "Cannot allocate memory", "out of memory")):
            kind = summary.removeprefix("raised ").split(":")[0]
            asked = re.search(r"allocate (\d+) bytes", summary)
            on_gpu = re.search(r"allocate ([\d.]+) ([KMG]iB)", summary)  # the CUDA caching allocator's words
            return rank, (f"{kind}: the allocator refused {int(asked.group(1)) / 2**20:.1f} MiB more" if asked else
                          f"{kind}: the allocator refused {on_gpu.group(1)} {on_gpu.group(2)} more" if on_gpu else
                          f"{kind}: out of memory")
    return None


def _large_model(cluster, wraps: dict, kinds: dict, timeout: float) -> dict:
    """Each set-up on the large model on 2 ranks: {"ddp": {...}, "fsdp": {...}} with
    "outcome" ("fits", "out of memory", "over" (measured, not enforced), "failed", None: not
    run, and "why" not), "rank", "error", "peak" (bytes), "steps_per_second" (the median
    step's), "step_seconds" (each step after the first), "enforced"; and "side_by_side": the
    course's MLP under both set-ups taking steps in turn (``_side_by_side``), first.
    The ranks are restarted afterwards (by a failure, or here)."""
    from ..backends import uses_cuda

    on_gpu = uses_cuda(cluster.backend)
    enforced = budget_enforced() or on_gpu  # a GPU rank's caching allocator takes a budget anywhere
    budget = BUDGET_MIB << 20
    found = {key: {"outcome": None, "enforced": enforced, "on_gpu": on_gpu,
                   "why": "judged once the set-up runs" if kinds.get(key) is None else
                   f"not judged: the set-up is not {NAMES[key]}"} for key in NAMES}
    restarted = False
    found["side_by_side"] = _side_by_side(cluster, wraps, kinds, timeout)

    def run(key, limit, observers):
        nonlocal restarted
        try:
            out = cluster.run(_run_large, wraps[key], LARGE, LARGE_STEPS, limit, timeout=timeout, observe=observers)
            return out, None
        except (RankError, RankTimeout) as err:
            restarted = restarted or getattr(err, "restarted", True)
            warm_up(cluster)  # the cluster is usable again: the next call proves it
            return None, err

    if enforced:
        plan = [("ddp", None), ("fsdp", budget), ("ddp", budget)]  # DDP's own peak first, then the budget
    else:
        plan = [("ddp", None), ("fsdp", None)]
    for key, limit in plan:
        if not kinds.get(key) or found[key]["outcome"] == "failed":
            continue
        held = setups.AtRest()
        memory = Memory() if not enforced else None
        out, err = run(key, limit, [held] + ([memory] if memory else []))
        entry = found[key]
        if err is not None:
            oom = _out_of_memory(err) if isinstance(err, RankError) else None
            if limit is not None and oom:
                entry.update(outcome="out of memory", rank=oom[0], error=oom[1])
            else:
                lines = str(err).splitlines()
                entry.update(outcome="failed", error=lines[1 if isinstance(err, RankError) else 0][:200])
            continue
        peak = memory.peak(0)[0] if memory else out[0]["peak_added"]
        speed = {"steps_per_second": held.steps_per_second(0), "step_seconds": held.step_seconds(0)}
        if limit is None:  # a run to measure: its peak and speed
            entry.update(peak=peak, **speed)
            if not enforced:
                entry.update(outcome="fits" if peak <= budget else "over")
        else:
            entry.update(outcome="fits", peak=peak, **speed)
    if any(kinds.get(k) for k in NAMES) and not restarted:
        cluster.restart()  # fresh ranks: the malloc setting of these runs goes with the old ones
        warm_up(cluster)
    return found


def _judge_large(report: Report, large: dict, formulas: dict, answers=None) -> None:
    yours = _your_formulas(formulas, answers)
    for key in NAMES:
        entry, name = large[key], f"the large model in {BUDGET_MIB} MiB per rank: {NAMES[key]}"
        outcome = entry["outcome"]
        mine = yours.get(key, "")
        if outcome is None:
            report.add(name, None, entry["why"])
        elif outcome == "failed":
            report.add(name, False, f"it failed for another reason than memory: {entry['error']}")
        elif key == "ddp":
            if outcome == "out of memory":
                report.add(name, True, f"DDP ran out of the {BUDGET_MIB} MiB budget on rank {entry['rank']} "
                                       f"({entry['error']}): every rank holds the whole model, its gradients and "
                                       f"Adam's two moments{mine}")
            elif entry["enforced"]:
                report.add(name, False, f"DDP fitted in {BUDGET_MIB} MiB: every rank should hold the whole model, its "
                                        "gradients and Adam's two moments -- is it DDP of the whole model?")
            else:  # measured, not enforced
                report.add(name, outcome == "over",
                           f"DDP's measured peak, {_mib(entry['peak'])} per rank, is "
                           f"{'over' if outcome == 'over' else 'within'} the {BUDGET_MIB} MiB budget: every rank "
                           f"holds the whole model, its gradients and Adam's two moments{mine}. {_NOT_ENFORCED}")
        elif outcome == "out of memory":
            report.add(name, False, f"FULL_SHARD ran out of the {BUDGET_MIB} MiB budget too, on rank {entry['rank']} "
                                    "-- does every rank keep only its shard between steps, and gather one block at "
                                    "a time?")
        elif entry["enforced"]:
            report.add(name, True, f"FULL_SHARD fits in {BUDGET_MIB} MiB on both ranks (its peak added "
                                   f"{_mib(entry['peak'])}): each rank keeps 1/2 of the model's state and gathers "
                                   f"one block at a time{mine}")
        else:
            fits = outcome == "fits"
            report.add(name, fits, f"FULL_SHARD's measured peak, {_mib(entry['peak'])} per rank, is "
                                   f"{'within' if fits else 'over'} the {BUDGET_MIB} MiB budget{mine}. {_NOT_ENFORCED}")


_NOT_ENFORCED = ("This platform cannot refuse a process memory beyond a budget (no enforceable RLIMIT_DATA, e.g. "
                 "macOS), so the peak is measured and compared instead of enforced.")


def _mib(nbytes) -> str:
    return "unmeasured" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


def _your_formulas(formulas: dict, answers) -> dict:
    """{"ddp": "; your formulas say ...", ...}: the learner's own held() on the large model."""
    fn, problem = formulas["held"]
    if fn is None or problem or answers is None:
        return {}
    units = models.unit_numels(models.build_model("mlp", **LARGE))
    out = {}
    for key in NAMES:
        value, error = answers("held", list(units), 2, key)
        if error or not isinstance(value, Mapping):
            continue
        values = [setups.as_bytes(value.get(c, ...)) for c in CATEGORIES]
        if all(isinstance(v, float) for v in values):
            out[key] = f"; your formulas say {_mib(sum(values))} between steps, before anything is gathered"
    return out


# --- steps per second, side by side -------------------------------------------------------------

TIMED_STEPS = 9   # steps of each set-up timed in turn on the same ranks, after one untimed step of each


def _steps_in_turn(wrap_ddp, wrap_fsdp, sizes: dict, steps: int) -> dict:
    """On each rank: the course's MLP under each set-up, one Adam step of each in turn (which
    goes first alternates), ``steps`` of each timed after one untimed warm-up step each (it
    builds Adam's state). Each step starts from a barrier, so no rank's lag is counted in the
    next step. Returns {"ddp": [seconds per step], "fsdp": [...]}: both saw the same load."""
    import time

    import torch
    import torch.distributed as dist

    from ..backends import rank_device

    device = rank_device()
    x, y = (t.to(device) for t in models.make_dataset("mlp", setups.BATCH, **sizes).tensors)
    runs = {}
    for key, wrap in (("ddp", wrap_ddp), ("fsdp", wrap_fsdp)):
        model = wrap(models.build_model("mlp", **sizes).to(device))
        runs[key] = (model, torch.optim.Adam(model.parameters(), lr=setups.LR))
    done = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = {key: [] for key in runs}
    for step in range(steps + 1):
        for key in ("ddp", "fsdp") if step % 2 == 0 else ("fsdp", "ddp"):
            model, optimizer = runs[key]
            dist.barrier()
            start = time.perf_counter()
            models.loss_fn("mlp", model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done()
            if step:
                seconds[key].append(time.perf_counter() - start)
    return seconds


def _side_by_side(cluster, wraps: dict, kinds: dict, timeout: float) -> dict | None:
    """The course's MLP under both set-ups on ``cluster``'s ranks, their steps taken in turn:
    ``_compare`` of rank 0's step times. None unless both set-ups are what they say, or when
    it fails (the note then gives no ratio; the set-up items judge the set-ups)."""
    if not (kinds.get("ddp") and kinds.get("fsdp")):
        return None
    try:
        seconds = cluster.run(_steps_in_turn, wraps["ddp"], wraps["fsdp"], SIZES, TIMED_STEPS, timeout=timeout)[0]
    except (RankError, RankTimeout):
        warm_up(cluster)
        return None
    return _compare(seconds["ddp"], seconds["fsdp"])


def _compare(ddp: list, fsdp: list) -> dict | None:
    """DDP's and FULL_SHARD's steps, timed in turn (seconds, in the order taken), compared:
    {"ddp"/"fsdp": their ``setups.throughput``, "faster": "ddp" or "fsdp" when the two ranges
    of steps/s do not overlap (every step of one beat every step of the other), None when they
    do (within noise); "ratio": the faster one's median steps/s over the other's (DDP's over
    FULL_SHARD's within noise), "low"/"high": the least and most of that ratio step by step
    (each pair of steps taken one after the other), "pairs": how many}. None without both."""
    rates = {"ddp": setups.throughput(ddp), "fsdp": setups.throughput(fsdp)}
    if not all(rates.values()):
        return None
    a, b = rates["ddp"], rates["fsdp"]
    faster = "ddp" if a["low"] > b["high"] else "fsdp" if b["low"] > a["high"] else None
    lead, other = ("fsdp", "ddp") if faster == "fsdp" else ("ddp", "fsdp")
    steps = {"ddp": ddp, "fsdp": fsdp}
    pairs = [o / f for f, o in zip(steps[lead], steps[other]) if f > 0 and o > 0]
    return {**rates, "faster": faster, "ratio": rates[lead]["median"] / rates[other]["median"],
            "low": min(pairs), "high": max(pairs), "pairs": len(pairs)}


def _said_side_by_side(compared: dict) -> str:
    """The two rates with their spread, and the ratio said as a direction only when the
    ranges do not overlap."""
    rates = "; ".join(f"{NAMES[k]} {setups.said_rate(compared[k])}" for k in NAMES)
    spread = (f"{setups.figure(compared['low'])}–{setups.figure(compared['high'])} times step by step, over "
              f"{compared['pairs']} pairs of steps")
    faster = compared["faster"]
    if faster is None:
        return (f"{rates}: within noise -- the two ranges overlap, so neither is said to be faster here (DDP "
                f"{setups.figure(compared['ratio'])} times FULL_SHARD's steps/s at the median, {spread})")
    slower = "fsdp" if faster == "ddp" else "ddp"
    return (f"{rates}: {NAMES[faster]} is faster, {setups.figure(compared['ratio'])} times {NAMES[slower]}'s "
            f"steps/s at the median ({spread})")


def _explain(cases: list, large: dict, ratio_known: bool) -> str:
    """Peak memory and steps per second, measured, and why; the ratio of the bytes the two
    send only when ``ratio_known`` (both predictions of it passed). Steps per second are
    medians with their range; the two set-ups are compared only as measured side by side
    (``_side_by_side``), by a ratio said as a direction only beyond noise."""
    parts = []
    small = cases[0]
    compared = large.get("side_by_side")
    if compared:
        parts.append(f"the course's MLP on 2 ranks, the two set-ups taking steps in turn: {_said_side_by_side(compared)}")
    else:  # not both what they say: each run's own steps, not compared
        rates = {k: setups.throughput(small.runs[k][1].step_seconds(0)) for k in NAMES
                 if isinstance(small.runs.get(k), tuple)}
        said = [f"{NAMES[k]} {setups.said_rate(r)}" for k, r in rates.items() if r]
        if said:
            parts.append(f"the course's MLP on {small.n} ranks, each set-up in a run of its own, so not compared: "
                         + "; ".join(said))
    sizes = []
    for key in NAMES:
        entry = large[key]
        rate = setups.throughput(entry.get("step_seconds") or [])
        if entry.get("peak") is not None or rate:
            speed = f", {setups.said_rate(rate)}" if rate else ""
            where = " (run without the budget)" if key == "ddp" and entry["enforced"] else ""
            sizes.append(f"{NAMES[key]} peak {'+' if entry['enforced'] else ''}{_mib(entry.get('peak'))}{speed}{where}")
    if sizes:
        P = sum(p.numel() for p in models.build_model("mlp", **LARGE).parameters())
        parts.append(f"the large model ({P:,} parameters, {_mib(4 * P)} of float32) on 2 ranks: " + "; ".join(sizes))
    if not parts:
        return ""
    sent = {}
    for key in NAMES:
        if isinstance(small.runs.get(key), tuple):
            sent[key] = sum(small.runs[key][2].bytes(rank=0, step=-1).values())
    more = (f"{sent['fsdp'] / sent['ddp']:.1f} times DDP's bytes" if ratio_known and len(sent) == 2 and sent["ddp"]
            else "more bytes than DDP")
    peak_word = ("the GPU memory a run allocated at its fullest" if large["ddp"].get("on_gpu") else
                 "the resident memory a run added at its fullest" if large["ddp"]["enforced"] else
                 "the Memory observer's peak")
    return ("Measured on rank 0 (steps/s: the median step after a warm-up one, and the range from the slowest "
            "step to the fastest; peak: " + peak_word + "): "
            + " -- ".join(parts) + ". FULL_SHARD buys its memory with communication: it sends " + more
            + " in many small collectives (a gather per unit, twice, and a reduce-scatter), and every collective "
            "pays a fixed cost whatever its size, which these CPU ranks have little compute to hide. On GPUs with "
            "large layers, FSDP gathers the next unit while the current one computes, and most of it hides.")
