"""A script on the ranks behaves as under ``python``/torchrun: its folder first on ``sys.path``,
the learner's modules imported afresh each run, and no process it started left running.

On 2 and 3 ranks, forked and spawned."""
from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc
from conftest import wait_gone

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", params=[("fork", 2), ("fork", 3), ("spawn", 2), ("spawn", 3)],
                ids=lambda p: f"{p[0]}-{p[1]}")
def cluster(request):
    method, world_size = request.param
    with dpc.Cluster(world_size, start_method=method, timeout=120) as c:
        yield c


# --- 1. the script's folder ------------------------------------------------------------
def test_the_scripts_folder_is_first_on_sys_path_for_the_run_only(cluster, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "checkpoint.py").write_text("NAME = 'sibling'\n")
    (project / "main.py").write_text(textwrap.dedent('''
        import os, sys
        assert sys.path[0] == os.path.dirname(os.path.abspath(__file__)), sys.path[:3]
        from checkpoint import NAME          # a sibling module, as the FSDP2 example imports
        assert NAME == "sibling"
    '''))
    before = cluster.run(lambda: list(sys.path))
    assert os.getcwd() != str(project)
    assert cluster.run_script(project / "main.py") == [0] * cluster.world_size
    assert cluster.run(lambda: list(sys.path)) == before  # taken off again
    # a %%ranks --script cell runs as `python -c` would: the working folder first
    cell = "import os, sys\nassert sys.path[0] == os.getcwd(), sys.path[:2]\n"
    assert cluster.run_script_source(cell) == [0] * cluster.world_size
    assert cluster.run(lambda: list(sys.path)) == before


# --- 2. fresh modules ----------------------------------------------------------------------
FSDP2_EXAMPLE = textwrap.dedent('''
    import os, sys
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from model import ModelArgs, Transformer
    from utils import inspect_model

    def main(out):
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(0)
        model = Transformer(ModelArgs())
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, ModelArgs.dim, generator=torch.Generator().manual_seed(dist.get_rank()))
        model(x).pow(2).mean().backward()
        opt.step()
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                f.write(inspect_model(model))
        dist.destroy_process_group()

    if __name__ == "__main__":
        main(sys.argv[1])
''')

MODEL = textwrap.dedent('''
    from dataclasses import dataclass
    import torch

    @dataclass
    class ModelArgs:
        dim = 8
        n_layers = 2

    class Transformer(torch.nn.Module):
        def __init__(self, args):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(args.dim, args.dim) for _ in range(args.n_layers))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x
''')


def _utils(tag: str) -> str:
    return f"TAG = {tag!r}\ndef inspect_model(model):\n    return TAG + ' ' + type(model).__name__\n"


def test_fsdp2_examples_layout_sees_each_edit_and_projects_never_collide(cluster, tmp_path):
    """The FSDP2 example's layout: a script beside model.py and utils.py, run from another
    folder; a sibling edited between runs shows at once; a second project's utils.py is its own."""
    out = tmp_path / "out.txt"
    projects = {}
    for name in ("fsdp2", "other"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "example.py").write_text(FSDP2_EXAMPLE)
        (folder / "model.py").write_text(MODEL)
        (folder / "utils.py").write_text(_utils(f"{name}-v1"))
        projects[name] = folder / "example.py"
    n = cluster.world_size
    assert cluster.run_script(projects["fsdp2"], out) == [0] * n
    assert out.read_text() == "fsdp2-v1 FSDPTransformer"
    (tmp_path / "fsdp2" / "utils.py").write_text(_utils("fsdp2-version-2"))  # edited between runs
    assert cluster.run_script(projects["fsdp2"], out) == [0] * n
    assert out.read_text() == "fsdp2-version-2 FSDPTransformer"
    assert cluster.run_script(projects["other"], out) == [0] * n  # its own utils.py, not the other
    assert out.read_text() == "other-v1 FSDPTransformer"
    # nothing of the learner's stays loaded between runs; torch's modules do
    loaded = cluster.run(lambda: sorted({"utils", "model", "torch.distributed.fsdp"} & set(sys.modules)))
    assert loaded == [["torch.distributed.fsdp"]] * n
    (tmp_path / "fsdp2" / "utils.py").unlink()  # deleted: the next run fails as `python` would
    with pytest.raises(dpc.RankError, match="No module named 'utils'"):
        cluster.run_script(projects["fsdp2"], out)


def test_a_notebook_module_is_set_aside_during_a_script_and_back_after(cluster, tmp_path):
    """A module the notebook's functions imported on the ranks (here from a user path) neither
    shadows a script's own module of that name nor is lost to it."""
    mine, project = tmp_path / "mine", tmp_path / "project"
    mine.mkdir(), project.mkdir()
    (mine / "helpers.py").write_text("WHO = 'notebook'\n")
    (project / "helpers.py").write_text("WHO = 'script'\n")
    (project / "main.py").write_text("import helpers\nassert helpers.WHO == 'script', helpers.WHO\n")

    def load(folder):
        sys.path.append(folder)
        import helpers

        return helpers.WHO

    assert cluster.run(load, str(mine)) == ["notebook"] * cluster.world_size
    try:
        assert cluster.run_script(project / "main.py") == [0] * cluster.world_size
        assert cluster.run(lambda: sys.modules["helpers"].WHO) == ["notebook"] * cluster.world_size
    finally:
        cluster.run(lambda: (sys.path.remove(str(mine)), sys.modules.pop("helpers", None)) and None)


def test_a_notebook_function_still_travels_by_value(cluster):
    scale = 7

    def times_rank():
        return dist.get_rank() * scale

    assert cluster.run(times_rank) == [r * 7 for r in range(cluster.world_size)]


# --- 3. no process left running ------------------------------------------------------------
LEAKS = textwrap.dedent('''
    import multiprocessing as mp, os, subprocess, sys, time

    def sleep():
        time.sleep(300)

    def daemon(out):
        # the classic double fork: the grandchild leaves the rank's session and process group
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                with open(out, "a") as f:
                    f.write(f"{os.getpid()}\\n")
                time.sleep(300)
            os._exit(0)

    if __name__ == "__main__":
        out, rank = sys.argv[1], int(os.environ["RANK"])
        started = []
        if rank == 1:
            started.append(mp.get_context("fork").Process(target=sleep))
            started.append(mp.get_context("spawn").Process(target=sleep))
            for p in started:
                p.start()                                   # never joined: the tutorials' pattern
            started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]))
            daemon(out)
            time.sleep(0.5)  # the daemon has written its PID
        with open(out, "a") as f:
            f.write("".join(f"{p.pid}\\n" for p in started))
''')


def test_what_a_script_starts_ends_with_the_script(cluster, tmp_path, capfd):
    script, out = tmp_path / "leaks.py", tmp_path / "pids.txt"
    script.write_text(LEAKS)
    out.write_text("")
    start = time.monotonic()
    assert cluster.run_script(script, out) == [0] * cluster.world_size
    took = time.monotonic() - start
    pids = [int(line) for line in out.read_text().split()]
    assert len(pids) == 4
    assert wait_gone(pids, timeout=3) == []
    err = capfd.readouterr().err
    assert "dpcourse: rank 1's script left " in err and "were stopped" in err
    print(f"\nscript with 4 leftover processes: {took:.1f} s, {err.strip()}")
    assert cluster.run(lambda: dist.get_rank()) == list(range(cluster.world_size))


def _start_sleeper():
    import subprocess

    if dist.get_rank() == 0:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                start_new_session=True).pid
    return None


def test_what_a_call_starts_ends_when_the_ranks_restart(cluster, capfd):
    pid = cluster.run(_start_sleeper)[0]
    assert wait_gone([pid], timeout=0) == [pid]  # a call's processes live until the ranks restart
    cluster.restart()
    assert wait_gone([pid], timeout=3) == []
    assert f"rank 0 left 1 process running (pid {pid} python); it was stopped with the ranks" \
        in capfd.readouterr().err


def test_what_a_call_starts_ends_at_shutdown():
    cluster = dpc.Cluster(2)
    pid = cluster.run(_start_sleeper)[0]
    cluster.shutdown()
    assert wait_gone([pid], timeout=5) == []


FORKS_THAT_END = textwrap.dedent('''
    import multiprocessing as mp, os, sys

    def work(q):
        q.put(os.getpid())

    if __name__ == "__main__":
        q = mp.get_context("fork").Queue()
        p = mp.get_context("fork").Process(target=work, args=(q,))
        p.start()
        child = q.get(timeout=30)
        p.join(30)                      # a multiprocessing child ends with os._exit: its own
        assert p.exitcode == 0, p.exitcode
        pid = os.fork()
        if pid == 0:
            sys.exit(7)                 # a bare fork's child leaves the script, as under python
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 7, status
        print("children ended", child != os.getpid())
''')


def test_forked_children_that_end_end_as_under_python(cluster, tmp_path, capfd):
    """A process forked by a script must end where it would under ``python`` (``os._exit``,
    ``sys.exit``, falling off the end) and never go on as a copy of the rank."""
    script = tmp_path / "forks.py"
    script.write_text(FORKS_THAT_END)
    pids = cluster.pids
    for _ in range(2):
        assert cluster.run_script(script, timeout=60) == [0] * cluster.world_size
    assert capfd.readouterr().out.count("children ended True") == 2 * cluster.world_size
    assert cluster.pids == pids  # no rank failed or restarted
    assert cluster.run(lambda: dist.get_rank()) == list(range(cluster.world_size))
