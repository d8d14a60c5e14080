"""Every PyTorch collective by its definition: what each rank must hold after it. Pure.

A notebook runs the real ``torch.distributed`` calls on its ranks and keeps, per rank, each
call's tensor before and after it, keyed by the call as written (``"all_reduce(t)"``,
``"reduce_scatter_single(part, t)"``, ``"broadcast(t, src=0)"``). ``expected_after``
computes from the "before" tensors, in one process, what the documentation says each rank
holds afterwards, so the ranks can be checked against it; ``contributions`` says which
ranks' values each element holds, for the drawing (``dpcourse.viz.draw_collectives``).
"""
from __future__ import annotations

import re

import torch

# torch.distributed's function -> the collective it is
FUNCTIONS = {"broadcast": "broadcast", "reduce": "reduce", "all_reduce": "all_reduce",
             "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
             "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
             "reduce_scatter_single": "reduce_scatter",
             "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
             "gather": "gather", "scatter": "scatter"}


def parse_call(call: str) -> tuple[str, int]:
    """(collective, root) of a call as written: "broadcast(t, src=1)" -> ("broadcast", 1).

    The root (``src=``/``dst=``) defaults to 0."""
    match = re.match(r"\s*(?:dist\.)?(\w+)\s*\(", call)
    if not match or match.group(1) not in FUNCTIONS:
        raise ValueError(f"not a torch.distributed collective call: {call!r}; write it as e.g. "
                         f"'all_reduce(t)' (known: {', '.join(sorted(FUNCTIONS))})")
    root = re.search(r"\b(?:src|dst)\s*=\s*(\d+)", call)
    return FUNCTIONS[match.group(1)], int(root.group(1)) if root else 0


def expected_after(call: str, before: list) -> list:
    """What each rank must hold after ``call`` (see ``parse_call``), from every rank's
    ``before`` tensor (None where a rank passes nothing, e.g. a non-root rank of scatter);
    None where the rank holds nothing meaningful (a non-root rank after reduce or gather)."""
    collective, root = parse_call(call)
    n = len(before)
    if not 0 <= root < n:
        raise ValueError(f"root {root} of {call!r} is not a rank of {n}")
    if collective == "broadcast":
        return [before[root].clone() for _ in range(n)]
    if collective == "reduce":
        return [sum(before) if r == root else None for r in range(n)]
    if collective == "all_reduce":
        return [sum(before) for _ in range(n)]
    if collective == "all_gather":
        return [torch.cat(before) for _ in range(n)]
    if collective == "reduce_scatter":
        return list(sum(before).chunk(n))
    if collective == "all_to_all":
        return [torch.cat([b.chunk(n)[r] for b in before]) for r in range(n)]
    if collective == "gather":
        return [torch.cat(before) if r == root else None for r in range(n)]
    return list(before[root].chunk(n))  # scatter


def contributions(call: str, before: list) -> list:
    """For each rank after ``call``: per element, the set of ranks whose input it holds (None
    where the rank holds nothing) -- ``expected_after`` on one-bit inputs."""
    bits = [None if t is None else torch.full(t.shape, 1 << r, dtype=torch.int64) for r, t in enumerate(before)]
    out = []
    for t in expected_after(call, bits):
        out.append(None if t is None else
                   [frozenset(k for k in range(len(before)) if int(v) >> k & 1) for v in t])
    return out
