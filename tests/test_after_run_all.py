"""After Run All, whose last cell shuts the notebook's cluster down: a try-it or exercise
checked then starts the ranks again and passes; a call says in one line what to run; the first
cell runs again quietly (``%reload_ext dpcourse``) and shows the start's progress; an error in
the notebook carries no frame of the course. Real clusters, a real Jupyter kernel."""
from __future__ import annotations

import re

import torch.distributed as dist

import dpcourse as dpc
from dpcourse.exercises import tryits
from dpcourse.pool.errors import ClusterError

from conftest import wait_gone


def test_a_call_after_shutdown_says_in_one_line_what_to_run_and_restart_starts_it_again():
    cluster = dpc.Cluster(world_size=2, current=False)
    first = cluster.pids + [cluster.launcher_pid]
    cluster.shutdown()
    assert wait_gone(first) == []
    try:
        cluster.run(lambda: 1)
    except ClusterError as err:
        shown = err._render_traceback_()   # what IPython shows instead of a traceback
        assert len(shown) == 1 and "shut down" in shown[0] and "cluster.restart()" in shown[0], shown
    else:
        raise AssertionError("a call on a shut-down cluster ran")
    cluster.restart()
    try:
        assert not cluster.closed and cluster.run(lambda: dist.get_world_size()) == [2, 2]
        assert set(cluster.pids).isdisjoint(first)
    finally:
        again = cluster.pids + [cluster.launcher_pid]
        cluster.shutdown()
    assert wait_gone(again) == []


def _no_sync_reference():
    from dpcourse.grading import provenance

    with provenance.quiet():
        source = dpc.exercises.solution("no_sync")
    namespace = {"__name__": "__main__"}
    exec("import torch\nimport torch.distributed as dist\nfrom torch.nn.parallel import "
         "DistributedDataParallel as DDP\n" + source, namespace)
    return namespace["accumulate"]


def test_a_try_it_checked_after_the_last_cell_shut_the_cluster_down_starts_it_and_passes(capsys):
    cluster = dpc.Cluster(world_size=2, current=False)
    cluster.shutdown()
    try:
        report = tryits.check("4.2a", "no_sync", _no_sync_reference(), cluster, second=False)
        assert report.passed, str(report)
        assert not cluster.closed
        said = capsys.readouterr()
        assert "was shut down" in said.out and "starting its 2 ranks again" in said.out and not said.err
    finally:
        pids = cluster.pids + [cluster.launcher_pid]
        cluster.shutdown()
    assert wait_gone(pids) == []


def test_in_a_kernel_start_shows_progress_the_first_cell_reruns_quietly_and_calls_say_what_to_run():
    """A real kernel, as JupyterLab drives it: the first cell twice (``%reload_ext``), the
    start's progress line updated in place, then what Run All's last cell leaves."""
    from test_kernel import Kernel

    kernel = Kernel()
    try:
        first = ("import torch, torch.distributed as dist\nimport dpcourse as dpc\n%reload_ext dpcourse\n"
                 "cluster = dpc.Cluster(world_size=2)")
        for _ in range(2):
            shown = kernel.execute(first)
            assert shown["error"] is None and shown["stdout"] == "" and shown["stderr"] == "", shown
            assert "dpcourse: starting 2 ranks" in shown["display"][0], shown["display"]
            assert re.fullmatch(r"dpcourse: 2 ranks ready in [\d.]+ s", shown["display"][-1]), shown["display"]
        deadlock = kernel.execute("%%ranks\nt = torch.zeros(1)\nif rank == 0:\n    dist.recv(t, src=1)")["error"]
        raised = kernel.execute("def f():\n    raise ValueError('boom')\ncluster.run(f)")["error"]
        for ename, _, traceback in (deadlock, raised):  # the ranks' report, none of the course's frames
            assert not any(f in traceback for f in ("magic.py", "cluster.py", "interactiveshell.py")), traceback
        assert deadlock[0] == "RankDeadlock" and '<ranks-cell-1>", line 3' in deadlock[2], deadlock[2]
        assert "----> cluster.run(f)" in raised[2] and "raise ValueError('boom')" in raised[2], raised[2]
        assert kernel.execute("cluster.shutdown()")["error"] is None
        for cell in ("cluster.run(lambda: 1)", "%%ranks\nrank"):
            ename, evalue, traceback = kernel.execute(cell)["error"]
            assert ename == "ClusterError" and "cluster.restart()" in evalue
            assert len(traceback.splitlines()) == 1, traceback  # one line, no frames of the course
        again = kernel.execute("cluster.restart()\nprint(cluster.run(lambda: 7))")
        assert again["stdout"] == "[7, 7]\n" and "ready in" in again["display"][-1], again
        pids = kernel.value("cluster.pids + [cluster.launcher_pid]")
        assert kernel.execute("cluster.shutdown()")["error"] is None
        assert wait_gone(pids) == []
    finally:
        kernel.close()


def test_an_exercise_checker_given_the_shut_down_cluster_starts_it_again(capsys):
    from dpcourse.grading.judging import clusters_for

    cluster = dpc.Cluster(world_size=2, current=False)
    cluster.shutdown()
    try:
        with clusters_for(cluster, [2]) as clusters:
            assert clusters[2] is cluster and cluster.run(lambda: dist.get_world_size()) == [2, 2]
        assert "starting its 2 ranks again" in capsys.readouterr().out
    finally:
        pids = cluster.pids + [cluster.launcher_pid]
        cluster.shutdown()
    assert wait_gone(pids) == []
