"""PyTorch's private names live in dpcourse/torch_private.py alone, and each one's absence says so."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpcourse import torch_private as tp

PACKAGE = Path(__file__).resolve().parent.parent / "dpcourse"
PRIVATE = re.compile(r"_pytree|_execution_engine|_AutoDispatchBelowAutograd|_source_rank|c10d\._world|"
                     r"_get_ddp_logging_data|\._comm_hooks|_local_shard|_saved_grad_shard|_full_param_padded|"
                     r"_get_fsdp_state|_fsdp_param_group|distributed\._tools|\._type\(\)|\._version\b|\._base\b|"
                     r"_passing_sync_batchnorm_handle|_get_privateuse1_backend_name")


def test_no_private_pytorch_name_outside_its_one_module():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "torch_private.py" or "solutions" in path.parts:
            continue  # exercise solutions are the learner's PyTorch code, as written by hand
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if PRIVATE.search(code) and "``" not in code:
                found.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not found, "private PyTorch names outside dpcourse/torch_private.py:\n" + "\n".join(found)


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
    ("torch.distributed._tools.mem_tracker", "MemTracker", "torch.distributed._tools.mem_tracker.MemTracker",
     tp.mem_tracker_class),
    ("torch.utils._pytree", "tree_flatten", "torch.utils._pytree.tree_flatten", lambda: tp.tree_flatten([1])),
    ("torch.utils._pytree", "tree_map", "torch.utils._pytree.tree_map", lambda: tp.tree_map(str, [1])),
    ("torch._C", "_AutoDispatchBelowAutograd", "torch._C._AutoDispatchBelowAutograd", tp.below_autograd),
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


def test_a_boxed_object_without_its_type_says_so(monkeypatch):
    class Boxed:  # stands for a ScriptObject of a release without ScriptObject._type
        pass

    monkeypatch.setattr(torch, "ScriptObject", Boxed)
    _says_missing("ScriptObject._type", lambda: tp.boxed_type_name(Boxed()))


def test_the_names_work_on_the_tested_release():
    assert torch.__version__.startswith(tp.TESTED)
    assert tp.tree_flatten([torch.ones(1), (2, torch.zeros(2))])[0][1] == 2
    with tp.below_autograd():
        pass
    t = torch.zeros(3)
    before = tp.tensor_version(t)
    t.add_(1)
    assert tp.tensor_version(t) == before + 1 and tp.tensor_base(t[1:]) is t and tp.tensor_base(t) is None
    assert tp.boxed_type_name(t) == "" and tp.source_rank(object()) is None
    assert not dist.is_initialized() and tp.process_groups() == []
    assert tp.mem_tracker_class().__name__ == "MemTracker"
