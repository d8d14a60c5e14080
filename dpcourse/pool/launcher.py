"""The launcher: a small parent process, with torch already imported, that forks the ranks.

(Or spawns them: with ``start_method="spawn"`` -- the default where forking a process that
imported torch is unsafe, macOS -- each rank is a fresh interpreter, started ahead of need
as a *spare* that imports torch and then waits for its spec on stdin; see ``_spawn_rank``.)

Why a separate parent and not the kernel: forking the kernel is unsafe (CUDA may be
initialised there; a used intra-op thread pool hangs the child), and spawning fresh
interpreters costs a full ``import torch`` (2-3 s) every time the ranks are restarted.
The launcher imports torch once, never runs an op or touches CUDA, and forks ranks on
request in ~0.1 s. It is the ranks' parent, so only it can kill and reap them by PID
without any risk of hitting a reused PID.

It dies with the kernel (death signal + end-of-file on its socket) and kills its ranks
first; the ranks also carry a death signal, so nothing outlives the kernel.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
from multiprocessing.connection import Connection, wait

from . import reaper


def _fork_rank(spec: dict, rank: int, fds: list[int], inherited: list[int], launcher_pid: int) -> int:
    pid = os.fork()
    if pid:
        try:
            os.setpgid(pid, pid)  # the rank leads a process group (both sides set it: no race)
        except OSError:
            pass
        return pid
    reaper.own_group()
    # Child: keep only this rank's two sockets; drop the launcher's own descriptors so
    # that only the launcher holds its socket to the kernel.
    mine = fds[2 * rank: 2 * rank + 2]
    for fd in fds + inherited:
        if fd not in mine:
            os.close(fd)
    from . import rank as rank_module

    rank_module.main(spec, rank, mine[0], mine[1], launcher_pid)
    os._exit(5)  # not reached


# Popen's process_group (Python 3.11+) is safe with the launcher's threads; preexec_fn is not.
_OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": reaper.own_group}


def _spawn_rank(rank: int, fds: list[int], launcher_pid: int):
    """A fresh interpreter for ``rank``: it imports torch, then reads its spec from stdin."""
    import subprocess

    mine = fds[2 * rank: 2 * rank + 2]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = f"import sys; sys.path.insert(0, {root!r}); from dpcourse.pool.rank import spawned_main; spawned_main()"
    return subprocess.Popen([sys.executable, "-c", code, str(rank), *map(str, mine), str(launcher_pid)],
                            pass_fds=mine, stdin=subprocess.PIPE, close_fds=True,
                            **_OWN_GROUP)  # each rank leads a process group of its own (see reaper)


def _peak_bytes(usage) -> int:
    """A reaped child's peak resident memory (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    if usage is None:
        return 0
    return usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (OSError, ValueError):
        pass  # the spare died already (the kernel hears of it as an exit), or was reaped


class Launcher:
    def __init__(self, sock: socket.socket, start_method: str = "fork"):
        self.sock = sock
        self.start_method = start_method
        self.conn = Connection(os.dup(sock.fileno()))
        self.children: dict[int, int] = {}  # pid -> pidfd (or -1 without pidfd support)
        self.spawned: dict[int, object] = {}  # pid -> Popen of a spawned rank (reaped here, by PID)
        self.subreaper = reaper.set_subreaper()  # what the ranks leave becomes ours (Linux)

    def reap(self) -> list[tuple[int, int, int]]:
        """Collect exited children; return (pid, wait status, peak resident bytes) for each rank.
        Processes adopted as the ranks' subreaper (see ``reaper``) are reaped without a report."""
        gone = []
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            if pid in self.children:
                self._forget(pid, status)
                gone.append((pid, status, _peak_bytes(usage)))
        return gone

    def _forget(self, pid: int, status: int) -> None:
        fd = self.children.pop(pid)
        if fd >= 0:
            os.close(fd)
        popen = self.spawned.pop(pid, None)
        if popen is not None:  # reaped by PID here: tell the Popen, so it never waits itself
            popen.returncode = os.waitstatus_to_exitcode(status) if status else 0
            if popen.stdin:
                popen.stdin.close()

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
            gone.append((pid, status, _peak_bytes(usage)))
        return gone, self.sweep(grace_s=0.2, owner=owner)

    def sweep(self, grace_s: float = reaper.GRACE_S, owner: dict | None = None) -> list:
        """Stop the processes the ranks left (adopted by this subreaper, or listed in ``owner``):
        (pid, the rank's pid or the process group, name) of each."""
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
            reaper.stop(sorted(left), grace_s)
            self.reap()
            return [(pid, owner.get(pid, left[pid]), names[pid]) for pid in sorted(left)]
        except Exception:  # noqa: BLE001 -- never let the cleanup take the launcher down
            return []

    def handle(self, msg) -> bool:
        kind = msg[0]
        if kind == "spawn":
            spec = msg[1]
            _, fds, _, _ = socket.recv_fds(self.sock, 16, 2 * spec["world_size"])
            if self.start_method == "spawn":  # spares: they wait for "activate" and a spec
                popens = [_spawn_rank(r, fds, os.getpid()) for r in range(spec["world_size"])]
                pids = [p.pid for p in popens]
                self.spawned.update(zip(pids, popens))
            else:
                inherited = [self.sock.fileno(), self.conn.fileno()]
                inherited += [fd for fd in self.children.values() if fd >= 0]
                pids = [_fork_rank(spec, r, fds, inherited, os.getpid()) for r in range(spec["world_size"])]
            for fd in fds:
                os.close(fd)
            for pid in pids:
                self.children[pid] = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else -1
            self.conn.send(("spawned", pids))
        elif kind == "activate":  # spawned spares: here is your spec (a pickled dict)
            import threading

            for pid in msg[1]:  # written from threads: a spare still importing reads it later
                popen = self.spawned.get(pid)
                if popen is not None:
                    threading.Thread(target=_feed, args=(popen.stdin, msg[2]), daemon=True).start()
        elif kind == "signal":
            for pid in msg[2]:
                if pid in self.children:
                    os.kill(pid, msg[1])
        elif kind == "kill":
            self.conn.send(("killed", *self.kill(msg[1])))
        elif kind == "sweep":
            self.conn.send(("swept", self.sweep()))
        elif kind == "exit":
            return False
        return True

    def serve(self) -> None:
        try:
            while True:
                watched = [self.conn] + [fd for fd in self.children.values() if fd >= 0]
                timeout = None if all(fd >= 0 for fd in self.children.values()) else 0.05
                if self.subreaper:  # adopted processes that end are reaped within a second
                    timeout = 1.0 if timeout is None else timeout
                ready = wait(watched, timeout)
                exited = self.reap()
                if exited:
                    self.conn.send(("exited", exited))
                if self.conn in ready and not self.handle(self.conn.recv()):
                    break
        except (EOFError, OSError):
            pass  # the kernel is gone
        finally:
            self.kill(list(self.children))


def main() -> None:
    fd, kernel_pid, arm_death_signal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    start_method = sys.argv[4] if len(sys.argv) > 4 else "fork"
    # Ctrl-C in a terminal or the notebook's stop button must reach the ranks only
    # through the pool (which decides what to interrupt), never directly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if arm_death_signal:
        from .rank import set_death_signal

        set_death_signal(kernel_pid)
    sock = socket.socket(fileno=fd)
    if start_method == "fork":
        # Preload what every rank needs, once: this is what makes restarts cheap.
        import cloudpickle  # noqa: F401
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
        import torch.distributed.distributed_c10d  # noqa: F401

        from . import rank, wire  # noqa: F401

    launcher = Launcher(sock, start_method)
    launcher.conn.send(("launcher_ready", os.getpid()))
    launcher.serve()


if __name__ == "__main__":
    main()
