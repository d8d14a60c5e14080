"""Exercise A's reference: train_lm.py made data-parallel with DDP, one process per device.

    torchrun --standalone --nproc_per_node=2 train_lm_ddp.py --batch-size 8 --accum-steps 2

--batch-size is per rank and per micro-batch: an optimizer step sees batch-size x accum-steps
x world-size sequences, so the command above trains what `python train_lm.py --batch-size 16`
trains, to float rounding, and prints the same val_loss. What going distributed decided:

* training data: DistributedSampler, a disjoint share per rank, reshuffled by set_epoch;
* accumulation: DDP all-reduces inside backward(), so the micro-batches before the last run
  under no_sync() and the gradients are averaged over the ranks once per optimizer step;
* the schedule: it counts optimizer steps, which every rank takes together;
* validation: the whole set, each sequence on exactly one rank (no padding), the sums of
  token losses and of tokens added up over the ranks before dividing;
* rank 0 alone prints and saves the plain module's weights.
"""
import argparse
import contextlib
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset

from dpcourse.models import build_model, loss_fn, make_dataset


def parse_options(argv=None):
    parser = argparse.ArgumentParser(description="Train the course's tied transformer with DDP (under torchrun).")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch")
    parser.add_argument("--accum-steps", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of AdamW")
    parser.add_argument("--warmup-steps", type=int, default=4, help="optimizer steps of linear warm-up")
    parser.add_argument("--max-norm", type=float, default=0.1, help="clip the gradients' global norm to this")
    parser.add_argument("--num-samples", type=int, default=256, help="training sequences")
    parser.add_argument("--val-samples", type=int, default=37, help="validation sequences")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the data order")
    parser.add_argument("--out", default="model.pt", help="file rank 0 writes the trained weights to")
    return parser.parse_args(argv)


def lr_factor(step, warmup, total):
    """The learning rate at optimizer step `step`, as a fraction of the peak: a linear
    warm-up over `warmup` steps, then a cosine decay to a tenth of the peak at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def join_group():
    """This process's device, once it has joined the job's process group (torchrun's
    environment says where the group meets, how many ranks, and which one this is)."""
    if not torch.cuda.is_available():
        dist.init_process_group(backend="gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # this machine's n-th GPU
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl", device_id=device)
    return device


@torch.no_grad()
def evaluate(model, loader, device):
    """Mean loss per token over the whole validation set, of which `loader` reads this rank's part."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # token losses, tokens
    for inputs, targets in loader:
        logits = model(inputs.to(device))
        targets = targets.to(device)
        sums[0] += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        sums[1] += targets.numel()
    # A mean of the ranks' means would weigh a short share like a full one: add the sums.
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    model.train()
    return (sums[0] / sums[1]).item()


def train(argv=None):
    args = parse_options(argv)
    device = join_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()

    model = build_model("tied_transformer", seed=args.seed).to(device)
    # The wrapper starts every replica from rank 0's weights and averages the gradients in
    # backward(); the tied head and embedding are one parameter, all-reduced once.
    ddp_model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    train_set = make_dataset("tied_transformer", args.num_samples, seed=1)
    val_set = make_dataset("tied_transformer", args.val_samples, seed=15)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    # Not a DistributedSampler here: it would repeat sequences until every rank has as many,
    # and a repeated sequence counts twice in the mean. Every rank's part, each sequence once:
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=args.batch_size)

    steps_per_epoch = len(train_loader) // args.accum_steps  # this rank's micro-batches: the same count on all
    total_steps = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, args.warmup_steps, total_steps))

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # the shared shuffle's seed: a new order every epoch
        for i, (inputs, targets) in enumerate(train_loader):
            inputs, targets = inputs.to(device), targets.to(device)
            stepping = (i + 1) % args.accum_steps == 0
            # Forward and backward under no_sync(): DDP keeps the gradients local and adds
            # the next micro-batch's to them; the last one's backward all-reduces the sum.
            with contextlib.nullcontext() if stepping else ddp_model.no_sync():
                loss = loss_fn("tied_transformer", ddp_model(inputs), targets) / args.accum_steps
                loss.backward()
            if stepping:
                torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), args.max_norm)  # the same norm on every rank
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
        val_loss = evaluate(model, val_loader, device)  # the plain module: its forward needs no peer
        if rank == 0:
            print(f"epoch {epoch}: val_loss {val_loss:.6f} lr {scheduler.get_last_lr()[0]:.3e}")

    if rank == 0:  # the replicas hold the same weights: one file, the plain module's keys
        torch.save(model.state_dict(), args.out)
        print(f"wrote {args.out}")
    dist.barrier()  # rank 0 hosts the group's store: the others wait until it has saved
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
    # Gloo's threads can abort a finished process while Python shuts down (SIGABRT), which
    # torchrun reports as a failure: every file is closed, so leave without that shutdown.
    sys.stdout.flush()
    os._exit(0)
