"""Starters of the exercises: complete single-device scripts that a learner converts.

``train_lm.py`` (exercises A and F) trains the course's tied-weight language model with
AdamW, a warm-up-then-cosine schedule, gradient accumulation, a validation pass after every
epoch and gradient clipping. The chapters never convert it; the notebooks' folder holds the
same file for the learner to copy.
"""
from __future__ import annotations

from pathlib import Path


def path(name: str = "train_lm") -> str:
    """Absolute path of the starter ``name`` (without ``.py``)."""
    found = Path(__file__).resolve().with_name(f"{name}.py")
    if not found.exists():
        raise ValueError(f"no starter {name!r}")
    return str(found)
