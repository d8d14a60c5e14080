"""What the ranks' traffic leaves in flight: messages no rank received, receives nothing sent
to, groups whose members issued different numbers of collectives.

Runs in the kernel. Each rank's reply carries its call's traffic (``tracker``'s
``CollectiveTracker.traffic()``, counted on the rank); the kernel adds the ranks' traffic up,
and keeps what a call left in flight for the next one (a send in one call may meet its
receive in the next), until the ranks are restarted.
"""
from __future__ import annotations


def in_flight(traffic: dict[int, dict]) -> list[str]:
    """What the ranks' traffic (rank -> ``CollectiveTracker.traffic()``, keyed by ``wire.Group``)
    leaves in flight, one line per problem: a message no rank received, a receive nothing sent to, a group whose
    members issued different numbers of collectives. Empty: nothing can reach the next call."""
    sent: dict[tuple, int] = {}      # (group, src, dst) -> messages
    received: dict[tuple, int] = {}  # (group, src, dst)
    any_source: dict[tuple, int] = {}  # (group, dst) -> receives from any rank
    issued: dict = {}  # group -> {rank: collectives}
    for rank, t in traffic.items():
        for (group, dst), n in t["sent"].items():
            sent[(group, rank, dst)] = sent.get((group, rank, dst), 0) + n
        for (group, src), n in t["received"].items():
            if src is None:
                any_source[(group, rank)] = any_source.get((group, rank), 0) + n
            else:
                received[(group, src, rank)] = received.get((group, src, rank), 0) + n
        for group, n in t["collectives"].items():
            issued.setdefault(group, {})[rank] = n
    problems = []
    for key in sorted(set(sent) | set(received), key=str):
        group, src, dst = key
        extra = sent.get(key, 0) - received.get(key, 0)
        if extra > 0:
            matched = min(extra, any_source.get((group, dst), 0))
            any_source[(group, dst)] = any_source.get((group, dst), 0) - matched
            extra -= matched
        if extra > 0:
            problems.append(f"rank {src} sent {_messages(extra)} to rank {dst} that rank {dst} did not receive")
        elif extra < 0:
            problems.append(f"rank {dst} waits for {_messages(-extra)} from rank {src} that rank {src} did not send")
    for (group, dst), n in sorted(any_source.items(), key=str):
        if n > 0:
            problems.append(f"rank {dst} waits for {_messages(n)} from any rank that no rank sent")
    for group, by_rank in sorted(issued.items(), key=str):
        counts = {r: by_rank.get(r, 0) for r in group.ranks if r in traffic}
        if len(set(counts.values())) > 1:
            said = ", ".join(f"rank {r} {n}" for r, n in sorted(counts.items()))
            problems.append(f"on {group.describe()} the ranks issued different numbers of collectives ({said})")
    return problems


def add_traffic(a: dict[int, dict], b: dict[int, dict]) -> dict[int, dict]:
    """Two calls' traffic (rank -> ``traffic()``) added up, so a message sent in one call and
    received in the next balances out."""
    out = {}
    for rank in set(a) | set(b):
        out[rank] = {}
        for kind in ("sent", "received", "collectives"):
            table = dict(a.get(rank, {}).get(kind, {}))
            for key, n in b.get(rank, {}).get(kind, {}).items():
                table[key] = table.get(key, 0) + n
            out[rank][kind] = table
    return out


def _messages(n: int) -> str:
    return "1 message" if n == 1 else f"{n} messages"
