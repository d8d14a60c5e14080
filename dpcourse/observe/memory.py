"""``Memory``: what each rank holds, by the ledger's categories, at rest and over one step.

    mem = dpc.observe.Memory()                # record the last training step (or step=k)
    cluster.run(train, observe=[mem])
    mem.at_rest(rank=0)      # {"parameters": ..., "gradients": ..., "optimizer_state": ..., ...}
    mem.peak(rank=0)         # (bytes, phase) at the recorded step's fullest moment
    mem.frames(rank=0)       # per phase of that step: bytes by category at its end and peak

Attached from outside (the call's shared step clock, ``watch.LoopWatch``): the model is the
outermost module the loop calls, the optimizer the one that steps. *At rest* is right after
the recorded step's ``optimizer.step()``, before ``zero_grad``: every model state is alive
(``held.held_bytes``, unique storages by role). The whole call is recorded change by change with PyTorch's
``MemTracker`` (``record.CallRecorder``); the frames are those of the recorded step, from
the end of the step before it (where ``zero_grad`` usually runs) to its own optimizer step,
counted from what the walk found at that start. The storages get their roles once the
optimizer shows itself, when it first steps, so the recorded step must be the second or
later (``step >= 1``). Record a steady step: Adam creates its state in the first, and DDP
(torch 2.13) rebuilds its buckets in the third forward, holding old and new buckets
until that backward ends -- record the fourth step or later to leave that out.

Units -- the moments "forward blocks.1", "backward blocks.0" of the frames -- are FSDP's
units where the model has them, else the modules of its ``nn.ModuleList``s (the blocks).
DDP's bucket buffers are seen through a communication hook that does what DDP's default
does; when the loop registers its own, the buckets count from DDP's logging data at rest
and are missing from the frames.
"""
from __future__ import annotations

import torch
from torch import nn
from ..torch_private import ddp_has_comm_hook, ddp_logging_data, tree_flatten

from .held import capture_buckets, held_bytes
from .observer import Observer
from .record import CallRecorder
from .watch import LoopWatch, unwrapped_names


def _units(root: nn.Module) -> dict:
    """{module whose forward starts a unit: unit name} (see the module's docstring)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    names = unwrapped_names(root)
    fsdp = {m: names.get(m, "") or "root" for m in root.modules()
            if isinstance(m, (FullyShardedDataParallel, FSDPModule))}
    if fsdp:
        return fsdp
    blocks = {m: names[m] for lst in root.modules() if isinstance(lst, nn.ModuleList)
              for m in lst.children() if m in names}
    return {**blocks, root: "root"}


def _ddp_bucket_bytes(root: nn.Module) -> int:
    """Bytes of DDP's bucket buffers from its logging data (0 with gradient_as_bucket_view)."""
    data = ddp_logging_data(root)
    if data.get("gradient_as_bucket_view"):
        return 0
    return sum(int(b) for b in str(data.get("bucket_sizes", "")).split())


class Memory(Observer):
    """Observer: bytes by category on every rank, at rest and over one training step.

    step: which step's frames and at-rest bytes to keep (0-based; 1 or later); None, the
    last one the call completed."""

    NAME = "mem"   # in the message when nothing was observed yet

    def __init__(self, step: int | None = None):
        if step is not None and step < 1:
            raise ValueError(f"Memory(step={step}): the recorded step must be 1 or later -- the "
                             "optimizer shows itself only when it first steps")
        self.step = step
        self.per_rank: list[dict] | None = None

    def __repr__(self) -> str:
        return f"Memory(step={self.step})" + ("" if self.per_rank is None else
                                               f", observed on {len(self.per_rank)} ranks")

    # --- on the rank -----------------------------------------------------------------
    def __enter__(self):
        self._buckets, self._ddp_seen = {}, set()
        self._units: dict = {}
        self._stack: list[str] = []
        self._marks: list[tuple[int, dict]] = []  # per step: (its "zero_grad" phase after it, held then)
        self._recorder = CallRecorder()
        self._recorder.__enter__()
        self._watch = self.watch(LoopWatch(on_forward=self._on_forward, on_step_begin=self._on_step_begin,
                                           on_step_end=self._on_step_end, on_module_forward=self._pre_forward,
                                           on_module_output=self._post_forward))
        return self

    def __exit__(self, *exc):
        self.unwatch(*exc)
        self._recorder.__exit__(*exc)

    # --- phases ----------------------------------------------------------------------
    def _on_forward(self, module) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(module, DistributedDataParallel) and id(module) not in self._ddp_seen:
            self._ddp_seen.add(id(module))
            if not ddp_has_comm_hook(module):  # its own hook would refuse a second one
                self._buckets = capture_buckets(module)
        if module is self._watch.root or self._watch.root is None:
            self._units = _units(module)

    def _pre_forward(self, module, _args) -> None:
        name = self._units.get(module)
        if name is not None:
            self._stack.append(name)
            self._recorder.phase(f"forward {name}")

    def _post_forward(self, module, _args, output) -> None:
        name = self._units.get(module)
        if name is None or not self._stack:
            return
        self._stack.pop()
        self._recorder.phase(f"forward {self._stack[-1]}" if self._stack else "loss")
        if torch.is_grad_enabled():  # the unit's backward begins when its output's gradient arrives
            fired = []

            def hook(_grad, name=name):
                if not fired:
                    fired.append(True)
                    self._recorder.phase(f"backward {name}")

            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(hook)

    def _on_step_begin(self, watch) -> None:
        self._recorder.knows(watch.root, watch.optimizer, self._buckets)
        self._recorder.phase("optimizer step")

    def _on_step_end(self, watch) -> None:
        self._recorder.next_step()
        held = self._held(watch)  # at rest: after optimizer.step(), before zero_grad
        self._marks.append((self._recorder.phase("zero_grad"), held))

    def result(self) -> dict:
        done = len(self._marks)
        step = done - 1 if self.step is None else self.step
        found = {"steps": done, "step": step, "at_rest": None, "frames": None, "tool": self._recorder.tool,
                 "kind": self._recorder.kind}
        if 1 <= step < done:
            (first, baseline), (end, held) = self._marks[step - 1], self._marks[step]
            frames = self._recorder.frames(first, end - 1, baseline)
            frames.append({"phase": "at rest", "end": dict(held), "peak": dict(held)})
            found.update(at_rest=held, frames=frames)
        return found

    def _held(self, watch) -> dict:
        held = held_bytes(watch.root, watch.optimizer, self._buckets)
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(watch.root, DistributedDataParallel) and not self._buckets:
            held["bucket_buffers"] = _ddp_bucket_bytes(watch.root)
        return held

    # --- in the kernel -----------------------------------------------------------------
    def collect(self, per_rank: list) -> None:
        self.per_rank = per_rank
        for rank, found in enumerate(per_rank):
            if found["at_rest"] is None:
                need = 2 if self.step is None else self.step + 1
                raise RuntimeError(
                    f"{self!r} saw rank {rank} run {found['steps']} optimizer step(s): the observed "
                    f"function must run at least {need} (the recorded step starts where the one "
                    "before it ended)")

    def at_rest(self, rank: int = 0) -> dict[str, int]:
        """{category: bytes} ``rank`` held right after the recorded step's optimizer step."""
        return dict(self.of_rank(rank)["at_rest"])

    def frames(self, rank: int = 0) -> list[dict]:
        """The recorded step, phase by phase: {"phase", "end": {category: bytes}, "peak": {...}}."""
        return self.of_rank(rank)["frames"]

    def peak(self, rank: int = 0) -> tuple[int, str]:
        """(most bytes ``rank`` held at once during the recorded step, the phase it was in)."""
        best = max(self.frames(rank), key=lambda f: sum(f["peak"].values()))
        return sum(best["peak"].values()), best["phase"]
