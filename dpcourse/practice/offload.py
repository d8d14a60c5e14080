"""CPU offload: keep the shards of parameters, gradients and optimizer state in CPU memory.

With FSDP2's ``offload_policy=CPUOffloadPolicy()`` the sharded parameters live in CPU memory;
before a unit's all-gather FSDP2 copies its shard to the GPU, after the reduce-scatter it
copies the gradient shard back, and the optimizer steps on the CPU. The GPU then holds only
the gathered units and the activations; the price is two host-device copies per unit per
step and a CPU optimizer step. ``pin_memory=True`` (the default) puts the shards in pinned
(page-locked) memory so those copies can run asynchronously.

On a machine without an accelerator everything already lives in CPU memory, so offloading
moves nothing: ``CPUOffloadPolicy(pin_memory=False)`` runs and trains exactly as without it;
``pin_memory=True``, and FSDP1's ``CPUOffload(offload_params=True)`` (which always pins),
fail there because pinning needs an accelerator. ``offload_policy(device)`` picks the right
one for the device the ranks compute on.
"""
from __future__ import annotations

import torch

from .. import models
from .common import local_shards, loss_of, rank_batch, shard


def offload_policy(device: torch.device):
    """FSDP2's CPU offload for ranks computing on ``device``: pinned memory only with an accelerator."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=torch.device(device).type != "cpu")


def train_offloaded(offload: bool, steps: int = 2, batch_size: int = 16, lr: float = 1e-2,
                    observe=None) -> dict:
    """On every rank: FSDP2 + Adam for ``steps`` steps, with or without CPU offload; final shards.

    ``observe(model, optimizer)`` is called after the last step (e.g. to see where each
    tensor lives); its result is returned under "observed".
    """
    device = torch.device("cpu")  # the device the ranks compute on (cuda:<local rank> on GPUs)
    model = models.build_model("mlp").to(device)
    shard(model, offload_policy=offload_policy(device)) if offload else shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    inputs, targets = (t.to(device) for t in rank_batch(batch_size))
    for _ in range(steps):
        optimizer.zero_grad()
        loss_of(model, inputs, targets).backward()
        optimizer.step()
    observed = observe(model, optimizer) if observe else None
    return {"observed": observed, "shards": local_shards(model)}


def pinned_offload_error() -> dict:
    """On every rank: what FSDP2 with ``pin_memory=True`` and FSDP1's ``CPUOffload`` say here
    (None where they run, i.e. with an accelerator)."""
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    attempts = {
        "fully_shard(offload_policy=CPUOffloadPolicy(pin_memory=True))":
            lambda m: shard(m, offload_policy=CPUOffloadPolicy(pin_memory=True)),
        "FSDP(cpu_offload=CPUOffload(offload_params=True))":
            lambda m: FSDP(m, device_id=torch.device("cpu"), cpu_offload=CPUOffload(offload_params=True)),
    }
    out = {}
    for name, wrap in attempts.items():
        try:
            loss_of(wrap(models.build_model("mlp")), *rank_batch()).backward()
            out[name] = None
        except RuntimeError as err:
            out[name] = f"RuntimeError: {err}".splitlines()[0]
    return out
