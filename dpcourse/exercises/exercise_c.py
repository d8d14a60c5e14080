"""Exercise C: the learner writes four FSDP configurations and one function that predicts, for
each, what a rank holds and sends; the checker runs them on 4 ranks and judges.

    report = dpc.exercises.check_c(configs, predict)

``configs``: {"FULL_SHARD": wrap, "SHARD_GRAD_OP": wrap, "HYBRID_SHARD": wrap, "one unit":
wrap}, each ``wrap(model) -> model`` in FSDP1 (``sharding_strategy``, an ``auto_wrap_policy``,
a 2-D ``device_mesh`` for HYBRID) or FSDP2 (``fully_shard`` per block, ``reshard_after_forward``,
a 2-D mesh). ``predict(units, world_size, config)`` returns, for rank 0, {"at_rest": bytes
held between steps, "peak": the most bytes held at once during a step, "sent_per_step":
bytes sent in a step}; ``units`` are the parameters (elements) per FSDP unit of the MLP
when each block is a unit -- the blocks, then the root -- and ``config`` one of the four
names. The three orderings follow from these figures.

Judged: each configuration trains like one process and behaves as its name says (what a rank
holds, how often each unit is gathered, on which process groups); each configuration's
figures against what its run measured (``Memory``: at rest and peak; ``Comm``: bytes), said
as too high / too low and roughly by how much, never as the value -- within ``TOLERANCE``,
the peak within ``PEAK_TOLERANCE`` (activations, FSDP's prefetching and its copy buffers come
on top of what is gathered); and the order the figures give, pair by pair. The machine's own
noise never counts against the learner: a pair's order is judged only where the memory ledger
(deterministic) and the measurement both separate the two by more than ``TIE``; what the
machine measured next to the ledger is reported apart as "the machine's run". A set-up that
is not what its name says leaves its figures "not judged", and out of the orderings. A
``predict`` that uses the course's calculators (``dpc.memory.ledger``, ...), by any route, or
copies their code, is refused (it runs where they cannot be reached: ``sandbox``), and one
that fails on models no rank ran, drawn at each check, fails there.
"""
from __future__ import annotations

from collections.abc import Mapping

from .. import memory, models
from ..memory.ledger import AT_REST
from ..observe import Comm, Memory
from . import setups
from ..grading.judging import RankFailure, blanks_in, clusters_for, run_or_failure
from ..grading import provenance
from ..grading.report import Report

WORLD_SIZE, SHARD_GROUP = 4, 2   # HYBRID_SHARD: 2 "nodes" of 2 ranks
SIZES = {"d_hidden": 128, "depth": 4}
CONFIGS = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "one unit")
FIGURES = {"at_rest": "held between steps", "peak": "at the fullest moment of a step",
           "sent_per_step": "bytes sent per step"}
ORDERINGS = {"at_rest": "between steps", "peak": "at the fullest moment of a step",
             "sent_per_step": "of bytes sent per step"}
TOLERANCE, PEAK_TOLERANCE = 0.05, 0.35
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


@provenance.judged("C")
def check_c(configs: dict, predict, cluster=None, timeout: float = 180.0) -> Report:
    """Run the learner's four configurations on 4 ranks and judge them, their figures and the
    orderings the figures give."""
    report = Report("Exercise C", key="C")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise ValueError(f"configs has {unknown}; its keys are {list(CONFIGS)}")
    blank = [name for name in CONFIGS if name not in configs or blanks_in(configs[name])]
    if len(blank) == len(CONFIGS):
        report.attempted = False
        report.note = "Write the four wrap functions (replace the `...`), then run this cell again."
        return report
    model = models.build_model("mlp", **SIZES)
    set_ups, runs, behaved = _measure(configs, blank, cluster, timeout)
    for name, ok, detail in set_ups:
        report.add(name, ok, detail)
    books = {n: _ledger(model, api)[n] for n, (_, _, api) in runs.items()} if runs else {}
    books = {**_ledger(model), **books}
    measured = {n: {"at_rest": sum(h.at_rest(0).get(c, 0) for c in AT_REST), "peak": h.peak(0)[0],
                    "sent_per_step": sum(c.bytes(rank=0, step=-1).values())} for n, (h, c, _) in runs.items()}
    figures, problem = _figures(predict, models.unit_numels(model))
    judged = {}  # the configurations whose figures were judged: name -> its figures
    for name in CONFIGS:
        item = f"prediction: {name} per rank"
        if problem:
            report.add(item, None if problem == "no prediction yet" else False, problem)
        elif name not in runs:
            report.add(item, None, "judged once the set-up runs")
        elif not behaved[name]:  # its measurement is of another set-up than the one predicted
            report.add(item, None, f"not judged: the set-up is not {name}")
        else:
            ok, detail = _judge_figures(name, figures[name], measured[name])
            if ok and figures["unseen"][name]:
                ok, detail = False, figures["unseen"][name]
            report.add(item, ok, detail)
            if ok is not None:
                judged[name] = figures[name]
    # the orders: the ledger and this machine's measurement; a pair is judged only where both separate it
    for key, what in ORDERINGS.items():
        sources = [{n: measured[n][key] for n in judged}]
        if key != "sent_per_step":
            sources.append({n: (sum(books[n].at_rest().values()) if key == "at_rest" else books[n].peak)
                            for n in judged})
        report.add(f"prediction: the order {what}",
                   *_judge_order(key, judged, sources, problem, runs, behaved))
    report.note = _machine(runs, books)
    if report.attempted and not report.passed:
        report.note = (report.note + " Each failed item says what the ranks did. To compare with a reference: "
                       "report.fix().").strip()
    return report


def _measure(configs: dict, blank: list, cluster, timeout: float) -> tuple[list, dict, dict]:
    """Run each configuration that is written: the set-up items [(name, ok, detail)], the runs
    {name: (Memory, Comm, api)} and whether each behaved as its name says. Nothing of the
    learner's figures: they are judged against it in the kernel."""
    reference = setups.one_process(SIZES, WORLD_SIZE)
    model = models.build_model("mlp", **SIZES)
    items, runs, behaved = [], {}, {}
    with clusters_for(cluster, [WORLD_SIZE]) as clusters:
        for name in CONFIGS:
            item = f"{name}: trains like one process and behaves as {name}"
            if name in blank:
                items.append((item, None, "replace the `...` first"))
                continue
            held, comm = Memory(), Comm()
            out = run_or_failure(clusters[WORLD_SIZE], setups.train_wrapped, configs[name], SIZES,
                                 timeout=timeout, observe=[held, comm])
            if isinstance(out, RankFailure):
                items.append((item, False, out.describe(timeout)))
                continue
            ok, detail = setups.weights_verdict(out, reference)
            if ok:
                ok, detail = _behaves(name, held, comm, model)
            items.append((item, ok, detail))
            runs[name], behaved[name] = (held, comm, out[0]["api"]), ok
    return items, runs, behaved


def _figures(predict, units: list) -> tuple[dict, str]:
    """({config: {"at_rest": ..., "peak": ..., "sent_per_step": ...}}, problem): the learner's
    figures for each configuration, or why there are none ("" when there are)."""
    if predict is ... or predict is None:
        return {}, "no prediction yet"
    if not callable(predict):
        return {}, f"predict is a {type(predict).__name__}: a function of (units, world_size, config), please"
    used = setups.calculator_in(predict)
    if used:
        return {}, (f"refused: {getattr(predict, '__name__', 'predict')}() uses {used}, the course's own calculator "
                    "-- write the figures yourself, from units, world_size and config")
    unseen = _unseen()
    answers = setups.Answers({"predict": predict}, [("predict", (u, WORLD_SIZE, name)) for u in [list(units), *unseen]
                                                   for name in CONFIGS], "from units, world_size and config")
    refused = answers.refusal("predict")
    if refused:
        return {}, refused
    fname = getattr(predict, "__name__", "predict")
    figures = {"unseen": _judge_unseen(answers, unseen, fname)}
    for name in CONFIGS:
        value, error = answers("predict", list(units), WORLD_SIZE, name)
        if error:
            return {}, f"{fname}(units, {WORLD_SIZE}, {name!r}) raised {error}"
        if value is ...:
            value = {}
        if not isinstance(value, Mapping):
            return {}, f"{fname}() returned a {type(value).__name__}: a dict of 'at_rest', 'peak', 'sent_per_step'"
        figures[name] = {k: setups.as_bytes(value.get(k, ...)) for k in FIGURES}
    if all(v is ... for n, f in figures.items() if n != "unseen" for v in f.values()):
        return {}, "no prediction yet"
    return figures, ""


def _unseen(draw=None) -> list[list]:
    """Units of 2 models drawn now, from a space no table covers: 3 to 8 blocks of 1,000 to 10
    million parameters each, a root of 1 to 5 % of them."""
    import random

    draw = draw or random.Random()
    out = []
    for _ in range(2):
        blocks = [draw.randint(1_000, 10_000_000) for _ in range(draw.randint(3, 8))]
        out.append(blocks + [max(1, int(sum(blocks) * draw.uniform(0.01, 0.05)))])
    return out


def _judge_unseen(answers, unseen: list, fname: str) -> dict:
    """{config: "" or why its figures fail on a model no rank ran}: next to the reference's
    figures (within twice the tolerance: both are judged against measurements within it)."""
    import importlib

    from ..grading import provenance

    with provenance.quiet():   # the course reading its reference: not the learner's read
        reference = importlib.import_module(f"{__package__}.solutions.configs_c").predict
    out = {}
    for name in CONFIGS:
        out[name] = ""
        for units in unseen:
            value, error = answers("predict", units, WORLD_SIZE, name)
            if error:
                out[name] = f"{fname}(units, {WORLD_SIZE}, {name!r}) raised {error} (units={units}, a model no rank ran)"
                break
            want = reference(units, WORLD_SIZE, name)
            for key in FIGURES:
                got = setups.as_bytes(value.get(key, ...)) if isinstance(value, Mapping) else value
                ok, detail = setups.miss(got, want[key], 2 * (PEAK_TOLERANCE if key == "peak" else TOLERANCE))
                if ok is not True:
                    out[name] = (f"for units={units}, a model no rank ran, its {FIGURES[key]} is {detail} next to what "
                                 f"{name} holds and sends there: figures follow from units alone, for any model")
                    break
            if out[name]:
                break
    return out


def _judge_figures(name: str, figures: dict, measured: dict) -> tuple[bool | None, str]:
    """One configuration's three figures against its run: each within its tolerance."""
    parts, verdicts = [], []
    for key, what in FIGURES.items():
        ok, detail = setups.miss(figures[key], measured[key], PEAK_TOLERANCE if key == "peak" else TOLERANCE)
        verdicts.append(ok)
        value = figures[key]
        why = (_why(name, key, value / measured[key]) if ok is False and isinstance(value, float) and measured[key]
               else "")
        parts.append(f"{what} {detail}{why}")
    if any(v is False for v in verdicts):
        return False, "; ".join(parts)
    if any(v is None for v in verdicts):
        return None, "; ".join(parts)
    return True, "; ".join(parts)


def _why(name: str, key: str, ratio: float) -> str:
    """A hint for a figure off by a telling factor (from the factor alone, not the value)."""
    near = lambda x: abs(ratio - x) < 0.1 * x  # noqa: E731
    if key == "at_rest" and name == "HYBRID_SHARD" and near(0.5):
        return " (HYBRID_SHARD shards over a group of 2 and keeps one replica per group)"
    if key == "at_rest" and name != "HYBRID_SHARD" and (near(2) or near(4)):
        return f" ({name} shards the parameters, gradients and optimizer state over all 4 ranks)"
    if key == "at_rest" and (near(0.75) or near(1.5) or near(0.5)):
        return " (how many tensors the size of the parameters does Adam keep?)"
    if key == "peak" and name == "one unit" and ratio < 1:
        return " (with one unit, what is gathered is the whole model)"
    if key == "peak" and name == "SHARD_GRAD_OP" and ratio < 1:
        return " (SHARD_GRAD_OP keeps every block gathered from its forward to its backward)"
    if key == "sent_per_step" and name == "HYBRID_SHARD" and ratio > 1:
        return (" (HYBRID_SHARD gathers and reduce-scatters within its group of 2, then all-reduces its shard "
                "across the groups)")
    if key == "sent_per_step" and name in ("SHARD_GRAD_OP", "one unit") and near(1.5):
        return " (how often is each unit gathered in a step when its parameters stay from forward to backward?)"
    if key == "sent_per_step" and (near(4 / 3) or near(8 / 3)):
        return " (in a ring, a rank sends (N-1)/N of the data per phase, not all of it)"
    return ""


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


def _judge_order(key: str, judged: dict, sources: list, problem: str, runs: dict,
                 behaved: dict) -> tuple[bool | None, str]:
    """The order the learner's figures give, pair by pair, among the configurations whose
    figures were judged: a pair fails where every source separates it by more than ``TIE``
    and the figures do not put it the same way round."""
    if problem:
        return None, "judged once there are figures"
    left_out = [n for n in CONFIGS if n in runs and not behaved[n]]
    names = [n for n in CONFIGS if n in judged and isinstance(judged[n][key], float)]
    if len(names) < 2:
        return None, ("judged once every configuration runs and has a figure" if not left_out else
                      f"not judged: {setups.many(left_out)} is not what its name says")
    for a in names:
        for b in names:
            if a == b:
                continue
            if all(values[a] * (1 + TIE) < values[b] for values in sources) and not judged[a][key] < judged[b][key]:
                where = "on these ranks" if len(sources) == 1 else "on these ranks and in the ledger"
                return False, (f"your figures put {a} at or above {b}; {where} it is below: "
                               f"{a} {REASONS[key][a]}, and {b} {REASONS[key][b]}")
    order = sorted(names, key=lambda n: judged[n][key])
    said = order[0]
    for before, name in zip(order, order[1:]):
        said += (" ≈ " if judged[name][key] <= judged[before][key] * (1 + TIE) else " < ") + name
    rest = f" ({setups.many(left_out)} left out: not what its name says)" if left_out else ""
    return True, f"your figures give {said}, and that holds{rest}"


def _machine(runs: dict, books: dict) -> str:
    """What this machine measured next to the ledger, as agreement only (no values: they would
    give the orderings away). Reported, never judged."""
    lines = []
    for name, (held, _, _) in runs.items():
        rest = sum(held.at_rest(0).get(c, 0) for c in AT_REST)
        exact = "equal to" if rest == sum(books[name].at_rest().values()) else "not equal to"
        off = held.peak(0)[0] / books[name].peak - 1
        lines.append(f"{name}: at rest {exact} the ledger's, peak {abs(off):.0%} {'above' if off > 0 else 'below'} it")
    return ("The machine's run (rank 0's memory, measured next to the ledger; not part of your verdict): "
            + "; ".join(lines) + ".") if lines else ""
