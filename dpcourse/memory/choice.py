"""Choosing a strategy the way a practitioner does: what fits, then what it costs a step.

Every plan is a sharding strategy with, where needed, activation checkpointing (selective or
full) and CPU offload. ``plans`` prices each one per rank and step: the peak bytes (the
ledger's, with the activations the checkpointing keeps), the bytes sent (``cost.step_bytes``,
as a ring sends them), the forward work done again, the bytes copied between host and device,
and an estimated step time (``alpha_beta``: compute at a share of peak FLOP/s, each phase's
communication hidden behind that phase's compute, what sticks out added). ``choose`` walks
the plans in the order of what each adds, and takes the first that fits:

    1. ``ddp``: a full replica, one all-reduce (2 Psi).
    2. ZeRO-2: gradients and optimizer state sharded, parameters whole from forward to
       backward: sends what DDP sends. On one node ``SHARD_GRAD_OP``; over several nodes HSDP
       with ZeRO-2 inside a node (FSDP2 on a 2-D mesh with ``reshard_after_forward=False``;
       FSDP1 names it ``ShardingStrategy._HYBRID_SHARD_ZERO2``),
       so only an all-reduce of each node's shard crosses between nodes.
    3. Activation checkpointing with the replica or ZeRO-2: selective first (the matmuls'
       outputs kept, the cheap ops recomputed), then full (a block's input kept, its forward
       run again in backward: a third more compute).
    4. Parameters sharded too (ZeRO-3, 3 Psi): over several nodes HSDP (FULL_SHARD inside a
       node), then ``fully_shard(..., reshard_after_forward=<ranks per node>)`` (backward's
       gathers stay inside a node), then FULL_SHARD over all ranks; each without, then with
       checkpointing.
    5. FULL_SHARD with CPU offload, then with full checkpointing too: model states on the
       host, every unit copied in for forward and backward and its gradient copied out.

The order puts network bytes before recompute before more network bytes before host copies:
what each step adds is paid every step. The estimate beside it says whether a later plan
would be faster here (e.g. ZeRO-3 whose gathers hide, against full recompute): the verdict
then names it, to be measured, not assumed.

What checkpointing keeps is an assumption about the model (``SELECTIVE_KEEPS`` etc.): 4.2c
measures both on the ranks; pass your model's figures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..collectives import alpha_beta
from ..collectives.cost import step_bytes
from .fit import _hybrid_group, equal_units
from .ledger import AT_REST, ledger

# Activation checkpointing, as shares of the activations a rank holds without it, and of one
# forward pass. Selective (a policy that saves the matmuls' outputs): about half kept, a tenth
# of the forward's time recomputed (the element-wise ops are cheap in FLOPs). Full: each
# block keeps only its input (one hidden state against the ~16-34 a GPT block saves), plus
# one block's activations while its forward runs again; the whole forward recomputed.
SELECTIVE_KEEPS, SELECTIVE_RECOMPUTES = 0.5, 0.1
FULL_KEEPS, FULL_RECOMPUTES = 1 / 16, 1.0
CHECKPOINTING = ("none", "selective", "full")
TOKENS_PER_RANK = 8192  # tokens per rank and step: e.g. 4 sequences of 2,048


@dataclass(frozen=True)
class Plan:
    """One way to train: a strategy over ``group`` ranks per copy, checkpointing, offload.

    name: as the table shows it. strategy: the ledger's (``vocab.SHARDING``). group: ranks one
    copy of the model is sharded over (1: a replica). reshard: ``reshard_after_forward`` as an
    int (ranks the parameters stay sharded over between forward and backward), or None.
    """

    name: str
    strategy: str
    group: int
    checkpointing: str = "none"
    offload: bool = False
    hsdp: bool = False
    reshard: int | None = None


def candidates(world_size: int, shard_group_size: int | None = 8) -> list[Plan]:
    """The plans in the rule's order (module docstring), for ``world_size`` ranks of which
    ``shard_group_size`` share a node (HSDP and ``reshard_after_forward=<int>`` only when it
    divides ``world_size`` and leaves more than one node)."""
    n, node = world_size, _hybrid_group(world_size, shard_group_size)
    if n == 1:
        return [Plan("single device", "ddp", 1), *(Plan(f"single device + {c} AC", "ddp", 1, c)
                                                   for c in CHECKPOINTING[1:]),
                Plan("single device + CPU offload", "ddp", 1, offload=True),
                Plan("single device + full AC + CPU offload", "ddp", 1, "full", offload=True)]
    zero2 = [Plan(f"HSDP, ZeRO-2 in a node of {node}", "SHARD_GRAD_OP", node, hsdp=True)] if node else []
    zero2 += [Plan("SHARD_GRAD_OP (ZeRO-2)", "SHARD_GRAD_OP", n)]
    plans = [Plan("ddp", "ddp", 1), *zero2]
    for c in CHECKPOINTING[1:]:
        plans += [Plan(f"ddp + {c} AC", "ddp", 1, c)]
        plans += [Plan(f"{p.name} + {c} AC", p.strategy, p.group, c, hsdp=p.hsdp) for p in zero2]
    zero3 = ([Plan(f"HSDP, FULL_SHARD in a node of {node}", "HYBRID_SHARD", node, hsdp=True),
              Plan(f"FULL_SHARD, reshard_after_forward={node}", "FULL_SHARD", n, reshard=node)] if node else [])
    zero3 += [Plan("FULL_SHARD (ZeRO-3)", "FULL_SHARD", n)]
    for c in CHECKPOINTING:
        plans += [Plan(p.name + (f" + {c} AC" if c != "none" else ""), p.strategy, p.group, c,
                       hsdp=p.hsdp, reshard=p.reshard) for p in zero3]
    plans += [Plan("FULL_SHARD + CPU offload", "FULL_SHARD", n, offload=True),
              Plan("FULL_SHARD + full AC + CPU offload", "FULL_SHARD", n, "full", offload=True)]
    return plans


def kept_activations(activation_bytes: int, checkpointing: str, num_units: int = 1) -> int:
    """Bytes of activations a rank holds at forward's end under ``checkpointing``; full
    checkpointing also holds one unit's activations again while its forward reruns."""
    if checkpointing == "none":
        return activation_bytes
    if checkpointing == "selective":
        return math.ceil(activation_bytes * SELECTIVE_KEEPS)
    if checkpointing == "full":
        return math.ceil(activation_bytes * FULL_KEEPS + activation_bytes / max(1, num_units))
    raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, not {checkpointing!r}")


def plan_peak(plan: Plan, num_params: int, world_size: int, precision: str, optimizer: str,
              activation_bytes: int, units) -> int:
    """Peak bytes per rank of ``plan``: the ledger over the ranks one copy is sharded over
    (HSDP's replicas do not change what a rank holds), its activations as checkpointing
    leaves them; ``reshard_after_forward=<int>`` keeps each unit's parameters sharded over
    ``reshard`` ranks, not all, between forward and backward; offload moves the model states
    held between steps to the host."""
    acts = kept_activations(activation_bytes, plan.checkpointing, max(1, len(units) - 1))
    strategy = "FULL_SHARD" if plan.strategy == "HYBRID_SHARD" else plan.strategy
    over = plan.group if plan.strategy != "ddp" else world_size
    book = ledger(num_params, over, strategy, precision, optimizer, units=units, activation_bytes=acts)
    phases = {name: dict(p) for name, p in book.phases.items()}
    if plan.reshard:  # between forward and backward every unit's shard is 1/reshard, not 1/N
        extra = _param_bytes(precision) * num_params * (1 / plan.reshard - 1 / world_size)
        phases["backward"]["unsharded_parameters"] += math.ceil(extra)
    if plan.offload:
        for p in phases.values():
            for c in AT_REST:
                p[c] = 0
    return max(sum(p.values()) for p in phases.values())


def _param_bytes(precision: str) -> int:
    """Bytes per parameter as FSDP gathers it: 2 under mixed precision, else 4."""
    return 2 if precision == "mixed" else 4


def _comm(plan: Plan, world_size: int, units, precision: str, node: int | None) -> tuple[dict, float]:
    """(seconds communicating per phase, bytes sent per rank and step) of ``plan`` on NVLink
    inside a node and InfiniBand across nodes (``alpha_beta.LINKS``)."""
    n, pb = world_size, _param_bytes(precision)
    intra, inter = alpha_beta.LINKS["nvlink4"], alpha_beta.LINKS["ib_ndr"]
    per_node = node or n
    nodes = n // per_node if n % per_node == 0 else 1
    whole = alpha_beta.across_nodes(intra, inter, nodes, per_node) if nodes > 1 else intra
    if plan.hsdp:
        seconds = alpha_beta.step_comm_seconds("HYBRID_SHARD", n, units, intra, shard_group_size=plan.group,
                                               inter_link=inter, param_bytes=pb)
        sent = step_bytes("HYBRID_SHARD", n, units, shard_group_size=plan.group, param_bytes=pb, by_phase=True)
        if plan.strategy == "SHARD_GRAD_OP":  # ZeRO-2 in a node: no second gather in backward
            seconds["backward"].pop("all_gather", None)
            sent["backward"].pop("all_gather", None)
    else:
        strategy = plan.strategy
        seconds = alpha_beta.step_comm_seconds(strategy, n, units, whole, param_bytes=pb)
        sent = step_bytes(strategy, n, units, param_bytes=pb, by_phase=True)
        if plan.reshard and "all_gather" in seconds["backward"]:  # backward's gathers inside a node
            hybrid = alpha_beta.step_comm_seconds("HYBRID_SHARD", n, units, intra, shard_group_size=plan.reshard,
                                                  inter_link=inter, param_bytes=pb)
            hybrid_sent = step_bytes("HYBRID_SHARD", n, units, shard_group_size=plan.reshard, param_bytes=pb,
                                     by_phase=True)
            seconds["backward"]["all_gather"] = hybrid["backward"]["all_gather"]
            sent["backward"]["all_gather"] = hybrid_sent["backward"]["all_gather"]
    total = sum(b for phase in sent.values() for b in phase.values())
    return seconds, total


def plans(num_params: int, world_size: int, device_bytes: int, shard_group_size: int | None = 8,
          precision: str = "mixed", optimizer: str = "adam", activation_bytes: int = 0, units=None,
          tokens: int = TOKENS_PER_RANK, flops: float = alpha_beta.H100_BF16_FLOPS, mfu: float = 0.4) -> list[dict]:
    """Every candidate plan, in the rule's order, priced per rank and step.

    Each row: plan (``Plan``), name, peak (bytes per rank), fits (peak <= device_bytes), sent
    (bytes per rank and step), recompute (share of one forward pass run again), host (bytes
    copied between host and device per step), seconds (estimated step time: forward and
    backward at ``mfu`` of ``flops`` for ``tokens`` per rank, the recompute added to backward,
    each phase's communication beyond its compute added, host copies over PCIe 4.0 x16).
    """
    units = list(units) if units is not None else equal_units(num_params, 32) + [0]
    node = _hybrid_group(world_size, shard_group_size)
    forward = alpha_beta.forward_seconds(num_params, tokens, flops, mfu)
    backward = alpha_beta.backward_seconds(num_params, tokens, flops, mfu)
    pcie = alpha_beta.LINKS["pcie4"]
    rows = []
    for plan in candidates(world_size, shard_group_size):
        peak = plan_peak(plan, num_params, world_size, precision, optimizer, activation_bytes, units)
        recompute = {"none": 0.0, "selective": SELECTIVE_RECOMPUTES, "full": FULL_RECOMPUTES}[plan.checkpointing]
        if world_size > 1:
            comm, sent = _comm(plan, world_size, units, precision, node)
        else:
            comm, sent = {"forward": {}, "backward": {}}, 0
        compute = {"forward": forward, "backward": backward + recompute * forward}
        exposed = sum(max(0.0, sum(comm[phase].values()) - compute[phase]) for phase in compute)
        # offload: each unit's shard copied in for forward and again for backward, its gradient out
        host = (3 * _param_bytes(precision) * num_params // (plan.group if plan.strategy != "ddp" else 1)
                if plan.offload else 0)
        seconds = sum(compute.values()) + exposed + host / pcie.beta
        rows.append({"plan": plan, "name": plan.name, "peak": peak, "fits": peak <= device_bytes,
                     "sent": sent, "recompute": recompute, "host": host, "seconds": seconds})
    return rows


def choose(rows: list[dict]) -> tuple[dict | None, dict | None]:
    """(the rule's plan: the first row that fits, the fastest row that fits if it is
    estimated more than 10 % faster than the rule's, else None); (None, None) if none fits."""
    fits = [r for r in rows if r["fits"]]
    if not fits:
        return None, None
    fastest = min(fits, key=lambda r: r["seconds"])
    return fits[0], (fastest if fastest["seconds"] < 0.9 * fits[0]["seconds"] else None)


def recommend(num_params: int, world_size: int, device_bytes: int, shard_group_size: int = 8,
              precision: str = "mixed", optimizer: str = "adam", activation_bytes: int = 0,
              units=None, tokens: int = TOKENS_PER_RANK) -> tuple[str, str]:
    """The course's rule (module docstring): (the plan's name, why), or ("none", what to do).

    device_bytes: one device's memory; activation_bytes: per rank without checkpointing;
    tokens: per rank and step, for the estimate the reason quotes.
    """
    rows = plans(num_params, world_size, device_bytes, shard_group_size, precision, optimizer,
                 activation_bytes, units, tokens)
    chosen, faster = choose(rows)
    if chosen is None:
        return "none", ("nothing fits, not even FULL_SHARD with full checkpointing and CPU offload: "
                        "add ranks, or split the model itself (tensor or pipeline parallelism)")
    plan = chosen["plan"]
    adds = []
    if plan.offload:
        adds.append("nothing fits on the device alone: with CPU offload the model states live in host "
                    f"memory and every step copies {chosen['host'] / 1e9:.3g} GB over PCIe")
    elif plan.strategy == "ddp":
        adds.append("a full replica with its gradients, optimizer state and activations fits; the "
                    "gradients are all-reduced (2 Psi a step)" if world_size > 1 else "it fits on one device")
    elif plan.strategy == "SHARD_GRAD_OP":
        adds.append("sharding gradients and optimizer state (ZeRO-2) fits; it sends what DDP sends "
                    "(all-gather + reduce-scatter = one all-reduce)"
                    + ("; HSDP keeps the gathers inside a node" if plan.hsdp else ""))
    else:
        adds.append("only sharding the parameters too fits (ZeRO-3: the parameters are gathered again "
                    "for backward, 1.5x DDP's bytes)"
                    + ("; HSDP keeps every gather inside a node" if plan.hsdp else "")
                    + (f"; resharding over {plan.reshard} ranks after forward keeps backward's gathers "
                       "inside a node" if plan.reshard else ""))
    if plan.checkpointing != "none":
        adds.append(f"{plan.checkpointing} activation checkpointing before sharding more, since it costs "
                    f"compute ({chosen['recompute']:.0%} of a forward again), not network bytes")
    why = "; ".join(adds) + f"; estimated step {duration(chosen['seconds'])}"
    if faster is not None:
        why += (f". Estimated faster here: {faster['name']} ({duration(faster['seconds'])}): "
                "measure both before choosing")
    return plan.name, why


def duration(seconds: float) -> str:
    """``seconds`` as ms below one second, else as s, three significant digits."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"
