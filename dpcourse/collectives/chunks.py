"""How a tensor is cut into one chunk per rank, and what a receiver does in each phase: shared
by the schedules (``schedule``) and the record of what was sent (``trace``)."""
from __future__ import annotations

# The phases a transfer can belong to, and what the receiver does with what arrives:
# "add" reduces it into its own copy, "copy" overwrites its own copy.
PHASES = {"reduce-scatter": "add", "all-gather": "copy",     # ring
          "reduce": "add", "broadcast": "copy",              # naive: via one root rank
          "pass": "add"}                                     # whole tensor around the ring


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """(start, stop) element offsets of the ``world_size`` chunks of a tensor of ``numel``."""
    if world_size < 1 or numel < 0:
        raise ValueError(f"need world_size >= 1 and numel >= 0, got {world_size} and {numel}")
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for c in range(world_size):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
