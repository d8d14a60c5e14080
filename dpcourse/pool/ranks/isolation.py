"""A script run on a rank sees what ``python script.py`` would: its folder first on ``sys.path``
and the learner's own modules imported afresh.

Runs on the ranks. Persistent ranks keep ``sys.path`` and ``sys.modules`` between calls, which
a fresh torchrun process would not: an edited ``utils.py`` beside a script would stay stale,
and two projects' ``utils.py`` would collide. So, for the length of one script run:

* the script's folder (the rank's working folder for a ``%%ranks --script`` cell, as for
  ``python -c``) is put first on ``sys.path``; ``sys.path`` is restored afterwards;
* the learner's modules -- those loaded from outside the Python installation and outside this
  package: the script's folder, the notebook's folder, anything on a path the learner added --
  are set aside before the run and put back after it, and the ones the run imported are
  dropped, with the import caches invalidated, so the next run imports them from the files
  as they are then.

The installation's modules (the standard library, site-packages: torch, numpy, ...) and this
package's stay loaded: importing them again would cost seconds and change nothing.

The same line between the learner's code and everything else (``tracking.learners``, which the
collective tracker draws too) tells which threads of a rank are the learner's
(``learner_threads``): a thread that runs the learner's code may still send or receive, so a
rank that runs one decides no deadlock.
"""
from __future__ import annotations

import contextlib
import importlib
import linecache
import os
import sys
import threading

from ...torch_private import thread_target
from ...tracking.learners import is_learners_file, roots


def learner_threads() -> list[str]:
    """Names of the rank's live threads that run the learner's code, besides the main thread and
    the pool's own (``dpcourse-...``): their function is the learner's, or the learner's code is on
    their stack now. The main thread's frames are never taken: held here a moment, they would
    keep its locals (tensors) alive past their time."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread()
              and not t.name.startswith("dpcourse-") and t.is_alive()]
    if not others:
        return []
    frames = sys._current_frames()
    frames.pop(threading.main_thread().ident, None)
    found = []
    for thread in others:
        entries = [thread_target(thread), getattr(thread, "function", None)]  # a Timer's function
        if type(thread).run is not threading.Thread.run:
            entries.append(type(thread).run)
        codes = [getattr(e, "__code__", None) for e in entries]
        frame = frames.get(thread.ident)
        while frame is not None:
            codes.append(frame.f_code)
            frame = frame.f_back
        if any(c is not None and is_learners_file(c.co_filename) for c in codes):
            found.append(thread.name)
    return found


def is_learners(module) -> bool:
    """True for a module loaded from outside the Python installation and this package."""
    file = getattr(module, "__file__", None)
    places = [file] if isinstance(file, str) else []
    if not places:  # a namespace package has locations but no file; builtins have neither
        try:
            places = [p for p in getattr(module, "__path__", None) or () if isinstance(p, str)]
        except Exception:  # noqa: BLE001 -- an odd __path__ object: not the learner's
            return False
    if not places:
        return False
    return not any(os.path.abspath(p).startswith(roots()) for p in places)


def _script_folder(path: str) -> str:
    """The folder ``python path`` puts first on ``sys.path`` (the working folder for a cell)."""
    if path.startswith("<"):  # a %%ranks --script cell: as `python -c`, the working folder
        return os.getcwd()
    return os.path.dirname(os.path.abspath(path))


@contextlib.contextmanager
def script_imports(path: str):
    """For one script run: its folder first on ``sys.path``, the learner's modules fresh."""
    saved_path = list(sys.path)
    set_aside = {name: m for name, m in list(sys.modules.items()) if name != "__main__" and is_learners(m)}
    for name in set_aside:
        del sys.modules[name]
    before = set(sys.modules)
    importlib.invalidate_caches()
    linecache.checkcache()  # tracebacks show the files as they are now
    sys.path.insert(0, _script_folder(path))
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for name in [n for n in list(sys.modules) if n not in before and n != "__main__"]:
            module = sys.modules.get(name)
            if module is None or is_learners(module):
                sys.modules.pop(name, None)
        sys.modules.update(set_aside)
        importlib.invalidate_caches()
