"""Record what a learner's training script does on each rank, without reading its source.

A ``ScriptRecorder`` is entered in each torchrun worker a checker starts (by
``site/sitecustomize.py``, for the life of the worker, and left when it exits), so everything
here lives in a process the checker started for one run. Inside it, every event appends one
line to ``<dir>/rank<R>.log``:

* ``pass P`` when a ``DataLoader`` pass begins, ``read P I`` for every sample index ``I``
  read from the course's dataset during pass ``P``, and ``step P`` for every
  ``optimizer.step()`` (during pass ``P``, the one last asked for a batch): a pass with steps
  is a training epoch, one without (an evaluation) is not;
* ``grads S N2`` before step ``S``: the sum of squares of the gradients this rank holds (its
  shards' under FSDP), so the checker can add them up over the ranks into the global norm;
* ``shards LOCAL GLOBAL DTENSORS PARAMS`` at the first step: elements of the optimizer's
  parameters this rank holds, their global size, and how many are DTensors;
* ``comm S COLLECTIVE DTYPE BYTES GROUP ID KIND`` for every collective, issued in step ``S``
  and numbered ``ID``; BYTES its payload S as the course's observers count it
  (``dpcourse.observe.payload``, nccl-tests' convention); KIND ``c10d`` through the
  process's collective tracker (the one the course's observers listen to: ``dist.*``, DDP's,
  FSDP's), ``functional`` for DTensor's (GROUP 0: not recorded);
* ``save PATH`` for every ``torch.save`` and ``destroy`` once ``destroy_process_group`` has
  returned;
* ``pid PID`` once, so a watcher can tell a rank that has ended from one that waits;
* ``done ID`` when collective ``ID`` has completed on this rank (``wait ID`` first, when a
  functional one starts to be waited for), so a collective waited in is one without ``done``;
* ``lr S LR`` before step ``S``: the first parameter group's learning rate;
* ``backward S N N2`` when a backward pass starts (the ``N``-th since step ``S - 1``) and
  ``backward_end N2`` when it returns: the collectives between them ran inside it, and
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
(``hang_watch.py``).

The checker judges the behaviour from these lines, so any correct script passes, whatever
it looks like.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref

# DTensor's own collectives (a full_tensor(), the norm of sharded gradients, the gathers of a
# full state dict) are functional collectives: their Python entry points are observed (the
# outermost call only: some call others), issued when called, waited in from entering
# wait_tensor until it returns; the c10d operator each one calls inside is not noted again.
_FUNCTIONAL = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast")


class ScriptRecorder:
    """``with ScriptRecorder(directory, rank):`` every event above appends its line to
    ``<directory>/rank<rank>.log``; leaving it undoes every patch, removes every hook, stops
    listening to the collective tracker and closes the log."""

    def __init__(self, directory: str, rank: int):
        self.path = os.path.join(directory, f"rank{rank}.log")
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

    def note(self, line: str) -> None:
        with self.lock:
            if self._log is not None:  # a Work's callback may come after the recorder was left
                self._log.write(line + "\n")

    def issue(self, what: str, kind: str) -> int:
        """Number a collective as it is issued and note it; returns its number."""
        with self.lock:
            self.state["comms"] += 1
            number = self.state["comms"]
        self.note(f"comm {self.steps} {what} {number} {kind}")
        return number

    # --- context ------------------------------------------------------------------------
    def __enter__(self):
        from ..observe.watch import LoopWatch

        self._stack = stack = contextlib.ExitStack()
        self._log = open(self.path, "a", buffering=1)
        stack.callback(self._close)
        self.note(f"pid {os.getpid()}")
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

    def _close(self) -> None:
        with self.lock:
            log, self._log = self._log, None
        log.close()

    def _patch(self, owner, name: str, value) -> None:
        """``owner.name = value`` until the recorder is left."""
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, value)
        self._stack.callback(setattr, owner, name, original)

    # --- what is observed -----------------------------------------------------------------
    def _observe_reads(self) -> None:
        """``read P I``: the course's dataset notes every sample index read."""
        import torch.utils.data as data

        from .. import models

        state, note = self.state, self.note

        class ObservedDataset(data.TensorDataset):
            def __getitem__(self, index):
                note(f"read {state['current']} {int(index)}")
                return super().__getitem__(index)

        make_dataset = models.make_dataset

        @functools.wraps(make_dataset)
        def observed_make_dataset(*args, **kwargs):
            dataset = make_dataset(*args, **kwargs)
            return ObservedDataset(*dataset.tensors)

        self._patch(models, "make_dataset", observed_make_dataset)

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
            note(f"pass {state['passes']}")
            return ObservedPass(loader_iter(loader), state["passes"])

        self._patch(data.DataLoader, "__iter__", observed_iter)

    def _before_step(self, watch) -> None:
        """``grads``, ``lr`` and (once) ``shards`` before each optimizer step."""
        state, note = self.state, self.note
        optimizer = watch.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        note(f"grads {watch.steps} {_squares(params)!r}")
        note(f"lr {watch.steps} {float(optimizer.param_groups[0]['lr'])!r}")
        if not state["shards"]:
            state["shards"] = True
            local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
            note(f"shards {local} {sum(p.numel() for p in params)} "
                 f"{sum(hasattr(p, 'to_local') for p in params)} {len(params)}")

    def _after_step(self, _watch) -> None:
        """``step P`` after each optimizer step."""
        self.state["backwards"] = 0
        self.note(f"step {self.state['current']}")

    def _collective(self, issued) -> None:
        """``comm ... c10d`` as a collective is issued, ``done`` once it has completed."""
        import torch.distributed as dist

        from ..observe.payload import first_tensor, issued_bytes
        from ..pool.ranks.tracker import process_group, when_complete

        if issued.collective in ("send", "recv") or getattr(self._functional, "call", False):
            return  # a functional collective's own c10d call: noted once, as "functional"
        tensor = first_tensor(issued.args[0]) if issued.args else None
        group = next((g for g in map(process_group, issued.args) if g is not None), None)
        size = group.size() if group is not None else dist.get_world_size()
        dtype = str(tensor.dtype).replace("torch.", "") if tensor is not None else "-"
        number = self.issue(f"{issued.collective} {dtype} {issued_bytes(issued)} {size}", "c10d")
        when_complete(issued.work, lambda _future: self.note(f"done {number}"))

    def _observe_init(self) -> None:
        """Listen to the collective tracker once the process group is up, until the recorder is left."""
        import torch.distributed as dist

        from ..pool.ranks.tracker import TRACKER

        init = dist.init_process_group

        @functools.wraps(init)
        def observed_init(*args, **kwargs):
            result = init(*args, **kwargs)
            # registered any earlier, the tracker's kernels would be replaced when
            # torch.distributed sets up
            if self._stack is not None:
                self._stack.enter_context(TRACKER.listen(self._collective))
            return result

        self._patch(dist, "init_process_group", observed_init)
        self._patch(dist.distributed_c10d, "init_process_group", observed_init)

    def _observe_saves(self) -> None:
        """``save PATH`` for every ``torch.save``."""
        import torch

        save = torch.save

        @functools.wraps(save)
        def observed_save(obj, f, *args, **kwargs):
            where = os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else "<file object>"
            self.note(f"save {where}")
            return save(obj, f, *args, **kwargs)

        self._patch(torch, "save", observed_save)

    def _observe_destroy(self) -> None:
        """``destroy`` once ``destroy_process_group`` returns."""
        import torch.distributed as dist

        destroy = dist.destroy_process_group

        @functools.wraps(destroy)
        def observed_destroy(*args, **kwargs):
            result = destroy(*args, **kwargs)
            self.note("destroy")  # once it has returned: this rank's distributed work is over
            return result

        self._patch(dist, "destroy_process_group", observed_destroy)
        self._patch(dist.distributed_c10d, "destroy_process_group", observed_destroy)

    def _observe_optimizers(self) -> None:
        """Every optimizer built from now on (held weakly), to read all their parameters' gradients."""
        import torch

        optimizers = self.optimizers
        optimizer_init = torch.optim.Optimizer.__init__

        @functools.wraps(optimizer_init)
        def observed_optimizer_init(optimizer, *args, **kwargs):
            optimizer_init(optimizer, *args, **kwargs)
            optimizers.add(optimizer)

        self._patch(torch.optim.Optimizer, "__init__", observed_optimizer_init)

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
            note(f"backward {self.steps} {state['backwards']} {squares()!r}")
            try:
                return backward(*args, **kwargs)
            finally:
                note(f"backward_end {squares()!r}")

        self._patch(torch.autograd, "backward", observed_backward)

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
                number = self.issue(f"{name} {dtype} {nbytes} 0", "functional")
                for t in results:
                    numbers[id(getattr(t, "elem", t))] = number
                return result

            return call

        for function, fn in functional_collective_functions():
            name = next((n for n in _FUNCTIONAL if function.startswith(n)), None)
            if name:
                self._patch(funcol, function, observed(name, fn))
        wait = funcol.wait_tensor
        note = self.note

        @functools.wraps(wait)
        def observed_wait(tensor):
            number = numbers.pop(id(tensor), None)
            if number is None:
                return wait(tensor)
            note(f"wait {number}")
            try:
                return wait(tensor)
            finally:
                note(f"done {number}")

        self._patch(funcol, "wait_tensor", observed_wait)


def _squares(params) -> float:
    """Sum of squares of the gradients of ``params`` this rank holds (a DTensor's local part)."""
    squares = 0.0
    for p in params:
        if getattr(p, "grad", None) is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            squares += float(g.detach().double().pow(2).sum())
    return squares


def log_lines(directory: str, rank: int) -> list[str]:
    """The complete lines of one rank's log so far (a line still being written is left out)."""
    try:
        with open(os.path.join(directory, f"rank{rank}.log")) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    return lines if not lines or lines[-1] else lines[:-1]


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
    for line in log_lines(directory, rank):
        kind, _, rest = line.partition(" ")
        args = rest.split(" ")
        if kind == "pass":
            passes.setdefault(int(args[0]), {"reads": [], "steps": 0})
        elif kind == "read":  # pass 0: read outside any DataLoader pass
            passes.setdefault(int(args[0]), {"reads": [], "steps": 0})["reads"].append(int(args[1]))
        elif kind == "step":
            passes.setdefault(int(args[0]), {"reads": [], "steps": 0})["steps"] += 1
        elif kind == "grads":
            log["grads"][int(args[0])] = float(args[1])
        elif kind == "lr":
            log["lrs"][int(args[0])] = float(args[1])
        elif kind == "backward":
            inside, step = int(args[1]), int(args[0])
            log["backwards"][step] = inside
            if len(args) > 2:
                log["accumulated"].setdefault(step, []).append((float(args[2]), None))
        elif kind == "backward_end":
            inside = 0
            if args[0]:
                log["before_clip"][step] = float(args[0])
                passes_of_step = log["accumulated"].get(step)
                if passes_of_step and passes_of_step[-1][1] is None:
                    passes_of_step[-1] = (passes_of_step[-1][0], float(args[0]))
        elif kind == "shards":
            log["shards"] = tuple(int(a) for a in args)
        elif kind == "comm":
            record = (int(args[0]), args[1], args[2], int(args[3]), int(args[4]), int(args[5]), inside)
            log["functional" if args[6:] == ["functional"] else "comms"].append(record)
        elif kind == "save":
            log["saves"].append(rest)
        elif kind == "destroy":
            log["destroyed"] = True
    ordered = [passes[k] for k in sorted(passes)]
    log["epochs"] = [p["reads"] for p in ordered if p["steps"] and p["reads"]]
    log["evaluations"] = [p["reads"] for p in ordered if not p["steps"] and p["reads"]]
    log["other_passes"] = len(log["evaluations"])
    return log
