"""Exceptions the pool raises in the kernel, and the per-rank facts they carry.

Read in every process of the pool (``wire`` names ``SerializationError``), so it imports
nothing else of the pool's; ``wait_hint`` is the advice a hang ends with.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


def wait_hint(kinds: set[str]) -> str:
    """Advice for ranks stuck waiting, that matches the operation: ``kinds`` holds "p2p",
    "collective" or both."""
    parts = []
    if "p2p" in kinds:
        parts.append("A send completes when its peer calls the matching recv, and a recv when its peer "
                     "sends: check that\nevery send has its recv on the other rank (same pair of ranks, "
                     "same order).")
    if "collective" in kinds:
        parts.append("A collective waits until every rank calls the same one; check that all ranks\n"
                     "reach the same collectives in the same order.")
    return "\n".join(parts)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # dpcourse/
_TOOLING = (f"{os.sep}IPython{os.sep}", f"{os.sep}ipykernel{os.sep}")  # the notebook's own machinery


def _frame_place(filename: str, lineno: int, name: str) -> str:
    """Where a frame is, as IPython says it: "Cell In[3], line 4" for a notebook cell."""
    from ..torch_private import ipython_cell_numbers

    cells = ipython_cell_numbers()
    if filename in cells:
        return f"Cell In[{cells[filename]}], line {lineno}"
    return f'File "{filename}", line {lineno}, in {name}'


def learner_traceback(err: BaseException, name: str) -> list[str]:
    """``err`` as a notebook shows it, without the course's own frames (nor IPython's): the
    learner's lines that led to it, then ``name: message``. The ranks' tracebacks are in the
    message, already without the pool's frames."""
    import traceback

    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(_PACKAGE) and not any(t in f.filename for t in _TOOLING)
              and "run_cell_magic(" not in (f.line or "") and "run_line_magic(" not in (f.line or "")]
    lines = ["Traceback (most recent call last):"] if frames else []
    for f in frames:
        lines.append(_frame_place(f.filename, f.lineno, f.name))
        if f.line:
            lines.append(f"----> {f.line.strip()}")
    return lines + [f"\x1b[31m{name}\x1b[39m: {err}"]


class ClusterError(RuntimeError):
    """Something went wrong with the ranks or with a request to them."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows these lines instead of a traceback through the pool's files
        return learner_traceback(self, type(self).__name__)


class ClusterShutDown(ClusterError):
    """A call to a cluster after its ``shutdown()``: the notebook shows this one line (IPython's
    ``_render_traceback_``) that says what to run, not a traceback through the pool's code."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[31mClusterError\x1b[39m: {self}"]


ClusterShutDown.__name__ = ClusterShutDown.__qualname__ = "ClusterError"  # what a learner meets


class SerializationError(ClusterError, TypeError):
    """A function, argument or result could not be pickled (the message says which)."""


@dataclass
class RankReport:
    """What one rank was doing when a call ended badly.

    state: "finished", "raised", "exited" (a script's non-zero exit code), "died", "running"
    or "interrupted".
    """

    rank: int
    state: str
    summary: str = ""  # one line, e.g. "raised ValueError: bad shape" or "waiting in the 3rd all_reduce of this call"
    traceback: str = ""  # the remote traceback ("raised") or Python stack ("running")
    exception: BaseException | None = field(default=None, repr=False)

    def describe(self, with_trace: bool = True) -> str:
        head = f"rank {self.rank} {self.summary}".rstrip()
        if with_trace and self.traceback:
            body = "\n".join("    " + line for line in self.traceback.rstrip().splitlines())
            return f"{head}\n{body}"
        return head


# What a backend says on a rank whose peer went away (its process ended, or its group was torn
# down): a consequence of another rank's failure, not a cause of its own.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "NCCL communicator was aborted", "ncclRemoteError")


def lost_a_peer(report: RankReport) -> bool:
    """Whether a rank failed only because a peer did (its backend's words for a vanished peer)."""
    return report.state == "raised" and any(words in report.summary for words in _PEER_LOST)


def _format(title: str, reports: list[RankReport], note: str) -> str:
    lines = [title]
    lines += [r.describe() for r in reports]
    if note:
        lines.append(note)
    return "\n".join(lines)


class RankError(ClusterError):
    """One or more ranks raised an exception or died; ``failures`` maps rank -> RankReport."""

    def __init__(self, reports: list[RankReport], restarted: bool, in_flight: list[str] = (),
                 first: int | None = None):
        self.reports = {r.rank: r for r in reports}
        self.failures = {r.rank: r for r in reports if r.state in ("raised", "exited", "died")}
        self.restarted = restarted
        self.in_flight = list(in_flight)  # what the call left in flight, one line each
        bad = sorted(self.failures)
        title = f"{len(bad)} of {len(reports)} rank(s) failed: {', '.join(map(str, bad))}"
        echoes = [r for r in bad if lost_a_peer(self.failures[r])]
        causes = sorted(set(bad) - set(echoes), key=lambda r: (r != first, r))  # the first report first
        if causes and echoes:  # the cause first; the others only lost the rank that failed
            bad = causes + echoes
            title += (f" (rank{'s' if len(echoes) > 1 else ''} {', '.join(map(str, echoes))} only "
                      f"lost {'a peer' if len(causes) > 1 else f'rank {causes[0]}'}: "
                      f"the connection to it closed when it failed)")
        if self.in_flight:
            note = ("No rank was left running, but the call left messages or collectives in flight ("
                    + "; ".join(self.in_flight) + "), which the next call would meet. So the ranks "
                    "were restarted (variables kept on ranks are gone); the cluster is ready.")
        elif restarted:
            note = "The ranks were restarted (variables kept on ranks are gone); the cluster is ready."
        else:
            note = ("No rank was left running and nothing of the call is in flight, so the ranks "
                    "were kept; the cluster is ready.")
        failed = [self.reports[r] for r in bad]
        others = [r for r in reports if r.rank not in self.failures]
        text = _format(title, failed, "")
        if others:
            text += "\n" + "; ".join(r.describe(with_trace=False) for r in others)
        super().__init__(text + "\n" + note)


class RankDied(RankError):
    """A rank's process ended without reporting (killed by a signal, os._exit, a crash)."""


class RankTimeout(ClusterError):
    """Ranks did not finish within ``timeout``; ``reports`` says where each one was."""

    def __init__(self, reports: list[RankReport], timeout: float, undecided: str = ""):
        self.reports = {r.rank: r for r in reports}
        self.timeout = timeout
        summary = "; ".join(r.describe(with_trace=False) for r in reports)
        stuck = [r for r in reports if r.state == "running"]
        title = f"ranks did not finish within {timeout:g} s: {summary}"
        waits = [r.summary for r in stuck if r.summary.startswith("waiting in")]
        if waits:
            p2p = (" send of", " recv of", " isend of", " irecv of")
            hint = wait_hint({"p2p" if any(op in w for op in p2p) else "collective" for w in waits})
        else:  # no rank is in a collective: the advice above would mislead
            hint = ("No rank is waiting in a collective: a rank ran longer than the timeout (pass a\n"
                    "larger timeout=...), waited for something else, or was blocked in C++ code\n"
                    "that holds the GIL (a rank that did not answer).")
        if undecided:  # why the deadlock finder told nothing sooner
            hint += "\n" + undecided
        note = hint + "\nThe ranks were restarted (variables kept on ranks are gone); the cluster is ready."
        super().__init__(_format(title, stuck, note))


class RankDeadlock(RankTimeout):
    """The ranks can never finish the call (a certain deadlock, see ``deadlock``): raised in
    seconds instead of at the timeout; ``reports`` says where each rank was, ``waits`` why."""

    def __init__(self, reports: list[RankReport], waited_s: float, timeout: float | None,
                 waits: list[str], hint: str):
        self.reports = {r.rank: r for r in reports}
        self.timeout, self.waits = timeout, list(waits)
        stuck = [r for r in reports if r.state == "running"]
        others = [r for r in reports if r.state != "running"]
        limit = "no timeout" if timeout is None else f"the {timeout:g} s timeout"
        title = (f"the ranks can never finish this call (seen after {waited_s:.1f} s, instead of "
                 f"waiting out {limit}):\n" + "\n".join(waits))
        if others:
            title += "\n" + "; ".join(r.describe(with_trace=False) for r in others)
        note = hint + "\nThe ranks were restarted (variables kept on ranks are gone); the cluster is ready."
        ClusterError.__init__(self, _format(title, stuck, note))


class Interrupted(KeyboardInterrupt):
    """The stop button, handled by the pool: the notebook shows this one line (IPython's
    ``_render_traceback_``), not a traceback through the pool's code."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[31mKeyboardInterrupt\x1b[39m: {self}"]


Interrupted.__name__ = Interrupted.__qualname__ = "KeyboardInterrupt"  # what the learner pressed


def interrupted(text: str) -> KeyboardInterrupt:
    """The stop button's one message, raised ``from None`` where the pool caught the interrupt."""
    return Interrupted(text)
