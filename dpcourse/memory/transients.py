"""The ledger's transient terms: memory that exists only during part of a training step.

All results are bytes on one rank. The mechanisms, each read from PyTorch's source:

* FSDP1 all-gathers a unit straight into its unsharded FlatParameter; the root unit (the
  outermost module) stays gathered for the whole forward and backward, because its forward
  and backward enclose every other unit's. In backward, BACKWARD_PRE (the default)
  gathers the next unit while the current one computes: two units at once. Autograd
  computes a gradient per original parameter and concatenates them into the FlatParameter's
  gradient, which lives until its reduce-scatter: two copies of a unit's gradients.
* FSDP2 ``fully_shard`` all-gathers into one flat buffer and copies each parameter out of
  it; in forward it keeps the previous unit's buffer until the next copy-out, to overlap
  them (``FSDPParamGroup.wait_for_unshard``): three units' worth at once. Gradients are
  copied into a reduce-scatter buffer (two copies), and the root's unsharded gradients wait
  until its backward ends.
* ``reshard_after_forward=False`` / SHARD_GRAD_OP keep every unit gathered from its forward
  to its backward (FSDP2 also still holds the last unit's all-gather buffer).
* The optimizer: ``torch.optim.Adam``'s per-tensor path computes ``exp_avg_sq.sqrt()`` and
  divides it (two temporaries of the tensor's size) while the previous tensor's
  denominator is still referenced: max over neighbours of (previous + 2 x current).
"""
from __future__ import annotations

from . import layout


def unsharded_bytes(spec, units, group: int, compute_bytes: int, *,
                    reshard_after_forward: bool = True) -> dict:
    """Bytes of gathered parameters (forward, backward) and unsharded gradients on one rank.

    spec: the strategy's ``vocab.Sharding``. units: lists of parameter shapes, the root unit
    last (``layout.unit_shapes``). compute_bytes: bytes per element of the gathered
    parameters and gradients. reshard_after_forward: FSDP2's option (FSDP1's strategy fixes it).
    """
    out = {"forward": 0, "backward": 0, "gradients": 0}
    if "parameters" not in spec.shards:
        if spec.storage == "partition" and "gradients" in spec.shards:
            # ZeRO-2: one bucket of full gradients before its reduce-scatter.
            out["gradients"] = compute_bytes * max(layout.numel(u) for u in units)
        return out
    per_param = spec.storage == "tensors"
    sizes = [compute_bytes * layout.unsharded_numel(u, group, per_param) for u in units]
    root, others = (sizes[-1], sizes[:-1]) if len(sizes) > 1 else (0, sizes)
    largest = sorted(others, reverse=True) + [0]
    if not spec.units:  # ZeRO-3, the paper's view: one layer's parameters and gradients
        return {"forward": largest[0], "backward": largest[0], "gradients": largest[0]}
    reshard = reshard_after_forward if spec.reshard_after_forward is None else spec.reshard_after_forward
    if per_param:
        out["forward"] = sum(sizes) + largest[0] if not reshard else root + 3 * largest[0]
        out["gradients"] = root + 2 * largest[0]
    else:
        out["forward"] = sum(sizes) if not reshard else root + largest[0]
        out["gradients"] = 2 * largest[0]
    out["backward"] = sum(sizes) if not reshard else root + largest[0] + largest[1]
    return out


def optimizer_temporaries(spec, optimizer: str, units, group: int, rank: int,
                          foreach: bool = False) -> int:
    """Bytes the optimizer step allocates and frees again on one rank (fp32 state).

    SGD, with or without momentum, updates in place. Adam/AdamW per tensor: see the module
    docstring; with ``foreach`` (CUDA's default) one sqrt of every local tensor at once.
    """
    if optimizer not in ("adam", "adamw") or spec.storage == "partition":
        return 0  # ZeRO's own (fused) optimizer updates its partition in place
    local = layout.local_tensors(spec.storage, units, group, rank)
    if foreach:
        return 4 * sum(local)
    pairs = [2 * n + (local[i - 1] if i else 0) for i, n in enumerate(local)]
    return 4 * max(pairs, default=0)
