"""4.2g's numbers, each derived a second way: the notebook's own functions (read from its cells)
run on real ranks and are compared with what the rule behind each number predicts -- DDP's
buckets walked from the parameters' sizes and ``bucket_cap_mb``, the order in which a split
backward hands DDP its buckets, ``torch.chunk`` for a DTensor's shards, a 2-D mesh's
coordinates and groups from its shape, the collectives' bytes from the ring's formulas -- and
with one process training the same model on the whole global batch (losses, gradients, the
gradients' total norm)."""
from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dpcourse as dpc

pytestmark = pytest.mark.timeout(900)
NB = Path(__file__).resolve().parent.parent / "notebooks" / "4.2g-compile-meshes-and-choosing.ipynb"
CELLS = {c["id"]: "".join(c["source"]) for c in json.loads(NB.read_text())["cells"]}
MIB = 1024 * 1024


def notebook(*ids) -> dict:
    """A namespace holding what the notebook's cells ``ids`` define (after its imports): their
    imports, functions and assignments; the lines that run something on a cluster are left out."""
    ns = {"__name__": "__main__"}
    first = CELLS["nb42g-01"]
    exec("\n".join(line for line in first.splitlines() if line.startswith(("import ", "from "))), ns)
    for cid in ids:
        source = CELLS[cid]
        tree = ast.parse(source)
        kept = [node for node in tree.body
                if isinstance(node, (ast.FunctionDef, ast.Import, ast.ImportFrom))
                or (isinstance(node, ast.Assign) and "cluster" not in ast.get_source_segment(source, node))]
        exec(compile(ast.Module(body=kept, type_ignores=[]), cid, "exec"), ns)
    return ns


def ddp_buckets(model, bucket_cap_mb: float, first_bucket_bytes: int = MIB) -> list[int]:
    """DDP's buckets in bytes, in the order they fill (the last parameters first): parameters
    walked from the end, a bucket closed once it holds at least its cap -- the first bucket's
    cap the smaller of ``bucket_cap_mb`` and DDP's 1 MiB first bucket."""
    cap = int(bucket_cap_mb * MIB)
    buckets, size = [], 0
    for p in reversed(list(model.parameters())):
        size += p.numel() * p.element_size()
        if size >= (min(cap, first_bucket_bytes) if not buckets else cap):
            buckets.append(size)
            size = 0
    return buckets + ([size] if size else [])


def wide_mlp(ns):
    return dpc.models.build_model("mlp", seed=0, **ns["sizes"])


def test_the_bucket_walk_gives_the_notebook_s_four_buckets():
    ns = notebook("compile-1")
    model = wide_mlp(ns)
    assert ddp_buckets(model, 1) == [1067040, 1050624, 1050624, 67584]
    assert sum(ddp_buckets(model, 1)) == 4 * sum(p.numel() for p in model.parameters())
    assert ddp_buckets(model, 25) == [1067040, 2168832]   # DDP's default cap: the first stops at 1 MiB


def test_ddp_s_graph_pieces_are_its_buckets_and_one_graph_without_the_split(cluster2):
    ns = notebook("compile-1", "compile-3")
    want = ddp_buckets(wide_mlp(ns), 1)
    for optimize_ddp in (True, False):
        comm = dpc.observe.Comm()
        seen = cluster2.run(ns["ddp_graphs"], optimize_ddp, observe=[comm])
        sent = [r.logical_sent for r in comm.records(rank=0, step=-1) if r.collective == "all_reduce"]
        assert sent == want, sent                            # 2 ranks: an all-reduce counts its S
        for graphs in seen:                                  # each rank compiles its own
            assert graphs == (list(reversed(want)) if optimize_ddp else [sum(want)]), (optimize_ddp, graphs)


def _small_cap(cap_mb):
    import torch._dynamo.config as dynamo_config
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.compiler.reset()
    dynamo_config.optimize_ddp = True
    model = dpc.models.build_model("mlp", seed=0)
    model.compile(backend="eager")
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    x, y = dpc.models.make_dataset("mlp", 4).tensors
    try:
        F.mse_loss(ddp(x), y).backward()
        return "ran"
    except AssertionError as error:
        return str(error)
    finally:
        dist.barrier()


def test_a_bucket_cap_below_ddp_s_first_bucket_stops_the_compile(cluster2):
    """The notebook's prose: in 2.13 a bucket_cap_mb below 1 raises in the DDPOptimizer."""
    said = cluster2.run(_small_cap, 0.5)
    assert all("First bucket should be smaller/equal" in s for s in said), said
    assert cluster2.run(_small_cap, 1) == ["ran", "ran"]


def test_a_split_backward_launches_all_buckets_but_the_last_before_its_last_piece(cluster2):
    ns = notebook("compile-1", "compile-3", "compile-6")
    buckets = len(ddp_buckets(wide_mlp(ns), 1))
    for optimize_ddp in (True, False):
        for spans in cluster2.run(ns["traced_step"], optimize_ddp):
            pieces = sorted(s for s in spans if s[0] == "CompiledFunctionBackward")
            reduces = sorted(s for s in spans if s[0] == "c10d::allreduce_")   # where DDP launched each
            assert len(pieces) == (buckets if optimize_ddp else 1) and len(reduces) == buckets
            if optimize_ddp:   # bucket k goes once piece k's backward ended; only the last waits for the last piece
                assert all(r[1] >= p[2] for r, p in zip(reduces, pieces))
                assert sum(r[1] < pieces[-1][1] for r in reduces) == buckets - 1
            else:              # every bucket after the one piece
                assert all(r[1] >= pieces[0][2] for r in reduces)


def test_a_print_of_an_item_breaks_the_graph_and_an_all_reduce_does_not(cluster2):
    ns = notebook("compile-1", "compile-11")
    one_rank = torch.relu(torch.ones(4, 4) @ torch.ones(4, 4).T).sum().item()   # 16 entries of 4
    assert one_rank == 64.0
    assert cluster2.run(ns["graphs_of"], ns["logged"]) == [(2, one_rank)] * 2
    assert cluster2.run(ns["graphs_of"], ns["summed"]) == [(1, 2 * one_rank)] * 2


def one_process_losses(sizes: dict, steps: int, x, y, lr: float = 0.01) -> list[float]:
    """One process, the whole global batch (both ranks' halves), SGD: each step's loss."""
    model = dpc.models.build_model("mlp", seed=0, **sizes)
    optimizer, losses = torch.optim.SGD(model.parameters(), lr=lr), []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_ddp_compiled_or_not_trains_as_one_process(cluster2, backend):
    ns = notebook("compile-1", "compile-3", "compile-14")
    x, y = ns["X"], ns["Y"]
    rows = torch.cat([torch.arange(0, len(x), 2), torch.arange(1, len(x), 2)])   # rank 0's half, rank 1's
    want = one_process_losses(ns["sizes"], 4, x[rows], y[rows])
    records = cluster2.run(ns["ddp_training"], backend, timeout=600)
    got = [sum(r[step][0] for r in records) / 2 for step in range(4)]           # equal halves: the mean
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)


def test_fsdp2_per_block_compiles_one_graph_per_block_shape_and_trains_as_one_process(cluster2):
    ns = notebook("compile-1", "compile-17")
    model = wide_mlp(ns)
    shapes = {(b.linear.in_features, b.linear.out_features) for b in model.blocks}
    x, y = ns["X"], ns["Y"]
    rows = torch.cat([torch.arange(0, len(x), 2), torch.arange(1, len(x), 2)])
    want = one_process_losses(ns["sizes"], 3, x[rows], y[rows])
    for compile_as in ("blocks", "model"):
        got = cluster2.run(ns["fsdp_training"], compile_as)
        assert [g[0] for g in got] == [len(shapes)] * 2, (compile_as, got)
        mean = [sum(g[1][step] for g in got) / 2 for step in range(3)]
        assert max(abs(a - b) for a, b in zip(mean, want)) < 1e-6, (compile_as, mean, want)


def test_dtensor_shards_are_torch_chunk_and_the_2d_groups_follow_the_coordinates(cluster4):
    ns = notebook("mesh-1", "mesh-3")
    full = torch.arange(24.0).reshape(6, 4)
    chunks = [tuple(c.shape) for c in torch.chunk(full, 4)]
    chunks += [(0, 4)] * (4 - len(chunks))                 # torch.chunk leaves the last ranks empty
    assert [g[1] for g in cluster4.run(ns["placed_1d"])] == chunks
    for rank, (coordinate, groups, size, local) in enumerate(cluster4.run(ns["axes"])):
        row, column = divmod(rank, 2)                     # shape (2, 2): rank r at (r // 2, r % 2)
        assert tuple(coordinate) == (row, column) and size == 2
        assert groups == {"shard": [2 * row, 2 * row + 1], "replicate": [column, column + 2]}
        assert local == tuple(torch.chunk(full, 2)[column].shape)


def test_hsdp_gradients_are_one_process_s_and_each_collective_runs_on_its_axis(cluster4):
    ns = notebook("mesh-3", "hsdp-1")
    comm = dpc.observe.Comm()
    got = cluster4.run(ns["hsdp_gradients"], observe=[comm])
    model = dpc.models.build_model("mlp", seed=0)
    x, y = dpc.models.make_dataset("mlp", 32).tensors
    F.mse_loss(model(x), y).backward()
    for placements, local, grads in got:
        assert [repr(p) for p in placements] == ["Replicate()", "Shard(dim=0)"]
        assert local == (model.head.weight.shape[0] // 2, model.head.weight.shape[1])
        assert max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters()) < 1e-6
    psi = 4 * sum(p.numel() for p in model.parameters())
    root = 4 * sum(p.numel() for p in model.head.parameters())
    # in the shard group of 2: forward gathers every unit, backward every unit but the root,
    # full_tensor() reads every gradient: (N-1)/N of each, N = 2; a reduce-scatter of every
    # gradient; across the replicas an all-reduce of each rank's half, 2(N-1)/N of it
    assert comm.groups(rank=0, step=None) == {
        (0, 1): {"all_gather": psi // 2 + (psi - root) // 2 + psi // 2, "reduce_scatter": psi // 2},
        (0, 2): {"all_reduce": psi // 2}}


def test_clipping_across_the_mesh_returns_one_process_s_norm(cluster4):
    ns = notebook("mesh-3", "hsdp-1", "hsdp-4")
    model = dpc.models.build_model("mlp", seed=0)
    x, y = dpc.models.make_dataset("mlp", 32).tensors
    F.mse_loss(model(x), y).backward()
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
    got = cluster4.run(ns["clipped_norm"])
    assert all(kind == "DTensor" and abs(n - norm) < 1e-6 * norm for kind, n in got), (got, norm)
