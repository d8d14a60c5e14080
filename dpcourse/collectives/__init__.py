"""Collectives from point-to-point messages, PyTorch's by their definition, and their cost.

    dpc.collectives.ring.ring_all_reduce(t)   # the module to read: like dist.all_reduce(t), on isend/irecv
    dpc.collectives.trace_all_reduce(cluster, numel)   # a traced run on every rank, next to dist.all_reduce
    dpc.collectives.step_bytes("FULL_SHARD", world_size, model)   # bytes one rank sends per training step
    dpc.collectives.alpha_beta         # the alpha-beta model projected onto named interconnects

Everything else is imported from its module: schedule (who sends what when: ``simulate``,
``chunk_bounds``), trace (``Trace``: ``ring_all_reduce(t, trace=trace)`` on each rank,
``Trace.merge`` in the kernel), fast_ring (the same ring, pipelined: the benchmark's), naive
(``naive_all_reduce``, ``whole_ring_all_reduce``), cost (the formulas: bus factors, bytes per
rank, per training step), live (every collective's definition: ``expected_after``), traced.
Bytes a rank really sends are measured by ``dpc.observe.Comm``.
"""
from . import alpha_beta, ring
from .cost import step_bytes
from .traced import trace_all_reduce

__all__ = ["alpha_beta", "ring", "step_bytes", "trace_all_reduce"]
