"""One call on every rank: send it, gather the replies, and turn failures into the kernel's errors.

``Call`` holds the state of one call (the generation it runs on, which ranks are pending,
their results and reports) so the cluster's own code is about starting and keeping ranks.
"""
from __future__ import annotations

import signal
import sys
import time

from . import deadlock
from .errors import RankDeadlock, RankDied, RankError, RankReport, RankTimeout, interrupted
from .procs import readable
from .reaper import describe
from .tracker import add_traffic, in_flight

ERROR_GRACE_S = 0.25  # after the first failure, how long other ranks may take to report theirs
INTERRUPT_GRACE_S = 1.0  # after the stop button, how long ranks may take to unwind


class Call:
    """A message sent to every rank of ``cluster``'s current generation, and what came back."""

    def __init__(self, cluster, timeout: float | None):
        self.cluster, self.gen, self.timeout = cluster, cluster._gen, timeout
        n = cluster.world_size
        self.pending: set[int] = set(range(n))
        self.results: list = [None] * n
        self.observed: list = [None] * n  # per rank: what each observer of the call saw
        self.reports: dict[int, RankReport] = {}
        self.traffic: dict[int, dict] = {}  # rank -> the call's messages and collectives
        self.first_failure: float | None = None
        self.left: dict[int, list] = {}  # rank -> (pid, name) its script left running, now stopped
        self._last_verdict = None  # the deadlock check's last verdict (see _judge)
        self._asked = False  # a probe is out, not yet judged

    def run(self, message: bytes) -> list:
        """Send ``message`` to every rank; the results by rank, or RankError/RankDied/RankTimeout."""
        __tracebackhide__ = True
        try:
            for conn in self.gen.task:
                conn.send_bytes(message)
            self._collect()
        except KeyboardInterrupt:
            raise interrupted(self._on_interrupt()) from None  # one message, no pool frames
        finally:
            self.cluster._printer.flush()
            for rank in sorted(self.left):
                who = f"rank {rank}'s script"
                print(f"dpcourse: {describe(who, self.left[rank])}.", file=sys.stderr)
        return self.results

    def _collect(self) -> None:
        __tracebackhide__ = True
        start = time.monotonic()
        self.start, next_probe = start, start + deadlock.PROBE_S
        while self.pending:
            now = time.monotonic()
            if self.first_failure is not None and now - self.first_failure > ERROR_GRACE_S:
                break
            if self.timeout is not None and now - start > self.timeout:
                self._fail(RankTimeout)
            if self.first_failure is None and self.cluster.find_deadlocks:
                self._judge()
                if now >= next_probe:
                    self._ask()
                    next_probe = now + deadlock.PROBE_S
            wait_s = 0.05 if self.first_failure else 0.1
            for rank, msg in self.cluster._link.poll(self.gen, self.pending, wait_s):
                self.pending.discard(rank)
                self.reports[rank] = self._report(rank, msg)
                if self.reports[rank].state != "finished" and self.first_failure is None:
                    self.first_failure = time.monotonic()
        if self.first_failure is not None:
            died = any(r.state == "died" for r in self.reports.values())
            self._fail(RankDied if died else RankError)
        left = self._left_in_flight()
        if left:  # the call went well; what it left may be meant for the next call (or not)
            self.cluster._printer.flush()
            print("dpcourse: the call returned, but " + "; ".join(left) + ". The next call's "
                  "matching send, receive or collective will meet it; if that is not what you meant, "
                  "cluster.restart() drops it.", file=sys.stderr)

    def _judge(self) -> None:
        """The deadlock check (see ``deadlock``): once every running rank answered the last
        probe, judge; raise RankDeadlock when the call can never finish (the same verdict on
        two probes in a row, with no progress between)."""
        __tracebackhide__ = True
        if not self._asked:
            return
        answers = {r: self.cluster._link.waits.get(r) for r in self.pending}
        finished = {r for r, rep in self.reports.items() if rep.state in ("finished", "exited")}
        if any(a is None for a in answers.values()):
            return  # not all in yet
        self._asked = False
        if not all(a["running"] for a in answers.values()) or \
                any(self.traffic.get(r) is None for r in finished):
            self._last_verdict = None
            return
        this_call = {**{r: self.traffic[r] for r in finished},
                     **{r: a["traffic"] for r, a in answers.items()}}
        found = deadlock.verdict({r: a["wait"] for r, a in answers.items()}, finished,
                                 add_traffic(self.cluster._carried, this_call), self.cluster.world_size)
        seen = repr(sorted(answers.items())) if found else None
        if found and seen == self._last_verdict:
            self._deadlock(*found)
        self._last_verdict = seen

    def _ask(self) -> None:
        """Probe: ask every running rank what it waits in (answers arrive on the control channel)."""
        self.cluster._link.waits.clear()
        self._asked = True
        for rank in self.pending:
            try:
                self.gen.control[rank].send(("wait",))
            except OSError:
                pass

    def _deadlock(self, lines: list[str], kinds: set[str]):
        __tracebackhide__ = True
        waited = time.monotonic() - self.start
        self.reports.update(self._stuck_reports(0.5))
        self.cluster._printer.flush()
        self.cluster._restart()
        ordered = [self.reports[r] for r in sorted(self.reports)]
        raise RankDeadlock(ordered, waited, self.timeout, lines, deadlock.hint(kinds))

    def _left_in_flight(self) -> list[str]:
        """Messages or collectives still in flight once every rank has replied, counted over
        the calls since the ranks started (a send in one call may meet its receive in the next)."""
        if len(self.traffic) < self.cluster.world_size or None in self.traffic.values():
            return []  # a rank died (restarted anyway), or its traffic is unknown
        total = add_traffic(self.cluster._carried, self.traffic)
        left = in_flight(total)
        self.cluster._carried = total if left else {}
        return left

    def _report(self, rank: int, msg) -> RankReport:
        """What a rank's reply (None: the rank died) says; notes a destroyed process group."""
        cluster = self.cluster
        if msg is None:
            return RankReport(rank, "died", cluster._link.exit_text(self.gen, rank),
                              cluster._link.crash_log(self.gen, rank))
        intact, self.traffic[rank], left = msg[-1]  # the last item of every reply
        if left:
            self.left[rank] = left
        if not intact:  # the pool's process group was destroyed
            cluster._group_lost.add(rank)
        if msg[0] == "ok":
            self.results[rank], self.observed[rank] = msg[2], msg[3]
            return RankReport(rank, "finished", "finished")
        if msg[0] == "exited":
            self.results[rank], self.observed[rank] = msg[2], msg[3]
            return RankReport(rank, "exited", f"exited with code {msg[2]}")
        if msg[0] == "raised":
            return RankReport(rank, "raised", "raised " + msg[2], msg[3], msg[4])
        return RankReport(rank, "interrupted", "was interrupted")

    def _stuck_reports(self, wait_s: float) -> dict[int, RankReport]:
        """Ask still-running ranks where they are (stack + collective in progress)."""
        gen, pending = self.gen, self.pending
        for rank in pending:
            try:
                gen.control[rank].send(("status",))
            except OSError:
                pass
        found, deadline = {}, time.monotonic() + wait_s
        while len(found) < len(pending) and time.monotonic() < deadline:
            for conn in readable([gen.control[r] for r in pending if r not in found], 0.05):
                rank = gen.control.index(conn)
                status = self.cluster._link.pump_control(gen, rank)
                if status is not None:
                    found[rank] = RankReport(rank, "running", status["collective"], status["stack"])
        for rank in pending:
            found.setdefault(rank, RankReport(rank, "running", "did not answer (blocked outside Python?)"))
        return found

    def _fail(self, error):
        __tracebackhide__ = True
        restarted = bool(self.pending) or error is RankDied
        left = [] if restarted else self._left_in_flight()
        if self.pending:
            self.reports.update(self._stuck_reports(1.0 if error is RankTimeout else 0.3))
        self.cluster._printer.flush()
        if restarted or left:
            self.cluster._restart()
        ordered = [self.reports[r] for r in sorted(self.reports)]
        if error is RankTimeout:
            raise RankTimeout(ordered, self.timeout)
        for r in ordered:
            if r.state == "running":
                r.summary = f"was stopped while {r.summary}" if r.summary.startswith("waiting") else \
                    "was stopped while running"
                r.traceback = ""
        raise error(ordered, restarted or bool(left), left)

    def _on_interrupt(self) -> str:
        """The stop button: interrupt the ranks' Python code; restart any that do not return.
        Returns what happened, one line."""
        cluster, gen, pending = self.cluster, self.gen, self.pending
        try:
            where = self._stuck_reports(0.3) if pending else {}
            cluster._launcher.signal([gen.pids[r] for r in pending], signal.SIGINT)
            deadline = time.monotonic() + INTERRUPT_GRACE_S
            while pending and time.monotonic() < deadline:
                for rank, msg in cluster._link.poll(gen, set(pending), 0.05):
                    pending.discard(rank)
                    if msg is not None:
                        self.traffic[rank] = msg[-1][1]
                        if msg[-1][2]:
                            self.left[rank] = msg[-1][2]
            notes = [f"rank {r} was {where[r].summary}" for r in sorted(where)
                     if where[r].summary.startswith("waiting")]
            left = [] if pending else self._left_in_flight()
            if pending or left:
                cluster._restart()
                notes += left + ["the ranks were restarted"]
            return "; ".join(["the call was interrupted"] + notes + ["the cluster is ready."])
        except BaseException:
            cluster._restart()  # whatever happened, leave a usable pool behind
            return "the call was interrupted, and the ranks were restarted; the cluster is ready."
