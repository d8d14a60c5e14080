"""Shared fixtures. Every test that starts processes cleans up its own PIDs."""
from __future__ import annotations

import os
import time

import psutil
import pytest

import dpcourse as dpc


def descendants() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def wait_gone(pids, timeout: float = 10.0, zombies_count: bool = False) -> list[int]:
    """PIDs from ``pids`` that still exist after waiting up to ``timeout`` seconds.

    A zombie (dead, not yet reaped by its parent) counts as gone unless ``zombies_count``.
    """
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                status = psutil.Process(pid).status()
                if zombies_count or status != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def kill_tree(proc) -> None:
    """SIGKILL a child started with ``start_new_session=True`` and everything it started.

    torchrun puts each worker in a session of its own, so killing the child's process group
    is not enough: its descendants are collected first (all ours), then killed."""
    if proc.poll() is not None:
        return
    family = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, 9)
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


@pytest.fixture(autouse=True, scope="module")
def no_leftover_processes():
    """After each test module: no process started by it may still run. Kills by PID, then fails."""
    before = {p.pid for p in descendants()}
    yield
    leftover = [p for p in descendants() if p.pid not in before]
    alive = wait_gone([p.pid for p in leftover], timeout=10)
    for pid in alive:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    assert not alive, f"processes left behind by this module: {alive}"


def _cluster_fixture(world_size: int):
    """A module-scoped ``dpc.Cluster`` of ``world_size`` ranks, named ``cluster<world_size>``."""
    @pytest.fixture(scope="module", name=f"cluster{world_size}")
    def fixture():
        with dpc.Cluster(world_size=world_size, timeout=60) as cluster:
            yield cluster

    return fixture


cluster2, cluster3, cluster4, cluster5 = (_cluster_fixture(n) for n in (2, 3, 4, 5))
