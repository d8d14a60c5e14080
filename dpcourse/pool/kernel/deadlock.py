"""Certain deadlocks, told in seconds instead of at the timeout.

Runs in the kernel, which knows more than torchrun: which ranks have *returned* from the call
(they will issue nothing more in it, and the next call cannot start before this one ends),
what each rank has sent, received and issued since the ranks started (the tracker's
``Traffic``, see ``dpcourse.tracking`` and ``traffic``), and -- asked every half second while
a call runs -- the operation each running rank's main thread is blocked in, as the tracker
recorded it (a ``Wait``: inside a blocking call, or in ``wait()`` on that operation's own
``Work``).

``verdict`` is a pure function of those records. A blocked operation can never complete when

* a receive, the j-th from rank P on its group, has fewer than j messages sent to it by P, and
  P has returned from the call (or is itself stuck: a cycle);
* a send, the j-th to P, has fewer than j receives posted for it by P (from it or from any
  rank), P returned or stuck;
* a collective, the k-th on its group, has a member that issued fewer than k there, that
  member returned or stuck;
* every member of the group is blocked in its k-th collective there, and they differ.

It decides nothing for a rank whose state says nothing certain: one computing, sleeping, or
waiting on anything the tracker did not see issued (a ``Future``, a ``Work`` of an earlier
call), one running threads of the learner's own (they may still communicate), or a receive
from any rank. Such a rank may still help the others, so a rank waiting for it is not stuck;
the timeout stays for it, and says where each rank waits. What the finder cannot tell at all
-- a send and a receive with different tags, which Gloo never matches (NCCL ignores tags) --
the timeout's message names. The kernel asks for the same verdict on two probes in a row,
with no progress between them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...tracking.records import NO_TRAFFIC, Peer, Traffic, Wait, ordinal
from .traffic import add_traffic

PROBE_S = 0.5  # how often the kernel asks running ranks what they wait in
UNSEEN = ("The deadlock finder saw no certain deadlock: it decides only for ranks blocked in a send, "
          "a recv, a collective or a Work's wait() it saw issued, and cannot tell send/recv tags apart.")


@dataclass(frozen=True)
class Verdict:
    """A certain deadlock: one line per stuck rank (one per group whose collectives differ), and
    the kinds of wait among them ("p2p", "collective") for the advice."""

    lines: list
    kinds: frozenset


def _of(table: dict[int, Traffic], rank: int) -> Traffic:
    """A rank's traffic in ``table`` (none yet: ``NO_TRAFFIC``)."""
    return table.get(rank) or NO_TRAFFIC


def what(wait: Wait) -> str:
    """'recv from rank 1 (the 1st recv of this call)' or 'the 2nd all_reduce of this call'."""
    nth = f"the {ordinal(wait.number)} {wait.name} of this call"
    if wait.kind == "recv":
        return f"{wait.name} from rank {wait.peer} ({nth})"
    if wait.kind == "send":
        return f"{wait.name} to rank {wait.peer} ({nth})"
    return nth


def verdict(waits: dict[int, Wait | None], returned: set[int], carried: dict[int, Traffic],
            this_call: dict[int, Traffic]) -> Verdict | None:
    """A ``Verdict`` when some rank can never finish the call, else None.

    ``waits``: every rank still in the call, with what it is blocked in (None: nothing certain,
    it may still act); ``returned``: ranks certain to issue nothing more in this call;
    ``carried``: rank -> traffic left in flight by earlier calls; ``this_call``: rank -> this
    call's traffic so far (a returned rank's from its reply)."""
    total = add_traffic(carried, this_call)
    deps, mismatched = {}, {}
    for r, w in waits.items():
        if w is None:
            continue
        needs = _needs(r, w, waits, carried, total)
        if needs is not None:
            deps[r] = needs
        elif (same := _differing(r, w, waits, carried, total)) is not None:
            mismatched[r], deps[r] = same, set()
    _keep_the_stuck(deps, returned)
    if not deps:
        return None
    return _describe(deps, mismatched, waits, returned)


def _position(r: int, w: Wait, carried: dict[int, Traffic]) -> int:
    """The waited operation's place since the ranks started, among its kind on its group (and peer)."""
    before = _of(carried, r)
    if w.kind == "collective":
        return before.collectives.get(w.group, 0) + w.seq
    table = before.received if w.kind == "recv" else before.sent
    return table.get(Peer(w.group, w.peer), 0) + w.seq


def _needs(r: int, w: Wait, waits: dict, carried: dict, total: dict) -> set[int] | None:
    """The ranks that must still act for rank ``r``'s wait to end; None when it can complete (or,
    a receive from any rank, is not decided here)."""
    g, j = w.group, _position(r, w, carried)
    if w.kind == "recv":
        if w.peer is None or _of(total, w.peer).sent.get(Peer(g, r), 0) >= j:
            return None  # from any rank, or a message is there for it
        return {w.peer}
    if w.kind == "send":
        received = _of(total, w.peer).received
        posted = received.get(Peer(g, r), 0) + received.get(Peer(g, None), 0)
        return None if posted >= j else {w.peer}
    behind = {m for m in g.ranks if m != r and _of(total, m).collectives.get(g, 0) < j}
    return behind or None


def _differing(r: int, w: Wait, waits: dict, carried: dict, total: dict) -> list[int] | None:
    """The other members of ``r``'s group when every one is blocked in the same k-th collective
    there and not all of them in the same one (none can complete), else None."""
    if w.kind != "collective":
        return None
    k, others = _position(r, w, carried), [m for m in w.group.ranks if m != r]
    same = [m for m in others if (o := waits.get(m)) is not None and o.kind == "collective"
            and o.group == w.group and _position(m, o, carried) == k]
    if others and len(same) == len(others) and any(waits[m].name != w.name for m in same):
        return same
    return None


def _keep_the_stuck(deps: dict[int, set[int]], returned: set[int]) -> None:
    """Keep only ranks whose every possible helper has returned or is stuck too (in place)."""
    changed = True
    while changed:
        changed = False
        for r in list(deps):
            if any(d not in returned and d not in deps for d in deps[r]):
                del deps[r]
                changed = True


def _describe(deps: dict[int, set[int]], mismatched: dict[int, list[int]], waits: dict,
              returned: set[int]) -> Verdict:
    lines, kinds = [], set()
    for r in sorted(deps):
        w = waits[r]
        kinds.add("collective" if w.kind == "collective" else "p2p")
        if r not in mismatched:
            lines.append(_stuck_line(r, deps[r], waits, returned))
        elif r == min(mismatched[r] + [r]):  # one line per group
            lines.append(_mismatch_line(r, mismatched[r], waits))
    return Verdict(lines, frozenset(kinds))


def _mismatch_line(r: int, same: list[int], waits: dict) -> str:
    members = sorted([r, *same])
    said = ", ".join([f"rank {r} waits in {what(waits[r])}"] + [f"rank {m} in {what(waits[m])}" for m in members[1:]])
    return f"on {waits[r].group.describe()} {said}: the collectives differ, so none of them can complete"


def _stuck_line(r: int, deps: set[int], waits: dict, returned: set[int]) -> str:
    w = waits[r]

    def where(d: int) -> str:
        return "has returned from this call" if d in returned else f"waits in {what(waits[d])}"

    if w.kind == "collective":
        return (f"rank {r} waits in {what(w)} on {w.group.describe()}, which "
                + "; ".join(f"rank {d} has not joined: it {where(d)}" for d in sorted(deps)))
    d = next(iter(deps))
    return f"rank {r} waits in {what(w)}, which " + ("" if d in returned else "itself ") + where(d)
