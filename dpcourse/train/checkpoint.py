"""Checkpoints that are complete or absent, with torch.distributed.checkpoint (DCP).

``get_state_dict`` / ``set_state_dict`` give the same view of a model and its optimizer for
DDP, FSDP1 and FSDP2, and DCP writes each rank's shards in parallel; loading reshards, so a
run saved by 4 ranks resumes on 2 with its optimizer state.

A rank can die at any instant, also in the middle of a save. So each save goes to a hidden
``.partial-step-NNNNNN/`` folder; once every rank has written its shards (a barrier), rank 0
writes ``progress.json`` -- the completion mark, fsync'ed -- and publishes the folder with
one ``os.rename`` to ``step-NNNNNN/``, which is atomic on POSIX file systems. A reader sees
either the whole checkpoint or none of it; the loader refuses a folder without the mark.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import warnings
from contextlib import contextmanager

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

MARK = "progress.json"  # written last: a folder without it is not a checkpoint
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where training stands, saved beside the tensors so a resume continues exactly."""

    step: int          # optimizer steps done (global count)
    epoch: int         # sampler epoch of the next batch
    batch: int         # index of the next batch within that epoch (per-rank batches)
    global_batch: int  # samples per optimizer step, all ranks together
    world_size: int    # ranks that wrote the checkpoint (any world size can load it)

    def advanced(self, steps: int, per_epoch: int) -> "Progress":
        """This progress ``steps`` optimizer steps later, with ``per_epoch`` batches per epoch."""
        epochs, batch = divmod(self.batch + steps, per_epoch)
        return dataclasses.replace(self, step=self.step + steps, epoch=self.epoch + epochs, batch=batch)


@contextmanager
def _quiet():
    """FSDP1's state-dict code warns about its own internals (ShardedTensor, default devices)
    at every save and load; a run saving every N steps would print them every N steps."""
    with warnings.catch_warnings():
        for text in ("Please use DTensor instead", "`_get_pg_default_device` will be deprecated",
                     "Multiple backends are registered"):
            warnings.filterwarnings("ignore", text)
        yield


def step_dir(root: str, step: int) -> str:
    """The folder of the checkpoint taken after ``step`` optimizer steps."""
    return os.path.join(root, f"step-{step:06d}")


def complete_checkpoints(root: str) -> list[str]:
    """Published checkpoints in ``root`` that carry the completion mark, oldest first."""
    if not os.path.isdir(root):
        return []
    found = sorted((int(m.group(1)), m.group(0)) for m in map(_STEP_DIR.match, os.listdir(root)) if m)
    return [os.path.join(root, name) for _, name in found if os.path.exists(os.path.join(root, name, MARK))]


def latest(root: str) -> str | None:
    """The newest complete checkpoint in ``root``, or None when there is none."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def _test_kill(point: str, step: int) -> None:
    """Test-only fault hook: SIGKILL this rank at ``point`` of the save of ``step`` when
    DPCOURSE_TEST_KILL="rank:point:step" names it (first torchrun attempt only)."""
    spec = os.environ.get("DPCOURSE_TEST_KILL")
    if spec == f"{dist.get_rank()}:{point}:{step}" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)


class _Writer(FileSystemWriter):
    """DCP's file writer (one file per rank, fsync'ed) with the "mid-write" fault point:
    this rank's shards are on disk, DCP's ``.metadata`` is not yet."""

    def __init__(self, path: str, step: int):
        super().__init__(path)
        self.step = step

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # synchronous: the files are written
        _test_kill("mid-write", self.step)
        return future


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes a rename or a new entry in this folder durable
    finally:
        os.close(fd)


def _discard(root: str, name: str) -> None:
    """Delete ``root/name`` by renaming it to a hidden name first: a half-deleted checkpoint
    must never look complete (its mark could outlive its shards)."""
    trash = os.path.join(root, f".deleting-{name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(os.path.join(root, name), trash)
    shutil.rmtree(trash, ignore_errors=True)


def _clear_leftovers(root: str) -> None:
    """Remove what dead ranks left: unpublished ``.partial-*`` and half-deleted ``.deleting-*``
    folders (a run saves one checkpoint at a time, so none of them is in use)."""
    for name in os.listdir(root):
        if name.startswith((".partial-step-", ".deleting-step-")):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def save(root: str, model, optimizer, progress: Progress, keep: int = 2) -> str:
    """Write a complete checkpoint of ``progress.step`` to ``root/step-NNNNNN`` on every rank
    (each its own shards), publish it atomically, keep the newest ``keep``; return its path."""
    rank, final = dist.get_rank(), step_dir(root, progress.step)
    partial = os.path.join(root, f".partial-{os.path.basename(final)}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        _clear_leftovers(root)  # e.g. this very partial, from an attempt that died writing it
    dist.barrier()  # nobody writes into the folder while rank 0 clears it
    with _quiet():
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, storage_writer=_Writer(partial, progress.step))
    _test_kill("before-barrier", progress.step)
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        with open(os.path.join(partial, MARK), "w") as f:
            json.dump(dataclasses.asdict(progress), f)
            f.flush()
            os.fsync(f.fileno())
        _test_kill("before-publish", progress.step)
        if os.path.exists(final):
            _discard(root, os.path.basename(final))
        os.rename(partial, final)  # the instant the checkpoint exists
        _fsync_dir(root)
        _test_kill("after-publish", progress.step)
        for old in complete_checkpoints(root)[:-keep]:
            _discard(root, os.path.basename(old))
    dist.barrier()  # everyone sees the published checkpoint before going on
    return final


def read_progress(path: str) -> Progress:
    """The progress record of a complete checkpoint folder; a clear error for anything else."""
    mark = os.path.join(path, MARK)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint folder {path!r}")
    if not os.path.exists(mark):
        newest = latest(path)
        hint = f"; the newest complete checkpoint inside it is {newest!r}" if newest else ""
        raise FileNotFoundError(
            f"{path!r} has no {MARK} completion mark: it is not a complete checkpoint (a rank may "
            f"have died while writing it, and a partial checkpoint is never loaded){hint}")
    with open(mark) as f:
        return Progress(**json.load(f))


def resolve(resume, root: str | None) -> str | None:
    """The checkpoint folder ``resume`` names: "auto" -> the newest complete one in ``root``
    or None (start fresh); True/"latest" -> the newest, which must exist; a path -> that
    checkpoint, or the newest complete one inside it. None/False -> None."""
    if resume in (None, False, "", "no"):
        return None
    if resume in (True, "auto", "latest"):
        found = latest(root)
        if found is None and resume != "auto":
            raise FileNotFoundError(f"no complete checkpoint in {root!r}: run once with "
                                    f"checkpoint_dir={root!r} first, or use resume='auto'")
        return found
    path = str(resume)
    return path if os.path.exists(os.path.join(path, MARK)) else (latest(path) or path)


def agree_on(resume, root: str | None) -> str | None:
    """``resolve`` on rank 0, broadcast: every rank loads the same checkpoint even if their
    views of a shared file system differ for a moment."""
    if resume in (None, False, "", "no"):
        return None  # the same config on every rank: nothing to agree on
    choice: list = [None]
    if dist.get_rank() == 0:
        try:
            choice[0] = ("path", resolve(resume, root))
        except FileNotFoundError as err:  # raised on every rank, not only rank 0
            choice[0] = ("error", str(err))
    dist.broadcast_object_list(choice, src=0)
    kind, value = choice[0]
    if kind == "error":
        raise FileNotFoundError(value)
    return value


def load(path: str, model, optimizer) -> Progress:
    """Restore model + optimizer state from the complete checkpoint ``path`` in place
    (resharding to this world size as needed); return its progress record."""
    progress = read_progress(path)  # refuses a folder without the completion mark
    with _quiet():
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return progress


def resume(choice, root: str | None, model, optimizer, global_batch: int, per_epoch: int):
    """(progress to start from, checkpoint path or None): load the checkpoint that ``choice``
    (a ``TrainConfig.resume`` value, see ``resolve``) names, if any.

    ``global_batch``: samples per step of this run; ``per_epoch``: batches per epoch per rank.
    The data resume where the checkpoint's sampler epoch and batch say, which is the same
    sample at any world size only for the same global batch -- anything else is refused.
    """
    world = dist.get_world_size()
    fresh = Progress(0, 0, 0, global_batch, world)
    path = agree_on(choice, root)
    if path is None:
        return fresh, None
    saved = read_progress(path)
    if saved.global_batch != global_batch:
        raise ValueError(f"{path} was saved with a global batch of {saved.global_batch} samples "
                         f"({saved.world_size} ranks), this run's is {global_batch} ({world} ranks): "
                         f"use batch_size={saved.global_batch // world} so the data continue exactly")
    load(path, model, optimizer)
    epochs, batch = divmod(saved.batch, per_epoch)  # a checkpoint taken at an epoch's end
    return Progress(saved.step, saved.epoch + epochs, batch, global_batch, world), path


def load_weights(path: str, model) -> None:
    """Load a complete checkpoint's model weights into a plain (unwrapped) ``model`` in this
    process, e.g. to compare with single-process training; needs no process group."""
    read_progress(path)  # refuses a folder without the completion mark
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # loading in one process
        dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state["model"])
