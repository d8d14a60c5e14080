"""Faults, for real: kill -9 a worker during training and in the middle of a checkpoint write.

Under ``torchrun --max-restarts=1`` the elastic agent restarts all workers, ``--resume auto``
finds the newest *complete* checkpoint, and the run ends with the losses and the weights of an
uninterrupted run. A checkpoint interrupted at any point of its write is never loaded. Each
test prints (see ``pytest -s``) how many steps were redone: the steps between the last
complete checkpoint and the fault.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import dpcourse as dpc
from dpcourse.pool.errors import RankDied
from dpcourse import models
from dpcourse.processes import (TORCHRUN, end_tree, free_port, launch_env, run_process, start_process,
                                torchrun_command)
from dpcourse.train import TrainConfig, checkpoint, train

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)
OPTIONS = dict(wrapper="ddp", batch_size=4, num_samples=128)  # 16 batches of 2 x 4 per epoch


@pytest.fixture(scope="module")
def uninterrupted(cluster2):
    """steps -> rank 0's metrics and full final state of an uninterrupted run on the pool."""
    cache = {}

    def run(steps: int) -> dict:
        if steps not in cache:
            cfg = TrainConfig(steps=steps, progress=False, **OPTIONS)
            cache[steps] = cluster2.run(train, cfg, full_state=True)[0]
        return cache[steps]
    return run


# torchrun's workers and the pool's ranks may use different numbers of intra-op threads on
# another machine; here they agree bit for bit. A resume from the wrong step or data position
# changes the losses in their third digit.
CLOSE = dict(rtol=1e-6, atol=1e-7)


def _start(tmp_path: Path, steps: int, every: int, restarts: int, **env) -> subprocess.Popen:
    """torchrun (2 workers, this interpreter) in its own session; output in tmp_path/log."""
    args = [str(ROOT / "launch" / "torchrun_single_node.sh"), "--steps", str(steps),
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", str(every),
            "--resume", "auto", "--metrics-path", str(tmp_path / "metrics.json")]
    for key, value in OPTIONS.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    env = launch_env(TORCHRUN=" ".join(TORCHRUN), NPROC_PER_NODE="2", MAX_RESTARTS=str(restarts), **env)
    with open(tmp_path / "log", "w") as log:
        return start_process(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _finish(agent: subprocess.Popen, timeout: float = 150) -> int:
    """Wait for the agent; on timeout end it with all it started, and fail."""
    try:
        return agent.wait(timeout=timeout)
    finally:
        end_tree(agent)


def _attempts(log: str) -> list[tuple[int, int]]:
    """(first step, last step printed) of each attempt, from rank 0's output."""
    starts = list(re.finditer(r"steps (\d+)\.\.\d+", log))
    result = []
    for i, start in enumerate(starts):
        chunk = log[start.end(): starts[i + 1].start() if i + 1 < len(starts) else len(log)]
        done = [int(m) for m in re.findall(r"step (\d+)/\d+ loss", chunk)]
        result.append((int(start.group(1)), done[-1] if done else int(start.group(1))))
    return result


def _check_resumed_run(tmp_path: Path, steps: int, reference: dict) -> tuple[int, int]:
    """The restarted attempt's losses and the final weights equal the uninterrupted run's;
    returns (steps done before the fault, step resumed from)."""
    log = (tmp_path / "log").read_text()
    attempts = _attempts(log)
    assert len(attempts) == 2 and attempts[0][0] == 0, log[-3000:]
    ranks = json.loads((tmp_path / "metrics.json").read_text())["ranks"]
    resumed = ranks[0]["first_step"]
    assert resumed == attempts[1][0] and resumed > 0, "the restarted workers started from scratch"
    for r in ranks:
        torch.testing.assert_close(r["losses"], reference["losses"][resumed:], **CLOSE)
    final = models.build_model("mlp", seed=12345)  # other weights: the checkpoint must replace them
    checkpoint.load_weights(checkpoint.step_dir(str(tmp_path / "ckpt"), steps), final)
    torch.testing.assert_close(final.state_dict(), reference["state"], **CLOSE)
    return attempts[0][1], resumed


def _worker(agent: subprocess.Popen, rank: int) -> psutil.Process | None:
    """The first attempt's worker of ``rank`` (a child of the agent), if it runs."""
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RESTART_COUNT") == "0":
            return child
    return None


def _wait_for(agent: subprocess.Popen, log: Path, pattern: str, timeout: float = 120) -> re.Match:
    """The last match of ``pattern`` in the log, waiting for one to appear."""
    deadline = time.monotonic() + timeout
    while True:
        found = list(re.finditer(pattern, log.read_text()))
        if found:
            return found[-1]
        assert agent.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.01)


def test_kill_9_of_a_worker_restarts_all_and_resumes_from_the_newest_checkpoint(tmp_path, uninterrupted):
    steps, every, log = 60, 10, tmp_path / "log"
    agent = _start(tmp_path, steps, every, restarts=1)
    try:
        # Kill half-way between two checkpoints, once rank 0 reports step 15 or later.
        _wait_for(agent, log, r"step (1[5-9]|[2-5]\d)/60 loss")
        victim = _worker(agent, rank=1)
        assert victim is not None
        victim.send_signal(signal.SIGKILL)  # our own child, by its PID
        killed = time.monotonic()
        _wait_for(agent, log, r"\(resumed from ")
        restart_s = time.monotonic() - killed
        assert _finish(agent) == 0, log.read_text()[-3000:]
    finally:
        end_tree(agent)
    done, resumed = _check_resumed_run(tmp_path, steps, uninterrupted(steps))
    print(f"\ntorchrun, kill -9 of rank 1 during training: {done} steps done, resumed from step "
          f"{resumed}: {done - resumed} steps redone (checkpoint every {every}); "
          f"{restart_s:.1f} s from the kill to the restarted workers' first line")
    assert 15 <= done and 0 <= done - resumed <= every


def test_kill_9_in_a_checkpoint_write_under_torchrun(tmp_path, uninterrupted):
    steps, every = 20, 5
    agent = _start(tmp_path, steps, every, restarts=1, DPCOURSE_TEST_KILL="1:mid-write:10")
    assert _finish(agent) == 0, (tmp_path / "log").read_text()[-3000:]
    done, resumed = _check_resumed_run(tmp_path, steps, uninterrupted(steps))
    print(f"\ntorchrun, kill -9 of rank 1 writing the step-10 checkpoint: {done} steps done, "
          f"resumed from step {resumed}: {done - resumed} steps redone")
    assert (done, resumed) == (10, 5)
    assert not [p for p in os.listdir(tmp_path / "ckpt") if p.startswith(".")]  # no partial left


def _arm(spec: str) -> None:
    """On a rank: make the checkpoint's test hook SIGKILL it (this process only)."""
    os.environ["DPCOURSE_TEST_KILL"] = spec


@pytest.mark.parametrize("rank, point, newest", [
    (1, "mid-write", 5),       # its shards written, DCP's .metadata not yet
    (1, "before-barrier", 5),  # a checkpoint DCP alone would load, but not everyone is done
    (0, "before-publish", 5),  # completion mark written, the folder not yet renamed
    (0, "after-publish", 10),  # published: complete, and the one to resume from
])
def test_kill_9_at_each_point_of_a_checkpoint_write(cluster2, uninterrupted, tmp_path, rank, point, newest):
    root = str(tmp_path / "ckpt")
    cfg = TrainConfig(steps=20, checkpoint_dir=root, checkpoint_every=5, resume="auto", progress=False, **OPTIONS)
    cluster2.run(_arm, f"{rank}:{point}:10")
    with pytest.raises(RankDied):  # the pool restarts the ranks, without the armed hook
        cluster2.run(train, cfg)
    assert checkpoint.latest(root) == checkpoint.step_dir(root, newest)
    partial = os.path.join(root, ".partial-step-000010")
    if point in ("mid-write", "before-barrier"):
        assert os.path.exists(os.path.join(partial, ".metadata")) == (point == "before-barrier")
        with pytest.raises(FileNotFoundError, match="no progress.json completion mark"):
            checkpoint.load_weights(partial, models.build_model("mlp"))
    rest = cluster2.run(train, cfg, full_state=True)[0]
    print(f"\npool, kill -9 of rank {rank} at {point} of the step-10 checkpoint: 10 steps done, "
          f"resumed from step {rest['first_step']}: {10 - rest['first_step']} steps redone")
    assert rest["first_step"] == newest
    whole = uninterrupted(20)
    torch.testing.assert_close(rest["losses"], whole["losses"][newest:], rtol=0, atol=0)
    torch.testing.assert_close(rest["state"], whole["state"], rtol=0, atol=0)
    assert not [p for p in os.listdir(root) if p.startswith(".")]  # the stale partial was cleared


# --- a plain torchrun command, as PyTorch's elastic docs show it ---------------------------

def _plain(tmp_path: Path, steps: int, every: int, *extra: str, **env) -> subprocess.Popen:
    """``torchrun --standalone --max-restarts=1 --nproc_per_node=2 -m dpcourse.train ...`` with
    no TORCH_* or TORCHELASTIC_* variable of ours (the launchers' fix is not there)."""
    args = torchrun_command(2, "--max-restarts=1", "-m", "dpcourse.train", "--steps", steps,
                            "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", every,
                            "--resume", "auto", "--metrics-path", tmp_path / "metrics.json", *extra)
    for key, value in OPTIONS.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    clean = {k: v for k, v in launch_env().items() if not k.startswith("TORCH_")}
    with open(tmp_path / "log", "w") as log:
        return start_process(args, cwd=ROOT, env={**clean, **env}, stdout=log, stderr=subprocess.STDOUT)


def test_a_plain_torchrun_command_resumes_after_kill_9_round_after_round(tmp_path, uninterrupted):
    """The shared store of torchrun's agent held the dead attempt's keys: 3 of 9 restarts
    resumed before the process group had its own keys per attempt. Two rounds (each some 15 s
    of both cores) would show that more often than not."""
    steps, every, rounds, times = 40, 10, 2, []
    for n in range(rounds):
        folder = tmp_path / f"round{n}"
        folder.mkdir()
        agent = _plain(folder, steps, every)
        log = folder / "log"
        try:
            _wait_for(agent, log, r"step (1[5-9]|[2-3]\d)/40 loss")  # after the first checkpoint
            victim = _worker(agent, rank=1)
            assert victim is not None
            victim.send_signal(signal.SIGKILL)  # our own grandchild, by its PID
            killed = time.monotonic()
            resumed = _wait_for(agent, log, r"\(resumed from ")
            first_step = re.compile(r"step \d+/40 loss")
            while not first_step.search(log.read_text(), resumed.end()):
                assert agent.poll() is None and time.monotonic() - killed < 120, log.read_text()[-3000:]
                time.sleep(0.01)
            times.append(time.monotonic() - killed)
            assert _finish(agent) == 0, log.read_text()[-3000:]
        finally:
            end_tree(agent)
        done, resumed_at = _check_resumed_run(folder, steps, uninterrupted(steps))
        assert 0 <= done - resumed_at <= every
    print(f"\nplain torchrun, kill -9 of rank 1: {rounds} of {rounds} rounds resumed; kill to the "
          f"resumed first step {', '.join(f'{t:.1f}' for t in times)} s")


def _descendants_of(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_workers_die_with_a_killed_agent(tmp_path):
    agent = _plain(tmp_path, 100000, 0, "--batch-size", "4")
    workers = []
    try:
        _wait_for(agent, tmp_path / "log", r"step \d+/100000 loss")
        workers = [p for p in _descendants_of(agent.pid) if "dpcourse.train" in " ".join(p.cmdline())]
        assert len(workers) == 2
        agent.send_signal(signal.SIGKILL)  # the agent alone, by its PID: not its session
        agent.wait(timeout=10)
        gone = time.monotonic()
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers {[p.pid for p in alive]} outlived their agent"
        print(f"\nagent killed: its 2 workers gone within {time.monotonic() - gone:.2f} s")
    finally:
        end_tree(agent)
        for p in workers:  # psutil handles: a PID reused meanwhile is not killed
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.mark.parametrize("shared_store", [False, True], ids=["env-store", "agent-store"])
def test_a_rank_that_cannot_join_fails_within_the_timeout(tmp_path, shared_store):
    """Rank 1 of 2 alone: rank 0 never comes. Gloo would wait 30 minutes; --pg-timeout 3 fails in ~3 s."""
    port = free_port()
    env = {k: v for k, v in launch_env().items() if not k.startswith("TORCH_")}
    env.update(RANK="1", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    server = None
    if shared_store:  # what torchrun's agent gives its workers: its own store, already up
        server = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        env.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="test")
    start = time.monotonic()
    done = run_process([sys.executable, "-m", "dpcourse.train", "--pg-timeout", "3", "--steps", "1"],
                       timeout=60, cwd=ROOT, env=env, text=True)
    took = time.monotonic() - start
    del server
    assert done.returncode == 3, done.stderr[-2000:]
    error = done.stderr.strip().splitlines()[-1]
    if shared_store:
        assert error.startswith("error: rank 1 waited 3 s for rank 0 to admit it to the process group; "
                                "is rank 0 started?"), error
    else:
        assert error.startswith("error: rank 1 could not join the process group within --pg-timeout 3 s"), error
        assert error.endswith("Is every rank started, and can it reach MASTER_ADDR:MASTER_PORT?"), error
    assert f"MASTER_PORT={port}" in error and "WORLD_SIZE=2" in error
    assert took < 3 + 25, took  # the timeout, plus starting Python and torch on 2 busy cores
