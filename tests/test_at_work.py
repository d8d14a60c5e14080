"""4.2e's numbers, each derived a second way: the notebook's own functions (read from its
cells) run on real ranks and are compared with one process, with the formula behind the
number (the sampler's padding, the hooks' bytes, ZeroRedundancyOptimizer's partition), with
a second tool (torch.profiler against the Timeline observer), DDP's collectives under
find_unused_parameters and static_graph against the model's tensors; and 4.2g's projection of
where data parallelism stops paying, with the alpha-beta model written out in closed form."""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dpcourse as dpc

pytestmark = pytest.mark.timeout(600)
NB = Path(__file__).resolve().parent.parent / "notebooks" / "4.2e-ddp-and-fsdp-at-work.ipynb"
CELLS = {c["id"]: "".join(c["source"]) for c in json.loads(NB.read_text())["cells"]}


def notebook(*ids, cluster=None) -> dict:
    """A namespace holding what the notebook's cells ``ids`` define (after its imports); a
    cell that also runs its function runs it on ``cluster``."""
    first = CELLS["nb42e-01"]
    ns = {"__name__": "__main__", "cluster": cluster}
    exec("\n".join(line for line in first.splitlines() if line.startswith(("import ", "from "))), ns)
    ns["workdir"] = tempfile.mkdtemp()
    for cid in ("nb42e-02", *ids):
        exec(CELLS[cid], ns)
    return ns


def mlp_shapes() -> list[torch.Size]:
    return [p.shape for p in dpc.models.build_model("mlp").parameters()]


def test_the_padded_mean_is_one_process_counting_the_first_sample_twice(cluster2):
    ns = notebook("eval-1")
    val = dpc.models.make_dataset("mlp", 11, seed=3)
    padded = lambda d: ns["DistributedSampler"](d, shuffle=False)   # noqa: E731 -- as the notebook's
    strided = lambda d: range(ns["dist"].get_rank(), len(d), ns["dist"].get_world_size())  # noqa: E731
    (biased, n12), _ = cluster2.run(ns["mean_error"], val, padded)
    (right, n11), _ = cluster2.run(ns["mean_error"], val, strided)
    x, y = val.tensors
    with torch.no_grad():
        per_sample = F.mse_loss(dpc.models.build_model("mlp", seed=0)(x), y, reduction="none").mean(dim=1)
    assert (n12, n11) == (12, 11)
    assert biased == pytest.approx(float((per_sample.sum() + per_sample[0]) / 12), rel=1e-6)
    assert right == pytest.approx(float(per_sample.mean()), rel=1e-6)


def test_map_location_puts_every_rank_s_tensors_on_its_device(cluster2, tmp_path):
    ns = notebook("load-1", cluster=cluster2)
    got = cluster2.run(ns["save_then_load"], str(tmp_path / "w.pt"))
    assert got == [(["cpu"], ["cpu"])] * 2
    # one process: a dict map_location rewrites the recorded location, a callable sees it
    torch.save({"w": torch.ones(2)}, tmp_path / "one.pt")
    seen = []
    torch.load(tmp_path / "one.pt", map_location=lambda s, where: seen.append(where) or s, weights_only=True)
    assert seen == ["cpu"]
    assert torch.load(tmp_path / "one.pt", map_location={"cpu": "meta"}, weights_only=True)["w"].is_meta


def powersgd_bytes(rank: int = 1, min_rate: float = 2) -> int:
    """PowerSGD's bytes per step, from its rule: a matrix n x m goes as (n + m) r values when
    (n + m) r * min_compression_rate < n m; vectors and other matrices go whole (fp32)."""
    values = 0
    for shape in mlp_shapes():
        if len(shape) == 2 and (shape[0] + shape[1]) * rank * min_rate < shape[0] * shape[1]:
            values += (shape[0] + shape[1]) * rank
        else:
            values += math.prod(shape)
    return 4 * values


def test_the_hooks_bytes_are_their_formulas_and_their_errors_their_rounding(cluster2):
    ns = notebook("hooks-1", "hooks-2")
    exec(CELLS["hooks-4"].split("sent, errors")[0], ns)      # the hook factories only
    psi = sum(math.prod(s) for s in mlp_shapes())
    want = {None: 4 * psi, "fp16": 2 * psi, "power_sgd": powersgd_bytes()}
    for name, nbytes in want.items():
        comm = dpc.observe.Comm()
        error = cluster2.run(ns["compressed_steps"], ns[name] if name else None, observe=[comm])[0]
        assert sum(comm.bytes(rank=0, step=-1).values()) == nbytes, name
        if name is None:
            assert error < 1e-6
        elif name == "fp16":   # fp16 keeps 11 significant bits: each value rounded twice at most
            assert 0 < error < 2 * 2**-11
        else:
            assert error > 0.1
    assert f"{4 * psi / powersgd_bytes():.1f}" == "18.5" and powersgd_bytes() == 3264   # as the notebook says


def zero_partition(world: int = 2) -> list[list[int]]:
    """ZeroRedundancyOptimizer's assignment: tensors by size, largest first, each to the rank
    with the fewest elements so far (torch/distributed/optim/zero_redundancy_optimizer.py)."""
    sizes = sorted((math.prod(s) for s in mlp_shapes()), reverse=True)
    ranks: list[list[int]] = [[] for _ in range(world)]
    for n in sizes:
        min(ranks, key=sum).append(n)
    return ranks


def test_zero1_state_per_rank_is_its_partition_and_the_steps_are_adam_s(cluster2):
    ns = notebook("zero-1")
    comm = dpc.observe.Comm()
    held = cluster2.run(ns["zero1_steps"], observe=[comm])
    # Adam: exp_avg and exp_avg_sq in fp32 per element, a float32 step counter per tensor
    assert held == [(8 * sum(p) + 4 * len(p), len(p)) for p in zero_partition()]
    ledger = dpc.memory.ledger(dpc.models.build_model("mlp"), 2, "ddp", optimizer="adam").bytes
    assert sum(b for b, _ in held) == ledger["optimizer_state"]
    psi = sum(math.prod(s) for s in mlp_shapes())
    assert comm.calls(rank=0, step=-1) == {"broadcast": len(mlp_shapes())}
    assert comm.bytes(rank=0, step=-1) == {"broadcast": 4 * psi}

    def weights_after_two_steps():
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        rank, (x, y) = dist.get_rank(), dpc.models.make_dataset("mlp", 32).tensors
        ddp = DDP(dpc.models.build_model("mlp", seed=0))
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(ddp(x[16 * rank:][:16]), y[16 * rank:][:16]).backward()
            opt.step()
        return ddp.module.state_dict()

    model = dpc.models.build_model("mlp", seed=0)
    x, y = dpc.models.make_dataset("mlp", 32).tensors
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for got in cluster2.run(weights_after_two_steps):
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def test_the_profiler_and_the_timeline_see_the_same_all_reduces(cluster2, tmp_path):
    ns = notebook("prof-1")
    timeline = dpc.observe.Timeline()
    paths = cluster2.run(ns["profiled_step"], str(tmp_path), observe=[timeline])
    for rank, path in enumerate(paths):
        spans = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
        backend = [e for e in spans if e["name"] == "gloo:all_reduce"]
        issued = [e for e in spans if e["name"] == "c10d::allreduce_"]
        seen = [e for e in timeline.events(step=-1) if e.rank == rank and e.lane == "comm" and e.kind == "all_reduce"]
        # DDP issues each bucket's all-reduce once, and the profiler records its c10d operator once
        assert len(backend) == len(seen) == len(issued) >= 3


def closed_form_rate(global_tokens: int, n: int, params: float = 1e9) -> float:
    """Tokens/s per rank: forward 2 P t / (F mfu), backward twice that, DDP's ring all-reduce of
    2 P bytes in 25 MiB buckets (2(N-1) alpha per bucket, 2(N-1)/N S / beta), hidden under
    backward at best; NVLink 4 inside a node of 8, InfiniBand NDR across nodes."""
    flops, tokens, s = 989e12 * 0.4, global_tokens // n, 2 * params
    if n <= 8:
        alpha, beta = 3.4e-6, 450e9
    else:
        nodes = n // 8
        alpha, beta = ((n - nodes) * 3.4e-6 + (nodes - 1) * 14.0e-6) / (n - 1), 50e9
    comm = math.ceil(s / (25 * 2**20)) * 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / beta
    forward = 2 * params * tokens / flops
    return tokens / (forward + max(2 * forward, comm))


def test_where_data_parallelism_stops_paying_is_the_closed_form():
    """4.2g's projection (the chapter's close; it was 4.2e's)."""
    cells = {c["id"]: "".join(c["source"]) for c in json.loads(NB.with_name("4.2g-compile-meshes-and-choosing.ipynb")
                                                                .read_text())["cells"]}
    ns = {"__name__": "__main__", "dpc": dpc}
    exec(cells["scale-1"], ns)
    for mi in (1, 4):
        for n in [2**k for k in range(3, 11)]:
            assert ns["tokens_per_second_per_rank"](mi * 2**20, n) == pytest.approx(closed_form_rate(mi * 2**20, n), rel=1e-9)
    rel = {mi: [closed_form_rate(mi * 2**20, 2**k) / closed_form_rate(mi * 2**20, 8) for k in range(3, 11)]
           for mi in (1, 4)}
    # what the notebook prints and says: 4 Mi holds to 128 ranks, 1 Mi to 64; 0.07 at 1,024
    assert [f"{r:.2f}" for r in rel[4]] == ["1.00"] * 5 + ["0.72", "0.25", "0.07"]
    assert [f"{r:.2f}" for r in rel[1]] == ["1.00"] * 4 + ["0.59", "0.22", "0.07", "0.02"]


def test_assign_adopts_the_loaded_tensors_and_to_empty_copies():
    ns = notebook()
    model = dpc.models.build_model("mlp", seed=0)
    torch.save(model.state_dict(), os.path.join(ns["workdir"], "weights.pt"))
    exec(CELLS["assign-1"], ns)
    state, adopted, copied = ns["state"], ns["adopted"], ns["copied"]
    assert all(p.data_ptr() == state[n].data_ptr() for n, p in adopted.named_parameters())
    assert not any(p.data_ptr() == state[n].data_ptr() for n, p in copied.named_parameters())
    for n, p in model.named_parameters():   # both hold the saved weights, as trainable parameters
        assert torch.equal(adopted.get_parameter(n), p) and torch.equal(copied.get_parameter(n), p)
        assert adopted.get_parameter(n).requires_grad
    assert {id(p) for p in ns["optimizer"].param_groups[0]["params"]} == {id(p) for p in adopted.parameters()}
    # what the notebook says of PyTorch 2.13: assign=True marks the dict itself, so a later
    # plain load of the same dict object adopts too (a fresh dict is copied)
    later, fresh = dpc.models.build_model("mlp", seed=1), dpc.models.build_model("mlp", seed=1)
    later.load_state_dict(state)
    fresh.load_state_dict(model.state_dict())
    assert later.head.weight.data_ptr() == state["head.weight"].data_ptr()
    assert fresh.head.weight.data_ptr() != model.head.weight.data_ptr()


def test_a_frozen_block_under_fsdp2_is_sharded_gathered_and_never_reduced(cluster2):
    ns = notebook("frozen-1")
    comms, shards = {}, {}
    for freeze in (False, True):
        comms[freeze] = dpc.observe.Comm()
        shards[freeze] = cluster2.run(ns["step_with_frozen_first_block"], freeze, observe=[comms[freeze]])
    assert shards[True] == ["DTensor, local shard (32, 32), gradient: False"] * 2
    assert shards[False] == ["DTensor, local shard (32, 32), gradient: True"] * 2
    frozen_bytes = 4 * sum(p.numel() for p in dpc.models.build_model("mlp").blocks[0].parameters())
    on, off = (comms[f].bytes(rank=0, step=0) for f in (False, True))
    assert on["all_gather"] == off["all_gather"]
    assert on["reduce_scatter"] - off["reduce_scatter"] == frozen_bytes * (2 - 1) // 2 == 4224

    def trained_weights():   # the notebook's step, the full weights gathered to compare
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh, rank = init_device_mesh("cpu", (2,)), dist.get_rank()
        model = dpc.models.build_model("mlp", seed=0)
        model.blocks[0].requires_grad_(False)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        x, y = dpc.models.make_dataset("mlp", 16).tensors
        F.mse_loss(model(x[8 * rank:][:8]), y[8 * rank:][:8]).backward()
        opt.step()
        return {k: v.full_tensor() for k, v in model.state_dict().items()}

    one = dpc.models.build_model("mlp", seed=0)
    one.blocks[0].requires_grad_(False)
    x, y = dpc.models.make_dataset("mlp", 16).tensors
    F.mse_loss(one(x), y).backward()
    torch.optim.SGD([p for p in one.parameters() if p.requires_grad], lr=0.1).step()
    for got in cluster2.run(trained_weights):
        for k, v in one.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def test_reshard_after_forward_int_gathers_backward_within_the_smaller_group(cluster4):
    ns = notebook("frozen-1", "reshard-1")
    psi, n = 4 * sum(p.numel() for p in dpc.models.build_model("mlp").parameters()), 4
    gather, scatter = psi * (n - 1) // n, psi * (n - 1) // n           # a ring's (N-1)/N of the bytes
    want = {True: {(0, 1, 2, 3): {"all_gather": 2 * gather, "reduce_scatter": scatter}},
            2: {(0, 1, 2, 3): {"all_gather": gather, "reduce_scatter": scatter}, (0, 1): {"all_gather": psi // 2}},
            False: {(0, 1, 2, 3): {"all_gather": gather, "reduce_scatter": scatter}}}
    for reshard, groups in want.items():
        comm = dpc.observe.Comm()
        cluster4.run(ns["step_resharded"], reshard, observe=[comm])
        assert comm.groups(rank=0, step=0) == groups, reshard
        assert comm.groups(rank=3, step=0).get((2, 3), {}) == ({"all_gather": psi // 2} if reshard == 2 else {})


def test_the_profilers_memory_view_and_the_memory_observer_agree_on_the_gradients(cluster2):
    ns = notebook("prof-1", "prof-5", "prof-5b", cluster=cluster2)
    psi = sum(p.numel() for p in dpc.models.build_model("mlp").parameters())
    assert ns["kept"] == ns["memory"].at_rest(rank=0)["gradients"] == 4 * psi
    assert ns["memory"].at_rest(rank=0)["parameters"] == 4 * psi


def _prose(cid: str) -> str:
    return " ".join(CELLS[cid].split())


def test_find_unused_parameters_all_reduces_a_map_of_the_used_tensors_every_step_static_graph_once(cluster2):
    ns = notebook("unused-1", "unused-2", cluster=cluster2)
    params = list(ns["Deep"]().parameters())
    grads, used_map = 4 * sum(p.numel() for p in params), 4 * len(params)   # fp32 gradients; an int32 per tensor
    assert (grads, used_map, len(params)) == (4 * 48 * (16 * 16 + 16), 384, 96)
    assert "52,224 bytes (48 × (16 × 16 + 16) values of 4 bytes)" in _prose("unused-4")
    assert "adds 384 bytes in every step: the map, 4 bytes for each of the 96 parameter tensors" in _prose("unused-4")
    per_step = {}
    for name, options in {"default": {}, "find_unused": {"find_unused_parameters": True},
                          "static_graph": {"static_graph": True}}.items():
        comm = dpc.observe.Comm()
        cluster2.run(ns["ddp_steps"], steps=4, observe=[comm], **options)
        per_step[name] = [(comm.calls(rank=0, step=i)["all_reduce"], comm.bytes(rank=0, step=i)["all_reduce"])
                          for i in range(4)]
    assert per_step["default"] == [(1, grads)] * 4
    assert per_step["find_unused"] == [(2, grads + used_map)] * 4
    assert per_step["static_graph"] == [(2, grads + used_map)] + [(1, grads)] * 3


def _iterations_before_the_error(deep) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(deep(unused_head=True))
    for done in range(3):
        try:
            ddp(torch.randn(8, 16)).sum().backward()
        except RuntimeError:
            return done
    return done + 1


def test_an_unused_head_stops_the_default_at_the_next_iteration_and_trains_under_either_switch(cluster2):
    ns = notebook("unused-1", "unused-2", cluster=cluster2)
    head = len(list(torch.nn.Linear(16, 4).parameters()))   # what Deep(unused_head=True) adds
    assert cluster2.run(_iterations_before_the_error, ns["Deep"]) == [1, 1]   # it fails at the second
    with pytest.raises(dpc.RankError, match="Expected to have finished reduction in the prior iteration"):
        cluster2.run(ns["ddp_steps"], True, 3)
    for options in ({"find_unused_parameters": True}, {"static_graph": True}):
        assert [r[2] for r in cluster2.run(ns["ddp_steps"], True, 3, **options)] == [head, head], options
    assert [r[2] for r in cluster2.run(ns["ddp_steps"], False, 3, find_unused_parameters=True)] == [0, 0]


def test_a_block_used_twice_under_reentrant_checkpointing_trains_under_static_graph_alone(cluster2):
    ns = notebook("unused-5", cluster=cluster2)
    for options in ({}, {"find_unused_parameters": True}):
        with pytest.raises(dpc.RankError, match="Expected to mark a variable ready only once"):
            cluster2.run(ns["gradient_gap"], **options)
    assert max(cluster2.run(ns["gradient_gap"], static_graph=True)) < 1e-6
    # the one-process reference is the model's gradient: checkpointing changes no number
    torch.manual_seed(0)
    model, x = ns["BlockTwice"](), torch.randn(8, 8)
    model(x).square().mean().backward()
    checkpointed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain = model.block(model.block(model.inp(x)))
    model.out(plain).square().mean().backward()
    assert all(torch.allclose(a, p.grad) for a, p in zip(checkpointed, model.parameters()))
    assert all(p.grad.abs().sum() > 0 for p in model.parameters())


def test_the_exercises_answers():
    from torch.utils.data import DistributedSampler
    counted = [i for r in range(8) for i in DistributedSampler(range(10_001), num_replicas=8, rank=r, shuffle=False)]
    assert len(counted) == 10_008 and sorted(i for i in set(counted) if counted.count(i) > 1) == list(range(7))
    ranks: list[list[int]] = [[], []]
    for n in (4, 3, 2, 1):   # millions of parameters, ZeroRedundancyOptimizer's greedy assignment
        min(ranks, key=sum).append(n)
    assert ranks == [[4, 1], [3, 2]]   # 5 M parameters each: 40 MB of Adam state (8 bytes each)
