"""Counts the collectives a rank enters, so a hang can be reported as "waiting in all_reduce #17".

Runs on the ranks. It wraps the public ``torch.distributed`` collectives once at rank
start-up; code that calls ``dist.all_reduce`` (the course's, the learner's, FSDP's Python
side) goes through the wrapper. DDP's C++ reducer calls Gloo/NCCL directly, so its
all-reduces are not counted; the Python stack in the report still shows where the rank is.
"""
from __future__ import annotations

import functools
import threading
import time

COLLECTIVES = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list",
)


class CollectiveTracker:
    """Per-rank counter of collective calls: which one is in progress and which came last."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.current: tuple[str, int, float] | None = None  # (name, number, monotonic start)
        self.last: tuple[str, int] | None = None
        self._lock = threading.Lock()

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None or getattr(original, "_dpcourse_wrapped", False):
                continue
            wrapped = self._wrap(name, original)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def tracked(*args, **kwargs):
            with self._lock:
                number = self.counts.get(name, 0) + 1
                self.counts[name] = number
                outer, self.current = self.current, (name, number, time.monotonic())
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.last = (name, number)
                    self.current = outer

        tracked._dpcourse_wrapped = True
        return tracked

    def describe(self) -> str:
        """One line: the collective in progress, or the last one that returned."""
        with self._lock:
            current, last = self.current, self.last
        if current:
            name, number, start = current
            return f"waiting in {name} #{number} for {time.monotonic() - start:.1f} s"
        if last:
            return f"last collective {last[0]} #{last[1]} returned"
        return "no collective entered yet"
