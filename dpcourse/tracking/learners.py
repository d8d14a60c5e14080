"""Which code is the learner's: the one line the tracker, and the pool's ranks, draw between
the learner's code and everything else (the Python installation, this package).

The tracker asks it of the frame that issued a collective: the learner's asynchronous
operations are held until they complete, so that a ``wait()`` on one says what the rank
waits in; PyTorch's own (DDP's, FSDP's) are not. The pool's ranks ask it of a script's
modules (imported afresh each run) and of a rank's threads (a learner's thread may still
communicate).

"This package" is all of ``dpcourse/``: its modules are never the learner's, so a script run
never sets them aside and imports them again (a second tracker would then record the run).
"""
from __future__ import annotations

import os
import sys
import sysconfig

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # dpcourse/


def _installation_roots() -> tuple[str, ...]:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots.update(p for p in sysconfig.get_paths().values() if p)
    try:
        import site

        roots.update(site.getsitepackages())
        roots.add(site.getusersitepackages())
    except Exception:  # noqa: BLE001 -- a stripped-down site module: the prefixes suffice
        pass
    found = {os.path.join(os.path.realpath(r), "") for r in roots if r}
    found |= {os.path.join(os.path.abspath(r), "") for r in roots if r}
    return tuple(sorted(found)) + (_PACKAGE_DIR, os.path.join(os.path.realpath(_PACKAGE_DIR), ""))


_ROOTS: tuple[str, ...] | None = None


def roots() -> tuple[str, ...]:
    """Where the installation and this package live (found once; ``sysconfig`` imports a module
    the first time, so a rank asks at its start, never first from another thread)."""
    global _ROOTS
    if _ROOTS is None:
        _ROOTS = _installation_roots()
    return _ROOTS


def is_learners_file(filename: str) -> bool:
    """True for code of the learner's: a file outside the Python installation and this package, a
    notebook cell or a string it ran (``<ipython-input-3-...>``, ``<ranks-cell-2>``, ``<string>``);
    not Python's own frozen modules."""
    if filename.startswith("<"):
        return not filename.startswith("<frozen")
    return not os.path.abspath(filename).startswith(roots())
