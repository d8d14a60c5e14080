"""The memory ledger: what one rank holds, in theory and measured on real ranks.

    dpc.memory.ledger(7_500_000_000, 64, "zero3", "mixed").total   # bytes per rank
    cluster.run(dpc.memory.experiment.measure_strategy, "FULL_SHARD")  # measured on ranks
    dpc.memory.report.table(results)                                # the two side by side
"""
from . import activations, fit, layout, report, sizes, transients
from .activations import activation_bytes
from .fit import fit_table, recommend
from .layout import transformer_num_params, unit_shapes
from .ledger import AT_REST, CATEGORIES, STRATEGIES, TRANSIENT, Ledger, LedgerError, ledger
from .sizes import format_bytes, in_unit

__all__ = ["AT_REST", "CATEGORIES", "STRATEGIES", "TRANSIENT", "Ledger", "LedgerError",
           "activation_bytes",
           "fit_table", "format_bytes", "in_unit", "ledger", "recommend", "transformer_num_params",
           "unit_shapes"]
