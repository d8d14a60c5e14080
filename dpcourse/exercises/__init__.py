"""Exercises: starters the learner edits, checkers that say item by item what is right.

    report = dpc.exercises.check_a("train_lm_ddp.py")   # runs it on 2 ranks under torchrun
    report = dpc.exercises.check_f("train_lm_fsdp.py")  # the same, for the FSDP2 conversion
    report.passed, report.items                        # shown as a table in Jupyter
    dpc.exercises.solution("A")                        # the reference solution, on request
    dpc.exercises.check_d(ring_reduce_scatter, ring_all_gather)   # on 2-5 real ranks
    dpc.exercises.check_e(MyBucketedDDP)               # next to torch DDP on 2 ranks
    dpc.exercises.check_answer("4.1a", 3, {...})       # the chapters' self-check questions
    dpc.exercises.check_answer("4.2a", "no_sync", accumulate, cluster)   # a try-it cell, on the ranks
    report.fix()                                       # a failed check's reference, on request
    dpc.exercises.check_b(wrap_ddp, wrap_fsdp, predicted)   # set-ups, formulas on 2-4 ranks, a memory budget
    dpc.exercises.check_c(configs, predict)            # four FSDP configurations, their figures and order
"""
from __future__ import annotations

import os

from ..grading import judging, provenance
from . import known_errors

# files in solutions/ (A's and F's: complete scripts); a try-it's is solutions/tryits/<name>.py
SOLUTION_FILES = {"A": "train_lm_ddp.py", "B": "setups_b.py", "C": "configs_c.py", "D": "ring_d.py",
                  "E": "bucketed_e.py", "F": "train_lm_fsdp.py"}
# a reference's file read in this kernel, by any route, is recorded (and on the ranks a check
# warms up, and in the torchrun workers whose recorder imports this package)
provenance.install((os.path.join(os.path.dirname(os.path.abspath(__file__)), "solutions"), SOLUTION_FILES))
judging.explain_errors(known_errors.with_hint)   # PyTorch's message, then the course's sentence on its cause

from .exercise_a import check_a  # noqa: E402 -- after the references are registered
from .exercise_d import check_d  # noqa: E402
from .exercise_e import check_e  # noqa: E402
from .exercise_f import check_f  # noqa: E402
from .selfcheck import check_answer  # noqa: E402


def solution(exercise: str) -> str:
    """The reference solution of ``exercise`` ("A" to "F", or a try-it's name such as
    "no_sync"), as source text (print it to read it)."""
    from . import tryits

    key = exercise.upper()
    if exercise in tryits.load_all():
        provenance.shown(exercise)   # an instructor sees it in the reports that follow
        return tryits.reference(exercise)
    if key not in SOLUTION_FILES:
        raise ValueError(f"no exercise {exercise!r}; choose one of {sorted(SOLUTION_FILES)} "
                         f"or a try-it: {', '.join(sorted(tryits.load_all()))}")
    provenance.shown(key)
    return provenance.reference_text(key)


def __getattr__(name):
    # exercises B and C import the training runner, the observers and the ledger (3 s here,
    # after torch): loaded on first use, so a rank that runs another checker's code never does
    lazy = {"check_b": "exercise_b", "exercise_b": "exercise_b", "check_c": "exercise_c", "exercise_c": "exercise_c"}
    if name in lazy:
        import importlib

        module = importlib.import_module(f"{__name__}.{lazy[name]}")
        return module if name == lazy[name] else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["check_a", "check_b", "check_c", "check_d", "check_e", "check_answer", "check_f",
           "solution"]
