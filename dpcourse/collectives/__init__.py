"""Collectives from point-to-point messages, PyTorch's by their definition, and their cost.

    ring_all_reduce(t)                 # like dist.all_reduce(t), built on isend/irecv
    ring_reduce_scatter / ring_all_gather, naive_all_reduce, whole_ring_all_reduce
    fast_ring_all_reduce(t)            # the same ring, pipelined (the benchmark's)
    trace = Trace(); ring_all_reduce(t, trace=trace)   # on each rank; Trace.merge in the kernel
    trace_all_reduce(cluster, numel)   # a traced run on every rank, next to dist.all_reduce
    simulate("ring_all_reduce", world_size, numel)     # the same schedule, no processes
    expected_after("all_gather(parts, t)", before)     # what each rank must hold afterwards
    step_bytes("FULL_SHARD", world_size, model)        # bytes one rank sends per training step

Modules: schedule (who sends what when), trace, ring (the one to read), fast_ring, naive,
cost (the formulas: bus factors, bytes per rank, per training step), alpha_beta (the model
projected to real links), live (every collective's definition).
Bytes a rank really sends are measured by ``dpc.observe.Comm``.
"""
from . import alpha_beta
from .cost import (algbw, bus_factor, busbw, bytes_sent_per_rank, num_steps, ring_all_reduce_busbw,
                   ring_all_reduce_seconds, step_bytes)
from .fast_ring import fast_ring_all_gather, fast_ring_all_reduce, fast_ring_reduce_scatter
from .live import contributions, expected_after
from .naive import naive_all_reduce, whole_ring_all_reduce
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .schedule import ALGORITHMS, algorithm_steps, chunk_bounds, simulate
from .trace import Frame, Trace, Transfer
from .traced import TracedRun, rank_input, trace_all_reduce

__all__ = ["ALGORITHMS", "Frame", "Trace", "TracedRun", "Transfer", "algbw", "algorithm_steps", "alpha_beta",
           "bus_factor", "busbw", "bytes_sent_per_rank", "chunk_bounds", "contributions", "expected_after",
           "fast_ring_all_gather", "fast_ring_all_reduce", "fast_ring_reduce_scatter",
           "naive_all_reduce", "num_steps", "rank_input", "ring_all_gather", "ring_all_reduce",
           "ring_all_reduce_busbw", "ring_all_reduce_seconds", "ring_reduce_scatter", "simulate",
           "step_bytes", "trace_all_reduce", "whole_ring_all_reduce"]
