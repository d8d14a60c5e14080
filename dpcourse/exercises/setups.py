"""What exercises B and C share: a learner's wrapping trained on the ranks by the course's one
training loop (``dpc.train.train`` with ``wrap=``) under the course's observers, the same
training in one process, and a prediction judged without printing the value it is judged
against.

The learner writes ``wrap(model) -> model`` functions (DDP, FSDP1 or FSDP2 lines); the runner
calls them on every rank on a fresh MLP that already sits on the rank's device. Nothing of
the learner's runs in the kernel.
"""
from __future__ import annotations

from ..train import TrainConfig, train, train_single_process

STEPS, BATCH, LR = 3, 8, 1e-3   # Adam steps, samples per rank per step, learning rate
WEIGHTS_ATOL = 1e-5            # fp32 data parallelism reproduces one process to float rounding


def config(sizes: dict, world_size: int, steps: int = STEPS) -> TrainConfig:
    return TrainConfig(model="mlp", model_sizes=dict(sizes), batch_size=BATCH, steps=steps, optimizer="adam",
                       lr=LR, num_samples=BATCH * steps * world_size, progress=False)


def train_wrapped(wrap, sizes: dict, steps: int = STEPS):
    """On each rank: the runner's training of the MLP, wrapped by the learner's ``wrap``.
    Returns the full weights (on rank 0; None elsewhere) and the API the wrapping used:
    "fsdp2", "fsdp1" or "other"."""
    import torch.distributed as dist

    def checked(model):
        wrapped = wrap(model)
        if not hasattr(wrapped, "parameters"):
            raise TypeError(f"the wrap function returned a {type(wrapped).__name__}, not the wrapped model: "
                            "end it with `return model` (or the wrapper it built)")
        return wrapped

    metrics = train(config(sizes, dist.get_world_size(), steps), full_state=True, wrap=checked)
    applied = metrics["applied"]
    api = ("fsdp1" if applied.startswith("FullyShardedDataParallel") else
           "fsdp2" if applied.startswith("FSDP") else "other")
    return {"weights": metrics["state"], "api": api}


def one_process(sizes: dict, world_size: int, steps: int = STEPS) -> dict:
    """The same training in this process, on the whole global batches."""
    return train_single_process(config(sizes, world_size, steps), world_size)["state"]


def weights_verdict(results: list[dict], reference: dict) -> tuple[bool, str]:
    """Do rank 0's full weights equal one process's? (keys must be the plain model's)"""
    weights = results[0]["weights"]
    missing = sorted(set(reference) - set(weights))
    if missing:
        return False, f"the trained model has no {missing[0]!r}: did the wrap function return the model it wrapped?"
    diff = max((weights[k].float().cpu() - reference[k]).abs().max().item() for k in reference)
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
