"""Measured next to theory: the ledger a measurement should match, and the table of both.

Pure functions on the plain data ``experiment.measure_strategy`` returns from the ranks;
used by the notebook, the benchmark and the tests. All numbers are bytes per rank.
"""
from __future__ import annotations

from .activations import activation_bytes
from .ledger import AT_REST, CATEGORIES, Ledger, ledger
from .sizes import format_bytes


def label(result: dict) -> str:
    """Short name of a measured configuration, e.g. 'ddp (bucket view)', 'fully_shard (keep)'."""
    s, o = result["strategy"], result["options"]
    if s == "ddp":
        name = "ddp (bucket view)" if o.get("gradient_as_bucket_view") else "ddp"
        return name + (" + autocast" if result.get("precision") == "autocast" else "")
    if s == "fully_shard":
        return "fully_shard" if o.get("reshard_after_forward", True) else "fully_shard (no reshard)"
    if s == "HYBRID_SHARD":
        return f"HYBRID_SHARD ({result['world_size'] // o['shard_group_size']}x{o['shard_group_size']})"
    return s


def theory_for(result: dict) -> Ledger:
    """The ledger for exactly what a rank measured (same model units, rank and options)."""
    acts = activation_bytes(result["model"], result["batch_size"], **result["sizes"])
    return ledger(result["num_params"], result["world_size"], result["strategy"],
                  result.get("precision", "fp32"), optimizer=result["optimizer"], units=result["units"], rank=result["rank"],
                  activation_bytes=acts, **result["options"])


def measured_peak(result: dict) -> tuple[int, str]:
    """(largest total in bytes over the recorded step, the phase it happened in)."""
    best = max(result["frames"], key=lambda f: sum(f["peak"].values()))
    return sum(best["peak"].values()), best["phase"]


def compare(result: dict) -> dict:
    """Theory vs measurement for one rank: at-rest categories, totals and peaks (bytes)."""
    theory = theory_for(result)
    row = {"label": label(result), "rank": result["rank"],
           "at_rest": {c: (theory.bytes[c], result["at_rest"].get(c, 0)) for c in AT_REST},
           "total": (theory.total, sum(result["at_rest"].get(c, 0) for c in AT_REST))}
    if result["frames"]:
        peak, phase = measured_peak(result)
        row["peak"] = (theory.peak, peak)
        row["peak_phase"] = (theory.peak_phase, phase)
        row["peak_ratio"] = peak / theory.peak
    return row


def at_rest_matches(result: dict) -> bool:
    """True when every at-rest category measured on the rank equals the theory exactly."""
    return all(t == m for t, m in compare(result)["at_rest"].values())


def table(results, unit: str = "KiB") -> str:
    """A text table, one line per configuration (rank 0 of each), theory / measured."""
    short = {"parameters": "params", "gradients": "grads", "optimizer_state": "optim",
             "bucket_buffers": "buckets"}
    head = f"{'strategy':<26}" + "".join(f"{v:>17}" for v in short.values()) + f"{'total':>17}{'peak':>17}  ratio"
    lines = [f"bytes per rank in {unit}, theory / measured", head]

    def pair(t, m):
        return f"{format_bytes(t, unit, 4).split()[0]}/{format_bytes(m, unit, 4).split()[0]}".rjust(17)

    tools: dict = {}
    for result in results:
        row = compare(result)
        cells = "".join(pair(*row["at_rest"][c]) for c in short)
        peak = pair(*row["peak"]) + f"  {row['peak_ratio']:.3f}" if "peak" in row else ""
        lines.append(f"{row['label']:<26}{cells}{pair(*row['total'])}{peak}")
        if result.get("tool"):
            tools.setdefault(result["tool"], []).append(row["label"])
        if result.get("cuda"):
            lines.append(f"{'':<26}CUDA allocator: {format_bytes(result['cuda']['at_rest'], unit)} "
                         f"allocated at rest, {format_bytes(result['cuda']['peak'], unit)} peak")
    lines.append("measured at rest: unique storages by role (measure.held_bytes); over the step: "
                 + "; ".join(f"{tool} for {', '.join(names)}" for tool, names in sorted(tools.items())))
    return "\n".join(lines)


def ledger_table(books: dict, unit: str = "GB") -> str:
    """Theory only: {name: Ledger} as text, at-rest categories and total per rank in ``unit``."""
    cols = ("parameters", "gradients", "optimizer_state", "master_weights", "bucket_buffers")
    lines = [f"{unit + ' per rank':<13}" + "".join(f"{c.replace('_', ' '):>16}" for c in cols) + f"{'total':>10}"]
    for name, book in books.items():
        cells = "".join(f"{format_bytes(book.bytes[c], unit, 3):>16}" for c in cols)
        lines.append(f"{name:<13}{cells}{format_bytes(book.total, unit, 3):>10}")
    return "\n".join(lines)


__all__ = ["CATEGORIES", "at_rest_matches", "compare", "label", "ledger_table", "measured_peak", "table",
           "theory_for"]
