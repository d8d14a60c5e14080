"""What the checkers that run learner code on ranks share: blanks, clusters, failures as data.

* ``blanks_in(fn_or_class)``: how many ``...`` placeholders of a starter are still there.
* ``clusters_for(cluster, world_sizes)``: the clusters a check needs, reusing the learner's.
* ``run_or_failure(cluster, fn, ...)``: ``cluster.run``, with a rank's exception or a hang
  returned as a ``RankFailure`` a checker can put in an item (the cluster stays usable).

A fresh rank process imports the checker's modules (this package pulls in
``dpcourse.scratch``) when it first unpickles a checker function: seconds on a busy
machine, longer than a short hang timeout. So ``warm_up`` runs first on every cluster, and
again after a failure has restarted the ranks, with a generous timeout of its own.
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap
import types
from dataclasses import dataclass

from ..pool import Cluster, RankError, RankTimeout


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
    clusters = {c.world_size: c for c in given}
    started = []
    try:
        for n in world_sizes:
            if n not in clusters:
                clusters[n] = Cluster(world_size=n, timeout=60)
                started.append(clusters[n])
            warm_up(clusters[n])
        yield clusters
    finally:
        for c in started:
            c.shutdown()


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

    def fail(self, report, runs: str, timeout: float, later, why: str = "judged once it runs"):
        """Add to ``report`` the item ``runs`` failed as this call did, and each item in ``later``
        as not judged (``why``); returns ``report``."""
        report.add(runs, False, self.describe(timeout))
        for name in later:
            report.add(name, None, why)
        return report


def _ready() -> bool:
    return True


def warm_up(cluster, timeout: float = 180.0) -> None:
    """Have every rank import this package (and what it imports) before anything is timed."""
    cluster.run(_ready, timeout=timeout)


def run_or_failure(cluster, fn, *args, timeout: float, **kwargs):
    """``cluster.run(fn, *args, **kwargs)``'s results, or a ``RankFailure`` if a rank raised
    or the call did not finish within ``timeout`` seconds."""
    try:
        return cluster.run(fn, *args, timeout=timeout, **kwargs)
    except RankTimeout as err:
        stuck = [r for r in err.reports.values() if r.state == "running"] or list(err.reports.values())
        failure = RankFailure("hang", "; ".join(f"rank {r.rank} {r.summary}".strip() for r in stuck[:2]))
    except RankError as err:
        if err.failures:
            first = err.failures[min(err.failures)]
            failure = RankFailure("raised", f"rank {first.rank} {first.summary}")
        else:
            failure = RankFailure("raised", str(err).splitlines()[0])
    warm_up(cluster)  # the failure restarted the ranks: fresh processes, nothing imported
    return failure
