"""Processes the ranks start do not outlive the call that started them (scripts), nor the ranks.

A script run on the ranks may start processes of its own -- a ``multiprocessing`` child it
never joins (the tutorials' launcher pattern), a ``subprocess``, a daemon that forks twice.
Under torchrun they would end with the script's process or be left to init; a persistent rank
outlives the script, so the pool ends them itself:

* each rank is the leader of its own process group, so what it starts shares its group
  unless it asks for a session of its own;
* when a script ends, the rank stops its descendants and the members of its group
  (``stop_descendants``): SIGTERM, and SIGKILL for what is still running a second later;
* on Linux the launcher is a *child subreaper* (``set_subreaper``): whatever a rank started
  and left -- even in a new session, after a double fork -- becomes the launcher's child
  instead of init's, so the launcher finds it (``orphans``) after a script, when the ranks
  restart and when the cluster shuts down. Elsewhere the process group is what finds them.
"""
from __future__ import annotations

import os
import sys

# The process table, trees and stop() live in the package's process toolbox; the launcher
# reads tree, process, stop and GRACE_S through this module.
from ..processes import GRACE_S, children, is_multiprocessing_helper, process, process_table, stop, tree  # noqa: F401


def set_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
    except (OSError, AttributeError):
        return False


def own_group() -> None:
    """Make this process the leader of a process group of its own (what it starts joins it)."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass  # already a group leader, or not permitted: the subreaper still finds what it starts


def stop_descendants() -> list[tuple[int, str]]:
    """Stop what this process started that still runs: its descendants, and where no subreaper
    adopts what they leave (not Linux) its process group's other members. Returns (pid, name)
    of each process stopped. ``multiprocessing``'s own helpers (its resource tracker, its
    forkserver) serve the rank for its life, as they would a process: they are left alone."""
    me = os.getpid()
    left = tree(me)
    if not sys.platform.startswith("linux") and os.getpgid(0) == me:
        table = process_table()  # a double fork's grandchild is init's now, but still in our group
        for p in table.values():
            if p.pgid == me and p.pid != me and not p.zombie:
                left[p.pid] = p
    left = {pid: p for pid, p in left.items() if not is_multiprocessing_helper(pid)}
    if not left:
        return []
    found = sorted(left)
    stop(found)
    return [(pid, left[pid].name) for pid in found]


def orphans(known: set[int]) -> list[tuple[int, int, str]]:
    """The subreaper's adopted processes: its children that are not in ``known`` (the ranks and
    spares), and everything below them; (pid, process group, name) of each."""
    adopted = {pid: p for pid, p in children(os.getpid()).items() if pid not in known}
    found = dict(adopted)
    for pid in adopted:
        found.update(tree(pid))
    return [(pid, found[pid].pgid, found[pid].name) for pid in sorted(found)]


def describe(who: str, procs: list[tuple[int, str]]) -> str:
    """'rank 1's script left 1 process running (pid 123, python); it was stopped'."""
    n = len(procs)
    listed = ", ".join(f"{pid} {name}" for pid, name in procs[:6]) + (", ..." if n > 6 else "")
    plural = n != 1
    return (f"{who} left {n} process{'es' if plural else ''} running "
            f"(pid{'s' if plural else ''} {listed}); {'they were' if plural else 'it was'} stopped")

