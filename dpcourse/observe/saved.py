"""``Activations``: the bytes autograd keeps for backward on each rank, live, with their peak.

    acts = dpc.observe.Activations()
    cluster.run(train, observe=[acts])
    acts.peak(rank=0)          # most bytes saved for backward at once, over the call
    acts.at_backward(rank=0)   # bytes held when each backward began (what forward left behind)

A ``torch.autograd.graph.saved_tensors_hooks`` pair counts every tensor autograd saves, from
the moment it is saved until autograd releases it (after the backward that used it).
Parameters and views of them are left out (they are held anyway); a storage saved twice
counts once; a saved view counts its whole storage. Activation checkpointing shows in
``at_backward``: a checkpointed block keeps only its input through forward (its own hooks
take over inside it) and recomputes the rest when backward reaches it, one block at a time.
A backward begins at the first saved tensor autograd unpacks after a forward saved some.
"""
from __future__ import annotations

import weakref

import torch

from ..torch_private import tensor_base
from .observer import Observer


class _Saved:
    """What autograd stores instead of the tensor while the hooks are on."""

    def __init__(self, tensor):
        self.tensor = tensor


class Activations(Observer):
    """Observer: bytes saved for backward on every rank (``live`` now, ``peak`` so far)."""

    NAME = "acts"   # in the message when nothing was observed yet

    def __init__(self):
        self.per_rank: list[dict] | None = None

    def __repr__(self) -> str:
        return "Activations()" if self.per_rank is None else f"Activations(observed on {len(self.per_rank)} ranks)"

    # --- on the rank -----------------------------------------------------------------
    def __enter__(self):
        self.live = self.peak_bytes = 0
        self.backward_starts: list[int] = []
        self._packing = False
        self._count: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        del self._hooks

    def _pack(self, t):
        base = t if tensor_base(t) is None else tensor_base(t)  # a Linear saves its weight transposed: a view
        if base.is_leaf and base.requires_grad:  # a parameter (sharded or gathered): not an activation
            return t
        self._packing = True
        key = t.untyped_storage().data_ptr()
        if self._count.get(key, 0) == 0:
            self._size[key] = t.untyped_storage().nbytes()
            self.live += self._size[key]
            self.peak_bytes = max(self.peak_bytes, self.live)
        self._count[key] = self._count.get(key, 0) + 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, key)  # autograd drops it after its backward
        return saved

    def _release(self, key):
        self._count[key] -= 1
        if self._count[key] == 0:
            self.live -= self._size.pop(key)

    def _unpack(self, saved):
        if self._packing:  # the first unpack after packing: a backward begins
            self._packing = False
            self.backward_starts.append(self.live)
        return saved.tensor if isinstance(saved, _Saved) else saved

    def result(self) -> dict:
        return {"peak": self.peak_bytes, "live": self.live, "at_backward": list(self.backward_starts)}

    # --- in the kernel -----------------------------------------------------------------
    def peak(self, rank: int = 0) -> int:
        """Most bytes ``rank`` had saved for backward at one moment of the call."""
        return self.of_rank(rank)["peak"]

    def at_backward(self, rank: int = 0) -> list[int]:
        """Bytes ``rank`` held saved for backward when each of its backward passes began."""
        return self.of_rank(rank)["at_backward"]
