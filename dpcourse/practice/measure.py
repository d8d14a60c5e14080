"""Observers for the large-model practice: what a rank holds, what autograd saves, what FSDP2 did when.

Kept apart from the training code they observe (``dpcourse.practice.*``), which has no
measuring lines in it:

* ``parameter_bytes(model)``: bytes of real parameter storage on this rank (a DTensor counts
  its local shard; a parameter on the meta device counts 0: it has a shape and no storage).
* ``SavedTensors``: a ``torch.autograd.graph.saved_tensors_hooks`` pair that counts the bytes
  autograd keeps for backward (activations), live, with their peak. Parameters and views of
  them are left out (they are held anyway); a storage saved twice counts once; a saved view
  counts its whole storage (slice a batch with ``.clone()`` to count only the slice).
* ``fsdp2_events(model, step)``: runs ``step()`` under ``torch.profiler`` and turns the ranges
  FSDP2 labels itself (``FSDP::all_gather (blocks.1)``, ``FSDP::pre_forward (blocks.1)``, ...)
  into the course's timeline events (``dpcourse.scratch.timeline.Event``), in seconds since
  the first event.
* ``fsdp1_events(model, step)``: the same for FSDP1, through the course's ``FSDP1Observer``.
"""
from __future__ import annotations

import contextlib
import os
import re
import weakref
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn

from ..scratch.timeline import COMM, COMPUTE, Event


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of real (non-meta) parameter storage this rank holds, each storage counted once."""
    seen, total = set(), 0
    for p in model.parameters():
        t = _local(p)
        if t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def bytes_by_device(tensors) -> dict[str, int]:
    """Bytes of the given tensors' storages per device type ("cpu", "cuda", ...), each counted once."""
    seen, out = set(), {}
    for t in tensors:
        t = _local(t)
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or t.is_meta:
            continue
        seen.add(storage.data_ptr())
        out[t.device.type] = out.get(t.device.type, 0) + storage.nbytes()
    return out


class _Saved:
    """What autograd stores instead of the tensor while our hooks are on."""

    def __init__(self, tensor):
        self.tensor = tensor


class SavedTensors:
    """``with SavedTensors() as saved:`` counts bytes autograd keeps for backward (``live``,
    ``peak``), from the moment a tensor is saved until autograd releases it."""

    def __init__(self):
        self.live = self.peak = 0
        self._count: dict[int, int] = {}
        self._size: dict[int, int] = {}

    def _pack(self, t):
        base = t if t._base is None else t._base  # a Linear saves its weight transposed: a view
        if base.is_leaf and base.requires_grad:  # a parameter (sharded or gathered): not an activation
            return t
        key = t.untyped_storage().data_ptr()
        if self._count.get(key, 0) == 0:
            self._size[key] = t.untyped_storage().nbytes()
            self.live += self._size[key]
            self.peak = max(self.peak, self.live)
        self._count[key] = self._count.get(key, 0) + 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, key)  # autograd drops it after its backward
        return saved

    def _release(self, key):
        self._count[key] -= 1
        if self._count[key] == 0:
            self.live -= self._size.pop(key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        del self._hooks  # the counts stay; the object can travel back to the kernel


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 briefly: the profiler's C++ side prints a tracing line at
    start and at stop that says nothing about the program."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# FSDP2's own labels. A unit's compute lies between the end of its pre-hook (which may be
# followed by a prefetch it issues, "FSDP::forward_prefetch for blocks.2") and its post-hook.
_LABEL = re.compile(r"FSDP::(all_gather|pre_forward|post_forward|pre_backward|post_backward_reduce) \((.+)\)$"
                    r"|FSDP::(forward|backward)_prefetch for (.+)$")


def fsdp2_events(model, step) -> list[dict]:
    """Run ``step()`` of the FSDP2 ``model`` under the profiler; FSDP2's all-gathers and per-unit compute as event dicts.

    Times are seconds since the first FSDP2 range of the step (the profiler counts in
    microseconds). Only units with a name (not the root) are kept.
    """
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    with _quiet_stderr():
        prof.start()
    try:
        step()
    finally:
        with _quiet_stderr():
            prof.stop()
    spans = sorted((e.time_range.start, e.time_range.end, m.group(1) or "prefetch", m.group(2) or m.group(4))
                   for e in prof.events() if (m := _LABEL.match(e.name)))
    t0, rank, events, opened, current = spans[0][0] if spans else 0, dist.get_rank(), [], {}, None
    for start, end, what, unit in spans:
        start, end = (start - t0) / 1e6, (end - t0) / 1e6
        if what == "all_gather":
            events.append(Event(rank, COMM, "all_gather", unit, start, end))
        elif what == "prefetch":  # issued by the current unit before it computes
            if current in opened:
                opened[current] = max(opened[current], end)
        elif what.startswith("pre_"):
            opened[unit], current = end, unit
        elif unit in opened:
            kind = "forward" if what == "post_forward" else "backward"
            events.append(Event(rank, COMPUTE, kind, unit, opened.pop(unit), start))
    return [asdict(e) for e in sorted(events, key=lambda e: (e.start, e.end))]


def fsdp1_events(model, step) -> list[dict]:
    """Run ``step()`` of the FSDP1 ``model`` with ``FSDP1Observer`` attached; all-gathers and
    per-unit compute as event dicts, seconds since the first. The observer names each
    all-gather from FSDP1's order (one per unit, reverse order in backward): right for every
    ``backward_prefetch``, not for ``forward_prefetch=True``."""
    from ..scratch.observe import FSDP1Observer
    from ..scratch.timeline import Timeline

    timeline = Timeline(dist.get_rank())
    observer = FSDP1Observer(model, timeline)
    try:
        with observer:
            step()
    finally:
        observer.remove()
    events = [e for e in timeline.to_list() if e["kind"] in ("all_gather", "forward", "backward")
              and e["name"] != "root"]
    t0 = min((e["start"] for e in events), default=0.0)
    return [{**e, "start": e["start"] - t0, "end": e["end"] - t0} for e in events]
