"""Byte units for display: decimal GB (10^9, as the ZeRO paper counts) and binary GiB (2^30).

Every quantity in ``dpcourse.memory`` is an integer number of bytes; these helpers only
turn bytes into labelled text or into a float in a named unit, never the other way round.
"""
from __future__ import annotations

UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def in_unit(num_bytes: float, unit: str) -> float:
    """``num_bytes`` (bytes) expressed in ``unit`` (one of ``UNITS``), as a float."""
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r}; choose one of {', '.join(UNITS)} "
                         "(GB = 10^9 bytes, GiB = 2^30 bytes)")
    return num_bytes / UNITS[unit]


def format_bytes(num_bytes: float, unit: str = "auto", digits: int = 3) -> str:
    """Bytes as labelled text, e.g. ``'31.4 GB'``; ``unit='auto'`` picks B/KiB/MiB/GiB."""
    if unit == "auto":
        unit = next((u for u in ("GiB", "MiB", "KiB") if abs(num_bytes) >= UNITS[u]), "B")
    if unit == "B":
        return f"{int(num_bytes):,} B"
    return f"{in_unit(num_bytes, unit):.{digits}g} {unit}"
