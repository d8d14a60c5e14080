"""Exercise F's reference: train_lm.py sharded with FSDP2 (`fully_shard`), one process per device.

    torchrun --standalone --nproc_per_node=2 train_lm_fsdp.py --batch-size 8 --accum-steps 2

Each rank stores 1/world-size of every parameter, gradient and AdamW state, and gathers a
unit's weights (in bf16) only while it computes with them. --batch-size is per rank and
per micro-batch, so the command above trains what `python train_lm.py --batch-size 16`
trains, to bf16's rounding. What sharding decided:

* units: each transformer block, then the root, which keeps the embedding and the head;
  they are one tied parameter, and both of its users must live in the same unit;
* every rank builds the same initial weights (fully_shard keeps each rank's own), and the
  optimizer is made after sharding, so it steps the shards;
* accumulation: the reduce-scatter runs in the last micro-batch's backward only;
* validation: under FSDP a forward is a collective, so every rank runs as many batches:
  a padded DistributedSampler, with the repeated sequences left out of the sums;
* clipping: the norm of DTensor gradients is global; the checkpoint is the full state dict,
  gathered by every rank, written by rank 0.
"""
import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler

from dpcourse.models import build_model, loss_fn, make_dataset


def parse_options(argv=None):
    parser = argparse.ArgumentParser(description="Train the course's tied transformer with FSDP2 (under torchrun).")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch")
    parser.add_argument("--accum-steps", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of AdamW")
    parser.add_argument("--warmup-steps", type=int, default=4, help="optimizer steps of linear warm-up")
    parser.add_argument("--max-norm", type=float, default=0.1, help="clip the gradients' global norm to this")
    parser.add_argument("--num-samples", type=int, default=256, help="training sequences")
    parser.add_argument("--val-samples", type=int, default=37, help="validation sequences")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the data order")
    parser.add_argument("--out", default="model.pt", help="file rank 0 writes the full trained weights to")
    return parser.parse_args(argv)


def lr_factor(step, warmup, total):
    """The learning rate at optimizer step `step`, as a fraction of the peak: a linear
    warm-up over `warmup` steps, then a cosine decay to a tenth of the peak at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def start_rank():
    """(device, mesh) of this process: it joins the process group torchrun describes in its
    environment, and lays all the ranks out in one row, the axis the shards are cut along."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device, init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("shard",))


def shard(model, mesh):
    """One FSDP unit per transformer block, then the root for the rest: the token embedding
    and the head share one weight, so they must be in one unit (split, FSDP refuses)."""
    compute = torch.bfloat16  # on CPUs too, only slower; a GPU older than Ampere has no bf16
    # units, yet is_bf16_supported says True there too unless asked without emulation
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False):
        compute = torch.float32
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@torch.no_grad()
def evaluate(model, loader, own, device):
    """Mean loss per token over the whole validation set. `loader` pads the ranks' parts to
    one length; the first `own` sequences this rank reads are its part, the rest repeats."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # token losses, tokens
    seen = 0
    for inputs, targets in loader:
        logits = model(inputs.to(device))  # every rank, every batch: the forward all-gathers each unit
        keep = max(0, min(len(targets), own - seen))  # this batch's sequences that are not repeats
        seen += len(targets)
        targets = targets[:keep].to(device)
        sums[0] += F.cross_entropy(logits[:keep].flatten(0, 1).float(), targets.flatten(), reduction="sum")
        sums[1] += targets.numel()
    dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[1]).item()


def train(argv=None):
    args = parse_options(argv)
    device, mesh = start_rank()
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # The same seed on every rank: fully_shard slices each rank's own weights, it does not
    # broadcast rank 0's. The optimizer comes after sharding, to hold the DTensor shards.
    model = shard(build_model("tied_transformer", seed=args.seed).to(device), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    train_set = make_dataset("tied_transformer", args.num_samples, seed=1)
    val_set = make_dataset("tied_transformer", args.val_samples, seed=15)
    sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    # Padded to one length per rank (the repeats come last on each rank, and are left out).
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=DistributedSampler(val_set, shuffle=False))
    own = len(range(rank, len(val_set), world_size))

    total_steps = args.epochs * (len(train_loader) // args.accum_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, args.warmup_steps, total_steps))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (inputs, targets) in enumerate(train_loader):
            inputs, targets = inputs.to(device), targets.to(device)
            last = (i + 1) % args.accum_steps == 0
            # Before the last micro-batch each rank keeps its full unsharded gradients and
            # adds to them; the last backward reduce-scatters their sum.
            model.set_requires_gradient_sync(last)
            (loss_fn("tied_transformer", model(inputs), targets) / args.accum_steps).backward()
            if not last:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)  # DTensors: the global norm
            optimizer.step()  # each rank steps its shards
            optimizer.zero_grad()
            scheduler.step()
        val_loss = evaluate(model, val_loader, own, device)
        if rank == 0:
            print(f"epoch {epoch}: val_loss {val_loss:.6f} lr {scheduler.get_last_lr()[0]:.3e}")

    # A collective: every rank gathers; cpu_offload leaves the full tensors on rank 0 only.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, args.out)  # plain keys and whole tensors: loads into the plain model
        print(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
    # Gloo's threads can abort a finished process while Python shuts down (SIGABRT), which
    # torchrun reports as a failure: every file is closed, so leave without that shutdown.
    sys.stdout.flush()
    os._exit(0)
