"""Prefetching: start gathering the next unit's parameters before the current unit computes.

FSDP issues one all-gather per unit. Issued just before the unit computes, the compute has to
wait for it; issued one unit earlier, it can run while the previous unit computes (on GPUs
the all-gather runs on its own CUDA stream, so it overlaps; with Gloo on CPUs it runs in
Gloo's own threads, competing with compute for the same cores). The knobs:

* FSDP2: by default, backward already prefetches one unit (the next in reverse order) and
  forward does not. ``block.set_modules_to_forward_prefetch([next_block])`` adds forward
  prefetching; ``set_modules_to_backward_prefetch([...])`` replaces the default (an empty
  list turns it off; two modules prefetch two units ahead, at the cost of memory).
* FSDP1: ``forward_prefetch=True`` and ``backward_prefetch=BackwardPrefetch.BACKWARD_PRE``
  (the default: gather the next unit before the current unit's gradient computation) or
  ``BACKWARD_POST`` (after it) or ``None``.

Each prefetch holds one more gathered unit in memory at a time: speed traded for memory.
"""
from __future__ import annotations

from .. import models
from .common import loss_of, rank_batch, shard


def set_prefetch(model, forward: bool, backward: int | None = None) -> None:
    """FSDP2 knobs on a sharded model: ``forward`` prefetches the next block in forward;
    ``backward`` is how many blocks backward gathers ahead (None: FSDP2's default, one)."""
    blocks = list(model.blocks)
    if forward:
        for block, following in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([following])
    if backward is not None:
        if backward < 1:  # an empty list means "the default" to FSDP2
            raise ValueError(f"backward={backward}: FSDP2 always prefetches at least one block in backward")
        for i, block in enumerate(blocks):
            block.set_modules_to_backward_prefetch(blocks[max(0, i - backward):i][::-1])


def prefetch_step(forward: bool, backward: int | None = None, batch_size: int = 16, observe=None):
    """On every rank: an FSDP2 step with the given prefetch knobs; ``observe(model, step)`` runs
    the step once more, after a warm-up step, and its result is returned (e.g.
    ``measure.fsdp2_events``)."""
    model = shard(models.build_model("mlp"))
    set_prefetch(model, forward, backward)
    return _observed_step(model, batch_size, observe)


def fsdp1_prefetch_step(backward_prefetch: str | None, batch_size: int = 16, observe=None):
    """On every rank: the same with FSDP1 (one unit per block), ``backward_prefetch``
    "BACKWARD_PRE" (FSDP1's default), "BACKWARD_POST" or None; e.g. ``measure.fsdp1_events``."""
    import torch
    from torch.distributed.fsdp import BackwardPrefetch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    knob = getattr(BackwardPrefetch, backward_prefetch) if backward_prefetch else None
    model = FSDP(models.build_model("mlp"), device_id=torch.device("cpu"), backward_prefetch=knob,
                 auto_wrap_policy=ModuleWrapPolicy(models.wrap_classes("mlp")))
    return _observed_step(model, batch_size, observe)


def _observed_step(model, batch_size: int, observe):
    inputs, targets = rank_batch(batch_size)

    def step():
        loss_of(model, inputs, targets).backward()

    step()  # warm-up: the first step also does one-time set-up
    return observe(model, step) if observe else step()


def issue_order(events) -> list[str]:
    """Kernel side: "gather blocks.1", "forward blocks.0", ... in the order they began."""
    verb = {"all_gather": "gather", "forward": "forward", "backward": "backward"}
    return [f"{verb[e['kind']]} {e['name']}" for e in sorted(events, key=lambda e: e["start"])]


def gathered_ahead(events, phase: str) -> dict[str, list[str]]:
    """Kernel side: for each unit's compute in ``phase`` ("forward"/"backward"), the later
    units of that phase whose all-gather had begun before this compute ended (could overlap it)."""
    events = sorted(events, key=lambda e: e["start"])
    computes = [e for e in events if e["kind"] == phase]
    end_of_forward = max(e["end"] for e in events if e["kind"] == "forward")
    gathers = [g for g in events if g["kind"] == "all_gather"
               and (g["start"] > end_of_forward) == (phase == "backward")]
    out = {}
    for i, unit in enumerate(computes):
        later = [c["name"] for c in computes[i + 1:]]
        out[unit["name"]] = [g["name"] for g in gathers if g["name"] in later and g["start"] < unit["end"]]
    return out
