"""4.2f's ``dcp.async_save``, derived a second way: what it returns, that the checkpoint it
writes while training goes on holds the state of the moment it was called (model and
optimizer, loaded back into fresh ones), not the state training reached meanwhile, and that
``dcp.save``'s checkpoint of the same step is the same. How long each blocks the loop is a
benchmark (``python -m dpcourse.bench async_save``), run here for its table, not its timing."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dpcourse as dpc

pytestmark = pytest.mark.timeout(600)


def _model(seed):
    from torch.distributed.fsdp import fully_shard

    model = dpc.models.build_model("mlp", seed=seed, d_hidden=256)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(model, optimizer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    weights, optim = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return ({k: v.clone() for k, v in weights.items()},
            {k: {s: t.clone() for s, t in per.items()} for k, per in optim["state"].items()})


def _steps(model, optimizer, first, last):
    x, y = dpc.models.make_dataset("mlp", 8 * dist.get_world_size() * last).tensors
    for step in range(first, last):
        rows = slice((step * dist.get_world_size() + dist.get_rank()) * 8, (step * dist.get_world_size() + dist.get_rank() + 1) * 8)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _save_while_training(folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _model(0)
    _steps(model, optimizer, 0, 2)
    at_save = _full(model, optimizer)
    group = dist.new_group(backend="gloo")
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{folder}/save", process_group=group)
    future = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{folder}/async",
                            process_group=group)
    _steps(model, optimizer, 2, 4)                       # training goes on while the write runs
    metadata = future.result()
    return {"future": type(future).__name__, "metadata": isinstance(metadata, Metadata),
            "at_save": at_save, "at_end": _full(model, optimizer)}


def _load(folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _model(1)
    _steps(model, optimizer, 0, 1)                      # other weights, an optimizer with state
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(model, optimizer)


def _equal(a, b) -> bool:
    (wa, oa), (wb, ob) = a, b
    return (wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa) and oa.keys() == ob.keys()
            and all(torch.equal(oa[k][s].float(), ob[k][s].float()) for k in oa for s in oa[k]))


def test_async_save_returns_a_future_and_writes_the_state_of_its_call(cluster2):
    folder = tempfile.mkdtemp(prefix="dpcourse-test-dcp-")
    try:
        saved = cluster2.run(_save_while_training, folder)
        loaded_async = cluster2.run(_load, f"{folder}/async")
        loaded_save = cluster2.run(_load, f"{folder}/save")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for rank in range(2):
        assert saved[rank]["future"] == "Future" and saved[rank]["metadata"]
        assert _equal(loaded_async[rank], saved[rank]["at_save"])     # model and optimizer, at the call
        assert _equal(loaded_save[rank], loaded_async[rank])          # the same as dcp.save's
        assert not _equal(loaded_async[rank], saved[rank]["at_end"])  # training went on meanwhile


def test_the_benchmark_prints_both_and_their_ratio():
    out = subprocess.run([sys.executable, "-m", "dpcourse.bench", "async_save", "--d-hidden", "256", "--depth", "2",
                          "--rounds", "1", "--saves", "2"], capture_output=True, text=True, timeout=300, check=True).stdout
    assert re.search(r"^save +blocked +[\d.]+ ms", out, re.M) and re.search(r"^async_save +blocked +[\d.]+ ms", out, re.M), out
    assert re.search(r"ratio blocked\(save\) / blocked\(async_save\): [\d.]+x", out), out
    assert "loaded checkpoints equal the weights at their save: True" in out
