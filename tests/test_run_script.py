"""Torchrun-style code on the notebook's ranks: scripts, init/destroy of the process group,
``__main__`` cells, and what the kernel says when a rank dies of memory."""
from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc
from dpcourse.pool.errors import ClusterError, RankDied
from dpcourse.backends import GPU_BACKEND, BackendError, choose_backend
from dpcourse.processes import launch_env, run_process, torchrun_command

pytestmark = pytest.mark.timeout(180)

# One DDP step from fixed data, written the way the PyTorch tutorials write it: the script
# owns its process group. Rank 0 saves the weights after the step to argv[1].
DDP_STEP = textwrap.dedent('''
    import os, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def main(out):
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        assert int(os.environ["LOCAL_RANK"]) == rank and int(os.environ["WORLD_SIZE"]) == world
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
        shard = data.chunk(world)[rank]   # equal shards of one global batch of 8
        model(shard).pow(2).mean().backward()
        opt.step()
        if rank == 0:
            torch.save(model.module.state_dict(), out)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        main(sys.argv[1])
''')


def single_process_step() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    model(data).pow(2).mean().backward()
    opt.step()
    return model.state_dict()


def assert_same_weights(path, expected):
    got = torch.load(path)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripts") / "ddp_step.py"
    path.write_text(DDP_STEP)
    return path


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_torchrun_script_runs_unchanged_on_the_ranks(script, tmp_path, world_size):
    out = tmp_path / "weights.pt"
    with dpc.Cluster(world_size=world_size, timeout=90) as cluster:
        assert cluster.run_script(script, out) == [0] * world_size
        assert_same_weights(out, single_process_step())
        # the cluster's own group is back, with the same ranks
        assert cluster.run(lambda: (dist.get_rank(), dist.get_world_size())) == \
            [(r, world_size) for r in range(world_size)]


def test_scripts_back_to_back_never_deadlock_in_the_groups_teardown(script, tmp_path):
    """When a DDP script ends, DDP's Reducer can drop the last reference to the Gloo group
    while holding the GIL; the group's destructor then waits for a worker thread that waits
    for the GIL: a rank hangs in C++ (about one run in six on 2 cores, before the pool
    kept a script's groups alive until the script returned). 30 runs in a row must pass."""
    out = tmp_path / "weights.pt"
    with dpc.Cluster(world_size=2, timeout=60) as cluster:
        for _ in range(30):
            assert cluster.run_script(script, out, timeout=20) == [0, 0]
        assert cluster.run(lambda: dist.get_world_size()) == [2, 2]


def test_the_same_script_under_torchrun_gives_the_same_weights(script, tmp_path):
    out = tmp_path / "weights.pt"
    proc = run_process(torchrun_command(2, script, out), timeout=120, env=launch_env(),
                       stderr=subprocess.STDOUT, text=True)  # past the timeout: ended, with its workers
    assert proc.returncode == 0, proc.stdout
    assert_same_weights(out, single_process_step())


def test_exit_codes_hangs_and_errors_of_scripts(cluster2, tmp_path):
    exits = tmp_path / "exits.py"
    exits.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(3)\n")
    with pytest.raises(dpc.RankError) as info:
        cluster2.run_script(exits)
    assert info.value.failures[1].summary == "exited with code 3" and 0 not in info.value.failures
    assert cluster2.run(lambda: dist.get_rank()) == [0, 1]

    # os._exit ends the process under torchrun; on the ranks it ends the script, not the rank
    hard = tmp_path / "hard_exit.py"
    hard.write_text("import os, sys\nprint('before', flush=True)\nos._exit(3 if os.environ['RANK'] == '1' else 0)\n"
                    "print('never')\n")
    pids = cluster2.pids
    with pytest.raises(dpc.RankError) as info:
        cluster2.run_script(hard)
    assert info.value.failures[1].summary == "exited with code 3" and 0 not in info.value.failures
    assert cluster2.run(lambda: (os.getpid(), os._exit.__module__)) == [(pid, "posix") for pid in pids]

    hangs = tmp_path / "hangs.py"
    hangs.write_text(textwrap.dedent('''
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))
        dist.barrier()
    '''))
    with pytest.raises(dpc.RankTimeout) as info:
        cluster2.run_script(hangs, timeout=8)
    reports = info.value.reports
    assert "waiting in the 1st all_reduce of this call" in reports[0].summary
    assert "waiting in the 1st barrier of this call" in reports[1].summary
    assert "hangs.py" in reports[0].traceback
    assert cluster2.run(lambda: dist.get_rank()) == [0, 1]

    raises = tmp_path / "raises.py"
    raises.write_text("import sys\nraise ValueError(f'bad argument {sys.argv[1]}')\n")
    with pytest.raises(dpc.RankError, match=r"ValueError: bad argument --lr") as info:
        cluster2.run_script(raises, "--lr", 0.1)
    assert "raises.py" in info.value.failures[0].traceback
    with pytest.raises(ClusterError, match="cannot read the script"):
        cluster2.run_script(tmp_path / "missing.py")
    assert cluster2.run(lambda: dist.get_world_size()) == [2, 2]


def test_script_environment_is_torchruns_and_is_restored(cluster2):
    before = cluster2.run(lambda: dict(os.environ))
    source = textwrap.dedent('''
        import os, sys, torch.distributed as dist
        assert not dist.is_initialized(), "a script starts without a process group"
        assert __name__ == "__main__" and sys.argv[1:] == ["a", "1"]
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")
        print({k: os.environ[k] for k in keys})
        os.environ["MASTER_PORT"] = "1"   # tutorials set these; the cluster must not keep them
    ''')
    assert cluster2.run_script_source(source, "a", 1) == [0, 0]
    after = cluster2.run(lambda: dict(os.environ))
    # MASTER_PORT now names the port of the cluster's new group; everything else is as before
    assert [a.pop("MASTER_PORT") != "1" for a in after] == [True, True]
    assert after == [{k: v for k, v in b.items() if k != "MASTER_PORT"} for b in before]


def test_destroy_process_group_in_a_call_is_recovered(cluster2, capfd):
    def cleanup():
        dist.destroy_process_group()   # what every tutorial's cleanup() does

    cluster2.run(cleanup)
    capfd.readouterr()
    assert cluster2.run(lambda: dist.get_world_size()) == [2, 2]
    assert "destroyed the process group on every rank; the cluster re-initialised it" in capfd.readouterr().err
    pids = cluster2.pids

    def only_rank_one():
        if dist.get_rank() == 1:
            dist.destroy_process_group()

    cluster2.run(only_rank_one)
    assert cluster2.run(lambda: torch.ones(1).add_(dist.get_rank()).tolist()) == [[1.0], [2.0]]
    assert cluster2.pids == pids  # re-initialised, not restarted: rank variables survive


def test_init_process_group_in_a_call_says_what_to_do(cluster2):
    def setup():
        dist.init_process_group("gloo")   # what the tutorials' setup() does

    with pytest.raises(dpc.RankError, match=r"already belongs to the cluster's process group") as info:
        cluster2.run(setup)
    text = str(info.value)
    assert "run_script" in text and "Drop the init_process_group" in text
    assert "group.py" not in text  # the pool's own frames are hidden
    assert cluster2.run(lambda: dist.get_rank()) == [0, 1]


def test_main_guarded_cells_run(cluster2):
    cell = textwrap.dedent('''
        def main():
            return rank * 10
        if __name__ == "__main__":
            result = main()
        result
    ''')
    assert cluster2.run_cell(cell) == [0, 10]


def test_auto_backend_serves_cpu_and_cuda_tensors_with_one_gpu_per_rank():
    assert choose_backend("auto", 4, gpus=4) == GPU_BACKEND == "cpu:gloo,cuda:nccl"
    assert choose_backend("auto", 4, gpus=8) == GPU_BACKEND
    assert choose_backend("auto", 4, gpus=2) == "gloo"
    assert choose_backend("auto", 2, gpus=0) == "gloo"
    assert choose_backend("gloo", 2, gpus=8) == "gloo"
    assert choose_backend("nccl", 2, gpus=2) == "nccl"
    with pytest.raises(BackendError, match="needs one CUDA device per rank"):
        choose_backend("nccl", 4, gpus=2)
    with pytest.raises(BackendError, match="'auto', 'gloo' or 'nccl'"):
        choose_backend("mpi", 2, gpus=0)


def test_memory_error_on_a_rank_is_a_rank_error(cluster2):
    def allocate_past_a_limit():
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (size + 256 * 2**20, hard))
        try:
            if dist.get_rank() == 1:
                return len(bytearray(2**30))
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

    with pytest.raises(dpc.RankError, match="MemoryError") as info:
        cluster2.run(allocate_past_a_limit)
    assert list(info.value.failures) == [1]
    assert cluster2.run(lambda: dist.get_rank()) == [0, 1]


def test_a_rank_killed_with_high_memory_is_reported_as_likely_oom(cluster2, monkeypatch):
    from dpcourse.pool.kernel.procs import MemoryWatch

    monkeypatch.setattr(MemoryWatch, "LIKELY_OOM_FRACTION", 0.001)  # ~24 MiB on a 24 GiB machine
    victim = cluster2.pids[1]

    def hold_memory():
        keep = torch.ones(64 * 2**20 // 4)  # 64 MiB, resident
        time.sleep(30 if dist.get_rank() == 1 else 0)
        return float(keep[0])

    import threading

    threading.Timer(1.5, os.kill, (victim, signal.SIGKILL)).start()  # a rank this test started
    with pytest.raises(RankDied) as info:
        cluster2.run(hold_memory, timeout=60)
    summary = info.value.failures[1].summary
    assert "killed by signal 9 (SIGKILL)" in summary and "resident at its peak" in summary
    assert "likely out of memory" in summary
    with open("/proc/self/oom_score_adj") as f:
        assert int(f.read()) < 1000  # the kernel (here: pytest) stays a worse OOM choice
    assert cluster2.run(lambda: int(open("/proc/self/oom_score_adj").read())) == [1000, 1000]
