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
* ``comm S COLLECTIVE DTYPE BYTES GROUP`` for every collective (through the process's
  collective tracker, the one the course's observers listen to), in step ``S``;
* ``save PATH`` for every ``torch.save`` and ``destroy`` once ``destroy_process_group`` has
  returned.

Patched in this process only (what the learner's script calls): ``make_dataset``,
``DataLoader.__iter__``, ``torch.save``, ``init_process_group`` (to start listening) and
``destroy_process_group``; the optimizer hooks are PyTorch's public global ones.

The checker judges the behaviour from these lines, so any correct script passes, whatever
it looks like.
"""
from __future__ import annotations

import functools
import os
import threading


def install(directory: str, rank: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.utils.data as data
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from .. import models
    from ..observe.comm import first_tensor
    from ..pool.tracker import TRACKER

    log = open(os.path.join(directory, f"rank{rank}.log"), "a", buffering=1)
    lock = threading.Lock()
    state = {"passes": 0, "current": 0, "steps": 0, "shards": False}

    def note(line: str) -> None:
        with lock:
            log.write(line + "\n")

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
        note(f"pass {state['passes']}")
        return ObservedPass(loader_iter(self), state["passes"])

    data.DataLoader.__iter__ = observed_iter

    def before_step(optimizer, _args, _kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        squares = 0.0
        for p in params:
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                squares += float(g.detach().double().pow(2).sum())
        note(f"grads {state['steps']} {squares!r}")
        if not state["shards"]:
            state["shards"] = True
            local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
            note(f"shards {local} {sum(p.numel() for p in params)} "
                 f"{sum(hasattr(p, 'to_local') for p in params)} {len(params)}")

    def after_step(_optimizer, _args, _kwargs):
        state["steps"] += 1
        note(f"step {state['current']}")

    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)

    def collective(issued) -> None:
        if issued.collective in ("send", "recv"):
            return
        tensor = first_tensor(issued.args[0]) if issued.args else None
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(issued.args[0])) if issued.args else 0
        group = next((g for g in map(_process_group, issued.args) if g is not None), None)
        size = group.size() if group is not None else dist.get_world_size()
        dtype = str(tensor.dtype).replace("torch.", "") if tensor is not None else "-"
        note(f"comm {state['steps']} {issued.collective} {dtype} {nbytes} {size}")

    init = dist.init_process_group

    @functools.wraps(init)
    def observed_init(*args, **kwargs):
        result = init(*args, **kwargs)
        # listen from now on, for the life of this process (which the checker ends): registered
        # any earlier, the tracker's kernels would be replaced when torch.distributed sets up
        state["listening"] = TRACKER.listen(collective)  # kept: a collected one would stop listening
        state["listening"].__enter__()
        return result

    dist.init_process_group = observed_init
    dist.distributed_c10d.init_process_group = observed_init

    save = torch.save

    @functools.wraps(save)
    def observed_save(obj, f, *args, **kwargs):
        note(f"save {os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else '<file object>'}")
        return save(obj, f, *args, **kwargs)

    torch.save = observed_save

    destroy = dist.destroy_process_group

    @functools.wraps(destroy)
    def observed_destroy(*args, **kwargs):
        result = destroy(*args, **kwargs)
        note("destroy")  # once it has returned: this rank's distributed work is over
        return result

    dist.destroy_process_group = observed_destroy
    dist.distributed_c10d.destroy_process_group = observed_destroy


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


def read_log(directory: str, rank: int) -> dict:
    """One rank's events.

    ``epochs``: the sample indices read in each training pass (a pass with optimizer steps),
    ``other_passes``: how many passes read data without a step (evaluations); ``saves``;
    ``destroyed``; ``grads``: {step: sum of squares}; ``shards``: (local, global, dtensors,
    params) or None; ``comms``: [(step, collective, dtype, bytes, group size)].
    """
    passes: dict[int, dict] = {}
    log = {"saves": [], "destroyed": False, "grads": {}, "shards": None, "comms": []}
    try:
        with open(os.path.join(directory, f"rank{rank}.log")) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
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
        elif kind == "shards":
            log["shards"] = tuple(int(a) for a in args)
        elif kind == "comm":
            log["comms"].append((int(args[0]), args[1], args[2], int(args[3]), int(args[4])))
        elif kind == "save":
            log["saves"].append(rest)
        elif kind == "destroy":
            log["destroyed"] = True
    ordered = [passes[k] for k in sorted(passes)]
    log["epochs"] = [p["reads"] for p in ordered if p["steps"] and p["reads"]]
    log["other_passes"] = sum(1 for p in ordered if not p["steps"] and p["reads"])
    return log
