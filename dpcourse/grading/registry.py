"""Try-its by name: each registers its check (``try_it``), and ``check`` judges a learner's
answer with it -- not attempted while a ``...`` is left, on the notebook's ranks, then again on
another world size once it passes there, with the references read before or meanwhile said."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import provenance
from .judging import blanks_in, judge_cluster, other_world_size, reopen
from .report import Report


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


def check(known: dict[str, TryIt], chapter: str, name: str, answer, cluster=None, second: bool = True) -> Report:
    """Judge the learner's ``answer`` to try-it ``name`` of ``chapter`` (one of ``known``) on
    ``cluster``'s ranks and, once it passes there, again on another world size
    (``judging.other_world_size``: 3 next to a notebook's 2), so an answer right only for the
    notebook's ranks fails and says which size broke it. ``second=False``: the notebook's
    ranks only."""
    since = provenance.mark()
    report = _check(known, chapter, name, answer, cluster, second)
    report.references = provenance.used(name, since)
    return report


def _check(known: dict[str, TryIt], chapter: str, name: str, answer, cluster, second: bool) -> Report:
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
