"""Record what a learner's training script does on each rank, without reading its source.

``install`` runs in each torchrun worker a checker starts (through ``site/sitecustomize.py``),
so everything here lives in a process the checker started for one run, and ends with it. It
appends to ``<dir>/rank<R>.log`` one line per event:

* ``pass P`` when a ``DataLoader`` pass begins, ``read P I`` for every sample index ``I``
  read from the course's dataset during pass ``P``, and ``step P`` for every
  ``optimizer.step()`` (during pass ``P``, the one last asked for a batch): a pass with steps
  is a training epoch, one without (an evaluation) is not;
* ``grads S N2`` before step ``S``: the sum of squares of the gradients this rank holds (its
  shards' under FSDP), so the checker can add them up over the ranks into the global norm;
* ``shards LOCAL GLOBAL DTENSORS PARAMS`` at the first step: elements of the optimizer's
  parameters this rank holds, their global size, and how many are DTensors;
* ``comm S COLLECTIVE DTYPE BYTES GROUP ID KIND`` for every collective, issued in step ``S``
  and numbered ``ID``: KIND ``c10d`` through the process's collective tracker (the one the
  course's observers listen to: ``dist.*``, DDP's, FSDP's), ``functional`` for DTensor's
  (GROUP 0: not recorded);
* ``save PATH`` for every ``torch.save`` and ``destroy`` once ``destroy_process_group`` has
  returned;
* ``pid PID`` once, so a watcher can tell a rank that has ended from one that waits;
* ``done ID`` when collective ``ID`` has completed on this rank (``wait ID`` first, when a
  functional one starts to be waited for), so a collective waited in is one without ``done``;
* ``lr S LR`` before step ``S``: the first parameter group's learning rate;
* ``backward S N`` when a backward pass starts (the ``N``-th since step ``S - 1``) and
  ``backward_end N2`` when it returns: the collectives between them ran inside it, and
  ``N2`` is the sum of squares of the gradients of every optimizer's parameters this rank
  holds then (the last before step ``S``: the step's gradient, before any clipping).

Patched in this process only (what the learner's script calls): ``make_dataset``,
``DataLoader.__iter__``, ``torch.save``, ``init_process_group`` (to start listening),
``destroy_process_group``, ``torch.autograd.backward``, ``Optimizer.__init__`` (to know
every optimizer's parameters) and DTensor's functional collectives; the optimizer hooks are
PyTorch's public global ones. Every line is written as it happens (line-buffered),
so a run that hangs can be read while it hangs (``hang_watch.py``).

The checker judges the behaviour from these lines, so any correct script passes, whatever
it looks like.
"""
from __future__ import annotations

import functools
import os
import threading
import weakref


def install(directory: str, rank: int) -> None:
    """Patch this process so that every event above appends its line to ``<directory>/rank<rank>.log``."""
    recorder = _Recorder(directory, rank)
    recorder.note(f"pid {os.getpid()}")
    _observe_reads(recorder)
    _observe_passes(recorder)
    _observe_steps(recorder)
    _observe_collectives(recorder)
    _observe_saves_and_destroy(recorder)
    _observe_backward(recorder, _observe_optimizers())
    _observe_functional_collectives(recorder.issue, recorder.note)


class _Recorder:
    """One rank's log (line-buffered) and the counters the observed functions share."""

    def __init__(self, directory: str, rank: int):
        self.log = open(os.path.join(directory, f"rank{rank}.log"), "a", buffering=1)
        self.lock = threading.Lock()
        self.state = {"passes": 0, "current": 0, "steps": 0, "shards": False, "comms": 0, "backwards": 0}

    def note(self, line: str) -> None:
        with self.lock:
            self.log.write(line + "\n")

    def issue(self, what: str, kind: str) -> int:
        """Number a collective as it is issued and note it; returns its number."""
        with self.lock:
            self.state["comms"] += 1
            number = self.state["comms"]
        self.note(f"comm {self.state['steps']} {what} {number} {kind}")
        return number


def _observe_reads(recorder: _Recorder) -> None:
    """``read P I``: the course's dataset notes every sample index read."""
    import torch.utils.data as data

    from .. import models

    state, note = recorder.state, recorder.note

    class ObservedDataset(data.TensorDataset):
        def __getitem__(self, index):
            note(f"read {state['current']} {int(index)}")
            return super().__getitem__(index)

    make_dataset = models.make_dataset

    @functools.wraps(make_dataset)
    def observed_make_dataset(*args, **kwargs):
        dataset = make_dataset(*args, **kwargs)
        return ObservedDataset(*dataset.tensors)

    models.make_dataset = observed_make_dataset


def _observe_passes(recorder: _Recorder) -> None:
    """``pass P``: each DataLoader pass is numbered, and is current while it hands out batches."""
    import torch.utils.data as data

    state = recorder.state
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

    def observed_iter(self):
        state["passes"] += 1
        recorder.note(f"pass {state['passes']}")
        return ObservedPass(loader_iter(self), state["passes"])

    data.DataLoader.__iter__ = observed_iter


def _observe_steps(recorder: _Recorder) -> None:
    """``grads``, ``lr`` and (once) ``shards`` before each optimizer step, ``step`` after it."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    state, note = recorder.state, recorder.note

    def before_step(optimizer, _args, _kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        note(f"grads {state['steps']} {_squares(params)!r}")
        note(f"lr {state['steps']} {float(optimizer.param_groups[0]['lr'])!r}")
        if not state["shards"]:
            state["shards"] = True
            local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
            note(f"shards {local} {sum(p.numel() for p in params)} "
                 f"{sum(hasattr(p, 'to_local') for p in params)} {len(params)}")

    def after_step(_optimizer, _args, _kwargs):
        state["steps"] += 1
        state["backwards"] = 0
        note(f"step {state['current']}")

    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)


def _observe_collectives(recorder: _Recorder) -> None:
    """``comm ... c10d`` and ``done``: listen to the collective tracker once the process group is up."""
    import torch.distributed as dist

    from ..observe.comm import first_tensor
    from ..pool.tracker import TRACKER, when_complete

    def collective(issued) -> None:
        if issued.collective in ("send", "recv"):
            return
        tensor = first_tensor(issued.args[0]) if issued.args else None
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(issued.args[0])) if issued.args else 0
        group = next((g for g in map(_process_group, issued.args) if g is not None), None)
        size = group.size() if group is not None else dist.get_world_size()
        dtype = str(tensor.dtype).replace("torch.", "") if tensor is not None else "-"
        number = recorder.issue(f"{issued.collective} {dtype} {nbytes} {size}", "c10d")
        when_complete(issued.work, lambda _future: recorder.note(f"done {number}"))

    init = dist.init_process_group

    @functools.wraps(init)
    def observed_init(*args, **kwargs):
        result = init(*args, **kwargs)
        # listen from now on, for the life of this process (which the checker ends): registered
        # any earlier, the tracker's kernels would be replaced when torch.distributed sets up
        recorder.state["listening"] = TRACKER.listen(collective)  # kept: a collected one would stop listening
        recorder.state["listening"].__enter__()
        return result

    dist.init_process_group = observed_init
    dist.distributed_c10d.init_process_group = observed_init


def _observe_saves_and_destroy(recorder: _Recorder) -> None:
    """``save PATH`` for every ``torch.save``; ``destroy`` once ``destroy_process_group`` returns."""
    import torch
    import torch.distributed as dist

    save = torch.save

    @functools.wraps(save)
    def observed_save(obj, f, *args, **kwargs):
        recorder.note(f"save {os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else '<file object>'}")
        return save(obj, f, *args, **kwargs)

    torch.save = observed_save

    destroy = dist.destroy_process_group

    @functools.wraps(destroy)
    def observed_destroy(*args, **kwargs):
        result = destroy(*args, **kwargs)
        recorder.note("destroy")  # once it has returned: this rank's distributed work is over
        return result

    dist.destroy_process_group = observed_destroy
    dist.distributed_c10d.destroy_process_group = observed_destroy


def _observe_optimizers() -> weakref.WeakSet:
    """Every optimizer built from now on (held weakly), to read all their parameters' gradients."""
    import torch

    optimizers = weakref.WeakSet()
    optimizer_init = torch.optim.Optimizer.__init__

    @functools.wraps(optimizer_init)
    def observed_optimizer_init(self, *args, **kwargs):
        optimizer_init(self, *args, **kwargs)
        optimizers.add(self)

    torch.optim.Optimizer.__init__ = observed_optimizer_init
    return optimizers


def _observe_backward(recorder: _Recorder, optimizers: weakref.WeakSet) -> None:
    """``backward S N`` as a backward pass starts, ``backward_end N2`` as it returns."""
    import torch

    state, note = recorder.state, recorder.note
    backward = torch.autograd.backward  # Tensor.backward calls it too

    @functools.wraps(backward)
    def observed_backward(*args, **kwargs):
        state["backwards"] += 1
        note(f"backward {state['steps']} {state['backwards']}")
        try:
            return backward(*args, **kwargs)
        finally:
            params = [p for o in list(optimizers) for group in o.param_groups for p in group["params"]]
            note(f"backward_end {_squares(params)!r}")

    torch.autograd.backward = observed_backward


# DTensor's own collectives (a full_tensor(), the norm of sharded gradients, the gathers of a
# full state dict) are functional collectives: C++ calls the process group directly, so the
# c10d operators never see them. Their Python entry points are observed instead (the
# outermost call only: some call others): issued when called, waited in from entering
# wait_tensor until it returns.
_FUNCTIONAL = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast")


def _observe_functional_collectives(issue, note) -> None:
    from ..torch_private import functional_collective_functions, functional_collectives

    funcol = functional_collectives()
    numbers: dict[int, int] = {}  # id of a result's tensor -> the collective's number
    inside = threading.local()

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
            nbytes = sum(t.numel() * t.element_size() for t in _tensors(args[0])) if args else 0
            number = issue(f"{name} {dtype} {nbytes} 0", "functional")
            for t in result if isinstance(result, (list, tuple)) else [result]:
                numbers[id(getattr(t, "elem", t))] = number
            return result

        return call

    for function, fn in functional_collective_functions():
        name = next((n for n in _FUNCTIONAL if function.startswith(n)), None)
        if name:
            setattr(funcol, function, observed(name, fn))
    wait = funcol.wait_tensor

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

    funcol.wait_tensor = observed_wait


def _squares(params) -> float:
    """Sum of squares of the gradients of ``params`` this rank holds (a DTensor's local part)."""
    squares = 0.0
    for p in params:
        if getattr(p, "grad", None) is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            squares += float(g.detach().double().pow(2).sum())
    return squares


def _tensors(arg) -> list:
    import torch

    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


def _process_group(arg):
    from ..pool.tracker import process_group

    return process_group(arg)


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
    ``backwards``: {step: backward passes before it}; ``shards``: (local, global, dtensors,
    params) or None; ``comms``: [(step, collective, dtype, bytes, group size, number,
    backward)], ``backward`` the backward pass of that step it ran in (0: outside any), the
    c10d collectives (DDP's, FSDP's, ``dist.*``); ``functional``: the same for DTensor's.
    """
    passes: dict[int, dict] = {}
    log = {"saves": [], "destroyed": False, "grads": {}, "before_clip": {}, "lrs": {}, "backwards": {},
           "shards": None, "comms": [], "functional": []}
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
        elif kind == "backward_end":
            inside = 0
            if args[0]:
                log["before_clip"][step] = float(args[0])
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
