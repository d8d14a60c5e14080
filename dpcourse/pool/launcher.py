"""The launcher: a small parent process, with torch already imported, that forks the ranks.

(Or spawns them: with ``start_method="spawn"`` -- the default where forking a process that
imported torch is unsafe, macOS -- each rank is a fresh interpreter, started ahead of need
as a *spare* that imports torch and then waits for its spec; see ``_spawn_rank``. Spare
generations import one at a time, oldest first, each at low priority: several spares
importing at once would share the cores and all be late, and the cluster's calls come first.)

Why a separate parent and not the kernel: forking the kernel is unsafe (CUDA may be
initialised there; a used intra-op thread pool hangs the child), and spawning fresh
interpreters costs a full ``import torch`` (2-3 s) every time the ranks are restarted.
The launcher imports torch once, never runs an op or touches CUDA, and forks ranks on
request in ~0.1 s. It is the ranks' parent, so only it can kill and reap them by PID
without any risk of hitting a reused PID.

It dies with the kernel (death signal + end-of-file on its socket) and kills its ranks, with
whatever they started, first: its death signal is SIGTERM, which it catches to clean up, so
even a kernel killed with ``kill -9`` leaves nothing behind. The ranks also carry a death
signal, so nothing outlives the kernel.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
from multiprocessing.connection import Connection, wait

from . import reaper, wire


def _output_pipes() -> tuple[tuple[int, int], tuple[int, int]]:
    """Pipes for a rank's fds 1 and 2: (read ends, write ends). The launcher keeps the read ends
    as well as the rank: what the rank wrote just before it died is read out here (see reap)."""
    out, err = os.pipe(), os.pipe()
    return (out[0], err[0]), (out[1], err[1])


def _fork_rank(spec: dict, rank: int, fds: list[int], inherited: list[int], launcher_pid: int,
               pipes: tuple) -> int:
    reads, writes = pipes
    pid = os.fork()
    if pid:
        try:
            os.setpgid(pid, pid)  # the rank leads a process group (both sides set it: no race)
        except OSError:
            pass
        for fd in writes:
            os.close(fd)
        return pid
    reaper.own_group()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's handler (_leave) is not the rank's
    # Child: keep only this rank's two sockets and output pipes; drop the launcher's own
    # descriptors so that only the launcher holds its socket to the kernel.
    mine = fds[2 * rank: 2 * rank + 2]
    for fd in fds + inherited:
        if fd not in mine:
            os.close(fd)
    for fd, target in zip(writes, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    from .ranks import rank as rank_module

    rank_module.main(spec, rank, mine[0], mine[1], launcher_pid, reads)
    os._exit(5)  # not reached


# Popen's process_group (Python 3.11+) is safe with the launcher's threads; preexec_fn is not.
_OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": reaper.own_group}


# A spare's nice value while it starts and imports torch: the lowest priority there is, so the
# scheduler runs the ranks' calls first. It is set on one thread (on Linux a nice value belongs
# to a thread): the rank itself keeps its priority, which an unprivileged process could not
# raise back. On Linux that thread also takes the SCHED_IDLE policy (sched(7)): a rank woken by
# a message then preempts it at once, where a nice-19 thread may first finish its time slice,
# and a call's ranks wake one another several times. Measured with ``python -m dpcourse.bench
# pool`` (tiny all_reduce calls in the first 2 s after a spawn-mode start, while the first
# spares import): about 2x fork's with SCHED_IDLE, 2.7-3x with nice 19 alone. Elsewhere spares
# start at normal priority.
LOW_PRIORITY = 19


def _boot_code(spare: bool) -> str:
    """What a spawned rank's interpreter runs (``python -c``): import the pool's rank module and
    run it. A spare imports it in a thread of ``LOW_PRIORITY``, so starting spares does not
    slow the cluster's calls."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return "\n".join([
        "import os, sys, threading",
        "if sys.platform.startswith('linux'):",  # die with the launcher from the first line on
        "    import ctypes",
        "    ctypes.CDLL(None).prctl(1, 9)",  # PR_SET_PDEATHSIG, SIGKILL (see processes.set_death_signal)
        "    if os.getppid() != int(sys.argv[4]):",
        "        os._exit(1)",
        f"sys.path.insert(0, {root!r})",
        "def load():",
        f"    if {spare!r} and sys.platform.startswith('linux'):",
        f"        os.setpriority(os.PRIO_PROCESS, 0, {LOW_PRIORITY})",  # 0: this thread
        "        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))",  # see LOW_PRIORITY
        "    import dpcourse.pool.ranks.rank",
        "thread = threading.Thread(target=load)",
        "thread.start()",
        "thread.join()",
        "from dpcourse.pool.ranks.rank import spawned_main",  # raises here if the thread's import failed
        "spawned_main()"])


def _spawn_rank(rank: int, fds: list[int], launcher_pid: int, spare: bool, pipes: tuple):
    """A fresh interpreter for ``rank``; returns its Popen and the launcher's end of the socket
    on its stdin, over which it is told when to import torch and, later, its spec (see
    ``rank.spawned_main``). It writes into its output ``pipes`` once it serves."""
    import subprocess

    mine = fds[2 * rank: 2 * rank + 2]
    reads, writes = pipes
    ours, theirs = socket.socketpair()
    try:
        popen = subprocess.Popen([sys.executable, "-c", _boot_code(spare), str(rank), *map(str, mine),
                                  str(launcher_pid), *map(str, reads), *map(str, writes)],
                                 pass_fds=[*mine, *reads, *writes], stdin=theirs.fileno(), close_fds=True,
                                 **_OWN_GROUP)  # each rank leads a process group of its own (see reaper)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
        for fd in writes:
            os.close(fd)
    return popen, Connection(ours.detach())


def _peak_bytes(usage) -> int:
    """A reaped child's peak resident memory (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    if usage is None:
        return 0
    return usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _send_spec(fd: int, data: bytes) -> None:
    """Send a spare its spec over its own copy ``fd`` of the socket (closed here), from a
    thread: a spare still importing reads it later."""
    conn = Connection(fd)
    try:
        conn.send(wire.Spec(spec=data))
    except (OSError, ValueError):
        pass  # the spare died already (the kernel hears of it as an exit)
    finally:
        conn.close()


class Launcher:
    def __init__(self, sock: socket.socket, start_method: str = "fork"):
        self.sock = sock
        self.start_method = start_method
        self.conn = Connection(os.dup(sock.fileno()))
        self.children: dict[int, int] = {}  # pid -> pidfd (or -1 without pidfd support)
        self.spawned: dict[int, object] = {}  # pid -> Popen of a spawned rank (reaped here, by PID)
        self.spares: dict[int, Connection] = {}  # pid -> socket to a spawned rank, until its spec is sent
        self.importing: set[int] = set()  # spawned ranks that have not yet said they imported torch
        self.told: set[int] = set()  # spawned ranks told to import (or sent their spec)
        self.activated: set[int] = set()  # spawned ranks sent their spec
        self.queue: list[list[int]] = []  # spawned generations, oldest first, while importing
        self.outputs: dict[int, tuple[int, int]] = {}  # pid -> read ends of its fds 1 and 2
        self.subreaper = reaper.set_subreaper()  # what the ranks leave becomes ours (Linux)

    def reap(self) -> list[tuple]:
        """Collect exited children; return (pid, wait status, peak resident bytes, what it wrote to
        fds 1 and 2 that its output thread had not sent) for each rank. Processes adopted as the
        ranks' subreaper (see ``reaper``) are reaped without a report."""
        gone = []
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            if pid in self.children:
                words = self._last_words(pid)
                self._forget(pid, status)
                gone.append((pid, status, _peak_bytes(usage), *words))
        return gone

    def _last_words(self, pid: int) -> tuple[str, str]:
        """What the rank wrote to fds 1 and 2 that is still in their pipes (its output thread died
        with it before sending it): the C++ runtime's last lines before an abort, say."""
        words = []
        for fd in self.outputs.get(pid, ()):
            chunks = []
            try:
                os.set_blocking(fd, False)
                while data := os.read(fd, 65536):
                    chunks.append(data)
            except OSError:  # nothing more now (BlockingIOError), or gone
                pass
            words.append(b"".join(chunks).decode(errors="replace"))
        return tuple(words) if words else ("", "")

    def _forget(self, pid: int, status: int) -> None:
        fd = self.children.pop(pid)
        if fd >= 0:
            os.close(fd)
        for out in self.outputs.pop(pid, ()):
            os.close(out)
        popen = self.spawned.pop(pid, None)
        if popen is not None:  # reaped by PID here: tell the Popen, so it never waits itself
            popen.returncode = os.waitstatus_to_exitcode(status) if status else 0
            self.told.discard(pid)
            self.activated.discard(pid)
            self._imported(pid)

    def _imported(self, pid: int) -> None:
        """``pid`` has imported torch, or is gone: the next generation may import."""
        self.importing.discard(pid)
        if pid in self.activated or pid not in self.spawned:  # its socket has no more use
            self._drop(pid)
        self._next_import()

    def _drop(self, pid: int) -> None:
        conn = self.spares.pop(pid, None)
        if conn is not None:
            conn.close()

    def _next_import(self) -> None:
        """Tell the oldest generation still importing torch to import; later ones wait for it."""
        self.queue = [gen for gen in ([pid for pid in gen if pid in self.importing] for gen in self.queue) if gen]
        for pid in self.queue[0] if self.queue else ():
            if pid not in self.told:
                self.told.add(pid)
                try:
                    self.spares[pid].send(wire.ImportNow(nice=LOW_PRIORITY))
                except OSError:
                    pass  # it died: its exit is reported as it is reaped

    def _read_spare(self, pid: int) -> None:
        try:
            self.spares[pid].recv()  # wire.SpareImported: the only thing a spare says
        except (EOFError, OSError):
            pass  # it died (reported as it is reaped)
        self._imported(pid)

    def kill(self, pids) -> tuple[list[tuple[int, int, int]], list]:
        """SIGKILL ranks with their process groups and reap them, then stop what they started:
        found below them first (so it is known whose it was, and found where no subreaper
        adopts it), and adopted by this subreaper after."""
        pids = [pid for pid in pids if pid in self.children]
        owner = {}
        try:
            for pid in pids:
                owner.update((d, pid) for d in reaper.tree(pid))
        except Exception:  # noqa: BLE001 -- no process table: the group and the subreaper remain
            pass
        gone = []
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)  # the rank and what it started in its group
            except OSError:
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            _, status, usage = os.wait4(pid, 0)
            self._forget(pid, status)
            gone.append((pid, status, _peak_bytes(usage), "", ""))  # stopped by the pool: nothing to add
        return gone, self.sweep(grace_s=0.2, owner=owner)

    def sweep(self, grace_s: float = reaper.GRACE_S, owner: dict | None = None) -> list:
        """Stop the processes the ranks left (adopted by this subreaper, or listed in ``owner``):
        (pid, the rank's pid or the process group, name) of each that the learner's code started
        (``multiprocessing``'s own helpers are stopped without a word: they were the rank's)."""
        try:
            owner = owner or {}
            names = {}
            left = {}
            for pid, pgid, name in reaper.orphans(set(self.children)):
                left[pid], names[pid] = pgid, name
            for pid, rank in owner.items():  # found below a rank before it was killed
                proc = reaper.process(pid)
                if proc is not None and not proc.zombie and pid not in self.children:
                    left[pid], names[pid] = rank, proc.name
            if not left:
                return []
            helpers = {pid for pid in left if reaper.is_multiprocessing_helper(pid)}
            reaper.stop(sorted(left), grace_s)
            self.reap()
            return [(pid, owner.get(pid, left[pid]), names[pid]) for pid in sorted(left) if pid not in helpers]
        except Exception:  # noqa: BLE001 -- never let the cleanup take the launcher down
            return []

    def handle(self, msg) -> bool:
        """Serve one request of the kernel (see ``wire``: ``Spawn``, ``Activate``, ``Signal``,
        ``Kill``, ``Sweep``); False for ``Exit``."""
        match wire.to_launcher(msg):
            case wire.Spawn(spec=spec, spare=spare):
                self._spawn(spec, spare)
            case wire.Activate(pids=pids, spec=spec):
                self._activate(pids, spec)
            case wire.Signal(signum=signum, pids=pids):
                for pid in pids:
                    if pid in self.children:
                        os.kill(pid, signum)
            case wire.Kill(pids=pids):
                exits, left = self.kill(pids)
                self.conn.send(wire.Killed(exits=exits, left=left))
            case wire.Sweep():
                self.conn.send(wire.Swept(left=self.sweep()))
            case wire.Exit():
                return False
            case request:  # to_launcher types only the requests above: the kernel and wire disagree
                raise TypeError(f"the launcher has no handler for {request!r}")
        return True

    def _spawn(self, spec: dict, spare: bool) -> None:
        """Start a generation of ranks on the sockets that follow the request; answer ``Spawned``."""
        _, fds, _, _ = socket.recv_fds(self.sock, 16, 2 * spec["world_size"])
        pipes = [_output_pipes() for _ in range(spec["world_size"])]
        if self.start_method == "spawn":  # spares: they wait for "activate" and a spec
            started = [_spawn_rank(r, fds, os.getpid(), spare, pipes[r]) for r in range(spec["world_size"])]
            pids = [popen.pid for popen, _ in started]
            self.spawned.update((popen.pid, popen) for popen, _ in started)
            self.spares.update((popen.pid, conn) for popen, conn in started)
            self.queue.append(pids)  # later spares wait for it to import
            if not spare:  # needed now: its spec follows, and it imports at full priority
                self.told.update(pids)
        else:
            inherited = [self.sock.fileno(), self.conn.fileno()]
            inherited += [fd for fd in self.children.values() if fd >= 0]
            inherited += [fd for reads in self.outputs.values() for fd in reads]
            pids = []
            for r in range(spec["world_size"]):  # a rank closes the other ranks' pipes it inherits
                others = [fd for i, (reads, writes) in enumerate(pipes) if i != r for fd in (*reads, *writes)
                          if i > r or fd in reads]
                pids.append(_fork_rank(spec, r, fds, inherited + others, os.getpid(), pipes[r]))
        for fd in fds:
            os.close(fd)
        for pid, (reads, _) in zip(pids, pipes):
            self.children[pid] = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else -1
            self.outputs[pid] = reads
        self.importing.update(pids if self.start_method == "spawn" else ())
        self.conn.send(wire.Spawned(pids=pids))
        self._next_import()

    def _activate(self, pids: list[int], spec: bytes) -> None:
        """Spawned spares: here is your ``spec`` (a pickled dict)."""
        import threading

        for pid in pids:  # written from threads: a spare still importing reads it later
            conn = self.spares.get(pid)
            if conn is None or pid in self.activated:
                continue  # gone already (the kernel hears of it as an exit)
            self.told.add(pid)  # the spec means "import now" too
            self.activated.add(pid)
            threading.Thread(target=_send_spec, args=(os.dup(conn.fileno()), spec),
                             daemon=True).start()
            if pid not in self.importing:
                self._drop(pid)

    def serve(self) -> None:
        try:
            while True:
                importing = {self.spares[pid]: pid for pid in self.importing if pid in self.spares}
                watched = [self.conn] + [fd for fd in self.children.values() if fd >= 0] + list(importing)
                timeout = None if all(fd >= 0 for fd in self.children.values()) else 0.05
                if self.subreaper:  # adopted processes that end are reaped within a second
                    timeout = 1.0 if timeout is None else timeout
                ready = wait(watched, timeout)
                exited = self.reap()
                if exited:
                    self.conn.send(wire.Reaped(exits=exited))
                for conn in ready:
                    if conn in importing and importing[conn] in self.spares:
                        self._read_spare(importing[conn])
                if self.conn in ready and not self.handle(self.conn.recv()):
                    break
        except (EOFError, OSError):
            pass  # the kernel is gone
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the kernel's death may say so twice
            self.kill(list(self.children))


def _leave(signum, frame) -> None:
    """SIGTERM: the kernel is gone (or someone asks the launcher to end): unwind ``serve``, whose
    cleanup no second signal interrupts."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(0)


def main() -> None:
    fd, kernel_pid, arm_death_signal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    start_method = sys.argv[4] if len(sys.argv) > 4 else "fork"
    # Ctrl-C in a terminal or the notebook's stop button must reach the ranks only
    # through the pool (which decides what to interrupt), never directly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _leave)  # the kernel died: serve() kills the ranks and what they started
    if arm_death_signal:
        from ..processes import set_death_signal

        set_death_signal(kernel_pid, signal.SIGTERM)
    sock = socket.socket(fileno=fd)
    if start_method == "fork":
        # Preload what every rank needs, once: this is what makes restarts cheap.
        import cloudpickle  # noqa: F401
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
        import torch.distributed.distributed_c10d  # noqa: F401

        from .ranks import rank  # noqa: F401

    launcher = Launcher(sock, start_method)
    launcher.conn.send(wire.LauncherReady(pid=os.getpid()))
    launcher.serve()


if __name__ == "__main__":
    main()
