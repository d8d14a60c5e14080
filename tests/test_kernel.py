"""The pool inside a real Jupyter kernel: notebook functions, failures, interrupt, kernel death."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
from jupyter_client.manager import start_new_kernel

from conftest import wait_gone

pytestmark = pytest.mark.timeout(180)


class Kernel:
    """A real IPython kernel, driven like JupyterLab drives it."""

    def __init__(self):
        self.km, self.kc = start_new_kernel(kernel_name="python3", cwd=os.path.dirname(__file__))

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def execute(self, code: str, timeout: float = 60, interrupt_after: float | None = None) -> dict:
        """Run one cell; return its stdout, stderr, error (ename, evalue, traceback) and displays."""
        msg_id = self.kc.execute(code)
        out = {"stdout": "", "stderr": "", "error": None, "display": []}
        deadline = time.monotonic() + timeout
        interrupt_at = None if interrupt_after is None else time.monotonic() + interrupt_after
        while True:
            if interrupt_at is not None and time.monotonic() > interrupt_at:
                self.km.interrupt_kernel()  # what the notebook's stop button does
                interrupt_at = None
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except Exception:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cell did not finish in {timeout} s: {code[:80]!r}")
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind == "error":
                out["error"] = (content["ename"], content["evalue"], "\n".join(content["traceback"]))
            elif kind in ("display_data", "update_display_data", "execute_result"):
                out["display"].append(content["data"].get("text/plain", ""))
            elif kind == "status" and content["execution_state"] == "idle":
                return out

    def value(self, expr: str):
        result = self.execute(f"import json as _j; print(_j.dumps({expr}))")
        assert result["error"] is None, result["error"]
        return json.loads(result["stdout"])

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def _ok(result: dict) -> dict:
    assert result["error"] is None, result["error"][2]
    return result


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    _ok(k.execute("import dpcourse as dpc, torch, torch.distributed as dist, os, time\n"
                  "%load_ext dpcourse\ncluster = dpc.Cluster(world_size=2, timeout=60)"))
    yield k
    _ok(k.execute("cluster.shutdown()"))
    k.close()


def test_notebook_defined_function_class_and_globals(kernel):
    _ok(kernel.execute(
        "class Point:\n    def __init__(self, x): self.x = x\n"
        "scale = 10\n"
        "def where():\n    print('on rank', dist.get_rank())\n    return Point(dist.get_rank() * scale)\n"
        "points = cluster.run(where)"))
    assert kernel.value("[isinstance(p, Point) for p in points]") == [True, True]
    assert kernel.value("[p.x for p in points]") == [0, 10]
    shown = kernel.execute("cluster.run(where)")["stdout"]
    assert "[rank 0] on rank 0" in shown and "[rank 1] on rank 1" in shown


def test_error_while_other_rank_waits_shows_the_cell_line(kernel):
    result = kernel.execute(
        "def step():\n    if dist.get_rank() == 1:\n        raise RuntimeError('loss is NaN')\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "cluster.run(step)")
    ename, evalue, tb = result["error"]
    assert ename == "RankError"
    assert "rank 1 raised RuntimeError: loss is NaN" in evalue
    assert "raise RuntimeError('loss is NaN')" in evalue  # source line of the notebook cell
    assert "rank 0 was stopped while waiting in the 1st all_reduce of this call" in evalue
    assert kernel.value("cluster.run(lambda: dist.get_rank())") == [0, 1]


def test_mismatched_collectives_and_kill_9(kernel):
    result = kernel.execute(
        "def bad():\n    if dist.get_rank() == 0:\n        dist.all_reduce(torch.ones(1))\n"
        "    else:\n        dist.barrier()\n"
        "cluster.run(bad)")  # a certain deadlock: told in seconds, not after the 60 s timeout
    assert result["error"][0] == "RankDeadlock"
    assert "on the default group rank 0 waits in the 1st all_reduce of this call, rank 1 in the 1st " \
           "barrier of this call: the collectives differ" in result["error"][1]
    assert "rank 0 waiting in the 1st all_reduce of this call" in result["error"][1]
    result = kernel.execute(
        "def late():\n    if dist.get_rank() == 0:\n        dist.all_reduce(torch.ones(1))\n"
        "    else:\n        time.sleep(30)\n"
        "cluster.run(late, timeout=2)")  # undecidable: rank 1 may yet join
    assert result["error"][0] == "RankTimeout"
    assert "rank 0 waiting in the 1st all_reduce of this call" in result["error"][1]
    result = kernel.execute(
        "def die():\n    if dist.get_rank() == 0:\n        os.kill(os.getpid(), 9)\n"
        "    dist.barrier()\n"
        "cluster.run(die)")
    assert result["error"][0] == "RankDied"
    assert "killed by signal 9 (SIGKILL)" in result["error"][1]
    assert kernel.value("cluster.run(lambda: dist.get_rank())") == [0, 1]


def test_stop_button_interrupts_ranks_and_keeps_the_pool(kernel):
    start = time.monotonic()
    result = kernel.execute("cluster.run(lambda: time.sleep(60))", interrupt_after=1.0)
    assert result["error"][0] == "KeyboardInterrupt"
    assert time.monotonic() - start < 10
    assert kernel.value("cluster.run(lambda: dist.get_rank())") == [0, 1]


@pytest.mark.parametrize("cell", ["cluster.run(lambda: time.sleep(60))",
                                  "%%ranks\nimport time\ntime.sleep(60)",
                                  "%%ranks --script\nimport time\ntime.sleep(60)"])
def test_stop_button_leaves_one_message_and_no_traceback_through_the_pool(kernel, cell):
    result = kernel.execute(cell, interrupt_after=1.0)
    ename, evalue, tb = result["error"]
    assert ename == "KeyboardInterrupt"
    assert evalue.startswith("the call was interrupted") and evalue.endswith("the cluster is ready.")
    for internal in ("link.py", "selectors", "connection.py", "call.py", "procs.py", "health.py",
                     "cluster.py", "magic.py", "During handling", "Traceback"):
        assert internal not in tb, tb
    assert "interrupted" not in result["stderr"], result["stderr"]  # said once, in the error
    assert kernel.value("cluster.run(lambda: dist.get_rank())") == [0, 1]


def test_ranks_magic_keeps_state_and_streams_progress(kernel):
    result = _ok(kernel.execute(
        "%%ranks -o totals\n"
        "import time\n"
        "x = torch.tensor([rank + 1.0])\n"
        "dist.all_reduce(x)\n"
        "for i in range(3):\n    print(f'step {i}', end='\\r')\n    time.sleep(0.15)\n"
        "print('done')\n"
        "x.item()"))
    assert "[rank 0] Out: 3.0" in result["stdout"] and "[rank 1] done" in result["stdout"]
    assert any("step" in d for d in result["display"])  # the live per-rank progress line
    assert kernel.value("totals") == [3.0, 3.0]
    result = _ok(kernel.execute("%%ranks\nx.item() * world_size"))
    assert "[rank 1] Out: 6.0" in result["stdout"]


def _cluster_pids(k: Kernel) -> list[int]:
    """The ranks, the launcher, and what a %%ranks cell started on each rank: a ``sleep`` by
    ``subprocess.Popen`` and a daemon in a session of its own (a double fork)."""
    _ok(k.execute("import dpcourse as dpc\n%load_ext dpcourse\ncluster = dpc.Cluster(world_size=2)"))
    _ok(k.execute("%%ranks -q -o started\nimport os, subprocess\n"
                  "sleeper = subprocess.Popen(['sleep', '600'])\n"
                  "r, w = os.pipe()\n"
                  "if os.fork() == 0:\n"
                  "    os.setsid()\n"
                  "    pid = os.fork()\n"
                  "    if pid == 0:\n"
                  "        os.execvp('sleep', ['sleep', '601'])\n"
                  "    os.write(w, str(pid).encode())\n"
                  "    os._exit(0)\n"
                  "[sleeper.pid, int(os.read(r, 32))]"))
    pids = k.value("cluster.pids + [cluster.launcher_pid] + [p for pair in started for p in pair]")
    assert len(pids) == 7 and wait_gone(pids, 0) == pids  # all running
    return pids


@pytest.mark.parametrize("how", ["shutdown", "restart", "kill -9"])
def test_kernel_end_leaves_no_process_behind(how):
    k = Kernel()
    try:
        pids = _cluster_pids(k)
        if how == "shutdown":
            k.km.shutdown_kernel(now=False)
        elif how == "restart":
            k.km.restart_kernel(now=False)
        else:
            os.kill(k.pid, signal.SIGKILL)
        assert wait_gone(pids, 10) == []  # dead; their new parent reaps them
    finally:
        k.close()


def test_ranks_script_cell_runs_torchrun_style_code(kernel):
    result = _ok(kernel.execute(
        "%%ranks --script --argv '--steps 2' -o codes\n"
        "import sys, torch, torch.distributed as dist\n"
        "def main():\n"
        "    dist.init_process_group('gloo')\n"
        "    t = torch.ones(1)\n"
        "    dist.all_reduce(t)\n"
        "    print('sum', int(t.item()), sys.argv[1:])\n"
        "    dist.destroy_process_group()\n"
        "if __name__ == '__main__':\n"
        "    main()\n"))
    assert "[rank 1] sum 2 ['--steps', '2']" in result["stdout"]
    assert kernel.value("codes") == [0, 0]
    assert kernel.value("cluster.run(lambda: dist.get_world_size())") == [2, 2]
    result = kernel.execute("%%ranks --script\nimport os, sys\nsys.exit(int(os.environ['RANK']) * 4)\n")
    assert result["error"][0] == "RankError" and "rank 1 exited with code 4" in result["error"][1]


def test_ranks_script_with_a_file_runs_it_with_its_folder_first(kernel, tmp_path):
    (tmp_path / "helper_mod.py").write_text("VALUE = 41\n")
    (tmp_path / "main.py").write_text("import os, sys, helper_mod\n"
                                      "sys.exit(0 if helper_mod.VALUE == 41 else 3 + int(os.environ['RANK']))\n")
    main = tmp_path / "main.py"
    _ok(kernel.execute(f"%ranks --script {main} -o by_line"))
    assert kernel.value("by_line") == [0, 0]
    _ok(kernel.execute(f"%%ranks --script {main} -o by_cell\n# the FSDP2 example, as it is\n"))
    assert kernel.value("by_cell") == [0, 0]
    for cell, said in ((f"%ranks {main}", "without --script"), ("%ranks --script", "runs a script file"),
                       (f"%%ranks --script {main}\nprint('code')\n", "not the cell's code")):
        result = kernel.execute(cell)
        assert result["error"] is not None and result["error"][0] == "ClusterError", (cell, result)
        assert said in result["error"][1]
