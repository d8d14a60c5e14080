"""Record a rank's memory change by change, with the phase of the training step of each.

    recorder = CallRecorder()
    with recorder:                         # PyTorch's MemTracker sees every storage from here on
        ...                                # the observer calls recorder.phase("forward blocks.0"),
        recorder.knows(model, optimizer)   # ... and says what the model and optimizer are
    recorder.frames(first, last)           # per phase: bytes by category at its end and peak

The counting is PyTorch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, through
``dpcourse.torch_private``): a
dispatch mode that sees every storage an op creates, every ``resize_`` and every free. It is
entered when the observed call starts, outside any module's forward (its module tracker
cannot start inside one), so it sees the model and optimizer being created. We add a log of
its changes, the phases, and our own labels: every storage the model, its wrapper and the
optimizer hold (``held.role_tensors``) is filed under its role; any other under the
tracker's own label, else by when it was born (in forward: activations; later: temporaries).
Runs on the ranks; never draws.
"""
from __future__ import annotations

from ..memory.ledger import CATEGORIES
from ..torch_private import mem_tracker_record
from .held import ROLE_ORDER, TOOL_LABELS, fsdp1_flat_params, role_tensors, wrapper_kind
from .watch import remove_hooks


class CallRecorder:
    """Logs every storage change with the phase it happened in; files each storage by role."""

    def __init__(self):
        from ..torch_private import logging_mem_tracker

        self.tracker = logging_mem_tracker(self._on_change)
        self.tool = "MemTracker"
        self.model = self.optimizer = None
        self.buckets: dict = {}
        self.kind = None
        self.phases, self.events, self.winfos, self.born, self.roles = ["start"], [], [], [], {}
        self._handles: list = []

    # --- the log ----------------------------------------------------------------------
    def _on_change(self, kind: str, winfo, old) -> None:
        if kind == "REF":
            return
        sid = getattr(winfo, "_dpc_id", None)
        if sid is None:
            sid = winfo._dpc_id = len(self.winfos)
            self.winfos.append(winfo)
            self.born.append(len(self.phases) - 1)
        delta = {"ADD": winfo.mem_consumed, "DEL": -winfo.mem_consumed}.get(kind)
        if delta is None:  # SIZE: a resize_ (FSDP frees and re-allocates unsharded storage)
            delta = winfo.mem_consumed - old
        self.events.append((sid, delta, len(self.phases) - 1))

    def knows(self, model, optimizer, buckets=None) -> None:
        """The model (its outermost wrapper) and the optimizer: their storages get roles."""
        if buckets is not None:
            self.buckets = buckets
        if model is self.model and optimizer is self.optimizer:
            return
        self.model, self.optimizer, self.kind = model, optimizer, wrapper_kind(model)
        remove_hooks(self._handles)
        # Unsharded gradients live only between accumulation and FSDP's reduce-scatter:
        # look at them right after they are accumulated.
        self._handles = [t.register_post_accumulate_grad_hook(self._label)
                         for role, t in role_tensors(model, optimizer)
                         if role in ("parameters", "unsharded_parameters") and t.requires_grad and t.is_leaf]
        if self.kind == "fsdp":
            self._handles += [flat.register_post_accumulate_grad_hook(self._label)
                              for flat in fsdp1_flat_params(model)]
        self._label()

    def _label(self, *_args) -> None:
        """File the storages the model and optimizer hold right now under their roles."""
        if self.model is None:
            return
        for role, tensor in role_tensors(self.model, self.optimizer, self.buckets):
            winfo = mem_tracker_record(self.tracker, tensor.untyped_storage())
            sid = getattr(winfo, "_dpc_id", None)  # None: a storage the tracker has not seen
            if sid is not None and (sid not in self.roles
                                    or ROLE_ORDER.index(role) < ROLE_ORDER.index(self.roles[sid])):
                self.roles[sid] = role

    def phase(self, name: str) -> int:
        """Start a new phase (if ``name`` is not the current one); returns its index."""
        if name != self.phases[-1]:
            self.phases.append(name)
        self._label()
        return len(self.phases) - 1

    def next_step(self) -> None:
        """A training step has ended: the tracker's per-module statistics (which refuse a
        module's second forward) start again; its byte counts go on."""
        self.tracker.reset_mod_stats()

    def __enter__(self):
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        self.tracker.__exit__(*exc)
        self._handles = remove_hooks(self._handles)

    # --- results (plain data, sent back to the kernel) ----------------------------------
    def category(self, sid: int) -> str:
        """Our category for one storage: its role, else the tool's label, else when it was born."""
        if sid in self.roles:
            return self.roles[sid]
        label = TOOL_LABELS.get(getattr(self.winfos[sid].reftype, "value", ""))
        if label:
            return label
        born = self.phases[self.born[sid]]
        return "activations" if born.startswith(("forward", "loss")) else "temporaries"

    def frames(self, first: int, last: int, baseline: dict) -> list[dict]:
        """Phases ``first`` .. ``last``, in order: {"phase", "end": {category: bytes}, "peak": {...}}.

        ``baseline``: bytes by category held when phase ``first`` began (a walk of the model and
        optimizer); the changes logged from then on are added to it. (Counting from the call's
        start instead would keep storages PyTorch freed in C++ without telling the tracker,
        e.g. the buckets DDP replaces after its first iteration.)"""
        cats = [self.category(i) for i in range(len(self.winfos))]
        now = {c: baseline.get(c, 0) for c in CATEGORIES}
        frames = [{"phase": p, "end": None, "peak": None} for p in self.phases]
        best = [-1] * len(self.phases)
        best[first], frames[first]["peak"] = sum(now.values()), dict(now)  # it starts from the baseline
        index = first
        for sid, delta, phase in [e for e in self.events if e[2] >= first] + [(None, 0, len(self.phases) - 1)]:
            while index < phase:  # close the phases that ended before this change
                frames[index]["end"] = dict(now)
                if frames[index]["peak"] is None:
                    frames[index]["peak"] = dict(now)
                index += 1
            if sid is not None:
                now[cats[sid]] += delta
            total = sum(now.values())
            if total > best[phase]:
                best[phase], frames[phase]["peak"] = total, dict(now)
        frames[-1]["end"] = dict(now)
        return frames[first:last + 1]
