"""Exercise B, reference solution: the two set-ups, and predictions derived from the ledger's
formulas before anything runs (P parameters, N = 2 ranks, float32, Adam)."""
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import dpcourse as dpc


def wrap_ddp(model):
    return DDP(model)  # rank 0's weights broadcast; gradients all-reduced in backward


def wrap_fsdp(model):
    for block in model.blocks:  # one unit per block ...
        fully_shard(block)      # reshard_after_forward=True: FULL_SHARD
    return fully_shard(model)   # ... then the root


P = sum(p.numel() for p in dpc.models.build_model("mlp", d_hidden=128, depth=4).parameters())
N, psi = 2, 4 * P  # psi: bytes of the float32 gradients
predicted = {
    "ddp": {"parameters": 4 * P, "gradients": 4 * P, "optimizer_state": 8 * P,  # Adam: two moments
            "sent_per_step": 2 * (N - 1) / N * psi},                         # one all-reduce
    "fsdp": {"parameters": 4 * P / N, "gradients": 4 * P / N, "optimizer_state": 8 * P / N,
             "sent_per_step": 3 * (N - 1) / N * psi},  # gather, gather again, reduce-scatter
}
faster = "ddp"  # on CPU processes: one or two all-reduces against a gather per unit, twice, and a scatter
