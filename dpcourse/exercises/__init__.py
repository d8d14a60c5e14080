"""Exercises: starters the learner edits, checkers that say item by item what is right.

    report = dpc.exercises.check_a("train_ddp.py")   # runs it on 2 ranks under torchrun
    report.passed, report.items                        # shown as a table in Jupyter
    dpc.exercises.solution("A")                        # the reference solution, on request
    dpc.exercises.check_answer("4.1", 3, {...})        # the chapters' self-check questions
"""
from __future__ import annotations

from .exercise_a import check_a
from .report import Item, Report
from .selfcheck import check_answer

SOLUTIONS = {"A": "train_ddp"}


def solution(exercise: str) -> str:
    """The reference solution of ``exercise`` ("A", ...), as source text (print it to read it)."""
    from .. import scripts

    key = exercise.upper()
    if key not in SOLUTIONS:
        raise ValueError(f"no exercise {exercise!r}; choose one of {sorted(SOLUTIONS)}")
    with open(scripts.path(SOLUTIONS[key])) as f:
        return f.read()


__all__ = ["Item", "Report", "check_a", "check_answer", "solution"]
