"""Exercise F's checker on real torchrun launches: the reference and an independently written
conversion pass; each typical mistake fails with its item named and what was seen; a script
that deadlocks gathering the full state dict is stopped within a minute, each rank's place
named."""
from __future__ import annotations

import shutil
import textwrap
import time
from pathlib import Path

import pytest

import dpcourse as dpc
from dpcourse.exercises import starters
from test_exercises import assert_teaches, edited, item

pytestmark = pytest.mark.timeout(600)
REFERENCE = dpc.exercises.solution("F")

# Written apart from the reference: a named mesh, blocks wrapped by index, the gradient sync
# switched off before the first micro-batch and on before the last, the learning rate set by
# hand, clipping with foreach, every rank scoring the WHOLE validation set itself (the same
# forward passes on every rank, so FSDP's gathers match; no reduction needed), the full state
# dict gathered on every rank without cpu_offload.
INDEPENDENT = textwrap.dedent('''
    import argparse, math
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions
    from torch.utils.data import DataLoader, DistributedSampler
    from dpcourse.models import build_model, loss_fn, make_dataset

    p = argparse.ArgumentParser()
    for flag, kind, default in [("--epochs", int, 2), ("--batch-size", int, 8), ("--accum-steps", int, 2),
                                ("--lr", float, 1e-2), ("--warmup-steps", int, 4), ("--max-norm", float, 0.1),
                                ("--num-samples", int, 256), ("--val-samples", int, 37), ("--seed", int, 0),
                                ("--out", str, "model.pt")]:
        p.add_argument(flag, type=kind, default=default)
    args = p.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    net = build_model("tied_transformer", seed=args.seed)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i in range(len(net.blocks)):
        fully_shard(net.blocks[i], mesh=mesh, mp_policy=bf16)
    fully_shard(net, mesh=mesh, mp_policy=bf16)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = make_dataset("tied_transformer", args.num_samples, seed=1)
    held_out = make_dataset("tied_transformer", args.val_samples, seed=15)
    sampler = DistributedSampler(data, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    total = args.epochs * (len(loader) // args.accum_steps)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i % args.accum_steps == 0:
                net.set_requires_gradient_sync(False)
            if i % args.accum_steps == args.accum_steps - 1:
                net.set_requires_gradient_sync(True)
            (loss_fn("tied_transformer", net(x), y) / args.accum_steps).backward()
            if i % args.accum_steps == args.accum_steps - 1:
                w = args.warmup_steps
                t = min(1.0, (step - w) / max(1, total - w))
                scale = (step + 1) / w if step < w else 0.1 + 0.45 * (1 + math.cos(math.pi * t))
                for group in opt.param_groups:
                    group["lr"] = args.lr * scale
                torch.nn.utils.clip_grad_norm_(net.parameters(), args.max_norm, foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
        with torch.no_grad():   # every rank scores the whole set: the same gathers on every rank
            total_loss, tokens = 0.0, 0
            for x, y in DataLoader(held_out, batch_size=16):
                total_loss += F.cross_entropy(net(x).flatten(0, 1).float(), y.flatten(), reduction="sum").item()
                tokens += y.numel()
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: val_loss {total_loss / tokens:.6f}")
    full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        torch.save(full, args.out)
    dist.barrier()
    dist.destroy_process_group()
''')

SHARDED = "    model = shard(build_model(\"tied_transformer\", seed=args.seed).to(device), mesh)\n"
OPTIMIZER = "    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)\n"
CLIP = "            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)  # DTensors: the global norm\n"
BACKWARD = "            (loss_fn(\"tied_transformer\", model(inputs), targets) / args.accum_steps).backward()\n"
GATHER = "    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
# (mistake, edits of the reference, the item that must fail, words its detail must contain)
MISTAKES = [
    ("optimizer before sharding",
     [(SHARDED + OPTIMIZER, "    model = build_model(\"tied_transformer\", seed=args.seed).to(device)\n" + OPTIMIZER
       + "    shard(model, mesh)\n")],
     "each rank's optimizer steps", "when must the optimizer be created"),
    ("the root only",
     [("        fully_shard(block, mesh=mesh, mp_policy=policy)\n", "        pass\n")],
     "every block is a unit", "a unit of its own"),
    ("the tied weight split over two units",
     [("    fully_shard(model, mesh=mesh, mp_policy=policy)\n",
       "    fully_shard(model.head, mesh=mesh, mp_policy=policy)\n    fully_shard(model, mesh=mesh, mp_policy=policy)\n")],
     "runs to completion", "which unit can hold both of its users"),
    ("no mixed precision",
     [("MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)", "MixedPrecisionPolicy()")],
     "mixed precision", "carried float32"),
    ("bf16 reductions",
     [("reduce_dtype=torch.float32", "reduce_dtype=torch.bfloat16")],
     "mixed precision", "reduce-scatters carried bfloat16"),
    ("every micro-batch reduce-scatters",
     [("            model.set_requires_gradient_sync(last)\n", "")],
     "gradients are synchronised once per optimizer step", "whether this backward pass should reduce"),
    ("the schedule steps per micro-batch",
     [("            scheduler.step()\n", ""), (BACKWARD, BACKWARD + "            scheduler.step()\n")],
     "the learning rate at every optimizer step", "how often may a schedule move"),
    ("the loss is not divided by the micro-batches",
     [(BACKWARD, "            loss_fn(\"tied_transformer\", model(inputs), targets).backward()\n")],
     "the first step's gradient", "what share of the step's loss"),
    ("no clipping",
     [(CLIP, "")],
     "the gradients' global norm is clipped", "unclipped"),
    ("each rank clips its own slice",
     [(CLIP, "            mine = [p.grad.to_local() for p in model.parameters() if p.grad is not None]\n"
             "            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in mine]))\n"
             "            for g in mine:\n"
             "                g.mul_(min(1.0, args.max_norm / (norm.item() + 1e-6)))\n")],
     "the gradients' global norm is clipped", "the norm of its own slice"),
    ("the repeated validation sequences counted",
     [("        keep = max(0, min(len(targets), own - seen))", "        keep = len(targets)")],
     "the val_loss rank 0 prints", "counted twice"),
    ("each rank's own validation loss",
     [("    dist.all_reduce(sums)\n", "")],
     "the val_loss rank 0 prints", "include the losses the other rank computed"),
    ("rank 0 alone validates, as under DDP",   # Gloo says "Connection reset by peer": the cause is named
     [("        val_loss = evaluate(model, val_loader, own, device)\n        if rank == 0:\n",
       "        if rank == 0:\n"
       "            val_loss = evaluate(model, DataLoader(val_set, batch_size=args.batch_size), len(val_set), device)\n"),
      ("    dist.all_reduce(sums)\n", "")],
     "runs to completion", "so every rank must run the same validation forwards"),
    ("saves the shards",
     [(GATHER, "    full = model.state_dict()\n")],
     "the checkpoint loads into the plain model", "gathered from every rank"),
    ("every rank saves",
     [("    if rank == 0:\n        torch.save(full, args.out)", "    if True:\n        torch.save(full, args.out)")],
     "only rank 0 writes the checkpoint", "rank 1 also called torch.save"),
    ("a seed per rank",
     [("build_model(\"tied_transformer\", seed=args.seed)", "build_model(\"tied_transformer\", seed=args.seed + rank)")],
     "final weights equal one process", "same initial weights before sharding"),
]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "train_lm_fsdp.py"
    path.write_text(text)
    return str(path)


def test_the_reference_passes_and_is_the_solution(tmp_path):
    start = time.monotonic()
    report = dpc.exercises.check_f(write(tmp_path, REFERENCE))
    assert report.passed, str(report)
    assert "passed (16 of 16 checks)" in str(report)
    assert REFERENCE == (Path(starters.__file__).parent.parent / "solutions" / "train_lm_fsdp.py").read_text()
    print(f"check_f on the reference: {time.monotonic() - start:.1f} s")


def test_an_independent_conversion_passes(tmp_path):
    report = dpc.exercises.check_f(write(tmp_path, INDEPENDENT))
    assert report.passed, str(report)


def test_untouched_starter_is_not_attempted(tmp_path):
    assert not dpc.exercises.check_f(str(tmp_path / "train_lm_fsdp.py")).attempted
    copy = tmp_path / "copy.py"
    shutil.copy(starters.path("train_lm"), copy)
    unchanged = dpc.exercises.check_f(str(copy))
    assert not unchanged.attempted and "unchanged" in str(unchanged)


def test_ddp_is_not_fsdp(tmp_path):
    report = dpc.exercises.check_f(write(tmp_path, dpc.exercises.solution("A")))
    assert item(report, "each rank's optimizer steps").status == "fail"
    assert "no reduce-scatter in any backward pass" in item(report, "every block is a unit").detail


@pytest.mark.parametrize("mistake, edits, failing, words", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_mistake_fails_with_its_item_named(tmp_path, mistake, edits, failing, words):
    report = dpc.exercises.check_f(write(tmp_path, edited(REFERENCE, edits)))
    assert not report.passed
    bad = item(report, failing)
    assert bad.status == "fail" and words in bad.detail, str(report)
    if mistake == "the tied weight split over two units":
        # PyTorch 2.13 refuses at the first forward; the traceback quotes the learner's own line
        assert "is shared with a parameter already managed by another FSDP group" in bad.detail
        return
    assert_teaches(report, REFERENCE)
    if mistake == "optimizer before sharding":  # its stale parameters get no gradients: clipping is not judged
        assert item(report, "the gradients' global norm").status == "skip", str(report)


def test_a_full_state_dict_gathered_on_rank_0_alone_is_stopped_within_a_minute(tmp_path):
    """Gathering the full state dict is a collective; called on rank 0 only, rank 0 waits in
    its all-gather while rank 1 waits in the barrier after it. The checker stops the run and
    says so, instead of waiting out its timeout."""
    hang = edited(REFERENCE, [(GATHER + "    if rank == 0:\n", "    if rank == 0:\n    " + GATHER)])
    start = time.monotonic()
    report = dpc.exercises.check_f(write(tmp_path, hang))
    took = time.monotonic() - start
    first = report.items[0]
    assert first.status == "fail" and "could no longer meet" in first.detail, str(report)
    assert "rank 0 waits in its " in first.detail and " all_gather since optimizer step 8" in first.detail
    assert "rank 1 waits in its 1st barrier since optimizer step 8" in first.detail, first.detail
    assert took < 60, f"the deadlock was reported after {took:.0f} s"
    print(f"deadlock reported after {took:.1f} s: {first.detail}")


# each rank scores its own strided share, no padding: right with batches of 8 (19 and 18
# sequences make 3 batches on each rank), a hang with batches of 2 (10 on rank 0, 9 on rank 1)
_UNEVEN_VALIDATION = [
    ("    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=DistributedSampler(val_set, shuffle=False))\n"
     "    own = len(range(rank, len(val_set), world_size))\n",
     "    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=args.batch_size)\n"
     "    own = len(range(rank, len(val_set), world_size))\n"),
    ("from torch.utils.data import ", "from torch.utils.data import Subset, "),
]


def test_a_validation_right_at_one_batch_size_only_fails_at_the_other(tmp_path):
    report = dpc.exercises.check_f(write(tmp_path, edited(REFERENCE, _UNEVEN_VALIDATION)))
    assert not report.passed, str(report)
    failed = [i for i in report.items if i.status == "fail"]
    assert failed and all(i.detail.startswith("with --batch-size 2 (it passed with 8)") for i in failed), str(report)
