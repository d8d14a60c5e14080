"""What the checkers that run learner code on ranks share: blanks, clusters, failures as data.

* ``blanks_in(fn_or_class)``: how many ``...`` placeholders of a starter are still there.
* ``clusters_for(cluster, world_sizes)``: the clusters a check needs, reusing the learner's.
* ``run_or_failure(cluster, fn, ...)``: ``cluster.run``, with a rank's exception or a hang
  returned as a ``RankFailure`` a checker can put in an item (the cluster stays usable); a
  known PyTorch error keeps its message and gains the course's sentence on its likely cause
  (``known_errors.py``).

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
from ..pool.errors import lost_a_peer
from .known_errors import with_hint


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
    from . import provenance

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

    def fail(self, report, runs: str, timeout: float, later, why: str = "judged once it runs"):
        """Add to ``report`` the item ``runs`` failed as this call did, and each item in ``later``
        as not judged (``why``); returns ``report``."""
        report.add(runs, False, self.describe(timeout))
        for name in later:
            report.add(name, None, why)
        return report


def _ready() -> bool:
    from . import provenance

    provenance.install()   # from now on, a reference read on this rank is recorded
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
    cluster.run(_ready, timeout=timeout)


def run_or_failure(cluster, fn, *args, timeout: float, **kwargs):
    """``cluster.run(fn, *args, **kwargs)``'s results, or a ``RankFailure`` if a rank raised
    or the call did not finish within ``timeout`` seconds. A raise is told by the first rank
    whose error is its own, PyTorch's message kept and the course's sentence on its likely
    cause added where ``known_errors`` knows one."""
    try:
        return cluster.run(fn, *args, timeout=timeout, **kwargs)
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
        return RankFailure("raised", with_hint(str(err).splitlines()[0]))
    own = [r for r in sorted(err.failures) if not lost_a_peer(err.failures[r])] or sorted(err.failures)
    first = err.failures[own[0]]
    return RankFailure("raised", with_hint(f"rank {first.rank} {first.summary}"))
