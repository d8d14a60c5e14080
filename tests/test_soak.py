"""200 consecutive calls, some of them failing, leak no processes, descriptors or ports."""
from __future__ import annotations

import os

import psutil
import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc

pytestmark = pytest.mark.timeout(240)


def _tcp_connections(pids) -> int:
    return sum(len(psutil.Process(p).net_connections("tcp")) for p in pids)


def _census(cluster):
    ranks = cluster.pids
    return {
        "kernel fds": len(os.listdir("/proc/self/fd")),
        "processes": len(psutil.Process().children(recursive=True)),
        "rank fds": sorted(len(os.listdir(f"/proc/{p}/fd")) for p in ranks),
        "tcp connections": _tcp_connections(ranks + [cluster.launcher_pid]),
    }


def step(i):
    if i % 40 == 39 and dist.get_rank() == 1:
        raise RuntimeError(f"planned failure {i}")
    t = torch.full((8,), float(i))
    dist.all_reduce(t)
    return t[0].item()


def test_200_calls_with_failures_leak_nothing():
    with dpc.Cluster(world_size=2) as cluster:
        cluster.run(step, 0)
        before = _census(cluster)
        failures = 0
        for i in range(200):
            try:
                assert cluster.run(step, i) == [2.0 * i] * 2
            except dpc.RankError as err:
                assert "planned failure" in str(err)
                failures += 1
        cluster.run(step, 0)  # finish the last restart before counting
        assert failures == 5
        assert _census(cluster) == before
