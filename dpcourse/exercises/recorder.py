"""Record what a learner's training script does on each rank, without reading its source.

A ``ScriptRecorder`` is entered in each torchrun worker a checker starts (by
``site/sitecustomize.py``, for the life of the worker, and left when it exits), so everything
here lives in a process the checker started for one run. Inside it, every event is appended to
the rank's event log (``grading.events``: ``<dir>/rank<R>.jsonl``, one typed record a line):

* ``Pass(P)`` when a ``DataLoader`` pass begins, ``Read(P, I)`` for every sample index ``I``
  read from the course's dataset during pass ``P``, and ``Step(P)`` for every
  ``optimizer.step()`` (during pass ``P``, the one last asked for a batch): a pass with steps
  is a training epoch, one without (an evaluation) is not;
* ``Grads(S, N2)`` before step ``S``: the sum of squares of the gradients this rank holds (its
  shards' under FSDP), so the checker can add them up over the ranks into the global norm;
* ``Shards(LOCAL, TOTAL, DTENSORS, PARAMS)`` at the first step: elements of the optimizer's
  parameters this rank holds, their global size, and how many are DTensors;
* the harness's ``Comm`` for every collective, issued in step ``S`` and numbered ``ID``, its
  payload S as the course's observers count it (``dpcourse.observe.payload``, nccl-tests'
  convention); kind "c10d" through the process's collective tracker (the one the course's
  observers listen to: ``dist.*``, DDP's, FSDP's), "functional" for DTensor's (group 0: not
  recorded); ``Done(ID)`` when it has completed on this rank (``Wait(ID)`` first, when a
  functional one starts to be waited for), so a collective waited in is one without ``Done``;
* ``Save(PATH)`` for every ``torch.save`` and ``Destroy()`` once ``destroy_process_group``
  has returned; ``Pid`` once, so a watcher can tell a rank that has ended from one that waits;
* ``Lr(S, LR)`` before step ``S``: the first parameter group's learning rate;
* ``Backward(S, N, N2)`` when a backward pass starts (the ``N``-th since step ``S - 1``) and
  ``BackwardEnd(N2)`` when it returns: the collectives between them ran inside it, and
  ``N2`` is the sum of squares of the gradients of every optimizer's parameters this rank
  holds then (the last before step ``S``: the step's gradient, before any clipping); the
  start's ``N2`` against the previous end's shows what changed the gradients between two
  backward passes of one step (clipping or zeroing a gradient that is not complete yet).

Patched inside the recorder only, and put back as it was when it is left (what the learner's
script calls, where nothing public sees it): ``make_dataset``, ``DataLoader.__iter__``,
``torch.save``, ``init_process_group`` (to start listening to the collective tracker),
``destroy_process_group``, ``torch.autograd.backward``, ``Optimizer.__init__`` (to know
every optimizer's parameters) and DTensor's functional collectives. Steps come from the step
clock the course's observers share (``dpcourse.observe.watch.LoopWatch``). Every line is
written as it happens (line-buffered), so a run that hangs can be read while it hangs
(``grading.hang_watch``).

The checker judges the behaviour from these events, so any correct script passes, whatever
it looks like.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref

from ..grading.events import Comm, Destroy, Done, EventLog, Pid, Wait, event, log_path, read_events
from ..patching import patched

# DTensor's own collectives (a full_tensor(), the norm of sharded gradients, the gathers of a
# full state dict) are functional collectives: their Python entry points are observed (the
# outermost call only: some call others), issued when called, waited in from entering
# wait_tensor until it returns; the c10d operator each one calls inside is not noted again.
_FUNCTIONAL = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast")


@event
class Pass:
    """A ``DataLoader`` pass begins: pass ``number`` (from 1)."""
    number: int


@event
class Read:
    """Sample ``index`` of the course's dataset read during pass ``number`` (0: outside any pass)."""
    number: int
    index: int


@event
class Step:
    """An optimizer step taken during pass ``number``."""
    number: int


@event
class Grads:
    """Before step ``step``: the sum of squares of the gradients this rank holds."""
    step: int
    squares: float


@event
class Lr:
    """Before step ``step``: the first parameter group's learning rate."""
    step: int
    lr: float


@event
class Shards:
    """At the first step: elements of the optimizer's parameters this rank holds (``local``),
    their global size (``total``), how many are DTensors, and how many parameters."""
    local: int
    total: int
    dtensors: int
    params: int


@event
class Save:
    """A ``torch.save`` to ``path`` (absolute, or "<file object>")."""
    path: str


@event
class Backward:
    """Backward pass ``number`` since step ``step - 1`` begins; ``squares``: the gradients'
    sum of squares as it begins."""
    step: int
    number: int
    squares: float


@event
class BackwardEnd:
    """The backward pass returned; ``squares``: the gradients' sum of squares then."""
    squares: float


class ScriptRecorder:
    """``with ScriptRecorder(directory, rank):`` every event above appends its line to
    ``<directory>/rank<rank>.log``; leaving it undoes every patch, removes every hook, stops
    listening to the collective tracker and closes the log."""

    def __init__(self, directory: str, rank: int):
        self.path = log_path(directory, rank)
        self.lock = threading.Lock()
        self.state = {"passes": 0, "current": 0, "shards": False, "comms": 0, "backwards": 0}
        self.optimizers: weakref.WeakSet = weakref.WeakSet()  # every optimizer built inside
        self._functional = threading.local()  # .call: a functional collective runs on this thread
        self._log = None
        self._stack: contextlib.ExitStack | None = None
        self._watch = None

    # --- the log ------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Optimizer steps completed since the recorder was entered."""
        return self._watch.steps

    def note(self, record) -> None:
        self._log.write(record)   # after the recorder was left (a Work's late callback): dropped

    def issue(self, collective: str, dtype: str, nbytes: int, group: int, kind: str) -> int:
        """Number a collective as it is issued and note it; returns its number."""
        with self.lock:
            self.state["comms"] += 1
            number = self.state["comms"]
        self.note(Comm(self.steps, collective, dtype, nbytes, group, number, kind))
        return number

    # --- context ------------------------------------------------------------------------
    def __enter__(self):
        from ..observe.watch import LoopWatch

        self._stack = stack = contextlib.ExitStack()
        self._log = EventLog(self.path)
        stack.callback(self._log.close)
        self.note(Pid(os.getpid()))
        self._watch = stack.enter_context(LoopWatch(on_step_begin=self._before_step, on_step_end=self._after_step))
        for observe in (self._observe_reads, self._observe_passes, self._observe_init, self._observe_saves,
                        self._observe_destroy, self._observe_optimizers, self._observe_backward,
                        self._observe_functional_collectives):
            observe()
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    # --- what is observed -----------------------------------------------------------------
    def _observe_reads(self) -> None:
        """``read P I``: the course's dataset notes every sample index read."""
        import torch.utils.data as data

        from .. import models

        state, note = self.state, self.note

        class ObservedDataset(data.TensorDataset):
            def __getitem__(self, index):
                note(Read(state["current"], int(index)))
                return super().__getitem__(index)

        make_dataset = models.make_dataset

        @functools.wraps(make_dataset)
        def observed_make_dataset(*args, **kwargs):
            dataset = make_dataset(*args, **kwargs)
            return ObservedDataset(*dataset.tensors)

        self._stack.enter_context(patched(models, make_dataset=observed_make_dataset))

    def _observe_passes(self) -> None:
        """``pass P``: each DataLoader pass is numbered, and is current while it hands out batches."""
        import torch.utils.data as data

        state, note = self.state, self.note
        loader_iter = data.DataLoader.__iter__

        class ObservedPass:
            """The iterator of one DataLoader pass: marks itself current whenever asked for a batch."""

            def __init__(self, inner, number):
                self.inner, self.number = inner, number

            def __iter__(self):
                return self

            def __next__(self):
                state["current"] = self.number
                return next(self.inner)

            def __len__(self):
                return len(self.inner)

        def observed_iter(loader):
            state["passes"] += 1
            note(Pass(state["passes"]))
            return ObservedPass(loader_iter(loader), state["passes"])

        self._stack.enter_context(patched(data.DataLoader, __iter__=observed_iter))

    def _before_step(self, watch) -> None:
        """``grads``, ``lr`` and (once) ``shards`` before each optimizer step."""
        state, note = self.state, self.note
        optimizer = watch.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        note(Grads(watch.steps, _squares(params)))
        note(Lr(watch.steps, float(optimizer.param_groups[0]["lr"])))
        if not state["shards"]:
            state["shards"] = True
            local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
            note(Shards(local, sum(p.numel() for p in params), sum(hasattr(p, "to_local") for p in params),
                        len(params)))

    def _after_step(self, _watch) -> None:
        """``step P`` after each optimizer step."""
        self.state["backwards"] = 0
        self.note(Step(self.state["current"]))

    def _collective(self, issued) -> None:
        """``comm ... c10d`` as a collective is issued, ``done`` once it has completed."""
        import torch.distributed as dist

        from ..observe.payload import first_tensor, issued_bytes
        from ..tracking.tracker import process_group, when_complete

        if issued.collective in ("send", "recv") or getattr(self._functional, "call", False):
            return  # a functional collective's own c10d call: noted once, as "functional"
        tensor = first_tensor(issued.args[0]) if issued.args else None
        group = next((g for g in map(process_group, issued.args) if g is not None), None)
        size = group.size() if group is not None else dist.get_world_size()
        dtype = str(tensor.dtype).replace("torch.", "") if tensor is not None else "-"
        number = self.issue(issued.collective, dtype, issued_bytes(issued), size, "c10d")
        when_complete(issued.work, lambda _future: self.note(Done(number)))

    def _observe_init(self) -> None:
        """Listen to the collective tracker once the process group is up, until the recorder is left."""
        import torch.distributed as dist

        from ..tracking.tracker import TRACKER

        init = dist.init_process_group

        @functools.wraps(init)
        def observed_init(*args, **kwargs):
            result = init(*args, **kwargs)
            # registered any earlier, the tracker's kernels would be replaced when
            # torch.distributed sets up
            if self._stack is not None:
                self._stack.enter_context(TRACKER.listen(self._collective))
            return result

        self._stack.enter_context(patched(dist, init_process_group=observed_init))
        self._stack.enter_context(patched(dist.distributed_c10d, init_process_group=observed_init))

    def _observe_saves(self) -> None:
        """``save PATH`` for every ``torch.save``."""
        import torch

        save = torch.save

        @functools.wraps(save)
        def observed_save(obj, f, *args, **kwargs):
            where = os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else "<file object>"
            self.note(Save(where))
            return save(obj, f, *args, **kwargs)

        self._stack.enter_context(patched(torch, save=observed_save))

    def _observe_destroy(self) -> None:
        """``destroy`` once ``destroy_process_group`` returns."""
        import torch.distributed as dist

        destroy = dist.destroy_process_group

        @functools.wraps(destroy)
        def observed_destroy(*args, **kwargs):
            result = destroy(*args, **kwargs)
            self.note(Destroy())  # once it has returned: this rank's distributed work is over
            return result

        self._stack.enter_context(patched(dist, destroy_process_group=observed_destroy))
        self._stack.enter_context(patched(dist.distributed_c10d, destroy_process_group=observed_destroy))

    def _observe_optimizers(self) -> None:
        """Every optimizer built from now on (held weakly), to read all their parameters' gradients."""
        import torch

        optimizers = self.optimizers
        optimizer_init = torch.optim.Optimizer.__init__

        @functools.wraps(optimizer_init)
        def observed_optimizer_init(optimizer, *args, **kwargs):
            optimizer_init(optimizer, *args, **kwargs)
            optimizers.add(optimizer)

        self._stack.enter_context(patched(torch.optim.Optimizer, __init__=observed_optimizer_init))

    def _observe_backward(self) -> None:
        """``backward S N`` as a backward pass starts, ``backward_end N2`` as it returns."""
        import torch

        state, note, optimizers = self.state, self.note, self.optimizers
        backward = torch.autograd.backward  # Tensor.backward calls it too

        def squares() -> float:
            return _squares([p for o in list(optimizers) for group in o.param_groups for p in group["params"]])

        @functools.wraps(backward)
        def observed_backward(*args, **kwargs):
            state["backwards"] += 1
            note(Backward(self.steps, state["backwards"], squares()))
            try:
                return backward(*args, **kwargs)
            finally:
                note(BackwardEnd(squares()))

        self._stack.enter_context(patched(torch.autograd, backward=observed_backward))

    def _observe_functional_collectives(self) -> None:
        """``comm ... functional`` when DTensor calls one, ``wait``/``done`` around its wait."""
        from ..observe.payload import payload_bytes
        from ..torch_private import functional_collective_functions, functional_collectives

        funcol = functional_collectives()
        numbers: dict[int, int] = {}  # id of a result's tensor -> the collective's number
        inside = self._functional

        def observed(name: str, fn):
            @functools.wraps(fn)
            def call(*args, **kwargs):
                if getattr(inside, "call", False):
                    return fn(*args, **kwargs)
                inside.call = True
                try:
                    result = fn(*args, **kwargs)
                finally:
                    inside.call = False
                first = args[0] if args else None
                first = first[0] if isinstance(first, (list, tuple)) and first else first
                dtype = str(getattr(first, "dtype", "-")).replace("torch.", "")
                results = list(result) if isinstance(result, (list, tuple)) else [result]
                nbytes = payload_bytes(name, results if name == "all_gather" else (args[0] if args else None),
                                       args[0] if args else None)  # all_gather's S: its output
                number = self.issue(name, dtype, nbytes, 0, "functional")
                for t in results:
                    numbers[id(getattr(t, "elem", t))] = number
                return result

            return call

        for function, fn in functional_collective_functions():
            name = next((n for n in _FUNCTIONAL if function.startswith(n)), None)
            if name:
                self._stack.enter_context(patched(funcol, **{function: observed(name, fn)}))
        wait = funcol.wait_tensor
        note = self.note

        @functools.wraps(wait)
        def observed_wait(tensor):
            number = numbers.pop(id(tensor), None)
            if number is None:
                return wait(tensor)
            note(Wait(number))
            try:
                return wait(tensor)
            finally:
                note(Done(number))

        self._stack.enter_context(patched(funcol, wait_tensor=observed_wait))


def _squares(params) -> float:
    """Sum of squares of the gradients of ``params`` this rank holds (a DTensor's local part)."""
    squares = 0.0
    for p in params:
        if getattr(p, "grad", None) is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            squares += float(g.detach().double().pow(2).sum())
    return squares


def read_log(directory: str, rank: int) -> dict:
    """One rank's events.

    ``epochs``: the sample indices read in each training pass (a pass with optimizer steps),
    ``evaluations``: those of each pass that read data without a step, ``other_passes``:
    how many such passes; ``saves``; ``destroyed``; ``grads``: {step: sum of squares};
    ``before_clip``: {step: the same after the step's last backward}; ``lrs``: {step: rate};
    ``backwards``: {step: backward passes before it}; ``accumulated``: {step: [(sum of squares
    as each backward pass began, as it ended), ...]}; ``shards``: (local, global, dtensors,
    params) or None; ``comms``: [(step, collective, dtype, bytes, group size, number,
    backward)], ``backward`` the backward pass of that step it ran in (0: outside any), the
    c10d collectives (DDP's, FSDP's, ``dist.*``); ``functional``: the same for DTensor's.
    """
    passes: dict[int, dict] = {}
    log = {"saves": [], "destroyed": False, "grads": {}, "before_clip": {}, "lrs": {}, "backwards": {},
           "accumulated": {}, "shards": None, "comms": [], "functional": []}
    inside = step = 0
    for e in read_events(directory, rank):
        match e:
            case Pass() | Read() | Step():   # Read 0: outside any DataLoader pass
                counted = passes.setdefault(e.number, {"reads": [], "steps": 0})
                if isinstance(e, Read):
                    counted["reads"].append(e.index)
                elif isinstance(e, Step):
                    counted["steps"] += 1
            case Grads():
                log["grads"][e.step] = e.squares
            case Lr():
                log["lrs"][e.step] = e.lr
            case Backward():
                inside, step = e.number, e.step
                log["backwards"][step] = inside
                log["accumulated"].setdefault(step, []).append((e.squares, None))
            case BackwardEnd():
                inside = 0
                log["before_clip"][step] = e.squares
                passes_of_step = log["accumulated"].get(step)
                if passes_of_step and passes_of_step[-1][1] is None:
                    passes_of_step[-1] = (passes_of_step[-1][0], e.squares)
            case Shards():
                log["shards"] = (e.local, e.total, e.dtensors, e.params)
            case Comm():
                record = (e.step, e.collective, e.dtype, e.nbytes, e.group, e.number, inside)
                log["functional" if e.kind == "functional" else "comms"].append(record)
            case Save():
                log["saves"].append(e.path)
            case Destroy():
                log["destroyed"] = True
    ordered = [passes[k] for k in sorted(passes)]
    log["epochs"] = [p["reads"] for p in ordered if p["steps"] and p["reads"]]
    log["evaluations"] = [p["reads"] for p in ordered if not p["steps"] and p["reads"]]
    log["other_passes"] = len(log["evaluations"])
    return log
