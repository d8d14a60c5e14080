"""What exercises B and C share: a learner's wrapping trained on the ranks under the course's
observers, the same training in one process, and a prediction judged without printing the
value it is judged against.

The learner writes ``wrap(model) -> model`` functions (DDP, FSDP1 or FSDP2 lines); the
checker calls them on every rank on a fresh MLP that already sits on the rank's device, and
trains the result with the loop below. Nothing of the learner's runs in the kernel.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import models

STEPS, BATCH, LR = 3, 8, 1e-3   # Adam steps, samples per rank per step, learning rate
WEIGHTS_ATOL = 1e-5            # fp32 data parallelism reproduces one process to float rounding


def rank_device() -> torch.device:
    if "nccl" in dist.get_backend():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def data(sizes: dict, world_size: int):
    return models.make_dataset("mlp", STEPS * BATCH * world_size, seed=3).tensors


def train_wrapped(wrap, sizes: dict):
    """On each rank: the MLP wrapped by the learner's ``wrap``, trained ``STEPS`` Adam steps on
    this rank's share of each global batch. Returns the full weights after it (on every
    rank) and the API the wrapping used: "fsdp2", "fsdp1" or "other"."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    rank, n, device = dist.get_rank(), dist.get_world_size(), rank_device()
    model = wrap(models.build_model("mlp", seed=0, **sizes).to(device))
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the wrap function returned a {type(model).__name__}, not the wrapped model: "
                        "end it with `return model` (or the wrapper it built)")
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = data(sizes, n)
    for step in range(STEPS):
        rows = slice((step * n + rank) * BATCH, (step * n + rank + 1) * BATCH)
        F.mse_loss(model(x[rows].to(device)), y[rows].to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    api = ("fsdp2" if any(isinstance(m, FSDPModule) for m in model.modules()) else
           "fsdp1" if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()) else "other")
    return {"weights": {k: v.detach().cpu() for k, v in state.items()}, "api": api}


def one_process(sizes: dict, world_size: int) -> dict:
    """The same training in this process, on the whole global batches."""
    model = models.build_model("mlp", seed=0, **sizes)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = data(sizes, world_size)
    for step in range(STEPS):
        rows = slice(step * world_size * BATCH, (step + 1) * world_size * BATCH)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def weights_verdict(results: list[dict], reference: dict) -> tuple[bool, str]:
    """Do every rank's full weights equal one process's? (keys must be the plain model's)"""
    weights = [r["weights"] for r in results]
    missing = sorted(set(reference) - set(weights[0]))
    if missing:
        return False, f"the trained model has no {missing[0]!r}: did the wrap function return the model it wrapped?"
    diff = max((w[k].float() - reference[k]).abs().max().item() for w in weights for k in reference)
    if diff <= WEIGHTS_ATOL:
        return True, f"largest difference {diff:.1e}"
    return False, (f"largest difference from one process {diff:.1e}: does the wrapping keep every rank's "
                   "weights equal, and average (not sum) the gradients?")


def miss(predicted, measured: float, tolerance: float) -> tuple[bool | None, str]:
    """A numeric prediction against a measurement, said without the measured value: within
    ``tolerance`` (relative), or too high / too low and roughly by how much."""
    if predicted is ... or predicted is None:
        return None, "no prediction yet"
    if isinstance(predicted, bool) or not isinstance(predicted, (int, float)):
        return False, f"a number of bytes, please, not {predicted!r}"
    if measured == 0:
        return predicted == 0, "" if predicted == 0 else "too high: nothing of it was measured"
    ratio = predicted / measured
    if abs(ratio - 1) <= tolerance:
        return True, f"within {tolerance:.0%}"
    way = "too high" if ratio > 1 else "too low"
    factor = ratio if ratio > 1 else 1 / ratio
    if factor < 1.2:
        size = "by less than 20 %"
    elif factor < 1.75:
        size = "by 20 % to 75 %"
    else:
        size = f"by a factor of about {round(factor)}"
    return False, f"{way} {size}"
