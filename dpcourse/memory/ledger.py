"""The memory ledger in theory: what one rank holds, in bytes, for each data-parallel strategy.

Model states per parameter, as the ZeRO paper counts them (Rajbhandari et al. 2020, sec. 3.1):
fp32 training keeps a 4-byte parameter and a 4-byte gradient; mixed precision keeps 2-byte
parameters and gradients plus K bytes of optimizer state, K = 12 for Adam (a 4-byte fp32
master copy, momentum and variance). That is ``precision="mixed"``, the paper's fp16 layout.
DDP under ``torch.autocast`` (``precision="autocast"``) holds something else: fp32 parameters
(they are the master weights) and fp32 gradients, 4 + 4 + 8 bytes with Adam, and the 2-byte
copies exist only during forward and backward: autocast casts each weight the first time a
low-precision op uses it and caches the copy until the autocast region ends (backward keeps
the copies it saved). Sharding divides some of these by the shard group size; what each
strategy shards, and how it lays the shards out, is ``vocab.SHARDING``, one row per strategy:

    strategy          sharded (divided by the shard group)
    dp, ddp,          nothing (dp: only the primary device keeps them)
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

from dataclasses import dataclass, field

from .. import vocab
from . import activations, layout, transients

STRATEGIES = vocab.LEDGER_STRATEGIES
PRECISIONS = vocab.PRECISIONS
OPTIMIZERS = tuple(vocab.OPTIMIZERS)
AT_REST = ("parameters", "gradients", "optimizer_state", "master_weights", "bucket_buffers")
TRANSIENT = ("unsharded_parameters", "unsharded_gradients", "activations", "temporaries")
CATEGORIES = AT_REST + TRANSIENT

# fp32 optimizer state per parameter (bytes): SGD none, momentum one buffer, Adam two moments.
OPTIMIZER_STATE_BYTES = {name: 4 * tensors for name, tensors in vocab.OPTIMIZERS.items()}
# torch.optim.Adam(W) keeps ``step`` as a float32 scalar tensor per parameter tensor.
STEP_COUNTER_BYTES = {"sgd": 0, "sgd_momentum": 0, "adam": 4, "adamw": 4}


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
    rank: the rank asked about (dp: 0 is the primary device; FSDP2 ``fully_shard`` gives
    the last ranks smaller optimizer-state chunks). units: the FSDP units, either numbers of
    parameters (elements) or lists of parameter shapes (``models.unit_shapes``); they make the
    padding, step counters and transient unit sizes exact (default: one unit of
    ``num_params``). activation_bytes: per rank, e.g. from ``dpcourse.memory.activations``;
    or batch_size: a course model's activations for this per-rank batch, by formula.
    foreach: the optimizer's multi-tensor path (default on CUDA) instead of the per-tensor one.
    """
    num_params, units, activation_bytes = _from_model(num_params, units, batch_size, activation_bytes)
    _check(num_params, world_size, strategy, precision, optimizer, rank, activation_bytes)
    spec = vocab.SHARDING[strategy]
    group = vocab.shard_group(strategy, world_size, shard_group_size, LedgerError)
    try:
        shapes = layout.normalise_units(units, num_params)
    except ValueError as err:
        raise LedgerError(str(err)) from None
    shard_rank = rank % group
    on_this_rank = not (spec.primary_only and rank != 0)
    notes = []
    b = dict.fromkeys(CATEGORIES, 0)
    if on_this_rank:
        b.update(_model_states(spec, num_params, shapes, group, shard_rank, precision, optimizer,
                               units is not None, gradient_as_bucket_view))
    if units is None and STEP_COUNTER_BYTES[optimizer] and spec.storage != "partition":
        notes.append("step counters (4 B per parameter tensor) need units=... and are left out")
    if not on_this_rank:
        notes.append("dp: only the primary device keeps parameters, gradients and optimizer state; "
                     "it also gathers every device's outputs")
    gathered, autocast_b, step_b = _transients(spec, num_params, shapes, group, shard_rank, precision,
                                               optimizer, on_this_rank, reshard_after_forward, foreach)
    b["unsharded_parameters"] = max(gathered["forward"], gathered["backward"])
    b["unsharded_gradients"] = gathered["gradients"]
    b["activations"] = activation_bytes
    b["temporaries"] = max(step_b, autocast_b)
    grad_b = 4 if (spec.units or precision != "mixed") else 2  # FSDP upcasts its gradient shard to fp32
    # FSDP: a unit's gradient shard appears at its reduce-scatter, and the root unit (the last
    # of ``shapes``) reduces after every other one: at backward's peak its shard is not there
    # yet. With a single unit that is every gradient (measured: 9 % too high without this).
    root_grad = grad_b * layout.sharded_numel(spec.storage, shapes[-1:], group) if spec.units and on_this_rank else 0
    phases = _phases(spec, b, gathered, autocast_b, step_b, root_grad, gradient_as_bucket_view)
    return Ledger(strategy, world_size, rank, precision, optimizer, group, num_params, b,
                  phases, tuple(notes))


def _transients(spec, num_params, shapes, group, shard_rank, precision, optimizer, on_this_rank,
                reshard_after_forward, foreach) -> tuple[dict, int, int]:
    """(unsharded bytes by moment, autocast's weight copies, the optimizer step's temporaries),
    bytes per rank; see ``transients`` for the mechanisms behind each term."""
    compute_b = 2 if precision == "mixed" else 4  # unsharded (gathered) parameters and gradients
    gathered = transients.unsharded_bytes(spec, shapes, group, compute_b,
                                          reshard_after_forward=reshard_after_forward)
    if not on_this_rank:
        # The replica broadcast every step, and its gradients before the reduce to device 0.
        gathered = dict.fromkeys(gathered, compute_b * num_params)
    # autocast caches a 2-byte copy of every parameter a low-precision op uses (all of a
    # Linear's); assumed here for every parameter (LayerNorm's stay fp32 on CUDA: an upper bound).
    autocast_b = 2 * num_params if precision == "autocast" else 0
    step_b = 0
    if on_this_rank:
        step_b = transients.optimizer_temporaries(spec, optimizer, shapes, group, shard_rank, foreach)
    return gathered, autocast_b, step_b


def _phases(spec, b: dict, gathered: dict, autocast_b: int, step_b: int, root_grad: int,
            gradient_as_bucket_view: bool) -> dict:
    """phase -> {category: bytes} on this rank at each moment of a training step, from the
    ledger's bytes ``b``; ``root_grad``: the root unit's gradient shard, not there yet at
    backward's peak."""
    rest = {c: b[c] for c in AT_REST}
    # zero_grad(set_to_none=True) frees gradients before forward, unless they are views of
    # DDP's buckets (gradient_as_bucket_view), whose storage stays.
    grads_kept = spec.buckets and gradient_as_bucket_view
    forward = dict(rest, gradients=rest["gradients"] if grads_kept else 0,
                   unsharded_parameters=gathered["forward"], activations=b["activations"],
                   temporaries=autocast_b)
    # Backward counts every gradient and no activation: gradients appear as activations are
    # freed, and the two roughly trade places.
    backward = dict(rest, gradients=rest["gradients"] - root_grad,
                    unsharded_parameters=gathered["backward"],
                    unsharded_gradients=gathered["gradients"])
    step = dict(rest, temporaries=step_b)
    return {"at rest": rest, "forward": forward, "backward": backward, "optimizer step": step}


def _from_model(num_params, units, batch_size, activation_bytes):
    """(num_params, units, activation_bytes) with a model read: its size, one unit per block,
    and its activations for ``batch_size`` samples per rank by formula."""
    if not hasattr(num_params, "named_parameters"):
        if batch_size is not None:
            raise LedgerError("batch_size= needs a model (the course's, e.g. dpc.models.build_model('mlp')); "
                              "with a parameter count pass activation_bytes= instead")
        return num_params, units, activation_bytes
    model = num_params
    units = layout.unit_shapes(model) if units is None else units
    if batch_size is not None:
        if activation_bytes:
            raise LedgerError("give activation_bytes= or batch_size=, not both")
        try:
            kind, sizes = activations.model_sizes(model)
        except ValueError as err:
            raise LedgerError(str(err)) from None
        activation_bytes = activations.activation_bytes(kind, batch_size, **sizes)
    return sum(p.numel() for p in model.parameters()), units, activation_bytes


def _check(num_params, world_size, strategy, precision, optimizer, rank, activation_bytes) -> None:
    """Raise LedgerError, naming the fix, for a request that is no real configuration."""
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
    if precision == "autocast" and not vocab.SHARDING[strategy].autocast:
        raise LedgerError(f"precision='autocast' models DP/DDP under torch.autocast, not {strategy!r}; "
                          "for ZeRO and FSDP (MixedPrecision / MixedPrecisionPolicy) use precision='mixed'")


def _model_states(spec, num_params, shapes, group, shard_rank, precision, optimizer, units_known,
                  gradient_as_bucket_view) -> dict:
    """{category: bytes} of the model states one rank holds at rest under ``spec`` (a
    ``vocab.Sharding``): a state in ``spec.shards`` is held as ``layout.sharded_numel`` says."""
    mixed = precision == "mixed"

    def held(state: str, rank: int | None = None) -> int:
        """Elements of ``state`` on this rank (rank: this rank's exact FSDP2 chunks)."""
        return layout.sharded_numel(spec.storage, shapes, group, rank) if state in spec.shards else num_params

    stored_b = 4 if (spec.units or not mixed) else 2  # FSDP's shards stay fp32 (the master copy)
    out = {"parameters": stored_b * held("parameters"), "gradients": stored_b * held("gradients")}
    # Optimizer state is created with zeros_like on the local shard: FSDP2's chunks are
    # unpadded, so its last ranks may hold less than the padded parameter shard.
    counters = STEP_COUNTER_BYTES[optimizer] * layout.optimizer_tensors(spec.storage, shapes, units_known)
    out["optimizer_state"] = OPTIMIZER_STATE_BYTES[optimizer] * held("optimizer_state", shard_rank) + counters
    if mixed and not spec.units:  # ZeRO counts the fp32 master weights as optimizer state
        out["master_weights"] = 4 * held("optimizer_state")
    if spec.buckets and not gradient_as_bucket_view:
        out["bucket_buffers"] = stored_b * num_params  # DDP's flat buckets, beside param.grad
    return out
