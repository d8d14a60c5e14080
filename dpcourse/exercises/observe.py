"""Record what a learner's training script does on each rank, without reading its source.

``install`` runs in each torchrun worker a checker starts (through ``site/sitecustomize.py``).
It appends to ``<dir>/rank<R>.log`` one line per event: every pass over a ``DataLoader``
("epoch"), every sample index read from the course's dataset ("read 17"), every
``torch.save`` ("save PATH"), and ``destroy_process_group`` ("destroy"). The checker judges
the behaviour from these lines, so any correct conversion passes, whatever it looks like.
"""
from __future__ import annotations

import functools
import os


def install(directory: str, rank: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.utils.data as data

    from .. import models

    log = open(os.path.join(directory, f"rank{rank}.log"), "a", buffering=1)

    def note(line: str) -> None:
        log.write(line + "\n")

    class ObservedDataset(data.TensorDataset):
        def __getitem__(self, index):
            note(f"read {int(index)}")
            return super().__getitem__(index)

    make_dataset = models.make_dataset

    @functools.wraps(make_dataset)
    def observed_make_dataset(*args, **kwargs):
        dataset = make_dataset(*args, **kwargs)
        return ObservedDataset(*dataset.tensors)

    models.make_dataset = observed_make_dataset

    loader_iter = data.DataLoader.__iter__

    def observed_iter(self):
        note("epoch")
        return loader_iter(self)

    data.DataLoader.__iter__ = observed_iter

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


def read_log(directory: str, rank: int) -> dict:
    """One rank's events: {"epochs": [[indices of pass 0], ...], "saves": [...], "destroyed": bool}."""
    epochs: list[list[int]] = []
    saves: list[str] = []
    destroyed = False
    try:
        with open(os.path.join(directory, f"rank{rank}.log")) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        kind, _, arg = line.partition(" ")
        if kind == "epoch":
            epochs.append([])
        elif kind == "read":
            if not epochs:  # read outside a DataLoader pass: count it as a pass of its own
                epochs.append([])
            epochs[-1].append(int(arg))
        elif kind == "save":
            saves.append(arg)
        elif kind == "destroy":
            destroyed = True
    return {"epochs": [e for e in epochs if e], "saves": saves, "destroyed": destroyed}
