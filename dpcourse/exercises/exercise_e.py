"""Exercise E: the two methods of a bucketed DDP; the checker trains it next to torch DDP.

    report = dpc.exercises.check_e(MyBucketedDDP)
    report.figure                                # your timeline above torch DDP's

The learner's class -- the notebook's scaffold (it broadcasts rank 0's weights, packs the
buckets, registers the gradient hooks) with ``grad_ready`` and
``finish_gradient_synchronization`` written by the learner; nothing of either is inherited
-- and torch DDP train the same MLP from the same weights on the same data for ``STEPS``
SGD steps on 2 ranks, with ``bucket_cap_mb=BUCKET_CAP_MB``, in the course's one training loop
(``dpc.train.train(cfg, wrap=...)``). The course's observers watch from outside: ``Comm``
sees every all-reduce with its bytes, ``Timeline`` every layer's backward and every
all-reduce from launch to completion, ``Gradients`` (here) every gradient as the optimizer
steps. Judged: the gradients after every
backward equal torch DDP's; each bucket travels as one all-reduce per backward; and some
bucket's all-reduce is still in flight while a later layer's backward computes (completion
times, not launch times: an all-reduce waited for inside the hook never is).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import models
from ..observe import Comm, Timeline
from ..scratch.bucketed import assign_buckets
from ..grading.judging import RankFailure, blanks_in, clusters_for, run_or_failure
from ..grading import provenance
from ..grading.report import Report

MODEL, SIZES = "mlp", {"d_hidden": 512, "depth": 4}
BUCKET_CAP_MB = 1.0      # MiB: 4 buckets of this MLP's gradients, as torch DDP packs them (each
                         # 512 x 512 weight, exactly 1 MiB of float32, closes the bucket it lands in)
STEPS, BATCH, LR = 3, 64, 0.05  # SGD steps, samples per rank per step, learning rate
RTOL, ATOL = 1e-5, 1e-6  # on gradients; at 2 ranks (g0 + g1) / 2 is exact
LOSS_BYTES = 4           # the training loop all-reduces the loss, one float32, after every step
OVERLAP_S = 2e-4         # in flight under a later layer's backward for at least this long
ITEMS = {"runs": f"trains {STEPS} steps on the ranks",
         "grads": "gradients equal torch DDP's after every backward (same model, data, buckets)",
         "buckets": "each bucket's gradients travel as one all-reduce per backward",
         "overlap": "a bucket's all-reduce is in flight while a later layer's backward computes"}


@dataclass(repr=False)
class DDPReport(Report):
    """A ``Report`` that also carries ``figure``: the learner's timeline above torch DDP's
    (a matplotlib Figure, None if nothing ran)."""
    figure: object = None


def bucket_plan(model, bucket_cap_mb: float = BUCKET_CAP_MB) -> list[tuple[list[str], int]]:
    """(parameter names, bytes) of each bucket, bucket 0 first, as the scaffold packs them: the
    trainable parameters in reverse order of registration, cut by ``assign_buckets`` (PyTorch
    DDP's rule, the one the course's ``BucketedDDP`` uses: a bucket closes once it holds
    ``bucket_cap_mb`` MiB or more)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]
    nbytes = [p.numel() * p.element_size() for _, p in named]
    plan = assign_buckets([p.numel() for _, p in named], [p.element_size() for _, p in named], bucket_cap_mb)
    return [([named[i][0] for i in bucket], sum(nbytes[i] for i in bucket)) for bucket in plan]


def torch_ddp(model):
    """The reference: PyTorch's DDP with the same bucket cap."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = next(model.parameters()).device
    return DDP(model, bucket_cap_mb=BUCKET_CAP_MB, device_ids=[device] if device.type == "cuda" else None)


class Gradients:
    """Observer: every parameter's gradient as ``optimizer.step()`` begins (after backward and
    whatever synchronisation the wrapper does), in the optimizer's order, per step."""

    def __enter__(self):
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._steps: list[list] = []
        self._hook = register_optimizer_step_pre_hook(self._before_step)
        return self

    def _before_step(self, optimizer, _args, _kwargs) -> None:
        self._steps.append([None if p.grad is None else p.grad.detach().cpu().clone()
                            for group in optimizer.param_groups for p in group["params"]])

    def __exit__(self, *exc):
        self._hook.remove()

    def result(self) -> list:
        return self._steps

    def collect(self, per_rank: list) -> None:
        self.per_rank = per_rank


def config(world_size: int):
    from ..train import TrainConfig

    return TrainConfig(model=MODEL, model_sizes=dict(SIZES), batch_size=BATCH, steps=STEPS, optimizer="sgd",
                       lr=LR, num_samples=BATCH * STEPS * world_size, progress=False)


def _train(wrap):
    """On each rank: the course's training loop with the learner's class (or torch DDP)."""
    from ..train import train

    train(config(dist.get_world_size()), wrap=wrap)


@provenance.judged("E")
def check_e(cls, cluster=None, timeout: float = 60.0) -> DDPReport:
    """Train ``cls`` and torch DDP side by side on the ranks; say item by item what is right.

    cls: the notebook's ``MyBucketedDDP`` (built as ``cls(model, bucket_cap_mb=...)``).
    cluster: a ``dpc.Cluster`` of 2 or more ranks to use (None: one of 2 ranks is started for
    the check and shut down after it, ~5 s). timeout: seconds per training run.
    """
    report = DDPReport("Exercise E")
    if blanks_in(cls):
        report.attempted = False
        report.note = (f"Fill in the `...` in {cls.__name__}.grad_ready and "
                       "finish_gradient_synchronization, then run this cell again.")
        return report
    borrowed = _borrowed(cls)
    if borrowed:
        return report.fail(ITEMS["runs"], f"{cls.__name__}.{borrowed[0]} is the course's own "
                           f"({getattr(cls, borrowed[0]).__module__}): the exercise is to write grad_ready and "
                           "finish_gradient_synchronization in the scaffold's class",
                           [ITEMS[key] for key in ("grads", "buckets", "overlap")], "judged once the class is yours")
    world = cluster.world_size if cluster is not None else 2
    with clusters_for(cluster, [world]) as clusters:
        comm, timeline, mine = Comm(), Timeline(), Gradients()
        wrap = functools.partial(cls, bucket_cap_mb=BUCKET_CAP_MB)
        failed = run_or_failure(clusters[world], _train, wrap, timeout=timeout, observe=[comm, timeline, mine])
        if isinstance(failed, RankFailure):
            return report.fail(ITEMS["runs"], failed.describe(timeout),
                               [ITEMS[key] for key in ("grads", "buckets", "overlap")], "judged once it trains")
        torch_timeline, theirs = Timeline(), Gradients()
        clusters[world].run(_train, torch_ddp, timeout=timeout, observe=[torch_timeline, theirs])
    report.add(ITEMS["runs"], True, f"{world} ranks, {STEPS} SGD steps of the course's MLP")
    report.add(ITEMS["grads"], *_judge_grads(mine.per_rank, theirs.per_rank, world))
    report.add(ITEMS["buckets"], *_judge_buckets(comm))
    report.add(ITEMS["overlap"], *_judge_overlap(timeline, torch_timeline))
    report.figure = draw_side_by_side(timeline, torch_timeline)
    return report


def _borrowed(cls) -> list[str]:
    """The exercise's methods ``cls`` takes from the course's from-scratch wrappers (e.g.
    ``dpc.scratch.BucketedDDP``, which passes every item) instead of writing them."""
    return [name for name in ("grad_ready", "finish_gradient_synchronization")
            if getattr(getattr(cls, name, None), "__module__", "").startswith("dpcourse.scratch")]


def _judge_grads(mine, theirs, world: int) -> tuple[bool, str]:
    names = [n for n, _ in models.build_model(MODEL, **SIZES).named_parameters()]
    for rank, (a, b) in enumerate(zip(mine, theirs)):
        for step, (ga, gb) in enumerate(zip(a, b)):
            for name, got, want in zip(names, ga, gb):
                if got is None:
                    return False, f"rank {rank}, step {step}: {name!r} has no gradient after backward"
                if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
                    diff = (got - want).abs().max().item()
                    return False, (f"rank {rank}, step {step}, {name!r}: largest difference {diff:.2g}"
                                   f"{_why(got, want, world)}")
    return True, f"{STEPS} steps x {len(names)} parameters on {world} ranks"


def _why(got: torch.Tensor, want: torch.Tensor, world: int) -> str:
    """A hint from the ratio of the two gradients (least squares: <got, want> / <want, want>)."""
    ratio = (got * want).sum().item() / max((want * want).sum().item(), 1e-30)
    if abs(ratio - world) < 0.01 * world:
        return (f"; yours are {ratio:.2f}x torch DDP's: summed, not averaged -- divide by the "
                f"world size ({world})")
    if abs(ratio - 1) > 0.01 and (got - want).abs().max() > 0.5 * want.abs().max():
        return (" -- these look like this rank's own gradients: is every bucket all-reduced, and does "
                "each param.grad hold its averaged values after the wait?")
    return " -- does each param.grad hold its bucket's averaged values after the wait?"


def _judge_buckets(comm: Comm) -> tuple[bool, str]:
    plan = bucket_plan(models.build_model(MODEL, **SIZES))
    want = sorted(nbytes for _, nbytes in plan)
    for step in range(STEPS):
        sent = [r.nbytes for r in comm.records(rank=0, step=step)  # but the loop's loss average (one float)
                if r.collective == "all_reduce" and r.nbytes > LOSS_BYTES]
        if sorted(sent) == want:
            continue
        missing = [(names, nbytes) for names, nbytes in plan if nbytes not in sent]
        if len(sent) > len(plan):
            return False, (f"{len(sent)} all-reduces in step {step} for {len(plan)} buckets: put a "
                           "bucket's gradients into one flat tensor and all-reduce that once")
        if missing:
            names, _ = missing[0]
            return False, (f"the bucket of {names[0]} ... {names[-1]} was never all-reduced in step "
                           f"{step}: its gradients stayed local (rank 0)")
        return False, (f"step {step}'s all-reduces carried {sorted(sent)} bytes, not one bucket each: "
                       "flatten each bucket's gradients, in the scaffold's order")
    return True, f"{len(plan)} buckets x {STEPS} steps"


def overlap_seconds(events) -> float:
    """Per rank and step, the longest time one all-reduce was in flight after a later layer's
    backward had begun (that layer's backward span, clipped to the all-reduce's)."""
    best = 0.0
    backward = [e for e in events if e.kind == "backward"]
    for e in events:
        if e.kind != "all_reduce" or e.nbytes <= LOSS_BYTES:
            continue
        for b in backward:
            if b.rank == e.rank and b.step == e.step and b.start >= e.start:
                best = max(best, min(e.end, b.end) - b.start)
    return best


def _judge_overlap(mine: Timeline, theirs: Timeline) -> tuple[bool | None, str]:
    events = mine.events(step=None)
    if not any(e.kind == "all_reduce" for e in events):
        return None, "no all-reduce was seen"
    seconds, torch_seconds = overlap_seconds(events), overlap_seconds(theirs.events(step=None))
    detail = (f"longest all-reduce in flight under a later layer's backward: {seconds * 1e3:.2f} ms "
              f"(torch DDP: {torch_seconds * 1e3:.2f} ms)")
    if seconds < OVERLAP_S:
        detail += (" -- every all-reduce was over before the next layer's backward began: launch "
                   "each bucket in grad_ready with async_op=True and wait only in "
                   "finish_gradient_synchronization, once backward is done")
    return seconds >= OVERLAP_S, detail


def draw_side_by_side(mine: Timeline, theirs: Timeline):
    """A matplotlib Figure: the learner's last step (top) and torch DDP's (bottom), per rank."""
    from matplotlib.figure import Figure

    from ..viz.timeline import draw_timeline

    fig = Figure(figsize=(11, 7), layout="constrained")
    top, bottom = fig.subplots(2, 1)
    draw_timeline(mine.events(), ax=top, title="your bucketed DDP")
    draw_timeline(theirs.events(), ax=bottom, title="torch DDP, same bucket cap")
    return fig
