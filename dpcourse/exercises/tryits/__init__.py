"""Try-it cells: the learner writes the API a chapter just showed, for a variation the chapter
did not show; a check on the ranks says within seconds, item by item, what the code did.

In a chapter, after the demonstration of an API:

    def accumulate(ddp_model, micro_batches, loss_fn):      # the try-it cell (tag ``try-it``):
        ...                                                  # blanks written as ``x = ...``
    dpc.exercises.check_answer("4.2a", "no_sync", accumulate, cluster)   # the next cell

A try-it is three things, each in one place:

* ``tryits/<name>.py``: its checker, registered by name with its chapter (``@try_it``, from
  ``grading.registry``): most often the function its ranks run and a judge of what they
  returned (``grading.judging.on_ranks`` runs the one and, when a rank raised or hung, says so
  and judges nothing else; the judge adds one item per behaviour, and names each mistake it
  recognises). What a chapter's try-its share sits in the chapter's module (``ddp``, ``fsdp``,
  ...), what several chapters share in ``shared``.
* ``solutions/tryits/<name>.py``: its reference, the cell as the course's author filled it,
  shown by ``dpc.exercises.solution("<name>")`` on request only.
* the two cells: the try-it cell (tag ``try-it``, ``metadata["dpcourse"]["try_it"] = "<name>"``)
  and the check after it. The cell carries the reference's hash, never its text, written by
  ``python -m dpcourse.exercises.cells`` (a test fails while they differ).

A check's failed items name the behaviour and the idea it touches ("4 all-reduces ran for 4
micro-batches: ..."), never the expected value or the line that fixes it. A starter still
holding a ``...`` is "not attempted yet"; a rank that raises or hangs is a failed item, and
the cluster stays usable.
"""
from __future__ import annotations

import importlib
import os

from ...grading import registry
from ...grading.registry import TryIt

SOLUTIONS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "solutions", "tryits")


def names() -> list[str]:
    """Every try-it's name: one reference ``solutions/tryits/<name>.py`` and one checker
    ``tryits/<name>.py`` each (a test keeps the two sets equal)."""
    return sorted(n[:-3] for n in os.listdir(SOLUTIONS) if n.endswith(".py") and n != "__init__.py")


def load_all() -> dict[str, TryIt]:
    """Every try-it of every chapter, by name (each checker registers itself on import)."""
    for name in names():
        importlib.import_module(f"{__name__}.{name}")
    return registry.TRY_ITS


def reference(name: str) -> str:
    """The reference of try-it ``name``: the try-it cell as the course's author filled it."""
    path = os.path.join(SOLUTIONS, f"{name}.py")
    if not os.path.exists(path):
        raise ValueError(f"no try-it {name!r}; there are: {', '.join(sorted(load_all()))}")
    with open(path) as f:
        return f.read()


def check(chapter: str, name: str, answer, cluster=None, second: bool = True):
    """Judge the learner's ``answer`` to try-it ``name`` of ``chapter`` on ``cluster``'s ranks,
    and again on another world size once it passes (``grading.registry.check``)."""
    return registry.check(load_all(), chapter, name, answer, cluster, second)
