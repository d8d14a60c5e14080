"""4.2c's try-its: the habits of large-model training, written by the learner (checked on the
notebook's ranks). 4.2f's (DCP checkpoints, gradient accumulation) are in ``long_runs``.

Each checker runs the learner's function on every rank and judges what it did against one
process (weights, gradients, norms of the plain model) and against what the ranks did, seen
from outside: bytes of storage allocated (``MemTracker``), bytes saved for backward
(``Activations``), forward calls of each block, the order of FSDP's all-gathers
(``Timeline``).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ... import models
from ...backends import rank_device
from ...torch_private import wrapper_module_names
from ..report import Report
from . import on_ranks, try_it

TIMEOUT = 30.0          # seconds for one check's call on the ranks
RTOL, ATOL = 1e-4, 1e-6


def _same(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(torch.allclose(got[k], want[k], rtol=RTOL, atol=ATOL) for k in want)


def _largest_difference(got: dict, want: dict) -> float:
    return max(((got[k] - want[k]).abs().max().item() for k in want if k in got and got[k].shape == want[k].shape),
               default=float("inf"))


def _judge_same(report: Report, name: str, got: dict, want: dict, what: str, why: str) -> None:
    """Item ``name``: the tensors ``got`` equal one process's, ``want``; if not, by how much
    ``what`` differ, and ``why`` they should not."""
    if _same(got, want):
        report.add(name, True)
    else:
        report.add(name, False, f"{what} from one process's (largest difference "
                                f"{_largest_difference(got, want):.3g}): {why}")


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor glued together (every rank must call this), any other tensor as it is; on the CPU."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def _shard_blocks(model) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _plain_name(name: str) -> str:
    """A parameter's name in the plain model: activation checkpointing's wrapper names dropped."""
    return name.replace(wrapper_module_names()[1] + ".", "")


# ---------------------------------------------------------------------------------- meta_init
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
        got = {n: _full(p) for n, p in params.items()}      # every rank gathers: all are DTensors
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
    elif _same(r["got"], r["want"]):
        report.add(weights, True)
    else:
        diff = _largest_difference(r["got"], r["want"])
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


# ---------------------------------------------------------------------------------- checkpointing
DEPTH, CHOSEN = 8, [1, 2, 5]      # MLP blocks, and those the learner checkpoints
AC_SAMPLES = 64                   # per rank: enough for activations to show


class _Recompute(nn.Module):
    """The checker's own checkpointing (public ``torch.utils.checkpoint``), for the two extremes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


def _ac_data():
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset("mlp", AC_SAMPLES * world).tensors
    mine = slice(rank * AC_SAMPLES, (rank + 1) * AC_SAMPLES)
    return x, y, mine


def _saved_bytes(model, x, y) -> int:
    """Bytes saved for backward when backward begins, with the model's blocks and root sharded."""
    from ...observe import Activations

    device = rank_device()
    _shard_blocks(model)
    activations = Activations()
    with activations:
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
    return activations.result()["at_backward"][0]


def _checkpointing_on_rank(checkpoint_some):
    device = rank_device()
    x, y, mine = _ac_data()
    none = _saved_bytes(models.build_model("mlp", depth=DEPTH).to(device), x[mine], y[mine])
    every = models.build_model("mlp", depth=DEPTH).to(device)
    for i in range(DEPTH):
        every.blocks[i] = _Recompute(every.blocks[i])
    every = _saved_bytes(every, x[mine], y[mine])

    model = models.build_model("mlp", depth=DEPTH).to(device)
    modules = {"root": model, **{i: block for i, block in enumerate(model.blocks)},
               **{n: m for n, m in model.named_modules() if n.startswith("blocks.") and n.count(".") > 1}}
    calls = {k: 0 for k in modules}
    hooks = [m.register_forward_pre_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
             for k, m in modules.items()]
    returned = checkpoint_some(model, list(CHOSEN))
    model = returned if isinstance(returned, nn.Module) else model
    saved = _saved_bytes(model, x[mine], y[mine])       # one forward and one backward
    for hook in hooks:
        hook.remove()
    grads = {_plain_name(n): _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    one = models.build_model("mlp", depth=DEPTH)
    F.mse_loss(one(x), y).backward()
    return {"none": none, "every": every, "saved": saved, "calls": calls, "grads": grads,
            "want": {n: p.grad for n, p in one.named_parameters()}}


@try_it("checkpointing", "4.2c", f"checkpoint blocks {CHOSEN} of {DEPTH}, no others")
@on_ranks(_checkpointing_on_rank, "exactly the chosen blocks run their forward again in backward",
          "bytes saved for backward: as for the chosen blocks", "gradients equal one process's without checkpointing",
          timeout=TIMEOUT)
def check_checkpointing(report: Report, got: list, which, saved, grads) -> None:
    r = got[0]
    calls = r["calls"]
    again = [i for i in range(DEPTH) if calls[i] > 1]
    if calls["root"] > 1:
        report.add(which, False, "the whole model ran its forward a second time during backward: the "
                                 "checkpoint was put around the model itself, so every block's insides "
                                 "were recomputed. Which modules should be wrapped?")
    elif again == CHOSEN and all(calls[i] == 2 for i in CHOSEN):
        report.add(which, True)
    elif not again and any(calls[k] > 1 for k in calls if isinstance(k, str) and k != "root"):
        inner = sorted(k for k in calls if isinstance(k, str) and k != "root" and calls[k] > 1)
        report.add(which, False, f"no block ran its forward again in backward, but modules inside them did "
                                 f"({', '.join(inner)}): the wrong modules were checkpointed, smaller ones "
                                 "than the blocks. Which modules did the selection accept?")
    elif not again:
        report.add(which, False, "no block ran its forward again in backward: nothing was checkpointed. "
                                 "Did the selection accept any module? A check_fn is called with modules, "
                                 "not indices; a wrapper counts only where it replaces the block in the model.")
    else:
        report.add(which, False, f"blocks {again} ran their forward again in backward: the selection "
                                 "accepted other modules than the chosen blocks. Which modules did it "
                                 "accept?")
    k, depth = len(CHOSEN), DEPTH
    per_block = (r["none"] - r["every"]) / depth
    expected = r["none"] - k * per_block
    as_many = round((r["none"] - r["saved"]) / per_block) if per_block > 0 else 0
    if r["every"] < r["saved"] < r["none"] and abs(r["saved"] - expected) <= 0.02 * per_block:
        report.add(saved, True)
    elif r["saved"] >= r["none"]:
        report.add(saved, False, f"{r['saved']:,} bytes were saved when backward began, as many as with no "
                                 "block checkpointed: every block kept its insides for backward")
    elif r["saved"] < r["every"]:
        report.add(saved, False, f"{r['saved']:,} bytes were saved when backward began, fewer than with all "
                                 f"{depth} blocks checkpointed ({r['every']:,}): something larger than a "
                                 "block kept only its input")
    elif r["saved"] == r["every"]:
        report.add(saved, False, f"{r['saved']:,} bytes were saved when backward began, as with all {depth} "
                                 "blocks checkpointed: blocks that were not chosen kept only their input too")
    else:
        blocks = f"{as_many} checkpointed block{'s' if as_many != 1 else ''}"
        report.add(saved, False, f"{r['saved']:,} bytes were saved when backward began: the saving of about "
                                 f"{blocks} ({r['none']:,} with none, {r['every']:,} with all {depth}). "
                                 "How many blocks were chosen?")
    _judge_same(report, grads, r["grads"], r["want"], "they differ", "a recomputed forward must give the "
                "same gradients. Was anything else changed in the model?")


# ---------------------------------------------------------------------------------- offload_clip
MAX_NORM, LR, CLIP_SAMPLES = 0.05, 0.1, 16     # the clip, SGD's lr, samples per rank


def _offloaded(module) -> bool | None:
    """Whether FSDP2 keeps ``module``'s shards in CPU memory (None: it shards no parameters)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from ...torch_private import fsdp2_offload_policy

    policy = fsdp2_offload_policy(module)
    return None if policy is None else isinstance(policy, CPUOffloadPolicy)


def _one_process_clip(x, y):
    """One process: the global gradient norm; the weights after a clipped step and an unclipped one."""
    out = {}
    for clip in (True, False):
        one = models.build_model("mlp")
        optimizer = torch.optim.SGD(one.parameters(), lr=LR)
        F.mse_loss(one(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(one.parameters(), MAX_NORM if clip else float("inf"))
        out["norm"] = norm.item()
        if not clip:
            out["grads"] = {n: p.grad.clone() for n, p in one.named_parameters()}
        optimizer.step()
        out["clipped" if clip else "unclipped"] = {n: p.detach().clone() for n, p in one.named_parameters()}
    return out


def _offload_clip_on_rank(clipped_step):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    device, rank, world = rank_device(), dist.get_rank(), dist.get_world_size()
    x, y = models.make_dataset("mlp", CLIP_SAMPLES * world).tensors
    mine = slice(rank * CLIP_SAMPLES, (rank + 1) * CLIP_SAMPLES)
    model = models.build_model("mlp").to(device)
    returned = clipped_step(model, x[mine].to(device), y[mine].to(device), MAX_NORM)
    if isinstance(returned, DTensor):
        returned = returned.full_tensor()
    norm = float(returned) if returned is not None else None
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    offloaded = [_offloaded(m) for m in units]
    local_devices = {p.to_local().device.type for p in model.parameters() if isinstance(p, DTensor)}
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    weights = {n: _full(p) for n, p in model.named_parameters()} if sharded else None
    one = _one_process_clip(x, y)
    # the norm of this rank's rows of the gradient, as FSDP2 splits it: what a per-rank norm sees
    local_sq = sum(g.chunk(world)[rank].pow(2).sum().item() if len(g.chunk(world)) > rank else 0.0
                   for g in one["grads"].values())
    return {"norm": norm, "one_norm": one["norm"], "local_norm": local_sq ** 0.5, "units": len(units),
            "offloaded": offloaded, "local_devices": sorted(local_devices), "weights": weights,
            "clipped": one["clipped"], "unclipped": one["unclipped"],
            "initial": {n: p.detach().clone() for n, p in models.build_model("mlp").named_parameters()}}


@try_it("offload_clip", "4.2c", f"FSDP2 with CPU offload, gradients clipped to {MAX_NORM}")
@on_ranks(_offload_clip_on_rank, "the norm returned is the norm of all the ranks' gradients together",
          "the step used gradients clipped over all ranks (weights as one process's)",
          "the shards, gradients and optimizer state are kept in CPU memory", timeout=TIMEOUT)
def check_offload_clip(report: Report, got: list, norm, step, offload) -> None:
    r = got[0]
    norms = [x["norm"] for x in got]
    locals_ = [x["local_norm"] for x in got]
    if any(n is None for n in norms):
        report.add(norm, False, "the function returned None: return the total norm that clipping reported")
    elif all(abs(n - r["one_norm"]) <= 1e-4 * r["one_norm"] for n in norms):
        report.add(norm, True)
    elif all(abs(n - m) <= 1e-4 * m for n, m in zip(norms, locals_)):
        report.add(norm, False, f"the ranks returned different norms ({', '.join(f'{n:.4g}' for n in norms)}): "
                                "each the norm of its own shard of the gradients, a part of the whole. "
                                "What must the ranks combine before the norm is known?")
    elif all(abs(n - MAX_NORM) <= 1e-4 for n in norms):
        report.add(norm, False, f"the ranks returned {norms[0]:.4g}, the norm after clipping: clipping "
                                "reports the norm it found before it scaled the gradients")
    else:
        report.add(norm, False, f"the ranks returned {', '.join(f'{n:.4g}' for n in norms)}, not the norm of "
                                "the whole gradient (every rank's shard together)")
    if r["weights"] is None:
        report.add(step, None, "judged once every parameter is sharded")
    elif _same(r["weights"], r["clipped"]):
        report.add(step, True)
    elif _same(r["weights"], r["initial"]):
        report.add(step, False, "the weights did not change at all: the step moved nothing. fully_shard "
                                "replaces each parameter with a DTensor: which parameters does the "
                                "optimizer hold, and when was it created?")
    elif _same(r["weights"], r["unclipped"]):
        report.add(step, False, "the weights are those of a step with unclipped gradients: the gradients "
                                "were scaled too late, or not at all. When does the optimizer read them?")
    else:
        diff = _largest_difference(r["weights"], r["clipped"])
        report.add(step, False, f"the weights differ from a clipped step on one process (largest difference "
                                f"{diff:.3g}), and from an unclipped one: were the ranks' shards scaled by "
                                f"different factors? One norm of the whole gradient decides the factor.")
    if not r["units"]:
        report.add(offload, False, "no module was sharded with FSDP2, so there is nothing to offload")
    elif all(x is not False for x in r["offloaded"]) and r["local_devices"] in ([], ["cpu"]):
        report.add(offload, True)
    else:
        kept = sum(x is False for x in r["offloaded"])
        report.add(offload, False, f"{kept} of {r['units']} FSDP units were sharded without offloading: with "
                                   "an accelerator, their shards, gradients and optimizer state would stay "
                                   "in its memory. What tells FSDP2 to keep them in CPU memory, and did "
                                   "every unit get it?")


# ---------------------------------------------------------------------------------- prefetch
AHEAD, WIDTHS = 2, (32, 40, 48, 56, 64, 72)   # blocks prefetched ahead; widths (each block its own size)


class Widening(nn.Module):
    """An MLP whose blocks all differ in size, so each all-gather's bytes tell its block; the root
    holds an input layer (computed before block 0) and the head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTHS[0], WIDTHS[0])
        self.blocks = nn.ModuleList(models.MLPBlock(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))
        self.head = nn.Linear(WIDTHS[-1], 8)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _widening() -> Widening:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Widening()


def _forward_order(set_prefetch=None):
    """Two SGD steps of the sharded Widening model; the last forward's order of events on this
    rank: ("gather", bytes) and ("compute", block index; -1 the root's input layer), and the
    weights after the steps."""
    from ...observe import Timeline

    device, rank = rank_device(), dist.get_rank()
    x, y = models.make_dataset("mlp", 16 * dist.get_world_size()).tensors
    mine = slice(rank * 16, (rank + 1) * 16)
    model = _shard_blocks(_widening().to(device))
    if set_prefetch is not None:
        set_prefetch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    timeline = Timeline()
    with timeline:
        for _ in range(2):
            F.mse_loss(model(x[mine].to(device)), y[mine].to(device)).backward()
            optimizer.step()
            optimizer.zero_grad()
    events = sorted((e for e in timeline.result()["events"] if e["step"] == 1), key=lambda e: e["start"])
    end = max(e["end"] for e in events if e["kind"] == "forward")
    order = []
    for e in events:
        if e["kind"] == "all_gather" and e["start"] < end:
            order.append(("gather", e["nbytes"]))
        elif e["kind"] == "forward" and e["name"].startswith("blocks."):
            order.append(("compute", int(e["name"].split(".")[1])))
        elif e["kind"] == "forward" and e["name"] == "inp":
            order.append(("compute", -1))
    return order, {n: _full(p) for n, p in model.named_parameters()}


def _prefetch_on_rank(prefetch):
    default, _ = _forward_order()
    sizes = [nbytes for kind, nbytes in default if kind == "gather"]   # root, blocks 0, 1, ...: by default
    unit = {nbytes: i - 1 for i, nbytes in enumerate(sizes)}          # -1: the root
    order, weights = _forward_order(prefetch)
    events = [(kind, unit.get(v, "?") if kind == "gather" else v) for kind, v in order]
    one = _widening()
    optimizer = torch.optim.SGD(one.parameters(), lr=0.1)
    x, y = models.make_dataset("mlp", 16 * dist.get_world_size()).tensors
    for _ in range(2):
        F.mse_loss(one(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"events": events, "weights": weights, "want": {n: p.detach().clone() for n, p in one.named_parameters()}}


def _ahead(events, blocks: int) -> tuple[list[int], list, list[int]]:
    """For each block, how many later blocks were gathered before it began computing; the units
    gathered more than once in the forward; the blocks gathered before the root's input layer."""
    gathered, ahead, seen, first = set(), [], [], None
    for kind, v in events:
        if kind == "gather":
            if v in gathered:
                seen.append(v)
            gathered.add(v)
        elif v == -1 and first is None:
            first = sorted(j for j in gathered if isinstance(j, int) and j >= 0)
        elif len(ahead) == v:
            ahead.append(sum(1 for j in gathered if isinstance(j, int) and j > v))
    return ahead + [0] * (blocks - len(ahead)), seen, first or []


@try_it("prefetch", "4.2c", f"each block's forward all-gather issued {AHEAD} blocks early, the first by the root")
@on_ranks(_prefetch_on_rank, f"the first {AHEAD} blocks' gathers are issued before the root's input layer computes",
          f"each block finds the next {AHEAD} blocks' gathers issued when it starts",
          "each unit is gathered once per forward",
          "training is unchanged: the weights after two steps equal one process's", timeout=TIMEOUT)
def check_prefetch(report: Report, got: list, start, early, once, same) -> None:
    r = got[0]
    blocks = len(WIDTHS) - 1
    ahead, again, first = _ahead(r["events"], blocks)
    if first == list(range(AHEAD)):
        report.add(start, True)
    elif not first:
        report.add(start, False, "when the root's input layer began computing, no block's gather had been "
                                 "issued: block 0 waits for its own gather after the input layer, with the "
                                 "link idle meanwhile. The root is a unit too, and runs first: who can issue "
                                 "the first blocks' gathers before any block runs?")
    else:
        report.add(start, False, f"when the root's input layer began computing, the gathers of "
                                 f"{', '.join(f'block {j}' for j in first)} had been issued: which blocks does "
                                 "the root's prefetch list name?")
    want = [min(AHEAD, blocks - 1 - i) for i in range(blocks)]
    seen = ", ".join(f"block {i}: {a}" for i, a in enumerate(ahead))
    if ahead == want:
        report.add(early, True)
    elif max(ahead) < min(AHEAD, blocks - 1) and ahead[:-1] == [max(ahead)] * (blocks - 1) and max(ahead) > 0:
        report.add(early, False, f"later blocks already gathered as each block started: {seen}. Each block "
                                 "prefetches fewer blocks than asked: how many does its list name?")
    elif not any(ahead):
        report.add(early, False, f"later blocks already gathered as each block started: {seen}. The forward's "
                                 "all-gathers ran one by one, each as its block began, as with no prefetching "
                                 "at all. Forward and backward each have a prefetch list of their own: which "
                                 "one did the function set?")
    elif ahead[0] > 0 and not any(ahead[1:]):
        report.add(early, False, f"later blocks already gathered as each block started: {seen}. Only the "
                                 "first block found anything prefetched: the prefetching was set up once, "
                                 "where the forward begins. Who issues the gathers for the blocks further on?")
    else:
        report.add(early, False, f"later blocks already gathered as each block started: {seen}. Which "
                                 "blocks does each block's prefetch list name: those that come after it?")
    if not again:
        report.add(once, True)
    else:
        names = sorted({"the root" if u == -1 else f"block {u}" for u in again if u != "?"})
        report.add(once, False, f"{', '.join(names) or 'some units'} were gathered a second time in one "
                                "forward, after they had computed and freed their parameters: a prefetch "
                                "that names blocks already done gathers them again for nothing")
    _judge_same(report, same, r["weights"], r["want"], "the weights differ", "prefetching changes when "
                "parameters arrive, never what is computed. Was anything else changed?")
