"""What an observer holds in the kernel once a call returns: one result per rank.

Runs in the kernel. Each observer's ``result()`` runs on every rank; the pool hands the
list, ordered by rank, to ``collect``, and the observer's readers look one rank up there.
"""
from __future__ import annotations


class Collected:
    """The kernel side every observer shares: ``collect`` keeps the ranks' results, ``of_rank``
    reads one, or says how to observe when nothing was collected yet."""

    per_rank: list[dict] | None = None
    NAME = "observer"   # what the learner calls it, for the message: observe=[NAME]

    def collect(self, per_rank: list) -> None:
        self.per_rank = per_rank

    def of_rank(self, rank: int) -> dict:
        """What ``rank`` recorded (its ``result()``), once a call has returned."""
        if self.per_rank is None:
            raise RuntimeError(f"nothing observed yet: pass this observer to cluster.run(fn, observe=[{self.NAME}])")
        return self.per_rank[rank]
