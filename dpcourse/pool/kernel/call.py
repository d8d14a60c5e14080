"""One call on every rank: send it, gather the replies, and say what the cluster must do next.

Runs in the kernel. ``Call`` holds the state of one call (the generation it runs on, which
ranks are pending, their results and reports) and returns an ``Outcome``: the results, the
error to raise, and what the call changed for the cluster (process groups lost, traffic
still in flight, whether the ranks must be replaced). ``Cluster`` applies it, so the
cluster's own state is changed in one place, and a call is read without the cluster's code.

What the replies mean is decided by pure functions of plain data, which a table tests
without a process: ``replied`` (one rank's reply: its report and result), ``failure`` (which
error a failed call raises, and whether the ranks must go) and ``ending`` (that error, worded
from every rank's report). ``Call`` gathers the data and applies what they decide.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field, replace

from . import deadlock
from .. import wire
from ..errors import ClusterError, RankDeadlock, RankDied, RankError, RankReport, RankTimeout
from ..errors import interrupted, wait_hint
from .link import RankLink
from .procs import Generation, readable
from ..reaper import describe
from .traffic import add_traffic, in_flight

ERROR_GRACE_S = 0.25  # after the first failure, how long other ranks may take to report theirs
REJOIN_S = 30.0  # after a script failed on every rank still in the call: how long they may take to rejoin
INTERRUPT_GRACE_S = 1.0  # after the stop button, how long ranks may take to unwind


@dataclass
class Outcome:
    """How a call ended, for ``Cluster`` to apply in this order: note the lost process groups
    and the traffic carried, restart the ranks if asked, print the notes, raise ``error``."""

    results: list                  # by rank: each rank's return value (None where it failed)
    observed: list                 # by rank: [observer.result() for each observer of the call]
    reports: dict = field(default_factory=dict)  # rank -> RankReport: each rank that replied or was asked
    group_lost: set = field(default_factory=set)  # ranks whose default process group rank code destroyed
    carried: dict = field(default_factory=dict)   # rank -> traffic still in flight after the call
    restart: bool = False          # the ranks must be killed and replaced before the next call
    notes: list = field(default_factory=list)     # lines for stderr, once the ranks' output is out
    error: BaseException | None = None  # raised in the kernel once the rest is applied


@dataclass(frozen=True)
class Replied:
    """What one rank's reply says: its ``report``, and -- where it returned (a function's value,
    a script's exit code) -- its ``value`` and its observers' results, ``observed``."""

    report: RankReport
    returned: bool = False
    value: object = None
    observed: list | None = None


def replied(rank: int, reply: wire.Reply) -> Replied:
    """How rank ``rank``'s reply to a call reads (a pure function of the reply)."""
    match reply:
        case wire.Finished(value=value, observed=observed):
            return Replied(RankReport(rank, "finished", "finished"), True, value, observed)
        case wire.Exited(code=code, observed=observed):
            return Replied(RankReport(rank, "exited", f"exited with code {code}"), True, code, observed)
        case wire.Raised(summary=summary, traceback=traceback, exception=exception):
            return Replied(RankReport(rank, "raised", "raised " + summary, traceback, exception))
        case _:  # wire.Interrupted: the stop button's SIGINT reached the call
            return Replied(RankReport(rank, "interrupted", "was interrupted"))


def failure(reports: dict[int, RankReport], pending: set[int], timed_out: bool = False
            ) -> tuple[type[ClusterError] | None, bool]:
    """Which error a call raises from the ``reports`` of the ranks that replied (or died), with
    ``pending`` ranks still inside it, and whether the ranks must be restarted whatever the call
    left in flight: ``RankTimeout`` after the timeout; None while every report says "finished"
    (no rank failed); ``RankDied`` when a rank died (restarted); else ``RankError`` (restarted
    while a rank is still inside the call: it is stopped, as torchrun stops the others)."""
    if timed_out:
        return RankTimeout, bool(pending)
    if all(r.state == "finished" for r in reports.values()):
        return None, False
    died = any(r.state == "died" for r in reports.values())
    return (RankDied if died else RankError), bool(pending) or died


@dataclass(frozen=True)
class Ending:
    """How a failed call ends: the ``error`` it raises, whether the ranks are ``restart``ed, and
    every rank's report as the error tells it."""

    error: ClusterError
    restart: bool
    reports: dict


def ending(error: type[ClusterError], reports: dict[int, RankReport], restarted: bool, left: list[str],
           first_failed: int | None = None, timeout: float | None = None, undecided: str = "") -> Ending:
    """The error of a failed call (a pure function): ``error`` (from ``failure``), every rank's
    report (a rank still inside: "running", where it waits), ``restarted`` (``failure``'s say),
    ``left``: what the call left in flight (the ranks go too); ``first_failed``: the rank whose
    failure came first; ``timeout`` and ``undecided`` (why no deadlock was found) for a timeout.
    A rank still running is said to have been stopped, as it is."""
    restart = restarted or bool(left)
    ordered = [reports[r] for r in sorted(reports)]
    if error is RankTimeout:
        return Ending(RankTimeout(ordered, timeout, undecided), restart, dict(reports))
    ordered = [_stopped(r) if r.state == "running" else r for r in ordered]
    return Ending(error(ordered, restart, left, first_failed), restart, {r.rank: r for r in ordered})


def _stopped(report: RankReport) -> RankReport:
    """A rank still inside a failed call, as the error tells it: stopped while it waited, or ran."""
    waiting = report.summary.startswith("waiting")
    return replace(report, summary=f"was stopped while {report.summary}" if waiting else "was stopped while running",
                   traceback="")


class Call:
    """A task sent to every rank of generation ``gen``, and what came back.

    ``link``: the kernel's reader of the ranks (their replies, output and exits); ``carried``:
    the traffic earlier calls left in flight (rank -> traffic, see ``traffic``); ``timeout``:
    seconds, None for no limit; ``find_deadlocks``: probe running ranks (see ``deadlock``).
    """

    def __init__(self, gen: Generation, link: RankLink, timeout: float | None, carried: dict,
                 find_deadlocks: bool = True):
        self.gen, self.link, self.timeout = gen, link, timeout
        self.find_deadlocks = find_deadlocks
        self.world_size = n = len(gen.pids)
        self.pending: set[int] = set(range(n))
        self.outcome = Outcome([None] * n, [None] * n, carried=carried)
        self.reports = self.outcome.reports
        self.traffic: dict[int, dict] = {}  # rank -> the call's messages and collectives
        self.threads: dict[int, tuple] = {}  # rank -> the learner's threads still running when it replied
        self.ended: dict[int, wire.Reply] = {}  # rank -> how its script ended, while it rejoins the pool's group
        self.first_failure: float | None = None
        self.first_failed: int | None = None  # the rank whose failure came first
        self.left: dict[int, list] = {}  # rank -> (pid, name) its script left running, now stopped
        self._last_verdict = None  # the deadlock check's last verdict (see _judge)
        self._asked = False  # a probe is out, not yet judged
        link.waits.clear()
        link.ended.clear()

    def run(self, message: bytes) -> Outcome:
        """Send ``message`` (a pickled ``wire.Task``) to every rank; how the call ended."""
        try:
            for conn in self.gen.task:
                conn.send_bytes(message)
            self._collect()
        except KeyboardInterrupt:
            # one message, no pool frames (the cluster raises it outside any handler)
            self.outcome.error = interrupted(self._on_interrupt())
        finally:
            self.link.printer.flush()
        for rank in sorted(self.left):
            who = f"rank {rank}'s script"
            self.outcome.notes.append(f"dpcourse: {describe(who, self.left[rank])}.")
        return self.outcome

    def _collect(self) -> None:
        start = time.monotonic()
        self.start, next_probe = start, start + deadlock.PROBE_S
        while self.pending:
            now = time.monotonic()
            self._note_ended()
            if self.first_failure is not None and now - self.first_failure > ERROR_GRACE_S:
                if not self.pending <= set(self.ended) or now - self.first_failure > REJOIN_S:
                    break  # a rank is still inside the call: stopped, as torchrun stops the others
            if self.timeout is not None and now - start > self.timeout:
                return self._fail(timed_out=True)
            if self.first_failure is None and self.find_deadlocks:
                self._judge()
                if self.outcome.error is not None:  # a certain deadlock
                    return None
                if now >= next_probe:
                    self._ask()
                    next_probe = now + deadlock.PROBE_S
            self._receive(0.05 if self.first_failure else 0.1)
        if self.first_failure is not None:
            return self._fail()
        left = self._left_in_flight()
        if left:  # the call went well; what it left may be meant for the next call (or not)
            self.outcome.notes.append(
                "dpcourse: the call returned, but " + "; ".join(left) + ". The next call's matching "
                "send, receive or collective will meet it; if that is not what you meant, "
                "cluster.restart() drops it.")
        return None

    def _note_ended(self) -> None:
        """A rank's script has ended (``wire.ScriptEnded``): it issues nothing more in the call, and
        a failure counts from now, not from its reply, which waits until every rank rejoins."""
        for rank, reply in list(self.link.ended.items()):
            if rank in self.pending and rank not in self.ended:
                self.ended[rank] = reply
                self.reports[rank] = self._report(rank, reply, rejoining=True)
                if self.reports[rank].state != "finished" and self.first_failure is None:
                    self.first_failure, self.first_failed = time.monotonic(), rank

    def _receive(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` seconds for replies; note each one's report."""
        for rank, reply in self.link.poll(self.gen, self.pending, wait_s):
            self.pending.discard(rank)
            self.reports[rank] = self._report(rank, reply)
            if self.reports[rank].state != "finished" and self.first_failure is None:
                self.first_failure, self.first_failed = time.monotonic(), rank

    def _judge(self) -> None:
        """The deadlock check (see ``deadlock``): once every running rank answered the last
        probe, judge; fail with RankDeadlock when the call can never finish (the same verdict
        on two probes in a row, with no progress between)."""
        if not self._asked:
            return
        inside = self.pending - set(self.ended)
        answers = {r: self.link.waits.get(r) for r in inside}
        if any(a is None for a in answers.values()):
            return  # not all in yet
        self._asked = False
        finished = {r for r, rep in self.reports.items() if rep.state in ("finished", "exited")}
        if not all(a.running for a in answers.values()) or any(self.traffic.get(r) is None for r in finished):
            self._last_verdict = None
            return
        busy = {r for r in finished if self.threads.get(r)}  # its threads may still communicate
        waits = {**{r: None for r in busy}, **{r: a.wait for r, a in answers.items()}}
        this_call = {**{r: self.traffic[r] for r in finished}, **{r: a.traffic for r, a in answers.items()}}
        found = deadlock.verdict(waits, finished - busy, self.outcome.carried, this_call)
        seen = repr((sorted(answers.items()), sorted(finished))) if found else None
        if found and seen == self._last_verdict:
            self._deadlock(found)
        self._last_verdict = seen

    def _ask(self) -> None:
        """Probe: ask every running rank what it waits in (answers arrive on the control channel)."""
        self.link.waits.clear()
        self._asked = True
        self._tell(self.pending, wire.AskWait())

    def _tell(self, ranks, message) -> None:
        """Send ``message`` on the control socket of each of ``ranks`` still listening."""
        for rank in ranks:
            try:
                self.gen.control[rank].send(message)
            except OSError:
                pass

    def _deadlock(self, found: deadlock.Verdict) -> None:
        waited = time.monotonic() - self.start
        self.reports.update(self._stuck_reports(0.5))
        self.outcome.restart = True
        ordered = [self.reports[r] for r in sorted(self.reports)]
        self.outcome.error = RankDeadlock(ordered, waited, self.timeout, found.lines, wait_hint(set(found.kinds)))

    def _left_in_flight(self) -> list[str]:
        """Messages or collectives still in flight once every rank has replied, counted over
        the calls since the ranks started (a send in one call may meet its receive in the next).
        While a rank's threads of the learner's still run, they may still send: what is in
        flight is carried, and said only once it is certain."""
        if len(self.traffic) < self.world_size or None in self.traffic.values():
            return []  # a rank died (restarted anyway), or its traffic is unknown
        total = add_traffic(self.outcome.carried, self.traffic)
        left = in_flight(total)
        self.outcome.carried = total if left else {}
        if any(self.threads.values()):
            return []
        return left

    def _report(self, rank: int, reply: wire.Reply | None, rejoining: bool = False) -> RankReport:
        """What a rank's reply (None: the rank died) says; notes a destroyed process group.
        ``rejoining``: how its script ended, told before it joins the pool's group again."""
        if reply is None:
            how = self.link.exit_text(self.gen, rank)
            self.link.last_words(self.gen, rank)
            return RankReport(rank, "died", how, self.link.crash_log(self.gen, rank))
        self._note_after(rank, reply.after)
        if not reply.after.intact and not rejoining:  # the pool's process group was destroyed
            self.outcome.group_lost.add(rank)
        said = replied(rank, reply)
        if said.returned:
            self.outcome.results[rank], self.outcome.observed[rank] = said.value, said.observed
        return said.report

    def _note_after(self, rank: int, after: wire.After) -> None:
        """Keep what a reply says the call left behind: its traffic, a script's processes."""
        self.traffic[rank] = after.traffic
        self.threads[rank] = after.threads
        if after.left:
            self.left[rank] = after.left

    def _stuck_reports(self, wait_s: float) -> dict[int, RankReport]:
        """Ask the ranks still inside the call where they are (stack + collective in progress);
        one whose script has ended keeps its report of how."""
        gen, pending = self.gen, self.pending - set(self.ended)
        self._tell(pending, wire.AskStatus())
        found, deadline = {}, time.monotonic() + wait_s
        while len(found) < len(pending) and time.monotonic() < deadline:
            for conn in readable([gen.control[r] for r in pending if r not in found], 0.05):
                rank = gen.control.index(conn)
                status = self.link.pump_control(gen, rank)
                if status is not None:
                    found[rank] = RankReport(rank, "running", status.collective, status.stack)
        for rank in pending:
            found.setdefault(rank, RankReport(rank, "running", "did not answer (blocked outside Python?)"))
        return found

    def _fail(self, timed_out: bool = False) -> None:
        """End a failed call (see ``failure`` and ``ending``): ask the ranks still inside it where
        they are, and note the error and whether the ranks must go."""
        error, restarted = failure(self.reports, self.pending, timed_out)
        left = [] if restarted else self._left_in_flight()
        if self.pending:
            self.reports.update(self._stuck_reports(1.0 if timed_out else 0.3))
        self.link.printer.flush()
        undecided = self._undecided() if timed_out else ""
        error = error or RankError  # a rank's report said it failed (first_failure), then it finished
        end = ending(error, self.reports, restarted, left, self.first_failed, self.timeout, undecided)
        self.reports.update(end.reports)
        self.outcome.restart, self.outcome.error = end.restart, end.error

    def _undecided(self) -> str:
        """For a timeout: why the deadlock finder decided nothing, each rank's reason in its words."""
        if not self.find_deadlocks:
            return ""
        whys = [f"rank {r} {a.why}" for r, a in sorted(self.link.waits.items())
                if r in self.pending and a.wait is None and a.why]
        whys += [f"rank {r} returned, but its threads {', '.join(map(repr, self.threads[r]))} still run"
                 for r in sorted(self.threads) if self.threads[r] and r not in self.pending]
        return deadlock.UNSEEN + ("" if not whys else " Here: " + "; ".join(whys) + ".")

    def _on_interrupt(self) -> str:
        """The stop button: interrupt the ranks' Python code; restart any that do not return.
        Returns what happened, one line."""
        gen, pending = self.gen, self.pending
        try:
            where = self._stuck_reports(0.3) if pending else {}
            self.link.launcher.signal([gen.pids[r] for r in pending], signal.SIGINT)
            deadline = time.monotonic() + INTERRUPT_GRACE_S
            while pending and time.monotonic() < deadline:
                for rank, reply in self.link.poll(gen, set(pending), 0.05):
                    pending.discard(rank)
                    if reply is not None:
                        self._note_after(rank, reply.after)
            notes = [f"rank {r} was {where[r].summary}" for r in sorted(where)
                     if where[r].summary.startswith("waiting")]
            left = [] if pending else self._left_in_flight()
            if pending or left:
                self.outcome.restart = True
                notes += left + ["the ranks were restarted"]
            return "; ".join(["the call was interrupted"] + notes + ["the cluster is ready."])
        except BaseException:
            self.outcome.restart = True  # whatever happened, leave a usable pool behind
            return "the call was interrupted, and the ranks were restarted; the cluster is ready."
