"""Exercise C: the learner writes four FSDP configurations and predicts, before running, how
they order by memory and by bytes sent; the checker runs them on 4 ranks and judges.

    report = dpc.exercises.check_c(configs, predicted)

``configs``: {"FULL_SHARD": wrap, "SHARD_GRAD_OP": wrap, "HYBRID_SHARD": wrap, "one unit":
wrap}, each ``wrap(model) -> model`` in FSDP1 (``sharding_strategy``, an ``auto_wrap_policy``,
a 2-D ``device_mesh`` for HYBRID) or FSDP2 (``fully_shard`` per block, ``reshard_after_forward``,
a 2-D mesh). ``predicted``: three orderings of the four names, least first -- "at_rest"
(bytes a rank holds between steps), "peak" (the most it holds during a step) and
"sent_per_step" (bytes a rank sends per step). Values within ``TIE`` of each other are tied:
either order passes.

Judged: each configuration trains like one process and behaves as its name says (what a rank
holds, how often each unit is gathered, on which process groups); the memory orderings
against the memory ledger for that configuration (deterministic), the bytes ordering against
the ``Comm`` observer's count. What the machine measured -- memory next to the ledger -- is
reported apart as "the machine's run", never as the learner's verdict.
"""
from __future__ import annotations

from .. import memory, models
from ..observe import Comm, Memory
from . import setups
from .ranks import RankFailure, blanks_in, clusters_for, run_or_failure
from .report import Report

WORLD_SIZE, SHARD_GROUP = 4, 2   # HYBRID_SHARD: 2 "nodes" of 2 ranks
SIZES = {"d_hidden": 128, "depth": 4}
CONFIGS = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "one unit")
ORDERINGS = {"at_rest": "between steps", "peak": "at the fullest moment of a step",
             "sent_per_step": "bytes sent per step"}
TIE = 0.03
# why a configuration sits where it does, said when a learner's order puts it wrongly
REASONS = {
    "at_rest": {"FULL_SHARD": "shards everything over all 4 ranks", "SHARD_GRAD_OP": "shards everything over all 4 ranks too",
                "HYBRID_SHARD": "shards over a group of 2 and keeps a replica per group",
                "one unit": "shards its one flat unit over all 4 ranks"},
    "peak": {"FULL_SHARD": "holds one block's full parameters at a time",
             "SHARD_GRAD_OP": "keeps every block's full parameters from its forward to its backward",
             "HYBRID_SHARD": "holds shards twice as large all the time, and gathers one block at a time",
             "one unit": "gathers the whole model at once, and holds all its full gradients at once"},
    "sent_per_step": {"FULL_SHARD": "gathers every block twice a step and reduce-scatters it",
                      "SHARD_GRAD_OP": "gathers every block once a step and reduce-scatters it",
                      "HYBRID_SHARD": "gathers and reduce-scatters within pairs, then all-reduces its shard across",
                      "one unit": "is FSDP's root unit, which stays gathered from forward to backward"},
}


def check_c(configs: dict, predicted: dict, cluster=None, timeout: float = 180.0) -> Report:
    """Run the learner's four configurations on 4 ranks and judge them and the orderings."""
    report = Report("Exercise C")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise ValueError(f"configs has {unknown}; its keys are {list(CONFIGS)}")
    blank = [name for name in CONFIGS if name not in configs or blanks_in(configs[name])]
    if len(blank) == len(CONFIGS):
        report.attempted = False
        report.note = "Write the four wrap functions (replace the `...`), then run this cell again."
        return report
    reference = setups.one_process(SIZES, WORLD_SIZE)
    runs, model = {}, models.build_model("mlp", **SIZES)
    with clusters_for(cluster, [WORLD_SIZE]) as clusters:
        for name in CONFIGS:
            item = f"{name}: trains like one process and behaves as {name}"
            if name in blank:
                report.add(item, None, "replace the `...` first")
                continue
            held, comm = Memory(), Comm()
            out = run_or_failure(clusters[WORLD_SIZE], setups.train_wrapped, configs[name], SIZES,
                                 timeout=timeout, observe=[held, comm])
            if isinstance(out, RankFailure):
                report.add(item, False, out.describe(timeout))
                continue
            ok, detail = setups.weights_verdict(out, reference)
            if ok:
                ok, detail = _behaves(name, held, comm, model)
            report.add(item, ok, detail)
            runs[name] = (held, comm, out[0]["api"])
    books = {n: _ledger(model, api)[n] for n, (_, _, api) in runs.items()} if runs else {}
    books = {**_ledger(model), **books}
    complete = len(runs) == len(CONFIGS)
    # memory: the ledger and this machine's measurement; an order fails only where both say so
    sources = {"at_rest": [{n: sum(b.at_rest().values()) for n, b in books.items()}],
               "peak": [{n: b.peak for n, b in books.items()}],
               "sent_per_step": [{n: sum(c.bytes(rank=0, step=-1).values()) for n, (_, c, _) in runs.items()}]}
    if complete:
        sources["at_rest"].append({n: sum(h.at_rest(0).get(c, 0) for c in memory.AT_REST)
                                   for n, (h, _, _) in runs.items()})
        sources["peak"].append({n: h.peak(0)[0] for n, (h, _, _) in runs.items()})
    for key, what in ORDERINGS.items():
        name = f"prediction: the order {what}"
        guess = predicted.get(key, ...) if isinstance(predicted, dict) else ...
        known = sources[key] if key != "sent_per_step" or complete else None
        report.add(name, *_judge_order(key, guess, known))
    report.note = _machine(runs, books)
    return report


def _ledger(model, api: str = "fsdp1") -> dict:
    """The ledger of each configuration for the checker's model, batch and optimizer, in the
    layout of the API the learner used (FSDP2's per-parameter shards, or FSDP1's flat ones)."""
    one = [[tuple(p.shape) for p in model.parameters()]]
    common = dict(optimizer="adam", batch_size=setups.BATCH)
    if api == "fsdp2":
        return {"FULL_SHARD": memory.ledger(model, WORLD_SIZE, "fully_shard", **common),
                "SHARD_GRAD_OP": memory.ledger(model, WORLD_SIZE, "fully_shard", reshard_after_forward=False, **common),
                "HYBRID_SHARD": memory.ledger(model, WORLD_SIZE, "fully_shard", shard_group_size=SHARD_GROUP, **common),
                "one unit": memory.ledger(model, WORLD_SIZE, "fully_shard", units=one, **common)}
    return {"FULL_SHARD": memory.ledger(model, WORLD_SIZE, "FULL_SHARD", **common),
            "SHARD_GRAD_OP": memory.ledger(model, WORLD_SIZE, "SHARD_GRAD_OP", **common),
            "HYBRID_SHARD": memory.ledger(model, WORLD_SIZE, "HYBRID_SHARD", shard_group_size=SHARD_GROUP, **common),
            "one unit": memory.ledger(model, WORLD_SIZE, "FULL_SHARD", units=one, **common)}


def _behaves(name: str, held: Memory, comm: Comm, model) -> tuple[bool, str]:
    full = 4 * sum(p.numel() for p in model.parameters())
    share = held.at_rest(0)["parameters"] / full
    calls, groups = comm.calls(rank=0, step=-1), comm.groups(rank=0, step=-1)
    gathers, scatters = calls.get("all_gather", 0), calls.get("reduce_scatter", 0)
    blocks = len(model.blocks)
    want_share = 1 / SHARD_GROUP if name == "HYBRID_SHARD" else 1 / WORLD_SIZE
    seen = f"{share:.0%} of the parameters per rank, {gathers} all-gathers and {scatters} reduce-scatters per step"
    fine = {"FULL_SHARD": "sharded over all ranks, one unit per block, gathered again for backward",
            "SHARD_GRAD_OP": "sharded over all ranks, one unit per block, kept gathered from forward to backward",
            "HYBRID_SHARD": "sharded inside groups of 2, replicated across them",
            "one unit": "sharded over all ranks as a single unit"}[name]
    if not scatters:
        return False, f"{seen}: no reduce-scatter, so the gradients are not sharded (is it FSDP?)"
    if abs(share - want_share) > 0.03:
        return False, (f"{seen}: {name} keeps 1/{round(1 / want_share)} per rank between steps"
                       + (" -- a 2-D mesh (2 groups of 2): shard inside a group, replicate across"
                          if name == "HYBRID_SHARD" else ""))
    if name == "HYBRID_SHARD":
        # (the training loop's all-reduce of the loss, one float, goes over all 4 ranks)
        across = [g for g, sent in groups.items() if sent.get("all_reduce", 0) > 4 * (WORLD_SIZE - 1)]
        inside = [g for g, sent in groups.items() if "all_gather" in sent]
        if not across or any(len(g) != SHARD_GROUP for g in inside + across):
            return False, (f"{seen}, on the groups {sorted(groups)}: HYBRID_SHARD gathers inside a group of "
                           f"{SHARD_GROUP} and all-reduces each shard across the groups")
    if name == "one unit":
        if scatters != 1:
            return False, f"{seen}: {scatters} units -- one unit means no auto-wrap policy (FSDP2: fully_shard on the root only)"
        return True, fine
    if scatters < blocks:
        return False, (f"{seen}: fewer units than the MLP's {blocks} blocks -- an auto-wrap policy (FSDP1: "
                       "ModuleWrapPolicy of the block class; FSDP2: fully_shard on each block) makes each block a unit")
    again = gathers > scatters  # some unit gathered a second time, for backward
    if name in ("FULL_SHARD", "HYBRID_SHARD") and not again:
        return False, f"{seen}: every unit was gathered only once -- {name} frees the parameters after forward"
    if name == "SHARD_GRAD_OP" and again:
        return False, f"{seen}: units were gathered again for backward -- SHARD_GRAD_OP keeps them from forward"
    return True, fine


def _judge_order(key: str, guess, sources) -> tuple[bool | None, str]:
    """``guess`` (least first) against every source of values: a pair in the wrong order fails
    only where each source puts it the other way by more than ``TIE``."""
    if guess is ... or guess is None:
        return None, "no prediction yet"
    if not isinstance(guess, (list, tuple)) or sorted(guess) != sorted(CONFIGS):
        return False, f"an ordering of the four names {list(CONFIGS)}, least first, not {guess!r}"
    if sources is None:
        return None, "judged once every configuration runs"
    for i, a in enumerate(guess):
        for b in guess[i + 1:]:
            if all(values[a] > values[b] * (1 + TIE) for values in sources):
                return False, f"{a} is not below {b}: {a} {REASONS[key][a]}, and {b} {REASONS[key][b]}"
    return True, "holds"


def _machine(runs: dict, books: dict) -> str:
    """What this machine measured next to the ledger, as agreement only (no values: they would
    give the orderings away). Reported, never judged."""
    lines = []
    for name, (held, _, _) in runs.items():
        rest = sum(held.at_rest(0).get(c, 0) for c in memory.AT_REST)
        exact = "equal to" if rest == sum(books[name].at_rest().values()) else "not equal to"
        off = held.peak(0)[0] / books[name].peak - 1
        lines.append(f"{name}: at rest {exact} the ledger's, peak {abs(off):.0%} {'above' if off > 0 else 'below'} it")
    return ("The machine's run (rank 0's memory, measured next to the ledger; not part of your verdict): "
            + "; ".join(lines) + ".") if lines else ""
