"""The kernel's end of one generation of ranks: their replies, their output, how they ended.

Runs in the kernel. ``Cluster`` and ``Call`` read every rank through one ``RankLink``: ``poll``
yields replies while showing each rank's output as it arrives; ``pump_control`` drains a
rank's control channel (output lines, status answers); ``exit_text`` and ``crash_log`` say
how a dead rank ended.
"""
from __future__ import annotations

import os
import time

from .. import wire
from ..errors import ClusterError
from .printer import RankPrinter
from ...processes import describe_exit
from .procs import Generation, LauncherProcess, MemoryWatch, readable


class RankLink:
    """Reads the ranks of a generation for the kernel (replies, output, exits)."""

    def __init__(self, launcher: LauncherProcess, printer: RankPrinter, memory: MemoryWatch, crash_dir: str):
        self.launcher, self.printer, self.memory, self.crash_dir = launcher, printer, memory, crash_dir
        self.oom_first = True  # the ranks volunteer to the OOM killer (False: the platform cannot)
        self.waits: dict[int, wire.Waiting] = {}  # rank -> its answer to the last AskWait probe
        self.ended: dict[int, wire.Reply] = {}  # rank -> how its script ended (wire.ScriptEnded), this call

    def poll(self, gen: Generation, pending: set[int], timeout: float):
        """Show rank output; yield (rank, message or None if the rank died) from pending ranks:
        ``wire.Reply`` during a call, ``Imported``/``Ready``/``InitError`` while starting."""
        tasks = {gen.task[r]: r for r in pending}
        controls = {c: r for r, c in enumerate(gen.control)}
        ready = readable(list(tasks) + list(controls) + [self.launcher.conn], timeout)
        for conn in ready:
            if conn in controls:
                self.pump_control(gen, controls[conn])
            elif conn is self.launcher.conn:
                self.launcher.poll_one()
        for conn in ready:
            if conn in tasks:
                rank = tasks[conn]
                self.pump_control(gen, rank)  # output written before the reply comes first
                try:
                    yield rank, conn.recv()
                except (EOFError, OSError):
                    yield rank, None
        self.printer.tick()

    def pump_control(self, gen: Generation, rank: int) -> wire.Status | None:
        """Show what rank ``rank`` printed; return its status answer if one came, else None."""
        conn, status = gen.control[rank], None
        try:
            while conn.poll(0):
                match conn.recv():
                    case wire.Output(stream=stream, text=text):
                        self.printer.feed(rank, stream, text)
                    case wire.Status() as answer:
                        status = answer
                    case wire.Waiting() as answer:  # an answer to the deadlock check's probe
                        self.waits[rank] = answer
                    case wire.ScriptEnded(reply=reply):  # the rank now joins the pool's group again
                        self.ended[rank] = reply
                    case other:  # the rank and the kernel disagree on the control channel
                        raise ClusterError(f"rank {rank} sent {other!r} on its control socket, which "
                                           "carries Output, Status, Waiting and ScriptEnded only")
        except (EOFError, OSError):
            pass
        return status

    def exit_text(self, gen: Generation, rank: int, wait_s: float = 0.5) -> str:
        """How a dead rank ended, e.g. 'was killed by SIGKILL (pid 123)' plus an OOM hint."""
        pid = gen.pids[rank]
        deadline = time.monotonic() + wait_s
        while pid not in self.launcher.exited and time.monotonic() < deadline:
            if self.launcher.conn.poll(0.02):
                self.launcher.poll_one()
        status = self.launcher.exited.get(pid)
        words = "".join(self.launcher.last_words.get(pid, ("", "")))
        aborted = "terminate called" in words or "what():" in words
        return (describe_exit(status) + f" (pid {pid})"
                + (": C++ ended it on an exception nothing caught, whose what() is printed above"
                   if aborted else "")
                + self.memory.kill_hint(self.launcher.peaks.get(pid), status, self.oom_first))

    def last_words(self, gen: Generation, rank: int) -> None:
        """Show what a dead rank wrote that its output thread had not sent (the launcher read it
        out of the rank's pipes): the end of a C++ abort's message, say."""
        out, err = self.launcher.last_words.pop(gen.pids[rank], ("", ""))
        for stream, text in (("stdout", out), ("stderr", err)):
            if text:
                self.printer.feed(rank, stream, text)
        self.printer.flush()

    def crash_log(self, gen: Generation, rank: int) -> str:
        """What faulthandler wrote when the rank crashed (a segfault's Python stack), if anything."""
        path = os.path.join(self.crash_dir, f"generation{gen.number}-rank{rank}.log")
        try:
            with open(path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""
