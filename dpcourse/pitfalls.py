"""Common data-parallel pitfalls, each as a bug and its fix, run on real ranks.

Every public function here runs on every rank (``cluster.run(dpc.pitfalls.f, ...)``) and
returns plain observations (lists, numbers, error texts) for the kernel to print and check;
the ``*_single_process`` functions are the one-process references the parallel runs must
reproduce. Sizes are tiny: each call takes well under a second on two CPU ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from . import models
from .train import TrainConfig, parallel, runner


def _first_lines(err: BaseException, n: int = 1, width: int = 110) -> list[str]:
    lines = f"{type(err).__name__}: {err}".strip().splitlines()
    return [line.strip()[:width] for line in lines[:n]]


# 1. set_epoch ------------------------------------------------------------------------
def sampler_indices(set_epoch: bool, epochs: int = 2, num_samples: int = 8) -> list[list[int]]:
    """The dataset indices (sample numbers) this rank's DistributedSampler yields, per epoch."""
    sampler = DistributedSampler(range(num_samples), shuffle=True, seed=0)
    seen = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)  # the shuffle is seeded with seed + epoch
        seen.append(list(sampler))
    return seen


# 2. logging and saving on every rank -------------------------------------------------------
def log_and_save(path: str, rank0_only: bool) -> dict:
    """Log one line and save a checkpoint to ``path``, on every rank or on rank 0 only.

    Returns the lines this rank logged, whether it wrote the file, and (fix only) the number
    of tensors it read back after the barrier.
    """
    rank = dist.get_rank()
    model = models.build_model("mlp")
    writer = rank == 0 or not rank0_only
    logged = []
    if writer:
        logged.append(f"epoch 0 done, saving {len(model.state_dict())} tensors")
        print(logged[-1])
        torch.save(model.state_dict(), path)  # every writer truncates and rewrites one file
    if not rank0_only:
        return {"logged": logged, "wrote": writer, "read_back": None}
    dist.barrier()  # nobody reads the checkpoint before rank 0 has finished writing it
    state = torch.load(path, weights_only=True)
    return {"logged": logged, "wrote": writer, "read_back": len(state)}


# 3. saving the DDP wrapper instead of model.module -----------------------------------------
def save_ddp_state(path: str, unwrap: bool) -> dict:
    """Rank 0 saves a DDP model's state dict (``model`` or ``model.module``); every rank
    then loads it into the plain model. Returns the first saved key and the load error."""
    model = DDP(models.build_model("mlp"))
    if dist.get_rank() == 0:
        torch.save((model.module if unwrap else model).state_dict(), path)
    dist.barrier()
    state = torch.load(path, weights_only=True)
    plain = models.build_model("mlp", seed=1)
    try:
        plain.load_state_dict(state)
        error = None
    except RuntimeError as err:
        error = _first_lines(err, 2)
    return {"first_key": next(iter(state)), "error": error}


# 4. different initial weights without a broadcast --------------------------------------
def sync_module_states_error() -> str | None:
    """What FSDP1's own fix, ``sync_module_states=True``, says on CPU parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    try:
        FSDP(models.build_model("mlp"), device_id=torch.device("cpu"), sync_module_states=True)
    except ValueError as err:
        return _first_lines(err, 1, 300)[0]
    return None


def train_from_rank_seeds(cfg: TrainConfig, broadcast: bool) -> dict:
    """Train as ``dpc.train.train`` would, but with each rank's model seeded with
    ``cfg.seed + rank``: the bug.

    cfg.strategy: "ddp" or "fsdp" (FSDP1); broadcast: copy rank 0's weights first
    (``dpc.train.parallel.broadcast_module``), the fix. Returns the sum of this rank's
    initial weights and the global-batch loss per step.
    """
    if cfg.strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy {cfg.strategy!r}: this demo covers 'ddp' and 'fsdp' (FSDP1)")
    device = torch.device("cpu")
    cfg.validate(dist.get_world_size(), device.type)
    model = models.build_model(cfg.model, seed=cfg.seed + dist.get_rank(), **cfg.model_sizes)  # the bug
    initial_sum = sum(p.sum().item() for p in model.parameters())
    if broadcast:
        parallel.broadcast_module(model)
    if cfg.strategy == "ddp":
        model = parallel.apply_ddp(model, device, cfg)  # DDP broadcasts rank 0's weights here
    else:
        model = parallel.apply_fsdp(model, device, cfg, models.wrap_classes(cfg.model))
    optimizer = runner.make_optimizer(cfg, model.parameters())
    sampler, loader = runner.make_loader(cfg, dist.get_rank(), dist.get_world_size())
    losses = []
    for _, (x, y) in runner.batches(loader, sampler, 0, cfg.steps):
        loss = models.loss_fn(cfg.model, model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the global batch's loss
        losses.append(loss.item())
    return {"initial_sum": initial_sum, "losses": losses}


# 5. unused parameters ----------------------------------------------------------------------
class TwoHeads(nn.Module):
    """A trunk and two heads; ``forward`` uses only head ``a`` (head ``b`` is unused)."""

    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x):
        return self.a(torch.relu(self.trunk(x)))


def _global_batch(step: int, world_size: int, per_rank: int = 4):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(per_rank * world_size, 4, generator=g)
    return x, x.sum(1, keepdim=True)


def train_two_heads(find_unused_parameters: bool, steps: int = 3) -> dict:
    """DDP-train ``TwoHeads`` with SGD; returns the global-batch losses and the first line
    of DDP's error (None if it trained), plus whether head b ever got a gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(TwoHeads(), find_unused_parameters=find_unused_parameters)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    losses, error = [], None
    for step in range(steps):
        x, y = (t.chunk(world)[rank] for t in _global_batch(step, world))
        try:
            loss = nn.functional.mse_loss(model(x), y)
        except RuntimeError as err:  # raised by DDP at the start of the next forward
            error = _first_lines(err)[0].split(". ")[0] + "."
            break
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the global batch's loss
        losses.append(loss.item())
    return {"losses": losses, "error": error, "b_grad": model.module.b.weight.grad is not None}


def train_two_heads_single_process(world_size: int, steps: int = 3) -> list[float]:
    """The reference: the same model and global batches in one process; losses per step."""
    torch.manual_seed(0)
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    losses = []
    for step in range(steps):
        x, y = _global_batch(step, world_size)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# 6. uneven inputs --------------------------------------------------------------------------
def train_uneven(fix: str | None, num_samples: int = 9, batch_size: int = 2) -> dict:
    """DDP-train on a dataset of ``num_samples`` split between the ranks.

    fix: None shards by hand (``dataset[rank::world_size]``), so rank 0 gets one batch more
    and waits forever in that batch's all-reduce; "drop_last" uses
    ``DistributedSampler(drop_last=True)`` (equal shares); "join" keeps the uneven shards
    under DDP's ``Join`` context manager. Returns this rank's batch count and weight sum.
    """
    from torch.distributed.algorithms import Join

    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = models.make_dataset("mlp", num_samples)
    if fix == "drop_last":
        loader = DataLoader(dataset, batch_size=batch_size,
                            sampler=DistributedSampler(dataset, shuffle=False, drop_last=True))
    else:
        loader = DataLoader(Subset(dataset, range(rank, num_samples, world)), batch_size=batch_size)
    model = DDP(models.build_model("mlp"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 0
    # Join: a rank that runs out of data keeps answering the others' all-reduces with zeros.
    with Join([model], enable=fix == "join"):
        for x, y in loader:
            models.loss_fn("mlp", model(x), y).backward()  # the all-reduce of gradients
            optimizer.step()
            optimizer.zero_grad()
            batches += 1
    return {"batches": batches, "weight_sum": sum(p.sum().item() for p in model.parameters())}


# 8. BatchNorm vs SyncBatchNorm -------------------------------------------------------------
class _AllReduceSum(torch.autograd.Function):
    """all_reduce(SUM) whose backward all-reduces the gradient: every rank's statistics
    depend on every rank's inputs, so the gradient flows back to all of them."""

    @staticmethod
    def forward(ctx, tensor):
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def sync_batch_norm(x: torch.Tensor, bn: nn.BatchNorm1d) -> torch.Tensor:
    """Training-mode BatchNorm over the global batch: one all-reduce of (count, sum, sum of
    squares) per feature, then the usual affine normalisation. Updates ``bn``'s running stats.

    (SyncBatchNorm gathers per-rank mean and inverse std instead, which is numerically
    safer for large activations; the result is the same.)
    """
    if bn.momentum is None:
        raise ValueError("sync_batch_norm needs a BatchNorm with a float momentum; "
                         "momentum=None (cumulative average) is not supported")
    c = x.shape[1]
    stats = _AllReduceSum.apply(torch.cat([x.sum(0), (x * x).sum(0), x.new_tensor([x.shape[0]])]))
    n = stats[-1]
    mean = stats[:c] / n
    var = stats[c:2 * c] / n - mean * mean  # biased: what BatchNorm normalises with
    with torch.no_grad():  # running_var is unbiased, as in nn.BatchNorm1d
        bn.running_mean.lerp_(mean, bn.momentum)
        bn.running_var.lerp_(var * n / (n - 1), bn.momentum)
    return (x - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias


def _bn_batch(world_size: int, per_rank: int = 4, features: int = 3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(per_rank * world_size, features, generator=g) * 2 + 1
    return x, torch.randn(x.shape, generator=g)  # inputs, a fixed weighting for the loss


def _bn_step(bn_forward, bn: nn.BatchNorm1d, x, w) -> dict:
    x = x.clone().requires_grad_(True)
    out = bn_forward(x)
    (out * w).sum().backward()  # a loss summed over the global batch
    return {"mean": bn.running_mean.clone(), "var": bn.running_var.clone(), "out": out.detach(),
            "x_grad": x.grad}


def _batchnorm(features: int) -> nn.BatchNorm1d:
    # momentum=1.0: after one step the running statistics are exactly the statistics the
    # layer normalised with (running_var unbiased), so they can be shown and compared.
    return nn.BatchNorm1d(features, momentum=1.0)


def batchnorm_step(mode: str) -> dict:
    """One training-mode BatchNorm1d forward/backward on this rank's slice of a global batch.

    mode: "local" (plain BatchNorm, per-rank statistics), "sync_batchnorm"
    (``nn.SyncBatchNorm.convert_sync_batchnorm``) or "all_reduce" (``sync_batch_norm``).
    Returns the per-feature mean and (unbiased) variance the layer normalised with, and the
    outputs and input gradients of this rank's rows -- or SyncBatchNorm's refusal, "error".
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    x, w = (t.chunk(world)[rank] for t in _bn_batch(world))
    bn = _batchnorm(x.shape[1])
    if mode == "sync_batchnorm":
        sync_bn = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(bn))
        try:
            return _bn_step(sync_bn, sync_bn[0], x, w)
        except ValueError as err:  # torch checks the device before any collective
            return {"error": _first_lines(err)[0]}
    forward = bn if mode == "local" else (lambda t: sync_batch_norm(t, bn))
    return _bn_step(forward, bn, x, w)


def batchnorm_step_single_process(world_size: int) -> dict:
    """The reference: plain BatchNorm1d on the whole global batch in one process."""
    x, w = _bn_batch(world_size)
    bn = _batchnorm(x.shape[1])
    return _bn_step(bn, bn, x, w)
