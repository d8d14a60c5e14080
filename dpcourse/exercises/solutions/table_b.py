"""Exercise B, reference solution: the table read off the records, and the two letters.

``records`` is what ``dpc.exercises.run_b`` returned: ``records["ddp"]`` and
``records["fsdp"]`` are lists of per-rank metrics from ``dpc.train.train``, rank 0 first.
"""
import statistics


def fill_table(records) -> dict:
    """Rank 0's figures per strategy: peak MB (10^6 bytes), samples/s, median CPU ms per step."""
    table = {}
    for name in ("ddp", "fsdp"):
        rank0 = records[name][0]
        table[name] = {"peak_mb": rank0["memory"]["peak_bytes"] / 1e6,
                       "samples_per_s": rank0["samples_per_s"],
                       "cpu_ms_per_step": 1000 * statistics.median(rank0["step_cpu_s"])}
    return table


# (b): each rank keeps 1/N of the model states; full parameters only for the unit computing.
# (c): tiny layers on CPU over Gloo: per-unit collectives and hooks cost more than they save.
answers = {"why_less_memory": "b", "why_slower_here": "c"}
