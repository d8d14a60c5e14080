"""Who sends which chunk to whom, step by step: the schedules of our all-reduce algorithms.

Pure computation, no processes. The ring functions on the ranks walk these same schedules,
and ``simulate`` plays them on in-memory tensors, so a figure or a unit test can show an
algorithm without starting ranks (a test checks that real traced runs match it step for step).

Chunk ``c`` of a tensor of ``numel`` elements is ``chunk_bounds(numel, world_size)[c]``:
the first ``numel % world_size`` chunks get one element more, as ``torch.tensor_split``
does, so any ``numel`` works, even fewer elements than ranks (some chunks are then empty).
"""
from __future__ import annotations

from dataclasses import dataclass

from .chunks import PHASES, chunk_bounds
from .trace import Trace, Transfer

ALGORITHMS = ("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather",
              "naive_all_reduce", "whole_ring_all_reduce")


@dataclass(frozen=True)
class Send:
    """One planned point-to-point transfer: ``src`` sends chunk ``chunk`` (None: the whole
    tensor) to ``dst`` at ``step`` (counted from 0 over the whole operation)."""
    phase: str
    step: int
    src: int
    dst: int
    chunk: int | None


def ring_reduce_scatter_steps(world_size: int, first_step: int = 0) -> list[list[Send]]:
    """N-1 steps; at step s rank r sends chunk (r-s-1) mod N to rank r+1, which adds it.

    After the last step rank r holds chunk r fully reduced -- the chunk that
    ``dist.reduce_scatter_single`` gives rank r.
    """
    n = world_size
    return [[Send("reduce-scatter", first_step + s, r, (r + 1) % n, (r - s - 1) % n)
             for r in range(n)] for s in range(n - 1)]


def ring_all_gather_steps(world_size: int, first_step: int = 0) -> list[list[Send]]:
    """N-1 steps; at step s rank r passes chunk (r-s) mod N on to rank r+1 (starting with
    its own chunk r), so after N-1 steps every rank holds every chunk."""
    n = world_size
    return [[Send("all-gather", first_step + s, r, (r + 1) % n, (r - s) % n)
             for r in range(n)] for s in range(n - 1)]


def ring_all_reduce_steps(world_size: int) -> list[list[Send]]:
    """Reduce-scatter then all-gather: 2(N-1) steps, N sends per step."""
    n = world_size
    return ring_reduce_scatter_steps(n) + ring_all_gather_steps(n, first_step=n - 1)


def naive_all_reduce_steps(world_size: int, root: int = 0) -> list[list[Send]]:
    """Every other rank sends its whole tensor to ``root``, which adds them up (step 0) and
    sends the sum back to each of them (step 1)."""
    others = [r for r in range(world_size) if r != root]
    if not others:
        return []
    return [[Send("reduce", 0, r, root, None) for r in others],
            [Send("broadcast", 1, root, r, None) for r in others]]


def whole_ring_all_reduce_steps(world_size: int) -> list[list[Send]]:
    """N-1 steps; at each, every rank passes a whole tensor to rank r+1 (its own at step 0,
    then the one it just received) and adds what arrives: (N-1) whole tensors per rank."""
    n = world_size
    return [[Send("pass", s, r, (r + 1) % n, None) for r in range(n)] for s in range(n - 1)]


def algorithm_steps(algorithm: str, world_size: int) -> list[list[Send]]:
    """The steps of ``algorithm`` (one of ``ALGORITHMS``) on ``world_size`` ranks."""
    table = {"ring_all_reduce": ring_all_reduce_steps,
             "ring_reduce_scatter": ring_reduce_scatter_steps,
             "ring_all_gather": ring_all_gather_steps,
             "naive_all_reduce": naive_all_reduce_steps,
             "whole_ring_all_reduce": whole_ring_all_reduce_steps}
    if algorithm not in table:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, not {world_size!r}")
    return table[algorithm](world_size)


def simulate(algorithm: str, world_size: int, numel: int, itemsize: int = 4, inputs=None):
    """Play ``algorithm`` without processes; return its ``Trace``.

    itemsize: bytes per element. inputs: optional list of ``world_size`` 1-D tensors of
    ``numel`` elements (one per rank); then the trace also records what each transfer
    carries and every rank's result, computed on in-memory copies.
    """
    steps = algorithm_steps(algorithm, world_size)
    bounds = chunk_bounds(numel, world_size)
    trace = Trace(algorithm=algorithm, world_size=world_size, numel=numel, itemsize=itemsize,
                  record_values=inputs is not None)
    held = forwarded = None
    if inputs is not None:
        if len(inputs) != world_size or any(t.numel() != numel for t in inputs):
            raise ValueError(f"inputs must be {world_size} tensors of {numel} elements each")
        held = [t.detach().reshape(-1).clone() for t in inputs]
        forwarded = [t.clone() for t in held]  # whole-ring: what each rank passes on next
        trace.inputs = {r: t.clone() for r, t in enumerate(held)}
    for sends in steps:
        payloads = []
        for s in sends:
            lo, hi = bounds[s.chunk] if s.chunk is not None else (0, numel)
            values = None
            if held is not None:
                source = forwarded[s.src] if s.phase == "pass" else held[s.src]
                values = source[lo:hi].clone()
            payloads.append(values)
            trace.transfers.append(Transfer(s.phase, s.step, s.src, s.dst, s.chunk,
                                            hi - lo, (hi - lo) * itemsize, values))
        if held is None:
            continue
        for s, values in zip(sends, payloads):  # everything of one step arrives "at once"
            lo, hi = bounds[s.chunk] if s.chunk is not None else (0, numel)
            if PHASES[s.phase] == "add":
                held[s.dst][lo:hi] += values
            else:
                held[s.dst][lo:hi] = values
            if s.phase == "pass":
                forwarded[s.dst] = values
    if held is not None:
        trace.outputs = dict(enumerate(held))
    return trace
