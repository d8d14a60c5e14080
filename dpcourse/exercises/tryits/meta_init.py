"""4.2c's try-it ``meta_init``: a transformer built on meta, sharded, then materialised. Its set-up
on the ranks, its items and the mistakes it names."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ... import models
from ...backends import rank_device
from ...grading.compare import close
from ...grading.judging import on_ranks
from ...grading.registry import try_it
from ...grading.report import Report
from .large_models import TIMEOUT, largest_difference
from .shared import full

def init_every_parameter(model, seed: int = 0):
    """The init the checker passes: each parameter drawn from N(0, 0.02^2) by a generator of its
    own (by its position in ``model.parameters()``); a DTensor keeps this rank's rows only, so
    any number of ranks, or one process, gets the same model."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            g = torch.Generator().manual_seed(seed * 10_000 + i)
            whole = torch.randn(p.shape, generator=g) * 0.02
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements,
                                                     src_data_rank=None).to_local())
            else:
                p.copy_(whole)
    return model


def _storage_peak(tracker, device: torch.device) -> int:
    """The most bytes of storage ``tracker`` saw allocated on ``device``'s type at one moment."""
    peak = 0
    for where, categories in tracker.get_tracker_snapshot("peak").items():
        if torch.device(where).type == device.type:
            peak += sum(v for k, v in categories.items() if getattr(k, "value", k) == "Total")
    return peak


def _meta_init_on_rank(build_sharded):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ...torch_private import mem_tracker_class

    device, world = rank_device(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    created = []       # (device type, bytes) of every parameter as a module was constructed

    def registered(_module, _name, param):
        if param is not None and not isinstance(param, DTensor):
            created.append((param.device.type, param.numel() * param.element_size()))

    # Memory just freed by earlier calls may hold the very weights wanted (the same shards,
    # freed at the same sizes): fill such memory with NaN first, so uninitialised reads show.
    poison = [torch.full((p.numel() // k,), float("nan"), device=device)
              for p in models.build_model("transformer").parameters() for k in (1, world)]
    del poison
    hook = nn.modules.module.register_module_parameter_registration_hook(registered)
    tracker = mem_tracker_class()()
    try:
        with tracker:
            model = build_sharded(mesh, device, init_every_parameter)
    finally:
        hook.remove()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the function returned {type(model).__name__}, not the model")
    want = dict(init_every_parameter(models.build_model("transformer")).named_parameters())
    whole = sum(p.numel() * p.element_size() for p in want.values())

    def on_meta(t):
        return (t.to_local() if isinstance(t, DTensor) else t).is_meta

    tensors = list(model.named_parameters()) + list(model.named_buffers())
    params = dict(model.named_parameters())
    meta = [n for n, t in tensors if on_meta(t)]
    elsewhere = [n for n, t in tensors if not on_meta(t) and t.device.type != device.type]
    whole_here = [n for n, p in params.items()
                  if not (isinstance(p, DTensor) and p.device_mesh.size() == world
                          and all(isinstance(s, Shard) for s in p.placements))]
    got = None
    if not meta and not whole_here:
        got = {n: full(p) for n, p in params.items()}      # every rank gathers: all are DTensors
    elif not meta:
        got = {n: p.detach().cpu() for n, p in params.items() if not isinstance(p, DTensor)}
        if len(got) < len(params):
            got = None                                       # gathering some only could hang
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): n for n, m in model.named_modules()}
    units = sorted(names[id(m)] or "the root" for m in model.modules() if isinstance(m, FSDPModule))
    blocks = len(getattr(model, "blocks", []))
    return {"meta": meta, "elsewhere": elsewhere, "whole_here": whole_here, "count": len(params),
            "units": units, "blocks": blocks,
            "got": got, "want": {n: p.detach() for n, p in want.items()}, "whole": whole,
            "peak": _storage_peak(tracker, device), "built_with_storage": any(d != "meta" for d, _ in created),
            "device": device.type}


@try_it("meta_init", "4.2c", "a transformer built on meta, sharded, then materialised")
@on_ranks(_meta_init_on_rank, "every parameter and buffer has storage on this rank's device",
          "every parameter is a shard: a DTensor split over the ranks",
          "the weights are the init function's, as on one process", "no rank ever held the whole model",
          timeout=TIMEOUT)
def check_meta_init(report: Report, got: list, storage, sharded, weights, held) -> None:
    r = got[0]
    if r["meta"]:
        report.add(storage, False, f"{len(r['meta'])} tensors (e.g. {r['meta'][0]}) are still on the meta "
                                   "device: a shape and a dtype, no storage. What gives this rank's part "
                                   "of a meta model real memory on its device?")
    elif r["elsewhere"]:
        report.add(storage, False, f"{len(r['elsewhere'])} tensors (e.g. {r['elsewhere'][0]}) are not on "
                                   f"the rank's device ({r['device']}): which device was the storage given on?")
    else:
        report.add(storage, True)
    if r["whole_here"]:
        n = len(r["whole_here"])
        report.add(sharded, False, f"{n} of {r['count']} parameters (e.g. {r['whole_here'][0]}) are plain "
                                   "tensors, whole on every rank: were every block and the root (which "
                                   "holds the embeddings and the head) sharded?")
    elif len(r["units"]) < r["blocks"] + 1:
        report.add(sharded, False, f"every parameter is a shard, but the model has {len(r['units'])} FSDP "
                                   f"unit(s) ({', '.join(r['units']) or 'none'}) for {r['blocks']} blocks and "
                                   "the root: forward gathers each unit whole, so a rank would hold the whole "
                                   "model at once. Which modules were to be units of their own, before the root?")
    else:
        report.add(sharded, True)
    if r["got"] is None:
        report.add(weights, None, "judged once every parameter has storage and is sharded")
    elif close(r["got"], r["want"]):
        report.add(weights, True)
    else:
        diff = largest_difference(r["got"], r["want"])
        how = f"largest difference {diff:.3g}" if math.isfinite(diff) else "some are not even finite"
        report.add(weights, False, f"the weights glued from the shards differ from the init function's on "
                                   f"one process ({how}): freshly allocated "
                                   "storage holds whatever was in memory. What fills it, and when must "
                                   "that run?")
    peak, whole = max(x["peak"] for x in got), r["whole"]
    if peak < whole:
        report.add(held, True)
    elif r["built_with_storage"]:
        report.add(held, False, f"constructing the model allocated every parameter: a rank held {peak:,} "
                                f"bytes at once, the whole model is {whole:,}. How can a model get its "
                                "shapes without any storage?")
    else:
        report.add(held, False, f"the model was built without storage, but a rank later held {peak:,} bytes "
                                f"at once (the whole model is {whole:,}): the storage was given to whole "
                                "parameters, before they were split. In which order must sharding and "
                                "allocating come?")
