"""4.2e's try-its (checked on the notebook's ranks)."""
from __future__ import annotations

from . import try_it  # noqa: F401
