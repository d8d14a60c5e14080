"""Train the MLP of train_single.py with DistributedDataParallel (DDP): one process per device.

On one machine, 2 processes (torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in each process's environment):

    torchrun --standalone --nproc_per_node=2 train_ddp.py --batch-size 16 --out model.pt

On 2 machines with 8 GPUs each, the same command on both (HEAD is the first machine):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 train_ddp.py

From the course notebook, on its ranks (what `torchrun --standalone` would do):

    cluster.run_script("train_ddp.py", "--batch-size", "16", "--out", "model.pt")

--batch-size is per rank: every optimizer step uses batch_size x world_size samples. So the
2-process command above trains exactly what `python train_single.py --batch-size 32` trains
(to float rounding), as long as the dataset size is a multiple of the world size; otherwise
DistributedSampler repeats a few samples so that every rank gets as many.
"""
import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from dpcourse.models import MLP, make_dataset


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Train the course's MLP with DDP (run under torchrun).")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--num-samples", type=int, default=256, help="size of the synthetic dataset")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the shuffle")
    parser.add_argument("--max-norm", type=float, default=0.5, help="clip the gradients' global norm to this")
    parser.add_argument("--out", default="model.pt", help="where rank 0 saves the trained weights")
    return parser.parse_args(argv)


def setup_distributed():
    """Join the process group (its address comes from torchrun's environment); return the device.

    A rank waits at most ``timeout`` for its peers, to join or in a collective (PyTorch's default
    is 10 minutes for NCCL, 30 for Gloo): a peer that never comes then fails the run, which
    torchrun --max-restarts can restart, instead of hanging it."""
    timeout = timedelta(minutes=5)
    if torch.cuda.is_available():
        # One GPU per process: LOCAL_RANK is this process's index on its own machine.
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # else every process would put its tensors on GPU 0
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)  # NCCL needs GPUs; Gloo runs on CPUs
    return device


def main(argv=None):
    args = parse_args(argv)
    device = setup_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)  # same initial weights as train_single.py, on every rank
    model = MLP().to(device)
    # DDP broadcasts rank 0's weights now, then all-reduces (averages) gradients in backward().
    model = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    dataset = make_dataset("mlp", args.num_samples)  # every rank builds the same dataset
    # One shuffle shared by all ranks (seeded with seed + epoch); rank r reads every
    # world_size-th index of it from position r, so the ranks' batches never overlap.
    sampler = DistributedSampler(dataset, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    if rank == 0:
        print(f"{world_size} ranks x {args.batch_size} samples = global batch {world_size * args.batch_size}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # without it, every epoch repeats epoch 0's order
        total, steps = torch.zeros((), device=device), 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # gradients are averaged over the ranks here, bucket by bucket
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)  # every rank: the same norm
            optimizer.step()  # identical gradients -> identical updates: replicas stay equal
            total += loss.detach()
            steps += 1
        # Each rank only saw its own micro-batches; the mean over ranks is the global batch's loss.
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        if rank == 0:  # every rank runs this script: log once
            print(f"epoch {epoch}: mean loss {total.item() / steps:.6f}")

    if rank == 0:  # the replicas are identical, so one copy is enough
        # .module is the plain MLP: its keys have no "module." prefix and load without DDP.
        torch.save(model.module.state_dict(), args.out)
        print(f"saved {args.out}")
    # Leave together: a rank that tears down the group while rank 0 still saves (and hosts
    # the rendezvous store) can make the others fail at exit.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    if not torch.cuda.is_available():
        # Gloo only: its worker threads outlive destroy_process_group() once a model was
        # wrapped, and now and then one aborts the finished process while Python shuts down
        # (SIGABRT, "terminate called without an active exception"), which torchrun reports
        # as a failed run -- and restarts under --max-restarts. Every file is closed: leave
        # without that shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
