"""4.2a's try-its: DDP written by the learner (checked on the notebook's ranks).

Each checker runs the learner's function on every rank next to a reference computed on the
same rank (one process's gradient of the whole global batch), and judges what happened:
gradients, and what the ranks sent, seen from outside (a counting comm hook, ``Comm``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import models
from ..ranks import RankFailure, run_or_failure
from ..report import Report
from . import on_ranks, try_it

TIMEOUT = 20.0          # seconds for one check's call on the ranks
RTOL, ATOL = 1e-4, 1e-6


def _grads(model) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _global_grads(samples_per_rank: int, world_size: int) -> list[torch.Tensor]:
    """One process: the gradient of the mean loss over every rank's samples (the ground truth)."""
    model = models.build_model("mlp", seed=0)
    x, y = models.make_dataset("mlp", samples_per_rank * world_size).tensors
    F.mse_loss(model(x), y).backward()
    return _grads(model)


def _ratio(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """How many times ``want`` ``got`` is, fitted over all gradients (1.0 when equal)."""
    g, w = torch.cat([t.flatten() for t in got]), torch.cat([t.flatten() for t in want])
    return float((g @ w) / (w @ w).clamp_min(1e-30))


def _same(got, want) -> bool:
    return all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(got, want))


# ---------------------------------------------------------------------------------- no_sync
MICRO_BATCHES, MICRO = 4, 4   # micro-batches per rank and step, samples in each


def _accumulate_on_rank(accumulate):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    share = MICRO_BATCHES * MICRO
    x, y = models.make_dataset("mlp", share * world).tensors
    mine = slice(rank * share, (rank + 1) * share)
    micro_batches = list(zip(x[mine].chunk(MICRO_BATCHES), y[mine].chunk(MICRO_BATCHES)))
    calls = [0]

    def counting(state, bucket):   # DDP's own all-reduce, counted
        calls[0] += 1
        return allreduce_hook(state, bucket)

    one = DDP(models.build_model("mlp", seed=0))       # one synchronised backward: how many buckets
    one.register_comm_hook(None, counting)
    F.mse_loss(one(x[mine]), y[mine]).backward()
    per_sync, calls[0] = calls[0], 0
    one.module.zero_grad()
    with one.no_sync():
        F.mse_loss(one(x[mine]), y[mine]).backward()
    local = _grads(one.module)                          # this rank's own gradient, not averaged

    ddp = DDP(models.build_model("mlp", seed=0))
    ddp.register_comm_hook(None, counting)
    accumulate(ddp, micro_batches)
    return {"calls": calls[0], "per_sync": per_sync, "grads": _grads(ddp.module), "local": local,
            "want": _global_grads(share, world)}


@try_it("no_sync", "4.2a", f"{MICRO_BATCHES} micro-batches per step under DDP, one all-reduce")
@on_ranks(_accumulate_on_rank, "DDP all-reduces once per optimizer step",
          "gradients equal one process's on the global batch", timeout=TIMEOUT)
def check_no_sync(report: Report, got: list, once, same) -> None:
    r = got[0]
    syncs = r["calls"] / r["per_sync"]
    if syncs == 1:
        report.add(once, True)
    elif syncs == 0:
        report.add(once, False,
                   "no all-reduce ran at all: every micro-batch's backward ran with DDP's "
                   "synchronisation switched off, so the ranks' gradients were never averaged")
    else:
        report.add(once, False,
                   f"DDP all-reduced the gradients {syncs:g} times for {MICRO_BATCHES} micro-batches: it "
                   "synchronised after micro-batches whose gradients were not final yet. What lets "
                   "backward only add to .grad, without communicating -- and DDP decides that in "
                   "forward: does each micro-batch's forward run where it should?")
    if all(_same(x["grads"], x["want"]) for x in got):
        report.add(same, True)
    elif any(_ratio(x["grads"], x["local"]) > 0.5 and not _same(x["local"], x["want"])
             and _same([g / _ratio(x["grads"], x["local"]) for g in x["grads"]], x["local"]) for x in got):
        report.add(same, False, "each rank kept a gradient of its own samples only: the last "
                                "micro-batch's backward must be the one DDP averages over the ranks")
    else:
        ratio = _ratio(r["grads"], r["want"])
        if abs(ratio - 1) > 0.05:
            detail = (f"about {ratio:.2g} times the right size: how much should each micro-batch's loss "
                      "count, if the step is to see the mean over all of them?")
        elif syncs == 1:
            detail = ("DDP all-reduced once, but not the whole step's gradient: the all-reduce averages "
                      "what .grad holds when it runs, and the micro-batches after it stayed this rank's "
                      "own. After which micro-batch's backward must it run?")
        else:
            detail = "they differ from it: is every micro-batch's loss part of the gradient, once?"
        report.add(same, False, detail)


# ---------------------------------------------------------------------------------- sampler
N_ITEMS, EPOCHS, SEED = 11, 3, 5   # a dataset of 11 items: not a multiple of 2 (or 4) ranks


def _orders_on_rank(epoch_orders):
    from torch.utils.data import TensorDataset

    def orders(seed):
        got = epoch_orders(TensorDataset(torch.arange(N_ITEMS)), EPOCHS, seed)
        # one list of indices per epoch; batches (tensors) inside it are read in order too
        return [torch.cat([torch.as_tensor(i).flatten() for i in epoch]).tolist() if len(epoch) else []
                for epoch in got]

    return {"orders": orders(SEED), "again": orders(SEED), "other": orders(SEED + 1)}


def _overlap(epoch: int, runs: list[list[int]]) -> str | None:
    """What the ranks read twice in an epoch, in words (None: nothing)."""
    reads: dict[int, list[int]] = {}
    for rank, order in enumerate(runs):
        for i in order:
            reads.setdefault(i, []).append(rank)
    twice = {i: ranks for i, ranks in reads.items() if len(ranks) > 1}
    if not twice:
        return None
    if len(twice) > len(reads) // 2:
        return (f"in epoch {epoch} the ranks read {len(twice)} of the same samples: each rank went "
                "through the whole dataset, shuffled its own way. What gives each rank its own part?")
    i, ranks = next(iter(sorted(twice.items())))
    if len(set(ranks)) > 1:
        who = "by ranks " + " and ".join(map(str, sorted(set(ranks))))
    else:
        who = f"{len(ranks)} times by rank {ranks[0]}"
    total = sum(len(order) for order in runs)
    if len(reads) < min(total, N_ITEMS):   # padding repeats a few and leaves none out: this left some out
        return (f"in epoch {epoch}, sample {i} was read {who}, and {N_ITEMS - len(reads)} of the {N_ITEMS} "
                "samples by no rank: each rank took its part of a permutation of its own -- the ranks "
                "shuffled with different seeds, so their parts overlap and miss samples. The parts are "
                "slices of one shared shuffle only when every rank shuffles with the same seed")
    return (f"in epoch {epoch}, sample {i} was read {who}: to give every rank as many samples, "
            "the sampler repeated some to fill up the uneven tail")


def _unequal(by_epoch: list[list[list[int]]], world: int) -> str | None:
    """How the ranks' parts ([epoch][rank] -> indices) differ from equal shares of all but the
    uneven tail, in words (None: they do not)."""
    share, counts = N_ITEMS // world, [len(x) for x in by_epoch[0]]
    read = [len(set().union(*map(set, runs_e))) for runs_e in by_epoch]
    if all(len(x) == share for runs_e in by_epoch for x in runs_e) and read == [share * world] * EPOCHS:
        return None
    if min(counts) >= N_ITEMS:
        return (f"every rank read {counts[0]} samples per epoch, the whole dataset of {N_ITEMS}: "
                f"{world} ranks did the work of one process {world} times over")
    if len(set(counts)) > 1:
        return (f"in epoch 0 the ranks read {counts} samples: their epochs then have different numbers "
                "of steps, and a rank with more waits in an all-reduce the others never start")
    if sum(counts) > N_ITEMS:
        return (f"the {world} ranks read {sum(counts)} samples per epoch from a dataset of {N_ITEMS}: the "
                "sampler padded the parts with repeated samples. What makes it leave out the uneven tail instead?")
    if 0 < read[0] < sum(counts):
        return (f"the ranks read {counts[0]} samples each in epoch 0, but only {read[0]} different ones: "
                f"their parts overlap (see above), so {N_ITEMS - read[0]} of the {N_ITEMS} went unread, more "
                "than the uneven tail")
    return (f"together the ranks read {read[0]} different samples in epoch 0, {counts[0]} each, of "
            f"{N_ITEMS}: only the uneven tail (what does not divide by the world size) should be left out")


@try_it("sampler", "4.2a", f"{N_ITEMS} samples on the ranks, a new shuffle every epoch")
def check_sampler(epoch_orders, cluster) -> Report:
    report = Report("")
    runs, parts, new, seeded = ("runs on every rank", "the ranks' parts never overlap",
                                "a new shared shuffle every epoch", "the seed decides the orders")
    equal = "the ranks read equal parts, all but the uneven tail"
    got = run_or_failure(cluster, _orders_on_rank, epoch_orders, timeout=TIMEOUT)
    if isinstance(got, RankFailure):
        return got.fail(report, runs, TIMEOUT, [parts, equal, new, seeded])
    world = len(got)
    lengths = {len(r["orders"]) for r in got}
    if lengths != {EPOCHS}:
        report.add(runs, False, f"asked for {EPOCHS} epochs, the function returned {sorted(lengths)} "
                                "lists: one list of indices per epoch")
        for name in (parts, equal, new, seeded):
            report.add(name, None, "judged once it returns one list per epoch")
        return report
    report.add(runs, True)
    by_epoch = [[r["orders"][e] for r in got] for e in range(EPOCHS)]   # [epoch][rank] -> indices
    overlaps = [o for e, runs_e in enumerate(by_epoch) if (o := _overlap(e, runs_e))]
    report.add(parts, not overlaps, overlaps[0] if overlaps else "")

    unequal = _unequal(by_epoch, world)
    report.add(equal, unequal is None, unequal or "")

    same = [e for e in range(1, EPOCHS) if by_epoch[e] == by_epoch[e - 1]]
    # one permutation of the whole dataset, redrawn each epoch, cut into the ranks' parts: a
    # rank's part changes between epochs. A fixed part per rank, shuffled within, never does.
    fixed = all(len({frozenset(by_epoch[e][r]) for e in range(EPOCHS)}) == 1 for r in range(world))
    if same:
        report.add(new, False, f"epoch {same[0]} read the same order as epoch {same[0] - 1} on every "
                               "rank: the sampler shuffles from its seed and its epoch. What tells it "
                               "that a new epoch began?")
    elif fixed and any(by_epoch[0]) and not overlaps:
        report.add(new, False, f"each rank read the same samples in all {EPOCHS} epochs, only in another order "
                               f"(rank 0: {sorted(by_epoch[0][0])}): every rank kept a fixed part of its own and "
                               "shuffled within it. The shuffle must be one permutation of the whole dataset, "
                               "shared by all ranks and redrawn every epoch, each rank taking its part of it, "
                               "so that a sample can land on any rank")
    else:
        report.add(new, True)
    if any(r["again"] != r["orders"] for r in got):
        report.add(seeded, False, "called again with the same seed, the function read other orders: "
                                  "the shuffle drew from a random state, not from the seed alone. Which "
                                  "object should shuffle, so that the seed decides?")
    elif all(r["other"] == r["orders"] for r in got):
        report.add(seeded, False, "another seed gave the same orders: is the seed passed on to what "
                                  "shuffles?")
    else:
        report.add(seeded, True)
    return report


# ------------------------------------------------------------------------------- ddp_script
GLOBAL_BATCH, LR = 24, 0.1   # samples per step, all ranks together (2, 3 and 4 ranks share it evenly); SGD's learning rate
# What ``cluster.run_script_source`` runs on every rank, as torchrun would run a file: no
# process group yet; argv: the learner's pickled function, the folder for what is observed.
_SCRIPT = ("import sys\n"
           "from dpcourse.exercises.tryits.ddp import _script_main\n"
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

    torch.save = save
    try:
        answer(model, x, y, os.path.join(folder, "weights.pt"))
    finally:   # a SystemExit too: os._exit(0) ends a script on the ranks, as a process under torchrun
        torch.save = real_save
        seen["initialized"] = dist.is_initialized()
        real_save(seen, os.path.join(folder, f"seen-{rank}.pt"))


def _script_or_failure(cluster, source: str, *argv, timeout: float):
    """``cluster.run_script_source``'s exit codes, or a ``RankFailure`` (as ``run_or_failure``)."""
    from ...pool import RankError, RankTimeout
    from ..ranks import failure_of, warm_up

    try:
        return cluster.run_script_source(source, *argv, timeout=timeout)
    except (RankTimeout, RankError) as err:
        failure = failure_of(err)
    warm_up(cluster)
    return failure


def _sgd_step(x, y) -> dict[str, torch.Tensor]:
    """One process: the MLP's weights after one SGD step on (x, y)."""
    model = models.build_model("mlp", seed=0)
    F.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return model.state_dict()


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=RTOL, atol=ATOL) for k in a)


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
        got = _script_or_failure(cluster, _SCRIPT, os.path.join(folder, "answer.pkl"), folder, timeout=TIMEOUT)
        if isinstance(got, RankFailure):
            return got.fail(report, runs, TIMEOUT, [once, loads, step, left])
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
        if _close(weights, _sgd_step(x, y)) and everything and shares:
            report.add(step, True)
        elif _close(weights, models.build_model("mlp", seed=0).state_dict()):
            report.add(step, False, "the saved weights are the initial ones: was the optimizer step "
                                    "taken before saving?")
        elif not shares or not everything:
            counts = ", ".join(f"rank {r} {len(i)}" for r, i in enumerate(rows))
            report.add(step, False, f"the model's forward saw {counts} samples of the global batch of "
                                    f"{GLOBAL_BATCH}: each rank computes on its own part of the batch, "
                                    "the ranks' parts together the whole batch once")
        elif _close(weights, _sgd_step(x[rows[0]], y[rows[0]])):
            report.add(step, False, "the saved weights are one step on rank 0's samples alone: its "
                                    "gradients were never averaged with the other ranks'. What averages "
                                    "them during backward?")
        else:
            worst = max((weights[k] - v).abs().max().item() for k, v in _sgd_step(x, y).items() if k in weights)
            report.add(step, False, f"they differ from one SGD step (learning rate {LR}, the mean squared "
                                    f"error) on the whole batch by up to {worst:.1e}: one step, with that loss?")


# -------------------------------------------------------------------------------- comm_hook
SHARE = 16   # samples per rank
# bf16 keeps 8 significant bits: rounding to it moves a value by at most u = 2**-8 of itself.
# The hook rounds each rank's share g_r / N (or g_r) once, the N - 1 additions of the
# all-reduce round at most once each, a division after it once more: the mean it returns is
# off by at most u * (sum over r of |g_r| + |mean|) -- the tolerance, per element.
BF16_U = torch.finfo(torch.bfloat16).eps / 2


def _all_reduces(seen: list):
    """A listener for the collective tracker: (dtype, bytes) of every all-reduce issued."""
    def listen(issued):
        if issued.collective == "all_reduce":
            arg = issued.args[0]
            for t in arg if isinstance(arg, (list, tuple)) else [arg]:
                if isinstance(t, torch.Tensor):
                    seen.append((str(t.dtype).removeprefix("torch."), t.numel() * t.element_size()))
    return listen


def _value_dtype(value) -> str:
    t = value[0] if isinstance(value, (list, tuple)) and value else value
    return str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else type(value).__name__


def _handed_back(value, returned: list):
    """What the learner's hook handed DDP, noted; a list said plainly (DDP's own error prints it)."""
    returned.append(_value_dtype(value))
    if isinstance(value, (list, tuple)):
        raise TypeError(f"the hook's future holds a {type(value).__name__} of {len(value)} tensor(s), as "
                        "an all-reduce's future does; DDP takes one tensor from it, the bucket's new contents")
    return value


def _compressed_on_rank(register):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ...pool.ranks.tracker import TRACKER

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset("mlp", SHARE * world).tensors
    mine = slice(rank * SHARE, (rank + 1) * SHARE)
    plain, hooked = [], []
    ddp = DDP(models.build_model("mlp", seed=0))                # DDP's own all-reduce: the bytes
    with TRACKER.listen(_all_reduces(plain)):
        F.mse_loss(ddp(x[mine]), y[mine]).backward()

    ddp = DDP(models.build_model("mlp", seed=0))
    registered, returned = [], []
    register_on_ddp = ddp.register_comm_hook

    def watching(state, hook):   # register the learner's hook, watching what its future holds
        def watched(state, bucket):
            future = hook(state, bucket)
            if not callable(getattr(future, "then", None)):   # no future: DDP says what is wrong
                return future
            return future.then(lambda f: _handed_back(f.value(), returned))
        registered.append(True)
        return register_on_ddp(state, watched)

    ddp.register_comm_hook = watching
    register(ddp)
    with TRACKER.listen(_all_reduces(hooked)):
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
    local = []   # every rank's gradient of its own share, computed here
    for r in range(world):
        model = models.build_model("mlp", seed=0)
        F.mse_loss(model(x[r * SHARE:(r + 1) * SHARE]), y[r * SHARE:(r + 1) * SHARE]).backward()
        local.append(_grads(model))
    return {"plain": plain, "hooked": hooked, "registered": bool(registered), "returned": returned,
            "grads": _grads(ddp.module), "local": local, "want": _global_grads(SHARE, world),
            "grad_dtypes": sorted({str(p.grad.dtype).removeprefix("torch.") for p in ddp.module.parameters()
                                   if p.grad is not None})}


def _within_bf16(r) -> tuple[bool, float]:
    """Whether the gradients are the mean to bf16 rounding; their largest difference from it."""
    ok, worst = True, 0.0
    for i, (got, want) in enumerate(zip(r["grads"], r["want"])):
        spread = sum(loc[i].abs() for loc in r["local"])
        bound = BF16_U * (spread + want.abs()) + ATOL + RTOL * want.abs()
        excess = (got - want).abs() - bound
        ok = ok and bool((excess <= 0).all())
        worst = max(worst, float((got - want).abs().max()))
    return ok, worst


def _callback_error(failure: RankFailure, world_size: int) -> str:
    """A failed call, said without the stack: a future's callback that raised, by its message."""
    return failure.describe(TIMEOUT).split("\n\nAt:")[0]


@try_it("comm_hook", "4.2a", "a comm hook that all-reduces the buckets in bf16")
@on_ranks(_compressed_on_rank, "each bucket travels in bf16: half of DDP's bytes",
          "DDP gets each bucket back as float32",
          "gradients equal one process's on the global batch, to bf16 rounding",
          timeout=TIMEOUT, describe=_callback_error)
def check_comm_hook(report: Report, got: list, wire, back, grads) -> None:
    r = got[0]
    _judge_wire(report, wire, r)

    kinds = sorted(set(r["returned"]))
    if not kinds or kinds == ["float32"]:
        report.add(back, True)
    else:
        copied = ("this version of DDP happened to copy it into the float32 gradients"
                  if r["grad_dtypes"] == ["float32"] else
                  f"the gradients came out as {', '.join(r['grad_dtypes']) or 'nothing'}")
        report.add(back, False, f"the hook's future held a {', '.join(kinds)} value, not the float32 bucket "
                                f"DDP handed over: DDP takes that value as the bucket's new contents, and "
                                f"{copied}. What turns the averaged bf16 values back into the bucket?")

    worst = _within_bf16(r)[1]
    if all(_within_bf16(x)[0] for x in got):
        report.add(grads, True)
    else:
        ratio = _ratio(r["grads"], r["want"])
        if abs(ratio - 1) > 0.05 and ratio > 0:
            detail = (f"about {ratio:.2g} times the right size: an all-reduce adds the ranks' buckets. "
                      "What turns that sum into the mean DDP's own all-reduce leaves?")
        elif any(_same(x["grads"], x["local"][i]) for i, x in enumerate(got)):
            detail = "each rank kept the gradient of its own samples: the all-reduced values never reached the bucket"
        else:
            detail = (f"they differ from it by up to {worst:.1e}, more than rounding the buckets to bf16 "
                      "explains: is each value rounded once, and averaged over the ranks?")
        report.add(grads, False, detail)


def _judge_wire(report: Report, wire: str, r: dict) -> None:
    """Was each bucket all-reduced in bf16, half the bytes of DDP's own float32 all-reduce?"""
    plain_bytes, dtypes = sum(b for _, b in r["plain"]), sorted({d for d, _ in r["hooked"]})
    hooked_bytes = sum(b for _, b in r["hooked"])
    if not r["registered"]:
        report.add(wire, False, "no comm hook was registered on the model: DDP all-reduced each bucket "
                                "itself, in float32")
    elif not r["hooked"]:
        report.add(wire, False, "no all-reduce ran: the hook's future held a result, but no rank "
                                "sent its bucket to the others")
    elif dtypes == ["bfloat16"] and 2 * hooked_bytes == plain_bytes:
        report.add(wire, True)
    elif dtypes == ["float16"]:
        report.add(wire, False, f"the buckets travelled in float16, not bf16 ({hooked_bytes:,} bytes: half, "
                                "as asked): float16 keeps more mantissa bits but a far smaller range, so "
                                "large gradients overflow to inf where bf16 keeps float32's range. Which "
                                "16-bit dtype did the cell ask for?")
    elif dtypes != ["bfloat16"]:
        report.add(wire, False, f"the bucket travelled in full precision ({', '.join(dtypes)}, "
                                f"{hooked_bytes:,} bytes; DDP's own all-reduce sends {plain_bytes:,}): "
                                "where does the hook make it bf16?")
    else:
        report.add(wire, False, f"the hook all-reduced {hooked_bytes:,} bytes of bf16 per backward, DDP "
                                f"itself {plain_bytes:,} of float32: one all-reduce per bucket, of the "
                                "bucket's whole gradient?")
