"""The memory ledger in theory: what one rank holds, in bytes, for each data-parallel strategy.

Model states per parameter, as the ZeRO paper counts them (Rajbhandari et al. 2020, sec. 3.1):
fp32 training keeps a 4-byte parameter and a 4-byte gradient; mixed precision keeps 2-byte
parameters and gradients plus K bytes of optimizer state, K = 12 for Adam (a 4-byte fp32
master copy, momentum and variance). That is ``precision="mixed"``, the paper's fp16 layout.
DDP under ``torch.autocast`` (``precision="autocast"``) holds something else: fp32 parameters
(they are the master weights) and fp32 gradients, 4 + 4 + 8 bytes with Adam, and the 2-byte
copies exist only during forward and backward: autocast casts each weight the first time a
low-precision op uses it and caches the copy until the autocast region ends (backward keeps
the copies it saved). Sharding divides some of these by the shard group size:

    strategy          sharded (divided by the shard group)
    dp, ddp,          nothing (dp: only the primary device keeps them, see ``ledger``)
    NO_SHARD
    zero1             optimizer state (+ master weights)
    zero2             ... and gradients
    zero3, FSDP       ... and parameters (FSDP1 SHARD_GRAD_OP / FULL_SHARD / HYBRID_SHARD,
                      FSDP2 ``fully_shard``)

Transient terms come on top: autocast's weight copies, FSDP's unsharded units (the FSDP
paper, Zhao et al. 2023, sec. 3.2.1: peak parameter memory is sum_i psi_i / F + max_i psi_i),
activations, and the optimizer step's temporaries. ``phases`` puts them at the moment of a
step where they live.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import vocab
from . import activations, layout, transients

STRATEGIES = vocab.LEDGER_STRATEGIES
PRECISIONS = vocab.PRECISIONS
AUTOCAST_STRATEGIES = ("dp", "ddp")  # the ledger models torch.autocast for these only
OPTIMIZERS = tuple(vocab.OPTIMIZERS)
AT_REST = ("parameters", "gradients", "optimizer_state", "master_weights", "bucket_buffers")
TRANSIENT = ("unsharded_parameters", "unsharded_gradients", "activations", "temporaries")
CATEGORIES = AT_REST + TRANSIENT

# fp32 optimizer state per parameter (bytes): SGD none, momentum one buffer, Adam two moments.
OPTIMIZER_STATE_BYTES = {name: 4 * tensors for name, tensors in vocab.OPTIMIZERS.items()}
# torch.optim.Adam(W) keeps ``step`` as a float32 scalar tensor per parameter tensor.
STEP_COUNTER_BYTES = {"sgd": 0, "sgd_momentum": 0, "adam": 4, "adamw": 4}
_SHARDED = {"dp": (), "ddp": (), "NO_SHARD": (),
            "zero1": ("optimizer_state", "master_weights"),
            "zero2": ("optimizer_state", "master_weights", "gradients")}
_FSDP = ("SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "fully_shard")


class LedgerError(ValueError):
    """A ledger request that does not describe a real configuration; the message says the fix."""


@dataclass(frozen=True)
class Ledger:
    """Per-rank bytes by category for one strategy; ``phases`` and ``peak`` add transients."""

    strategy: str
    world_size: int
    rank: int
    precision: str
    optimizer: str
    shard_group_size: int
    num_params: int
    bytes: dict  # category -> bytes on this rank (at rest: AT_REST; largest transient: TRANSIENT)
    phases: dict  # phase -> {category: bytes} at that moment of a training step
    notes: tuple = field(default=())

    @property
    def total(self) -> int:
        """Bytes held at rest on this rank (model states between steps), per rank."""
        return sum(self.bytes[c] for c in AT_REST)

    @property
    def peak(self) -> int:
        """Largest per-rank total (bytes) over the phases of one training step."""
        return max(sum(p.values()) for p in self.phases.values())

    @property
    def peak_phase(self) -> str:
        """The phase of ``peak``: "at rest", "forward", "backward" or "optimizer step"."""
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def bound(self) -> int:
        """Every term at its largest at the same moment (bytes per rank): no step exceeds it."""
        return sum(self.bytes.values())

    def at_rest(self) -> dict:
        """{category: bytes} of the model states held between steps on this rank."""
        return {c: self.bytes[c] for c in AT_REST}


def ledger(num_params: int, world_size: int, strategy: str, precision: str = "fp32",
           optimizer: str = "adam", *, shard_group_size: int | None = None, rank: int = 0,
           gradient_as_bucket_view: bool = False, reshard_after_forward: bool = True,
           units=None, activation_bytes: int = 0, batch_size: int | None = None,
           foreach: bool = False) -> Ledger:
    """Bytes one rank holds for ``num_params`` parameters (elements) under ``strategy``.

    num_params may be a model: its parameter count, and (unless ``units`` is given) one FSDP
    unit per module of its ``nn.ModuleList``s plus the root (``models.unit_shapes``).

    world_size: ranks in total. precision: "fp32"; "mixed" (2-byte parameters and
    gradients with an fp32 master copy, the ZeRO paper's recipe; FSDP keeps its sharded
    parameters in fp32 as the master copy instead); or "autocast" (dp/ddp only: fp32
    parameters and gradients, plus 2-byte copies of every parameter during forward,
    counted under temporaries). optimizer: "sgd", "sgd_momentum",
    "adam", "adamw". shard_group_size: HYBRID_SHARD's ranks per shard group.
    rank: the rank asked about ("dp": 0 is the primary device; FSDP2 ``fully_shard`` gives
    the last ranks smaller optimizer-state chunks). units: the FSDP units, either numbers of
    parameters (elements) or lists of parameter shapes (``models.unit_shapes``); they make the
    padding, step counters and transient unit sizes exact (default: one unit of
    ``num_params``). activation_bytes: per rank, e.g. from ``dpcourse.memory.activations``;
    or batch_size: a course model's activations for this per-rank batch, by formula.
    foreach: the optimizer's multi-tensor path (default on CUDA) instead of the per-tensor one.
    """
    if hasattr(num_params, "named_parameters"):  # a model: its size, and one unit per block
        model = num_params
        num_params = sum(p.numel() for p in model.parameters())
        units = layout.unit_shapes(model) if units is None else units
        if batch_size is not None:
            if activation_bytes:
                raise LedgerError("give activation_bytes= or batch_size=, not both")
            try:
                kind, sizes = activations.model_sizes(model)
            except ValueError as err:
                raise LedgerError(str(err)) from None
            activation_bytes = activations.activation_bytes(kind, batch_size, **sizes)
    elif batch_size is not None:
        raise LedgerError("batch_size= needs a model (the course's, e.g. dpc.models.build_model('mlp')); "
                          "with a parameter count pass activation_bytes= instead")
    vocab.check_name("strategy", strategy, STRATEGIES, LedgerError)
    vocab.check_name("precision", precision, PRECISIONS, LedgerError)
    vocab.check_name("optimizer", optimizer, OPTIMIZERS, LedgerError)
    for name, value in (("num_params", num_params), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LedgerError(f"{name} must be a whole number >= 1, not {value!r}")
    if not 0 <= rank < world_size:
        raise LedgerError(f"rank={rank} is not a rank of world_size={world_size} (0..{world_size - 1})")
    if activation_bytes < 0:
        raise LedgerError(f"activation_bytes must be >= 0, not {activation_bytes}")
    if precision == "autocast" and strategy not in AUTOCAST_STRATEGIES:
        raise LedgerError(f"precision='autocast' models DP/DDP under torch.autocast, not {strategy!r}; "
                          "for ZeRO and FSDP (MixedPrecision / MixedPrecisionPolicy) use precision='mixed'")
    group = vocab.shard_group(strategy, world_size, shard_group_size, LedgerError)
    try:
        shapes = layout.normalise_units(units, num_params)
    except ValueError as err:
        raise LedgerError(str(err)) from None
    mixed, fsdp = precision == "mixed", strategy in _FSDP
    per_param = strategy == "fully_shard"
    param_b = 4 if (fsdp or not mixed) else 2  # FSDP's sharded parameters stay fp32
    grad_b = 4 if (fsdp or not mixed) else 2  # FSDP upcasts the sharded gradient to fp32
    compute_b = 2 if mixed else 4  # unsharded (gathered) parameters and gradients
    shard_rank = rank % group
    notes = []

    def held(sharded: bool, exact_rank: bool = False) -> int:
        """Elements of model state this rank holds for one category."""
        if not sharded:
            return num_params
        if strategy.startswith("zero"):  # ZeRO partitions one flattened buffer
            return math.ceil(num_params / group)
        if per_param:
            return layout.per_parameter_shard(shapes, group, shard_rank if exact_rank else None)
        return sum(math.ceil(layout.numel(u) / group) for u in shapes)  # FSDP1: padded flat params

    sharded = set(_SHARDED.get(strategy, CATEGORIES))  # zero3 and FSDP shard everything
    on_this_rank = not (strategy == "dp" and rank != 0)
    opt_b = OPTIMIZER_STATE_BYTES[optimizer]
    b = dict.fromkeys(CATEGORIES, 0)
    if on_this_rank:
        b["parameters"] = param_b * held("parameters" in sharded)
        b["gradients"] = grad_b * held("gradients" in sharded)
        # Optimizer state is created with zeros_like on the local shard: FSDP2's chunks are
        # unpadded, so its last ranks may hold less than the padded parameter shard.
        b["optimizer_state"] = opt_b * held("optimizer_state" in sharded, exact_rank=True)
        b["optimizer_state"] += STEP_COUNTER_BYTES[optimizer] * layout.optimizer_tensors(strategy, shapes, units is not None)
        if mixed and not fsdp:
            b["master_weights"] = 4 * held("master_weights" in sharded)
        if strategy == "ddp" and not gradient_as_bucket_view:
            b["bucket_buffers"] = grad_b * num_params  # DDP's flat buckets, beside param.grad
    if units is None and STEP_COUNTER_BYTES[optimizer] and strategy in ("dp", "ddp", "NO_SHARD") + _FSDP:
        notes.append("step counters (4 B per parameter tensor) need units=... and are left out")

    # Transients (bytes; see ``transients`` for the mechanisms behind each term).
    gathered = transients.unsharded_bytes(strategy, shapes, group, compute_b,
                                          reshard_after_forward=reshard_after_forward)
    if strategy == "zero2":  # one bucket of full gradients before its reduce-scatter
        gathered["gradients"] = compute_b * max(layout.numel(u) for u in shapes)
    elif strategy == "dp" and rank != 0:
        # The replica broadcast every step, and its gradients before the reduce to device 0.
        gathered = dict.fromkeys(gathered, compute_b * num_params)
        notes.append("dp: only the primary device keeps parameters, gradients and optimizer state; "
                     "it also gathers every device's outputs")
    b["unsharded_parameters"] = max(gathered["forward"], gathered["backward"])
    b["unsharded_gradients"] = gathered["gradients"]
    b["activations"] = activation_bytes
    # autocast caches a 2-byte copy of every parameter a low-precision op uses (all of a
    # Linear's); assumed here for every parameter (LayerNorm's stay fp32 on CUDA: an upper bound).
    autocast_b = 2 * num_params if precision == "autocast" else 0
    step_b = 0
    if on_this_rank:
        step_b = transients.optimizer_temporaries(strategy, optimizer, shapes, group, shard_rank, foreach)
    b["temporaries"] = max(step_b, autocast_b)

    rest = {c: b[c] for c in AT_REST}
    # zero_grad(set_to_none=True) frees gradients before forward, unless they are views of
    # DDP's buckets (gradient_as_bucket_view), whose storage stays.
    grads_kept = strategy == "ddp" and gradient_as_bucket_view
    forward = dict(rest, gradients=rest["gradients"] if grads_kept else 0,
                   unsharded_parameters=gathered["forward"], activations=activation_bytes,
                   temporaries=autocast_b)
    # Backward counts every gradient and no activation: gradients appear as activations are
    # freed, and the two roughly trade places.
    # FSDP: a unit's gradient shard appears at its reduce-scatter, and the root unit (the last
    # of ``shapes``) reduces after every other one: at backward's peak its shard is not there
    # yet. With a single unit that is every gradient (measured: 9 % too high without this).
    root_grad = 0
    if fsdp and on_this_rank:
        root = shapes[-1:]
        root_grad = grad_b * (layout.per_parameter_shard(root, group, None) if per_param
                              else math.ceil(layout.numel(root[0]) / group))
    backward = dict(rest, gradients=rest["gradients"] - root_grad,
                    unsharded_parameters=gathered["backward"],
                    unsharded_gradients=gathered["gradients"])
    step = dict(rest, temporaries=step_b)
    phases = {"at rest": rest, "forward": forward, "backward": backward, "optimizer step": step}
    return Ledger(strategy, world_size, rank, precision, optimizer, group, num_params, b,
                  phases, tuple(notes))
