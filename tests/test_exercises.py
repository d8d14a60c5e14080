"""Exercise checkers: the reference passes, an untouched starter is "not attempted", and each
typical mistake fails with the item named. Every run is a real torchrun launch on 2 ranks."""
from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import dpcourse as dpc

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = Path(dpc.scripts.path("train_ddp")).read_text()

# A DDP conversion written independently of the reference: no helper functions, the rank
# from the environment, no barrier, a different log line. It must pass.
INDEPENDENT = textwrap.dedent('''
    import argparse, os
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler
    from dpcourse.models import MLP, make_dataset

    p = argparse.ArgumentParser()
    for name, kind, default in [("--epochs", int, 3), ("--batch-size", int, 32), ("--lr", float, 0.05),
                                ("--num-samples", int, 256), ("--seed", int, 0), ("--out", str, "model.pt"),
                                ("--max-norm", float, 0.5)]:
        p.add_argument(name, type=kind, default=default)
    args = p.parse_args()
    dist.init_process_group(backend="gloo")
    torch.manual_seed(args.seed)
    net = MLP()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    data = make_dataset("mlp", args.num_samples)
    sampler = DistributedSampler(data, num_replicas=int(os.environ["WORLD_SIZE"]),
                                 rank=int(os.environ["RANK"]), shuffle=True, seed=args.seed)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=args.batch_size, sampler=sampler):
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=args.max_norm)
            opt.step()
        EVALUATE
        if dist.get_rank() == 0:
            print("done with epoch", epoch)
    if dist.get_rank() == 0:
        torch.save(net.state_dict(), args.out)
    dist.destroy_process_group()
''')

# evaluations on the whole dataset after every epoch: not training epochs, whoever runs them
EVALUATIONS = {
    "no evaluation": "pass",
    "every rank evaluates": """with torch.no_grad():
            loss = sum(F.mse_loss(ddp(x), y, reduction="sum") for x, y in DataLoader(data, batch_size=64))""",
    "rank 0 evaluates": """if dist.get_rank() == 0:
            with torch.no_grad():
                loss = sum(F.mse_loss(net(x), y, reduction="sum") for x, y in DataLoader(data, batch_size=50))""",
}

# (mistake, edit of the reference, the item that must fail, words its detail must contain)
MISTAKES = [
    ("no DistributedSampler",
     ("sampler = DistributedSampler(dataset, seed=args.seed)",
      "sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(0))\n"
      "    sampler.set_epoch = lambda epoch: None"),
     "each epoch, the ranks read disjoint samples", "both read samples"),
    ("no set_epoch",
     ("        sampler.set_epoch(epoch)", "        pass"),
     "the order changes between epochs", "reshuffle for a new epoch"),
    ("every rank saves",
     ("    if rank == 0:  # the replicas are identical, so one copy is enough", "    if True:"),
     "only rank 0 writes the checkpoint", "rank 1 also called torch.save"),
    ("saves the DDP wrapper",
     ("torch.save(model.module.state_dict(), args.out)", "torch.save(model.state_dict(), args.out)"),
     "the checkpoint loads into the plain model", "the DDP wrapper's names"),
    ("sums instead of averaging",
     ("loss = F.mse_loss(model(x), y)", "loss = F.mse_loss(model(x), y, reduction=\"sum\")"),
     "final weights equal the reference", "averaged"),
    ("never destroys the group",
     ("    dist.destroy_process_group()\n", "\n"),
     "destroys the process group on every rank", "ended without leaving the process group"),
]


def assert_teaches(report, reference: str) -> None:
    """A failed report names behaviours, never a line of the reference; the line is on request."""
    lines = {line.strip() for line in reference.splitlines()
             if len(line.strip()) > 12 and not line.strip().startswith("#")}
    given_away = [line for line in lines if line in str(report)]
    assert not given_away, f"the report gives the reference's line away: {given_away}\n{report}"
    assert "report.fix()" in report.note and report.fix() == reference


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "train_ddp.py"
    path.write_text(text)
    return str(path)


def item(report, name: str):
    return next(i for i in report.items if i.name.startswith(name))


def test_the_reference_passes(tmp_path):
    report = dpc.exercises.check_a(write(tmp_path, REFERENCE))
    assert report.passed, str(report)
    assert "passed (8 of 8 checks)" in str(report) and "<table>" in report._repr_html_()


@pytest.mark.parametrize("evaluation", list(EVALUATIONS))
def test_independent_conversions_pass_with_or_without_an_evaluation(tmp_path, evaluation):
    independent = dpc.exercises.check_a(write(tmp_path, INDEPENDENT.replace("EVALUATE", EVALUATIONS[evaluation])))
    assert independent.passed, str(independent)


def test_an_evaluation_does_not_hide_a_missing_set_epoch(tmp_path):
    script = INDEPENDENT.replace("EVALUATE", EVALUATIONS["every rank evaluates"]).replace(
        "    sampler.set_epoch(epoch)\n", "")
    assert "set_epoch" not in script
    report = dpc.exercises.check_a(write(tmp_path, script))
    assert item(report, "the order changes between epochs").status == "fail", str(report)


def test_untouched_starter_is_not_attempted(tmp_path):
    missing = dpc.exercises.check_a(str(tmp_path / "train_ddp.py"))
    assert not missing.attempted and not missing.passed and "not attempted yet" in str(missing)
    copy = tmp_path / "copy.py"
    shutil.copy(dpc.scripts.path("train_single"), copy)
    unchanged = dpc.exercises.check_a(str(copy))
    assert not unchanged.attempted and "unchanged" in str(unchanged)


@pytest.mark.parametrize("mistake, edit, failing, words", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_mistake_fails_with_its_item_named(tmp_path, mistake, edit, failing, words):
    old, new = edit
    assert old in REFERENCE, f"the reference changed; update the mistake {mistake!r}"
    report = dpc.exercises.check_a(write(tmp_path, REFERENCE.replace(old, new)))
    assert not report.passed
    bad = item(report, failing)
    assert bad.status == "fail" and words in bad.detail, str(report)
    if mistake == "no DistributedSampler":  # what the learner reads: ranks, samples, the fix
        assert bad.detail.startswith("rank 0 and rank 1 both read samples 0, 1, 2 (and ")
        assert "in epoch 0: each rank drew from the whole dataset" in bad.detail
    assert_teaches(report, REFERENCE)
    others = [i.name for i in report.items if i.status == "fail" and i is not bad]
    assert len(others) <= 1, f"{mistake}: more failed than expected: {others}\n{report}"


def test_a_hanging_rank_times_out_cleanly(tmp_path):
    hang = REFERENCE.replace("    dist.barrier()\n", "    if rank == 1:\n        import time; time.sleep(600)\n    dist.barrier()\n")
    report = dpc.exercises.check_a(write(tmp_path, hang), timeout=40)
    first = report.items[0]
    assert first.status == "fail" and "did not finish within 40 s" in first.detail
    # conftest's module fixture fails this module if torchrun or a worker is left behind


@pytest.mark.parametrize("where, words, passes", [
    ("after destroy_process_group", True, True),
    ("after destroy_process_group", False, False),  # an abort of another kind
    ("before the barrier", True, False)])
def test_an_abort_at_exit_is_told_apart_from_a_rank_that_died(tmp_path, where, words, passes):
    """Gloo's teardown sometimes aborts a worker (SIGABRT) as Python exits, after the script's
    work is done, with the C++ runtime's "terminate called without an active exception": the
    checker says so and passes; an abort before the end, or with other words, still fails."""
    tail = "    dist.barrier()\n    dist.destroy_process_group()\n"
    assert tail in REFERENCE, "the reference changed; update this test"
    said = "        sys.stderr.write('terminate called without an active exception\\n'); sys.stderr.flush()\n"
    abort = "    if rank == 1:\n" + (said if words else "") + "        os.abort()\n"
    script = REFERENCE.replace(tail, tail + abort if where.startswith("after") else abort + tail)
    script = "import os\nimport sys\n" + script
    report = dpc.exercises.check_a(write(tmp_path, script))
    first = report.items[0]
    assert report.passed is passes, str(report)
    assert ("known race in Gloo's teardown" in first.detail) is passes, first.detail


def test_solution_is_the_reference_and_unknown_exercises_are_named():
    assert dpc.exercises.solution("a") == REFERENCE
    with pytest.raises(ValueError, match="choose one of"):
        dpc.exercises.solution("Z")


def test_exercise_notebook_with_the_solution_filled_in(tmp_path):
    folder = tmp_path / "exercises"
    shutil.copytree(ROOT / "notebooks" / "exercises", folder, symlinks=False)
    (folder / "train_ddp.py").write_text(REFERENCE)
    nb = nbformat.read(folder / "A-single-device-to-ddp.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(folder)}}).execute()
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             if "report" in c.source and o.get("output_type") == "execute_result"]
    assert shown and "passed (8 of 8 checks)" in shown[0]["data"]["text/plain"]
