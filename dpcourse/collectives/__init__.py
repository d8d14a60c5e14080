"""Collectives from point-to-point messages, and PyTorch's own, measured and shown live.

    ring_all_reduce(t)                 # like dist.all_reduce(t), built on isend/irecv
    ring_reduce_scatter / ring_all_gather, naive_all_reduce, whole_ring_all_reduce
    fast_ring_all_reduce(t)            # the same ring, pipelined (the benchmark's)
    trace = Trace(); ring_all_reduce(t, trace=trace)   # on each rank; Trace.merge in the kernel
    simulate("ring_all_reduce", world_size, numel)     # the same schedule, no processes
    measure_bytes_sent(fn)             # on a rank: logical (c10d ops) and wire bytes
    expected_after("all_gather(parts, t)", before)     # what each rank must hold afterwards
    alpha_beta.fit_alpha_beta(cluster.run(alpha_beta.time_all_reduce, sizes)[0], n)

Modules: schedule (who sends what when), trace, ring (the one to read), fast_ring,
naive, cost (formulas), alpha_beta (the model fitted to timings), meter, live.
"""
from . import alpha_beta
from .alpha_beta import fit_alpha_beta
from .cost import (algbw, bus_factor, busbw, bytes_sent_per_rank, num_steps, step_bytes,
                   ring_all_reduce_busbw, ring_all_reduce_seconds)
from .fast_ring import fast_ring_all_gather, fast_ring_all_reduce, fast_ring_reduce_scatter
from .live import contributions, expected_after
from .meter import BytesSent, C10dMeter, CommRecord, measure_bytes_sent, wire_bytes_written
from .naive import naive_all_reduce, whole_ring_all_reduce
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .schedule import ALGORITHMS, algorithm_steps, chunk_bounds, simulate
from .trace import Frame, Trace, Transfer
from .traced import TracedRun, rank_input, trace_all_reduce
