"""dpcourse/scripts under real torchrun: DDP and FSDP2 train exactly what one process trains
on the global batch, and only rank 0 logs and saves."""
from __future__ import annotations

import ast
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dpcourse.scripts as scripts
from dpcourse.models import MLP
from dpcourse.processes import free_port, launch_env, run_process, torchrun_command

pytestmark = pytest.mark.timeout(240)

GLOBAL_BATCH = 32
COMMON = ["--epochs", "2", "--num-samples", "128"]  # 4 steps per epoch at the global batch
EPOCH_LINE = re.compile(r"^epoch (\d+): mean loss ([0-9.]+)$")


def _run(args: list[str], timeout: float = 120, check: bool = True) -> tuple[int, str, str]:
    """Run ``args`` in a new session: (exit code, stdout, stderr); ``check``: the code must be 0.
    On timeout it is ended with all it started (torchrun and its ranks), and the test fails."""
    try:
        proc = run_process(args, timeout, env=launch_env(), text=True)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args} ran past {timeout} s and was stopped")
    assert proc.returncode == 0 or not check, f"{args} exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.returncode, proc.stdout, proc.stderr


def _torchrun(name: str, nproc: int, out: Path, *argv: str) -> list[tuple[int, str]]:
    """Run a script on ``nproc`` ranks; return what they printed as (rank, line) pairs.

    Each rank's stdout is read from the file torchrun redirects it to, not from torchrun's
    ``--tee``: the tee reads those files while the ranks write, and a line caught half
    written comes out split ("...0.408363[default0]:"), which is torchrun's display, not
    the script's output.
    """
    logs = out.parent / f"{out.stem}-logs"
    code, _, err = _run(torchrun_command(nproc, "--redirects=3", f"--log-dir={logs}",
                                         scripts.path(name), *COMMON, "--out", out, *argv), check=False)
    files = sorted(logs.glob("*/attempt_0/*/stdout.log"))
    assert len(files) == nproc, f"expected one stdout.log per rank under {logs}: {files}"
    stderr = "".join(f.read_text() for f in logs.glob("*/attempt_0/*/stderr.log"))
    # Strict: a course script leaves with os._exit(0) on Gloo, so PyTorch's teardown as
    # Python exits (a Gloo worker ended inside a C++ destructor: SIGABRT) cannot fail it.
    assert code == 0, f"torchrun exited with {code}:\n{err[-3000:]}\n{stderr[-3000:]}"
    return [(int(f.parent.name), line) for f in files for line in f.read_text().splitlines()]


def _epoch_losses(lines: list[str]) -> list[float]:
    return [float(m.group(2)) for m in map(EPOCH_LINE.match, lines) if m]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """train_single.py on the global batch: (final weights, logged epoch losses)."""
    out = tmp_path_factory.mktemp("single") / "model.pt"
    _, stdout, _ = _run([sys.executable, scripts.path("train_single"), *COMMON,
                         "--batch-size", str(GLOBAL_BATCH), "--out", str(out)])
    return torch.load(out), _epoch_losses(stdout.splitlines())


def _assert_same_training(lines, out: Path, single) -> None:
    weights, losses = single
    assert {rank for rank, _ in lines} == {0}, f"a rank other than 0 printed: {lines}"
    texts = [text for _, text in lines]
    assert len(_epoch_losses(texts)) == 2 and f"saved {out}" in texts
    # Printed with 6 decimals: equal up to the last printed digit.
    torch.testing.assert_close(_epoch_losses(texts), losses, rtol=0, atol=1.5e-6)
    saved = torch.load(out)
    assert list(saved) == list(weights), "the checkpoint's keys differ from the plain model's"
    for key in weights:
        torch.testing.assert_close(saved[key], weights[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("nproc", [2, 4])
def test_ddp_equals_single_process_on_the_global_batch(tmp_path, single, nproc):
    out = tmp_path / "ddp.pt"
    lines = _torchrun("train_ddp", nproc, out, "--batch-size", str(GLOBAL_BATCH // nproc))
    assert lines[0][1] == f"{nproc} ranks x {GLOBAL_BATCH // nproc} samples = global batch {GLOBAL_BATCH}"
    _assert_same_training(lines, out, single)


def test_fsdp_equals_single_process_on_the_global_batch(tmp_path, single):
    """With float32 gathers, to float rounding; with the script's default bf16 gathers, to
    bf16's rounding (the fp32 shards stay the master copy)."""
    out = tmp_path / "fsdp.pt"
    lines = _torchrun("train_fsdp", 2, out, "--batch-size", str(GLOBAL_BATCH // 2), "--param-dtype", "float32")
    _assert_same_training(lines, out, single)
    assert {type(t) for t in torch.load(out).values()} == {torch.Tensor}  # full tensors, not DTensor shards
    bf16 = tmp_path / "bf16.pt"
    _torchrun("train_fsdp", 2, bf16, "--batch-size", str(GLOBAL_BATCH // 2))
    full, low = torch.load(out), torch.load(bf16)
    gap = max((full[k] - low[k]).abs().max().item() for k in full)
    assert 1e-6 < gap < 1e-3, gap


def test_single_process_on_the_per_rank_batch_trains_something_else(tmp_path, single):
    """The equality above is not automatic: the per-rank batch alone gives other weights."""
    out = tmp_path / "small.pt"
    main = runpy.run_path(scripts.path("train_single"))["main"]  # in this process: no start-up cost
    main([*COMMON, "--batch-size", str(GLOBAL_BATCH // 2), "--out", str(out)])
    diff = max((torch.load(out)[k] - w).abs().max().item() for k, w in single[0].items())
    assert diff > 1e-3


def _save_plain_fsdp2_state_dict(path: str) -> None:
    """The mistake the notebook warns about: torch.save(model.state_dict()) of an FSDP2 model."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = MLP()
    fully_shard(model)
    state = model.state_dict()
    if dist.get_rank() == 0:
        torch.save(state, path)
    dist.barrier()


def test_plain_state_dict_of_fsdp2_holds_rank_0s_shards_only(cluster2, tmp_path):
    """Why train_fsdp.py gathers with get_model_state_dict instead (4.2's saving advice)."""
    from torch.distributed.tensor import DTensor

    path = tmp_path / "plain.pt"
    cluster2.run(_save_plain_fsdp2_state_dict, str(path), timeout=60)
    saved = torch.load(path)
    head = saved["head.weight"]  # (8, 64) in the model, split along dim 0 over 2 ranks
    assert isinstance(head, DTensor) and tuple(head.to_local().shape) == (4, 64)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        MLP().load_state_dict(saved)


def test_scripts_use_no_course_helper_but_the_model_and_data():
    for name in scripts.NAMES:
        tree = ast.parse(Path(scripts.path(name)).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        assert {m for m in imported if m.startswith("dpcourse")} == {"dpcourse.models"}, name


def test_unknown_script_is_named():
    with pytest.raises(ValueError, match="unknown script 'train_zero'.*train_ddp"):
        scripts.path("train_zero")


# Why the scripts end with os._exit on Gloo: the worker threads of the group outlive
# destroy_process_group() once a model was wrapped. Counted as the threads PyTorch names
# pt_gloo_runloop; a plain group's are joined by destroy_process_group(). If a PyTorch release
# joins them after wrapping too, this fails: the scripts' ending can then go.
GLOO_THREADS = '''
import gc, os, sys
import torch, torch.distributed as dist
def runloops():
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop" for t in os.listdir("/proc/self/task"))
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Linear(4, 4)
if sys.argv[1] == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(model)
elif sys.argv[1] == "fsdp2":
    from torch.distributed.fsdp import fully_shard
    fully_shard(model)
model(torch.randn(2, 4)).sum().backward()
del model
gc.collect()
dist.barrier()
dist.destroy_process_group()
print(runloops(), flush=True)
os._exit(0)
'''


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
@pytest.mark.parametrize("wrap, left", [("none", 0), ("ddp", 2), ("fsdp2", 2)])
def test_gloo_worker_threads_outlive_destroy_process_group_once_a_model_was_wrapped(tmp_path, wrap, left):
    path = tmp_path / "gloo_threads.py"
    path.write_text(GLOO_THREADS)
    env = launch_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = run_process([sys.executable, path, wrap], timeout=60, env=env, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) == left, proc.stdout
