"""Model shapes for the ledger: FSDP units, how they shard, and parameter counts.

A unit is what FSDP gathers at once: one wrapped module's parameters (FSDP1 flattens them
into one FlatParameter, padded to a multiple of the shard group; FSDP2 shards every
parameter on dim 0 like ``torch.chunk``). Everything here is pure arithmetic on shapes;
counts are elements, not bytes.
"""
from __future__ import annotations

import math

from ..models import unit_shapes  # noqa: F401 -- the ledger's units come from the model


def numel(shapes) -> int:
    """Elements in a list of parameter shapes."""
    return sum(math.prod(s) for s in shapes)


def normalise_units(units, num_params: int) -> list[list[tuple]]:
    """``units`` as lists of shapes: None -> one unit of ``num_params``; ints -> 1-D units."""
    if units is None:
        return [[(num_params,)]]
    out = []
    for unit in units:
        if isinstance(unit, int) and not isinstance(unit, bool):
            out.append([(unit,)])
        else:
            shapes = [tuple(int(d) for d in s) for s in unit]
            if any(len(s) == 0 for s in shapes):
                raise ValueError("0-dimensional parameters are not supported in units; give their "
                                 "shape as (1,)")
            out.append(shapes)
    total = sum(numel(u) for u in out)
    if total != num_params:
        raise ValueError(f"units hold {total:,} parameters but num_params={num_params:,}; pass the "
                         "units of this model (layout.unit_shapes(model, classes)) or leave units out")
    return out


def _chunk_rows(dim0: int, group: int, rank: int) -> int:
    """Rows of a dim-0 ``torch.chunk`` into ``group`` pieces that land on ``rank`` (may be 0)."""
    size = math.ceil(dim0 / group)
    return max(0, min(size, dim0 - rank * size))


def per_parameter_shard(units, group: int, rank: int | None) -> int:
    """Elements FSDP2 keeps per rank: padded chunks (rank=None) or this rank's real chunks.

    Parameters and gradients live in padded storage (every rank the same size); optimizer
    state is built with ``zeros_like`` on the unpadded local chunk.
    """
    total = 0
    for shapes in units:
        for s in shapes:
            rest = math.prod(s[1:])
            rows = math.ceil(s[0] / group) if rank is None else _chunk_rows(s[0], group, rank)
            total += rows * rest
    return total


def unsharded_numel(unit, group: int, per_param: bool) -> int:
    """Elements of one unit once gathered, with the padding the all-gather adds."""
    if group == 1:
        return numel(unit)
    if per_param:
        return sum(math.ceil(s[0] / group) * group * math.prod(s[1:]) for s in unit)
    return math.ceil(numel(unit) / group) * group


def sharded_numel(storage: str, units, group: int, rank: int | None = None) -> int:
    """Elements of one sharded model state on a rank, by ``vocab.Sharding.storage``.

    "partition" (ZeRO): a 1/group slice of one flattened buffer; "flat_parameter" (FSDP1):
    each unit's FlatParameter padded to a multiple of the group; "tensors" (FSDP2): each
    parameter chunked on dim 0, padded (rank=None) or this rank's real chunks.
    """
    if storage == "partition":
        return math.ceil(sum(numel(u) for u in units) / group)
    if storage == "tensors":
        return per_parameter_shard(units, group, rank)
    return sum(math.ceil(numel(u) / group) for u in units)


def optimizer_tensors(storage: str, units, known: bool) -> int:
    """How many tensors the optimizer steps on one rank (each gets a step counter), by
    ``vocab.Sharding.storage``; 0 for ZeRO's partition, whose fused optimizer keeps one."""
    if not known or storage == "partition":
        return 0
    if storage == "flat_parameter":
        return len(units)  # one FlatParameter per unit
    return sum(len(u) for u in units)


def local_tensors(storage: str, units, group: int, rank: int) -> list[int]:
    """Elements of each tensor the optimizer updates on this rank (``vocab.Sharding.storage``;
    group 1 for an unsharded replica)."""
    if storage == "partition":
        return [math.ceil(sum(numel(u) for u in units) / group)]
    if storage == "flat_parameter":
        return [math.ceil(numel(u) / group) for u in units]
    return [_chunk_rows(s[0], group, rank) * math.prod(s[1:]) for u in units for s in u]


def transformer_num_params(n_layers: int, d_model: int, vocab_size: int, seq_len: int = 0,
                           d_ff: int | None = None, tied_embeddings: bool = False,
                           bias: bool = True) -> int:
    """Parameters (elements) of a GPT-style decoder: embeddings, pre-norm blocks, final norm, head.

    Per block: q, k, v and output projections (4 d^2), an MLP of width d_ff (2 d d_ff, default
    d_ff = 4 d), two LayerNorms; with ``bias`` every Linear and LayerNorm has a bias. The
    head is ``d_model x vocab_size`` unless tied to the token embedding. ``seq_len`` > 0 adds
    learned position embeddings.
    """
    for name, value in (("n_layers", n_layers), ("d_model", d_model), ("vocab_size", vocab_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, not {value!r}")
    d, f = d_model, d_ff or 4 * d_model
    b = 1 if bias else 0
    block = 4 * d * d + b * 4 * d + 2 * d * f + b * (f + d) + 2 * (d + b * d)
    head = 0 if tied_embeddings else d * vocab_size + b * vocab_size
    return vocab_size * d + seq_len * d + n_layers * block + (d + b * d) + head
