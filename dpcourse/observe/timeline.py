"""``Timeline``: what each rank computed and communicated, and when, seen from outside.

    tl = dpc.observe.Timeline()
    cluster.run(train, observe=[tl])
    events = tl.events(step=-1)          # the last step of every rank, merged, in seconds
    dpc.viz.draw_timeline(events)        # a Gantt chart per rank
    tl.hidden_fraction(step=-1)          # share of communication that ran under compute

Nothing in the training code changes; PyTorch's public hooks say what happens:

* **compute**, per layer -- a module without children that has a ``weight`` (a Linear, an
  Embedding, a LayerNorm): ``forward`` spans from PyTorch's global forward hooks;
  ``backward`` spans from a tensor hook on the layer's output (its gradient has arrived: the
  layer's backward begins) to the next such moment, or to the end of backward compute (an
  autograd-engine callback queued when backward starts, which runs as soon as the last
  gradient is computed -- before DDP's own, which waits for its buckets); ``optimizer``
  spans from the optimizer step hooks; and ``wait``: from the end of backward compute to the
  optimizer step, the time ``backward()`` sat waiting for communication (in a plain loop).
* **comm**, per collective: from the moment it was issued (the collective tracker,
  ``dpcourse.tracking``) to the moment its ``Work`` completed (its future's callback,
  which the backend runs when the operation is done, not when somebody waits for it); its
  ``nbytes`` is the payload S as ``Comm`` counts it (``payload.payload_bytes``: a
  reduce-scatter's input, an all-gather's output).

Steps, layers' forwards and the optimizer come from the call's shared step clock
(``watch.LoopWatch``), the one every observer of the call reads.

Times are ``time.perf_counter()``, CLOCK_MONOTONIC on Linux: one clock for every process of
a machine, so ranks line up. On a GPU the compute spans are when the CPU issued the work.
"""
from __future__ import annotations

import time

import torch
from ..torch_private import queue_backward_callback, tree_flatten

from .comm import Completions
from . import events as ev
from .observer import Observer
from .payload import first_tensor, issued_bytes
from .watch import LoopWatch, unwrapped_names


def _is_layer(module) -> bool:
    return next(module.children(), None) is None and isinstance(getattr(module, "weight", None), torch.Tensor)


def _grad_outputs(output):
    return [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]


class Timeline(Observer):
    """Observer: compute and communication spans on every rank, by training step."""

    NAME = "timeline"   # in the message when nothing was observed yet

    def __init__(self):
        self.per_rank: list[dict] | None = None

    # --- on the rank -----------------------------------------------------------------
    def __enter__(self):
        import torch.distributed as dist

        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._events: list[dict] = []
        self._names: dict = {}
        self._forward_start: dict = {}
        self._backward_open = None  # (layer name, start) of the layer whose backward runs now
        self._backward_end = None  # when backward compute last ended
        self._comm_counts: dict[str, int] = {}
        self._completions = Completions()
        self._clocks = [(time.perf_counter(), time.process_time())]  # at the start and every step's end
        self._watch = self.watch(LoopWatch(on_forward=self._on_outer_forward, on_step_begin=self._on_step_begin,
                                           on_step_end=self._on_step_end, on_module_forward=self._pre_forward,
                                           on_module_output=self._post_forward), listen=self._issued)
        return self

    def __exit__(self, *exc):
        self.unwatch(*exc)
        self._completions.close()  # collectives without a future report from its thread

    def _add(self, lane: str, kind: str, name: str, start: float, end: float, nbytes: int = 0,
             step: int | None = None) -> None:
        self._events.append({"rank": self._rank, "lane": lane, "kind": kind, "name": name, "start": start,
                             "end": end, "nbytes": nbytes, "step": self._watch.steps if step is None else step})

    def _on_outer_forward(self, module) -> None:
        if module not in self._names:
            self._names.update(unwrapped_names(module))

    def _pre_forward(self, module, _args) -> None:
        if _is_layer(module):
            self._forward_start[module] = time.perf_counter()

    def _post_forward(self, module, _args, output) -> None:
        start = self._forward_start.pop(module, None)
        if start is None:
            return
        name = self._names.get(module, type(module).__name__)
        self._add(ev.COMPUTE, "forward", name, start, time.perf_counter())
        if torch.is_grad_enabled():
            outputs = _grad_outputs(output)
            fired = []

            def hook(_grad, name=name):
                if not fired:
                    fired.append(True)
                    self._backward_begins(name)

            for t in outputs:
                t.register_hook(hook)

    def _backward_begins(self, name: str) -> None:
        now = time.perf_counter()
        if self._backward_open is None:  # the first layer of this backward
            queue_backward_callback(self._backward_ends)
        else:
            self._close_backward(now)
        self._backward_open = (name, now)

    def _close_backward(self, now: float) -> None:
        name, start = self._backward_open
        self._add(ev.COMPUTE, "backward", name, start, now)

    def _backward_ends(self) -> None:
        if self._backward_open is not None:
            self._backward_end = time.perf_counter()
            self._close_backward(self._backward_end)
            self._backward_open = None

    def _on_step_begin(self, watch) -> None:
        self._step_start = now = time.perf_counter()
        if self._backward_end is not None:
            self._add(ev.COMPUTE, ev.WAIT, "gradient sync", self._backward_end, now)
            self._backward_end = None

    def _on_step_end(self, watch) -> None:
        self._add(ev.COMPUTE, "optimizer", "step", self._step_start, time.perf_counter(), step=watch.steps - 1)
        self._comm_counts = {}  # collectives are numbered within their step
        self._clocks.append((time.perf_counter(), time.process_time()))

    def _issued(self, issued) -> None:
        if issued.collective in ("recv", "barrier"):
            return
        count = self._comm_counts.get(issued.collective, 0)
        self._comm_counts[issued.collective] = count + 1
        event = {"rank": self._rank, "lane": ev.COMM, "kind": issued.collective,
                 "name": f"{issued.collective} {count}", "start": issued.start, "end": None,
                 "nbytes": issued_bytes(issued), "step": self._watch.steps}
        self._events.append(event)
        if issued.collective != "send" or issued.work is None or isinstance(issued.work, int):
            self._completions.add(issued.work, lambda: event.__setitem__("end", time.perf_counter()),
                                  first_tensor(issued.args[0]) if issued.args else None)  # the output
        # an isend on Gloo has no future and completes only inside the caller's wait(): it is
        # left out of the timeline (result() keeps finished events only)

    def result(self) -> dict:
        clocks = self._clocks
        return {"events": [e for e in self._events if e["end"] is not None],
                "step_s": [b[0] - a[0] for a, b in zip(clocks, clocks[1:])],
                "step_cpu_s": [b[1] - a[1] for a, b in zip(clocks, clocks[1:])]}

    # --- in the kernel -----------------------------------------------------------------
    def events(self, step: int | None = -1) -> list[ev.Event]:
        """Every rank's events of one step (-1: the last complete one on each rank; None: the
        whole call), merged and shifted so that the earliest starts at 0 (seconds)."""
        chosen = []
        for events in (r["events"] for r in self.collected()):
            steps = max((e["step"] for e in events if e["kind"] == "optimizer"), default=None)
            if step is None or steps is None:
                chosen.append(events)
                continue
            index = steps + 1 + step if step < 0 else step
            chosen.append([e for e in events if e["step"] == index])
        return ev.from_lists(chosen)

    def hidden_fraction(self, step: int | None = -1, rank: int | None = None) -> float:
        """Share (0..1) of the time communication was in flight during which the rank was
        computing (``events.hidden_fraction``), in one step (-1: the last; rank None: all)."""
        return ev.hidden_fraction(self.events(step), rank)

    def step_seconds(self, rank: int = 0, cpu: bool = False) -> list[float]:
        """Seconds of each training step on ``rank`` (from the end of the one before, or the
        call's start), wall clock -- or CPU time of the rank's process with ``cpu=True``."""
        return list(self.of_rank(rank)["step_cpu_s" if cpu else "step_s"])

    def summary(self, step: int | None = -1, rank: int = 0) -> dict:
        """``rank``'s step in numbers: ``step_s`` (first event to last), ``comm_s`` (seconds
        with communication in flight), ``exposed_s`` (of those, seconds it computed nothing)
        and ``collectives`` (how many it issued)."""
        mine = [e for e in self.events(step) if e.rank == rank]
        return {"step_s": max((e.end for e in mine), default=0.0) - min((e.start for e in mine), default=0.0),
                "comm_s": ev.comm_seconds(mine), "exposed_s": ev.exposed_seconds(mine),
                "collectives": sum(e.lane == ev.COMM for e in mine)}
