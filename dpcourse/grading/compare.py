"""Numeric comparisons a judge makes: tensors, lists of them and dicts of them, close or not,
and how many times one is another."""
from __future__ import annotations

import torch

RTOL, ATOL = 1e-4, 1e-6   # float32 arithmetic done in another order: rounding, not a difference


def close(got, want, rtol: float = RTOL, atol: float = ATOL) -> bool:
    """Whether ``got`` equals ``want`` to rounding: two tensors, two sequences of tensors (of one
    length), or two dicts of tensors (with the same keys)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(
            close(got[k], want[k], rtol, atol) for k in want)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(close(a, b, rtol, atol) for a, b in zip(got, want))
    return torch.allclose(got, want, rtol=rtol, atol=atol)


def scale_of(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """How many times ``want`` ``got`` is, fitted over all the tensors (1.0 when equal)."""
    g, w = torch.cat([t.flatten() for t in got]), torch.cat([t.flatten() for t in want])
    return float((g @ w) / (w @ w).clamp_min(1e-30))
