"""The observation core, in one process: one step clock however many observers watch, one
byte convention (nccl-tests' payload S), and the torchrun-side recorder whose patches are
undone when it is left, installed without hiding another ``sitecustomize``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dpcourse
from dpcourse.observe.payload import payload_bytes
from dpcourse.observe.watch import LoopWatch, StepClock

pytestmark = pytest.mark.timeout(240)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dpcourse.__file__)))
SITE = os.path.join(PACKAGE_ROOT, "dpcourse", "exercises", "site")   # what a checker puts first on PYTHONPATH


def _global_hooks() -> tuple[int, int, int, int]:
    from torch.nn.modules import module
    from torch.optim import optimizer

    return (len(module._global_forward_pre_hooks), len(module._global_forward_hooks),
            len(optimizer._global_optimizer_pre_hooks), len(optimizer._global_optimizer_post_hooks))


def test_every_collective_counts_its_nccl_tests_payload():
    out, whole = torch.empty(4), torch.empty(16)   # 16 and 64 bytes: one rank's share of 4, the whole
    assert payload_bytes("reduce_scatter", out, whole) == 64     # the input, not the 1/N output
    assert payload_bytes("all_gather", whole, out) == 64         # the output, not one rank's input
    assert payload_bytes("all_gather", [out] * 4, out) == 64     # list form: every rank's share
    assert payload_bytes("all_reduce", whole) == 64
    assert payload_bytes("all_to_all", whole, whole) == 64
    assert payload_bytes("send", out) == 16
    assert payload_bytes("barrier", whole) == 0


def test_watches_entered_together_share_one_clock_and_count_from_their_entry():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _global_hooks()

    def step():
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()

    layers: list = []
    first = LoopWatch(on_module_forward=lambda module, _args: layers.append(module))
    with first:
        step()
        with LoopWatch() as second, LoopWatch():
            assert _global_hooks() == tuple(b + 1 for b in before)   # one set of hooks for three watches
            step()
            assert second.root is model and second.optimizer is optimizer
        assert (first.steps, second.steps) == (2, 1)
        assert second.root is None   # a watch left holds nothing of the run
    assert first.steps == 2 and _global_hooks() == before and StepClock._current is None
    assert layers == [model, model[0], model[1]] * 2


RECORDED = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import dpcourse
    from torch.utils.data import DataLoader
    from dpcourse.exercises.recorder import ScriptRecorder, read_log
    from dpcourse.torch_private import functional_collectives

    funcol = functional_collectives()

    def installed():
        from torch.nn.modules import module
        from torch.optim import optimizer
        return [torch.save, dist.init_process_group, dist.distributed_c10d.init_process_group,
                dist.destroy_process_group, torch.autograd.backward, torch.optim.Optimizer.__init__,
                DataLoader.__iter__, dpcourse.models.make_dataset, funcol.wait_tensor, funcol.all_reduce,
                dist.isend, len(module._global_forward_pre_hooks), len(optimizer._global_optimizer_post_hooks)]

    directory = sys.argv[1]
    before = installed()
    with ScriptRecorder(directory, 0):
        assert installed() != before
        dist.init_process_group("gloo", init_method="file://" + os.path.join(directory, "store"),
                                rank=0, world_size=1)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for x, y in DataLoader(dpcourse.models.make_dataset("mlp", 4, d_in=2, d_out=1), batch_size=2):
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        dist.all_reduce(torch.ones(8))
        torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
        dist.destroy_process_group()
    assert installed() == before, [a for a, b in zip(installed(), before) if a != b]
    log = read_log(directory, 0)
    assert log["destroyed"] and len(log["epochs"]) == 1 and sorted(log["epochs"][0]) == [0, 1, 2, 3], log
""")


def test_the_script_recorder_records_and_then_undoes_every_patch(tmp_path):
    script = tmp_path / "recorded.py"
    script.write_text(RECORDED)
    env = {**os.environ, "PYTHONPATH": PACKAGE_ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("DPCOURSE_OBSERVE_DIR", None)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    from dpcourse.exercises.recorder import Lr, Save, Step
    from dpcourse.grading.events import Comm, Destroy, Done, Pid, read_events

    events = read_events(str(tmp_path), 0)
    assert isinstance(events[0], Pid) and events[0].pid > 0
    assert Comm(2, "all_reduce", "float32", 32, 1, 1, "c10d") in events   # issued after step 2; 8 floats
    assert Done(1) in events and Destroy() in events and sum(isinstance(e, Step) for e in events) == 2
    assert Save(str(tmp_path / "model.pt")) in events
    assert [e for e in events if isinstance(e, Lr)] == [Lr(0, 0.5), Lr(1, 0.5)]


OTHER_SITECUSTOMIZE = "import os\nopen(os.environ['OTHER_SITE_MARK'], 'w').write('ran')\n"


@pytest.mark.parametrize("observed", [True, False])
def test_the_checkers_sitecustomize_still_runs_another_on_the_path(tmp_path, observed):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text(OTHER_SITECUSTOMIZE)
    mark, logs = tmp_path / "mark", tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SITE, PACKAGE_ROOT, str(other)]),
           "OTHER_SITE_MARK": str(mark), "RANK": "0", "OMP_NUM_THREADS": "1"}
    env.pop("DPCOURSE_OBSERVE_DIR", None)
    if observed:
        env["DPCOURSE_OBSERVE_DIR"] = str(logs)
    probe = "import sitecustomize, sys; print(sitecustomize.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert mark.read_text() == "ran"
    assert done.stdout.strip() == str(other / "sitecustomize.py")   # `import sitecustomize` finds the other
    log = logs / "rank0.jsonl"
    assert log.exists() == observed
    if observed:
        assert json.loads(log.read_text().splitlines()[0])["event"] == "Pid"
