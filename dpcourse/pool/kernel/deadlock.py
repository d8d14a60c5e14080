"""Certain deadlocks, told in seconds instead of at the timeout.

Runs in the kernel, which knows more than torchrun: which ranks have *returned* from the
call (they will issue nothing more in it, and the next call cannot start before this one
ends), what each rank has sent, received and issued since the ranks started (the tracker's
traffic, see ``tracker`` and ``traffic``), and -- asked every half second while a call runs --
what each running rank waits in. From that, ``verdict`` decides, conservatively, whether the
call can ever finish:

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

from ..errors import ordinal

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
    deps, mismatched = _dependencies(waits, total)
    _keep_the_stuck(deps, pending)
    if not deps or (set(deps) != pending and not mismatched):
        return None
    return _describe(deps, mismatched, waits, finished, world_size)


def _dependencies(waits: dict[int, dict | None], total: dict[int, dict]) -> tuple[dict, dict]:
    """(rank -> the ranks that must act before its wait can end, rank -> the other members of its
    group blocked in a different collective), for every blocked rank nothing already frees."""
    deps: dict[int, set[int]] = {}
    mismatched: dict[int, list[int]] = {}
    for r, w in waits.items():
        if not w:
            continue
        if w["kind"] in ("recv", "send"):
            peers = _p2p_waits_for(r, w, total)
            if peers is not None:
                deps[r] = peers
            continue
        behind, same = _collective_waits_for(r, w, waits, total)
        if behind:
            deps[r] = behind
        elif same is not None:
            mismatched[r] = same
            deps[r] = set()
    return deps, mismatched


def _p2p_waits_for(r: int, w: dict, total: dict[int, dict]) -> set[int] | None:
    """{the peer} a blocked send or recv waits for, or None when it completes (or, a recv from
    any rank, is not decided here)."""
    g, peer = tuple(w["group"]), w.get("peer")
    if w["kind"] == "recv":
        if peer is None:
            return None  # from any rank: not decided here
        if _count(total.get(peer), "sent", (g, r)) >= _count(total.get(r), "received", (g, peer)):
            return None  # a message is there for it: it completes
        return {peer}
    posted = _count(total.get(peer), "received", (g, r)) + _count(total.get(peer), "received", (g, None))
    if posted >= _count(total.get(r), "sent", (g, peer)):
        return None
    return {peer}


def _collective_waits_for(r: int, w: dict, waits: dict[int, dict | None],
                          total: dict[int, dict]) -> tuple[set[int], list[int] | None]:
    """(the members that have issued fewer collectives on the group, the other members when every
    one is blocked in this same k-th collective under a different name, else None)."""
    g = tuple(w["group"])
    k = _count(total.get(r), "collectives", g)
    behind = {m for m in g if m != r and _count(total.get(m), "collectives", g) < k}
    if behind:
        return behind, None
    others = [m for m in g if m != r]
    same = [m for m in others if waits.get(m) and waits[m]["kind"] == "collective"
            and tuple(waits[m]["group"]) == g and _count(total.get(m), "collectives", g) == k]
    if others and len(same) == len(others) and any(waits[m]["name"] != w["name"] for m in same):
        return behind, same
    return behind, None


def _keep_the_stuck(deps: dict[int, set[int]], pending: set[int]) -> None:
    """Keep only ranks whose every possible helper has returned or is stuck too (in place)."""
    changed = True
    while changed:
        changed = False
        for r in list(deps):
            if any(d in pending and d not in deps for d in deps[r]):
                del deps[r]
                changed = True


def _describe(deps: dict[int, set[int]], mismatched: dict[int, list[int]], waits: dict[int, dict | None],
              finished: set[int], world_size: int) -> tuple[list[str], set[str]]:
    """One line per stuck rank (one per group whose collectives differ), and the kinds of wait."""
    lines, kinds = [], set()
    for r in sorted(deps):
        w = waits[r]
        kinds.add("collective" if w["kind"] == "collective" else "p2p")
        if r not in mismatched:
            lines.append(_stuck_line(r, deps[r], waits, finished, world_size))
        elif r == min(mismatched[r] + [r]):  # one line per group
            lines.append(_mismatch_line(r, mismatched[r], waits, world_size))
    return lines, kinds


def _mismatch_line(r: int, same: list[int], waits: dict[int, dict | None], world_size: int) -> str:
    members = sorted([r, *same])
    said = ", ".join([f"rank {r} waits in {_what(waits[r])}"]
                     + [f"rank {m} in {_what(waits[m])}" for m in members[1:]])
    return (f"on {_group_name(tuple(waits[r]['group']), world_size)} {said}: the collectives differ, "
            "so none of them can complete")


def _stuck_line(r: int, deps: set[int], waits: dict[int, dict | None], finished: set[int],
                world_size: int) -> str:
    w = waits[r]

    def where(d: int) -> str:
        if d in finished or d not in waits:
            return "has returned from this call"
        return f"waits in {_what(waits[d])}"

    if w["kind"] == "collective":
        return (f"rank {r} waits in {_what(w)} on {_group_name(tuple(w['group']), world_size)}, which "
                + "; ".join(f"rank {d} has not joined: it {where(d)}" for d in sorted(deps)))
    d = next(iter(deps))
    return f"rank {r} waits in {_what(w)}, which " + ("" if d in finished or d not in waits else "itself ") + where(d)
