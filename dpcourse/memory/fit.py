"""Does it fit? The ledger of every strategy against one device's memory, and the rule of thumb.

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


def recommend(num_params: int, world_size: int, device_bytes: int, shard_group_size: int = 8,
              precision: str = "mixed", optimizer: str = "adam", activation_bytes: int = 0,
              units=None) -> tuple[str, str]:
    """The course's rule, decided by each candidate's peak (bytes per rank): (strategy, reason).

    device_bytes: one device's memory; activation_bytes: per rank. The first that fits wins;
    bytes sent per rank and step are counted as a ring sends them, Psi = the gradients' bytes:

    1. ``ddp``: a full replica; one all-reduce, 2 Psi.
    2. On one node, ``SHARD_GRAD_OP`` (FSDP's ZeRO-2: gradients and optimizer state sharded,
       parameters gathered from forward to backward): an all-gather and a reduce-scatter,
       2 Psi, what DDP sends; the paper's ZeRO-1/2 send the same. On several nodes
       (``world_size`` a multiple of ``shard_group_size``, the ranks of one node, above it),
       ``HYBRID_SHARD`` instead:
       FULL_SHARD inside a node and replicas across nodes, so the gathers stay on a node's
       fast links and only an all-reduce of each shard crosses between nodes.
    3. ``FULL_SHARD`` (ZeRO-3) over all ranks: parameters gathered again for backward, 3 Psi.
    """
    def peak(strategy, group=None):
        return ledger(num_params, world_size, strategy, precision, optimizer, shard_group_size=group,
                      activation_bytes=activation_bytes, units=units).peak

    multi_node = _hybrid_group(world_size, shard_group_size) is not None
    if peak("ddp") <= device_bytes:
        return "ddp", "a full replica with its gradients, optimizer state and activations fits"
    if not multi_node and peak("SHARD_GRAD_OP") <= device_bytes:
        return "SHARD_GRAD_OP", ("sharding gradients and optimizer state (ZeRO-2) fits; it sends "
                                 "what DDP sends (all-gather + reduce-scatter = one all-reduce)")
    if multi_node and peak("HYBRID_SHARD", shard_group_size) <= device_bytes:
        return "HYBRID_SHARD", (f"sharding over one node ({shard_group_size} ranks) fits; replicating "
                                "across nodes keeps the all-gathers inside a node")
    if peak("FULL_SHARD") <= device_bytes:
        return "FULL_SHARD", ("only sharding parameters too, over all ranks, fits (ZeRO-3: 1.5x "
                              "DDP's bytes, the parameters are gathered again for backward)")
    return "none", ("even FULL_SHARD over all ranks does not fit: add ranks, checkpoint activations "
                    "or offload to CPU memory")
