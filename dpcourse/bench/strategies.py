"""DDP vs each FSDP strategy (and FSDP2) on the same model: speed, memory and bytes per step.

    python -m dpcourse.bench strategies [--world-sizes 2 4] [--rounds 3] [--steps 6]

For each world size, every strategy trains the same MLP on the same data; rounds are
interleaved (strategy A, B, C, then A, B, C again) so machine load hits all alike. The
steady figure is CPU time per step (median over steps >= 2 and rounds): on an
oversubscribed CPU, wall time mostly measures waiting. Peak memory per rank comes from the
memory ledger's measurement of one step; bytes per step are the logical bytes of the c10d
ops PyTorch called and Gloo's wire bytes, next to the ring theory (at the run's dtypes).
The auto-wrap rows show the units' effect (one unit: one all-gather, the whole model gathered
at once; by size: units of at least ``min_num_params``); the bf16 rows FSDP's mixed precision
(gathers in bf16; reductions in bf16, or in fp32 as the common recipe does).
"""
from __future__ import annotations

import statistics

from ..collectives import step_bytes
from ..models import build_model
from ..observe import Comm, Memory, Timeline
from ..pool import Cluster
from ..train import TrainConfig, train
from ..vocab import TRAIN_OPTIONS

HELP = "DDP vs FSDP strategies and FSDP2: CPU time per step, peak memory, bytes per step"

ROWS = {
    "DDP": TRAIN_OPTIONS["ddp"],
    **{f"FSDP1 {s}": TRAIN_OPTIONS[s] for s in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")},
    "FSDP1 HYBRID_SHARD": dict(TRAIN_OPTIONS["HYBRID_SHARD"], shard_group_size=2),
    "FSDP2 reshard": dict(wrapper="fully_shard", reshard_after_forward=True),
    "FSDP2 no reshard": dict(wrapper="fully_shard", reshard_after_forward=False),
    "FSDP2 one unit": dict(wrapper="fully_shard", auto_wrap="none"),
    "FSDP2 units by size": dict(wrapper="fully_shard", auto_wrap="size", min_num_params=50_000),
    "FSDP1 bf16": dict(wrapper="fsdp", mixed_precision="bf16"),
    "FSDP2 bf16": dict(wrapper="fully_shard", mixed_precision="bf16"),
    "FSDP2 bf16, reduce fp32": dict(wrapper="fully_shard", mixed_precision="bf16", reduce_dtype="fp32"),
}


def add_arguments(parser) -> None:
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first 2 are warm-up)")
    parser.add_argument("--d-hidden", type=int, default=256, help="MLP width")


def _kb(x) -> str:
    return f"{x / 1e3:.1f}" if isinstance(x, (int, float)) else "-"  # None, or the wire not measured


def _theory(cfg: TrainConfig, world: int) -> dict | None:
    """``step_bytes`` for a row (None where units are not one per block or precision is mixed)."""
    if cfg.auto_wrap != "block" or cfg.mixed_precision != "fp32":
        return None
    strategy = cfg.ledger_strategy()
    extra = {"shard_group_size": cfg.shard_group_size} if cfg.shard_group_size is not None else {}
    if strategy == "fully_shard":
        extra["reshard_after_forward"] = cfg.reshard_after_forward
    return step_bytes(strategy, world, build_model(cfg.model, **cfg.model_sizes), **extra)


def main(args) -> int:
    sizes = {"d_hidden": args.d_hidden, "depth": 4}
    print(__doc__.split("\n\n")[0].strip())
    for world in args.world_sizes:
        names = [n for n, o in ROWS.items() if world >= 4 or o["wrapper"] != "fsdp"
                 or o.get("sharding_strategy") != "HYBRID_SHARD"]
        cpu, wall, comm, peak = {n: [] for n in names}, {n: [] for n in names}, {}, {}
        with Cluster(world_size=world) as cluster:
            for _ in range(args.rounds):
                for name in names:
                    cfg = TrainConfig(steps=args.steps, batch_size=16, progress=False, model_sizes=sizes,
                                      **ROWS[name])
                    timeline, comm[name], memory = Timeline(), Comm(), Memory()
                    cluster.run(train, cfg, timeout=600, observe=[timeline, comm[name], memory])
                    for i in range(2, args.steps):  # after two warm-up steps; the slowest rank
                        cpu[name].append(max(timeline.step_seconds(r, cpu=True)[i] for r in range(world)))
                        wall[name].append(max(timeline.step_seconds(r)[i] for r in range(world)))
                    peak[name] = max(memory.peak(r)[0] for r in range(world))
        psi = 4 * sum(p.numel() for p in build_model("mlp", **sizes).parameters())
        base = statistics.median(cpu["DDP"])
        print(f"\nworld_size={world}, MLP with {psi / 4:,.0f} parameters (Ψ = {psi / 1e3:.0f} kB fp32), "
              f"{args.rounds} interleaved rounds (the observers add their own time: compare rows, not runs)")
        header = ("setup", "CPU ms/step", "vs DDP", "wall ms/step", "peak kB/rank", "all-gathers",
                  "logical kB sent", "theory kB", "Gloo wire kB")
        rows = []
        for name in names:
            c = comm[name]
            sent = {k: v for k, v in c.bytes(0, -1).items()}
            theory = _theory(TrainConfig(model_sizes=sizes, **ROWS[name]), world)
            med = statistics.median(cpu[name])
            rows.append((name, f"{med * 1e3:.2f}", f"x{med / base:.2f}",
                         f"{statistics.median(wall[name]) * 1e3:.2f}", _kb(peak[name]),
                         str(c.calls(0, -1).get("all_gather", 0)), _kb(sum(sent.values())),
                         _kb(sum(theory.values()) if theory else None), _kb(c.wire(0, -1))))
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        for row in [header] + rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0
