"""4.2d's try-it ``sync_batchnorm``: BatchNorm with the global batch's statistics, under DDP. Its
set-up on the ranks, its items and the mistakes it names."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import backends, torch_private
from ...grading.compare import close
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from ...patching import patched
from .pitfalls import ATOL, RTOL, ready

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
    with patched(torch, **_KERNELS), torch_private.sync_batchnorm_accepts_cpu():
        yield


def _copy(t):
    return t.detach().to("cpu", copy=True)


@contextlib.contextmanager
def _exact_float32():
    """On a GPU: convolutions in full float32 (cuDNN would use TF32), to compare with a CPU."""
    with patched(torch.backends.cudnn, allow_tf32=False), patched(torch.backends.cuda.matmul, allow_tf32=False):
        yield


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


def one_process(world: int):
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
        if all(close(r["running"][name], everyone, RTOL, ATOL) for r in got):   # (mean, variance) each
            continue
        own = [_running_of(i) for i in inputs]
        if all(close(r["running"][name], o, RTOL, ATOL) for r, o in zip(got, own)):
            per_rank.append(_name(name))
        else:
            other.append(_name(name))
    return per_rank, other


@try_it("sync_batchnorm", "4.2d", "BatchNorm with the global batch's statistics, under DDP")
@on_ranks(_prepare_on_rank, "each BatchNorm layer normalises with the statistics of the global batch",
          "outputs equal one process's on the global batch",
          "one training step equals one process's step on the global batch", timeout=BN_TIMEOUT, warm_up=ready)
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
    want_out, want_w = one_process(world)
    outs = torch.cat([r["out"] for r in got])
    if outs.shape == want_out.shape and close(outs, want_out, RTOL, ATOL):
        report.add(out_name, True)
    else:
        gap = (outs - want_out).abs().max().item() if outs.shape == want_out.shape else float("nan")
        report.add(out_name, False, f"the ranks' outputs, side by side, differ from it by up to {gap:.2g}: "
                                    "a layer that normalises a rank's samples alone gives each sample another output")
    weights = [r["weights"] for r in got]
    same_everywhere = all(close(w, weights[0], RTOL, ATOL) for w in weights[1:])
    if all(close(w, want_w, RTOL, ATOL) for w in weights):
        report.add(step_name, True)
    elif not same_everywhere:
        report.add(step_name, False, "after one step the ranks' weights differ: each rank stepped with "
                                     "the gradient of its own samples. What averages the gradients over "
                                     "the ranks before the step?")
    else:
        report.add(step_name, False, "the ranks agree, but not with one process: the gradient came "
                                     "through statistics that were not the global batch's")
