"""The memory ledger: what one rank holds, in theory, by category and moment of the step.

    dpc.memory.ledger(7_500_000_000, 64, "zero3", "mixed").total   # bytes per rank
    dpc.memory.ledger(model, 2, "FULL_SHARD", optimizer="adamw")  # a model: its units too
    dpc.memory.recommend(num_params, world_size, device_bytes)    # the course's rule

What a rank really holds is measured by ``dpc.observe.Memory``; the notebooks and tests put
the two side by side. Modules, whose other names are imported from them: ledger (``Ledger``,
``AT_REST``, ...), layout (units and shards), transients (what a step adds), activations (a
formula for the demo models), fit (what fits: ``fit_table``), choice (the rule: ``plans``, ``recommend``), sizes (``format_bytes``).
"""
from .choice import recommend
# the function, which hides its module here (``from dpcourse.memory.ledger import Ledger`` still finds it)
from .ledger import ledger

__all__ = ["ledger", "recommend"]
