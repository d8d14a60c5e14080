"""What every observer shares: one result per rank in the kernel, one step clock on the rank.

An observer is a context manager the pool enters on every rank around a call; its
``result()`` (plain data) runs on each rank after the call, and the pool hands the list,
ordered by rank, to ``collect`` in the kernel, where the observer's readers look one rank up
(``of_rank``). On the rank, every observer that needs to know where the training loop is
enters a ``watch.LoopWatch``: all of a call's share the process's one ``StepClock``.
"""
from __future__ import annotations

import contextlib


class Observer:
    """The kernel side every observer shares: ``collect`` keeps the ranks' results, ``of_rank``
    reads one, or says how to observe when nothing was collected yet."""

    per_rank: list | None = None
    NAME = "observer"   # what the learner calls it, for the message: observe=[NAME]

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}()" if self.per_rank is None else f"{name}(observed on {len(self.per_rank)} ranks)"

    # --- on the rank -----------------------------------------------------------------
    def watch(self, watch, listen=None):
        """As the observer is entered on a rank: follow the training loop through ``watch`` (a
        ``watch.LoopWatch``: the call's shared clock), and, given ``listen``, call
        ``listen(issued)`` after every collective the rank issues (the collective tracker);
        ``unwatch`` undoes both. Returns ``watch``, entered."""
        from ..tracking.tracker import TRACKER

        self._watching = contextlib.ExitStack()
        entered = self._watching.enter_context(watch)
        if listen is not None:
            self._watching.enter_context(TRACKER.listen(listen))
        return entered

    def unwatch(self, *exc) -> None:
        """Stop listening, then leave the clock (the last observer to leave removes its hooks)."""
        self._watching.__exit__(*exc)

    # --- in the kernel -----------------------------------------------------------------
    def collect(self, per_rank: list) -> None:
        """Keep the ranks' results (``result()`` of each rank, ordered by rank)."""
        self.per_rank = per_rank

    def collected(self) -> list:
        """Every rank's result, once a call has returned."""
        if self.per_rank is None:
            raise RuntimeError(f"nothing observed yet: pass this observer to cluster.run(fn, observe=[{self.NAME}])")
        return self.per_rank

    def of_rank(self, rank: int):
        """What ``rank`` recorded (its ``result()``), once a call has returned."""
        return self.collected()[rank]
