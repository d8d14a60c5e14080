"""Kernel-side handles on the launcher process and on one generation of ranks.

A *generation* is one set of rank processes with one process group. After a failure the
pool kills the whole generation (by PID, through the launcher that forked it) and forks
a new one; the launcher, with torch already imported, lives as long as the cluster.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

# free_port is re-exported: bench/pool.py, test_browser and test_repository import it from here.
from ...processes import PACKAGE_ROOT, describe_exit, free_port  # noqa: F401
from .. import wire
from ..errors import ClusterError
from ..reaper import describe


@dataclass
class Generation:
    """One set of ranks: their PIDs and the kernel's ends of their sockets."""

    number: int
    pids: list[int]
    task: list[Connection]
    control: list[Connection]
    ready: bool = False
    imported: set = None  # spawned spares: the ranks that have imported torch

    def warm(self) -> bool:
        """Spawned spares: every rank has imported torch (reads their ``wire.Imported`` notes,
        the only thing a spare says on its task socket before it is activated)."""
        if self.imported is None:
            self.imported = set()
        for rank, conn in enumerate(self.task):
            try:
                while rank not in self.imported and conn.poll(0):
                    match conn.recv():
                        case wire.Imported():
                            self.imported.add(rank)
                        case other:
                            raise ClusterError(f"spare rank {rank} said {other!r} before it was "
                                               "activated; a spare says only Imported then")
            except (EOFError, OSError):
                return False
        return len(self.imported) == len(self.task)

    def close(self) -> None:
        for conn in self.task + self.control:
            conn.close()


class LauncherProcess:
    """The launcher: started with the kernel's own interpreter, talked to over a socketpair.

    The socketpair is anonymous: nothing listens on a port or a path, so no other process
    can connect to the pool's control channel (local-only by construction).
    """

    def __init__(self, start_timeout: float, start_method: str = "fork"):
        self.start_method = start_method
        self.sock, child = socket.socketpair()
        self.conn = Connection(os.dup(self.sock.fileno()))
        self._stderr = tempfile.TemporaryFile()
        arm = "1" if threading.current_thread() is threading.main_thread() else "0"
        code = (f"import sys; sys.path.insert(0, {PACKAGE_ROOT!r}); "
                "from dpcourse.pool.launcher import main; main()")
        self.popen = subprocess.Popen(
            [sys.executable, "-c", code, str(child.fileno()), str(os.getpid()), arm, start_method],
            pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=self._stderr, start_new_session=True)
        child.close()
        self.exited: dict[int, int] = {}  # pid -> wait status, reported by the launcher
        self.peaks: dict[int, int] = {}   # pid -> peak resident bytes (the kernel's ru_maxrss)
        self.last_words: dict[int, tuple[str, str]] = {}  # pid -> what it wrote, unsent, as it died
        try:
            self.reply(wire.LauncherReady, start_timeout, "its start")
        except ClusterError:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except OSError as err:
            raise ClusterError(f"the launcher process is gone ({err}); create a new Cluster") from err

    def request(self, msg, expect: type, timeout: float = 30.0, fds: list[int] = ()):
        """Send the request ``msg`` (then ``fds``, by SCM_RIGHTS, where it needs them) and return
        the launcher's answer, which must be an ``expect``: an answer of another type, or none
        within ``timeout`` seconds, raises ``ClusterError`` naming what was asked and what came."""
        self.send(msg)
        if fds:
            socket.send_fds(self.sock, [b"F"], fds)
        return self.reply(expect, timeout, type(msg).__name__)

    def reply(self, expect: type, timeout: float, asked: str):
        """The launcher's next message but exit reports, checked to be an ``expect`` (the answer
        to ``asked``; exit reports are recorded on the way)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                raise ClusterError(f"the launcher did not answer {asked} within {timeout:g} s "
                                   f"(a {expect.__name__} was due)")
            msg = self.poll_one()
            if msg is None:
                continue
            if not isinstance(msg, expect):
                raise ClusterError(f"the launcher answered {asked} with {msg!r}, "
                                   f"where a {expect.__name__} was due")
            return msg

    def poll_one(self):
        """Read one message; record and swallow exit reports (returns None for them), return
        anything else: an answer, which ``reply`` checks."""
        try:
            msg = self.conn.recv()
        except (EOFError, OSError) as err:
            code = self.popen.poll()
            raise ClusterError(
                f"the launcher process ended ({describe_exit(None) if code is None else code}); "
                f"create a new Cluster. Its last words:\n{self.stderr_text()}") from err
        match msg:
            case wire.Reaped(exits=exits):
                self._note_exits(exits)
                return None
            case _:  # an answer to a request: the requester checks it (see reply)
                return msg

    def _note_exits(self, exits) -> None:
        for pid, status, peak, out, err in exits:
            self.exited[pid], self.peaks[pid] = status, peak
            if out or err:
                self.last_words[pid] = (out, err)

    def spawn(self, spec: dict, number: int, spare: bool = False) -> Generation:
        """Start a generation of ranks. Forked ones start at once; spawned ones wait for
        ``wire.Activate`` to send them their spec. ``spare``: a spawned generation kept for a later
        restart -- it imports torch at low priority, after every older generation has."""
        n = spec["world_size"]
        pairs = [socket.socketpair() for _ in range(2 * n)]
        try:
            pids = self.request(wire.Spawn(spec=spec, spare=spare), wire.Spawned,
                                fds=[p[1].fileno() for p in pairs]).pids
        finally:
            for _, theirs in pairs:
                theirs.close()
        mine = [Connection(p[0].detach()) for p in pairs]
        return Generation(number, pids, mine[0::2], mine[1::2])

    def activate(self, spare: Generation, spec: dict, number: int) -> Generation:
        """Hand spawned spares their spec: they join the process group as generation ``number``."""
        import pickle

        self.send(wire.Activate(pids=spare.pids, spec=pickle.dumps(spec)))
        spare.number = number
        return spare

    def alive(self, gen: Generation) -> bool:
        """None of ``gen``'s processes has been reported as exited."""
        while self.conn.poll(0):
            self.poll_one()
        return not any(pid in self.exited for pid in gen.pids)

    def signal(self, pids: list[int], signum: int) -> None:
        self.send(wire.Signal(signum=signum, pids=pids))

    def kill(self, gen: Generation) -> None:
        """SIGKILL and reap a generation's ranks (the launcher is their parent), and stop what
        they started that still runs (see ``reaper``); say so if they had left anything."""
        killed = self.request(wire.Kill(pids=gen.pids), wire.Killed)
        self._note_exits(killed.exits)
        left = killed.left
        gen.close()
        if left:
            print(f"dpcourse: {describe(_whose(left, gen, 'the ranks'), [(p, n) for p, _, n in left])} "
                  "with the ranks.", file=sys.stderr)

    def sweep(self, gen: Generation, what: str = "script") -> None:
        """After a script: stop what its ranks started and left behind in a session of its own
        (the ranks stop the rest themselves); say so."""
        left = self.request(wire.Sweep(), wire.Swept).left
        if left:
            print(f"dpcourse: {describe(_whose(left, gen, 'the ' + what), [(p, n) for p, _, n in left])}.",
                  file=sys.stderr)

    def close(self, timeout: float = 5.0) -> None:
        try:
            self.conn.send(wire.Exit())
        except OSError:
            pass
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()  # our own child, by its Popen handle
            self.popen.wait()
        self.conn.close()
        self.sock.close()
        self._stderr.close()


def _whose(left: list, gen: Generation, default: str) -> str:
    """"rank 1's script" when every process left is in rank 1's process group, else ``default``."""
    ranks = {gen.pids.index(pgid) if pgid in gen.pids else None for _, pgid, _ in left}
    if len(ranks) == 1 and None not in ranks:
        return f"rank {ranks.pop()}" + ("'s script" if default.endswith("script") else "")
    return default


class MemoryWatch:
    """Why a rank died of a SIGKILL the pool did not send: likely Linux's out-of-memory killer
    (ranks volunteer as its first choice) when its peak resident memory was a large share of
    the machine's. The peak is what the operating system reports when the launcher reaps the
    rank (``wait4``'s ``ru_maxrss``: Linux and macOS alike), so nothing is sampled meanwhile.
    """

    LIKELY_OOM_FRACTION = 0.10  # a peak above this share of physical memory: "likely out of memory"

    def kill_hint(self, peak: int | None, status: int | None, oom_first: bool = True) -> str:
        """'' or, after SIGKILL, the rank's peak memory and whether that looks like an OOM kill."""
        if status is None or not os.WIFSIGNALED(status) or os.WTERMSIG(status) != signal.SIGKILL:
            return ""
        if not peak:
            return ""
        total = physical_memory()
        text = f" with {_gib(peak)} resident at its peak"
        if total and peak >= self.LIKELY_OOM_FRACTION * total:
            first = "ranks are its first choice" if oom_first else "the ranks could not volunteer as its first choice here"
            text += (f" ({100 * peak / total:.0f} % of this machine's {_gib(total)}): likely out of "
                     f"memory -- the OOM killer sends SIGKILL, and {first}; use a smaller model or "
                     "batch, or fewer ranks")
        return text


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (POSIX sysconf; None where it cannot say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def check_port(port: int) -> None:
    """Raise ``ClusterError`` if ``port`` on 127.0.0.1 is taken (a ``master_port`` the user chose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            raise ClusterError(
                f"master_port={port} is in use ({err.strerror}); pass master_port=None "
                "and the pool picks a free port") from err


def readable(conns, timeout: float) -> list:
    """The connections of ``conns`` with something to read within ``timeout`` seconds."""
    return wait(conns, timeout) if conns else []
