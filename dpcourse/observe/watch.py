"""Where a rank's training loop is, seen from outside through PyTorch's global hooks.

The observers never ask the learner's code for its model or optimizer: PyTorch calls every
module's forward and every optimizer's step through hooks that anyone may register
process-wide (``torch.nn.modules.module.register_module_forward_pre_hook`` and
``register_module_forward_hook``; ``torch.optim.optimizer.register_optimizer_step_pre_hook``
and ``register_optimizer_step_post_hook``). From those alone a ``LoopWatch`` knows

* ``root``: the outermost module of the latest forward whose parameters the optimizer steps
  -- the wrapper the loop trains (``DistributedDataParallel``, an FSDP model, a plain model);
* ``optimizer``: the optimizer that stepped last;
* ``steps``: how many optimizer steps have completed (a "step" ends with ``optimizer.step()``),

and calls its owner back at the start of each outermost forward and around each step.
"""
from __future__ import annotations

import torch
from torch import nn

from ..torch_private import wrapper_module_names


def remove_hooks(handles: list) -> list:
    """Remove every hook in ``handles`` (PyTorch's removable handles); returns a new empty list."""
    for handle in handles:
        handle.remove()
    return []


class LoopWatch:
    """Inside ``with LoopWatch(on_forward=..., on_step_begin=..., on_step_end=...):`` the
    callbacks run at every outermost module forward (``on_forward(module)``) and before and
    after every ``optimizer.step()`` (``on_step_begin(watch)``, ``on_step_end(watch)``)."""

    def __init__(self, on_forward=None, on_step_begin=None, on_step_end=None):
        self.on_forward, self.on_step_begin, self.on_step_end = on_forward, on_step_begin, on_step_end
        self.steps = 0
        self.optimizer = None
        self.root: nn.Module | None = None
        self._outermost: list[nn.Module] = []  # outermost modules called since the last step
        self._depth = 0
        self._handles: list = []

    # --- the hooks -------------------------------------------------------------------
    def _pre_forward(self, module, _args):
        self._depth += 1
        if self._depth == 1:
            if module not in self._outermost:
                self._outermost.append(module)
            if self.on_forward is not None:
                self.on_forward(module)

    def _post_forward(self, module, _args, _out):
        self._depth = max(0, self._depth - 1)

    def _pre_step(self, optimizer, _args, _kwargs):
        self.optimizer = optimizer
        self.root = self._find_root(optimizer) or self.root
        if self.on_step_begin is not None:
            self.on_step_begin(self)

    def _post_step(self, optimizer, _args, _kwargs):
        self.steps += 1
        self._outermost = []
        if self.on_step_end is not None:
            self.on_step_end(self)

    def _find_root(self, optimizer) -> nn.Module | None:
        """The outermost module called since the last step that holds the optimizer's first
        parameter (a loss module or a metric is called at the top level too)."""
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        for module in reversed(self._outermost):
            if first is None or any(p is first for p in module.parameters()):
                return module
        return None

    # --- context ---------------------------------------------------------------------
    def __enter__(self):
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim

        self._handles = [nn_module.register_module_forward_pre_hook(self._pre_forward),
                         nn_module.register_module_forward_hook(self._post_forward, always_call=True),
                         optim.register_optimizer_step_pre_hook(self._pre_step),
                         optim.register_optimizer_step_post_hook(self._post_step)]
        return self

    def __exit__(self, *exc):
        self._handles = remove_hooks(self._handles)


def unwrapped_names(root: nn.Module) -> dict[nn.Module, str]:
    """{module: its name in the plain model}: wrapper prefixes (``module.`` of DDP and of
    anything with DDP's surface, FSDP1's ``_fsdp_wrapped_module.``, activation
    checkpointing's ``_checkpoint_wrapped_module.``) dropped; "" is the plain model itself."""
    inner = root.module if isinstance(getattr(root, "module", None), nn.Module) else root
    names, wrapped = {}, wrapper_module_names()
    for name, module in inner.named_modules():
        for part in wrapped:
            name = name.replace(part + ".", "").replace(part, "")
        names.setdefault(module, name.strip("."))
    return names


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank stores); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
