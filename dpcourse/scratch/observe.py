"""Record timelines from outside: per-layer backward, the collectives of torch DDP, FSDP1 and
of the from-scratch wrappers, through the hooks each of them offers.

* ``BackwardObserver(module, timeline)``: for each layer (a module with parameters of its
  own), a "backward" span from the moment its output gradient arrives (a tensor hook on
  its output) to the moment its last parameter gradient is accumulated; and the end of
  backward compute, to measure how long ``backward()`` then waited for communication.
* ``observe_ddp_communication(ddp, timeline)``: a DDP communication hook that does what the
  default hook does (divide by the world size, all-reduce the bucket) and records each
  bucket's launch and completion (the hook sees ``bucket.index()`` and ``bucket.buffer()``).
* ``FSDP1Observer(fsdp_model, timeline)``: FSDP1 calls ``dist.all_gather`` (on CPU; on
  GPUs ``all_gather_single``) and ``dist.reduce_scatter_single`` from Python, blocking on
  CPU; inside ``with observer:`` those calls are timed, and each unit's forward and
  backward recorded from module hooks. FSDP1 frees unsharded parameters inside its
  internals, with no hook to see it, so "free" is not observed.
* ``observe_comm_hook(wrapper, timeline)``: NaiveDDP, OverlapDDP and BucketedDDP send
  every all-reduce through their public ``comm_hook(tensor, name)``; this wraps it and
  records each collective from launch to completion, as for torch DDP above.
* ``MiniFSDPObserver(fsdp, timeline)``: wraps MiniFSDP's public steps (``pre_forward``,
  ``post_forward``, ``pre_backward``, ``post_backward``, ``comm_hook``) and each unit's
  ``gather``/``free``: compute spans, collectives, the waits for them, and how long each
  unit's gathered parameters lived.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from .timeline import COMM, COMPUTE, WAIT


def _on_output_grad(output, fn) -> None:
    """Call ``fn()`` once, when backward reaches ``output`` (its gradient has been computed):
    the moment a layer's own backward begins. A tensor hook, as FSDP uses; unlike a full
    backward pre-hook it does not wrap the layer's inputs and outputs."""
    tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
    fired = []

    def hook(grad):
        if not fired:
            fired.append(True)
            fn()

    for t in tensors:
        t.register_hook(hook)


class BackwardObserver:
    """Per-layer backward spans and the end of backward compute of a plain module."""

    def __init__(self, module: nn.Module, timeline, prefix: str = ""):
        self.timeline = timeline
        self.last_ready = None  # perf_counter() of the latest gradient accumulation
        self._handles, self._start, self._left = [], {}, {}
        seen = set()
        for name, layer in module.named_modules():
            own = [p for p in layer.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
            if not own:
                continue
            seen.update(id(p) for p in own)
            label = prefix + (name or "root")
            self._handles.append(layer.register_forward_hook(
                lambda m, a, out, label=label, n=len(own): _on_output_grad(out, lambda: self._begin(label, n))))
            for p in own:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, label=label: self._accumulated(label)))

    def _begin(self, label, count):
        self._start[label], self._left[label] = time.perf_counter(), count

    def _accumulated(self, label):
        self.last_ready = now = time.perf_counter()
        if label in self._left:
            self._left[label] -= 1
            if self._left[label] == 0:
                self.timeline.add(COMPUTE, "backward", label, self._start.pop(label), now)
                del self._left[label]

    def backward_returned(self) -> None:
        """Call right after ``loss.backward()`` returns: records the time backward() spent
        after its last gradient was computed (waiting for communication) as a wait span."""
        if self.last_ready is not None:
            self.timeline.add(COMPUTE, WAIT, "gradient sync", self.last_ready)
            self.last_ready = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def observe_ddp_communication(ddp_model, timeline) -> None:
    """Register a comm hook on a torch DDP model: DDP's own default all-reduce
    (``allreduce_hook``), with each bucket's span recorded."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        start = time.perf_counter()
        index, nbytes = bucket.index(), bucket.buffer().numel() * bucket.buffer().element_size()

        def done(f):
            timeline.add(COMM, "all_reduce", f"bucket {index}", start, nbytes=nbytes)
            return f.value()

        return allreduce_hook(state, bucket).then(done)

    ddp_model.register_comm_hook(None, hook)


class FSDP1Observer:
    """Times torch FSDP1's all-gathers and reduce-scatters and its units' compute spans.

    Collectives are named by unit from the order FSDP1 issues them: in forward, right after
    the unit's forward starts; in backward, units in reverse forward order (the root, which
    FSDP1 keeps gathered after forward, is not gathered again; it reduces last).
    """

    def __init__(self, fsdp_model, timeline):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        self.timeline = timeline
        self._handles, self._saved, self._open = [], {}, {}
        self._forward_units: list[str] = []
        self._next_forward_gather = None
        self._backward_gathers: list[str] = []
        self._backward_reductions: list[str] = []
        for name, unit in fsdp_model.named_modules():
            if not isinstance(unit, FSDP):
                continue
            label = name.replace("_fsdp_wrapped_module.", "") or "root"
            inner = unit.module  # the wrapped module: its hooks run after FSDP gathered it
            self._handles += [
                unit.register_forward_pre_hook(lambda m, a, label=label: self._unit_called(label)),
                inner.register_forward_pre_hook(lambda m, a, label=label: self._begin("fw " + label)),
                inner.register_forward_hook(lambda m, a, o, label=label: self._forward_done(label)),
                inner.register_forward_hook(lambda m, a, out, label=label: _on_output_grad(
                    out, lambda: self._begin("bw " + label))),
            ]

    def _unit_called(self, label):
        if label == "root":
            self._forward_units = []
        self._forward_units.append(label)
        self._next_forward_gather = label

    def _begin(self, key):
        self._open[key] = time.perf_counter()

    def _forward_done(self, label):
        start = self._open.pop("fw " + label)
        if label != "root":  # the root's span is the whole forward
            self.timeline.add(COMPUTE, "forward", label, start)
        if label == "root":  # the forward is over: what backward will do, in order
            self._backward_gathers = [u for u in reversed(self._forward_units) if u != "root"]
            self._backward_reductions = [u for u in reversed(self._forward_units) if u != "root"] + ["root"]

    def _timed(self, kind, fn):
        def call(output, input, *args, **kwargs):
            start = time.perf_counter()
            result = fn(output, input, *args, **kwargs)
            if kind == "all_gather":
                tensor = output
                if self._next_forward_gather is not None:
                    name, self._next_forward_gather = self._next_forward_gather, None
                else:
                    name = self._backward_gathers.pop(0) if self._backward_gathers else "?"
            else:
                tensor = input
                name = self._backward_reductions.pop(0) if self._backward_reductions else "?"
                begun = self._open.pop("bw " + name, None)
                if begun is not None and name != "root":  # a unit's backward ends with its reduce-scatter
                    self.timeline.add(COMPUTE, "backward", name, begun, start)
            tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
            self.timeline.add(COMM, kind, name, start, nbytes=sum(t.numel() * t.element_size() for t in tensors))
            self.timeline.add(COMPUTE, WAIT, f"{kind} {name}", start)
            return result
        return call

    def __enter__(self):
        # FSDP1 gathers with dist.all_gather (a list of chunks) on CPU, all_gather_single on GPUs
        for attr, kind in (("all_gather", "all_gather"), ("all_gather_single", "all_gather"),
                           ("reduce_scatter_single", "reduce_scatter")):
            self._saved[attr] = getattr(dist, attr)
            setattr(dist, attr, self._timed(kind, self._saved[attr]))
        return self

    def __exit__(self, *exc):
        for attr, fn in self._saved.items():
            setattr(dist, attr, fn)
        self._saved.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def observe_comm_hook(wrapper, timeline) -> None:
    """Record every all-reduce a from-scratch DDP wrapper launches through ``comm_hook``."""
    hook = wrapper.comm_hook

    def timed(tensor, name):
        start = time.perf_counter()
        return timeline.comm(hook(tensor, name), "all_reduce", name,
                             tensor.numel() * tensor.element_size(), start)

    wrapper.comm_hook = timed  # an instance attribute: found before the class's method


class _RecordedWait:
    """A ``Work`` whose ``wait()`` is recorded as a compute "wait" span."""

    def __init__(self, work, timeline, name: str):
        self.work, self.timeline, self.name = work, timeline, name

    def wait(self):
        start = time.perf_counter()
        result = self.work.wait()
        self.timeline.add(COMPUTE, WAIT, self.name, start)
        return result


class MiniFSDPObserver:
    """Forward/backward spans per unit, collectives, waits and gathered lifetimes of MiniFSDP.

    The root's compute spans are left out when there are other units (they would cover the
    whole pass). A unit's "unsharded" span runs from its ``gather`` call to its ``free``.
    """

    def __init__(self, fsdp, timeline):
        self.timeline, self.several = timeline, len(fsdp.units) > 1
        self._start, self._held = {}, {}
        steps = {n: getattr(fsdp, n) for n in ("pre_forward", "post_forward", "pre_backward",
                                               "post_backward", "comm_hook")}

        def pre_forward(unit):
            steps["pre_forward"](unit)
            self._start[unit.name] = time.perf_counter()

        def post_forward(unit, output):
            self._compute("forward", unit)
            steps["post_forward"](unit, output)

        def pre_backward(unit):
            first = not unit.backward_started
            steps["pre_backward"](unit)
            if first:
                self._start[unit.name] = time.perf_counter()

        def post_backward(unit):
            self._compute("backward", unit)
            steps["post_backward"](unit)

        def comm_hook(collective, output, input, name):
            start = time.perf_counter()
            nbytes = max(t.numel() * t.element_size() for t in (output, input))
            work = timeline.comm(steps["comm_hook"](collective, output, input, name),
                                 collective, name, nbytes, start)
            return _RecordedWait(work, timeline, f"{collective} {name}")

        fsdp.pre_forward, fsdp.post_forward = pre_forward, post_forward
        fsdp.pre_backward, fsdp.post_backward, fsdp.comm_hook = pre_backward, post_backward, comm_hook
        for unit in fsdp.units:
            unit.gather, unit.free = self._gather(unit), self._free(unit)

    def _compute(self, kind, unit):
        start = self._start.pop(unit.name, None)
        if start is not None and not (unit.is_root and self.several):
            self.timeline.add(COMPUTE, kind, unit.name, start)

    def _gather(self, unit):
        gather = unit.gather

        def timed(comm_hook):
            start = time.perf_counter()
            gather(comm_hook)
            self._held[unit.name] = start
        return timed

    def _free(self, unit):
        free = unit.free

        def timed():
            start = self._held.pop(unit.name, None)
            if unit.gathered and start is not None:
                self.timeline.add("memory", "unsharded", unit.name, start)
            free()
        return timed
