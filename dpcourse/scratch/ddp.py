"""Data-parallel wrappers from scratch, each a step closer to torch DDP.

    model = BucketedDDP(model, bucket_cap_mb=25)      # or NaiveDDP(model), OverlapDDP(model)
    loss_fn(model(x), y).backward()                    # gradients are averaged over ranks here
    optimizer.step()

* ``NaiveDDP``: after backward, all-reduce every gradient, one after another.
* ``OverlapDDP``: one asynchronous all-reduce per parameter, launched the moment that
  parameter's gradient is accumulated, so communication overlaps the rest of backward.
* ``BucketedDDP``: gradients copied into flat buckets (``bucketed.BucketManager``); one
  asynchronous all-reduce per bucket -- fewer, larger messages, still overlapped.

Training code runs unchanged on any of them or on torch DDP: ``.module``, ``no_sync()``
(accumulate locally; the next backward outside it synchronises the sum) and
``require_backward_grad_sync`` are torch DDP's. At construction they broadcast rank 0's
parameters and buffers, so ranks initialised with different seeds start equal. Frozen
parameters (``requires_grad=False``) are skipped; a tied parameter is one tensor,
accumulated once per backward, so it is reduced once.

Two methods are the wrapper's vocabulary, public so that a subclass can change them:

* ``grad_ready(param)``: called when ``param.grad`` is complete. The hook behind it is
  ``Tensor.register_post_accumulate_grad_hook``, which is called with the *parameter*,
  not with the gradient.
* ``comm_hook(tensor, name)``: start averaging ``tensor`` over the ranks and return the
  ``Work``; the idea of torch DDP's ``register_comm_hook``, whose default hook divides
  the bucket by the world size and all-reduces it.

``finish_gradient_synchronization()`` waits for the communication still in flight. It is
not torch DDP's (torch DDP waits inside backward and has no such method): it is the name
of that step in CS336's DDP assignment, whose tests call it after backward. Here it also
runs by itself when backward ends (a callback queued on the autograd engine), so
``loss.backward()`` returns with averaged gradients, as with torch DDP; calling it again
does nothing.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn

from ..torch_private import queue_backward_callback
from .bucketed import BucketManager


def broadcast_module(model: nn.Module, src: int = 0, group=None) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's model (of ``group``), in place."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=src, group=group)


class _DataParallel(nn.Module):
    """What the three wrappers share: the DDP surface, the hooks, the end-of-backward callback."""

    def __init__(self, module: nn.Module, group=None, broadcast_buffers: bool = True):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs a process group: run it on the ranks "
                               "of a dpc.Cluster (cluster.run(fn)) or after dist.init_process_group")
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self._callback_queued = False
        broadcast_module(module, group=group)
        self._trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = {p: n for n, p in self._trainable}
        # The hooks hold the wrapper weakly: a wrapper dropped in a notebook stops reducing.
        ref = weakref.ref(self)

        def hook(param, ref=ref):
            wrapper = ref()
            if wrapper is not None:
                wrapper._on_grad_accumulated(param)

        for _, p in self._trainable:
            p.register_post_accumulate_grad_hook(hook)

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1:
            # like DDP: rank 0's buffers (e.g. BatchNorm running stats) win at every forward
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, src=0, group=self.group)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward only accumulates gradients locally (gradient accumulation)."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def comm_hook(self, tensor: torch.Tensor, name: str):
        """Start averaging ``tensor`` over the ranks, in place; returns the async ``Work``.
        ``name``: what the tensor is (a parameter's name, "bucket 3"), for observers."""
        tensor.div_(self.world_size)  # divide first, then sum: what DDP's default hook does
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        if not self.require_backward_grad_sync:
            return  # inside no_sync(): keep accumulating locally
        if not self._callback_queued:
            self._callback_queued = True
            queue_backward_callback(self._end_of_backward)  # as DDP's reducer does: once backward ends
        self.grad_ready(param)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.finish_gradient_synchronization()

    def grad_ready(self, param: torch.Tensor) -> None:
        """``param.grad`` is complete (each wrapper decides what to do with it)."""

    def finish_gradient_synchronization(self) -> None:
        """Wait for all outstanding gradient communication; harmless if there is none."""


class NaiveDDP(_DataParallel):
    """All-reduce every gradient after backward, one blocking call per parameter."""

    def __init__(self, module: nn.Module, group=None, broadcast_buffers: bool = True):
        super().__init__(module, group, broadcast_buffers)
        self._pending = False

    def grad_ready(self, param):
        self._pending = True  # nothing to do yet: wait for the end of backward

    def finish_gradient_synchronization(self) -> None:
        if not self._pending:
            return
        self._pending = False
        for name, p in self._trainable:
            if p.grad is None:
                raise RuntimeError(f"parameter {name!r} got no gradient: it was not used to compute "
                                   "the loss; freeze it (requires_grad_(False)) or use it")
            self.comm_hook(p.grad, name).wait()


class OverlapDDP(_DataParallel):
    """One async all-reduce per parameter, launched as soon as its gradient is accumulated.

    Every rank runs the same autograd graph, and the engine visits it in the same order on
    each, so the ranks launch their all-reduces in the same order.
    """

    def __init__(self, module: nn.Module, group=None, broadcast_buffers: bool = True):
        super().__init__(module, group, broadcast_buffers)
        self.works: list = []  # the all-reduces in flight, in launch order

    def grad_ready(self, param):
        # the hook's argument is the parameter; its .grad is what we reduce
        self.works.append(self.comm_hook(param.grad, self._names[param]))

    def finish_gradient_synchronization(self) -> None:
        works, self.works = self.works, []
        for work in works:
            work.wait()


class BucketedDDP(_DataParallel):
    """Gradients packed into buckets of ``bucket_cap_mb`` MiB in reverse registration order
    (the first one ``first_bucket_cap_mb``, if given); each bucket all-reduced asynchronously
    when full; all waited for at the end of backward.
    After a step, each ``param.grad`` is a view of its bucket (torch DDP's
    ``gradient_as_bucket_view=True``), so gradients take no memory beyond the buckets."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, group=None,
                 broadcast_buffers: bool = True, first_bucket_cap_mb: float | None = None):
        super().__init__(module, group, broadcast_buffers)
        self.bucket_cap_mb, self.first_bucket_cap_mb = bucket_cap_mb, first_bucket_cap_mb
        self.buckets = BucketManager(self._trainable, bucket_cap_mb, first_bucket_cap_mb)

    def grad_ready(self, param):
        for bucket in self.buckets.add_grad(param):  # the buckets now due, in index order
            bucket.launch(self.comm_hook)

    def finish_gradient_synchronization(self) -> None:
        self.buckets.wait()
