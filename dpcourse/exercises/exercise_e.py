"""Exercise E: the bucket logic of a bucketed DDP; the checker trains it next to torch DDP.

    report = dpc.exercises.check_e(MyBucketedDDP)
    report.figure                                # your timeline above torch DDP's

The learner's class (a subclass of ``dpc.scratch.BucketedDDP`` overriding ``grad_ready`` and
``finish_gradient_synchronization``) and torch DDP train the same MLP from the same weights
on the same data for ``STEPS`` SGD steps on 2 ranks, with the same buckets
(``bucket_cap_mb=BUCKET_CAP_MB``: 3 buckets). The checker compares the gradients after every
backward, sees every ``dist.all_reduce`` the learner's class starts (the function is wrapped
on the ranks for the run, as ``scratch.observe.FSDP1Observer`` does), and records both
timelines with the course's observers: per-layer backward from tensor hooks, collectives from
launch to completion.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import models
from ..scratch.bucketed import assign_buckets
from ..scratch.observe import BackwardObserver, observe_ddp_communication
from ..scratch.timeline import COMM, COMPUTE, Timeline, from_lists
from .ranks import RankFailure, blanks_in, clusters_for, run_or_failure
from .report import Report

MODEL, SIZES = "mlp", {"d_hidden": 30, "depth": 3}
BUCKET_CAP_MB = 0.002  # MiB: 3 buckets for this MLP (the head and last block, then one per block)
STEPS, BATCH, LR = 3, 8, 0.1  # SGD steps, samples per rank per step, learning rate
RTOL, ATOL = 1e-5, 1e-6       # on gradients; at 2 ranks (g0 + g1) / 2 is exact, so it is 0 there
ITEMS = {"runs": f"trains {STEPS} steps on the ranks",
         "grads": "gradients equal torch DDP's after every backward (same model, data, buckets)",
         "buckets": "each bucket is all-reduced exactly once per backward",
         "overlap": "all-reduces start while backward is still computing (overlap)"}


@dataclass(repr=False)
class DDPReport(Report):
    """A ``Report`` that also carries ``figure``: the learner's timeline above torch DDP's
    (a matplotlib Figure, None if nothing ran)."""
    figure: object = None


class AllReduceRecorder:
    """Inside ``with AllReduceRecorder(buffers, timeline) as rec:``, every ``dist.all_reduce``
    is recorded: (step, bucket index or None, bytes, blocking) in ``rec.launches``, and its
    span from launch to completion in ``timeline``. ``buffers``: the buckets' flat buffers, by index."""

    def __init__(self, buffers, timeline: Timeline):
        self.where = {b.data_ptr(): i for i, b in enumerate(buffers)}
        self.timeline, self.launches, self.step, self._real = timeline, [], 0, None

    def __enter__(self):
        self._real = real = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            start, nbytes = time.perf_counter(), tensor.numel() * tensor.element_size()
            index = self.where.get(tensor.data_ptr())
            name = f"bucket {index}" if index is not None else f"{nbytes} B"
            work = real(tensor, *args, **kwargs)
            self.launches.append((self.step, index, nbytes, work is None))
            if work is None:  # blocking: it is already done
                self.timeline.add(COMM, "all_reduce", name, start, nbytes=nbytes)
                return work
            return self.timeline.comm(work, "all_reduce", name, nbytes, start)

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


def _train_on_rank(kind, steps: int = STEPS):
    """On this rank: ``steps`` SGD steps of the MLP wrapped by ``kind`` (the learner's class,
    or "ddp"). Returns gradients after each backward, all-reduce launches, the last
    step's timeline, and the buckets' parameter names."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.build_model(MODEL, seed=0, **SIZES)
    timeline, recorder = Timeline(rank), None
    if kind == "ddp":
        wrapped = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
        observe_ddp_communication(wrapped, timeline)
        buckets = None
    else:
        wrapped = kind(model, bucket_cap_mb=BUCKET_CAP_MB)
        buckets = [list(b.names) for b in wrapped.buckets.buckets]
        recorder = AllReduceRecorder([b.buffer for b in wrapped.buckets.buckets], timeline)
    backward = BackwardObserver(model, timeline)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    x, y = models.make_dataset(MODEL, BATCH * world * steps, seed=1).tensors
    grads = []
    with recorder if recorder is not None else contextlib.nullcontext():
        for step in range(steps):
            if recorder is not None:
                recorder.step = step
            timeline.clear()  # keep the last step only
            dist.barrier()    # the ranks start the step together
            lo = (step * world + rank) * BATCH
            start = time.perf_counter()
            out = wrapped(x[lo:lo + BATCH])
            timeline.add(COMPUTE, "forward", "model", start)
            models.loss_fn(MODEL, out, y[lo:lo + BATCH]).backward()
            backward.backward_returned()
            grads.append({n: p.grad.detach().clone() if p.grad is not None else None
                          for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    backward.remove()
    return {"grads": grads, "launches": recorder.launches if recorder else None,
            "timeline": timeline.to_list(), "buckets": buckets}


def check_e(cls, cluster=None, timeout: float = 60.0) -> DDPReport:
    """Train ``cls`` and torch DDP side by side on the ranks; say item by item what is right.

    cls: a subclass of ``dpc.scratch.BucketedDDP`` (built as ``cls(model, bucket_cap_mb=...)``).
    cluster: a ``dpc.Cluster`` of 2 or more ranks to use (None: one of 2 ranks is started for
    the check and shut down after it, ~5 s). timeout: seconds per training run.
    """
    report = DDPReport("Exercise E")
    if blanks_in(cls):
        report.attempted = False
        report.note = (f"Fill in the `...` in {cls.__name__}.grad_ready (and write "
                       "finish_gradient_synchronization), then run this cell again.")
        return report
    world = cluster.world_size if cluster is not None else 2
    with clusters_for(cluster, [world]) as clusters:
        mine = run_or_failure(clusters[world], _train_on_rank, cls, timeout=timeout)
        if isinstance(mine, RankFailure):
            report.add(ITEMS["runs"], False, mine.describe(timeout))
            for key in ("grads", "buckets", "overlap"):
                report.add(ITEMS[key], None, "judged once it trains")
            return report
        theirs = clusters[world].run(_train_on_rank, "ddp", timeout=timeout)
    report.add(ITEMS["runs"], True, f"{world} ranks, {STEPS} SGD steps of the course's MLP")
    report.add(ITEMS["grads"], *_judge_grads(mine, theirs, world))
    report.add(ITEMS["buckets"], *_judge_buckets(mine[0]))
    report.add(ITEMS["overlap"], *_judge_overlap(mine, theirs))
    report.figure = draw_side_by_side(mine, theirs)
    return report


def _judge_grads(mine, theirs, world: int) -> tuple[bool, str]:
    for rank, (a, b) in enumerate(zip(mine, theirs)):
        for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            for name, want in gb.items():
                got = ga[name]
                if got is None:
                    return False, f"rank {rank}, step {step}: {name!r} has no gradient after backward"
                if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
                    diff = (got - want).abs().max().item()
                    return False, (f"rank {rank}, step {step}, {name!r}: largest difference {diff:.2g}"
                                   f"{_why(got, want, world)}")
    return True, f"{STEPS} steps x {len(mine[0]['grads'][0])} parameters on {world} ranks"


def _why(got: torch.Tensor, want: torch.Tensor, world: int) -> str:
    """A hint from the ratio of the two gradients (least squares: <got, want> / <want, want>)."""
    ratio = (got * want).sum().item() / max((want * want).sum().item(), 1e-30)
    if abs(ratio - world) < 0.01 * world:
        return (f"; yours are {ratio:.2f}x torch DDP's: summed, not averaged -- divide the "
                f"bucket by the world size ({world})")
    return " -- is every bucket all-reduced, and is each param.grad its slot after the wait?"


def _judge_buckets(result) -> tuple[bool, str]:
    names, launches = result["buckets"], result["launches"]
    for step in range(STEPS):
        counts = [sum(1 for s, b, *_ in launches if s == step and b == i) for i in range(len(names))]
        for i, count in enumerate(counts):
            if count != 1:
                what = (f"was never all-reduced in step {step}: its gradients stayed local"
                        if count == 0 else f"was all-reduced {count} times in step {step}")
                return False, f"bucket {i} ({', '.join(names[i])}) {what} (rank 0)"
    others = [nbytes for _, b, nbytes, _ in launches if b is None]
    if others:
        return False, (f"{len(others)} all-reduce(s) of tensors that are no bucket's buffer, "
                       f"e.g. {others[0]} B: all-reduce bucket.buffer itself")
    return True, f"{len(names)} buckets x {STEPS} steps"


def _during_backward(result) -> tuple[int, int]:
    """(all-reduces launched before the last layer's backward began, all-reduces) on a rank."""
    events = result["timeline"]
    begun = max((e["start"] for e in events if e["kind"] == "backward"), default=None)
    launches = [e["start"] for e in events if e["lane"] == COMM]
    if begun is None:
        return 0, len(launches)
    return sum(1 for t in launches if t < begun), len(launches)


def _judge_overlap(mine, theirs) -> tuple[bool | None, str]:
    early, total = _during_backward(mine[0])
    torch_early, torch_total = _during_backward(theirs[0])
    if total == 0:
        return None, "no all-reduce was launched"
    if any(blocking for *_, blocking in mine[0]["launches"]):
        return False, ("your all-reduces block: backward stops at each one until every rank has "
                       "sent its bucket -- pass async_op=True, keep the Work, wait at the end")
    detail = (f"{early} of {total} all-reduces launched before the last layer's backward began "
              f"(torch DDP: {torch_early} of {torch_total}; rank 0, last step)")
    if early == 0:
        detail += (" -- launch each bucket in grad_ready, as soon as its last gradient is in, "
                   "not after backward")
    return early > 0, detail


def expected_buckets() -> list[list[int]]:
    """The bucket plan for the checker's model (parameter indices in reverse registration
    order), computed from the packing rule alone (``assign_buckets``)."""
    params = list(models.build_model(MODEL, **SIZES).parameters())[::-1]
    return assign_buckets([p.numel() for p in params], [p.element_size() for p in params], BUCKET_CAP_MB)


def draw_side_by_side(mine, theirs):
    """A matplotlib Figure: the learner's last step (top) and torch DDP's (bottom), per rank."""
    from matplotlib.figure import Figure

    from ..viz.timeline import draw_timeline

    fig = Figure(figsize=(11, 7), layout="constrained")
    top, bottom = fig.subplots(2, 1)
    draw_timeline(from_lists([r["timeline"] for r in mine]), ax=top, title="your bucketed DDP")
    draw_timeline(from_lists([r["timeline"] for r in theirs]), ax=bottom, title="torch DDP, same buckets")
    return fig
