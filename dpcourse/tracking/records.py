"""The records a rank's tracker keeps, and the pool carries to the kernel: every one is plain
data, so that the kernel's decisions on them are pure functions a table can test.

``Group`` names a process group, ``Wait`` the communication a main thread is blocked in,
``Traffic`` what a rank sent, received and issued (keyed by ``Peer`` and ``Group``), and
``Issued`` one call, as the observers hear of it. ``Op`` is the tracker's own live note of an
operation still in flight; it never leaves the rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..torch_private import source_rank


def ordinal(n: int) -> str:
    """1 -> '1st', 2 -> '2nd', 11 -> '11th', 23 -> '23rd' (the 3rd all_reduce of this call)."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


@dataclass(frozen=True)
class Group:
    """A process group as the tracker names it in traffic and waits: its ``ranks`` (global),
    ``default``: whether it is the default group (``dist.group.WORLD``), and ``name``: its
    ``group_name``, so that a subgroup of the same ranks as the default group is another group."""

    ranks: tuple
    default: bool
    name: str

    def describe(self) -> str:
        """'the default group' or 'the group of ranks [0, 1]'."""
        return "the default group" if self.default else f"the group of ranks {list(self.ranks)}"


@dataclass(frozen=True)
class Wait:
    """What a rank's main thread is blocked in, as the tracker recorded it (never inferred):
    inside a blocking ``send``/``recv`` or collective, or in ``wait()`` on the ``Work`` of one it
    issued. ``kind``: "collective", "send" or "recv"; ``name``: its ``torch.distributed`` name
    ("all_reduce", "irecv"); ``number``: the n-th call of that name in this call; ``group``: a
    ``Group``; ``peer``: the other rank of a send or recv (global; None: a receive from any rank);
    ``seq``: its place in this call among the collectives on ``group`` (a collective), the sends
    to ``peer`` there (a send) or the receives from ``peer`` there (a receive), from 1."""

    kind: str
    name: str
    number: int
    group: Group
    peer: int | None
    seq: int


@dataclass(frozen=True)
class Peer:
    """The other end of a rank's messages: the ``group`` they went through and the other
    ``rank`` (global; None for receives from any rank that nothing has matched yet)."""

    group: Group
    rank: int | None


@dataclass(frozen=True)
class Traffic:
    """What one rank sent, received and issued over some calls, counted on the rank.

    ``sent``: ``Peer`` -> messages sent to it; ``received``: ``Peer`` -> messages received from
    it (``Peer.rank`` None: receives from any rank still unmatched); ``collectives``: ``Group``
    -> collectives issued there. The tables are plain dicts, so the record pickles to the
    kernel; nobody changes them once the record is made. Two records add up with ``+`` (a
    message sent in one call and received in the next balances out)."""

    sent: dict = field(default_factory=dict)
    received: dict = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(_added(self.sent, other.sent), _added(self.received, other.received),
                       _added(self.collectives, other.collectives))


NO_TRAFFIC = Traffic()  # a rank that has sent, received and issued nothing


def _added(a: dict, b: dict) -> dict:
    """Two count tables added up, key by key."""
    table = dict(a)
    for key, n in b.items():
        table[key] = table.get(key, 0) + n
    return table


@dataclass(frozen=True)
class Issued:
    """One collective or point-to-point call a rank issued.

    ``op``: the c10d operator (``"allreduce_"``, ``"_allgather_base_"``) or, for point-to-point,
    the ``torch.distributed`` function (``"isend"``); ``collective``: its name in
    ``torch.distributed`` (``"all_reduce"``, ``"send"``); ``args``: the operator's arguments
    (point-to-point: ``(tensor, peer, group)``, ``peer`` a global rank); ``start``:
    ``time.perf_counter()`` when it was called; ``work``: what it returned (None: it blocked).
    """
    op: str
    collective: str
    args: tuple
    start: float
    work: object


@dataclass
class Op:
    """One communication a rank issued in the current call, as the tracker keeps it while it is
    in flight. Not frozen: it holds the live ``Work`` and learns when that completes.

    ``what``: the ``Wait`` that names it (kind, name, number, group, peer -- None: from any
    rank, until one sent --, place); ``start``: ``time.perf_counter()`` at the call; ``work``: its
    ``Work``, held until it completes (so that ``wait()`` on it is recognised), then dropped
    with its tensors; ``done``: it completed."""

    what: Wait
    start: float
    work: object = None
    done: bool = False

    def completed(self) -> bool:
        if not self.done and self.work is not None:
            try:
                self.done = bool(self.work.is_completed())
            except Exception:  # noqa: BLE001 -- a Work of a destroyed group
                self.done = True
            if self.done:
                if self.what.kind == "recv" and self.what.peer is None:  # irecv(src=None): who sent it
                    self.what = replace(self.what, peer=source_rank(self.work))
                self.work = None
        return self.done
