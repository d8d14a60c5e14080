"""Experiment panels for FSDP: DDP vs FSDP by model size, sharding strategies, auto-wrap policy.

    run_strategy_experiment(cluster, ("ddp", "FULL_SHARD"), d_hidden=128)   ddp_vs_fsdp_panel(cluster)
                                                                            sharding_panel(cluster)
    run_auto_wrap_experiment(cluster, ("none", "block"))                    auto_wrap_panel(cluster)

Each configuration trains the course's MLP with ``dpc.train.train`` on the ranks, with the
step timer, the byte meter and the memory probe attached (the hooks the benchmarks use), and
the figure puts memory per rank, bytes per step and time per step side by side. Memory is
what rank 0 holds; bytes are the logical bytes of the collectives PyTorch called on rank 0,
with the ring theory (``dpc.train.volume``) as a black tick.
"""
from __future__ import annotations

import re
import statistics

from ..vocab import TRAIN_OPTIONS
from .panel import Experiment, Panel, new_figure

# Strategies by the ledger's names (HYBRID_SHARD as 2 shard groups), auto-wrap policies with a label.
TRAINED = {**TRAIN_OPTIONS, "HYBRID_SHARD": dict(TRAIN_OPTIONS["HYBRID_SHARD"], shard_group_size=2)}
WRAP_LABELS = {"none": "one unit: the whole model", "block": "one unit per block",
               "size": "a unit per min_num_params parameters"}


def _measure(cluster, cfg) -> dict:
    """Train ``cfg`` on the ranks with timer, byte meter and memory probe; rank 0's figures."""
    from ..memory.probe import MemoryProbe
    from ..train import CommMeter, StepTimer, train
    from ..backends import uses_cuda

    cfg.validate(cluster.world_size, "cuda" if uses_cuda(cluster.backend) else "cpu")  # errors here, not on ranks
    metrics = cluster.run(train, cfg, [StepTimer(), CommMeter(), MemoryProbe()], timeout=240)
    m0, memory, comm = metrics[0], metrics[0]["memory"], metrics[0]["comm"]
    compare = memory.get("compare")
    units = re.search(r"(\d+) units", m0["applied"])
    return {"applied": m0["applied"], "units": int(units.group(1)) if units else 0,
            "at_rest": dict(memory["at_rest"]), "peak_bytes": memory["peak_bytes"],
            "theory_at_rest": None if compare is None else {c: t for c, (t, _) in compare["at_rest"].items()},
            "comm_measured": dict(comm["measured"]), "comm_theory": dict(comm["theory"]),
            "all_gathers": comm["calls"].get("all_gather", 0),
            "step_ms": 1e3 * statistics.median(max(m["step_time_s"][i] for m in metrics)
                                               for i in range(len(m0["step_time_s"]))),
            "losses": m0["losses"]}


def _config(name: str, policy: str | None, d_hidden: int, depth: int, batch_size: int, steps: int, **extra):
    from ..train import TrainConfig

    options = dict(TRAINED[name]) if name in TRAINED else None
    if options is None:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(TRAINED)}")
    if policy is not None:
        options["auto_wrap"] = policy
    return TrainConfig(model="mlp", model_sizes=dict(d_hidden=d_hidden, depth=depth), batch_size=batch_size,
                       steps=steps, num_samples=max(512, 2 * batch_size * 8), progress=False, **options, **extra)


def draw_comparison(rows: dict, title: str, label_units: bool = False):
    """Memory at rest by category plus the transient peak, bytes per step by collective, and
    milliseconds per step, one bar per configuration (rank 0). Returns the Figure."""
    from .memory import CATEGORY_COLORS, LABELS
    from .timeline import KIND_COLORS  # each collective in the colour the timelines give it

    names = list(rows)
    fig = new_figure(9.4, 3.4)  # ~850 px: fits a notebook's width
    mem, comm, time = fig.subplots(1, 3)
    used = set()
    for i, name in enumerate(names):
        row, bottom = rows[name], 0.0
        for cat, value in row["at_rest"].items():
            if value:
                mem.bar(i, value / 1e3, 0.6, bottom=bottom, color=CATEGORY_COLORS[cat],
                        label=None if cat in used else LABELS[cat])
                used.add(cat)
                bottom += value / 1e3
        transient = row["peak_bytes"] / 1e3 - bottom
        mem.bar(i, transient, 0.6, bottom=bottom, color="white", edgecolor="0.4", hatch="//",
                label=None if "peak" in used else "transient at the peak")
        used.add("peak")
        if row["theory_at_rest"]:
            mem.hlines(sum(row["theory_at_rest"].values()) / 1e3, i - 0.4, i + 0.4, colors="k", linestyles="--")
        if label_units:
            mem.annotate(f"{row['units']} unit" + ("" if row["units"] == 1 else "s"), (i, row["peak_bytes"] / 1e3),
                         textcoords="offset points",
                         xytext=(0, 3), ha="center", fontsize=7)
        bottom = 0.0
        for collective, sent in sorted(row["comm_measured"].items()):
            comm.bar(i, sent / 1e3, 0.6, bottom=bottom, color=KIND_COLORS.get(collective, "0.6"),
                     label=None if collective in used else collective.replace("_", "-"))
            used.add(collective)
            bottom += sent / 1e3
        comm.hlines(sum(row["comm_theory"].values()) / 1e3, i - 0.4, i + 0.4, colors="k", lw=2)
        time.bar(i, row["step_ms"], 0.6, color="0.55")
    for ax, what in ((mem, "kB per rank (-- ledger at rest)"), (comm, "kB sent per step (— theory)"),
                     (time, "ms per step (slowest rank, median)")):
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(what, fontsize=9)
        ax.margins(y=0.45)  # room above the bars for the legend
    mem.legend(fontsize=6, loc="upper right")
    comm.legend(fontsize=6, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def run_strategy_experiment(cluster, strategies=("ddp", "FULL_SHARD"), d_hidden: int = 128, depth: int = 4,
                            batch_size: int = 16, steps: int = 5, progress=None) -> Experiment:
    """Each strategy of ``strategies`` (``TRAINED`` names: the ledger's) trains the same MLP of ``depth``
    blocks of width ``d_hidden`` (``batch_size`` samples per rank); memory, bytes, time."""
    if not strategies:
        raise ValueError("choose at least one strategy")
    rows = {}
    for i, name in enumerate(strategies):
        if progress is not None:
            progress(0.05 + 0.85 * i / len(strategies), f"{name}: training {steps} steps, measuring the last...")
        rows[name] = _measure(cluster, _config(name, None, d_hidden, depth, batch_size, steps))
    psi = 4 * sum(p.numel() for p in _model(d_hidden, depth).parameters())
    least = min(rows, key=lambda n: rows[n]["peak_bytes"])
    data = {"rows": rows, "param_bytes": psi,
            "summary": f"Ψ = {psi / 1e3:.0f} kB of fp32 parameters; lowest peak: {least}"}
    title = f"{cluster.world_size} ranks, MLP {depth} x {d_hidden} (Ψ = {psi / 1e3:.0f} kB), batch {batch_size} per rank"
    return Experiment(data, draw_comparison(rows, title))


def _model(d_hidden: int, depth: int):
    from .. import models

    return models.build_model("mlp", d_hidden=d_hidden, depth=depth)


def _ledger_peaks(world_size: int, policies, d_hidden: int, depth: int, batch_size: int) -> dict:
    """The ledger's peak per rank (bytes) for the policies whose units are known without
    wrapping: "block" (one unit per block, the rest in the root) and "none" (all in the root)."""
    from .. import models
    from ..memory import activation_bytes, ledger, unit_shapes

    model = _model(d_hidden, depth)
    n = sum(p.numel() for p in model.parameters())
    acts = activation_bytes("mlp", batch_size, d_hidden=d_hidden, depth=depth)
    units = {"block": unit_shapes(model, models.wrap_classes("mlp")),
             "none": [[tuple(p.shape) for p in model.parameters()]]}
    return {f"auto_wrap={p}": ledger(n, world_size, "FULL_SHARD", "fp32", "adamw", units=units[p],
                                     activation_bytes=acts).peak for p in policies if p in units}


def run_auto_wrap_experiment(cluster, policies=("none", "block", "size"), min_num_params: int = 1000,
                             d_hidden: int = 128, depth: int = 4, batch_size: int = 16,
                             progress=None) -> Experiment:
    """FSDP FULL_SHARD of the same MLP under each auto-wrap policy (``WRAP_LABELS``; "size": a
    unit per ``min_num_params`` parameters): units, all-gathers per step, peak memory (and
    the ledger's, where the units are known beforehand) and bytes per step."""
    rows = {}
    for i, policy in enumerate(policies):
        if progress is not None:
            progress(0.05 + 0.85 * i / len(policies), f"auto_wrap={policy}: training, measuring...")
        cfg = _config("FULL_SHARD", policy, d_hidden, depth, batch_size, 5, min_num_params=min_num_params)
        rows[f"auto_wrap={policy}"] = _measure(cluster, cfg)
    units = {name: row["units"] for name, row in rows.items()}
    data = {"rows": rows, "units": units, "all_gathers": {n: r["all_gathers"] for n, r in rows.items()},
            "ledger_peak": _ledger_peaks(cluster.world_size, policies, d_hidden, depth, batch_size),
            "summary": ", ".join(f"{n}: {u} units, {rows[n]['all_gathers']} all-gathers, peak "
                                 f"{rows[n]['peak_bytes'] / 1e3:.0f} kB" for n, u in units.items())}
    title = f"FSDP FULL_SHARD on {cluster.world_size} ranks, MLP {depth} x {d_hidden}; min_num_params={min_num_params:,}"
    return Experiment(data, draw_comparison(rows, title, label_units=True))


def ddp_vs_fsdp_panel(cluster, widths=(64, 128, 256, 512), depths=(2, 4, 8), batches=(4, 16, 64)) -> Panel:
    """A panel for ``run_strategy_experiment`` with DDP and FULL_SHARD: the model's size, the batch."""
    import ipywidgets as w

    controls = {"d_hidden": w.Dropdown(options=list(widths), value=128, description="d_hidden"),
                "depth": w.Dropdown(options=list(depths), value=4, description="depth"),
                "batch_size": w.Dropdown(options=list(batches), value=16, description="batch/rank")}
    return Panel("DDP vs FSDP FULL_SHARD: model size and batch", run_strategy_experiment, controls, cluster,
                 fixed={"strategies": ("ddp", "FULL_SHARD")})


def sharding_panel(cluster, world_sizes=(2, 4)) -> Panel:
    """A panel for ``run_strategy_experiment``: which strategies, on how many ranks (HYBRID_SHARD
    needs 4: two shard groups of 2)."""
    import ipywidgets as w

    controls = {"world_size": w.Dropdown(options=list(world_sizes), value=cluster.world_size,
                                         description="world_size"),
                "strategies": w.SelectMultiple(options=list(TRAINED), value=("ddp", "SHARD_GRAD_OP", "FULL_SHARD"),
                                               rows=len(TRAINED), description="strategies")}
    return Panel("Sharding strategies: memory, bytes and time per step (ctrl-click: several strategies)",
                 run_strategy_experiment, controls, cluster)


def auto_wrap_panel(cluster) -> Panel:
    """A panel for ``run_auto_wrap_experiment``: the policies and min_num_params."""
    import ipywidgets as w

    controls = {"policies": w.SelectMultiple(options=list(WRAP_LABELS), value=tuple(WRAP_LABELS), rows=3,
                                             description="auto_wrap"),
                "min_num_params": w.Dropdown(options=[1000, 10000, 100000], value=1000, description="min_num_params")}
    return Panel("FSDP auto-wrap policy: units, peak memory, bytes (ctrl-click: several policies)",
                 run_auto_wrap_experiment, controls, cluster)
