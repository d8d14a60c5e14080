"""Exercise B, reference solution: the two set-ups, and the formulas of the memory ledger and
of the per-step traffic, written before anything runs (float32, Adam, a bandwidth-optimal
ring)."""
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap_ddp(model):
    return DDP(model)  # rank 0's weights broadcast; gradients all-reduced in backward


def wrap_fsdp(model):
    for block in model.blocks:  # one unit per block ...
        fully_shard(block)      # reshard_after_forward=True: FULL_SHARD
    return fully_shard(model)   # ... then the root


def held(units, world_size, setup):
    """Bytes one rank holds right after optimizer.step()."""
    P = sum(units)                                   # parameters of the whole model
    share = P / world_size if setup == "fsdp" else P  # FULL_SHARD keeps 1/N of everything
    return {"parameters": 4 * share,                 # float32
            "gradients": 4 * share,                  # one float32 gradient per parameter
            "optimizer_state": 8 * share}            # Adam: two moments per parameter


def sent_per_step(units, world_size, setup):
    """Bytes one rank sends in one training step."""
    psi, N = 4 * sum(units), world_size  # psi: bytes of all parameters (and of all gradients)
    ring = (N - 1) / N                   # a ring phase: each rank sends all but its own 1/N
    if setup == "ddp":
        return 2 * ring * psi            # one all-reduce: a reduce-scatter, then an all-gather
    root = 4 * units[-1]                 # the root unit stays gathered from forward to backward
    return ring * (psi + (psi - root) + psi)  # gather for forward, again for backward, reduce-scatter


predicted = {"held": held, "sent_per_step": sent_per_step}
