"""Exercise B: DDP next to FSDP FULL_SHARD on 2-4 ranks; the learner reads the figures off.

    records = dpc.exercises.run_b(world_size=2, d_hidden=128, batch_size=16)
    dpc.exercises.exercise_b.plot(records)                   # memory, throughput, CPU time
    dpc.exercises.check_b(records, table, answers)           # is each figure consistent?

``run_b`` trains the course's MLP with ``dpc.train.train`` under both strategies on real
ranks, with the step timer, byte meter and memory probe attached. The learner copies into
``table`` each strategy's peak memory (MB = 10^6 bytes), throughput (samples/s) and CPU
time per step (ms), all for rank 0, and answers two questions. ``check_b`` re-derives every
figure from the records (it never re-measures) and names each one that does not match.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..memory.probe import MemoryProbe
from ..train import CommMeter, StepTimer, TrainConfig, train
from .ranks import clusters_for
from .report import Report

RUNS = {"ddp": dict(strategy="ddp"),
              "fsdp": dict(strategy="fsdp", sharding_strategy="FULL_SHARD")}
LABELS = {"ddp": "DDP", "fsdp": "FSDP FULL_SHARD"}
FIGURES = {"peak_mb": "peak memory (MB)", "samples_per_s": "throughput (samples/s)",
           "cpu_ms_per_step": "CPU time per step (ms)"}
TOLERANCE = {"peak_mb": 0.05, "samples_per_s": 0.20, "cpu_ms_per_step": 0.20}  # relative
STEPS, DEPTH = 6, 4  # steps per run (the last is measured for memory and bytes, not timed)
QUESTIONS = {
    "why_less_memory": ("Why does FSDP FULL_SHARD hold less memory per rank than DDP?", {
        "a": "It compresses the gradients before communicating them.",
        "b": "Between steps each rank keeps only 1/N of the parameters, gradients and optimizer "
             "state; a unit's full parameters exist only while that unit computes.",
        "c": "It recomputes activations in backward instead of storing them.",
        "d": "Only rank 0 keeps the optimizer state."}, "b"),
    "why_slower_here": ("Why is FSDP slower than DDP on this machine?", {
        "a": "FSDP does more floating-point operations per sample than DDP.",
        "b": "The sharded optimizer step costs more than the full one.",
        "c": "The layers are tiny and the CPU ranks talk over Gloo: each unit's all-gather and "
             "reduce-scatter is a separate small collective with a fixed latency, plus per-unit "
             "hook overhead and more bytes than DDP, and there is little compute to hide it behind.",
        "d": "FSDP trains a larger model than DDP."}, "c"),
}


@dataclass
class Runs:
    """Real training runs on one cluster: ``metrics[name]`` is the list of per-rank metrics
    ``dpc.train.train`` returned (rank order) for ``configs[name]`` (TrainConfig options)."""

    world_size: int
    model_sizes: dict
    batch_size: int
    steps: int
    configs: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> list:
        return self.metrics[name]

    def __repr__(self) -> str:
        return (f"Runs({', '.join(self.metrics)} on {self.world_size} ranks, MLP {self.model_sizes}, "
                f"batch_size={self.batch_size} per rank, {self.steps} steps)")


def run_configs(configs: dict, world_size: int, model_sizes: dict, batch_size: int, steps: int,
                cluster=None, timeout: float = 300.0) -> Runs:
    """Train every ``configs`` entry with ``dpc.train.train`` on ``world_size`` ranks, measured.

    cluster: a ``dpc.Cluster`` of that size to use; otherwise one is started and shut down.
    timeout: seconds per run.
    """
    if not 2 <= world_size <= 8:
        raise ValueError(f"world_size must be between 2 and 8 ranks, not {world_size}")
    if cluster is not None and cluster.world_size != world_size:
        raise ValueError(f"the cluster has {cluster.world_size} ranks, not world_size={world_size}")
    runs = Runs(world_size, dict(model_sizes), batch_size, steps)
    num_samples = max(512, 2 * batch_size * world_size * steps)  # every step sees fresh samples
    with clusters_for(cluster, [world_size]) as clusters:
        for name, options in configs.items():
            cfg = TrainConfig(steps=steps, batch_size=batch_size, num_samples=num_samples,
                              progress=False, model_sizes=dict(model_sizes), **options)
            hooks = [StepTimer(), CommMeter(), MemoryProbe()]
            runs.configs[name] = dict(options)
            runs.metrics[name] = clusters[world_size].run(train, cfg, hooks, timeout=timeout)
    return runs


def run_b(world_size: int = 2, d_hidden: int = 128, batch_size: int = 16, cluster=None,
          steps: int = STEPS) -> Runs:
    """DDP and FSDP FULL_SHARD on ``world_size`` (2-4) ranks: the MLP of width ``d_hidden``,
    ``batch_size`` samples per rank per step. Takes a few seconds per run."""
    if not 2 <= world_size <= 4:
        raise ValueError(f"Exercise B runs on 2 to 4 ranks, not world_size={world_size}")
    return run_configs(RUNS, world_size, {"d_hidden": d_hidden, "depth": DEPTH},
                       batch_size, steps, cluster)


def figures(records: Runs) -> dict:
    """{strategy: {figure: value}} re-derived from rank 0's records: peak MB (10^6 bytes),
    samples/s, median CPU ms per step; plus the ledger's peak in MB as ``ledger_peak_mb``."""
    out = {}
    for name in RUNS:
        rank0 = records[name][0]
        memory = rank0["memory"] or {}
        compare = memory.get("compare") or {}
        out[name] = {"peak_mb": memory.get("peak_bytes", 0) / 1e6,
                     "samples_per_s": rank0["samples_per_s"],
                     "cpu_ms_per_step": 1e3 * statistics.median(rank0["step_cpu_s"]),
                     "ledger_peak_mb": compare["peak"][0] / 1e6 if "peak" in compare else None}
    return out


def _close(value, want: float, tol: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        abs(value - want) <= tol * abs(want)


def _judge_figure(report: Report, table: dict, derived: dict, name: str, key: str) -> None:
    title = f"{LABELS[name]}: {FIGURES[key]}"
    row = table.get(name) if isinstance(table, dict) else None
    value = row.get(key, ...) if isinstance(row, dict) else ...
    want, tol = derived[name][key], TOLERANCE[key]
    if value is ...:
        report.add(title, None, "fill in the `...`")
        return
    if _close(value, want, tol):
        extra = f"; the ledger predicts {derived[name]['ledger_peak_mb']:.3f} MB" \
            if key == "peak_mb" and derived[name]["ledger_peak_mb"] else ""
        report.add(title, True, f"{value:g} (records: {want:.4g}{extra})")
        return
    detail = f"you wrote {value!r}; rank 0's records give {want:.4g} (within {tol:.0%})"
    other = next(n for n in RUNS if n != name)
    if _close(value, derived[other][key], tol):
        detail += f" -- that is {LABELS[other]}'s figure: are the two swapped?"
    elif isinstance(value, (int, float)) and value and want:
        detail += f" -- off by a factor {value / want:.2g}"
    report.add(title, False, detail)


def judge_letters(report: Report, questions: dict, answers: dict) -> None:
    """One item per question: the learner's letter against the right one."""
    for key, (question, options, right) in questions.items():
        given = answers.get(key, ...) if isinstance(answers, dict) else ...
        if given is ...:
            report.add(question, None, "fill in the `...` with a letter")
            continue
        letter = str(given).strip().lower()
        if letter not in options:
            report.add(question, False, f"{given!r} is not one of {', '.join(options)}")
        elif letter == right:
            report.add(question, True, f"({letter}) {options[letter]}")
        else:
            report.add(question, False, f"({letter}) is not it: {options[letter]}")


def _untouched(table, answers) -> bool:
    """True when every value of the starter's table and answers is still ``...``."""
    rows = table.values() if isinstance(table, dict) else [{"": table}]
    values = [v for row in rows for v in (row.values() if isinstance(row, dict) else [row])]
    return all(v is ... for v in values + list(answers.values() if isinstance(answers, dict) else [answers]))


def check_b(records: Runs, table: dict, answers: dict) -> Report:
    """Say which of the learner's figures and answers are consistent with ``records``.

    table: {"ddp"|"fsdp": {"peak_mb", "samples_per_s", "cpu_ms_per_step"}}, rank 0's figures;
    answers: {"why_less_memory": letter, "why_slower_here": letter}. Memory within 5 %,
    speed within 20 % (timings vary from run to run; the records are the reference).
    """
    report = Report("Exercise B")
    if _untouched(table, answers):
        report.attempted = False
        report.note = "Fill in the `...` of the table and the answers, then run this cell again."
        return report
    derived = figures(records)
    for key in FIGURES:
        for name in RUNS:
            _judge_figure(report, table, derived, name, key)
    judge_letters(report, QUESTIONS, answers)
    return report


def plot(records: Runs):
    """Bars per strategy: peak memory per rank (with the ledger's prediction), throughput and
    CPU time per step, from ``records`` (draws only; starts nothing). Returns the Figure."""
    import matplotlib.pyplot as plt

    derived = figures(records)
    names = list(RUNS)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, key in zip(axes, FIGURES):
        ax.bar([LABELS[n] for n in names], [derived[n][key] for n in names], color=["#4c72b0", "#dd8452"])
        ax.set_title(FIGURES[key], fontsize=10)
    ledger = [derived[n]["ledger_peak_mb"] for n in names]
    if all(v is not None for v in ledger):
        axes[0].scatter(range(len(names)), ledger, marker="_", s=900, color="black", label="ledger")
        axes[0].legend(fontsize=8)
    fig.suptitle(f"{records.world_size} ranks, MLP d_hidden={records.model_sizes['d_hidden']}, "
                 f"batch {records.batch_size} per rank (rank 0)", fontsize=10)
    fig.tight_layout()
    plt.close(fig)
    return fig


class Choice:
    """Sliders for world size, ``d_hidden`` and ``batch_size``, starting at the given values;
    ``chosen()`` gives what they show now as ``run_b``'s keyword arguments."""

    def __init__(self, world_size: int = 2, d_hidden: int = 128, batch_size: int = 16):
        import ipywidgets as w

        self.sliders = {
            "world_size": w.IntSlider(world_size, min=2, max=4, description="world_size"),
            "d_hidden": w.IntSlider(d_hidden, min=32, max=512, step=32, description="d_hidden"),
            "batch_size": w.IntSlider(batch_size, min=4, max=64, step=4, description="batch_size")}
        self.box = w.VBox(list(self.sliders.values()))

    def chosen(self) -> dict:
        return {name: s.value for name, s in self.sliders.items()}

    def _repr_mimebundle_(self, **kwargs):
        return self.box._repr_mimebundle_(**kwargs)


def print_questions(questions: dict = QUESTIONS) -> None:
    """Print each question under the key its answer goes in, with its lettered options."""
    for key, (question, options, _) in questions.items():
        print(f"{key}: {question}")
        for letter, text in options.items():
            print(f"   ({letter}) {text}")
        print()
