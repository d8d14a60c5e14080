"""From-scratch wrappers on NCCL ranks, and the real nn.DataParallel. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

import dpcourse as dpc
from _training import reference_steps, train_steps
from dpcourse.train import TrainConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_scratch_wrappers_on_gpus_equal_single_process_training():
    world_size = torch.cuda.device_count()
    cfg = TrainConfig(model="mlp", optimizer="sgd", steps=3, batch_size=4, num_samples=96, progress=False)
    reference = reference_steps(cfg, world_size)
    with dpc.Cluster(world_size=world_size, backend="nccl") as cluster:
        for kind, options in (("bucketed", {"bucket_cap_mb": 0.01}), ("overlap", {}),
                              ("mini_fsdp", {}), ("bucketed", {"sharded_optimizer": True})):
            for r in cluster.run(train_steps, cfg, kind, seed_per_rank=True, **options,
                                  observe=[dpc.observe.Timeline(), dpc.observe.Comm()]):
                for name, want in reference["params"].items():
                    torch.testing.assert_close(r["params"][name], want, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nn.DataParallel needs 2 GPUs")
def test_real_data_parallel_loads_the_primary_gpu_most():
    """What 4.1a's DP section runs on GPUs: the primary device holds the gathered outputs."""
    gpus = list(range(torch.cuda.device_count()))
    tokens, targets = dpc.models.make_dataset("transformer", 32, vocab_size=1024).tensors
    net = torch.nn.DataParallel(dpc.models.build_model("transformer", vocab_size=1024).cuda(), gpus)
    for d in gpus:
        torch.cuda.reset_peak_memory_stats(d)
    dpc.models.loss_fn("transformer", net(tokens.cuda()), targets.cuda()).backward()
    peaks = [torch.cuda.max_memory_allocated(d) for d in gpus]
    assert peaks[0] > max(peaks[1:])
