"""Every PyTorch collective, run live on a cluster's ranks: each rank's tensor before and after.

``run_collective(cluster, "all_gather")`` runs the real ``torch.distributed`` call on every
rank and returns what each rank held before and after it. ``expected_after`` computes the
same from the "before" tensors in one process -- the collective's definition, written out --
so a notebook cell or a test can check the ranks against it. Drawing: ``dpcourse.viz``.

Inputs are easy to read: rank r holds ``10*(r+1) + [0, 1, 2, ...]`` (int64), so the tens
digit of a copied value names the rank it came from.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

COLLECTIVES = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter",
               "all_to_all", "gather", "scatter", "send_recv", "barrier")
# The call each rank makes, as the drawing shows it. "blocks": inputs of N blocks of numel.
CALLS = {
    "broadcast": "dist.broadcast(t, src=root)",
    "reduce": "dist.reduce(t, dst=root)",
    "all_reduce": "dist.all_reduce(t)",
    "all_gather": "dist.all_gather(out, t); out = torch.cat(out)",
    "reduce_scatter": "dist.reduce_scatter(out, list(t.chunk(world_size)))",
    "all_to_all": "dist.all_to_all_single(out, t)",
    "gather": "dist.gather(t, gather_list if rank == root else None, dst=root)",
    "scatter": "dist.scatter(out, list(t.chunk(world_size)) if rank == root else None, src=root)",
    "send_recv": "dist.send(t, dst=root+1) on root; dist.recv(t, src=root) on root+1",
    "barrier": "dist.barrier()  # after sleeping 50 ms * rank; values: ms since the first arrival",
}


@dataclass
class LiveResult:
    """One collective run on real ranks: ``before[r]`` / ``after[r]`` are rank r's tensors
    (None where the rank holds nothing meaningful, e.g. a non-root rank after reduce)."""
    collective: str
    world_size: int
    root: int
    before: list
    after: list
    call: str


def _check(collective: str, world_size: int, root: int) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if not 0 <= root < world_size:
        raise ValueError(f"root must be a rank, 0..{world_size - 1}, got {root}")
    if collective == "send_recv" and world_size < 2:
        raise ValueError("send_recv needs two ranks: start a dpc.Cluster(world_size=2) or more")


def initial_tensor(collective: str, rank: int, world_size: int, numel: int, root: int = 0):
    """What rank ``rank`` holds before ``collective`` (int64; None: nothing)."""
    blocks = collective in ("reduce_scatter", "all_to_all") or (collective == "scatter" and rank == root)
    if collective == "scatter" and rank != root:
        return None
    count = numel * world_size if blocks else numel
    return 10 * (rank + 1) + torch.arange(count, dtype=torch.int64)


def _on_rank(collective: str, numel: int, root: int):
    """Runs on every rank: make the input, call the collective, return (before, after)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    t = initial_tensor(collective, rank, n, numel, root)
    before = None if t is None else t.clone()
    after = t
    if collective == "broadcast":
        dist.broadcast(t, src=root)
    elif collective == "reduce":
        dist.reduce(t, dst=root)
        after = t if rank == root else None  # the others' tensors are unspecified
    elif collective == "all_reduce":
        dist.all_reduce(t)
    elif collective == "all_gather":
        out = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(out, t)
        after = torch.cat(out)
    elif collective == "reduce_scatter":
        after = torch.empty(numel, dtype=t.dtype)
        dist.reduce_scatter(after, list(t.chunk(n)))
    elif collective == "all_to_all":
        after = torch.empty_like(t)
        dist.all_to_all_single(after, t)
    elif collective == "gather":
        out = [torch.empty_like(t) for _ in range(n)] if rank == root else None
        dist.gather(t, out, dst=root)
        after = torch.cat(out) if rank == root else None
    elif collective == "scatter":
        after = torch.empty(numel, dtype=torch.int64)
        dist.scatter(after, list(t.chunk(n)) if rank == root else None, src=root)
    elif collective == "send_recv":
        peer = (root + 1) % n
        if rank == root:
            dist.send(t, dst=peer)
        elif rank == peer:
            dist.recv(t, src=root)
    elif collective == "barrier":
        dist.barrier()
        time.sleep(0.05 * rank)
        before = torch.tensor([time.time()], dtype=torch.float64)
        dist.barrier()
        after = torch.tensor([time.time()], dtype=torch.float64)
    return before, after


def run_collective(cluster, collective: str, numel: int = 4, root: int = 0,
                   timeout: float = 60) -> LiveResult:
    """Run ``collective`` (one of ``COLLECTIVES``) on every rank of ``cluster``.

    numel: elements per rank (per block for reduce_scatter, all_to_all and scatter, whose
    inputs hold one block per rank). root: the src/dst rank where the collective has one.
    """
    _check(collective, cluster.world_size, root)
    out = cluster.run(_on_rank, collective, numel, root, timeout=timeout)
    before, after = [b for b, _ in out], [a for _, a in out]
    if collective == "barrier":  # times -> ms since the first rank arrived
        first = min(b.item() for b in before)
        before = [(b - first) * 1e3 for b in before]
        after = [(a - first) * 1e3 for a in after]
    return LiveResult(collective, cluster.world_size, root, before, after, CALLS[collective])


def expected_after(collective: str, before: list, root: int = 0) -> list:
    """What each rank must hold after ``collective``, from the ``before`` tensors, computed
    in one process (None where the rank holds nothing meaningful). Not for "barrier"."""
    n = len(before)
    _check(collective, n, root)
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
    if collective == "scatter":
        return list(before[root].chunk(n))
    if collective == "send_recv":
        peer = (root + 1) % n
        return [before[root].clone() if r == peer else before[r].clone() for r in range(n)]
    raise ValueError("barrier moves no data: check that every rank left after the last arrived")


def contributions(collective: str, world_size: int, numel: int = 4, root: int = 0) -> list:
    """For each rank after ``collective``: per element, the set of ranks whose input it
    holds (None where the rank holds nothing) -- ``expected_after`` on one-bit inputs."""
    if collective == "barrier":
        return [None] * world_size
    bits = []
    for r in range(world_size):
        t = initial_tensor(collective, r, world_size, numel, root)
        bits.append(None if t is None else torch.full_like(t, 1 << r))
    out = []
    for t in expected_after(collective, bits, root):
        out.append(None if t is None else
                   [frozenset(k for k in range(world_size) if int(v) >> k & 1) for v in t])
    return out
