"""Shared fixtures. Every test that starts processes cleans up its own PIDs (a whole torchrun
launch with ``dpcourse.processes.end_tree``)."""
from __future__ import annotations

import time

import psutil
import pytest

import dpcourse as dpc
from dpcourse.grading import provenance
from dpcourse.grading.judging import close_judges
from dpcourse.processes import stop


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


@pytest.fixture(autouse=True, scope="module")
def no_leftover_processes():
    """After each test module: no process started by it may still run. Kills by PID, then fails."""
    before = {p.pid for p in descendants()}
    yield
    close_judges()   # the checkers' second-world-size clusters live as long as their kernel
    leftover = [p for p in descendants() if p.pid not in before]
    alive = wait_gone([p.pid for p in leftover], timeout=10)
    stop(alive, grace_s=0)  # found below this process a moment ago: ours
    assert not alive, f"processes left behind by this module: {alive}"


@pytest.fixture(autouse=True)
def a_learner_who_read_no_reference():
    """Each test starts as a kernel in which no reference was read (``provenance``)."""
    provenance.forget()


def _cluster_fixture(world_size: int):
    """A module-scoped ``dpc.Cluster`` of ``world_size`` ranks, named ``cluster<world_size>``."""
    @pytest.fixture(scope="module", name=f"cluster{world_size}")
    def fixture():
        with dpc.Cluster(world_size=world_size, timeout=60) as cluster:
            yield cluster

    return fixture


cluster2, cluster3, cluster4, cluster5 = (_cluster_fixture(n) for n in (2, 3, 4, 5))


# --- tiers and order ----------------------------------------------------------------------
# `pytest -m "not slow"` is the fast tier: every room's own tests, in a few minutes, to run
# while working. `slow` marks what runs a whole notebook or a kernel's Run All, a browser,
# torchrun, an exercise's checker end to end (all but two try-its, in test_tryits.py), or waits
# on purpose (deadlocks, faults); `.ci/run` runs both tiers.
SLOW_FILES = {
    "test_browser.py", "test_exercise_f.py", "test_exercises.py", "test_exercises_bc.py",
    "test_exercises_de.py", "test_exercise_notebooks.py", "test_launch.py",
    "test_deadlock.py", "test_faults.py", "test_script_isolation.py", "test_start_method.py",
    "test_run_script.py", "test_scratch_ddp.py", "test_kernel.py", "test_at_work.py",
    "test_notebook_peaks.py", "test_soak.py", "test_scripts.py", "test_script_end.py",
    "test_compile_meshes.py", "test_long_runs.py", "test_large_models_memory.py", "test_after_run_all.py",
    "test_memory_ranks.py", "test_bench.py",
}

# Under `-n 2 --dist loadfile` a file runs on one worker from start to end: the longest start
# first, so that none of them is left to run alone at the end (seconds, measured with
# --durations=0 on a 2-core machine running two workers; a file not named here is short and
# keeps its place).
LONGEST_FIRST = {
    "test_browser.py": 340, "test_exercises.py": 180, "test_exercise_f.py": 175, "test_start_method.py": 155,
    "test_deadlock.py": 200, "test_script_end.py": 90, "test_grade.py": 95, "test_exercises_bc.py": 90, "test_launch.py": 85,
    "test_faults.py": 80, "4.2d-launching-faults-and-pitfalls.ipynb": 60, "test_exercises_de.py": 50,
    "test_tryits.py": 50, "test_scripts.py": 50, "test_script_isolation.py": 50, "test_collectives.py": 40,
    "test_train.py": 40, "test_memory_ranks.py": 40, "test_run_script.py": 35, "4.2b-fsdp.ipynb": 35,
    "test_scratch_ddp.py": 35, "test_kernel.py": 30,
}


def is_slow(path) -> bool:
    return path.suffix == ".ipynb" or path.name in SLOW_FILES


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_slow(item.path):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -LONGEST_FIRST.get(item.path.name, 0))  # stable: a file's order kept
