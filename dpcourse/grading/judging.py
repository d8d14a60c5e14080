"""Running a learner's code on the ranks and judging it: blanks, clusters, failures as data.

* ``blanks_in(fn_or_class)``: how many ``...`` placeholders of a starter are still there.
* ``clusters_for(cluster, world_sizes)``: the clusters a check needs, reusing the learner's.
* ``run_or_failure(cluster, fn, ...)``: ``cluster.run``, with a rank's exception or a hang
  returned as a ``RankFailure`` a checker can put in an item (the cluster stays usable); a
  known PyTorch error keeps its message and gains the sentence on its likely cause that the
  content registered (``explain_errors``).
* ``run_checked`` and ``on_ranks``: a check's first item ("runs on every rank") from that call,
  and every later item not judged when it failed (``Report.fail``).

A fresh rank process imports the checker's modules (and what they import: torch's
distributed packages, the course's models) when it first unpickles a checker function:
seconds on a busy machine, longer than a short hang timeout. So ``warm_up`` runs first on every cluster, and
again after a failure has restarted the ranks, with a generous timeout of its own.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass
from typing import Callable

from ..pool import Cluster, RankError, RankTimeout
from ..pool.errors import lost_a_peer
from . import provenance
from .report import Report

RUNS = "runs on every rank"     # a check's first item: did the learner's code run at all
LATER = "judged once it runs"   # what an item says when the ranks never got that far
WARM_UP_TIMEOUT = 180.0         # seconds for a warm-up call (see ``run_checked``)
_explain: list[Callable[[str], str]] = []   # the content's sentences on known errors (``explain_errors``)


def explain_errors(with_hint: Callable[[str], str]) -> None:
    """Have every failure's message pass through ``with_hint(text) -> text`` (the course's
    sentence on a known PyTorch error's likely cause, added to PyTorch's message)."""
    _explain[:] = [with_hint]


def _hinted(text: str) -> str:
    return _explain[0](text) if _explain else text


def _code_blanks(code: types.CodeType) -> int:
    return sum(1 if c is Ellipsis else _code_blanks(c) if isinstance(c, types.CodeType) else 0
               for c in code.co_consts)


def _source_blanks(obj) -> int | None:
    """``...`` placeholders in ``obj``'s source (None: no source to read). Counts bare ``...``
    statements too, which compile away; an ``x[..., 0]`` index is not a placeholder."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return None
    indices = {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}
    indices |= {id(e) for n in ast.walk(tree) if isinstance(n, ast.Tuple) and id(n) in indices for e in n.elts}
    return sum(1 for n in ast.walk(tree)
               if isinstance(n, ast.Constant) and n.value is Ellipsis and id(n) not in indices)


def blanks_in(obj) -> int:
    """Number of ``...`` placeholders left in a function, or in the methods a class defines itself.

    Read from the source where there is one (a notebook's cells have it): a bare ``...``
    statement counts. Without source, from the code's constants: a starter that writes its
    blanks as values (``send_c = ...``) is still recognised, a bare ``...`` is compiled away.
    """
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    # a lambda's source is its whole line, which may hold other lambdas: read its code instead
    if (inspect.isfunction(obj) and obj.__name__ != "<lambda>") or isinstance(obj, type):
        from_source = _source_blanks(obj)
        if from_source is not None:
            return from_source
    if isinstance(obj, type):
        return sum(blanks_in(v) for v in vars(obj).values()
                   if inspect.isfunction(v) or isinstance(v, (staticmethod, classmethod)))
    code = getattr(obj, "__code__", None)
    return _code_blanks(code) if code is not None else 0


@contextlib.contextmanager
def clusters_for(cluster, world_sizes):
    """{world_size: Cluster} for ``world_sizes``: the given cluster(s) where their size fits,
    fresh ones (shut down on exit) for the others."""
    given = cluster if isinstance(cluster, (list, tuple)) else [cluster] if cluster is not None else []
    for c in given:
        reopen(c)
    clusters = {c.world_size: c for c in given}
    started = []
    try:
        for n in world_sizes:
            if n not in clusters:
                clusters[n] = Cluster(world_size=n, timeout=60, current=False)
                started.append(clusters[n])
            warm_up(clusters[n])
            provenance.from_cluster(clusters[n], earlier=True)   # what the ranks read before it
        yield clusters
    finally:
        for c in clusters.values():
            provenance.from_cluster(c)   # a reference the learner's code read on a rank
        for c in started:
            c.shutdown()


_judges: dict[int, Cluster] = {}


def judge_cluster(world_size: int) -> Cluster:
    """A cluster of ``world_size`` ranks of the checkers' own, kept for the kernel's life (a
    second world size for every check after the first): started on first use, warmed up,
    started again if it was shut down; never the one ``%%ranks`` uses."""
    cluster = _judges.get(world_size)
    if cluster is None or cluster.closed:
        cluster = _judges[world_size] = Cluster(world_size=world_size, timeout=60, current=False)
        warm_up(cluster)
    return cluster


def close_judges() -> None:
    """Shut the checkers' own clusters down now (they also end with the kernel)."""
    while _judges:
        _judges.popitem()[1].shutdown()


def other_world_size(world_size: int) -> int:
    """The second world size a check judges at: 3 next to a notebook's 2 (or 1), else 2."""
    return 3 if world_size <= 2 else 2


@dataclass
class RankFailure:
    """A call that did not return: ``kind`` "raised" or "hang"; ``summary``: one line per rank
    that matters (what it raised, or where it waited)."""
    kind: str
    summary: str

    def describe(self, timeout: float) -> str:
        if self.kind == "hang":
            where = f" ({self.summary})" if "waiting in" in self.summary else ""
            return (f"the ranks did not finish within {timeout:g} s{where} -- a rank waits for a "
                    "message that is never sent: does every rank receive from the rank that sends "
                    "to it, the same number of times?")
        return self.summary


def _ready(where) -> bool:
    provenance.install(where)   # from now on, a reference read on this rank is recorded
    return True


def reopen(cluster) -> None:
    """Start the notebook's ``cluster`` again when it was shut down (Run All ends with
    ``cluster.shutdown()``, and a check run after it needs the ranks), saying so in one line."""
    if cluster is not None and cluster.closed:
        print(f"The notebook's cluster was shut down (its last cell does that); starting its "
              f"{cluster.world_size} ranks again for this check.")
        cluster.restart()


def warm_up(cluster, timeout: float = 180.0) -> None:
    """Have every rank import this package (and what it imports) before anything is timed."""
    cluster.run(_ready, provenance.where(), timeout=timeout)


def run_or_failure(cluster, fn, *args, timeout: float, **kwargs):
    """``cluster.run(fn, *args, **kwargs)``'s results, or a ``RankFailure`` if a rank raised
    or the call did not finish within ``timeout`` seconds. A raise is told by the first rank
    whose error is its own, PyTorch's message kept and the course's sentence on its likely
    cause added where the content knows one (``explain_errors``)."""
    return _attempt(cluster, lambda: cluster.run(fn, *args, timeout=timeout, **kwargs))


def script_or_failure(cluster, source: str, *argv, timeout: float):
    """``cluster.run_script_source(source, *argv)``'s exit codes, or a ``RankFailure`` (as
    ``run_or_failure`` says it)."""
    return _attempt(cluster, lambda: cluster.run_script_source(source, *argv, timeout=timeout))


def _attempt(cluster, call: Callable):
    try:
        return call()
    except (RankTimeout, RankError) as err:
        failure = failure_of(err)
    warm_up(cluster)  # the failure restarted the ranks: fresh processes, nothing imported
    return failure


def failure_of(err: RankTimeout | RankError) -> RankFailure:
    """The ``RankFailure`` a call that raised ``err`` ended in: where the stuck ranks waited,
    or the first rank whose error is its own (a rank that only lost a peer echoes another's),
    with the course's sentence for a known PyTorch error."""
    if isinstance(err, RankTimeout):
        stuck = [r for r in err.reports.values() if r.state == "running"] or list(err.reports.values())
        return RankFailure("hang", "; ".join(f"rank {r.rank} {r.summary}".strip() for r in stuck[:2]))
    if not err.failures:
        return RankFailure("raised", _hinted(str(err).splitlines()[0]))
    own = [r for r in sorted(err.failures) if not lost_a_peer(err.failures[r])] or sorted(err.failures)
    first = err.failures[own[0]]
    return RankFailure("raised", _hinted(f"rank {first.rank} {first.summary}"))



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
        report.fail(runs, describe(got, cluster.world_size) if describe else got.describe(timeout), items)
        return None
    report.add(runs, True)
    return got


def on_ranks(fn, *items: str, timeout: float, runs: str = RUNS, warm_up: Callable | None = None,
             describe: Callable | None = None):
    """Make the decorated ``judge(report, got, *items)`` a check ``check(answer, cluster)``.

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
