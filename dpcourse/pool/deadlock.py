"""Certain deadlocks, told in seconds instead of at the timeout.

The kernel knows more than torchrun: which ranks have *returned* from the call (they will
issue nothing more in it, and the next call cannot start before this one ends), what each
rank has sent, received and issued since the ranks started (the tracker's traffic, see
``tracker``), and -- asked every half second while a call runs -- what each running rank
waits in. From that, ``verdict`` decides, conservatively, whether the call can ever finish:

* a rank blocked in ``recv`` from rank P, when P has sent it no message still unreceived and
  P has returned from the call (or is itself blocked in such a wait: a cycle);
* a rank blocked in ``send`` to P that P has no receive posted for, P returned or blocked;
* a rank blocked in its k-th collective on a group, when a member has issued fewer than k
  there and has returned (or is blocked in such a wait);
* every member of a group blocked in its k-th collective there, and those collectives differ.

It decides only for ranks *blocked* in a communication (their main thread inside
``torch.distributed`` or on a ``.wait()``); a rank computing, sleeping or anywhere else makes
the state undecidable, and the timeout stays for it. The same verdict must hold on two probes
in a row, with no progress between them.
"""
from __future__ import annotations

from .tracker import ordinal

PROBE_S = 0.5  # how often the kernel asks running ranks what they wait in


def _count(traffic: dict, kind: str, key) -> int:
    return (traffic or {}).get(kind, {}).get(key, 0)


def _group_name(ranks: tuple, world_size: int) -> str:
    return "the default group" if len(ranks) == world_size else f"the group of ranks {list(ranks)}"


def _what(wait: dict) -> str:
    """'recv from rank 1 (the 1st recv of this call)' or 'the 2nd all_reduce of this call'."""
    nth = f"the {ordinal(wait['number'])} {wait['name']} of this call"
    if wait["kind"] == "recv":
        return f"{wait['name']} from rank {wait['peer']} ({nth})"
    if wait["kind"] == "send":
        return f"{wait['name']} to rank {wait['peer']} ({nth})"
    return nth


def verdict(waits: dict[int, dict | None], finished: set[int], total: dict[int, dict],
            world_size: int) -> tuple[list[str], set[str]] | None:
    """(one line per rank that can never finish, the kinds of wait: "p2p"/"collective"), or None
    when the call may still finish. ``waits``: each running rank's wait (``None``: not blocked in
    a communication); ``finished``: ranks that returned from the call; ``total``: rank -> its
    traffic since the ranks started, this call's so far included."""
    pending = set(waits)
    if not pending:
        return None
    deps: dict[int, set[int]] = {}
    mismatched: dict[int, list[int]] = {}
    for r, w in waits.items():
        if not w:
            continue
        g, peer = tuple(w["group"]), w.get("peer")
        if w["kind"] == "recv":
            if peer is None:
                continue  # from any rank: not decided here
            if _count(total.get(peer), "sent", (g, r)) >= _count(total.get(r), "received", (g, peer)):
                continue  # a message is there for it: it completes
            deps[r] = {peer}
        elif w["kind"] == "send":
            posted = _count(total.get(peer), "received", (g, r)) + _count(total.get(peer), "received", (g, None))
            if posted >= _count(total.get(r), "sent", (g, peer)):
                continue
            deps[r] = {peer}
        else:
            k = _count(total.get(r), "collectives", g)
            behind = {m for m in g if m != r and _count(total.get(m), "collectives", g) < k}
            if behind:
                deps[r] = behind
                continue
            others = [m for m in g if m != r]
            same = [m for m in others if waits.get(m) and waits[m]["kind"] == "collective"
                    and tuple(waits[m]["group"]) == g and _count(total.get(m), "collectives", g) == k]
            if others and len(same) == len(others) and any(waits[m]["name"] != w["name"] for m in same):
                mismatched[r] = same
                deps[r] = set()
    changed = True
    while changed:  # keep only ranks whose every possible helper has returned or is stuck too
        changed = False
        for r in list(deps):
            if any(d in pending and d not in deps for d in deps[r]):
                del deps[r]
                changed = True
    if not deps or (set(deps) != pending and not mismatched):
        return None
    lines, kinds = [], set()
    for r in sorted(deps):
        w = waits[r]
        kinds.add("collective" if w["kind"] == "collective" else "p2p")
        g = tuple(w["group"])
        if r in mismatched:
            members = sorted([r, *mismatched[r]])
            if r == members[0]:  # one line per group
                said = ", ".join([f"rank {r} waits in {_what(w)}"]
                                 + [f"rank {m} in {_what(waits[m])}" for m in members[1:]])
                lines.append(f"on {_group_name(g, world_size)} {said}: the collectives differ, so none "
                             "of them can complete")
            continue

        def where(d: int) -> str:
            if d in finished or d not in pending:
                return "has returned from this call"
            return f"waits in {_what(waits[d])}"

        if w["kind"] == "collective":
            lines.append(f"rank {r} waits in {_what(w)} on {_group_name(g, world_size)}, which "
                         + "; ".join(f"rank {d} has not joined: it {where(d)}" for d in sorted(deps[r])))
        else:
            d = next(iter(deps[r]))
            lines.append(f"rank {r} waits in {_what(w)}, which " + ("" if d in finished or d not in pending
                                                                   else "itself ") + where(d))
    return lines, kinds


def hint(kinds: set[str]) -> str:
    """Advice that matches the operation: point-to-point, collective, or both."""
    parts = []
    if "p2p" in kinds:
        parts.append("A send completes when its peer calls the matching recv, and a recv when its peer "
                     "sends: check that\nevery send has its recv on the other rank (same pair of ranks, "
                     "same order).")
    if "collective" in kinds:
        parts.append("A collective waits until every rank calls the same one; check that all ranks\n"
                     "reach the same collectives in the same order.")
    return "\n".join(parts)
