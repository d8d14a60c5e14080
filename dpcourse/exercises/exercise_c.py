"""Exercise C: FSDP's sharding strategies and auto-wrap policies, measured next to the ledger.

    records = dpc.exercises.run_c()                    # 4 ranks, a few seconds per strategy
    dpc.exercises.exercise_c.plot(records)             # memory, bytes per step, CPU time
    dpc.exercises.exercise_c.plot_wrap(records, "none")   # one FSDP unit vs one per block
    dpc.exercises.check_c(records, answers)

FSDP1's FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD (2 x 2) and NO_SHARD, FSDP2's
``reshard_after_forward`` True/False, and FULL_SHARD under the auto-wrap policies "none"
and "size" train the same MLP on real ranks. ``check_c`` derives every expected order from
the theory (the memory ledger for bytes held, ``dpc.train.volume`` for bytes sent), checks
that the measured records follow it, then judges the learner's answers against it.
"""
from __future__ import annotations

import re
import statistics

from .. import models
from ..memory.activations import activation_bytes
from ..memory.ledger import ledger
from .exercise_b import Runs, judge_letters, run_configs
from .report import Report

SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")  # FSDP1, one unit per block
CONFIGS = {
    **{s: dict(strategy="fsdp", sharding_strategy=s) for s in SHARDING},
    "fully_shard": dict(strategy="fully_shard", reshard_after_forward=True),
    "fully_shard (no reshard)": dict(strategy="fully_shard", reshard_after_forward=False),
    "FULL_SHARD, auto_wrap=none": dict(strategy="fsdp", auto_wrap="none"),
    "FULL_SHARD, auto_wrap=size": dict(strategy="fsdp", auto_wrap="size"),
}
WRAPS = {"block": "FULL_SHARD", "none": "FULL_SHARD, auto_wrap=none", "size": "FULL_SHARD, auto_wrap=size"}
TIE = 0.10       # peaks closer than this (relative) are a tie: either order is right
BYTES_TIE = 0.01
SITUATION = {"a": "FULL_SHARD", "b": "SHARD_GRAD_OP (FSDP2: reshard_after_forward=False)",
             "c": "HYBRID_SHARD", "d": "NO_SHARD (or plain DDP)"}
QUESTIONS = {
    "q1": ("64 GPUs in 8 nodes; the model fits when sharded over one node's 8 GPUs, and links "
           "between nodes are much slower than inside a node. Which strategy?", SITUATION, "c"),
    "q2": ("The model, its gradients and Adam's state fit comfortably on every GPU. Which?", SITUATION, "d"),
    "q3": ("The model fits only when parameters, gradients and optimizer state are all split "
           "over every rank. Which?", SITUATION, "a"),
    "q4": ("Sharded gradients and optimizer state fit, with room to keep each unit's full "
           "parameters from forward to backward; you want to save backward's all-gathers. Which?",
           SITUATION, "b"),
    "wrap": ("Why does auto_wrap='none' (one FSDP unit) peak so far above one unit per block?", {
        "a": "The single unit is gathered whole for forward and backward: the full parameters "
             "(and full gradients) exist at once; only what is held between steps is sharded.",
        "b": "Without auto-wrap FSDP falls back to DDP.",
        "c": "One unit means more collectives per step, each with its own buffers.",
        "d": "The optimizer state is not sharded without auto-wrap."}, "a"),
}


def run_c(world_size: int = 4, d_hidden: int = 64, batch_size: int = 8, cluster=None, steps: int = 4) -> Runs:
    """Every configuration of ``CONFIGS`` on ``world_size`` ranks (even, >= 4: HYBRID_SHARD
    runs as (world_size/2) x 2), the MLP of width ``d_hidden``. About a second per run."""
    if world_size < 4 or world_size % 2:
        raise ValueError(f"Exercise C needs an even world_size >= 4 (HYBRID_SHARD: 2 ranks per "
                         f"shard group, >= 2 groups), not {world_size}")
    configs = {k: dict(v) for k, v in CONFIGS.items()}
    configs["HYBRID_SHARD"]["shard_group_size"] = 2
    return run_configs(configs, world_size, {"d_hidden": d_hidden, "depth": 4}, batch_size, steps, cluster)


def one_unit_ledger(records: Runs, strategy: str = "FULL_SHARD"):
    """The ledger for the whole model as a single FSDP unit (``auto_wrap="none"``), rank 0."""
    plain = models.build_model("mlp", **records.model_sizes)
    shapes = [tuple(p.shape) for p in plain.parameters()]
    return ledger(sum(p.numel() for p in plain.parameters()), records.world_size, strategy, "fp32",
                  "adamw", units=[shapes],
                  activation_bytes=activation_bytes("mlp", records.batch_size, **records.model_sizes))


def figures(records: Runs) -> dict:
    """{name: {...}} from rank 0's records (bytes per rank; CPU ms per step): measured
    ``at_rest``, ``peak`` and ``sent`` (logical bytes per step), with the theory of each
    (``ledger_at_rest``, ``ledger_peak``, ``volume``) where the theory models the run."""
    out = {}
    for name, metrics in records.metrics.items():
        rank0 = metrics[0]
        memory, comm = rank0["memory"], rank0["comm"]
        compare = memory["compare"] or {}
        row = {"at_rest": sum(memory["at_rest"].values()), "peak": memory["peak_bytes"],
               "sent": sum(comm["measured"].values()), "volume": sum(comm["theory"].values()),
               "cpu_ms": 1e3 * statistics.median(rank0["step_cpu_s"]),
               "ledger_at_rest": compare.get("total", (None,))[0],
               "ledger_peak": compare.get("peak", (None,))[0]}
        if name == WRAPS["none"]:
            book = one_unit_ledger(records)
            row.update(ledger_at_rest=book.total, ledger_peak=book.peak)
        out[name] = row
    return out


def _order(values: dict, tie: float, reverse: bool = False) -> str:
    """'A < B = C' style text of ``values`` sorted, ties (relative) joined by '='."""
    names = sorted(values, key=values.get, reverse=reverse)
    text = names[0]
    for prev, name in zip(names, names[1:]):
        same = abs(values[name] - values[prev]) <= tie * max(values[name], values[prev])
        text += (" = " if same else (" > " if reverse else " < ")) + name
    return text


def _violations(claimed, values: dict, tie: float, reverse: bool = False) -> list[tuple[str, str]]:
    """Pairs (a, b) with a placed before b in ``claimed`` although theory strictly orders b first."""
    bad = []
    for i, a in enumerate(claimed):
        for b in claimed[i + 1:]:
            if abs(values[a] - values[b]) > tie * max(values[a], values[b]) and \
                    (values[a] > values[b]) != reverse:
                bad.append((a, b))
    return bad


def _judge_records(report: Report, fig: dict) -> None:
    """What the measured records show, each against the theory."""
    modelled = [n for n in fig if fig[n]["ledger_at_rest"] is not None]
    off = [n for n in modelled if fig[n]["at_rest"] != fig[n]["ledger_at_rest"]]
    report.add("measured at rest: every strategy holds exactly what the ledger says", not off,
               f"{off[0]}: {fig[off[0]]['at_rest']} B measured vs {fig[off[0]]['ledger_at_rest']} B" if off
               else f"{len(modelled)} configurations, bytes per rank")
    names = [n for n in fig if fig[n]["ledger_peak"] is not None and n != WRAPS["none"]]
    theory = {n: fig[n]["ledger_peak"] for n in names}
    measured = {n: fig[n]["peak"] for n in names}
    bad = _violations(sorted(names, key=measured.get), theory, TIE)
    but = f"; but measured {bad[0][0]} < {bad[0][1]}" if bad else ""
    report.add("measured peaks follow the ledger's order", not bad, f"ledger: {_order(theory, TIE)}{but}")
    off = [n for n in fig if abs(fig[n]["sent"] - fig[n]["volume"]) > BYTES_TIE * fig[n]["volume"]]
    volume = {n: fig[n]["volume"] for n in SHARDING}
    report.add("bytes per step equal the volume theory", not off,
               f"{off[0]}: {fig[off[0]]['sent']:.0f} B sent vs {fig[off[0]]['volume']:.0f} B" if off
               else f"most first: {_order(volume, BYTES_TIE, reverse=True)}")
    block, one = fig[WRAPS["block"]], fig.get(WRAPS["none"])
    if one is None:
        report.add("one unit (auto_wrap='none') peaks above one unit per block", None, "not in the records")
        return
    ok = one["peak"] > block["peak"] and one["ledger_peak"] > block["ledger_peak"]
    report.add("one unit (auto_wrap='none') peaks above one unit per block", ok,
               f"measured {one['peak']} B vs {block['peak']} B; ledger {one['ledger_peak']} B vs "
               f"{block['ledger_peak']} B")


def _judge_claim(report: Report, title: str, claimed, values: dict, tie: float, reverse: bool) -> None:
    if claimed is ...:
        report.add(title, None, "fill in the `...` with a list of the four names")
        return
    if not isinstance(claimed, (list, tuple)) or sorted(claimed) != sorted(values):
        report.add(title, False, f"list each of {', '.join(SHARDING)} once, not {claimed!r}")
        return
    bad = _violations(list(claimed), values, tie, reverse)
    verb = "sends more" if reverse else "holds less"
    report.add(title, not bad, f"theory: {_order(values, tie, reverse)}" +
               (f"; {bad[0][1]} {verb} than {bad[0][0]}, not the other way round" if bad else ""))


def check_c(records: Runs, answers: dict) -> Report:
    """Check the measured records against the theory, then the learner's ``answers``:
    "peak_order" (the four FSDP1 strategies, smallest peak per rank first), "bytes_order"
    (most bytes sent per step first), letters for "q1".."q4" and "wrap"."""
    report = Report("Exercise C")
    if not isinstance(answers, dict) or all(v is ... for v in answers.values()):
        report.attempted = False
        report.note = "Fill in the `...` of the answers, then run this cell again."
        return report
    fig = figures(records)
    _judge_records(report, fig)
    _judge_claim(report, "your order of peak memory per rank, smallest first", answers.get("peak_order", ...),
                 {n: fig[n]["ledger_peak"] for n in SHARDING}, TIE, reverse=False)
    _judge_claim(report, "your order of bytes sent per step, most first", answers.get("bytes_order", ...),
                 {n: fig[n]["volume"] for n in SHARDING}, BYTES_TIE, reverse=True)
    judge_letters(report, QUESTIONS, answers)
    return report


def plot(records: Runs):
    """Side by side per configuration: bytes held at rest and at peak (measured bars, ledger
    marks), bytes sent per step (measured bars, theory marks), CPU ms per step. Draws only."""
    import matplotlib.pyplot as plt

    fig_data = figures(records)
    names = list(fig_data)
    x = range(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    panels = (("memory per rank (kB)", (("at_rest", "ledger_at_rest"), ("peak", "ledger_peak"))),
              ("bytes sent per step (kB)", (("sent", "volume"),)),
              ("CPU time per step (ms)", (("cpu_ms", None),)))
    for ax, (title, series) in zip(axes, panels):
        width = 0.8 / len(series)
        for i, (key, theory) in enumerate(series):
            pos = [j + (i - (len(series) - 1) / 2) * width for j in x]
            scale = 1 if key == "cpu_ms" else 1e-3
            ax.bar(pos, [fig_data[n][key] * scale for n in names], width, label=key.replace("_", " "))
            marks = [(p, fig_data[n][theory] * scale) for p, n in zip(pos, names)
                     if theory and fig_data[n][theory] is not None]
            if marks:
                ax.scatter(*zip(*marks), marker="_", s=200, color="black", label="theory" if i == 0 else None)
        ax.set_xticks(list(x), names, rotation=60, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"{records.world_size} ranks, MLP {records.model_sizes}, rank 0", fontsize=10)
    fig.tight_layout()
    plt.close(fig)
    return fig


def plot_wrap(records: Runs, auto_wrap: str = "none"):
    """FULL_SHARD with one unit per block next to ``auto_wrap`` ("none" or "size"): bytes at
    rest and at peak per rank, measured (bars) and the ledger's (marks, where it models it)."""
    import matplotlib.pyplot as plt

    if auto_wrap not in WRAPS or WRAPS[auto_wrap] not in records.metrics:
        raise ValueError(f"auto_wrap must be one of {', '.join(WRAPS)} (as run by run_c), not {auto_wrap!r}")
    fig_data = figures(records)
    chosen = ["block"] + ([auto_wrap] if auto_wrap != "block" else [])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, key in enumerate(("at_rest", "peak")):
        pos = [j + (i - 0.5) * 0.4 for j in range(len(chosen))]
        rows = [fig_data[WRAPS[w]] for w in chosen]
        ax.bar(pos, [r[key] / 1e3 for r in rows], 0.4, label=f"{key.replace('_', ' ')} (measured)")
        marks = [(p, r["ledger_" + key] / 1e3) for p, r in zip(pos, rows) if r["ledger_" + key] is not None]
        if marks:
            ax.scatter(*zip(*marks), marker="_", s=300, color="black", label="ledger" if i else None)
    units = [re.search(r"\d+ units?", records[WRAPS[w]][0]["applied"]).group() for w in chosen]
    ax.set_xticks(range(len(chosen)), [f"auto_wrap={w}\n({u})" for w, u in zip(chosen, units)])
    ax.set_ylabel("kB per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig
