"""Does it fit? The ledger of every strategy against one device's memory, and the rule of thumb.

Pure arithmetic on ``ledger``: bytes per rank, compared with the device's bytes.
"""
from __future__ import annotations

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
    for strategy in strategies:
        group = shard_group_size if strategy == "HYBRID_SHARD" else None
        if strategy == "HYBRID_SHARD" and (not group or world_size % group or group == world_size):
            continue
        book = ledger(num_params, world_size, strategy, precision, optimizer, shard_group_size=group,
                      activation_bytes=activation_bytes, units=units)
        rows.append({"strategy": strategy, "ledger": book, "at_rest": book.total, "peak": book.peak,
                     "fits": book.peak <= device_bytes})
    return rows


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


def recommend(num_params: int, world_size: int, device_bytes: int, gpus_per_node: int = 8,
              precision: str = "mixed", optimizer: str = "adam", activation_bytes: int = 0,
              units=None) -> tuple[str, str]:
    """The course's rule, decided by the ledger: (strategy, reason).

    Fits on one device -> DDP; does not -> FSDP FULL_SHARD; more ranks than one node and a
    node's shard group suffices -> HYBRID_SHARD (gathers stay on the node's fast links).
    """
    def peak(strategy, group=None):
        return ledger(num_params, world_size, strategy, precision, optimizer, shard_group_size=group,
                      activation_bytes=activation_bytes, units=units).peak

    if peak("ddp") <= device_bytes:
        return "ddp", "a full replica with its gradients and optimizer state fits on one device"
    if world_size > gpus_per_node and world_size % gpus_per_node == 0 \
            and peak("HYBRID_SHARD", gpus_per_node) <= device_bytes:
        return "HYBRID_SHARD", (f"sharding over one node ({gpus_per_node} ranks) fits; replicate "
                                "across nodes so all-gathers stay inside a node")
    if peak("FULL_SHARD") <= device_bytes:
        return "FULL_SHARD", "only sharding parameters, gradients and optimizer state over all ranks fits"
    return "none", ("even FULL_SHARD over all ranks does not fit: add ranks, checkpoint activations "
                    "or offload to CPU memory")
