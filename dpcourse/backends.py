"""Which torch.distributed backend a rank uses, and on which device its tensors live.

One rule for the whole package (the pool, the training runner, the experiments):
with one CUDA device per rank, ranks get the process group ``"cpu:gloo,cuda:nccl"`` --
NCCL for CUDA tensors, Gloo for the CPU tensors that helpers and learners also pass to
collectives (NCCL serves CUDA tensors only). Without enough GPUs, Gloo on CPU processes.
"""
from __future__ import annotations

BACKENDS = ("auto", "gloo", "nccl")
GPU_BACKEND = "cpu:gloo,cuda:nccl"


class BackendError(ValueError):
    """A backend was asked for that this machine cannot serve, or does not exist."""


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(backend: str, world_size: int, gpus: int | None = None) -> str:
    """The process-group backend for ``world_size`` ranks on a machine with ``gpus`` GPUs.

    "auto": ``"cpu:gloo,cuda:nccl"`` with one GPU per rank, else "gloo". "nccl" (NCCL only,
    CUDA tensors only) needs one GPU per rank. ``gpus`` defaults to this machine's count.
    """
    if backend not in BACKENDS:
        raise BackendError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    gpus = gpu_count() if gpus is None else gpus
    if backend == "auto":
        return GPU_BACKEND if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise BackendError(
            f"backend='nccl' needs one CUDA device per rank: world_size={world_size} but this "
            f"machine has {gpus}. Use backend='gloo' (CPU ranks) or world_size<={gpus}.")
    return backend


def uses_cuda(backend: str) -> bool:
    """True when ``backend`` (a name or a "device:backend,..." string) includes NCCL."""
    return "nccl" in str(backend)


def rank_device():
    """``cuda:<current device>`` when the default process group has NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and uses_cuda(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
