"""PyTorch's private names live in dpcourse/torch_private.py alone, and each one's absence says so."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpcourse import torch_private as tp

PACKAGE = Path(__file__).resolve().parent.parent / "dpcourse"

# The scan cannot know types, so it flags every private name (one leading underscore) read off
# anything but ``self``/``cls`` or a name the file binds to dpcourse's own code (a relative
# import, a class or function it defines). What it lets through besides, each with why:
OWN_PREFIXES = ("_dpc",)  # dpcourse's own marks on foreign objects (_dpcourse_guard, ...): no library uses the prefix
OWN_OBJECTS = {  # a name that holds an object of dpcourse's, read by a sibling module -> the file
    "cluster": "pool/kernel/cluster.py",  # whose code defines that name
    "wrapper": "scratch/ddp.py",  # the wrapper, through a weak reference
    "dp": "scratch/threaded_dp.py",  # ctx.dp, the ThreadedDataParallel a backward belongs to
    "player": "viz/ring.py",  # a drawing's player (viz/ring.py's and viz/memory.py's keep frames alike)
}
PYTHON = {"os._exit", "sys._current_frames"}  # documented in Python's library reference
LEARNER_CODE = {  # reference solutions are the PyTorch a learner writes, equal to the notebook's text
    ("exercises/solutions/bucketed_e.py", "torch.autograd.Variable._execution_engine"),  # E's scaffold
    ("exercises/solutions/tryits/checkpointing.py",  # apply_activation_checkpointing has no public home
     "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing"),
}
C10D_OPERATORS = {"_allgather_base_", "_reduce_scatter_base_"}  # op names the dispatcher reports,
# matched as data in the tracker's table (read off no object; a renamed op goes uncounted)
ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")
IDENTIFIER = re.compile(r"_[A-Za-z]\w*\.?")  # a private name in a string, or a name prefix ("_x.")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) \
        and not name.startswith(OWN_PREFIXES)


def _defined(tree: ast.Module) -> set[str]:
    """The attributes, functions, classes and class attributes a file defines."""
    return ({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
            | {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            | {t.id for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for a in c.body
               for t in (a.targets if isinstance(a, ast.Assign) else [a.target] if isinstance(a, ast.AnnAssign) else [])
               if isinstance(t, ast.Name)})


@functools.cache
def _defined_in(home: str | None) -> frozenset[str]:
    """What a dpcourse file defines (nothing for ``None``)."""
    return frozenset(_defined(ast.parse((PACKAGE / home).read_text())) if home else ())


def _own_names(tree: ast.Module) -> set[str]:
    """Names a file binds to dpcourse's own code: relative imports, dpcourse imports, its defs."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "dpcourse"):
            own |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            own |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "dpcourse"}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
    return own


def private_uses(source: str, where: str = "") -> list[str]:
    """Every private name ``source`` reaches outside dpcourse: ``x._name`` and
    ``getattr(x, "_name")`` (and set/has/delattr) where ``x`` is not dpcourse's own,
    ``import a._b`` and ``from a._b import c`` / ``from a import _c`` of another package, and a
    private name written as a string (``"_fsdp_wrapped_module."``) anywhere else."""
    tree = ast.parse(source)
    own, defined, found = _own_names(tree), _defined(tree), []

    def own_base(base, name):  # self._x only for an _x this file defines: not one a base class of torch's has
        return isinstance(base, ast.Name) and (base.id in own or base.id in ("self", "cls") and name in defined)
    named = {id(node.args[1]) for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_FUNCTIONS and len(node.args) >= 2}

    def flag(node, text):
        base, _, name = text.rpartition(".")
        if text not in PYTHON and (where, text) not in LEARNER_CODE and name not in _defined_in(OWN_OBJECTS.get(base)):
            found.append(f"{where}:{node.lineno}: {text}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not own_base(node.value, node.attr):
                flag(node, f"{ast.unparse(node.value)}.{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_FUNCTIONS
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            if not own_base(node.args[0], node.args[1].value):
                flag(node, f"{ast.unparse(node.args[0])}.{node.args[1].value}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "dpcourse" and any(map(_private, a.name.split("."))):
                    flag(node, f"import {a.name}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in named
              and IDENTIFIER.fullmatch(node.value) and _private(node.value) and node.value not in C10D_OPERATORS):
            flag(node, repr(node.value))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] != "dpcourse":
            for a in node.names:
                if any(map(_private, node.module.split("."))) or _private(a.name):
                    flag(node, f"from {node.module} import {a.name}")
    return found


def test_no_private_name_outside_its_one_module():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "torch_private.py":
            found += private_uses(path.read_text(), str(path.relative_to(PACKAGE)))
    assert not found, ("private PyTorch (or cloudpickle) names outside dpcourse/torch_private.py; "
                       "add a function there that names what it relies on:\n" + "\n".join(found))


@pytest.mark.parametrize("source, caught", [
    ("import torch\ntorch._C._foo()", "torch._C"),
    ("import torch.distributed as dist\ndist.distributed_c10d._world", "dist.distributed_c10d._world"),
    ("def f(model):\n    return model.tracker._WINFO", "model.tracker._WINFO"),
    ("import cloudpickle\ngetattr(cloudpickle.cloudpickle, '_code_reduce', None)",
     "cloudpickle.cloudpickle._code_reduce"),
    ("def f(m):\n    return hasattr(m, '_fsdp_wrapped_module')", "m._fsdp_wrapped_module"),
    ("from torch.utils._pytree import tree_map", "from torch.utils._pytree import tree_map"),
    ("from torch._C import _get_privateuse1_backend_name", "import _get_privateuse1_backend_name"),
    ("import torch.distributed._functional_collectives as funcol", "import torch.distributed._functional_collectives"),
    ("class T(Base):\n    def _update_snap(self, *a):\n        super()._update_snap(*a)", "super()._update_snap"),
    ("def f(name):\n    return name.replace('_checkpoint_wrapped_module.', '')", "'_checkpoint_wrapped_module.'"),
    ("class M(nn.Module):\n    def f(self):\n        return self._parameters", "self._parameters"),  # inherited
    ("class M(Base):\n    def f(self):\n        return getattr(self, '_handle', None)", "self._handle"),
    ("def f(cluster):\n    return cluster._WINFO", "cluster._WINFO"),  # a name pool/kernel/cluster.py does not define
])
def test_the_scan_catches_each_form(source, caught):
    found = private_uses(source, "example.py")
    assert any(caught in line for line in found), found


@pytest.mark.parametrize("source", [
    "class A:\n    _y = None\n    def __init__(self):\n        self._x = 1\n    def f(self):\n"
    "        return self._x, getattr(self, '_y', None), self._f()\n    def _f(self):\n        pass",
    "from . import parallel\nparallel._DTYPES",
    "from .pool.kernel.cluster import Cluster\nCluster._helper",
    "import os\nos._exit(0)",
    "def f(cluster):\n    return cluster._link",
    "def f(t):\n    t._dpc_id = 1\n    return t.__class__, t.__dict__",
    "OPS = {'_allgather_base_': 'all_gather', 'send': 'send'}\nprint('__main__', 'not_private', '_ x')",
])
def test_the_scan_lets_dpcourse_own_names_through(source):
    assert private_uses(source, "example.py") == []


def test_each_exception_is_still_needed():
    for where, text in LEARNER_CODE:
        assert text in (PACKAGE / where).read_text(), f"{where} no longer writes {text}: drop it from LEARNER_CODE"
    text = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "torch_private.py")
    unused = [name for name in [*PYTHON, *(base + "._" for base in OWN_OBJECTS)] if name not in text]
    unused += [op for op in C10D_OPERATORS if f'"{op}"' not in text]
    assert not unused, f"exceptions nothing uses any more: {unused}"


def _says_missing(name: str, call) -> None:
    with pytest.raises(tp.PrivateAPIMissing) as err:
        call()
    text = str(err.value)
    assert f"needs PyTorch 2.13's `{name}`; you have {torch.__version__}" in text, text
    assert "pip install torch==2.13.0" in text


def _owner(path: str):
    """The module or class a private name hangs on, e.g. "torch.utils._pytree" or "torch._C"."""
    import importlib

    module, _, cls = path.partition(":")
    owner = importlib.import_module(module)
    return getattr(owner, cls) if cls else owner


@pytest.mark.parametrize("owner, attr, name, call", [
    ("torch.distributed._tools.mem_tracker:MemTracker", "_update_snap", "MemTracker._update_snap",
     tp.mem_tracker_class),
    ("torch.distributed._tools.mem_tracker:MemTracker", "_update_snap", "MemTracker._update_snap",
     lambda: tp.logging_mem_tracker(print)),
    ("torch.distributed.fsdp._common_utils", "FSDP_WRAPPED_MODULE",
     "torch.distributed.fsdp._common_utils.FSDP_WRAPPED_MODULE", lambda: tp.is_fsdp1_wrapper(nn.Linear(1, 1))),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "_CHECKPOINT_WRAPPED_MODULE",
     "torch.distributed.algorithms._checkpoint.checkpoint_wrapper._CHECKPOINT_WRAPPED_MODULE",
     tp.wrapper_module_names),
    ("torch.distributed._tools.mem_tracker", "MemTracker", "torch.distributed._tools.mem_tracker.MemTracker",
     tp.mem_tracker_class),
    ("torch.utils._pytree", "tree_flatten", "torch.utils._pytree.tree_flatten", lambda: tp.tree_flatten([1])),
    ("torch.utils._pytree", "tree_map", "torch.utils._pytree.tree_map", lambda: tp.tree_map(str, [1])),
    ("torch._C", "_dispatch_keyset_full_after", "torch._C._dispatch_keyset_full_after",
     tp.keys_below_backend_select),
    ("torch.distributed.distributed_c10d", "_world", "torch.distributed.distributed_c10d._world",
     tp.process_groups),
    ("torch.autograd:Variable", "_execution_engine", "torch.autograd.Variable._execution_engine",
     lambda: tp.queue_backward_callback(lambda: None)),
    ("torch.nn.parallel:DistributedDataParallel", "_passing_sync_batchnorm_handle",
     "DistributedDataParallel._passing_sync_batchnorm_handle", lambda: tp.sync_batchnorm_accepts_cpu().__enter__()),
    ("torch._C", "_get_privateuse1_backend_name", "torch._C._get_privateuse1_backend_name",
     lambda: tp.sync_batchnorm_accepts_cpu().__enter__()),
], ids=lambda v: v if isinstance(v, str) and "." not in v and ":" not in v else None)
def test_each_missing_name_is_named_with_both_releases(monkeypatch, owner, attr, name, call):
    monkeypatch.delattr(_owner(owner), attr)
    _says_missing(name, call)


def test_objects_without_the_names_say_which():
    plain = nn.Linear(2, 2)
    _says_missing("DistributedDataParallel._get_ddp_logging_data", lambda: tp.ddp_logging_data(plain))
    _says_missing("DistributedDataParallel._comm_hooks", lambda: tp.ddp_has_comm_hook(plain))
    _says_missing("FSDPModule._get_fsdp_state", lambda: tp.fsdp2_param_group(plain))
    _says_missing("FlatParameter._local_shard", lambda: tp.fsdp1_flat_tensors(torch.zeros(1)))
    _says_missing("Tensor._version", lambda: tp.tensor_version(object()))
    _says_missing("Tensor._base", lambda: tp.tensor_base(object()))
    _says_missing("MemTracker._WINFO", lambda: tp.mem_tracker_record(object(), None))
    _says_missing("FlatParamHandle.flat_param", lambda: tp.fsdp1_flat_param(type("Unit", (), {"_handle": 1})()))
    assert tp.fsdp1_flat_param(plain) is None  # a unit without parameters has no handle


def test_a_boxed_object_without_its_type_says_so(monkeypatch):
    class Boxed:  # stands for a ScriptObject of a release without ScriptObject._type
        pass

    monkeypatch.setattr(torch, "ScriptObject", Boxed)
    _says_missing("ScriptObject._type", lambda: tp.boxed_type_name(Boxed()))


def test_the_names_work_on_the_tested_release():
    assert torch.__version__.startswith(tp.TESTED)
    assert tp.tree_flatten([torch.ones(1), (2, torch.zeros(2))])[0][1] == 2
    below = tp.keys_below_backend_select()
    assert below.has(torch._C.DispatchKey.CPU) and not below.has(torch._C.DispatchKey.BackendSelect)
    t = torch.zeros(3)
    before = tp.tensor_version(t)
    t.add_(1)
    assert tp.tensor_version(t) == before + 1 and tp.tensor_base(t[1:]) is t and tp.tensor_base(t) is None
    assert tp.boxed_type_name(t) == "" and tp.source_rank(object()) is None
    assert not dist.is_initialized() and tp.process_groups() == []
    assert tp.mem_tracker_class().__name__ == "MemTracker"


def test_the_observers_names_work_on_the_tested_release():
    changes = []
    tracker = tp.logging_mem_tracker(lambda *change: changes.append(change))
    with tracker:
        t = torch.zeros(256)
    record = tp.mem_tracker_record(tracker, t.untyped_storage())
    assert ("ADD", record, None) in changes and record.mem_consumed >= 256 * 4
    assert tp.mem_tracker_record(tracker, torch.zeros(1).untyped_storage()) is None  # made after it exited
    assert tp.wrapper_module_names() == ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
    assert not tp.is_fsdp1_wrapper(nn.Linear(1, 1))
    funcol = tp.functional_collectives()
    functions = dict(tp.functional_collective_functions())
    assert functions["all_reduce"] is funcol.all_reduce and "wait_tensor" in functions
    assert all(fn.__module__ == funcol.__name__ and not name.endswith("_backward") for name, fn in functions.items())


def test_the_code_reducer_keeps_what_the_pool_rewrites():
    code = test_the_code_reducer_keeps_what_the_pool_rewrites.__code__
    rebuild, args = tp.cloudpickle_code_reduce()(code)
    assert callable(rebuild) and "<dynamic-code>" in args  # the file name the pool puts back
