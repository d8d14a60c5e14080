"""Each Linux-only piece, with its absence simulated on Linux: the fallback and its wording.

``/proc/self/io`` (wire bytes), ``/proc/self/oom_score_adj`` (the OOM killer's preference),
``/proc`` (Exercise A's cleanup), the death signal (tests/test_start_method.py) and the
memory figures of a killed rank (which come from ``wait4``, on every POSIX system).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc
from dpcourse.pool.errors import RankDied
from dpcourse import processes
from dpcourse.observe import comm as comm_module
from dpcourse.pool.ranks import rank as rank_module
from dpcourse.pool.kernel.procs import MemoryWatch, physical_memory

pytestmark = pytest.mark.timeout(120)


def _all_reduce_step():
    t = torch.ones(1000)
    dist.all_reduce(t)
    return t[0].item()


def _hide_io_counters(hidden: bool):
    comm_module.IO_COUNTERS = "/nonexistent/io" if hidden else "/proc/self/io"


def test_without_proc_self_io_the_wire_is_not_measured_and_says_so(cluster2):
    cluster2.run(_hide_io_counters, True)
    try:
        comm = dpc.observe.Comm()
        cluster2.run(_all_reduce_step, observe=[comm])
    finally:
        cluster2.run(_hide_io_counters, False)
    wire = comm.wire(rank=0)
    assert not wire and wire is comm_module.NOT_MEASURED
    assert f"{wire:>11,}" == "not measured on this platform" and str(wire) == repr(wire) == f"{wire}"
    assert comm.bytes(rank=0) == {"all_reduce": 4000}  # logical bytes are still counted
    measured = dpc.observe.Comm()
    cluster2.run(_all_reduce_step, observe=[measured])
    assert measured.wire(rank=0) > 0  # and with /proc/self/io back, the wire is read


def test_without_an_oom_preference_the_kill_hint_says_so(monkeypatch):
    monkeypatch.setattr(rank_module, "OOM_SCORE_FILE", "/nonexistent/oom_score_adj")
    assert rank_module.prefer_oom_kill() is False
    total = physical_memory()
    killed = signal.SIGKILL  # a wait status of "killed by SIGKILL" is the signal number itself
    hint = MemoryWatch().kill_hint(total // 2, killed, oom_first=False)
    assert "likely out of memory" in hint and "the ranks could not volunteer as its first choice here" in hint
    assert "ranks are its first choice" in MemoryWatch().kill_hint(total // 2, killed)


def test_without_sysconf_the_kill_hint_gives_the_peak_alone(monkeypatch):
    def missing(name):
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(os, "sysconf", missing)
    assert physical_memory() is None
    assert MemoryWatch().kill_hint(3 * 2**30, signal.SIGKILL) == " with 3.0 GiB resident at its peak"


def test_a_killed_ranks_peak_comes_from_wait4(cluster2):
    """The launcher reaps ranks with wait4: the peak it reports is the rank's own high-water mark."""
    victim = cluster2.pids[1]

    def hold(nbytes):
        keep = torch.ones(nbytes // 4)
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return float(keep[0])

    with pytest.raises(RankDied) as info:
        cluster2.run(hold, 96 * 2**20)
    summary = info.value.failures[1].summary
    peak = cluster2._launcher.peaks[victim]
    assert 96 * 2**20 <= peak < 2**31, peak
    assert "resident at its peak" in summary


def test_without_proc_the_checkers_cleanup_finds_descendants_with_ps(monkeypatch):
    tree = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(tree.pid).children():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        expected = sorted(p.pid for p in psutil.Process(tree.pid).children(recursive=True))
        assert sorted(processes.tree(tree.pid)) == expected
        monkeypatch.setattr(processes, "PROC", "/nonexistent/proc")  # as on macOS
        assert sorted(processes.tree(tree.pid)) == expected
    finally:
        for p in psutil.Process(tree.pid).children(recursive=True):
            p.kill()
        tree.kill()
        tree.wait()
