"""What several chapters' try-it checks use on the ranks: the collectives issued in a block,
an all-reduce listener, a DTensor's full value, the warm-up and warnings of FSDP's checks."""
from __future__ import annotations

import contextlib
import warnings

import torch


class Collectives:
    """On a rank: every collective issued inside ``with``, as (phase, collective, dtype);
    ``phase`` is whatever the checker last set ("forward", "backward", ...)."""

    def __init__(self):
        self.phase, self.seen, self.sizes = "", [], []   # sizes: each collective's first tensor's numel

    def __enter__(self):
        from ...observe.comm import first_tensor
        from ...tracking.tracker import TRACKER

        def issued(call):
            t = first_tensor(call.args[0]) if call.args else None
            self.seen.append((self.phase, call.collective, None if t is None else str(t.dtype).replace("torch.", "")))
            self.sizes.append(None if t is None else t.numel())

        self._listening = TRACKER.listen(issued)
        self._listening.__enter__()
        return self

    def __exit__(self, *exc):
        self._listening.__exit__(*exc)

    def count(self, collective: str, phase: str | None = None) -> int:
        return sum(1 for p, c, _ in self.seen if c == collective and (phase is None or p == phase))

    def dtypes(self, collective: str) -> set[str]:
        return {d for _, c, d in self.seen if c == collective}


def all_reduces(seen: list):
    """A listener for the collective tracker: (dtype, bytes) of every all-reduce issued."""
    def listen(issued):
        if issued.collective == "all_reduce":
            arg = issued.args[0]
            for t in arg if isinstance(arg, (list, tuple)) else [arg]:
                if isinstance(t, torch.Tensor):
                    seen.append((str(t.dtype).removeprefix("torch."), t.numel() * t.element_size()))
    return listen


@contextlib.contextmanager
def quiet_fsdp1():
    """FSDP1's state-dict code warns about its own internals (ShardedTensor, default devices)
    at every call: not the learner's business in a check."""
    with warnings.catch_warnings():
        for text in ("Please use DTensor instead", "`_get_pg_default_device` will be deprecated",
                     "Multiple backends are registered"):
            warnings.filterwarnings("ignore", text)
        yield


def full(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the CPU, glued together when it is a DTensor (a collective then:
    every rank must call this)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def fsdp_imports() -> None:
    """The warm-up of FSDP's checks: every rank imports FSDP, DTensor and DCP before a timed call."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
