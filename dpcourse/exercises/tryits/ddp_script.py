"""4.2a's try-it ``ddp_script``: a torchrun script's DDP step, saved once. Its set-up on the ranks,
its items and the mistakes it names."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import models
from ...grading.compare import close
from ...grading.judging import RankFailure, script_or_failure
from ...grading.registry import try_it
from ...grading.report import Report
from ...patching import patched
from .ddp import TIMEOUT

GLOBAL_BATCH, LR = 24, 0.1   # samples per step, all ranks together (2, 3 and 4 ranks share it evenly); SGD's learning rate
# What ``cluster.run_script_source`` runs on every rank, as torchrun would run a file: no
# process group yet; argv: the learner's pickled function, the folder for what is observed.
_SCRIPT = ("import sys\n"
           "from dpcourse.exercises.tryits.ddp_script import _script_main\n"
           "_script_main(sys.argv[1], sys.argv[2])\n")


def _saved_copy(obj):
    """What a ``torch.save`` was given: a state dict's tensors copied, anything else by its type."""
    from collections.abc import Mapping

    if isinstance(obj, Mapping):
        return {str(k): v.detach().clone() if isinstance(v, torch.Tensor) else repr(v) for k, v in obj.items()}
    return type(obj).__name__


def _script_main(answer_file: str, folder: str) -> None:
    """On a rank, as a script under torchrun: call the learner's function with a fresh model,
    the global batch and the path to save to; note every ``torch.save``, the rows each
    forward saw and whether a process group is left when it returns (in ``seen-<rank>.pt``)."""
    import os

    from ...pool import wire

    rank = int(os.environ["RANK"])
    with open(answer_file, "rb") as f:
        answer = wire.loads(f.read())
    model = models.build_model("mlp", seed=0)
    x, y = models.make_dataset("mlp", GLOBAL_BATCH).tensors
    seen = {"saved": [], "rows": [], "initialized": None}
    model.register_forward_pre_hook(lambda module, args: seen["rows"].append(args[0].detach().clone()))
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        seen["saved"].append(_saved_copy(obj))
        return real_save(obj, f, *args, **kwargs)

    try:
        with patched(torch, save=save):
            answer(model, x, y, os.path.join(folder, "weights.pt"))
    finally:   # a SystemExit too: os._exit(0) ends a script on the ranks, as a process under torchrun
        seen["initialized"] = dist.is_initialized()
        real_save(seen, os.path.join(folder, f"seen-{rank}.pt"))


def _sgd_step(x, y) -> dict[str, torch.Tensor]:
    """One process: the MLP's weights after one SGD step on (x, y)."""
    model = models.build_model("mlp", seed=0)
    F.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return model.state_dict()


def _rows_in(rows: list[torch.Tensor], x: torch.Tensor) -> list[int]:
    """Which rows of ``x`` the forwards saw (-1: a row that is none of them)."""
    found = []
    for row in torch.cat(rows) if rows else []:
        hits = (x == row).all(dim=1).nonzero()
        found.append(int(hits[0]) if len(hits) else -1)
    return found


@try_it("ddp_script", "4.2a", "a torchrun script's DDP step, saved once")
def check_ddp_script(train_and_save, cluster) -> Report:
    import os
    import shutil
    import tempfile

    from ...pool import wire

    report = Report("")
    runs, once, loads = ("runs on every rank as a torchrun script", "rank 0 alone saves",
                         "the file loads into the plain model")
    step = "the weights are one step on the global batch, each rank on its part"
    left = "every rank leaves the process group"
    folder = tempfile.mkdtemp(prefix="dpcourse-tryit-")
    try:
        with open(os.path.join(folder, "answer.pkl"), "wb") as f:
            f.write(wire.dumps(train_and_save))
        got = script_or_failure(cluster, _SCRIPT, os.path.join(folder, "answer.pkl"), folder, timeout=TIMEOUT)
        if isinstance(got, RankFailure):
            return report.fail(runs, got.describe(TIMEOUT), [once, loads, step, left])
        report.add(runs, True)
        seen = [torch.load(os.path.join(folder, f"seen-{r}.pt"), weights_only=False) for r in range(len(got))]
        path = os.path.join(folder, "weights.pt")
        file = None
        if os.path.exists(path):
            try:
                file = torch.load(path, weights_only=False)
            except Exception as err:  # noqa: BLE001 -- a torn file, a class that will not load
                file = err
        return _judge_script(report, seen, file, (once, loads, step, left))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _judge_script(report: Report, seen: list[dict], file, names) -> Report:
    once, loads, step, left = names
    saves = [len(s["saved"]) for s in seen]   # per rank: how many times it saved
    _judge_saved_once(report, once, saves)
    _judge_loads(report, loads, file, saves)
    _judge_step(report, step, seen)
    still = [r for r, s in enumerate(seen) if s["initialized"]]
    report.add(left, not still, "" if not still else
               f"rank{'s' if len(still) > 1 else ''} {', '.join(map(str, still))} still had a process group "
               "when the function returned: under torchrun, what does a process do with its group "
               "before it ends?")
    return report


def _judge_saved_once(report: Report, once: str, saves: list[int]) -> None:
    world = len(saves)
    if saves == [1] + [0] * (world - 1):
        report.add(once, True)
    elif sum(saves) == 0:
        report.add(once, False, "no rank saved anything")
    elif all(saves):
        report.add(once, False, f"every rank saved the weights ({sum(saves)} saves of one file): the "
                                "replicas are identical, and ranks writing one file at once can tear it. "
                                "Which rank's copy is enough?")
    elif saves[0] == 0:
        who = ", ".join(str(r) for r, n in enumerate(saves) if n)
        report.add(once, False, f"rank {who} saved, not rank 0: rank 0 is the one rank every run has, "
                                "whatever its world size")
    else:
        report.add(once, False, f"rank 0 saved {saves[0]} times, into one file: the last save is all that is left")


def _judge_loads(report: Report, loads: str, file, saves: list[int]) -> None:
    """``file``: what the saved file loads as (None: no file, an exception: it does not load)."""
    if file is None:
        report.add(loads, False, "nothing was saved at the path given" if any(saves) else "no rank saved")
    elif isinstance(file, Exception):
        report.add(loads, False, f"the file does not load ({type(file).__name__}: {str(file).splitlines()[0][:120]})"
                   + (": several ranks wrote it at once" if sum(saves) > 1 else ""))
    elif not isinstance(file, dict):
        report.add(loads, False, f"the file holds a {type(file).__name__}, not a state dict: a state dict "
                                 "loads into any copy of the model, without its class pickled")
    else:
        try:
            models.build_model("mlp", seed=1).load_state_dict(file)
            report.add(loads, True)
        except Exception as err:  # noqa: BLE001 -- wrong keys or shapes: said below
            keys = list(file)
            if keys and all(str(k).startswith("module.") for k in keys):
                report.add(loads, False, f"its keys start with \"module.\" ({keys[0]!r}, ...): it is the "
                                         "state dict of the DDP wrapper, which the plain model does not load. "
                                         "Which object holds the model's own weights?")
            else:
                report.add(loads, False, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")


def _judge_step(report: Report, step: str, seen: list[dict]) -> None:
    world = len(seen)
    x, y = models.make_dataset("mlp", GLOBAL_BATCH).tensors
    saved = next((s["saved"][0] for s in seen if s["saved"]), None)
    if not isinstance(saved, dict):
        report.add(step, False, "no state dict was saved to compare" if saved is None
                   else f"a {saved} was saved, not a state dict: nothing to compare")
    else:
        weights = {k.removeprefix("module."): v for k, v in saved.items()}
        rows = [_rows_in(s["rows"], x) for s in seen]
        everything = sorted(i for r in rows for i in r) == list(range(GLOBAL_BATCH))
        shares = {len(r) for r in rows} == {GLOBAL_BATCH // world}
        if close(weights, _sgd_step(x, y)) and everything and shares:
            report.add(step, True)
        elif close(weights, models.build_model("mlp", seed=0).state_dict()):
            report.add(step, False, "the saved weights are the initial ones: was the optimizer step "
                                    "taken before saving?")
        elif not shares or not everything:
            counts = ", ".join(f"rank {r} {len(i)}" for r, i in enumerate(rows))
            report.add(step, False, f"the model's forward saw {counts} samples of the global batch of "
                                    f"{GLOBAL_BATCH}: each rank computes on its own part of the batch, "
                                    "the ranks' parts together the whole batch once")
        elif close(weights, _sgd_step(x[rows[0]], y[rows[0]])):
            report.add(step, False, "the saved weights are one step on rank 0's samples alone: its "
                                    "gradients were never averaged with the other ranks'. What averages "
                                    "them during backward?")
        else:
            worst = max((weights[k] - v).abs().max().item() for k, v in _sgd_step(x, y).items() if k in weights)
            report.add(step, False, f"they differ from one SGD step (learning rate {LR}, the mean squared "
                                    f"error) on the whole batch by up to {worst:.1e}: one step, with that loss?")
