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
from conftest import wait_gone

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def test_fork_is_linux_default_and_the_choice_is_checked(monkeypatch):
    monkeypatch.delenv("DPCOURSE_START_METHOD", raising=False)
    assert dpc.pool.cluster.choose_start_method(None) == "fork"
    monkeypatch.setenv("DPCOURSE_START_METHOD", "spawn")
    assert dpc.pool.cluster.choose_start_method(None) == "spawn"
    assert dpc.pool.cluster.choose_start_method("fork") == "fork"  # the argument wins
    with pytest.raises(dpc.ClusterError, match=r"DPCOURSE_START_METHOD='forkserver': choose 'fork'"):
        monkeypatch.setenv("DPCOURSE_START_METHOD", "forkserver")
        dpc.pool.cluster.choose_start_method(None)
    with pytest.raises(dpc.ClusterError, match=r"start_method='thread': choose"):
        dpc.Cluster(2, start_method="thread")


def test_where_sockets_cannot_be_passed_the_pool_says_to_use_wsl(monkeypatch):
    import socket

    monkeypatch.delattr(socket, "send_fds")  # what native Windows lacks
    with pytest.raises(dpc.ClusterError, match="native Windows.*WSL"):
        dpc.pool.cluster.choose_start_method("spawn")


@pytest.fixture(scope="module")
def spawned():
    with dpc.Cluster(2, start_method="spawn", timeout=60) as cluster:
        yield cluster


def _warm(cluster, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cluster._spare.warm():
        assert time.monotonic() < deadline, "the spare generation never finished importing torch"
        time.sleep(0.05)


def test_spawned_ranks_are_fresh_interpreters(spawned):
    assert spawned.start_method == "spawn" and "start_method='spawn'" in repr(spawned)
    for pid in spawned.pids:
        process = psutil.Process(pid)
        assert "spawned_main" in " ".join(process.cmdline())  # exec'd, not forked
        assert process.ppid() == spawned.launcher_pid
    assert spawned.run(lambda: (dist.get_rank(), dist.get_world_size())) == [(0, 2), (1, 2)]


def test_a_failure_restarts_on_the_spare_generation(spawned):
    _warm(spawned)
    spare = list(spawned._spare.pids)
    with pytest.raises(dpc.RankDied):
        spawned.run(lambda: os._exit(3) if dist.get_rank() == 1 else dist.barrier())
    assert spawned.run(lambda: os.getpid()) == spare  # the warm spare took over
    assert spawned._spare is not None and set(spawned._spare.pids).isdisjoint(spare)  # and a new one waits


def test_killing_the_launcher_leaves_no_rank_and_no_spare():
    cluster = dpc.Cluster(2, start_method="spawn")
    try:
        _warm(cluster)
        pids = cluster.pids + cluster._spare.pids
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
        from dpcourse.pool.rank import set_death_signal
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
