"""Every private PyTorch (and cloudpickle) name the package uses, in one place, each with why
and what to expect.

The course is tested on PyTorch 2.13. Private names (a leading underscore) can move in any
release, so nothing else in the package touches one: it calls the functions here, which
raise ``PrivateAPIMissing`` -- "this needs PyTorch 2.13's `...`; you have 2.x" -- instead of
an AttributeError deep inside a lesson. Where a public API does the job it is used
instead (none does for the names below, as of 2.13; the public one is named where it
almost does).

    name                                             used by                   for
    torch.distributed._tools.mem_tracker.MemTracker  observe.Memory            bytes by category (no public tracker)
      and its _update_snap (overridden)                                        each change as it happens
    torch.utils._pytree.tree_flatten / tree_map      observe, scratch.MiniFSDP tensors in nested inputs/outputs
    DistributedDataParallel._get_ddp_logging_data    observe.Memory            DDP's bucket sizes (public: none)
    DistributedDataParallel._comm_hooks              observe.Memory            whether a comm hook is registered
    FlatParameter._local_shard, _saved_grad_shard,   observe.Memory            FSDP1's flat shards, by category
      _full_param_padded
    FSDPModule._get_fsdp_state()._fsdp_param_group   observe.Memory            FSDP2's unsharded parameters
      and its offload_policy                         4.2c's offload_clip       whether a unit offloads to CPU
                                                     try-it                    (on a CPU-only machine nothing
                                                                               public shows it: same device)
    MemTracker (above)                               4.2c's meta_init try-it   the peak bytes a rank allocated
    Variable._execution_engine.queue_callback        observe.Timeline,         run code when backward ends (what
                                                     scratch DDP/FSDP          DDP's reducer does; public: none)
    DistributedDataParallel                          4.2d's sync_batchnorm     SyncBatchNorm on CPU ranks: its
      ._passing_sync_batchnorm_handle and            try-it                    two refusals of a CPU, lifted
      torch._C._get_privateuse1_backend_name                                   for one call (public: none)
    torch._C._dispatch_keyset_full_after             pool's tracker            hand a c10d operator on to the
                                                                               backend's kernel, below its own
    OpOverload._schema                               pool's tracker            where a c10d operator's async_op
                                                                               stands among its arguments
    Work._source_rank                                pool's tracker            the sender of an irecv(src=None)
    distributed_c10d._world.pg_map                   pool's process group      every group a call destroyed
                                                                               (public: none lists them)
    ScriptObject._type                               pool's tracker            a boxed ProcessGroup argument
    Tensor._version, Tensor._base                    observe.Comm, Activations when a collective wrote its output;
                                                                               a saved view's storage
    MemTracker._WINFO                                observe.Memory            a storage's record of its bytes
    FSDP1 unit's _handle.flat_param                  observe.Memory            FSDP1's FlatParameters
    FSDPParamGroup.fsdp_params, FSDPParam's          observe.Memory            FSDP2's shards, unsharded
      sharded_param, _unsharded_param, all_gather_outputs                      parameters and buffers
    FSDP_WRAPPED_MODULE, _CHECKPOINT_WRAPPED_MODULE  observe (module names),   wrapped names as in the plain
                                                     train.runner              model; is this FSDP1
    torch.distributed._functional_collectives        exercises.recorder        DTensor's collectives
    cloudpickle.cloudpickle._code_reduce             pool.wire                 a cell's file name in tracebacks
    torch._C._distributed_c10d._dump_fr_trace_json   observe.Comm              the flight recorder's entries, on
                                                     .read_flight_recorder     Gloo (public: none; NCCL dumps its own)
    threading.Thread._target (Python's)              pool's ranks              whether a thread runs the learner's
                                                                               code (public: none)

Exercise E's reference solution, which the learner reads as PyTorch code, writes
``Variable._execution_engine.queue_callback`` itself, as DDP's own Python code would.
"""
from __future__ import annotations

import contextlib
import importlib

TESTED = "2.13"


class PrivateAPIMissing(RuntimeError):
    """A private PyTorch name the course relies on is missing from the installed release."""


def _missing(name: str, purpose: str) -> PrivateAPIMissing:
    import torch

    return PrivateAPIMissing(
        f"{purpose} needs PyTorch {TESTED}'s `{name}`; you have {torch.__version__}, which moved or "
        f"removed it. Install the release the course is tested on (pip install torch=={TESTED}.0) "
        "or report it, naming your release.")


def _attribute(module: str, attr: str, purpose: str):
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        raise _missing(f"{module}.{attr}", purpose) from None


def _member(obj, attr: str, name: str, purpose: str):
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise _missing(name, purpose) from None


# --- observers -----------------------------------------------------------------------------

def mem_tracker_class():
    purpose = "dpc.observe.Memory (bytes by category)"
    cls = _attribute("torch.distributed._tools.mem_tracker", "MemTracker", purpose)
    _member(cls, "_update_snap", "MemTracker._update_snap", purpose)  # what the observer overrides
    return cls


def tree_flatten(tree):
    return _attribute("torch.utils._pytree", "tree_flatten", "finding the tensors in nested values")(tree)


def tree_map(fn, tree):
    return _attribute("torch.utils._pytree", "tree_map", "mapping the tensors in nested values")(fn, tree)


def ddp_logging_data(ddp) -> dict:
    """DDP's own record of its buckets (``bucket_sizes``, ...)."""
    return _member(ddp, "_get_ddp_logging_data", "DistributedDataParallel._get_ddp_logging_data",
                   "dpc.observe.Memory (DDP's buckets)")()


def ddp_has_comm_hook(ddp) -> bool:
    return bool(_member(ddp, "_comm_hooks", "DistributedDataParallel._comm_hooks",
                        "dpc.observe.Memory (DDP's comm hook)"))


def fsdp1_flat_tensors(flat) -> dict:
    """FSDP1's tensors of one FlatParameter: its local shard, a saved gradient shard and the
    padded unsharded parameter (None where absent)."""
    purpose = "dpc.observe.Memory (FSDP1's flat shards)"
    return {"local_shard": _member(flat, "_local_shard", "FlatParameter._local_shard", purpose),
            "saved_grad_shard": getattr(flat, "_saved_grad_shard", None),
            "full_param_padded": getattr(flat, "_full_param_padded", None)}


def fsdp2_param_group(module):
    """FSDP2's parameter group of a ``fully_shard``-ed module (None if it holds none)."""
    purpose = "dpc.observe.Memory (FSDP2's unsharded parameters)"
    state = _member(module, "_get_fsdp_state", "FSDPModule._get_fsdp_state", purpose)()
    return _member(state, "_fsdp_param_group", "FSDPState._fsdp_param_group", purpose)


def queue_backward_callback(fn) -> None:
    """Run ``fn`` once the current backward pass has finished (call it during backward)."""
    import torch

    engine = _member(torch.autograd.Variable, "_execution_engine", "torch.autograd.Variable._execution_engine",
                     "running code when backward ends")
    _member(engine, "queue_callback", "Variable._execution_engine.queue_callback",
            "running code when backward ends")(fn)


def fsdp2_offload_policy(module):
    """The offload policy FSDP2 applies to a ``fully_shard``-ed module's parameters (None if the
    module shards none). Public: where the shards live, which on a CPU-only machine is the CPU
    with or without offloading."""
    group = fsdp2_param_group(module)
    if group is None:
        return None
    return _member(group, "offload_policy", "FSDPParamGroup.offload_policy", "4.2c's offload_clip check")


def logging_mem_tracker(on_change):
    """A ``MemTracker`` that also calls ``on_change(kind, info, old_bytes)`` after each change it
    records: ``kind`` is "ADD", "DEL", "SIZE" (a ``resize_``) or "REF" (its ``_UpdateType``'s
    names), ``info`` its ``_WeakRefInfo`` of the storage (``mem_consumed``: bytes now;
    ``reftype``), ``old_bytes`` the storage's bytes before the change. Overrides
    ``MemTracker._update_snap(u_type, winfo, old_mem_consumed, old_reftype)``, which 2.13
    calls on every change it sees (public: none reports changes one by one)."""
    class Logging(mem_tracker_class()):
        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            on_change(u_type.name, winfo, old_mem_consumed)

    return Logging()


def mem_tracker_record(tracker, storage):
    """A ``MemTracker``'s record (``_WeakRefInfo``) of an untyped storage it is tracking, None if
    it has none. Reads ``MemTracker._WINFO`` (a weak dict: storage -> (record, weak ref))."""
    winfo = _member(tracker, "_WINFO", "MemTracker._WINFO", "dpc.observe.Memory (storages by role)")
    entry = winfo.get(storage, None)
    return entry[0] if entry else None


def fsdp1_flat_param(module):
    """The FlatParameter an FSDP1 ``FullyShardedDataParallel`` unit holds (None if it holds no
    parameters). Reads the unit's ``_handle`` (a ``FlatParamHandle``, None or absent when
    there are no parameters) and its ``flat_param``."""
    handle = getattr(module, "_handle", None)
    if handle is None:
        return None
    return _member(handle, "flat_param", "FlatParamHandle.flat_param", "dpc.observe.Memory (FSDP1's flat shards)")


def fsdp2_param_tensors(module) -> list[dict]:
    """FSDP2's tensors of each parameter a ``fully_shard``-ed module manages (none if it shards
    none), in its group's order: "sharded_param" (a DTensor), "unsharded_param" (None until
    the first all-gather made it) and "all_gather_outputs" (a list). Reads the parameter group's
    ``fsdp_params`` and each ``FSDPParam``'s ``sharded_param``, ``_unsharded_param`` and
    ``all_gather_outputs`` (public: ``unshard()`` returns none of them)."""
    group = fsdp2_param_group(module)
    if group is None:
        return []
    purpose = "dpc.observe.Memory (FSDP2's parameters)"
    return [{"sharded_param": _member(fp, "sharded_param", "FSDPParam.sharded_param", purpose),
             "unsharded_param": getattr(fp, "_unsharded_param", None),
             "all_gather_outputs": list(_member(fp, "all_gather_outputs", "FSDPParam.all_gather_outputs", purpose))}
            for fp in _member(group, "fsdp_params", "FSDPParamGroup.fsdp_params", purpose)]


def wrapper_module_names() -> tuple[str, str]:
    """The attribute names under which FSDP1 and activation checkpointing register the module
    they wrap (each appears in the wrapped model's parameter and module names):
    ``torch.distributed.fsdp._common_utils.FSDP_WRAPPED_MODULE`` and
    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_WRAPPED_MODULE``."""
    purpose = "naming a wrapped model's modules as in the plain model"
    return (_attribute("torch.distributed.fsdp._common_utils", "FSDP_WRAPPED_MODULE", purpose),
            _attribute("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "_CHECKPOINT_WRAPPED_MODULE",
                       purpose))


def is_fsdp1_wrapper(model) -> bool:
    """Whether ``model`` is FSDP1's ``FullyShardedDataParallel`` or forwards attribute reads to
    one: it answers for ``_fsdp_wrapped_module``, the submodule FSDP1 registers (an
    ``isinstance`` check would miss a wrapper that forwards, as activation checkpointing's does)."""
    return hasattr(model, wrapper_module_names()[0])


def functional_collectives():
    """``torch.distributed._functional_collectives``: the module whose Python functions DTensor
    and FSDP2 call for their collectives (which never reach a c10d operator's Python entry point)."""
    purpose = "observing DTensor's collectives"
    try:
        return importlib.import_module("torch.distributed._functional_collectives")
    except ImportError:
        raise _missing("torch.distributed._functional_collectives", purpose) from None


def functional_collective_functions() -> list[tuple[str, object]]:
    """(name, function) of each Python function ``functional_collectives()`` defines itself, by
    name, less its autograd pieces (names ending ``_backward`` or ``_setup_context``)."""
    import inspect

    funcol = functional_collectives()
    return [(name, fn) for name, fn in inspect.getmembers(funcol, inspect.isfunction)
            if fn.__module__ == funcol.__name__ and not name.endswith(("_backward", "_setup_context"))]


# --- the pool ------------------------------------------------------------------------------

def argument_index(op, name: str) -> int | None:
    """Where an operator's argument ``name`` stands among its positional arguments (None: it has
    no such argument), from the operator's schema (``OpOverload._schema``)."""
    schema = _member(op, "_schema", "OpOverload._schema", "the pool's collective tracker")
    names = [argument.name for argument in schema.arguments]
    return names.index(name) if name in names else None


def keys_below_backend_select():
    """The dispatch keys below ``BackendSelect``: a c10d operator's own (backend) kernels, which
    the tracker's kernel, registered there, hands the operator on to (``op.redispatch``)."""
    import torch

    full_after = _member(torch._C, "_dispatch_keyset_full_after", "torch._C._dispatch_keyset_full_after",
                         "the pool's collective tracker")
    return full_after(torch._C.DispatchKey.BackendSelect)


def boxed_type_name(obj) -> str:
    """The TorchScript class name of a boxed object ('' if it is not one)."""
    import torch

    if not isinstance(obj, torch.ScriptObject):
        return ""
    return _member(obj, "_type", "ScriptObject._type", "the pool's collective tracker")().qualified_name()


def tensor_version(t) -> int:
    """A tensor's version counter: it moves on every in-place write."""
    return _member(t, "_version", "Tensor._version", "dpc.observe.Comm (when a collective finished)")


def tensor_base(t):
    """The tensor a view was taken from (None if ``t`` is not a view)."""
    return _member(t, "_base", "Tensor._base", "dpc.observe.Activations (a saved view's storage)")


def source_rank(work) -> int | None:
    """The sender of a completed ``irecv(src=None)``; None if it cannot say."""
    try:
        return work._source_rank()
    except (AttributeError, RuntimeError):
        return None


def process_groups() -> list:
    """Every process group that exists now (the default one and every subgroup)."""
    import torch.distributed.distributed_c10d as c10d

    world = _member(c10d, "_world", "torch.distributed.distributed_c10d._world", "the pool's group keeping")
    return list(_member(world, "pg_map", "torch.distributed.distributed_c10d._world.pg_map",
                        "the pool's group keeping"))


def thread_target(thread):
    """The function a ``threading.Thread`` was given to run (None: none, or it has returned):
    Python keeps it as ``Thread._target`` and publishes it nowhere."""
    return getattr(thread, "_target", None)


def cloudpickle_code_reduce():
    """cloudpickle's own reducer of a code object, ``cloudpickle.cloudpickle._code_reduce``
    (code -> (rebuild, args), args holding ``co_filename``); None where the installed
    cloudpickle has none, in which case code pickles as cloudpickle does by default."""
    import cloudpickle

    return getattr(cloudpickle.cloudpickle, "_code_reduce", None)


# --- SyncBatchNorm on a CPU (4.2d's sync_batchnorm try-it) ----------------------------------

@contextlib.contextmanager
def sync_batchnorm_accepts_cpu():
    """While the block runs, in this process: DDP wraps a model holding SyncBatchNorm on a CPU
    (its ``_passing_sync_batchnorm_handle`` only refuses one), and SyncBatchNorm's forward takes
    a CPU input (its device check accepts the name ``_get_privateuse1_backend_name`` returns:
    "cpu", for the length of the forward). The kernels its autograd function then calls have no
    CPU implementation in this build: the caller provides them."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    purpose = "4.2d's sync_batchnorm check (SyncBatchNorm on CPU ranks)"
    from .patching import patched

    # Both exist in this torch, or the caller hears which one is gone, and for what.
    _member(DDP, "_passing_sync_batchnorm_handle", "DistributedDataParallel._passing_sync_batchnorm_handle", purpose)
    _member(torch._C, "_get_privateuse1_backend_name", "torch._C._get_privateuse1_backend_name", purpose)
    forward = torch.nn.SyncBatchNorm.forward

    def forward_on_cpu(self, input):
        with patched(torch._C, _get_privateuse1_backend_name=lambda: "cpu"):
            return forward(self, input)

    # The forward is put back first, then DDP's refusal, as the patches were taken off before.
    with patched(DDP, _passing_sync_batchnorm_handle=lambda self, module: None), \
            patched(torch.nn.SyncBatchNorm, forward=forward_on_cpu):
        yield


# --- the flight recorder (4.2d's hang script) ------------------------------------------------

def flight_recorder_entries() -> list[dict]:
    """This process's flight-recorder entries, oldest first, as c10d dumps them (each with
    ``profiling_name``, ``collective_seq_id``, ``state``, ...). The recorder is on by default in
    2.13 (2,000 entries; ``TORCH_FR_BUFFER_SIZE=0`` before the process group turns it off). Gloo's recorder has no
    public reader in 2.13 (NCCL dumps its own with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``)."""
    import json

    import torch

    c10d = _member(torch._C, "_distributed_c10d", "torch._C._distributed_c10d", "reading the flight recorder")
    dump = _member(c10d, "_dump_fr_trace_json", "torch._C._distributed_c10d._dump_fr_trace_json",
                   "reading the flight recorder")
    return json.loads(dump()).get("entries", [])


def ipython_cell_numbers() -> dict:
    """{filename: execution count} of the cells this IPython shell compiled ({} outside IPython):
    the private map IPython reads to print "Cell In[3]" (``shell.compile._filename_map``)."""
    import sys

    shell = sys.modules.get("IPython") and getattr(sys.modules["IPython"], "get_ipython", lambda: None)()
    return getattr(getattr(shell, "compile", None), "_filename_map", {}) or {}
