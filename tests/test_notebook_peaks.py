"""The notebooks' measurements that move with the machine's load, measured here several times:
peaks against the ledger (4.2b's auto-wrap policies) and bytes on Gloo's wire (4.1b's ring
reduce-scatter, 4.2b's FULL_SHARD against DDP). The notebooks' hidden checks assert only what
is exact (counts, bytes at rest, the c10d byte counts); these bounds hold for the median of
REPEATS runs, so one run slowed or disturbed by another process cannot fail them.
(4.1b's ledger peaks are measured in test_memory_ranks.py.)
"""
from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import dpcourse as dpc

pytestmark = pytest.mark.timeout(300)
REPEATS = 3
STEPS, BATCH = 4, 8   # 4.2b's loop: steps, samples per rank and step


def _train(wrap):
    """4.2b's `train` on a rank: the seeded MLP wrapped, AdamW after wrapping, its share of each batch."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = dpc.models.make_dataset("mlp", STEPS * BATCH * 4).tensors
    model = wrap(dpc.models.build_model("mlp", seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        rows = slice((step * n + rank) * BATCH, (step * n + rank + 1) * BATCH)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _fsdp1(policy):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def wrap(model):
        units = ModuleWrapPolicy({type(model.blocks[0])}) if policy == "block" else None
        return FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"),
                    auto_wrap_policy=units)
    return wrap


def _ddp(model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model)


@pytest.mark.parametrize("policy", ["none", "block"])
def test_4_2b_auto_wrap_peaks_are_near_the_ledgers(cluster2, policy):
    mlp = dpc.models.build_model("mlp")
    shapes = [[tuple(p.shape) for p in mlp.parameters()]] if policy == "none" else None
    book = dpc.memory.ledger(mlp, 2, "FULL_SHARD", optimizer="adamw", units=shapes, batch_size=BATCH)
    ratios = []
    for _ in range(REPEATS):
        memory = dpc.observe.Memory()
        cluster2.run(_train, _fsdp1(policy), observe=[memory])
        ratios.append(memory.peak(rank=0)[0] / book.peak)
    # the ledger's peak is every unsharded gradient at once; with one unit, Gloo sometimes frees
    # the reduce-scatter's copy before the next buffer appears (then 22 % lower)
    assert 0.75 < statistics.median(ratios) < 1.1, (policy, ratios)


def test_4_2b_full_shard_puts_about_twice_ddps_bytes_on_glooss_wire(cluster4):
    mlp = dpc.models.build_model("mlp")
    psi = 4 * sum(p.numel() for p in mlp.parameters())
    root = 4 * (mlp.head.weight.numel() + mlp.head.bias.numel())
    ratios = []
    for _ in range(REPEATS):
        wire = {}
        for name, wrap in (("DDP", _ddp), ("FULL_SHARD", _fsdp1("block"))):
            comm = dpc.observe.Comm()
            cluster4.run(_train, wrap, observe=[comm])
            wire[name] = comm.wire(rank=0, step=-1)
        if not wire["DDP"]:
            pytest.skip("Gloo's wire is read from /proc/self/io: Linux only")
        ratios.append(wire["FULL_SHARD"] / wire["DDP"])
    assert abs(statistics.median(ratios) - (2 - root / (2 * psi))) < 0.15, ratios


def _mini_fsdp_wire(ring: bool):
    class RingReduceScatterFSDP(dpc.scratch.MiniFSDP):   # 4.1b's subclass
        def comm_hook(self, collective, output, input, name):
            if collective != "reduce_scatter":
                return super().comm_hook(collective, output, input, name)
            output.copy_(dpc.collectives.ring.ring_reduce_scatter(input, op="sum"))
            done = torch.futures.Future()
            done.set_result(output)
            return done
    make = RingReduceScatterFSDP if ring else dpc.scratch.MiniFSDP
    return lambda m: make(m, wrap={type(m.blocks[0])}, shard_root=True)


def test_4_1b_the_rings_reduce_scatter_sends_less_than_gloos(cluster2):
    sent = {True: [], False: []}
    for _ in range(REPEATS):
        for ring in (True, False):
            comm = dpc.observe.Comm()
            cluster2.run(_train, _mini_fsdp_wire(ring), observe=[comm])
            sent[ring].append(comm.wire(rank=0, step=-1))
    if not sent[False][0]:
        pytest.skip("Gloo's wire is read from /proc/self/io: Linux only")
    assert statistics.median(sent[True]) < statistics.median(sent[False]), sent
