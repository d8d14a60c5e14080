"""Drawings of the course. Pure: they draw results and traces, and never start processes."""
from .collectives import draw_collective, draw_collectives
from .colors import rank_color
from .ring import RingPlayer, draw_frame, plot_ring_trace, render_frame_png
