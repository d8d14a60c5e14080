"""Drawings of the course. Pure: they draw results and traces, and never start processes.

The exceptions are ``Panel`` (a widget that runs a notebook's experiment on the ranks when its
Run button is pressed, and may start a cluster of another world size for it), the players
that record a new trace on request (``RingPlayer``), and ``cluster_status``, which reads a
cluster's state.
"""
from .calculator import MemoryCalculator
from .collectives import draw_collectives
from .memory import plot_memory
from .panel import Panel
from .ring import RingPlayer, plot_ring_trace
from .status import cluster_status
from .timeline import draw_bucket_sweep, draw_timeline

__all__ = ["MemoryCalculator", "Panel", "RingPlayer", "cluster_status", "draw_bucket_sweep", "draw_collectives",
           "draw_timeline", "plot_memory", "plot_ring_trace"]
