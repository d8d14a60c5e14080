"""4.2a's try-it ``comm_hook``: a comm hook that all-reduces the buckets in bf16. Its set-up on the
ranks, its items and the mistakes it names."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import models
from ...grading.compare import close, scale_of
from ...grading.judging import RankFailure, on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from ...patching import patched
from .ddp import ATOL, RTOL, TIMEOUT, global_grads, grads_of
from .shared import all_reduces

SHARE = 16   # samples per rank
# bf16 keeps 8 significant bits: rounding to it moves a value by at most u = 2**-8 of itself.
# The hook rounds each rank's share g_r / N (or g_r) once, the N - 1 additions of the
# all-reduce round at most once each, a division after it once more: the mean it returns is
# off by at most u * (sum over r of |g_r| + |mean|) -- the tolerance, per element.
BF16_U = torch.finfo(torch.bfloat16).eps / 2


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

    from ...tracking.tracker import TRACKER

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset("mlp", SHARE * world).tensors
    mine = slice(rank * SHARE, (rank + 1) * SHARE)
    plain, hooked = [], []
    ddp = DDP(models.build_model("mlp", seed=0))                # DDP's own all-reduce: the bytes
    with TRACKER.listen(all_reduces(plain)):
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

    with patched(ddp, register_comm_hook=watching):
        register(ddp)
    with TRACKER.listen(all_reduces(hooked)):
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
    local = []   # every rank's gradient of its own share, computed here
    for r in range(world):
        model = models.build_model("mlp", seed=0)
        F.mse_loss(model(x[r * SHARE:(r + 1) * SHARE]), y[r * SHARE:(r + 1) * SHARE]).backward()
        local.append(grads_of(model))
    return {"plain": plain, "hooked": hooked, "registered": bool(registered), "returned": returned,
            "grads": grads_of(ddp.module), "local": local, "want": global_grads(SHARE, world),
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
        ratio = scale_of(r["grads"], r["want"])
        if abs(ratio - 1) > 0.05 and ratio > 0:
            detail = (f"about {ratio:.2g} times the right size: an all-reduce adds the ranks' buckets. "
                      "What turns that sum into the mean DDP's own all-reduce leaves?")
        elif any(close(x["grads"], x["local"][i]) for i, x in enumerate(got)):
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
