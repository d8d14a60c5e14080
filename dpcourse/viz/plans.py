"""The rule's table: every plan of ``dpcourse.memory.choice.plans``, fit beside throughput.

An HTML table in JupyterLab's theme colours (readable in light and dark themes); the rule's
plan in bold, a plan estimated faster marked to be measured. Pure string building.
"""
from __future__ import annotations

import html

from ..memory.choice import duration
from ..memory.sizes import in_unit

_CELL = "padding:1px 8px;text-align:right;border-bottom:1px solid var(--jp-border-color2, #ddd)"


def render_plans_html(rows: list[dict], chosen: dict | None, faster: dict | None, unit: str = "GB") -> str:
    """One line per plan: peak and bytes sent per rank and step (``unit``), forward recomputed,
    host copies, estimated step (ms), and whether it fits; the rule's choice in bold."""
    head = ["plan", f"peak ({unit})", "fits", f"sent/step ({unit})", "recompute", f"host copies ({unit})",
            "step (est.)"]
    lines = ["<tr>" + "".join(f"<th style='{_CELL};white-space:nowrap'>{h}</th>" for h in head) + "</tr>"]
    for row in rows:
        mark = "◀ the rule" if row is chosen else ("◀ estimated faster: measure" if row is faster else "")
        cells = [html.escape(row["name"]), f"{in_unit(row['peak'], unit):.4g}", "yes" if row["fits"] else "no",
                 f"{in_unit(row['sent'], unit):.3g}", f"{row['recompute']:.0%}" if row["recompute"] else "",
                 f"{in_unit(row['host'], unit):.3g}" if row["host"] else "", duration(row["seconds"])]
        weight = "font-weight:bold;" if row is chosen else ""
        faded = "" if row["fits"] else "opacity:0.55;"
        lines.append(f"<tr style='{weight}{faded}'>" + "".join(
            f"<td style='{_CELL}{';text-align:left' if i == 0 else ''}'>{c}</td>" for i, c in enumerate(cells))
            + f"<td style='padding:1px 8px;white-space:nowrap'>{mark}</td></tr>")
    return ("<table style='border-collapse:collapse;font-size:12px;color:var(--jp-ui-font-color1, inherit)'>"
            + "".join(lines) + "</table>")
