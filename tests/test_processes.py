"""The process toolbox (dpcourse.processes): exits described, trees found and ended, free ports,
torchrun's command and environment, death signals and the ending of a Gloo run."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dpcourse import processes
from conftest import wait_gone

pytestmark = pytest.mark.timeout(120)

# A process that starts one child in its own session (as torchrun starts its workers) and one
# in its process group, prints their PIDs, and waits.
FAMILY = textwrap.dedent("""
    import subprocess, sys, time
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    apart = subprocess.Popen(sleep, start_new_session=True)
    near = subprocess.Popen(sleep)
    print(apart.pid, near.pid, flush=True)
    time.sleep(120)
""")


def _family() -> tuple[subprocess.Popen, list[int]]:
    proc = processes.start_process([sys.executable, "-c", FAMILY], stdout=subprocess.PIPE, text=True)
    return proc, [int(pid) for pid in proc.stdout.readline().split()]


def test_exits_are_described_from_wait_statuses():
    assert processes.describe_exit(signal.SIGKILL) == "killed by signal 9 (SIGKILL)"
    assert processes.describe_exit(3 << 8) == "exited with code 3"
    assert processes.describe_exit(0) == "exited with code 0"
    assert processes.describe_exit(None) == "ended (exit status unknown)"


def test_free_ports_differ_and_can_be_bound():
    ports = processes.free_ports(3)
    assert len(set(ports)) == 3
    for port in ports + [processes.free_port()]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_tree_is_found_and_ended_whole_though_a_child_left_its_session():
    proc, kids = _family()
    try:
        assert set(processes.children(proc.pid)) == set(kids)
        assert set(processes.tree(os.getpid())) >= {proc.pid, *kids}
        assert processes.end_tree(proc) is None  # stopped, not ended by itself
        assert proc.returncode == -signal.SIGKILL
        assert wait_gone(kids, timeout=10) == []
    finally:
        processes.end_tree(proc)


def test_end_tree_gives_sigterm_a_grace_and_leaves_an_ended_process_alone():
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); " \
           "print(1, flush=True); time.sleep(120)"
    proc = processes.start_process([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # its handler is installed
    assert processes.end_tree(proc, grace_s=10) is None
    assert proc.returncode == 7  # it ended on SIGTERM, within the grace
    done = processes.start_process([sys.executable, "-c", "raise SystemExit(5)"])
    done.wait(30)
    assert processes.end_tree(done) == 5


def test_run_process_past_its_timeout_ends_the_whole_tree():
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        processes.run_process([sys.executable, "-c", FAMILY], timeout=3, text=True)
    assert time.monotonic() - start < 30
    kids = [int(pid) for pid in info.value.output.split()]
    assert len(kids) == 2 and wait_gone(kids, timeout=10) == []
    done = processes.run_process([sys.executable, "-c", "print('hi')"], timeout=30, text=True)
    assert (done.returncode, done.stdout) == (0, "hi\n")


def test_stop_terms_then_kills():
    stubborn = processes.start_process([sys.executable, "-c", "import signal, time; "
                                        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
                                        "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    stubborn.stdout.readline()
    start = time.monotonic()
    processes.stop([stubborn.pid], grace_s=0.5)  # reaps it too: it is our child
    assert wait_gone([stubborn.pid], timeout=0, zombies_count=True) == []
    assert 0.5 <= time.monotonic() - start < 10  # SIGTERM ignored: SIGKILL after the grace
    stubborn.wait(10)


def test_torchrun_command_and_environment():
    assert processes.torchrun_command(2, "--redirects=3", "train.py", 1) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "--redirects=3", "train.py", "1"]
    assert "--standalone" not in processes.torchrun_command(1, "x.py", standalone=False)
    os.environ.update(RANK="3", TORCHELASTIC_RUN_ID="old", DPCOURSE_KEPT="1")
    try:
        env = processes.launch_env(OMP_NUM_THREADS="1")
    finally:
        for key in ("RANK", "TORCHELASTIC_RUN_ID", "DPCOURSE_KEPT"):
            del os.environ[key]
    assert "RANK" not in env and "TORCHELASTIC_RUN_ID" not in env
    assert env["DPCOURSE_KEPT"] == "1" and env["OMP_NUM_THREADS"] == "1"


def test_a_death_signal_ends_the_child_with_its_parent():
    child = ("import os; from dpcourse.processes import set_death_signal; set_death_signal(os.getppid()); "
             "print('armed', flush=True); import time; time.sleep(120)")
    parent_code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
                   "print(p.pid, flush=True); time.sleep(120)")
    env = {**os.environ, "PYTHONPATH": processes.PACKAGE_ROOT}
    parent = processes.start_process([sys.executable, "-c", parent_code], stdout=subprocess.PIPE,
                                     text=True, env=env)
    try:
        pid = int(parent.stdout.readline())
        assert parent.stdout.readline() == "armed\n"  # the child's line, on the same pipe
        parent.kill()  # the parent alone, by its Popen handle
        parent.wait()
        assert wait_gone([pid], timeout=10) == []
    finally:
        processes.end_tree(parent)


def test_aborted_at_exit_needs_all_three_signs():
    output = f"... exitcode: -6 (SIGABRT) ... {processes.EXIT_ABORT}"
    assert processes.aborted_at_exit(1, output, work_done=True)
    assert not processes.aborted_at_exit(1, output, work_done=False)
    assert not processes.aborted_at_exit(None, output, work_done=True)  # a timeout never is
    assert not processes.aborted_at_exit(1, "exitcode: -6 (SIGABRT)", work_done=True)


LEAVE = textwrap.dedent("""
    import torch, torch.distributed as dist
    from dpcourse.processes import exit_without_shutdown, leave_process_group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    leave_process_group()
    print("initialized" if dist.is_initialized() else "left", end="", flush=True)
    exit_without_shutdown(4)
""")


def test_a_gloo_run_leaves_its_group_and_exits_with_its_code():
    env = {**os.environ, "PYTHONPATH": processes.PACKAGE_ROOT, "OMP_NUM_THREADS": "1"}
    done = processes.run_process([sys.executable, "-c", LEAVE], timeout=90, env=env, text=True)
    assert (done.returncode, done.stdout) == (4, "left"), done.stderr[-2000:]
