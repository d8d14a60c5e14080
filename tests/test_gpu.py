"""NCCL ranks on CUDA devices: device placement and results moved to the CPU. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def placement():
    t = torch.full((4,), float(dist.get_rank() + 1), device=f"cuda:{torch.cuda.current_device()}")
    dist.all_reduce(t)
    return dist.get_backend(), torch.cuda.current_device(), str(t.device), t


def test_nccl_ranks_one_per_gpu():
    world_size = torch.cuda.device_count()
    with dpc.Cluster(world_size=world_size, backend="auto") as cluster:
        assert cluster.backend == "nccl"
        out = cluster.run(placement)
    total = world_size * (world_size + 1) / 2
    for rank, (backend, device, where, t) in enumerate(out):
        assert backend == "nccl" and device == rank and where == f"cuda:{rank}"
        assert t.device.type == "cpu" and torch.equal(t, torch.full((4,), total))


def test_ranks_cell_device_is_the_rank_gpu():
    with dpc.Cluster(world_size=1, backend="nccl") as cluster:
        assert cluster.run_cell("str(device)") == ["cuda:0"]
