"""4.2d's try-its: two pitfalls fixed by the learner (checked on the notebook's ranks).

* ``sync_batchnorm``: a CNN with two BatchNorm layers prepared for DDP so that every layer
  normalises with the global batch's statistics. Judged on the ranks, on uneven per-rank
  batches: each layer's running statistics against those of the inputs all ranks fed it,
  the outputs and one training step against one process on the global batch.
* ``join``: DDP training through uneven numbers of batches per rank. Judged: it finishes
  (a hang is reported within ``JOIN_TIMEOUT``), each rank's optimizer steps, and the final
  weights against a simulation, in one process, of what DDP's join hook does.

SyncBatchNorm on a CPU: this PyTorch runs it on accelerators only. Its forward refuses a CPU
input, DDP refuses to wrap it on a CPU, and the five kernels its autograd function calls
(``torch.batch_norm_stats`` and the rest) have no CPU implementation. For the length of the
learner's call and the check's forward and backward, on the ranks only,
``_sync_batchnorm_on_cpu`` lifts the two refusals and gives the kernels CPU implementations
written from their CUDA definitions; PyTorch's own
``SyncBatchNorm`` module, ``convert_sync_batchnorm`` and autograd function
(``torch/nn/modules/_functions.py``) run unchanged, with its all_gather and all_reduce on
Gloo. The ground truth never goes through them: plain BatchNorm in one process. Ranks with
GPUs under NCCL (``backends.rank_device``) run the model there, SyncBatchNorm as it is.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import backends, models, torch_private
from ..ranks import RankFailure
from ..report import Report
from . import on_ranks, try_it

RTOL, ATOL = 1e-4, 1e-5


def _close(a, b) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)


def _ready() -> bool:
    """The warm-up of these checks: every rank imports this module, Join and what DDP imports
    when it first wraps a model, before a call is timed -- on a fresh rank (the first check, or
    one after a failure restarted the ranks) that takes seconds, longer than a short hang timeout."""
    from torch.distributed.algorithms import Join  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel(torch.nn.Linear(1, 1))   # the first one imports torch._dynamo
    return True


# --------------------------------------------------------------------------- sync_batchnorm
BN_TIMEOUT = 20.0
BN_LR = 0.1


def _bn_sizes(world: int) -> list[int]:
    return [3 + 2 * r for r in range(world)]          # uneven: 3 and 5 images on 2 ranks


def _cnn() -> torch.nn.Sequential:
    """The model the learner prepares: two BatchNorm layers, one 2-d and one 1-d."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
            torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
            torch.nn.Linear(8, 1))


def _images(n: int):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 1, 4, 4, generator=g) * 2 + 1
    return x, x.mean((1, 2, 3)).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g)


_BATCHNORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def _is_bn(module) -> bool:
    return isinstance(module, _BATCHNORMS)


def _name(name: str) -> str:
    """``module.5`` (inside DDP) or ``5`` -> ``model[5]``."""
    return "model[" + name.removeprefix("module.") + "]"


# CPU versions of the CUDA kernels of SyncBatchNorm's autograd function (aten/src/ATen/native/
# cuda/Normalization.cuh): per-channel statistics over every dimension but 1.
def _per_channel(t, like):
    return t.view(1, -1, *([1] * (like.dim() - 2)))


def _dims(x):
    return [0, *range(2, x.dim())]


def _stats(x, eps):
    return x.mean(_dims(x)), torch.rsqrt(x.var(_dims(x), unbiased=False) + eps)


def _gather_stats(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    c = counts.to(mean_all.dtype).view(-1, 1)
    n = c.sum()
    mean = (c * mean_all).sum(0) / n
    var = (c * (invstd_all.pow(-2) - eps + (mean_all - mean) ** 2)).sum(0) / n
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(momentum * mean)
    if running_var is not None:
        running_var.mul_(1 - momentum).add_(momentum * var * n / (n - 1))
    return mean, torch.rsqrt(var + eps)


def _elemt(x, weight, bias, mean, invstd, eps):
    out = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        out = out * _per_channel(weight, x)
    return out + _per_channel(bias, x) if bias is not None else out


def _backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    sum_dy = dy.sum(_dims(x))
    sum_dy_xmu = (dy * (x - _per_channel(mean, x))).sum(_dims(x))
    return (sum_dy, sum_dy_xmu, sum_dy_xmu * invstd if weight_g else None, sum_dy if bias_g else None)


def _backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    n = count.sum().to(dy.dtype)
    xmu = x - _per_channel(mean, x)
    grad = dy - _per_channel(sum_dy / n, x) - xmu * _per_channel(invstd ** 2 * sum_dy_xmu / n, x)
    scale = invstd if weight is None else invstd * weight
    return grad * _per_channel(scale, x)


_KERNELS = {"batch_norm_stats": _stats, "batch_norm_gather_stats_with_counts": _gather_stats,
            "batch_norm_elemt": _elemt, "batch_norm_backward_reduce": _backward_reduce,
            "batch_norm_backward_elemt": _backward_elemt}


@contextlib.contextmanager
def _sync_batchnorm_on_cpu():
    """SyncBatchNorm and DDP as on a GPU, on this rank's CPU, while the block runs: the two
    refusals lifted (``torch_private``), the five kernels given their CPU versions above."""
    real = {name: getattr(torch, name) for name in _KERNELS}
    for name, kernel in _KERNELS.items():
        setattr(torch, name, kernel)
    try:
        with torch_private.sync_batchnorm_accepts_cpu():
            yield
    finally:
        for name, kernel in real.items():
            setattr(torch, name, kernel)


def _copy(t):
    return t.detach().to("cpu", copy=True)


@contextlib.contextmanager
def _exact_float32():
    """On a GPU: convolutions in full float32 (cuDNN would use TF32), to compare with a CPU."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _prepare_on_rank(prepare):
    rank, world = dist.get_rank(), dist.get_world_size()
    device = backends.rank_device()   # the rank's GPU under NCCL: SyncBatchNorm as it is
    sizes = _bn_sizes(world)
    x, y = _images(sum(sizes))
    start = sum(sizes[:rank])
    x, y = x[start:start + sizes[rank]].to(device), y[start:start + sizes[rank]].to(device)
    seen = {}
    with _sync_batchnorm_on_cpu() if device.type == "cpu" else _exact_float32():
        model = prepare(_cnn().to(device))
        layers = [(n, m) for n, m in model.named_modules() if _is_bn(m)]
        for name, layer in layers:   # what each BatchNorm layer is given, in the forward
            layer.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(name, _copy(args[0])))
        model.train()
        out = model(x)
        running = {name: (_copy(m.running_mean), _copy(m.running_var)) for name, m in layers}
        # one SGD step on the global batch's mean loss: each rank's share of it, times the world
        # size, since DDP averages the ranks' gradients
        loss = F.mse_loss(out, y, reduction="sum") * world / sum(sizes)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= BN_LR * p.grad
    weights = {k.removeprefix("module."): _copy(v) for k, v in model.named_parameters()}
    return {"out": _copy(out), "seen": seen, "running": running, "weights": weights,
            "names": [n for n, _ in layers]}


def _one_process(world: int):
    """Plain BatchNorm in one process, on the global batch: outputs, one SGD step."""
    model = _cnn()
    x, y = _images(sum(_bn_sizes(world)))
    out = model(x)
    F.mse_loss(out, y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= BN_LR * p.grad
    return out.detach(), dict(model.named_parameters())


def _running_of(inputs):
    """The running statistics a fresh plain BatchNorm layer keeps after one forward on ``inputs``."""
    bn = (torch.nn.BatchNorm2d if inputs.dim() == 4 else torch.nn.BatchNorm1d)(inputs.shape[1])
    with torch.no_grad():
        bn(inputs)
    return bn.running_mean, bn.running_var


def _bn_statistics(got: list[dict], names: list[str]) -> tuple[list[str], list[str]]:
    """(the layers that normalised with one rank's samples only, those whose statistics are
    neither the global batch's nor one rank's); a layer with the global batch's is in neither."""
    per_rank = []
    other = []
    for name in names:
        if not all(name in r["seen"] for r in got):
            other.append(_name(name))
            continue
        inputs = [r["seen"][name] for r in got]
        everyone = _running_of(torch.cat(inputs))
        if all(_close(r["running"][name][0], everyone[0]) and _close(r["running"][name][1], everyone[1])
               for r in got):
            continue
        own = [_running_of(i) for i in inputs]
        if all(_close(r["running"][name][0], o[0]) and _close(r["running"][name][1], o[1]) for r, o in zip(got, own)):
            per_rank.append(_name(name))
        else:
            other.append(_name(name))
    return per_rank, other


@try_it("sync_batchnorm", "4.2d", "BatchNorm with the global batch's statistics, under DDP")
@on_ranks(_prepare_on_rank, "each BatchNorm layer normalises with the statistics of the global batch",
          "outputs equal one process's on the global batch",
          "one training step equals one process's step on the global batch", timeout=BN_TIMEOUT, warm_up=_ready)
def check_sync_batchnorm(report: Report, got: list, layers_name, out_name, step_name) -> None:
    world, sizes = len(got), _bn_sizes(len(got))
    names = got[0]["names"]
    per_rank, other = _bn_statistics(got, names)
    if len(names) < 2:
        report.add(layers_name, False, f"the model holds {len(names)} BatchNorm layer(s) after your function, "
                                       "it was given 2: was a layer replaced by something else?")
    elif not per_rank and not other:
        report.add(layers_name, True)
    elif per_rank:
        which = " and ".join(per_rank)
        report.add(layers_name, False,
                   f"{which} normalised each rank's batch with that rank's own mean and variance "
                   f"({', '.join(f'rank {r}: {n} samples' for r, n in enumerate(sizes))}, of the global "
                   f"batch's {sum(sizes)}): what must the ranks share for a layer to see the whole batch?"
                   + (f" ({' and '.join(other)}: neither statistics.)" if other else ""))
    else:
        report.add(layers_name, False, f"the running statistics of {' and '.join(other)} are neither the "
                                       "global batch's nor one rank's: did the layer run once, in training mode?")
    want_out, want_w = _one_process(world)
    outs = torch.cat([r["out"] for r in got])
    if outs.shape == want_out.shape and _close(outs, want_out):
        report.add(out_name, True)
    else:
        gap = (outs - want_out).abs().max().item() if outs.shape == want_out.shape else float("nan")
        report.add(out_name, False, f"the ranks' outputs, side by side, differ from it by up to {gap:.2g}: "
                                    "a layer that normalises a rank's samples alone gives each sample another output")
    weights = [r["weights"] for r in got]
    same_everywhere = all(_same_weights(w, weights[0]) for w in weights[1:])
    if all(_same_weights(w, want_w) for w in weights):
        report.add(step_name, True)
    elif not same_everywhere:
        report.add(step_name, False, "after one step the ranks' weights differ: each rank stepped with "
                                     "the gradient of its own samples. What averages the gradients over "
                                     "the ranks before the step?")
    else:
        report.add(step_name, False, "the ranks agree, but not with one process: the gradient came "
                                     "through statistics that were not the global batch's")


# ------------------------------------------------------------------------------------- join
JOIN_TIMEOUT = 6.0        # a correct call takes well under a second; a hang is reported after this
JOIN_LR, JOIN_BATCH = 0.1, 4


def _join_counts(world: int) -> list[int]:
    return [2 + 2 * r for r in range(world)]       # rank 0: 2 batches, rank 1: 4


def _join_batches(world: int):
    """Every rank's batches: [[(x, y), ...] for each rank]."""
    counts = _join_counts(world)
    x, y = models.make_dataset("mlp", sum(counts) * JOIN_BATCH).tensors
    out, start = [], 0
    for c in counts:
        out.append([(x[i:i + JOIN_BATCH], y[i:i + JOIN_BATCH])
                    for i in range(start, start + c * JOIN_BATCH, JOIN_BATCH)])
        start += c * JOIN_BATCH
    return out


def _join_on_rank(train):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _join_batches(world)[rank]
    model = DDP(models.build_model("mlp", seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=JOIN_LR)
    steps = [0]
    optimizer.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    train(model, optimizer, batches)
    return {"steps": steps[0], "batches": len(batches),
            "weights": {k: v.detach().clone() for k, v in model.module.named_parameters()}}


def _simulate_join(world: int, divide_by_initial_world_size: bool = True):
    """One process: the ranks' uneven training under DDP's join. While a rank has batches left
    it steps with the sum of the gradients of the ranks that still have one (a rank that ran out
    answers DDP's all-reduces with zeros) divided by the initial world size (or, with
    ``divide_by_initial_world_size=False``, by the number of ranks still training); at the end
    every rank receives the weights of the last rank to finish."""
    batches = _join_batches(world)
    model = models.build_model("mlp", seed=0)
    for s in range(max(len(b) for b in batches)):
        active = [b[s] for b in batches if s < len(b)]
        total = [torch.zeros_like(p) for p in model.parameters()]
        for x, y in active:
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            total = [t + p.grad for t, p in zip(total, model.parameters())]
        with torch.no_grad():
            for p, g in zip(model.parameters(), total):
                p -= JOIN_LR * g / (world if divide_by_initial_world_size else len(active))
    return dict(model.named_parameters())


def _join_failure(got: RankFailure, world_size: int) -> str:
    """What a join call that failed did: hung on uneven batches, called a hook of the wrong object, or else."""
    if got.kind == "hang":
        where = f" ({got.summary})" if got.summary else ""
        shares = ", ".join(f"rank {r} {n}" for r, n in enumerate(_join_counts(world_size)))
        return (f"the ranks did not finish within {JOIN_TIMEOUT:g} s{where}. Batches per rank: "
                f"{shares}. Each backward all-reduces the gradients, "
                "so the ranks issue different numbers of all-reduces, and a rank with batches left "
                "waits for a partner that has stopped. What can answer its all-reduces once a "
                "rank has run out?")
    if "join_hook" in got.summary or "joinable" in got.summary:
        return (f"{got.summary} -- the join context calls a hook of each object it is given, to "
                "answer that object's collectives for a rank that has run out: which object here "
                "issues the all-reduces?")
    return got.describe(JOIN_TIMEOUT)


@try_it("join", "4.2d", "DDP through uneven batches per rank, averaged over the ranks still training")
@on_ranks(_join_on_rank, "each rank takes one optimizer step per batch of its own",
          "the final weights are equal on every rank",
          "the final weights equal one process's training on every rank's batches, each step averaged over "
          "the ranks still training",
          timeout=JOIN_TIMEOUT, runs="runs on every rank and finishes", warm_up=_ready, describe=_join_failure)
def check_join(report: Report, got: list, steps_name, equal_name, want_name) -> None:
    short = [f"rank {r} took {x['steps']} steps for its {x['batches']} batches" for r, x in enumerate(got)
             if x["steps"] != x["batches"]]
    if not short:
        report.add(steps_name, True)
    else:
        skipped = any(x["steps"] < x["batches"] for x in got)
        report.add(steps_name, False, "; ".join(short) + (
            ": its last batches were never trained on. Stopping where the shortest rank stops keeps "
            "the ranks in step, at the price of samples: what lets a rank go on alone?" if skipped
            else ": one step per batch is the loop asked for"))
    weights = [x["weights"] for x in got]
    if all(_same_weights(w, weights[0]) for w in weights[1:]):
        report.add(equal_name, True)
    else:
        report.add(equal_name, False, "the ranks end with different weights: their gradients were not "
                                      "averaged at every step, or the replicas were not made equal at the end")
    by_active, diluted = _simulate_join(len(got), False), _simulate_join(len(got))
    if all(_same_weights(w, by_active) for w in weights):
        report.add(want_name, True)
    elif all(_same_weights(w, diluted) for w in weights):
        report.add(want_name, False, f"the steps after rank 0 ran out were divided by all {len(got)} ranks, "
                                     "the finished ranks counting as zeros: those steps came out smaller than "
                                     "the batches' mean. What tells the join hook to average over the ranks "
                                     "still training?")
    elif short:
        report.add(want_name, False, "they differ from it: some ranks' batches were left out")
    else:
        report.add(want_name, False, "they differ from it: was each step's gradient this batch's alone "
                                     "(nothing left over from the batches before), averaged over the ranks "
                                     "still training?")
