"""The alpha-beta model of a ring all-reduce, measured on the ranks and fitted in the kernel.

    times = cluster.run(dpc.collectives.alpha_beta.time_all_reduce, sizes)[0]   # on every rank
    alpha, beta = dpc.collectives.alpha_beta.fit_alpha_beta(times, cluster.world_size)

A ring all-reduce of n bytes over N ranks is 2(N-1) messages of n/N bytes, each costing
alpha + (n/N)/beta (``cost.ring_all_reduce_seconds``): a straight line in n whose intercept
gives alpha (seconds per message) and whose slope gives beta (bytes/s).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def time_all_reduce(sizes_bytes, repeats: int = 20) -> dict:
    """On every rank together: median seconds of a float32 all-reduce per size (bytes)."""
    out = {}
    for nbytes in sizes_bytes:
        t = torch.ones(max(1, nbytes // 4))
        dist.barrier()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - start)
        out[nbytes] = statistics.median(samples)
    return out


def fit_alpha_beta(seconds_by_bytes: dict, world_size: int) -> tuple[float, float]:
    """(alpha in seconds per message, beta in bytes/s) of the ring model, least squares.

    The ring all-reduce of n bytes takes 2(N-1) alpha + 2(N-1)/N n / beta: a straight line
    in n, whose intercept and slope give alpha and beta.
    """
    if world_size < 2:
        raise ValueError("the alpha-beta fit needs world_size >= 2 (one rank sends nothing)")
    xs, ys = zip(*sorted(seconds_by_bytes.items()))
    if len(xs) < 2:
        raise ValueError("fit_alpha_beta needs times for at least two message sizes")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        raise ValueError("larger messages did not take longer in these timings, so they say nothing "
                         "about bandwidth (noise from other processes?); time more repeats over sizes "
                         "further apart, e.g. 4 KiB to 4 MiB")
    intercept = my - slope * mx
    steps = 2 * (world_size - 1)
    return max(intercept, 0.0) / steps, steps / world_size / slope
