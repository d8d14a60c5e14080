"""MiniFSDP on real ranks: single-process training, PyTorch FSDP1 and the memory ledger agree."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import dpcourse as dpc
from _training import reference_steps, train_steps
from dpcourse.models import TransformerBlock
from dpcourse.train import TrainConfig

pytestmark = pytest.mark.timeout(180)


def _cfg(model="mlp", optimizer="sgd", model_sizes=None, **kw):
    sizes = {"d_hidden": 30, "depth": 3} if model == "mlp" else {}  # 30: units need padding
    return TrainConfig(model=model, model_sizes=model_sizes or sizes, optimizer=optimizer, steps=3,
                       batch_size=4, num_samples=96, progress=False, **kw)


def _assert_matches(results, reference, atol):
    for r in results:
        assert list(r["params"]) == list(reference["params"])  # the unwrapped model's names
        for name, want in reference["params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=atol, msg=name)
        torch.testing.assert_close(r["params"], results[0]["params"], rtol=0, atol=0)


def _frozen_or_block(module):
    """Units for tied_transformer: each block, and the frozen position table on its own (a
    unit is trainable or frozen as a whole); the tied embedding and head stay in the root."""
    return isinstance(module, TransformerBlock) or (
        isinstance(module, nn.Embedding) and not module.weight.requires_grad)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", [{}, {"shard_root": True}, {"reduce_scatter": "ring"},
                                     {"wrap": None}, {"optimizer": "adamw"}, {"accumulation": 2}],
                         ids=["blocks", "shard-root", "ring-reduce-scatter", "one-unit", "adamw",
                              "no_sync-accumulation"])
def test_minifsdp_equals_single_process_training(request, world, options):
    cluster = request.getfixturevalue(f"cluster{world}")
    options = dict(options)
    cfg = _cfg(optimizer=options.pop("optimizer", "sgd"))
    if "wrap" in options:
        options["wrap"] = lambda m: False  # matches nothing: the whole model is one unit
    results = cluster.run(train_steps, cfg, "mini_fsdp", seed_per_rank=True, **options)
    reference = reference_steps(cfg, world, options.get("accumulation", 1))
    _assert_matches(results, reference, 1e-5 if cfg.optimizer == "sgd" else 2e-4)
    units = results[0]["units"]
    assert sum(u["numel"] for u in units) == sum(p.numel() for p in reference["params"].values())
    assert all(u["padded_numel"] % (world if u["sharded"] else 1) == 0 for u in units)
    assert any(u["padded_numel"] > u["numel"] for u in units) == (world == 4)


def test_minifsdp_with_a_frozen_unit_and_tied_weights(cluster2):
    cfg = _cfg("tied_transformer")
    results = cluster2.run(train_steps, cfg, "mini_fsdp", wrap=_frozen_or_block, seed_per_rank=True)
    _assert_matches(results, reference_steps(cfg, 2), 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_minifsdp_in_half_precision_stays_close(cluster2, dtype):
    cfg = _cfg()
    results = cluster2.run(train_steps, cfg, "mini_fsdp", compute_dtype=dtype)
    # 3 SGD steps computed in 8- or 11-bit mantissas: loose, but far below the weights' scale
    _assert_matches(results, reference_steps(cfg, 2), 2e-2)
    assert all(p.dtype == torch.float32 for p in results[0]["params"].values())  # fp32 masters
    steps = _step_collectives(cluster2, cfg, "mini_fsdp", compute_dtype=dtype)
    full = _step_collectives(cluster2, cfg, "mini_fsdp")
    assert [(c, n // 2) for c, n in full] == steps  # gathered and reduced in 2-byte elements


def _step_collectives(cluster, cfg, kind, **options) -> list[tuple[str, int]]:
    """(collective, bytes S) of every c10d op rank 0 issued in the last step (``Comm``)."""
    comm = dpc.observe.Comm()
    if kind == "mini_fsdp":
        options = {"shard_root": True, **options}  # units as FSDP1's: blocks, then the root
    cluster.run(train_steps, cfg, kind, observe=[comm], **options)
    return [(r.collective, r.nbytes) for r in comm.records(rank=0, step=-1)]


@pytest.mark.parametrize("world", [2, 4])
def test_minifsdp_memory_at_rest_equals_the_ledger(request, world):
    """Held after the last optimizer step (the Memory observer's walk) = the ledger: the
    sharded units as FULL_SHARD, the replicated head as DDP with its gradients in place."""
    cluster = request.getfixturevalue(f"cluster{world}")
    cfg = _cfg(optimizer="adamw")
    plain = dpc.models.build_model("mlp", **cfg.model_sizes)
    blocks = [[tuple(p.shape) for p in b.parameters()] for b in plain.blocks]
    head = sum(p.numel() for p in plain.head.parameters())
    for options in ({}, {"shard_root": True}, {"compute_dtype": torch.bfloat16}):
        memory = dpc.observe.Memory()
        cluster.run(train_steps, cfg, "mini_fsdp", observe=[memory], **options)
        precision = "mixed" if options.get("compute_dtype") else "fp32"
        units = blocks + ([[tuple(p.shape) for p in plain.head.parameters()]] if options.get("shard_root") else [])
        for rank in range(world):
            parts = [dpc.memory.ledger(sum(p.numel() for p in plain.parameters()) - (0 if options.get("shard_root") else head),
                                       world, "FULL_SHARD", precision, "adamw", rank=rank, units=units)]
            if not options.get("shard_root"):  # one flat fp32 tensor, its gradient in place
                parts.append(dpc.memory.ledger(head, world, "ddp", "fp32", "adamw", rank=rank, units=[[(head,)]],
                                               gradient_as_bucket_view=True))
            held = memory.at_rest(rank)
            for category in ("parameters", "gradients", "optimizer_state"):
                assert held[category] == sum(p.bytes[category] for p in parts), (options, rank, category)
            assert held["unsharded_parameters"] == 0  # every gathered unit was freed


@pytest.mark.parametrize("world", [2, 4])
def test_minifsdp_sends_the_collectives_of_pytorch_fsdp(request, world):
    cluster = request.getfixturevalue(f"cluster{world}")
    for model in ("mlp", "transformer"):
        mini, fsdp = (_step_collectives(cluster, _cfg(model), kind) for kind in ("mini_fsdp", "fsdp"))
        assert Counter(mini) == Counter(fsdp)
        kinds = Counter(c for c, _ in mini)
        units = 4 if model == "mlp" else 3  # blocks + root
        assert kinds == {"all_gather": 2 * units - 1, "reduce_scatter": units}  # root gathered once


def test_our_ring_reduce_scatter_sends_less_than_gloos(cluster4):
    """Gloo's reduce-scatter sends 2(N-1)/N of its input (like an all-reduce), a ring (N-1)/N.

    The model is wide enough (126) that the data outweighs what both sides send besides
    it (Gloo's per-message headers and notices, the ring's size check)."""
    cfg = _cfg(model_sizes={"d_hidden": 126, "depth": 3})
    wire, rs_bytes = {}, None
    for how in ("backend", "ring"):
        comm = dpc.observe.Comm()
        cluster4.run(train_steps, cfg, "mini_fsdp", shard_root=True, reduce_scatter=how, observe=[comm])
        wire[how] = [comm.wire(rank=r, step=-1) for r in range(4)]
        if how == "backend":
            rs_bytes = sum(r.nbytes for r in comm.records(0, -1) if r.collective == "reduce_scatter")
    saved = 3 / 4 * rs_bytes
    for g, r in zip(wire["backend"], wire["ring"]):
        assert 0.95 * saved <= g - r <= 1.1 * saved


def test_the_timeline_shows_the_fsdp_rhythm(cluster2):
    """Observed from outside: per block, all-gather before its forward, again before its
    backward, a reduce-scatter after its backward -- MiniFSDP and FSDP1 alike."""
    for kind in ("mini_fsdp", "fsdp"):
        timeline = dpc.observe.Timeline()
        cluster2.run(train_steps, _cfg(), kind, observe=[timeline],
                     **({"shard_root": True} if kind == "mini_fsdp" else {}))
        events = sorted((e for e in timeline.events() if e.rank == 0), key=lambda e: e.start)
        kinds = [e.kind for e in events if e.kind in ("all_gather", "reduce_scatter", "forward", "backward")]
        first_backward = kinds.index("backward")
        assert kinds[:first_backward].count("all_gather") == 4, kind       # every unit before forward
        assert kinds[first_backward:].count("all_gather") == 3, kind       # the blocks again, not the root
        assert kinds.count("reduce_scatter") == 4, kind
        forward_layers = [e for e in events if e.kind == "forward"]
        gathers = [e for e in events if e.kind == "all_gather"]
        assert gathers[0].start < forward_layers[0].start


def _bad_units(case):
    from dpcourse.scratch import MiniFSDP

    model = dpc.models.build_model("tied_transformer")
    if case == "tied":
        MiniFSDP(model, wrap={nn.Linear})  # head (a Linear) shares its weight with tok
    else:
        MiniFSDP(model, wrap={TransformerBlock})  # root: frozen pos with trainable tok


@pytest.mark.parametrize("case, message", [("tied", "tied parameters must live in one unit"),
                                           ("frozen", "mixes trainable and frozen")])
def test_units_that_cannot_work_are_refused_clearly(cluster2, case, message):
    with pytest.raises(dpc.RankError, match=message):
        cluster2.run(_bad_units, case)
