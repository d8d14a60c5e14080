"""Train the MLP of train_single.py with FSDP2 (`fully_shard`): each rank stores 1/world_size
of every parameter, gradient and optimizer state, and gathers a block's full weights only
while it computes with them.

On one machine, 2 processes (torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in each process's environment):

    torchrun --standalone --nproc_per_node=2 train_fsdp.py --batch-size 16 --out model.pt

On 2 machines with 8 GPUs each, the same command on both (HEAD is the first machine):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HEAD:29500 train_fsdp.py

From the course notebook, on its ranks (what `torchrun --standalone` would do):

    cluster.run_script("train_fsdp.py", "--batch-size", "16", "--out", "model.pt")

--batch-size is per rank, as in train_ddp.py: the 2-process command above trains what
`python train_single.py --batch-size 32` trains -- to bf16's rounding by default, and to
float rounding with --param-dtype float32 (the dataset size must be a multiple of the
world size) -- and saves the same full, unsharded weights.
"""
import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler

from dpcourse.models import MLP, make_dataset


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Train the course's MLP with FSDP2 (run under torchrun).")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--num-samples", type=int, default=256, help="size of the synthetic dataset")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the shuffle")
    parser.add_argument("--max-norm", type=float, default=0.5, help="clip the gradients' global norm to this")
    parser.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="dtype of the gathered parameters (the shards stay float32)")
    parser.add_argument("--out", default="model.pt", help="where rank 0 saves the full trained weights")
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
    mesh = init_device_mesh(device.type, (world_size,))  # 1-D: shard over all ranks

    # Unlike DDP, fully_shard does not broadcast rank 0's weights: each rank keeps its slice
    # of its OWN weights. The same seed on every rank, before sharding, makes them one model.
    # Mixed precision: each unit's weights are gathered (and computed with) in param_dtype,
    # gradients reduced in float32; the float32 shards are the master copy the optimizer
    # steps. bf16 runs on CPUs too, only slower; a GPU older than Ampere (V100, T4) has no bf16
    # units, yet is_bf16_supported says True there unless asked without emulation.
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        args.param_dtype = "float32"
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, args.param_dtype), reduce_dtype=torch.float32)
    torch.manual_seed(args.seed)
    model = MLP().to(device)
    for block in model.blocks:  # one unit per block: its weights are gathered just in time
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root takes what is left (the head)
    # After sharding: the parameters are now DTensors, and the optimizer must hold those.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    dataset = make_dataset("mlp", args.num_samples)  # every rank builds the same dataset
    sampler = DistributedSampler(dataset, seed=args.seed)  # disjoint batches, as in DDP
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    if rank == 0:
        print(f"{world_size} ranks x {args.batch_size} samples = global batch {world_size * args.batch_size}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # without it, every epoch repeats epoch 0's order
        total, steps = torch.zeros((), device=device), 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.mse_loss(model(x), y)  # all-gathers each block's weights, then frees them
            optimizer.zero_grad()
            loss.backward()  # reduce-scatters: each rank gets the averaged gradient of its slice
            # The norm of the whole gradient, although each rank holds a slice: the gradients
            # are DTensors, and the norm of a DTensor sums the slices' squares over the ranks.
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
            optimizer.step()  # each rank updates only its own slice
            total += loss.detach()
            steps += 1
        dist.all_reduce(total, op=dist.ReduceOp.AVG)  # the global batch's loss, as in DDP
        if rank == 0:
            print(f"epoch {epoch}: mean loss {total.item() / steps:.6f}")

    # Gathering the full weights is a collective: every rank calls it and joins each tensor's
    # all-gather. With cpu_offload only rank 0 keeps the gathered tensors, copied to the CPU,
    # so no GPU keeps a second full copy.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if rank == 0:
        torch.save(state, args.out)  # the same keys and shapes as train_single.py's
        print(f"saved {args.out}")
    dist.barrier()  # leave together, as in train_ddp.py
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
