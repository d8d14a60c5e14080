"""DDP vs FSDP on one real step: the same model and batch under each strategy, side by side.

    records = {name: cluster.run(compare.measure_step, name)[0] for name in compare.STEP_RUNS}
    print(compare.format_rows(compare.bytes_rows(records)))

Each run trains the same seeded MLP on the same global batches (``measure_step``, on every
rank) with two step hooks: ``CommMeter`` (bytes of the last step, by collective and by process
group, logical and on Gloo's wire) and ``StepTimer`` (samples per second). The rest is pure
arithmetic on those records, for the notebook's tables:

  ring_formula      the closed forms a learner derives by hand: DDP 2(N-1)/N Ψ, FULL_SHARD
                    (3Ψ - root)(N-1)/N, HYBRID_SHARD's bytes inside and across shard groups
  fsdp_over_ddp     FULL_SHARD / DDP: 1.5 - root/2Ψ logically, 2 - root/2Ψ on Gloo's wire
  selection_rows    the "Choosing a strategy" table from ledgers, these records, line counts
                    of the course's scripts and the model sizes ``recommend`` gives each strategy

Ψ is the model's parameter bytes; the root unit (the parameters outside every wrapped block)
stays gathered from forward into backward, so FSDP gathers it once, not twice.
"""
from __future__ import annotations

import ast
import difflib
import io
import tokenize
from dataclasses import dataclass, field

from ..vocab import TRAIN_OPTIONS
from .config import TrainConfig
from .hooks import StepTimer
from .measure import CommMeter

# The compared runs (vocabulary names); HYBRID_SHARD needs world_size = 2 x shard_group_size.
STEP_RUNS = {
    "DDP": TRAIN_OPTIONS["ddp"],
    "SHARD_GRAD_OP": TRAIN_OPTIONS["SHARD_GRAD_OP"],
    "FULL_SHARD": TRAIN_OPTIONS["FULL_SHARD"],
    "HYBRID_SHARD": dict(TRAIN_OPTIONS["HYBRID_SHARD"], shard_group_size=2),
    "fully_shard": TRAIN_OPTIONS["fully_shard"],
}
COMMON = dict(model="mlp", optimizer="adamw", steps=6, batch_size=8, num_samples=256, progress=False)
# What each strategy sends per step in the textbook's round numbers (x Ψ, ignoring (N-1)/N).
TEXTBOOK_PSI = {"DDP": 2, "SHARD_GRAD_OP": 2, "FULL_SHARD": 3, "HYBRID_SHARD": 3, "fully_shard": 3}


@dataclass
class StepRecord:
    """One rank's view of one strategy's run: bytes of its last step (logical by collective
    and by process group; Gloo's wire), the ring theory, and time per step."""

    name: str
    rank: int
    world_size: int
    shard_group_size: int | None
    optimizer: str
    num_params: int            # elements
    param_bytes: int           # Ψ, fp32
    root_bytes: int            # parameters of the root unit (FSDP), bytes
    measured: dict             # collective -> bytes this rank sent (logical)
    theory: dict               # collective -> bytes, ``volume.step_bytes``
    by_group: dict             # process group's ranks -> {collective: bytes}
    wire: int | None           # bytes written to Gloo's sockets (None off Linux)
    wire_theory: float         # ``volume.gloo_wire_bytes(theory)``
    samples_per_s: float       # global samples per second at the median step
    losses: list = field(default_factory=list)

    @property
    def logical(self) -> int:
        """Bytes this rank sent in the step, all collectives (logical)."""
        return sum(self.measured.values())

    @property
    def ledger_args(self) -> tuple[str, dict]:
        """(strategy, options) of ``dpc.memory.ledger`` for this run."""
        if self.name == "DDP":
            return "ddp", {}
        if self.name == "HYBRID_SHARD":
            return "HYBRID_SHARD", {"shard_group_size": self.shard_group_size}
        return self.name, {}


def measure_step(name: str, **options) -> StepRecord:
    """On every rank: train ``STEP_RUNS[name]`` (plus ``options``) and return this rank's record."""
    import torch.distributed as dist

    from .runner import train

    if name not in STEP_RUNS:
        raise ValueError(f"unknown run {name!r}; choose one of {', '.join(STEP_RUNS)}")
    cfg = TrainConfig(**{**COMMON, **STEP_RUNS[name], **options})
    metrics = train(cfg, [StepTimer(), CommMeter()])
    comm = metrics["comm"]
    return StepRecord(name, dist.get_rank(), dist.get_world_size(), cfg.shard_group_size, cfg.optimizer,
                      comm["param_bytes"] // 4, comm["param_bytes"], comm["root_bytes"],
                      comm["measured"], comm["theory"], comm["by_group"], comm["wire"],
                      comm["gloo_wire_theory"], metrics["samples_per_s"], metrics["losses"])


def ring_formula(name: str, psi: float, root: float, world_size: int,
                 shard_group_size: int | None = None) -> dict[str, float]:
    """Bytes one rank sends per step in closed form, by where they travel (bytes).

    "world" for the strategies that use one group; HYBRID_SHARD (F ranks per shard group,
    R = N/F groups): "inside" its shard group, FULL_SHARD over F, and "across" groups, an
    all-reduce of the rank's Ψ/F shard over R.
    """
    n = world_size
    if name in ("DDP", "SHARD_GRAD_OP"):  # all_reduce = all_gather + reduce_scatter
        return {"world": 2 * (n - 1) / n * psi}
    if name in ("FULL_SHARD", "fully_shard"):  # gather twice (the root once), reduce-scatter once
        return {"world": (3 * psi - root) * (n - 1) / n}
    if name == "HYBRID_SHARD":
        f = shard_group_size
        r = n // f
        return {"inside": (3 * psi - root) * (f - 1) / f, "across": 2 * (r - 1) / r * psi / f}
    raise ValueError(f"no formula for {name!r}; choose one of {', '.join(STEP_RUNS)}")


def fsdp_over_ddp(psi: float, root: float) -> tuple[float, float]:
    """FULL_SHARD's bytes over DDP's (logical, Gloo's wire), same N: every (N-1)/N cancels.

    Logical: (2Ψ - root + Ψ) / 2Ψ = 1.5 - root/2Ψ. Gloo's reduce_scatter sends what an
    all_reduce sends (2Ψ), so on its wire: (2Ψ - root + 2Ψ) / 2Ψ = 2 - root/2Ψ.
    """
    return 1.5 - root / (2 * psi), 2.0 - root / (2 * psi)


def split_by_group(record: StepRecord) -> dict[str, int]:
    """The record's logical bytes by where they went: "inside" its shard group, "across"
    groups (HYBRID_SHARD), or "world" (one group of every rank); bytes."""
    out: dict[str, int] = {}
    for ranks, sent in record.by_group.items():
        if ranks is None or len(ranks) == record.world_size:
            where = "world"
        else:
            f = record.shard_group_size
            start = record.rank // f * f
            where = "inside" if tuple(ranks) == tuple(range(start, start + f)) else "across"
        out[where] = out.get(where, 0) + sum(sent.values())
    return out


def bytes_rows(records: dict) -> list[dict]:
    """One row per strategy: bytes per step by collective (kB), next to the ring formula,
    the textbook's kΨ and DDP's bytes (ratios), logical and on Gloo's wire."""
    ddp = records["DDP"]
    rows = []
    for name, r in records.items():
        formula = sum(ring_formula(name, r.param_bytes, r.root_bytes, r.world_size, r.shard_group_size).values())
        row = {"strategy": name}
        for collective in ("all_gather", "reduce_scatter", "all_reduce"):
            row[f"{collective} kB"] = round(r.measured.get(collective, 0) / 1e3, 1)
        row.update({"logical kB": round(r.logical / 1e3, 1), "ring formula kB": round(formula / 1e3, 1),
                    "textbook": f"{TEXTBOOK_PSI[name]}Ψ", "x Ψ": round(r.logical / r.param_bytes, 3),
                    "x DDP": round(r.logical / ddp.logical, 3),
                    "Gloo wire kB": None if r.wire is None else round(r.wire / 1e3, 1),
                    "wire x DDP": None if r.wire is None else round(r.wire / ddp.wire, 3)})
        rows.append(row)
    return rows


def code_lines(source: str) -> list[str]:
    """The lines of Python ``source`` that are code: no blank lines, comments or docstrings."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    comments = {tok.start[0]: tok.start[1] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    lines = []
    for number, line in enumerate(source.splitlines(), start=1):
        text = (line[:comments[number]] if number in comments else line).strip()
        if text and number not in docstrings:
            lines.append(text)
    return lines


def lines_added(base: str, changed: str) -> int:
    """Code lines of ``changed`` that are new or different from ``base`` (Python sources)."""
    old, new = code_lines(base), code_lines(changed)
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    return sum(j2 - j1 for tag, _, _, j1, j2 in matcher.get_opcodes() if tag in ("replace", "insert"))


def scale_ranges(picks: dict) -> dict[str, tuple[int, int]]:
    """{strategy: (smallest, largest) num_params} from {num_params: strategy ``recommend`` chose}."""
    out: dict[str, tuple[int, int]] = {}
    for size, strategy in sorted(picks.items()):
        low, high = out.get(strategy, (size, size))
        out[strategy] = (min(low, size), max(high, size))
    return out


def scale_text(ranges_by_world: dict) -> dict[str, str]:
    """{strategy: "1-4B params on 8 ranks; ..."} from {world_size: ``scale_ranges`` result}."""
    out: dict[str, list[str]] = {}
    for world, ranges in ranges_by_world.items():
        for strategy, (low, high) in ranges.items():
            span = f"{low / 1e9:g}B" if low == high else f"{low / 1e9:g}-{high / 1e9:g}B"
            out.setdefault(strategy, []).append(f"{span} on {world}")
    return {strategy: "; ".join(parts) for strategy, parts in out.items()}


# Things that can go wrong, each reproduced in this course (4.2 "Common pitfalls" and FSDP sections).
WHAT_CAN_GO_WRONG = {
    "DDP": ("no sampler.set_epoch", "saving the wrapper, not model.module", "unused parameters"),
    "FSDP": ("different initial weights (FSDP does not broadcast)", "optimizer built before sharding",
             "torch.save of a sharded state dict", "one unit for the whole model (no saving at peak)"),
    "HYBRID_SHARD": ("a mesh whose shard axis is not one node",),
}


def selection_rows(records: dict, books: dict, lines: dict, scale: dict) -> list[dict]:
    """The "Choosing a strategy" table, one row per strategy.

    records: ``measure_step`` results; books: {name: ``dpc.memory.ledger`` of that run} (per
    rank, bytes); lines: {name: code lines a learner adds to one-device training}; scale:
    {ledger strategy: text of the model sizes ``recommend`` picks it for}.
    """
    rows = []
    for name, r in records.items():
        wrong = WHAT_CAN_GO_WRONG["DDP" if name == "DDP" else "FSDP"]
        if name == "HYBRID_SHARD":
            wrong = wrong + WHAT_CAN_GO_WRONG["HYBRID_SHARD"]
        strategy = "FULL_SHARD" if name == "fully_shard" else r.ledger_args[0]  # FSDP2's FULL_SHARD
        rows.append({"strategy": name, "at rest kB/rank": round(books[name].total / 1e3, 1),
                     "peak kB/rank": round(books[name].peak / 1e3, 1), "bytes x DDP": round(
                         r.logical / records["DDP"].logical, 2), "lines added": lines.get(name, "-"),
                     "can go wrong": len(wrong), "suits": scale.get(strategy, "-")})
    return rows


def format_rows(rows: list[dict]) -> str:
    """Rows of dicts as an aligned text table (one header line; None shows as "-")."""
    header = list(rows[0])
    cells = [header] + [["-" if row[k] is None else str(row[k]) for k in header] for row in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)
