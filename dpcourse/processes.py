"""The processes the course starts and ends, in one place: death signals, exits, process trees,
free ports, torchrun launches and Gloo's teardown.

The pool (its launcher and ranks), ``python -m dpcourse.train`` under torchrun, the exercise
checkers that run a learner's script under torchrun, and the tests all use this module. It
imports no other room of the package, and torch only inside the functions that need it.

Nothing is ended by name: a process ended here is one this process started (a ``Popen``
handle, a PID it was given) or one found below it, by parent PID, while that parent runs.

Gloo's teardown. After ``destroy_process_group()`` Gloo's worker threads can still be
alive (a wrapped model keeps the group referenced); one that needs the GIL while the
interpreter finalizes is ended inside a C++ destructor and the finished process aborts
(SIGABRT, "terminate called without an active exception"), which torchrun reports as a
failed run. The package's own torchrun entry point leaves with ``leave_process_group`` then
``exit_without_shutdown``; the checkers recognise the abort with ``aborted_at_exit``. The
course's scripts (``dpcourse/scripts``) write the same ending out, commented, for the reader.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds dpcourse/
PROC = "/proc"  # where Linux lists processes; elsewhere (macOS) `ps` says the same
GRACE_S = 1.0  # after SIGTERM, how long a process may take to end before SIGKILL
_exit = os._exit  # the real one: the pool's ranks rebind os._exit while a script runs


# --- death signals ----------------------------------------------------------------------------

def set_death_signal(expected_parent: int, signum: int = signal.SIGKILL) -> None:
    """Die with the parent ``expected_parent``: Linux sends this process ``signum`` when its parent
    dies (``PR_SET_PDEATHSIG``); elsewhere a watchdog thread checks the parent every 0.5 s and
    sends it itself. A catchable ``signum`` (SIGTERM) lets the process clean up first."""
    armed = False
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum) == 0
    if os.getppid() != expected_parent:  # the parent died before the signal was armed
        if signum == signal.SIGKILL:
            _exit(1)
        os.kill(os.getpid(), signum)
    if not armed:
        threading.Thread(target=_watch_parent, args=(expected_parent, signum), name="dpcourse-parent",
                         daemon=True).start()


def _watch_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    if signum == signal.SIGKILL:
        _exit(1)
    os.kill(os.getpid(), signum)


# --- exits ------------------------------------------------------------------------------------

def describe_exit(status: int | None) -> str:
    """'killed by signal 9 (SIGKILL)' or 'exited with code 3' from a wait status (``os.wait``)."""
    if status is None:
        return "ended (exit status unknown)"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {sig} ({name})"
    return f"exited with code {os.WEXITSTATUS(status)}"


# --- the process table and process trees ------------------------------------------------------

@dataclass(frozen=True)
class Proc:
    """One process as the process table lists it."""

    pid: int
    ppid: int
    pgid: int
    name: str
    zombie: bool = False


def process_table() -> dict[int, Proc]:
    """Every process this user can see, by PID: from /proc on Linux, from ``ps`` elsewhere."""
    table: dict[int, Proc] = {}
    if os.path.isdir(f"{PROC}/self/task"):
        for entry in os.listdir(PROC):
            if entry.isdigit() and (proc := _stat(int(entry))) is not None:
                table[proc.pid] = proc
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


def _children_files() -> bool:
    """Linux lists each task's children in /proc (CONFIG_PROC_CHILDREN): no scan of /proc."""
    return os.path.exists(f"{PROC}/self/task/{os.getpid()}/children")


def _stat(pid: int) -> Proc | None:
    """One process's entry from /proc (None: gone)."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rfind(")") + 2:].split()
    return Proc(pid, int(fields[1]), int(fields[2]), data[data.find("(") + 1: data.rfind(")")], fields[0] in "ZX")


def _child_pids(pid: int) -> list[int]:
    """PIDs of ``pid``'s children, from each of its threads' children file in /proc."""
    found = []
    try:
        tasks = os.listdir(f"{PROC}/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"{PROC}/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            pass  # the thread ended meanwhile
    return found


# multiprocessing's own helper processes, by the code their interpreter was started with: they
# serve the process that started them for its whole life, and are not a script's leftovers
_MULTIPROCESSING_HELPERS = ("from multiprocessing.resource_tracker import main",
                            "from multiprocessing.forkserver import main")


def command_line(pid: int) -> str:
    """A process's command line, its arguments joined by spaces ('' if it cannot be read)."""
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        pass
    if os.path.isdir(f"{PROC}/self"):
        return ""
    try:
        return subprocess.run(["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def is_multiprocessing_helper(pid: int) -> bool:
    """Whether ``pid`` is a helper ``multiprocessing`` starts for the life of its process (the
    resource tracker, the forkserver), not a process the learner's code started."""
    line = command_line(pid)
    return any(helper in line for helper in _MULTIPROCESSING_HELPERS)


def process(pid: int) -> Proc | None:
    """One process's entry (None: gone)."""
    return _stat(pid) if _children_files() else process_table().get(pid)


def children(pid: int, table: dict[int, Proc] | None = None) -> dict[int, Proc]:
    """The running (not zombie) children of ``pid``, by PID: from ``table`` (a
    ``process_table()``) when given, else from /proc's children files where Linux has them."""
    if table is None and _children_files():
        found = {c: p for c in _child_pids(pid) if (p := _stat(c)) is not None}
    else:
        found = {p.pid: p for p in (process_table() if table is None else table).values() if p.ppid == pid}
    return {c: p for c, p in found.items() if not p.zombie}


def tree(root: int) -> dict[int, Proc]:
    """The running processes below ``root`` (children, their children, ...), by PID: read from
    each one's children in /proc where Linux lists them (a few files), else from one table."""
    table = None if _children_files() else process_table()
    found: dict[int, Proc] = {}
    todo = [root]
    while todo:
        for pid, proc in children(todo.pop(), table).items():
            if pid not in found:
                found[pid] = proc
                todo.append(pid)
    return found


def _running(pids: list[int]) -> list[int]:
    table = None if _children_files() else process_table()
    alive = [(pid, _stat(pid) if table is None else table.get(pid)) for pid in pids]
    return [pid for pid, p in alive if p is not None and not p.zombie]


def stop(pids: list[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM ``pids``, SIGKILL those still running after ``grace_s`` seconds; reap those that
    are this process's children."""
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
        try:
            os.waitpid(pid, os.WNOHANG)  # our own child: reaped; anyone else's: ChildProcessError
        except (ChildProcessError, OSError):
            pass


def end_tree(popen: subprocess.Popen, grace_s: float = 0.0) -> int | None:
    """End ``popen`` (our child, started by ``start_process``) and every process below it.

    With ``grace_s`` > 0 it gets SIGTERM first and that many seconds to end (torchrun's agent
    then stops its workers itself). Then SIGKILL for its process group and for every process
    found below it before the SIGTERM: torchrun starts each worker in a session of its own, so
    the group alone would miss them. Returns its exit code, None if it had to be stopped."""
    if popen.poll() is not None:
        return popen.returncode
    family = sorted(tree(popen.pid))  # found while their parent runs: ours, not reused PIDs
    if grace_s > 0:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    if popen.poll() is None:  # not reaped, so its PID still names its process group
        try:
            if os.getpgid(popen.pid) == popen.pid:
                os.killpg(popen.pid, signal.SIGKILL)
            else:
                popen.kill()
        except ProcessLookupError:
            pass
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    popen.wait()
    return None


# --- free ports -------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to right now."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` different TCP ports on 127.0.0.1 that nothing is bound to right now."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:  # all bound at once, so the ports differ
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# --- starting processes and torchrun ----------------------------------------------------------

TORCHRUN = (sys.executable, "-m", "torch.distributed.run")  # `torchrun`, with this interpreter
# What torchrun gives each worker: a launch started from inside one must not inherit it.
WORKER_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_command(nproc: int, *args, standalone: bool = True) -> list[str]:
    """``torchrun [--standalone] --nproc_per_node=nproc *args`` with this interpreter, for Popen."""
    return [*TORCHRUN, *(["--standalone"] if standalone else []), f"--nproc_per_node={nproc}",
            *map(str, args)]


def launch_env(**extra: str) -> dict[str, str]:
    """This process's environment without what torchrun gives its workers (``RANK``,
    ``MASTER_PORT``, ``TORCHELASTIC_*``, ...), then ``extra``: a launch's environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in WORKER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    return {**env, **extra}


def start_process(args, **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args)`` in a session of its own, stdin from /dev/null, so that
    ``end_tree`` can end it with all it starts (a terminal's Ctrl-C does not reach it)."""
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen([str(a) for a in args], start_new_session=True, **popen_kwargs)


def run_process(args, timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """Run ``args`` (``start_process``) to its end, its output captured unless redirected;
    past ``timeout`` seconds, or if this process is interrupted, the whole tree is ended
    (``end_tree``) and the error raised (``subprocess.TimeoutExpired`` with the output so far)."""
    popen_kwargs.setdefault("stdout", subprocess.PIPE)
    popen_kwargs.setdefault("stderr", subprocess.PIPE)
    proc = start_process(args, **popen_kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_tree(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
    except BaseException:
        end_tree(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# --- Gloo's teardown (see the module's docstring) ---------------------------------------------

EXIT_ABORT = "terminate called without an active exception"  # the C++ runtime's words for the abort


def leave_process_group() -> None:
    """Leave the process group together: wait for every rank (without the barrier, agents on
    different "nodes" tear down while peers still talk: SIGABRT), free the reference cycles
    (module hooks) that hold the group while every rank is still here, destroy the group."""
    import gc

    import torch.distributed as dist

    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def exit_without_shutdown(code: int) -> None:
    """End this process with ``code`` now, without Python's shutdown, where Gloo's worker
    threads can abort it; the standard streams are flushed (other files must be closed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    _exit(code)


def aborted_at_exit(returncode: int | None, output: str, work_done: bool) -> bool:
    """Whether torchrun failed only because a worker aborted as Python exited, its work done.

    Asks for all three: torchrun names a worker ended by SIGABRT; a worker's stderr has the
    C++ runtime's words for it (``EXIT_ABORT``); and the caller's own evidence that the
    script's work was done (``work_done``: every rank returned from
    ``destroy_process_group``, or rank 0 printed its save). A timeout (``None``) never is.
    """
    return (returncode not in (0, None) and work_done and "(SIGABRT)" in output
            and EXIT_ABORT in output)
