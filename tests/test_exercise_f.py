"""Exercise F's checker on real torchrun launches: the reference and independently written
conversions pass; each typical mistake fails with its item named and what was seen."""
from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

import dpcourse as dpc
from test_exercises import assert_teaches

pytestmark = pytest.mark.timeout(600)
REFERENCE = Path(dpc.scripts.path("train_fsdp")).read_text()

# Written apart from the reference: FSDP2 on a named mesh, blocks wrapped by index, the
# optimizer AdamW-free SGD as the starter's, clipping with foreach, an evaluation on rank 0
# after every epoch, the full state dict gathered on every rank without cpu_offload.
INDEPENDENT = textwrap.dedent('''
    import argparse, os
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions
    from torch.utils.data import DataLoader, DistributedSampler
    from dpcourse.models import MLP, make_dataset

    p = argparse.ArgumentParser()
    for flag, kind, default in [("--epochs", int, 3), ("--batch-size", int, 16), ("--lr", float, 0.05),
                                ("--num-samples", int, 256), ("--seed", int, 0), ("--out", str, "model.pt"),
                                ("--max-norm", float, 0.5)]:
        p.add_argument(flag, type=kind, default=default)
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    torch.manual_seed(args.seed)
    net = MLP()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i in range(len(net.blocks)):
        fully_shard(net.blocks[i], mesh=mesh, mp_policy=bf16)
    fully_shard(net, mesh=mesh, mp_policy=bf16)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    data = make_dataset("mlp", args.num_samples)
    sampler = DistributedSampler(data, seed=args.seed)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=args.batch_size, sampler=sampler):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(net(x), y).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), args.max_norm, foreach=True)
            opt.step()
        with torch.no_grad():   # every rank: forward is a collective under FSDP
            total = sum(F.mse_loss(net(x), y, reduction="sum") for x, y in DataLoader(data, batch_size=64))
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: {total.item() / len(data):.4f}")
    full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        torch.save(full, args.out)
    dist.barrier()
    dist.destroy_process_group()
''')

CLIP = "            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)\n"
OPTIMIZER = "    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)\n"
# (mistake, edits of the reference, the item that must fail, words its detail must contain)
MISTAKES = [
    ("optimizer before sharding",
     [(OPTIMIZER, ""), ("    model = MLP().to(device)\n", "    model = MLP().to(device)\n" + OPTIMIZER)],
     "each rank's optimizer steps", "when must the optimizer be created"),
    ("the root only",
     [("        fully_shard(block, mesh=mesh, mp_policy=policy)\n", "        pass\n")],
     "every block is a unit", "a unit of its own"),
    ("no mixed precision",
     [("mp_policy=policy", "mp_policy=MixedPrecisionPolicy()")],
     "mixed precision", "carried float32"),
    ("bf16 reductions",
     [("reduce_dtype=torch.float32", "reduce_dtype=torch.bfloat16")],
     "mixed precision", "reduce-scatters carried bfloat16"),
    ("no clipping",
     [(CLIP, "")],
     "the gradients' global norm is clipped", "unclipped"),
    ("each rank clips its own slice",
     [(CLIP, "            mine = [p.grad.to_local() for p in model.parameters()]  # this rank's slices\n"
             "            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in mine]))\n"
             "            for g in mine:\n"
             "                g.mul_(min(1.0, args.max_norm / (norm.item() + 1e-6)))\n")],
     "the gradients' global norm is clipped", "the norm of its own slice"),
    ("saves the shards",
     [("    state = get_model_state_dict(model, options=options)\n", "    state = model.state_dict()\n")],
     "the checkpoint loads into the plain model", "gathered from every rank"),
    ("every rank saves",
     [("    if rank == 0:\n        torch.save(state, args.out)", "    if True:\n        torch.save(state, args.out)")],
     "only rank 0 writes the checkpoint", "rank 1 also called torch.save"),
    ("a seed per rank",
     [("    torch.manual_seed(args.seed)\n    model", "    torch.manual_seed(args.seed + rank)\n    model")],
     "final weights equal one process", "same seed before sharding"),
]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "train_fsdp.py"
    path.write_text(text)
    return str(path)


def item(report, name: str):
    return next(i for i in report.items if i.name.startswith(name))


def test_the_reference_passes_and_is_the_solution(tmp_path):
    report = dpc.exercises.check_f(write(tmp_path, REFERENCE))
    assert report.passed, str(report)
    assert dpc.exercises.solution("F") == REFERENCE


def test_an_independent_conversion_passes(tmp_path):
    report = dpc.exercises.check_f(write(tmp_path, INDEPENDENT))
    assert report.passed, str(report)


def test_untouched_starter_is_not_attempted(tmp_path):
    assert not dpc.exercises.check_f(str(tmp_path / "train_fsdp.py")).attempted
    copy = tmp_path / "copy.py"
    shutil.copy(dpc.scripts.path("train_single"), copy)
    unchanged = dpc.exercises.check_f(str(copy))
    assert not unchanged.attempted and "unchanged" in str(unchanged)


def test_ddp_is_not_fsdp(tmp_path):
    report = dpc.exercises.check_f(write(tmp_path, Path(dpc.scripts.path("train_ddp")).read_text()))
    assert item(report, "each rank's optimizer steps").status == "fail"
    assert "no reduce-scatter in a step" in item(report, "every block is a unit").detail


@pytest.mark.parametrize("mistake, edits, failing, words", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_mistake_fails_with_its_item_named(tmp_path, mistake, edits, failing, words):
    script = REFERENCE
    for old, new in edits:
        assert old in script, f"the reference changed; update the mistake {mistake!r}"
        script = script.replace(old, new)
    report = dpc.exercises.check_f(write(tmp_path, script))
    assert not report.passed
    bad = item(report, failing)
    assert bad.status == "fail" and words in bad.detail, str(report)
    assert_teaches(report, REFERENCE)
    if mistake == "optimizer before sharding":  # its stale parameters get no gradients: clipping is not judged
        assert item(report, "the gradients' global norm").status == "skip", str(report)
