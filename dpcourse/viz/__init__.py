"""Drawings of the course. Pure: they draw results and traces, and never start processes.

The exceptions are the experiment panels (``panel``, ``panels_ddp``, ``panels_fsdp``): widgets
that run a real experiment on the ranks when their Run button is pressed, and may start a
cluster of another world size for it; and ``cluster_status``, which reads a cluster's state.
"""
from .collectives import draw_collective, draw_collectives
from .colors import rank_color
from .panel import Experiment, Panel
from .panels_ddp import (bucket_panel, bucket_sweep_panel, ddp_panel, run_bucket_experiment, run_bucket_sweep,
                         run_ddp_experiment)
from .panels_fsdp import (auto_wrap_panel, ddp_vs_fsdp_panel, run_auto_wrap_experiment, run_strategy_experiment,
                          sharding_panel)
from .ring import RingPlayer, draw_frame, plot_ring_trace, render_frame_png
from .status import cluster_status
