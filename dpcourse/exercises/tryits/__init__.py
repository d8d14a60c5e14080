"""Try-it cells: the learner writes the API a chapter just showed, for a variation the chapter
did not show; a check on the ranks says within seconds, item by item, what the code did.

In a chapter, after the demonstration of an API:

    def accumulate(ddp_model, micro_batches, loss_fn):      # the try-it cell (tag ``try-it``):
        ...                                                  # blanks written as ``x = ...``
    dpc.exercises.check_answer("4.2a", "no_sync", accumulate, cluster)   # the next cell

Each try-it is registered here by name, with its chapter and its checker. A checker is, most
often, the function its ranks run and a judge of what they returned: ``on_ranks`` runs the one
and, when a rank raised or hung, says so and judges nothing else; the judge adds one item per
behaviour. A try-it's reference is the file ``solutions/tryits/<name>.py``, which is also the
try-it cell's ``metadata["dpcourse"]["solution_sha256"]`` (its hash: a notebook never carries a
reference's text; a test keeps the two equal);
``dpc.exercises.solution("no_sync")`` shows it, on request only. A check's failed items name
the behaviour and the idea it touches ("4 all-reduces ran for 4 micro-batches: ..."), never
the expected value or the line that fixes it. A starter still holding a ``...`` is "not
attempted yet"; a rank that raises or hangs is a failed item, and the cluster stays usable.
"""
from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from typing import Callable

from .. import provenance
from ..ranks import RankFailure, blanks_in, judge_cluster, other_world_size, reopen, run_or_failure
from ..report import Report

# the module of checkers for each chapter (imported when one of its try-its is checked)
MODULES = {"4.2a": "ddp", "4.2b": "fsdp", "4.2c": "large_models", "4.2d": "pitfalls", "4.2e": "at_work",
           "4.2f": "long_runs", "4.2g": "compile_meshes"}
SOLUTIONS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "solutions", "tryits")
RUNS = "runs on every rank"     # a check's first item: did the learner's code run at all
LATER = "judged once it runs"   # what an item says when the ranks never got that far
WARM_UP_TIMEOUT = 180.0         # seconds for a warm-up call (see ``run_checked``)


@dataclass
class TryIt:
    """One try-it: ``check(answer, cluster) -> Report`` judges the learner's ``answer`` (what the
    cell defines: a function, usually) on ``cluster``'s ranks; ``asks`` says what the cell asks
    for, in a few words (the report's title)."""

    name: str
    chapter: str
    asks: str
    check: Callable


TRY_ITS: dict[str, TryIt] = {}


def try_it(name: str, chapter: str, asks: str):
    """Register the decorated ``check(answer, cluster) -> Report`` as try-it ``name``."""
    def register(check):
        TRY_ITS[name] = TryIt(name, chapter, asks, check)
        return check
    return register


def fail_all(report: Report, runs: str, detail: str, items, why: str = LATER) -> Report:
    """Add item ``runs``, failed as ``detail`` says, then each of ``items`` not judged (``why``)."""
    report.add(runs, False, detail)
    for name in items:
        report.add(name, None, why)
    return report


def run_checked(report: Report, cluster, fn, *args, items, timeout: float, runs: str = RUNS,
                warm_up: Callable | None = None, describe: Callable | None = None) -> list | None:
    """``fn(*args)`` on every rank of ``cluster``: the results in rank order, with item ``runs``
    passed; or None when a rank raised or the call did not return within ``timeout`` seconds,
    with ``runs`` failed and each of ``items`` not judged. The failure is said in
    ``RankFailure.describe``'s words, or ``describe(failure, world_size)``'s where a check knows
    better. ``warm_up``: run on every rank first, under a timeout of its own -- a rank that a
    failure restarted imports what the check needs for seconds, which ``timeout`` is not for."""
    if warm_up is not None:
        cluster.run(warm_up, timeout=WARM_UP_TIMEOUT)
    got = run_or_failure(cluster, fn, *args, timeout=timeout)
    if isinstance(got, RankFailure):
        fail_all(report, runs, describe(got, cluster.world_size) if describe else got.describe(timeout), items)
        return None
    report.add(runs, True)
    return got


def on_ranks(fn, *items: str, timeout: float, runs: str = RUNS, warm_up: Callable | None = None,
             describe: Callable | None = None):
    """Make the decorated ``judge(report, got, *items)`` a try-it's ``check(answer, cluster)``.

    The check runs ``fn(answer)`` on the cluster's ranks (``run_checked``, whose keywords these
    are); when every rank returned, the judge adds ``items``, the names of what it judges, in
    its own order, from ``got``: the ranks' results in rank order."""
    def make(judge):
        @functools.wraps(judge)
        def check(answer, cluster) -> Report:
            report = Report("")
            got = run_checked(report, cluster, fn, answer, items=items, timeout=timeout, runs=runs,
                              warm_up=warm_up, describe=describe)
            if got is not None:
                judge(report, got, *items)
            return report
        return check
    return make


def _again(tryit: TryIt, answer, first: Report, world_size: int) -> Report:
    """``first`` (passed on ``world_size`` ranks) judged again on the other world size: the
    report of that run, its failed items saying where it passed, when it fails there."""
    n = other_world_size(world_size)
    judge = judge_cluster(n)
    provenance.from_cluster(judge, earlier=True)
    again = tryit.check(answer, judge)
    provenance.from_cluster(judge)
    if again.passed:
        first.note = (first.note + " " if first.note else "") + f"Judged on {world_size} ranks and again on {n}."
        return first
    for item in again.items:
        if item.status == "fail":
            item.detail = f"on {n} ranks (it passed on {world_size}): {item.detail}"
    again.note = (f"It passed on {world_size} ranks and fails on {n}: an answer must hold for any number of "
                  "ranks (dist.get_world_size()), not only the notebook's.")
    return again


def load_all() -> dict[str, TryIt]:
    """Every try-it of every chapter, by name."""
    for module in MODULES.values():
        importlib.import_module(f"{__name__}.{module}")
    return TRY_ITS


def reference(name: str) -> str:
    """The reference of try-it ``name``: the try-it cell as the course's author filled it."""
    path = os.path.join(SOLUTIONS, f"{name}.py")
    if not os.path.exists(path):
        raise ValueError(f"no try-it {name!r}; there are: {', '.join(sorted(load_all()))}")
    with open(path) as f:
        return f.read()


def check(chapter: str, name: str, answer, cluster=None, second: bool = True) -> Report:
    """Judge the learner's ``answer`` to try-it ``name`` of ``chapter`` on ``cluster``'s ranks
    and, once it passes there, again on another world size (``ranks.other_world_size``: 3 next
    to a notebook's 2), so an answer right only for the notebook's ranks fails and says which
    size broke it. ``second=False``: the notebook's ranks only."""
    since = provenance.mark()
    report = _check(chapter, name, answer, cluster, second)
    report.references = provenance.used(name, since)
    return report


def _check(chapter: str, name: str, answer, cluster, second: bool) -> Report:
    known = load_all()
    if name not in known or known[name].chapter != str(chapter):
        here = sorted(n for n, t in known.items() if t.chapter == str(chapter))
        raise ValueError(f"no try-it {name!r} in chapter {chapter}; its try-its are: {', '.join(here) or 'none'}")
    tryit = known[name]
    if answer is ... or answer is None or blanks_in(answer):
        report = Report(f"Try it: {tryit.asks}", attempted=False)
        report.note = "Replace each `...` in the cell above with your code, run that cell, then this one."
        report.key = name
        return report
    if cluster is None:
        raise ValueError("pass the notebook's cluster: check_answer(..., cluster) runs your code on its ranks")
    reopen(cluster)   # after Run All, whose last cell shut it down
    provenance.from_cluster(cluster, earlier=True)   # what its ranks read before it
    report = tryit.check(answer, cluster)
    provenance.from_cluster(cluster)
    if second and report.passed:
        report = _again(tryit, answer, report, cluster.world_size)
    report.title, report.key = f"Try it: {tryit.asks}", name
    if not report.passed and not report.note:
        report.note = f"When you want to compare with a reference: dpc.exercises.solution({name!r})."
    return report
