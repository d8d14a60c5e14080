"""What the ranks' traffic leaves in flight: messages no rank received, receives nothing sent
to, groups whose members issued different numbers of collectives.

Runs in the kernel. Each rank's reply carries its call's traffic (a ``Traffic``, counted on
the rank by ``dpcourse.tracking``'s tracker); the kernel adds the ranks' traffic up, and keeps
what a call left in flight for the next one (a send in one call may meet its receive in the
next), until the ranks are restarted. Both functions here are pure.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...tracking.records import NO_TRAFFIC, Group, Peer, Traffic


@dataclass(frozen=True)
class Link:
    """Messages from rank ``src`` to rank ``dst`` on ``group``, as the kernel matches them."""

    group: Group
    src: int
    dst: int


def in_flight(traffic: dict[int, Traffic]) -> list[str]:
    """What the ranks' traffic (rank -> ``Traffic``) leaves in flight, one line per problem: a
    message no rank received, a receive nothing sent to, a group whose members issued different
    numbers of collectives. Empty: nothing can reach the next call."""
    sent: dict[Link, int] = {}
    received: dict[Link, int] = {}
    any_source: dict[Peer, int] = {}  # Peer(group, the receiving rank) -> receives from any rank
    issued: dict[Group, dict[int, int]] = {}  # group -> {rank: collectives}
    for rank, t in traffic.items():
        for peer, n in t.sent.items():
            link = Link(peer.group, rank, peer.rank)
            sent[link] = sent.get(link, 0) + n
        for peer, n in t.received.items():
            if peer.rank is None:
                mine = Peer(peer.group, rank)
                any_source[mine] = any_source.get(mine, 0) + n
            else:
                link = Link(peer.group, peer.rank, rank)
                received[link] = received.get(link, 0) + n
        for group, n in t.collectives.items():
            issued.setdefault(group, {})[rank] = n
    problems = _unmatched(sent, received, any_source)
    for group, by_rank in sorted(issued.items(), key=str):
        counts = {r: by_rank.get(r, 0) for r in group.ranks if r in traffic}
        if len(set(counts.values())) > 1:
            said = ", ".join(f"rank {r} {n}" for r, n in sorted(counts.items()))
            problems.append(f"on {group.describe()} the ranks issued different numbers of collectives ({said})")
    return problems


def _unmatched(sent: dict[Link, int], received: dict[Link, int], any_source: dict[Peer, int]) -> list[str]:
    """One line per link whose sends and receives differ (a receive from any rank matches a
    message left over), then per rank whose receives from any rank nothing sent to."""
    problems = []
    any_source = dict(any_source)
    for link in sorted(set(sent) | set(received), key=str):  # ordered as (group, src, dst) was
        extra = sent.get(link, 0) - received.get(link, 0)
        mine = Peer(link.group, link.dst)
        if extra > 0:
            matched = min(extra, any_source.get(mine, 0))
            any_source[mine] = any_source.get(mine, 0) - matched
            extra -= matched
        if extra > 0:
            problems.append(f"rank {link.src} sent {_messages(extra)} to rank {link.dst} "
                            f"that rank {link.dst} did not receive")
        elif extra < 0:
            problems.append(f"rank {link.dst} waits for {_messages(-extra)} from rank {link.src} "
                            f"that rank {link.src} did not send")
    for mine, n in sorted(any_source.items(), key=str):
        if n > 0:
            problems.append(f"rank {mine.rank} waits for {_messages(n)} from any rank that no rank sent")
    return problems


def add_traffic(a: dict[int, Traffic], b: dict[int, Traffic]) -> dict[int, Traffic]:
    """Two calls' traffic (rank -> ``Traffic``) added up, so a message sent in one call and
    received in the next balances out."""
    return {rank: (a.get(rank) or NO_TRAFFIC) + (b.get(rank) or NO_TRAFFIC) for rank in set(a) | set(b)}


def _messages(n: int) -> str:
    return "1 message" if n == 1 else f"{n} messages"
