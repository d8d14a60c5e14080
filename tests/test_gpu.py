"""What ``choose_backend`` promises, on CUDA devices: ``backend="auto"`` gives each rank the group
``"cpu:gloo,cuda:nccl"`` and its own GPU when there is one GPU per rank (NCCL for CUDA tensors,
Gloo for CPU tensors, both on the one group), Gloo on CPU ranks when there are fewer GPUs than
ranks, and ``backend="nccl"`` only with one GPU per rank. Skipped without CUDA; the whole GPU
path end to end is ``python -m dpcourse.gpu_check``."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc
from dpcourse.pool.errors import ClusterError
from dpcourse.backends import GPU_BACKEND, rank_device, uses_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def gpus() -> int:
    return torch.cuda.device_count()


def placement():
    rank, n = dist.get_rank(), dist.get_world_size()
    on_gpu = torch.full((4,), float(rank + 1), device=f"cuda:{torch.cuda.current_device()}")
    dist.all_reduce(on_gpu)  # NCCL
    on_cpu = torch.full((2,), float(rank + 1))
    dist.all_reduce(on_cpu)  # Gloo, on the same group
    return dist.get_backend(), torch.cuda.current_device(), str(on_gpu.device), on_gpu, on_cpu


def test_auto_gives_one_gpu_per_rank_with_nccl_and_gloo_on_one_group():
    world_size = min(gpus(), 8)
    with dpc.Cluster(world_size=world_size, backend="auto") as cluster:
        assert cluster.backend == GPU_BACKEND == "cpu:gloo,cuda:nccl"
        out = cluster.run(placement)
        assert cluster.status().ranks[0].device == "cuda:0"
    total = world_size * (world_size + 1) / 2
    for rank, (backend, device, where, on_gpu, on_cpu) in enumerate(out):
        assert uses_cuda(backend) and "gloo" in str(backend)
        assert device == rank and where == f"cuda:{rank}"
        # results come back to the kernel on the CPU
        assert on_gpu.device.type == "cpu" and torch.equal(on_gpu, torch.full((4,), total))
        assert torch.equal(on_cpu, torch.full((2,), total))


def test_auto_with_more_ranks_than_gpus_is_gloo_on_cpu():
    with dpc.Cluster(world_size=gpus() + 1, backend="auto") as cluster:
        assert cluster.backend == "gloo"
        assert cluster.run(lambda: (dist.get_backend(), str(rank_device()))) == \
            [("gloo", "cpu")] * (gpus() + 1)


def test_nccl_needs_one_gpu_per_rank():
    with pytest.raises(ClusterError, match="needs one CUDA device per rank"):
        dpc.Cluster(world_size=gpus() + 1, backend="nccl")


def test_ranks_cell_device_is_the_rank_gpu():
    with dpc.Cluster(world_size=1, backend="nccl") as cluster:
        assert cluster.backend == "nccl"
        assert cluster.run_cell("str(device)") == ["cuda:0"]
