"""What 4.2b's try-its share; each try-it is a file of its own (``fsdp1``, ``fully_shard``,
``mixed_precision``). 4.2b's try-its: FSDP2, FSDP1 and mixed precision, written by the learner
(checked on the notebook's ranks). 4.2f's DCP and accumulation checkers (``long_runs``) use the
helpers here.

Each checker runs the learner's function on every rank next to a reference computed on the
same rank (one process on the whole global batch, or the saver's own full state), and judges
what happened: the parameters' types, the collectives the ranks issued (seen from outside by
the collective tracker, with their dtypes and the phase, forward or backward, they ran in),
weights, gradients and optimizer state.
"""
from __future__ import annotations


TIMEOUT = 20.0          # seconds for one check's call on the ranks
RTOL, ATOL = 1e-4, 1e-6
