"""``cluster_status(cluster)``: a small widget that says what a cluster's ranks are doing.

    dpc.viz.cluster_status(cluster)     # backend, world size, and per rank: pid, device, state

It reads ``cluster.status()``, which never calls the ranks, so it works while they are
busy, after a failure and after ``shutdown``. It refreshes when its button is pressed (no
timer: a timer thread in the kernel could outlive the widget).
"""
from __future__ import annotations

import html

from .colors import rank_color

_PAD = "padding:1px 10px 1px 0"
STATE_COLORS = {"idle": "#2ca02c", "busy": "#ff7f0e", "dead": "#d62728", "closed": "#7f7f7f"}


def _swatch(color: str) -> str:
    """A square of ``color`` before a word in the theme's text colour: the rank and state
    colours (tab10) are marks, not text colours -- orange text on a light theme reads at 2.5:1."""
    return (f"<span style='display:inline-block;width:0.7em;height:0.7em;background:{color};"
            "margin-right:0.35em;vertical-align:baseline'></span>")


def status_html(status) -> str:
    """The table the widget shows, as HTML, from a ``ClusterStatus``."""
    head = (f"<b>Cluster</b>: {status.world_size} ranks, backend <code>{html.escape(status.backend)}</code>, "
            + (f"{_swatch(STATE_COLORS['closed'])}<b>shut down</b>" if status.closed else
               f"{len(status.alive)} of {status.world_size} alive")
            + (f", a call running for {status.busy_s:.1f} s" if status.busy_s is not None else "")
            + f", {status.calls} calls so far")
    rows = []
    for r in status.ranks:
        failed = (f"failed in the last call: {html.escape(r.failed_last)}" if r.failed_last else "")
        rows.append(
            f"<tr><td style='{_PAD}'>{_swatch(rank_color(r.rank))}<b>rank {r.rank}</b></td>"
            f"<td style='{_PAD}'>{r.pid if r.pid is not None else '-'}</td>"
            f"<td style='{_PAD}'>{html.escape(r.device)}</td>"
            f"<td style='{_PAD}'>{_swatch(STATE_COLORS.get(r.state, 'transparent'))}{r.state}</td>"
            f"<td style='{_PAD};text-align:left'>{failed}</td></tr>")
    head_row = "".join(f"<th style='{_PAD};text-align:left'>{h}</th>" for h in ("rank", "pid", "device", "state", ""))
    table = f"<table><tr>{head_row}</tr>" + "".join(rows) + "</table>"
    error = (f"<div>last error: <span style='color:var(--jp-error-color1, #b00)'>{html.escape(status.last_error)}</span></div>"
             if status.last_error else "<div>no call has failed</div>")
    return f"<div>{head}</div>{table}{error}"


class ClusterStatusView:
    """The widget: the table and a Refresh button. ``refresh()`` re-reads the cluster."""

    def __init__(self, cluster):
        import ipywidgets as w

        self.cluster = cluster
        self.html = w.HTML()
        self.button = w.Button(description="Refresh", icon="refresh")
        self.button.on_click(lambda _: self.refresh())
        self.widget = w.VBox([self.html, self.button])
        self.refresh()

    def refresh(self) -> None:
        """Show the cluster's state now."""
        try:
            self.status = self.cluster.status()
            self.html.value = status_html(self.status)
        except Exception as err:  # noqa: BLE001 -- a widget callback's error would be lost
            self.html.value = f"<b style='color:var(--jp-error-color1, #b00)'>cannot read the cluster's state: {html.escape(repr(err))}</b>"

    @property
    def text(self) -> str:
        """What the widget shows, as plain text (for asserts)."""
        import re

        cells = re.sub(r"</(td|th|tr|div)>", " ", self.html.value)  # block ends become spaces
        return " ".join(html.unescape(re.sub(r"<[^>]+>", "", cells)).split())

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def cluster_status(cluster) -> ClusterStatusView:
    """A status widget for ``cluster``: backend, world size, per rank pid, device and state
    (idle, busy, dead, closed), which ranks failed in the last call, the last error."""
    return ClusterStatusView(cluster)
