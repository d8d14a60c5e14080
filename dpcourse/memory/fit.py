"""Does it fit? The ledger of every strategy against one device's memory (the rule: ``choice``).

Pure arithmetic on ``ledger``: bytes per rank, compared with the device's bytes.
"""
from __future__ import annotations

from .. import vocab
from .layout import transformer_num_params
from .ledger import ledger

CANDIDATES = ("ddp", "zero1", "zero2", "zero3", "NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")


def fit_table(num_params: int, world_size: int, device_bytes: int, precision: str = "mixed",
              optimizer: str = "adam", *, shard_group_size: int | None = None,
              activation_bytes: int = 0, units=None, strategies=CANDIDATES) -> list[dict]:
    """Per strategy: the ledger, its at-rest total and peak (bytes per rank) and whether it fits.

    units: FSDP unit sizes (parameters per unit, root last), e.g. ``equal_units`` or
    ``transformer_units``; without them the whole model counts as one unit.
    HYBRID_SHARD is listed only with a ``shard_group_size`` that divides ``world_size``.
    """
    rows = []
    hybrid = _hybrid_group(world_size, shard_group_size)
    for strategy in strategies:
        needs_group = vocab.SHARDING[strategy].group == "shard_group_size"
        if needs_group and hybrid is None:
            continue
        book = ledger(num_params, world_size, strategy, precision, optimizer,
                      shard_group_size=hybrid if needs_group else None,
                      activation_bytes=activation_bytes, units=units)
        rows.append({"strategy": strategy, "ledger": book, "at_rest": book.total, "peak": book.peak,
                     "fits": book.peak <= device_bytes})
    return rows


def _hybrid_group(world_size: int, shard_group_size: int | None) -> int | None:
    """``shard_group_size`` if HYBRID_SHARD can use it here -- ``vocab.shard_group`` accepts it
    and it leaves more than one replica -- else None."""
    if shard_group_size is None:
        return None
    try:
        group = vocab.shard_group("HYBRID_SHARD", world_size, shard_group_size)
    except ValueError:
        return None
    return group if group < world_size else None


def equal_units(num_params: int, count: int) -> list[int]:
    """``num_params`` split into ``count`` units as equal as whole numbers allow."""
    if count < 1:
        raise ValueError(f"the number of units must be >= 1, not {count}")
    base, extra = divmod(num_params, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def transformer_units(n_layers: int, d_model: int, vocab_size: int, seq_len: int = 0, **shape) -> list[int]:
    """Parameters per FSDP unit of a GPT-style model: one per block, then the root (the rest)."""
    total = transformer_num_params(n_layers, d_model, vocab_size, seq_len, **shape)
    block = (transformer_num_params(2, d_model, vocab_size, seq_len, **shape)
             - transformer_num_params(1, d_model, vocab_size, seq_len, **shape))
    return [block] * n_layers + [total - n_layers * block]
