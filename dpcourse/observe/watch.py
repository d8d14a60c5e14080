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

One ``StepClock`` per process holds those hooks, whatever the number of observers: the first
``LoopWatch`` entered installs them, the last to leave removes them, and every observer of a
call reads the same step count (``Comm``'s records, ``Timeline``'s spans and ``Memory``'s
frames say "step 2" of the same step). The observers that time layers or mark phases ask the
same clock for every module's forward (``on_module_forward``, ``on_module_output``) instead
of registering hooks of their own.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from ..torch_private import wrapper_module_names


def remove_hooks(handles: list) -> list:
    """Remove every hook in ``handles`` (PyTorch's removable handles); returns a new empty list."""
    for handle in handles:
        handle.remove()
    return []


class StepClock:
    """The process's one view of the training loop: four global hooks (module forward pre/post,
    optimizer step pre/post) that every observer entered at the same time shares.

    Built by the first ``LoopWatch`` entered in a process and dropped, hooks removed, when the
    last one leaves, so observers of one call (``observe=[comm, timeline, mem]``) count the
    same steps from one set of hooks instead of one set each. It calls back every watch
    subscribed to it, in the order they were entered."""

    _current: "StepClock | None" = None  # the clock of the watches entered now, in this process

    def __init__(self):
        self.steps = 0
        self.optimizer = None
        self.root: nn.Module | None = None
        self.watches: list[LoopWatch] = []
        self._outermost: list[nn.Module] = []  # outermost modules called since the last step
        self._depth = 0
        self._handles: list = []
        self._quiet = None  # the warnings filter install() adds, removed with the hooks

    @classmethod
    def join(cls, watch: "LoopWatch") -> "StepClock":
        """Subscribe ``watch`` to the process's clock, starting one (and its hooks) if none runs."""
        if cls._current is None:
            cls._current = cls().install()
        cls._current.watches.append(watch)
        return cls._current

    def leave(self, watch: "LoopWatch") -> None:
        """Unsubscribe ``watch``; the last to leave removes the hooks and drops the clock (and the
        model and optimizer it saw: they are the run's, not the observers')."""
        self.watches = [w for w in self.watches if w is not watch]
        if not self.watches:
            self._handles = remove_hooks(self._handles)
            if self._quiet in warnings.filters:
                warnings.filters.remove(self._quiet)
            self.root = self.optimizer = None
            self._outermost = []
            if StepClock._current is self:
                StepClock._current = None

    def install(self) -> "StepClock":
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim

        # Dynamo warns that a compiled module's global hooks fire once more for its wrapper: these
        # are the observer's hooks, which count the outermost module once whatever wraps it, so the
        # warning is the course's own and is silenced while the observer is attached
        warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks",
                                category=UserWarning)
        self._quiet = warnings.filters[0]
        # always_call: the depth stays right when a forward raises
        self._handles = [nn_module.register_module_forward_pre_hook(self._pre_forward),
                         nn_module.register_module_forward_hook(self._post_forward, always_call=True),
                         optim.register_optimizer_step_pre_hook(self._pre_step),
                         optim.register_optimizer_step_post_hook(self._post_step)]
        return self

    # --- the hooks -------------------------------------------------------------------
    def _pre_forward(self, module, args):
        self._depth += 1
        if self._depth == 1:
            if module not in self._outermost:
                self._outermost.append(module)
            for watch in list(self.watches):
                watch.tell("on_forward", module)
        for watch in list(self.watches):
            watch.tell("on_module_forward", module, args)

    def _post_forward(self, module, args, output):
        self._depth = max(0, self._depth - 1)
        for watch in list(self.watches):
            watch.tell("on_module_output", module, args, output)

    def _pre_step(self, optimizer, _args, _kwargs):
        self.optimizer = optimizer
        found = self._find_root(optimizer)  # a module: never its truth value (DDP has no len())
        self.root = found if found is not None else self.root
        for watch in list(self.watches):
            watch.tell("on_step_begin", watch)

    def _post_step(self, optimizer, _args, _kwargs):
        self.steps += 1
        self._outermost = []
        for watch in list(self.watches):
            watch.tell("on_step_end", watch)

    def _find_root(self, optimizer) -> nn.Module | None:
        """The outermost module called since the last step that holds the optimizer's first
        parameter (a loss module or a metric is called at the top level too)."""
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        for module in reversed(self._outermost):
            if first is None or any(p is first for p in module.parameters()):
                return module
        return None


class LoopWatch:
    """Inside ``with LoopWatch(on_forward=..., on_step_begin=..., on_step_end=...):`` the
    callbacks run at every outermost module forward (``on_forward(module)``) and before and
    after every ``optimizer.step()`` (``on_step_begin(watch)``, ``on_step_end(watch)``); with
    ``on_module_forward(module, args)`` and ``on_module_output(module, args, output)``, also
    around every module's forward (inner ones included; ``output`` None when it raised).

    Every watch entered at once shares the process's ``StepClock`` (one set of global hooks);
    each counts ``steps`` from the moment it was entered, and keeps the count once left."""

    CALLBACKS = ("on_forward", "on_step_begin", "on_step_end", "on_module_forward", "on_module_output")

    def __init__(self, on_forward=None, on_step_begin=None, on_step_end=None, on_module_forward=None,
                 on_module_output=None):
        self.on_forward, self.on_step_begin, self.on_step_end = on_forward, on_step_begin, on_step_end
        self.on_module_forward, self.on_module_output = on_module_forward, on_module_output
        self._clock: StepClock | None = None
        self._first_step = self._steps = 0

    def tell(self, callback: str, *args) -> None:
        fn = getattr(self, callback)
        if fn is not None:
            fn(*args)

    @property
    def steps(self) -> int:
        """How many ``optimizer.step()`` calls have completed since this watch was entered."""
        return self._steps if self._clock is None else self._clock.steps - self._first_step

    @property
    def root(self) -> nn.Module | None:
        """The module the loop trains (see the module's docstring); None outside the watch."""
        return None if self._clock is None else self._clock.root

    @property
    def optimizer(self):
        """The optimizer that stepped last; None outside the watch."""
        return None if self._clock is None else self._clock.optimizer

    # --- context ---------------------------------------------------------------------
    def __enter__(self):
        self._clock = StepClock.join(self)
        self._first_step = self._clock.steps
        return self

    def __exit__(self, *exc):
        if self._clock is not None:
            self._steps = self.steps
            self._clock.leave(self)
            self._clock = None


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
