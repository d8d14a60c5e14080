"""The memory ledger: what one rank holds, in theory, by category and moment of the step.

    dpc.memory.ledger(7_500_000_000, 64, "zero3", "mixed").total   # bytes per rank
    dpc.memory.ledger(model, 2, "FULL_SHARD", optimizer="adamw")  # a model: its units too
    dpc.memory.recommend(num_params, world_size, device_bytes)    # the course's rule

What a rank really holds is measured by ``dpc.observe.Memory``; the notebooks and tests put
the two side by side. Modules: ledger, layout (units and shards), transients (what a step
adds), activations (a formula for the demo models), fit (what fits, the rule), sizes.
"""
from . import activations, fit, layout, sizes, transients
from .activations import activation_bytes
from .fit import fit_table, recommend
from .layout import transformer_num_params
from .ledger import AT_REST, CATEGORIES, STRATEGIES, TRANSIENT, Ledger, LedgerError, ledger
from .sizes import format_bytes, in_unit

__all__ = ["AT_REST", "CATEGORIES", "STRATEGIES", "TRANSIENT", "Ledger", "LedgerError", "activation_bytes",
           "fit_table", "format_bytes", "in_unit", "ledger", "recommend", "transformer_num_params"]
