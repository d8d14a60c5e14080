"""Six statements the course once got wrong, each checked against what PyTorch does or says,
so that none of them comes back: the projection's overlap per phase, FSDP2's default
prefetch, FSDP1's full state dict, the precision 4.2b claims, DDP's buffer broadcast, and
the NCCL version behind the α figures."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc
from dpcourse.collectives import alpha_beta

pytestmark = pytest.mark.timeout(180)
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def prose(name: str) -> str:
    nb = json.loads((NOTEBOOKS / name).read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


def test_1_fsdp_hides_phase_by_phase_like_ddp_when_bandwidth_dominates():
    """Forward's all-gathers run under forward (Ψ against 2PT), backward's gathers and
    reduce-scatters under backward (2Ψ against 4PT): DDP's ratio. Setting FSDP's whole 3Ψ
    against backward alone made FULL_SHARD need 1.5x DDP's tokens."""
    no_latency = alpha_beta.Link("bandwidth only", 0.0, 450e9, "test")
    rows = alpha_beta.hiding_rows([("8 GPUs", s, 8, no_latency, {}) for s in ("ddp", "FULL_SHARD")])
    for model in alpha_beta.REFERENCE_MODELS:
        ddp, fsdp = (next(r for r in rows if r["model"] == model and r["strategy"] == s)["min tokens"]
                     for s in ("ddp", "FULL_SHARD"))
        assert fsdp == pytest.approx(ddp, rel=0.05), (model, ddp, fsdp)


def test_2_fsdp2_overlaps_the_next_gather_by_default_as_its_docstring_says():
    from torch.distributed.fsdp import FSDPModule

    doc = " ".join(FSDPModule.set_modules_to_forward_prefetch.__doc__.split())
    assert "same all-gather overlap behavior as the default" in doc and "issued earlier from the CPU" in doc
    text = " ".join(prose("4.2c-large-models.ipynb").split())
    assert "FSDP2 overlaps both directions by default" in text and "earlier *from the CPU*" in text
    assert "none in forward" not in text


def _state_dicts():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    import dpcourse as dpc

    fsdp1 = FSDP(dpc.models.build_model("mlp"), device_id=torch.device("cpu"))
    fsdp2 = dpc.models.build_model("mlp")
    fully_shard(fsdp2)
    plain = dpc.models.build_model("mlp").state_dict()
    one = fsdp1.state_dict()  # FSDP1's default: StateDictType.FULL_STATE_DICT
    two = fsdp2.state_dict()
    return ({k: (type(v).__name__, tuple(v.shape)) for k, v in one.items()},
            {k: type(v).__name__ for k, v in two.items()},
            {k: tuple(v.shape) for k, v in plain.items()})


def test_3_fsdp1_full_state_dict_is_plain_full_tensors_fsdp2_holds_dtensors(cluster2):
    one, two, plain = cluster2.run(_state_dicts)[0]
    assert {k: shape for k, (_, shape) in one.items()} == plain and {t for t, _ in one.values()} == {"Tensor"}
    assert set(two) == set(plain) and set(two.values()) == {"DTensor"}
    text = " ".join(prose("4.2b-fsdp.ipynb").split())
    assert "Under **FSDP1** the default `StateDictType.FULL_STATE_DICT` gathers full tensors" in text


def test_4_no_notebook_says_it_stays_in_fp32_after_bf16():
    for path in NOTEBOOKS.glob("4*.ipynb"):
        assert "stays in fp32" not in prose(path.name), path.name


def _buffer_after_forward():
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = torch.nn.BatchNorm1d(3)
    ddp = DDP(model)  # forward_sync_buffers (formerly broadcast_buffers) defaults to True
    with torch.no_grad():
        model.running_mean.fill_(float(dist.get_rank() + 1))  # the ranks' buffers now differ
    ddp(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))  # rank 0's buffers first, then one batch
    return model.running_mean.clone(), model.num_batches_tracked.item()


def test_5_ddp_broadcasts_rank_0s_buffers_before_every_forward(cluster2):
    (mean0, n0), (mean1, n1) = cluster2.run(_buffer_after_forward)
    assert torch.equal(mean0, mean1) and n0 == n1  # rank 1 started from rank 0's 1.0, not its own 2.0
    for name in ("4.1a-data-parallelism-in-depth.ipynb", "4.2d-launching-faults-and-pitfalls.ipynb"):
        text = " ".join(prose(name).split())
        assert "`forward_sync_buffers`" in text and "running statistics" in text, name
        assert "broadcast_buffers=True" not in text and "deprecate" in text, name   # the 2.13 name


# NCCL's src/graph/tuning.cc, read at each tag: hwLat's ring/Simple latency per ring step (us) on
# NVLink, PCI and the network, and baseLat's ring/Simple (us per collective). From v2.28.3-1 on
# the table is ncclTunerConstantsDefaults' hwLatencies/baseLatencies, with the same values.
NCCL_RING_SIMPLE = {"v2.17.1-1": (3.4, 5.7, 9.6, 8.4), "v2.18.1-1": (3.4, 5.7, 14.0, 8.4),
                    "v2.22.3-1": (3.4, 5.7, 14.0, 8.4), "v2.27.7-1": (3.4, 5.7, 14.0, 8.4),
                    "v2.30.7-1": (3.4, 5.7, 14.0, 8.4)}


def test_6_the_alpha_figures_are_nccls_at_the_releases_named_with_its_base_latency_said():
    nvlink, pci, net, base = NCCL_RING_SIMPLE["v2.18.1-1"]
    assert all(NCCL_RING_SIMPLE[tag] == (nvlink, pci, net, base) for tag in NCCL_RING_SIMPLE if tag >= "v2.18")
    links = alpha_beta.LINKS
    assert [round(links[k].alpha * 1e6, 6) for k in ("nvlink4", "pcie4", "ib_ndr")] == [nvlink, pci, net]
    source = " ".join(Path(alpha_beta.__file__).read_text().split())
    assert "v2.18.1-1" in source and "baseLat" in source and f"{base} us" in source
    text = " ".join(prose("4.2b-fsdp.ipynb").split())
    assert f"{net} µs across the network" in text and "`v2.18.1-1`" in text
    assert "`baseLat`" in text and f"{base} µs per collective" in text


def _hybrid_without_a_mesh():
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    blocks = ModuleWrapPolicy({type(dpc.models.build_model("mlp").blocks[0])})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = FSDP(dpc.models.build_model("mlp"), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                     auto_wrap_policy=blocks, device_id=torch.device("cpu"))
    local = sum(p.numel() for p in model.parameters())
    return [str(w.message) for w in caught], local, sum(p.numel() for p in dpc.models.build_model("mlp").parameters())


def test_28_3_hybrid_shard_without_a_mesh_falls_back_to_no_shard_on_cpu_ranks(cluster2):
    messages, local, whole = cluster2.run(_hybrid_without_a_mesh)[0]
    assert any("NO_SHARD" in m and "world size is 1" in m for m in messages), messages
    assert local >= whole   # nothing sharded: each rank holds the whole model
    text = " ".join(prose("4.2b-fsdp.ipynb").split())
    assert "falls back to `NO_SHARD`" in text and "FULL_SHARD` under another name" not in text


def test_28_4_the_dcp_section_the_faults_section_points_to_is_in_4_2f():
    text = " ".join(prose("4.2d-launching-faults-and-pitfalls.ipynb").split())
    assert "`dcp.save`, as in 4.2f" in text
    code = "\n".join("".join(c["source"]) for c in json.loads((NOTEBOOKS / "4.2f-long-runs.ipynb").read_text())["cells"]
                     if c["cell_type"] == "code")
    assert "dcp.save(" in code


def _send_returns_after(delay: float = 1.0):
    import time

    t = torch.ones(1024)
    if dist.get_rank() == 0:
        start = time.perf_counter()
        dist.send(t, dst=1)
        return time.perf_counter() - start
    time.sleep(delay)
    dist.recv(t, src=0)


def test_28_5_a_gloo_send_waits_for_the_receiver_and_the_text_says_what_each_backend_does(cluster2):
    assert cluster2.run(_send_returns_after)[0] >= 0.9
    text = " ".join(prose("4.2a-communication-and-ddp.ipynb").split())
    assert "on Gloo, once the matching `recv` is posted" in text and "queued on the GPU's stream" in text
    assert "blocks until the matching `dist.recv(t, src)` has received it" not in text


def test_28_6_bf16_on_a_cpu_is_not_said_to_lack_units():
    text = " ".join(prose("4.2b-fsdp.ipynb").split())
    assert "no bf16 units" not in text and "`avx512_bf16`" in text


def test_28_7_one_unit_per_word_gb_is_10_to_the_9_and_ddp_buckets_are_mib():
    for name in ("4.1b-ring-fsdp-and-memory.ipynb", "4.2g-compile-meshes-and-choosing.ipynb"):
        code = "\n".join("".join(c["source"]) for c in json.loads((NOTEBOOKS / name).read_text())["cells"]
                         if c["cell_type"] == "code")
        assert "80 * 2**30" not in code and "10**9" in code, name
    text = prose("4.2b-fsdp.ipynb")
    assert "25 MB" not in text and "25 MiB" in text


def _gathers_per_micro_batch(keep: bool):
    from torch.distributed.fsdp import fully_shard

    from dpcourse.tracking.tracker import TRACKER

    model = dpc.models.build_model("mlp", seed=0)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=not keep)
    fully_shard(model, reshard_after_forward=not keep)
    x, y = dpc.models.make_dataset("mlp", 12).tensors
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(not keep)
    seen, counts = [], []
    with TRACKER.listen(lambda call: seen.append(call.collective)):
        for i in range(3):
            if i == 2:
                model.set_requires_gradient_sync(True)
                model.set_reshard_after_backward(True)
            before = len(seen)
            torch.nn.functional.mse_loss(model(x[i * 4:(i + 1) * 4]), y[i * 4:(i + 1) * 4]).backward()
            counts.append(seen[before:].count("all_gather"))
    return counts


def test_28_8_accumulation_under_full_shard_gathers_again_every_micro_batch_unless_kept(cluster2):
    units = 1 + len(dpc.models.build_model("mlp").blocks)
    assert cluster2.run(_gathers_per_micro_batch, False)[0] == [2 * units] * 3   # forward and backward, each time
    assert cluster2.run(_gathers_per_micro_batch, True)[0] == [units, 0, 0]      # gathered once, kept
    text = " ".join(prose("4.2f-long-runs.ipynb").split())
    assert "only the reduce-scatter is skipped" in text and "set_reshard_after_backward(False)" in text
