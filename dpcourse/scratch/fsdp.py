"""``MiniFSDP``: fully sharded data parallelism (FULL_SHARD, ZeRO-3) in one readable wrapper.

    model = MiniFSDP(model, wrap={Block})            # one unit per Block, 1/N of it per rank
    optimizer = torch.optim.AdamW(model.parameters())  # steps the fp32 shards only
    loss_fn(model(x), y).backward(); optimizer.step()

The rhythm of one step, per unit (Zhao et al., "PyTorch FSDP", VLDB 2023, sec. 3):
forward:  all-gather the unit's shards -> compute -> free the gathered parameters;
backward: all-gather again -> compute gradients -> free -> reduce-scatter the gradient,
          so each rank keeps the averaged gradient of its own shard;
step:     the optimizer updates each rank's shard with its shard of the optimizer state.

Units come from ``wrap``, like torch's auto-wrap policies: a set of module classes or a
predicate ``wrap(module) -> bool``; children are claimed before their parents. Parameters
outside every unit are replicated on all ranks and all-reduced; ``shard_root=True`` shards
them as one more unit instead, as FSDP1's root does. When ``wrap`` is None or matches no
module, the whole model is one unit. As in FSDP1, the root's unit stays gathered from
forward to backward.

``compute_dtype`` (e.g. torch.bfloat16): gather and compute in that dtype, reduce the
gradients in it, and keep fp32 master shards and fp32 shard gradients -- FSDP's
``MixedPrecision(param_dtype=..., reduce_dtype=...)``.

Surface: ``.module``, ``no_sync()``, ``finish_gradient_synchronization()``, and
``gather_full_params()`` (full fp32 parameters under the unwrapped module's names). The
optimizer must be built on the wrapper's parameters, after wrapping: they are the shards.
Its steps are public methods -- ``pre_forward``, ``post_forward``, ``pre_backward``,
``post_backward`` (per unit) and ``comm_hook`` (every collective) -- so that a subclass
can change them, as with DDP's comm hooks.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..torch_private import queue_backward_callback, tree_flatten, tree_map
from .ddp import broadcast_module
from .flat import FlatUnit


def _policy(wrap):
    """``wrap`` as a predicate on modules."""
    if wrap is None:
        return lambda m: False
    if callable(wrap) and not isinstance(wrap, type):
        return wrap
    classes = tuple(wrap) if isinstance(wrap, (set, list, tuple, frozenset)) else (wrap,)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"wrap must be a set of nn.Module classes or a predicate module -> bool, "
                        f"not {wrap!r}")
    return lambda m: isinstance(m, classes)


def _post_order(module: nn.Module, prefix: str = ""):
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), module


class MiniFSDP(nn.Module):
    """Shards each wrapped unit's parameters 1/N per rank; gathers them only to compute."""

    def __init__(self, module: nn.Module, wrap=None, compute_dtype: torch.dtype | None = None,
                 shard_root: bool = False, group=None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("MiniFSDP needs a process group: run it on the ranks of a dpc.Cluster "
                               "(cluster.run(fn)) or after dist.init_process_group")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating-point dtype, not {compute_dtype}")
        self.module, self.compute_dtype, self.group = module, compute_dtype, group
        self.world_size = dist.get_world_size(group)
        broadcast_module(module, group=group)  # ranks may have other seeds
        self._names = [n for n, _ in module.named_parameters()]
        self.units = self._make_units(module, _policy(wrap), compute_dtype, group, shard_root)
        self.flat_params = nn.ParameterList([u.shard for u in self.units])
        # self.<step> is looked up at each call, so a subclass or an observer can replace it
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda m, args, u=unit: self.pre_forward(u))
            unit.module.register_forward_hook(lambda m, args, out, u=unit: self.post_forward(u, out))
            if unit.requires_grad:
                unit.full.register_post_accumulate_grad_hook(lambda t, u=unit: self.post_backward(u))
        self._callback_queued = False
        self.require_backward_grad_sync = True

    def _make_units(self, module, predicate, compute_dtype, group, shard_root) -> list[FlatUnit]:
        owners = {}  # id(param) -> [(module, attribute)], every place the tensor is registered
        for m in module.modules():
            for attr, p in m.named_parameters(recurse=False, remove_duplicate=False):
                owners.setdefault(id(p), []).append((m, attr))
        names = {id(p): n for n, p in module.named_parameters()}
        unit_modules = [(name, m) for name, m in _post_order(module) if predicate(m) or m is module]
        region = {}  # module -> the unit module whose flat tensor holds its own parameters
        for _, m in reversed(unit_modules):  # parents first: children overwrite their subtree
            for sub in m.modules():
                region[sub] = m
        units, claimed = [], set()
        for name, m in unit_modules:
            params = [(names[id(p)], p) for p in m.parameters() if id(p) not in claimed]
            if not params:
                continue
            for n, p in params:
                claimed.add(id(p))
                places = {region[o] for o, _ in owners[id(p)]}
                if places != {m}:
                    raise ValueError(f"parameter {n!r} is shared by modules of different units; "
                                     "MiniFSDP gathers one unit at a time, so tied parameters must "
                                     "live in one unit: change wrap so that their modules share one")
            grads = {p.requires_grad for _, p in params}
            label = name or "root"
            if len(grads) > 1:
                raise ValueError(f"unit {label!r} mixes trainable and frozen parameters; a unit is one "
                                 "flat tensor, trainable or not as a whole (FSDP1 without "
                                 "use_orig_params has the same rule): make the frozen module a unit "
                                 "of its own with wrap")
            # the root's leftovers are replicated, unless the root is wrapped or is the only unit
            sharded = m is not module or shard_root or predicate(module) or len(unit_modules) == 1
            unit = FlatUnit(label, params, [owners[id(p)] for _, p in params], sharded,
                            compute_dtype, group)
            unit.module, unit.is_root, unit.backward_started = m, m is module, False
            units.append(unit)
        for m in module.modules():
            for attr, _ in list(m.named_parameters(recurse=False, remove_duplicate=False)):
                delattr(m, attr)  # the flat tensors own the data now
        return units

    # --- communication ----------------------------------------------------------------
    def comm_hook(self, collective: str, output: torch.Tensor, input: torch.Tensor, name: str):
        """Start one collective of unit ``name`` and return its async ``Work``: "all_gather"
        (every rank's ``input`` shard into ``output``), "reduce_scatter" (this rank's chunk
        of the sum of ``input`` into ``output``) or "all_reduce" (``input`` is ``output``)."""
        if collective == "all_gather":
            return dist.all_gather_single(output, input, group=self.group, async_op=True)
        if collective == "reduce_scatter":
            return dist.reduce_scatter_single(output, input, group=self.group, async_op=True)
        return dist.all_reduce(output, group=self.group, async_op=True)

    # --- forward ----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.compute_dtype is not None:  # like FSDP's MixedPrecision: cast float inputs
            def cast(t):
                return t.to(self.compute_dtype) if torch.is_tensor(t) and t.is_floating_point() else t

            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return self.module(*args, **kwargs)

    def pre_forward(self, unit: FlatUnit) -> None:
        """Before a unit's forward: gather its parameters (always: the shards changed)."""
        unit.gather(self.comm_hook)
        unit.set_views()
        unit.backward_started = False

    def post_forward(self, unit: FlatUnit, output) -> None:
        """After a unit's forward: free its parameters (the root keeps them for backward)
        and hook its output, whose gradient arriving means the unit's backward begins."""
        if not unit.is_root or not torch.is_grad_enabled():
            unit.free()
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(lambda grad, u=unit: self.pre_backward(u))

    # --- backward ---------------------------------------------------------------------
    def pre_backward(self, unit: FlatUnit) -> None:
        """Before a unit's backward: gather its parameters again (once per backward)."""
        if not self._callback_queued:
            self._callback_queued = True
            queue_backward_callback(self._end_of_backward)  # once this backward has finished
        if unit.backward_started:
            return
        unit.backward_started = True
        if not unit.gathered:
            unit.gather(self.comm_hook)  # refills the storage the saved views point at

    def post_backward(self, unit: FlatUnit) -> None:
        """The unit's gradient (``unit.full.grad``) is complete: free the parameters and
        start reducing the gradient (post-accumulate-grad hook on ``unit.full``)."""
        unit.free()
        if self.require_backward_grad_sync:
            unit.reduce_gradient(self.comm_hook)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward keeps each unit's full, unsharded gradient and adds to it (no
        reduce-scatter): gradient accumulation at the price of unsharded gradient memory,
        as with torch FSDP's ``no_sync``."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.finish_gradient_synchronization()
        for unit in self.units:
            unit.backward_started = False
            if unit.gathered:
                unit.free()

    def finish_gradient_synchronization(self) -> None:
        """Wait for every outstanding gradient reduction; harmless if none is in flight."""
        for unit in self.units:
            unit.finish_gradient()

    # --- inspection -------------------------------------------------------------------
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 tensor} with the unwrapped module's parameter names (tied
        parameters under their first name). A collective: call it on every rank."""
        full = {}
        for unit in self.units:
            full.update(zip(unit.params_names, unit.full_parameters()))
        return {n: full[n] for n in self._names}

    def describe_units(self) -> list[dict]:
        """One dict per unit: name, parameter names, elements (unpadded, padded), sharded."""
        return [{"name": u.name, "params": list(u.params_names), "numel": u.numel,
                 "padded_numel": u.padded, "sharded": u.sharded} for u in self.units]
