"""How ranks start: forked from the launcher (Linux's default) or spawned as fresh interpreters
(the default elsewhere: forking a process that imported torch is unsafe on macOS).

The pool's own hostile cases run in both modes: this module runs ``test_pool.py`` and
``test_kernel.py`` (errors, hangs, kill -9, the kernel's restart and kill with no orphans,
bad input) and one notebook under nbval again with ``DPCOURSE_START_METHOD=spawn``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

import dpcourse as dpc
from dpcourse.pool.errors import ClusterError, RankDied
from conftest import wait_gone

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def test_fork_is_linux_default_and_the_choice_is_checked(monkeypatch):
    monkeypatch.delenv("DPCOURSE_START_METHOD", raising=False)
    assert dpc.pool.kernel.cluster.choose_start_method(None) == "fork"
    monkeypatch.setenv("DPCOURSE_START_METHOD", "spawn")
    assert dpc.pool.kernel.cluster.choose_start_method(None) == "spawn"
    assert dpc.pool.kernel.cluster.choose_start_method("fork") == "fork"  # the argument wins
    with pytest.raises(ClusterError, match=r"DPCOURSE_START_METHOD='forkserver': choose 'fork'"):
        monkeypatch.setenv("DPCOURSE_START_METHOD", "forkserver")
        dpc.pool.kernel.cluster.choose_start_method(None)
    with pytest.raises(ClusterError, match=r"start_method='thread': choose"):
        dpc.Cluster(2, start_method="thread")


def test_where_sockets_cannot_be_passed_the_pool_says_to_use_wsl(monkeypatch):
    import socket

    monkeypatch.delattr(socket, "send_fds")  # what native Windows lacks
    with pytest.raises(ClusterError, match="native Windows.*WSL"):
        dpc.pool.kernel.cluster.choose_start_method("spawn")


@pytest.fixture(scope="module")
def spawned():
    with dpc.Cluster(2, start_method="spawn", timeout=60) as cluster:
        yield cluster


def _warm(cluster, timeout: float = 90.0) -> None:
    """Wait until every spare generation has imported torch."""
    deadline = time.monotonic() + timeout
    while not all(spare.warm() for spare in cluster._spares):
        assert time.monotonic() < deadline, "the spare generations never finished importing torch"
        time.sleep(0.05)


def _all_pids(cluster) -> list[int]:
    return cluster.pids + [pid for spare in cluster._spares for pid in spare.pids]


def test_spawned_ranks_are_fresh_interpreters(spawned):
    assert spawned.start_method == "spawn" and "start_method='spawn'" in repr(spawned)
    for pid in spawned.pids:
        process = psutil.Process(pid)
        assert "spawned_main" in " ".join(process.cmdline())  # exec'd, not forked
        assert process.ppid() == spawned.launcher_pid
    assert spawned.run(lambda: (dist.get_rank(), dist.get_world_size())) == [(0, 2), (1, 2)]


def test_a_failure_restarts_on_the_spare_generation(spawned):
    _warm(spawned)
    spare = list(spawned._spares[0].pids)
    with pytest.raises(RankDied):
        spawned.run(lambda: os._exit(3) if dist.get_rank() == 1 else dist.barrier())
    assert spawned.run(lambda: os.getpid()) == spare  # the warm spare took over
    assert len(spawned._spares) == dpc.pool.kernel.cluster.SPARE_GENERATIONS  # and new ones wait
    assert all(set(gen.pids).isdisjoint(spare) for gen in spawned._spares)


def _sum_of_ranks():
    import torch

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails")
    dist.barrier()


def test_two_failures_in_a_row_both_restart_on_spares_that_imported_torch():
    """A rank raises, then at once a rank is killed: each restart takes a spare generation that
    has imported torch already (the second does not wait for the first's replacement)."""
    cluster = dpc.Cluster(2, start_method="spawn", timeout=60)
    seen = []
    try:
        _warm(cluster)
        first, second = (list(gen.pids) for gen in cluster._spares[:2])
        seen += _all_pids(cluster)
        start = time.monotonic()
        with pytest.raises(dpc.RankError, match="rank 1 fails"):
            cluster.run(_raise_on_rank_1)
        assert cluster.run(os.getpid) == first
        seen += _all_pids(cluster)
        os.kill(cluster.pids[1], signal.SIGKILL)  # a rank of our own cluster, by its PID
        try:
            cluster.run(os.getpid)
        except RankDied:  # the call met the dying rank; the cluster restarted
            pass
        assert cluster.run(os.getpid) == second  # not a generation still importing torch
        assert cluster.run(_sum_of_ranks) == [3.0, 3.0]
        assert time.monotonic() - start < 60  # generous: the benchmark has the real figures
        seen += _all_pids(cluster)
    finally:
        cluster.shutdown()
    assert wait_gone(seen) == [], "ranks or spares outlived the cluster"


SCHED_IDLE = 5  # the scheduling policy's number in /proc/<pid>/task/<tid>/stat (sched(7))


def _threads(pid: int) -> list[tuple[int, bool, int]]:
    """(nice value, whether libtorch is mapped, scheduling policy) of each thread of ``pid``; []
    once it is gone."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            torch_in = "libtorch" in f.read()
        out = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # fields 3, 4, ... of proc(5)'s stat
                out.append((int(fields[16]), torch_in, int(fields[38])))  # nice is 19th, policy 41st
        return out
    except (FileNotFoundError, ProcessLookupError):
        return []


def _kinds(pids: list[int]) -> list[set[tuple[int, int]]]:
    """Each process's set of (nice value, scheduling policy) over its threads."""
    return [{(nice, policy) for nice, _, policy in _threads(pid)} for pid in pids]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_spare_generations_import_one_at_a_time_at_low_priority():
    """While the first spare generation imports torch (in a thread of the lowest priority and the
    SCHED_IDLE policy), the second has not begun; the ranks themselves keep the normal priority."""
    cluster = dpc.Cluster(2, start_method="spawn", timeout=60)
    seen = []
    try:
        first, second = cluster._spares[:2]
        seen += _all_pids(cluster)
        low_priority_import = False
        deadline = time.monotonic() + 90
        while True:
            later = [t for pid in second.pids for t in _threads(pid)]
            now = [t for pid in first.pids for t in _threads(pid)]
            if first.warm():
                break
            assert not any(torch_in for _, torch_in, _ in later), "the second spare imports alongside the first"
            low_priority_import |= any(nice == 19 and torch_in and policy == SCHED_IDLE
                                       for nice, torch_in, policy in now)
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert low_priority_import, "the first spare did not import at low priority"
        assert cluster.run(lambda: os.getpriority(os.PRIO_PROCESS, 0)) == [0, 0]
        cluster.restart()  # the spare takes over: it runs at normal priority too
        assert cluster.pids == first.pids
        assert cluster.run(lambda: os.getpriority(os.PRIO_PROCESS, 0)) == [0, 0]
        # and so do the threads it started while importing (numpy's BLAS workers); the import
        # thread itself may take a while to finish exiting on a busy machine, being SCHED_IDLE
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _kinds(cluster.pids) != [{(0, 0)}, {(0, 0)}]:
            time.sleep(0.1)
        assert _kinds(cluster.pids) == [{(0, 0)}, {(0, 0)}], "(nice, policy) of the ranks' threads"
        seen += _all_pids(cluster)
    finally:
        cluster.shutdown()
    assert wait_gone(seen) == [], "ranks or spares outlived the cluster"


def test_killing_the_launcher_leaves_no_rank_and_no_spare():
    cluster = dpc.Cluster(2, start_method="spawn")
    try:
        _warm(cluster)
        pids = _all_pids(cluster)
        assert len(pids) == 2 * (1 + dpc.pool.kernel.cluster.SPARE_GENERATIONS)
        os.kill(cluster.launcher_pid, signal.SIGKILL)  # our own child, by its PID
        assert wait_gone(pids) == [], "ranks outlived their launcher"
    finally:
        cluster.shutdown()  # with its launcher gone: closes the sockets, reaps the launcher


def test_without_a_death_signal_a_watchdog_follows_the_parent(tmp_path):
    """Where there is no PR_SET_PDEATHSIG (macOS, Windows), set_death_signal starts a watchdog:
    simulated here by hiding Linux from it, in a child whose parent we kill."""
    child_code = textwrap.dedent("""
        import os, sys, time
        sys.platform = "darwin"  # no prctl: the watchdog path
        from dpcourse.pool.ranks.rank import set_death_signal
        set_death_signal(os.getppid())
        time.sleep(120)
    """)
    parent_code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child_code!r}]);"
                   " time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (children := psutil.Process(parent.pid).children()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = children[0]
        time.sleep(3)  # let it import and arm
        parent.kill()  # our own child, by its Popen handle
        parent.wait()
        assert wait_gone([child.pid], timeout=5) == [], "the child outlived its parent"
    finally:
        for p in psutil.Process().children(recursive=True):
            if p.pid == parent.pid:
                p.kill()


@pytest.mark.timeout(420)
def test_the_pools_hostile_cases_and_a_notebook_pass_in_spawn_mode():
    """test_pool.py, test_kernel.py and 4.2c under nbval, once more with spawned ranks."""
    env = {**os.environ, "DPCOURSE_START_METHOD": "spawn"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                           "tests/test_pool.py", "tests/test_kernel.py", "--nbval",
                           "notebooks/4.2c-large-models.ipynb"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    print("\n" + done.stdout.strip().splitlines()[-1])
