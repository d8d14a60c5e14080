"""The worker pool on real ranks: results, output, errors, hangs, deaths, interrupts, bad input."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc
from dpcourse.pool.errors import ClusterError, RankDied, SerializationError
from conftest import wait_gone

pytestmark = pytest.mark.timeout(120)


def rank_info():
    return {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} | {
        "rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
        "threads": torch.get_num_threads(), "pid": os.getpid()}


def test_results_by_rank_and_torchrun_environment(cluster4):
    infos = cluster4.run(rank_info)
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert [i["RANK"] for i in infos] == ["0", "1", "2", "3"]
    assert [i["LOCAL_RANK"] for i in infos] == ["0", "1", "2", "3"]
    assert {i["WORLD_SIZE"] for i in infos} == {"4"} and {i["world"] for i in infos} == {4}
    assert {i["MASTER_ADDR"] for i in infos} == {"127.0.0.1"}
    assert len({i["MASTER_PORT"] for i in infos}) == 1
    assert {i["backend"] for i in infos} == {"gloo"} and cluster4.backend == "gloo"
    cores = len(os.sched_getaffinity(0))
    assert {i["threads"] for i in infos} == {max(1, cores // 4)}
    assert [i["pid"] for i in infos] == cluster4.pids
    assert os.getpid() not in cluster4.pids


def test_closures_and_args_go_by_value(cluster2):
    scale = 3.0
    payload = torch.arange(4.0)

    def fn(x, *, offset):
        t = payload * scale + x + offset + dist.get_rank()
        dist.all_reduce(t)
        return t

    out = cluster2.run(fn, 1.0, offset=10.0)
    expected = 2 * (torch.arange(4.0) * 3 + 11) + 1  # ranks add 0 and 1
    assert all(torch.equal(o, expected) for o in out)
    assert all(o.device.type == "cpu" for o in out)


def test_all_reduce_matches_single_process_sum(cluster4):
    def fn(seed):
        g = torch.Generator().manual_seed(seed + dist.get_rank())
        t = torch.randint(-100, 100, (1000,), generator=g)
        local = t.clone()
        dist.all_reduce(t)
        return local, t

    out = cluster4.run(fn, 7)
    expected = sum(local for local, _ in out)
    assert all(torch.equal(reduced, expected) for _, reduced in out)


def test_output_is_streamed_with_rank_labels(cluster2, capfd):
    def fn():
        print(f"hello from {dist.get_rank()}")
        print("progress 10%\rprogress 50%\rprogress 100%")
        os.write(2, f"c-level stderr {dist.get_rank()}\n".encode())  # bypasses Python
        print("no newline at the end", end="")

    cluster2.run(fn)
    out, err = capfd.readouterr()
    for r in (0, 1):
        assert f"[rank {r}] hello from {r}\n" in out
        assert f"[rank {r}] progress 100%\n" in out
        assert f"[rank {r}] no newline at the end\n" in out
        assert f"[rank {r}] c-level stderr {r}\n" in err
    assert "progress 10%" not in out


def _spares_settled(cluster, timeout: float = 120.0) -> None:
    """Spawn mode: wait until the oldest spare generation has imported torch. A failure before
    that waits for its import (on a busy 2-core machine, seconds): tests/test_start_method.py
    tests that case; here the restart itself is timed. Fork mode keeps no spares."""
    deadline = time.monotonic() + timeout
    while cluster._spares and not cluster._spares[0].warm() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_error_on_one_rank_while_others_wait_in_all_reduce(cluster4):
    _spares_settled(cluster4)

    def fn():
        if dist.get_rank() == 2:
            raise ValueError("bad batch on rank 2")
        dist.all_reduce(torch.ones(1))

    start = time.monotonic()
    with pytest.raises(dpc.RankError) as info:
        cluster4.run(fn)
    elapsed = time.monotonic() - start
    err = info.value
    assert elapsed < 1.0, f"RankError took {elapsed:.2f} s"
    assert set(err.failures) == {2}
    assert isinstance(err.failures[2].exception, ValueError)
    assert 'raise ValueError("bad batch on rank 2")' in err.failures[2].traceback
    assert "waiting in the 1st all_reduce of this call" in str(err) and err.restarted
    assert isinstance(err, ClusterError)
    start = time.monotonic()
    assert cluster4.run(lambda: dist.get_rank()) == [0, 1, 2, 3]
    assert time.monotonic() - start < 3.0


def test_errors_on_every_rank_keep_the_ranks(cluster2):
    pids = cluster2.pids
    with pytest.raises(dpc.RankError) as info:
        cluster2.run(lambda: 1 / 0)
    assert set(info.value.failures) == {0, 1} and not info.value.restarted
    assert cluster2.pids == pids


def test_mismatched_collectives_time_out_with_a_diagnosis(cluster2):
    def fn():
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))
        else:
            dist.broadcast(torch.ones(1), src=0)
            dist.barrier()

    with pytest.raises(dpc.RankTimeout) as info:
        cluster2.run(fn, timeout=1.5)
    reports = info.value.reports
    assert reports[0].state == "running" and "waiting in the 1st all_reduce of this call" in reports[0].summary
    assert "waiting in the 1st broadcast of this call" in reports[1].summary
    assert "dist.all_reduce(torch.ones(1))" in reports[0].traceback  # the learner's line
    assert "check that all ranks\nreach the same collectives" in str(info.value)
    assert cluster2.run(lambda: 1) == [1, 1]


def test_timeout_says_which_ranks_finished(cluster2):
    def fn():
        if dist.get_rank() == 1:
            time.sleep(30)

    with pytest.raises(dpc.RankTimeout) as info:
        cluster2.run(fn, timeout=1)
    assert info.value.reports[0].state == "finished"
    assert info.value.reports[1].state == "running"
    assert "time.sleep(30)" in info.value.reports[1].traceback
    # no rank waits in a collective, so the message does not blame the collectives' order
    assert "No rank is waiting in a collective" in str(info.value)
    assert "same collectives in the same order" not in str(info.value)


def test_rank_killed_during_a_call_is_reported_as_killed(cluster2):
    def fn():
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))

    with pytest.raises(RankDied) as info:
        cluster2.run(fn)
    assert "killed by signal 9 (SIGKILL)" in info.value.failures[1].summary
    assert cluster2.run(lambda: dist.get_rank()) == [0, 1]


def test_rank_killed_while_idle_is_restarted_before_the_next_call(cluster2, capfd):
    victim = cluster2.pids[0]
    os.kill(victim, signal.SIGKILL)
    assert not wait_gone([victim], 5, zombies_count=True)  # reaped by the launcher
    assert cluster2.run(lambda: dist.get_rank()) == [0, 1]
    assert victim not in cluster2.pids
    assert "rank 0 killed by signal 9 (SIGKILL)" in capfd.readouterr().err


def test_interrupt_stops_the_ranks_and_keeps_the_pool(cluster2):
    def fn():
        if dist.get_rank() == 0:
            time.sleep(60)  # interruptible Python code
        dist.all_reduce(torch.ones(1))  # rank 1 blocks here in C++

    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        cluster2.run(fn)
    assert time.monotonic() - start < 5
    assert cluster2.run(lambda: dist.get_rank()) == [0, 1]


def test_unpicklable_argument_function_and_result_are_named(cluster2):
    lock = threading.Lock()
    with pytest.raises(SerializationError, match="positional argument 1"):
        cluster2.run(lambda a, b: None, 1, lock)
    with pytest.raises(SerializationError, match="keyword argument 'k'"):
        cluster2.run(lambda k: None, k=lock)
    with pytest.raises(SerializationError, match="the function"):
        cluster2.run(lambda: lock)
    with pytest.raises(dpc.RankError, match="cannot be pickled"):
        cluster2.run(lambda: threading.Lock())
    assert cluster2.run(lambda: "still fine") == ["still fine"] * 2


@pytest.mark.parametrize("world_size", [0, -1, 2.5, "2", True, None])
def test_bad_world_size(world_size):
    with pytest.raises(ClusterError, match="world_size must be a whole number"):
        dpc.Cluster(world_size=world_size)


def test_bad_backend_requests():
    with pytest.raises(ClusterError, match="'auto', 'gloo' or 'nccl'"):
        dpc.Cluster(world_size=1, backend="mpi")
    if torch.cuda.device_count() < 64:
        with pytest.raises(ClusterError, match="needs one CUDA device per rank.*backend='gloo'"):
            dpc.Cluster(world_size=64, backend="nccl")


def test_port_in_use_is_a_clear_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ClusterError, match="in use.*master_port=None"):
            dpc.Cluster(world_size=1, master_port=s.getsockname()[1])


def test_run_after_shutdown_and_double_shutdown():
    cluster = dpc.Cluster(world_size=1)
    pids = cluster.pids + [cluster.launcher_pid]
    assert cluster.run(lambda: dist.get_world_size()) == [1]
    cluster.shutdown()
    cluster.shutdown()
    assert wait_gone(pids) == []
    with pytest.raises(ClusterError, match="shut down"):
        cluster.run(lambda: None)
    with pytest.raises(TypeError, match="needs a function"):
        dpc.Cluster.run(cluster, 42)


def test_run_cell_keeps_a_namespace_per_rank(cluster2):
    cluster2.restart()
    assert cluster2.run_cell("x = torch.tensor([rank + 1.0])\ndist.all_reduce(x)\nx.item()") == [3.0, 3.0]
    assert cluster2.run_cell("x.item() * world_size") == [6.0, 6.0]
    assert cluster2.run_cell("y = 1") == [None, None]
    with pytest.raises(dpc.RankError, match="NameError"):
        cluster2.run_cell("undefined_name")


def test_a_crashing_rank_shows_its_python_stack(cluster2):
    def crash_in_native_code():
        if dist.get_rank() == 0:
            import ctypes
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        dist.barrier()

    with pytest.raises(RankDied) as info:
        cluster2.run(crash_in_native_code)
    report = info.value.failures[0]
    assert "killed by signal 11 (SIGSEGV)" in report.summary
    assert "crash_in_native_code" in report.traceback and "Segmentation fault" in report.traceback
    assert cluster2.run(lambda: dist.get_rank()) == [0, 1]


def test_killing_the_launcher_takes_the_ranks_with_it_and_says_so():
    cluster = dpc.Cluster(world_size=2)
    ranks = cluster.pids
    os.kill(cluster.launcher_pid, signal.SIGKILL)
    assert wait_gone(ranks, 10) == []  # their death signal fired
    with pytest.raises(ClusterError, match="launcher process ended.*create a new Cluster"):
        cluster.run(lambda: None)
    cluster.shutdown()


def test_counting_collectives_keeps_no_tensor_alive(cluster2):
    """The hang diagnosis notes every collective; it must not hold the tensors they used
    (a memory measurement after a freed FSDP gradient would count it)."""
    def freed():
        import gc
        import weakref

        t = torch.ones(1000)
        dist.all_reduce(t)
        u = torch.ones(10)
        dist.all_reduce(u, async_op=True).wait()
        refs = [weakref.ref(t), weakref.ref(u)]
        del t, u
        gc.collect()
        return [r() is None for r in refs]

    assert cluster2.run(freed) == [[True, True]] * 2


def test_a_receive_nobody_sends_is_named(cluster2):
    """Point-to-point calls are counted too (at the Python functions, where they are cheap)."""
    def lonely():
        if dist.get_rank() == 0:
            dist.isend(torch.ones(2), dst=1).wait()   # matched by rank 1's first irecv
            dist.irecv(torch.empty(2), src=1).wait()  # never sent
        else:
            dist.irecv(torch.empty(2), src=0).wait()

    with pytest.raises(dpc.RankTimeout) as info:
        cluster2.run(lonely, timeout=2)
    assert "waiting in the 1st irecv of this call" in info.value.reports[0].summary
    assert info.value.reports[1].state == "finished"
