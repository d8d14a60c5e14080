"""Record one training step's memory on a rank, change by change, with the phase of each.

    recorder = StepRecorder(model, optimizer, units={block: "blocks.0", ...}, buckets=...)
    with recorder:
        recorder.phase("zero_grad"); optimizer.zero_grad(set_to_none=True)
        out = model(x)                   # phases "forward <unit>" come from module hooks
        recorder.phase("loss"); loss = loss_fn(out, y)
        recorder.phase("backward loss"); loss.backward()   # then "backward <unit>" phases
        recorder.phase("optimizer step"); optimizer.step()
    recorder.frames()                    # per phase: bytes by category at its end and peak

The counting is PyTorch's ``MemTracker`` (``FSDPMemTracker`` for FSDP2): a dispatch mode
that sees every storage an op creates, every ``resize_`` and every free. We only add a log of
its changes and our own labels (see ``measure``). Runs on the ranks; never draws.
"""
from __future__ import annotations

from .ledger import CATEGORIES
from .measure import ROLE_ORDER, TOOL_LABELS, fsdp1_flat_params, role_tensors, wrapper_kind


def _logging(base):
    """``base`` (a MemTracker class) that reports each change of its snapshot to ``on_change``."""

    class Logging(base):
        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            self.on_change(u_type.name, winfo, old_mem_consumed)

    Logging.__name__ = base.__name__
    return Logging


class StepRecorder:
    """Logs every storage change during a step with its phase; files each storage by role."""

    def __init__(self, model, optimizer, units: dict, buckets=(), inputs=()):
        from torch.distributed._tools.mod_tracker import ModTracker

        self.model, self.optimizer, self.units = model, optimizer, units
        self.buckets = buckets
        self.kind = wrapper_kind(model)
        if self.kind == "fully_shard":
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            self.tracker = _logging(FSDPMemTracker)(model, optimizer)
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            self.tracker = _logging(MemTracker)()
        self.tracker.on_change = self._on_change
        self.tool = type(self.tracker).__name__
        self.phases, self.events, self.winfos, self.born, self.roles = ["start"], [], [], [], {}
        self._stack: list[str] = []
        self._mods = ModTracker()
        self._mods.register_user_hooks(self._pre_fw, self._post_fw, self._pre_bw, self._post_bw)
        self._handles = []
        if self.kind == "fully_shard":
            self.tracker.track_inputs(tuple(inputs))
        else:  # created before the step: MemTracker must be told about them
            self.tracker.track_external(model, optimizer, *inputs,
                                        *[t for role, t in role_tensors(model, optimizer, buckets)
                                          if role == "bucket_buffers"],
                                        *[t for role, t in role_tensors(model, optimizer)
                                          if role.startswith("unsharded")])
        self._label()

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

    def _label(self, *_args) -> None:
        """File the storages the model and optimizer hold right now under their roles."""
        for role, tensor in role_tensors(self.model, self.optimizer, self.buckets):
            entry = self.tracker._WINFO.get(tensor.untyped_storage(), None)
            sid = getattr(entry[0], "_dpc_id", None) if entry else None
            if sid is not None and (sid not in self.roles
                                    or ROLE_ORDER.index(role) < ROLE_ORDER.index(self.roles[sid])):
                self.roles[sid] = role

    def phase(self, name: str) -> None:
        """Start a new phase of the step (module hooks start the forward/backward ones)."""
        if name != self.phases[-1]:
            self.phases.append(name)
        self._label()

    # --- phases from module hooks ---------------------------------------------------------
    def _pre_fw(self, module, _inputs):
        if module in self.units:
            self._stack.append(self.units[module])
            self.phase(f"forward {self._stack[-1]}")

    def _post_fw(self, module, _inputs, _outputs):
        if module in self.units and self._stack:
            self._stack.pop()
            self.phase(f"forward {self._stack[-1]}" if self._stack else "loss")

    def _pre_bw(self, module, _grads):
        if module is not None and module in self.units:
            self._stack.append(self.units[module])
            self.phase(f"backward {self._stack[-1]}")

    def _post_bw(self, module, _grads):
        if module is not None and module in self.units and self.units[module] in self._stack:
            self._stack.remove(self.units[module])
            if self._stack:
                self.phase(f"backward {self._stack[-1]}")

    def __enter__(self):
        # Unsharded gradients live only between accumulation and FSDP's reduce-scatter:
        # look at them right after they are accumulated.
        for role, tensor in role_tensors(self.model, self.optimizer):
            if role in ("parameters", "unsharded_parameters") and tensor.requires_grad and tensor.is_leaf:
                self._handles.append(tensor.register_post_accumulate_grad_hook(self._label))
        if self.kind == "fsdp":
            for flat in fsdp1_flat_params(self.model):
                self._handles.append(flat.register_post_accumulate_grad_hook(self._label))
        self._mods.__enter__()
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        self.tracker.__exit__(*exc)
        self._mods.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self.phase("at rest")

    # --- results (plain data, sent back to the kernel) ----------------------------------
    def category(self, sid: int) -> str:
        """Our category for one storage: its role, else the tool's label, else when it was born."""
        if sid in self.roles:
            return self.roles[sid]
        label = TOOL_LABELS.get(getattr(self.winfos[sid].reftype, "value", ""))
        if label:
            return label
        born = self.phases[self.born[sid]]
        return "activations" if born == "start" or born.startswith(("forward", "loss")) else "temporaries"

    def frames(self) -> list[dict]:
        """Per phase, in order: {"phase", "end": {category: bytes}, "peak": {category: bytes}}."""
        cats = [self.category(i) for i in range(len(self.winfos))]
        now = dict.fromkeys(CATEGORIES, 0)
        frames = [{"phase": p, "end": None, "peak": None} for p in self.phases]
        best = [-1] * len(self.phases)
        index = 0
        for sid, delta, phase in self.events + [(None, 0, len(self.phases) - 1)]:
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
        return frames

    def tool_peak(self) -> dict:
        """The tracker's own peak snapshot: {its category name: bytes} (one device)."""
        snap = self.tracker.get_tracker_snapshot("peak")
        return {getattr(k, "value", k): v for dev in snap.values() for k, v in dev.items()}


def record_step(model, optimizer, step, units: dict | None = None, buckets=(), inputs=()) -> dict:
    """Run ``step(recorder)`` (one training step) under a ``StepRecorder``; return its data.

    Returns {"frames", "peak_bytes" (per rank), "tool", "tool_peak"}. ``step`` may call
    ``recorder.phase(name)`` to name its moments (zero_grad, loss, optimizer step).
    """
    recorder = StepRecorder(model, optimizer, units or {model: "root"}, buckets, inputs)
    with recorder:
        step(recorder)
    frames = recorder.frames()
    return {"frames": frames, "peak_bytes": max(sum(f["peak"].values()) for f in frames),
            "tool": recorder.tool, "tool_peak": recorder.tool_peak()}
