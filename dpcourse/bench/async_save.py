"""``dcp.save`` next to ``dcp.async_save``: how long each blocks a training loop, one run.

    python -m dpcourse.bench async_save [--world-size 2] [--d-hidden 1024] [--depth 6] [--rounds 5]

Each rank trains an MLP under FSDP2 ``fully_shard`` (one unit per block) with AdamW and saves
model and optimizer state with DCP after every other step, ``--saves`` times per run, each save
on a Gloo group of its own (the background write's collectives never meet training's). Runs
alternate, save then async_save, ``--rounds`` times, so load on the machine hits both alike.
Per save (every rank, every save after the first of a run, which pays one-time set-up), in
milliseconds: the time the loop was blocked (the save call; for async_save also the wait on
the previous write, which has mostly finished by then) and, for async_save, how long the
write went on after the call returned. Printed: medians and quartiles, and the ratio
blocked(save) / blocked(async_save) of the medians. A checkpoint of each kind is loaded back
and compared with the weights at its save: both must equal them exactly.
"""
from __future__ import annotations

import shutil
import statistics
import tempfile

HELP = "DCP checkpoints: time the loop is blocked by dcp.save vs dcp.async_save"


def add_arguments(parser) -> None:
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--d-hidden", type=int, default=1024, help="MLP width")
    parser.add_argument("--depth", type=int, default=6, help="MLP blocks")
    parser.add_argument("--saves", type=int, default=3, help="saves per run")
    parser.add_argument("--rounds", type=int, default=5)


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _full(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _train_saving(kind: str, folder: str, sizes: dict, saves: int) -> dict:
    """On every rank: train, saving every other step with ``kind``; seconds blocked per save,
    seconds each async write went on after its call, and the weights at the last save."""
    import time
    from concurrent.futures import Future

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ..models import build_model, make_dataset

    model = _shard(build_model("mlp", seed=0, **sizes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = make_dataset("mlp", 8 * dist.get_world_size()).tensors
    rows = slice(dist.get_rank() * 8, (dist.get_rank() + 1) * 8)
    group = dist.new_group(backend="gloo")
    save = dcp.save if kind == "save" else dcp.async_save
    blocked, writing, pending, returned_at = [], [], None, 0.0
    for step in range(1, 2 * saves + 2):
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 2:
            continue
        start = time.perf_counter()
        if isinstance(pending, Future):
            pending.result()
        pending = save(_state(model, optimizer), checkpoint_id=f"{folder}/{kind}-{step}", process_group=group)
        returned_at = time.perf_counter()
        blocked.append(returned_at - start)
        if isinstance(pending, Future):
            pending.add_done_callback(lambda _f, t0=returned_at: writing.append(time.perf_counter() - t0))
        saved, last = {k: v.clone() for k, v in _full(model).items()}, f"{folder}/{kind}-{step}"
    if isinstance(pending, Future):
        pending.result()
    return {"blocked": blocked[1:], "writing": writing[1:], "saved": saved, "last": last}


def _load(folder: str, sizes: dict) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from ..models import build_model

    model = _shard(build_model("mlp", seed=1, **sizes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(model)


def _quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{statistics.median(values) * 1e3:8.1f} ms (quartiles {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f})"


def main(args) -> int:
    from ..models import build_model
    from ..pool import Cluster

    sizes = {"d_hidden": args.d_hidden, "depth": args.depth}
    params = sum(p.numel() for p in build_model("mlp", **sizes).parameters())
    folder = tempfile.mkdtemp(prefix="dpcourse-bench-dcp-")
    found = {"save": {"blocked": [], "writing": []}, "async_save": {"blocked": [], "writing": []}}
    same = True
    try:
        with Cluster(world_size=args.world_size) as cluster:
            for r in range(args.rounds):
                for kind in ("save", "async_save"):
                    got = cluster.run(_train_saving, kind, f"{folder}/{r}", sizes, args.saves, timeout=600)
                    for per_rank in got:
                        found[kind]["blocked"] += per_rank["blocked"]
                        found[kind]["writing"] += per_rank["writing"]
                    if r == 0:
                        loaded = cluster.run(_load, got[0]["last"], sizes, timeout=600)
                        same &= all(bool((loaded[i][k] == v).all()) for i, g in enumerate(got)
                                    for k, v in g["saved"].items())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"MLP d_hidden={args.d_hidden} depth={args.depth}: {params:,} parameters, AdamW, fp32; "
          f"{args.world_size} ranks, {args.rounds} rounds of {args.saves} saves each")
    print(f"save        blocked {_quartiles(found['save']['blocked'])}")
    print(f"async_save  blocked {_quartiles(found['async_save']['blocked'])}")
    if found["async_save"]["writing"]:
        print(f"async_save  writing after the call {_quartiles(found['async_save']['writing'])}")
    ratio = statistics.median(found["save"]["blocked"]) / statistics.median(found["async_save"]["blocked"])
    print(f"ratio blocked(save) / blocked(async_save): {ratio:.1f}x")
    print(f"loaded checkpoints equal the weights at their save: {same}")
    return 0 if same else 1
