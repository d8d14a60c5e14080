"""Exercise A: turn the single-device ``train_lm.py`` into DDP; the checker runs it under torchrun.

    report = dpc.exercises.check_a("train_lm_ddp.py")

It judges behaviour, not text: the script runs on 2 ranks under ``torchrun`` with the
course's observer (``recorder.py``), and beside it the starter as one process on the global
batch (``script_check.py`` holds the judges A and F share). Judged: it completes (a hang is
stopped within seconds and each rank's place named); each rank reads its own training
samples and a new order every epoch; accumulation all-reduces once per optimizer step; the
first step's gradient and every step's learning rate are one process's; the printed
val_loss is the whole validation set's; rank 0 alone logs and saves the plain model's
weights, which equal one process's; every rank leaves the group. Only the training loop's
passes over the data count as epochs (a pass with optimizer steps): an evaluation pass is
judged by the number it prints.
"""
from __future__ import annotations

from . import equivalence as eq
from . import script_check as sc
from .recorder import read_log
from ..grading import provenance
from ..grading.report import Report

ARGS = ["--epochs", "2", "--batch-size", "8", "--accum-steps", "4", "--num-samples", "256",
        "--val-samples", "37", "--max-norm", "0.1", "--out", "model.pt"]
# measured with these ARGS: the reference ends 0.004 % of one process's travel away and
# prints its val_loss to the last digit; a DistributedSampler's repeated sequence moves the
# mean by 4e-3 or more, rank 0's own share by 1.6e-2
SETTING = sc.Setting(ARGS, "all_reduce", val_tolerance=2e-5, grad_tolerance=1e-3, weight_tolerance=1e-3,
                     sync_idea="how does DDP learn that a backward pass is not the last before a step?")


@provenance.judged("A")
def check_a(path: str = "train_lm_ddp.py", timeout: float = 180.0) -> Report:
    """Run the learner's DDP script on 2 ranks under torchrun and say, item by item, what is right."""
    return sc.check_script(Report("Exercise A", key="A"), path, "make it data-parallel with DDP", SETTING,
                           timeout, _judge)


def _judge(report: Report, run, single: sc.SingleRun, setting: sc.Setting, timeout: float) -> None:
    logs = [read_log(run.observed, r) for r in range(sc.WORLD_SIZE)]
    finished = sc.judge_completion(report, run, logs, timeout, "e.g. a collective inside `if rank == 0:`, "
                                   "which the other rank never reaches")
    sc.judge_sampling(report, logs, finished, int(setting.arg("--num-samples")))
    other = eq.not_ddp(logs)  # e.g. exercise F's script: sharded, in bf16 -- not a DDP mistake
    eq.judge_synchronisation(report, logs, setting, "DDP", other)
    eq.judge_gradient(report, logs, single, setting)
    eq.judge_the_outcome(report, run, logs, single, setting, finished, _judge_checkpoint,
                         "are gradients averaged (not summed)? is the learning "
                         "rate unchanged? do all ranks start from the same weights?", other)


def _judge_checkpoint(report: Report, logs: list[dict]):
    def wrapped(state):
        keys = [k for k in state if k.startswith("module.")]
        return (f"its keys start with 'module.' (e.g. {keys[0]!r}): the file holds the DDP wrapper's names, "
                "which the plain model does not load -- whose state dict is the plain model's?") if keys else None

    return sc.judge_checkpoint(report, logs, "the checkpoint loads into the plain model (no 'module.' prefix)",
                               wrapped, "the file must hold the plain model's tensors")
