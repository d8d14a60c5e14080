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
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

GRACE_S = 1.0  # after SIGTERM, how long a process may take to end before SIGKILL


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    name: str
    zombie: bool = False


def process_table() -> dict[int, Proc]:
    """Every process this user can see: /proc on Linux, ``ps`` elsewhere."""
    table: dict[int, Proc] = {}
    if os.path.isdir("/proc/self/task"):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    data = f.read().decode(errors="replace")
            except OSError:
                continue  # gone meanwhile
            name = data[data.find("(") + 1: data.rfind(")")]
            fields = data[data.rfind(")") + 2:].split()
            table[int(entry)] = Proc(int(entry), int(fields[1]), int(fields[2]), name, fields[0] in "ZX")
        return table
    try:
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,pgid=,stat=,comm="], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return table
    for line in out.splitlines():
        parts = line.split(None, 4)
        if len(parts) == 5 and parts[0].isdigit():
            pid, ppid, pgid = map(int, parts[:3])
            table[pid] = Proc(pid, ppid, pgid, os.path.basename(parts[4]), parts[3].startswith("Z"))
    return table


def descendants(root: int, table: dict[int, Proc]) -> list[int]:
    """The running processes below ``root`` (children, their children, ...) in ``table``."""
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, ())
    return [pid for pid in found if not table[pid].zombie]


def _children_files() -> bool:
    """Linux lists each task's children in /proc (CONFIG_PROC_CHILDREN): no scan of /proc."""
    return os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _stat(pid: int) -> Proc | None:
    """One process's entry from /proc (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rfind(")") + 2:].split()
    return Proc(pid, int(fields[1]), int(fields[2]), data[data.find("(") + 1: data.rfind(")")], fields[0] in "ZX")


def _children(pid: int) -> list[int]:
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            pass  # the thread ended meanwhile
    return found


def tree(root: int) -> dict[int, Proc]:
    """The running processes below ``root``, by PID: read from each one's children in /proc
    where Linux lists them (a few files), else from the whole process table."""
    if not _children_files():
        table = process_table()
        return {pid: table[pid] for pid in descendants(root, table)}
    found: dict[int, Proc] = {}
    todo = _children(root)
    while todo:
        pid = todo.pop()
        proc = _stat(pid)
        if proc is None or pid in found:
            continue
        todo += _children(pid)
        if not proc.zombie:
            found[pid] = proc
    return found


def _running(pids: list[int]) -> list[int]:
    if _children_files():
        return [pid for pid in pids if (p := _stat(pid)) is not None and not p.zombie]
    table = process_table()
    return [pid for pid in pids if pid in table and not table[pid].zombie]


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


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except (ChildProcessError, OSError):
        pass


def stop(pids: list[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM ``pids``, SIGKILL those still running after ``grace_s``; reap our own children."""
    everyone = list(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while pids:
            pids = _running(pids)
            if not pids or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if not pids:
            break
    for pid in everyone:
        _reap(pid)  # our own child: reaped; anyone else's: ChildProcessError, ignored


def stop_descendants() -> list[tuple[int, str]]:
    """Stop what this process started that still runs: its descendants, and where no subreaper
    adopts what they leave (not Linux) its process group's other members. Returns (pid, name)
    of each process stopped."""
    me = os.getpid()
    left = tree(me)
    if not sys.platform.startswith("linux") and os.getpgid(0) == me:
        table = process_table()  # a double fork's grandchild is init's now, but still in our group
        for p in table.values():
            if p.pgid == me and p.pid != me and not p.zombie:
                left[p.pid] = p
    if not left:
        return []
    found = sorted(left)
    stop(found)
    return [(pid, left[pid].name) for pid in found]


def orphans(known: set[int]) -> list[tuple[int, int, str]]:
    """The subreaper's adopted processes: its children that are not in ``known`` (the ranks and
    spares), and everything below them; (pid, process group, name) of each."""
    me = os.getpid()
    if _children_files():
        adopted = {pid: p for pid in _children(me) if pid not in known
                   and (p := _stat(pid)) is not None and not p.zombie}
    else:
        table = process_table()
        adopted = {p.pid: p for p in table.values() if p.ppid == me and p.pid not in known and not p.zombie}
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


def process(pid: int) -> Proc | None:
    """One process's entry (None: gone)."""
    if _children_files():
        return _stat(pid)
    return process_table().get(pid)
