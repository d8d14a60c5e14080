"""The deadlock verdict is a pure function of recorded waits: a table of programs that finish
(no verdict, whatever their waits look like) and of certain deadlocks (each stuck rank said
rightly), judged in milliseconds without a process. ``test_deadlock`` runs each pattern on
real ranks."""
from __future__ import annotations

import time

import pytest

from dpcourse.pool.kernel.deadlock import verdict
from dpcourse.pool.kernel.traffic import in_flight
from dpcourse.pool.wire import Group, Wait

WORLD2, WORLD3 = Group((0, 1), True, "0"), Group((0, 1, 2), True, "0")
SAME_RANKS = Group((0, 1), False, "1")  # a subgroup of the same ranks as the default group


def coll(name, group=WORLD2, seq=1, number=None):
    return Wait("collective", name, number or seq, group, None, seq)


def recv(peer, seq=1, group=WORLD2, name="recv"):
    return Wait("recv", name, seq, group, peer, seq)


def send(peer, seq=1, group=WORLD2, name="send"):
    return Wait("send", name, seq, group, peer, seq)


def traffic(sent=(), received=(), collectives=()):
    """A rank's traffic: ``sent``/``received``: ((group, peer), n) pairs; ``collectives``: (group, n)."""
    return {"sent": dict(sent), "received": dict(received), "collectives": dict(collectives)}


# name -> (waits, returned, carried, this_call): programs that finish, or may
FINISH = {
    "a recv whose message is there": (
        {0: recv(1)}, {1}, {}, {0: traffic(received=[((WORLD2, 1), 1)]), 1: traffic(sent=[((WORLD2, 0), 1)])}),
    "a recv whose sender computes first": (
        {0: recv(1), 1: None}, set(), {}, {0: traffic(received=[((WORLD2, 1), 1)]), 1: traffic()}),
    "a recv from any rank": (
        {0: recv(None)}, {1}, {}, {0: traffic(received=[((WORLD2, None), 1)]), 1: traffic()}),
    # the first false verdict: irecv posted early, then each waits in a Future (no
    # communication the tracker can follow), then sends, then waits on the irecv
    "irecv early, then a Future's wait": (
        {0: None, 1: None}, set(), {},
        {r: traffic(received=[((WORLD2, 1 - r), 1)]) for r in (0, 1)}),
    # the second: irecv early, then a large all_reduce(async_op=True).wait(), then send
    "irecv early, then a waited all_reduce": (
        {0: coll("all_reduce"), 1: coll("all_reduce")}, set(), {},
        {r: traffic(received=[((WORLD2, 1 - r), 1)], collectives=[(WORLD2, 1)]) for r in (0, 1)}),
    # rank 0 issued two all_reduces (the second async) and waits in the 1st: rank 1 issued one
    # and returned. The 1st completes; comparing issued counts (2 > 1) would condemn it.
    "waiting in the 1st of two issued collectives": (
        {0: coll("all_reduce", seq=1)}, {1}, {},
        {0: traffic(collectives=[(WORLD2, 2)]), 1: traffic(collectives=[(WORLD2, 1)])}),
    "a send whose peer posted a receive from any rank": (
        {0: send(1)}, {1}, {}, {0: traffic(sent=[((WORLD2, 1), 1)]), 1: traffic(received=[((WORLD2, None), 1)])}),
    # a message sent in an earlier call (carried, unreceived) meets this call's recv
    "a send in one call received in the next": (
        {1: recv(0)}, {0}, {0: traffic(sent=[((WORLD2, 1), 1)]), 1: traffic()},
        {0: traffic(), 1: traffic(received=[((WORLD2, 0), 1)])}),
    # a rank that returned with a thread of the learner's still running may yet send
    "the sender returned, but its thread runs": (
        {0: recv(1), 1: None}, set(), {}, {0: traffic(received=[((WORLD2, 1), 1)]), 1: traffic()}),
    "the peer waits in an earlier collective it will finish": (
        {0: coll("barrier", seq=2), 1: coll("all_reduce", seq=1)}, set(), {},
        {0: traffic(collectives=[(WORLD2, 2)]), 1: traffic(collectives=[(WORLD2, 1)])}),
    "the same collective on every rank, still running": (
        {r: coll("all_reduce", WORLD3) for r in range(3)}, set(), {},
        {r: traffic(collectives=[(WORLD3, 1)]) for r in range(3)}),
}

# name -> (waits, returned, carried, this_call, the lines said)
CERTAIN = {
    "a recv from a rank that returned": (
        {0: recv(1)}, {1}, {}, {0: traffic(received=[((WORLD2, 1), 1)]), 1: traffic()},
        ["rank 0 waits in recv from rank 1 (the 1st recv of this call), which has returned from this call"]),
    "each waits in recv from the other": (
        {0: recv(1), 1: recv(0)}, set(), {}, {r: traffic(received=[((WORLD2, 1 - r), 1)]) for r in (0, 1)},
        ["rank 0 waits in recv from rank 1 (the 1st recv of this call), which itself waits in recv from "
         "rank 0 (the 1st recv of this call)",
         "rank 1 waits in recv from rank 0 (the 1st recv of this call), which itself waits in recv from "
         "rank 1 (the 1st recv of this call)"]),
    "the 2nd recv when one message was sent": (
        {0: recv(1, seq=2)}, {1}, {}, {0: traffic(received=[((WORLD2, 1), 2)]), 1: traffic(sent=[((WORLD2, 0), 1)])},
        ["rank 0 waits in recv from rank 1 (the 2nd recv of this call), which has returned from this call"]),
    "a send nobody receives": (
        {0: send(1)}, {1}, {}, {0: traffic(sent=[((WORLD2, 1), 1)]), 1: traffic()},
        ["rank 0 waits in send to rank 1 (the 1st send of this call), which has returned from this call"]),
    "a barrier the last rank returned without": (
        {0: coll("barrier", WORLD3), 1: coll("barrier", WORLD3)}, {2}, {},
        {0: traffic(collectives=[(WORLD3, 1)]), 1: traffic(collectives=[(WORLD3, 1)]), 2: traffic()},
        ["rank 0 waits in the 1st barrier of this call on the default group, which rank 2 has not joined: "
         "it has returned from this call",
         "rank 1 waits in the 1st barrier of this call on the default group, which rank 2 has not joined: "
         "it has returned from this call"]),
    # the inference-mode case: the one rank's all_reduce is counted now
    "one rank's all_reduce alone": (
        {0: coll("all_reduce")}, {1}, {}, {0: traffic(collectives=[(WORLD2, 1)]), 1: traffic()},
        ["rank 0 waits in the 1st all_reduce of this call on the default group, which rank 1 has not "
         "joined: it has returned from this call"]),
    "different collectives in the same place": (
        {0: coll("all_reduce"), 1: coll("broadcast")}, set(), {},
        {r: traffic(collectives=[(WORLD2, 1)]) for r in (0, 1)},
        ["on the default group rank 0 waits in the 1st all_reduce of this call, rank 1 in the 1st broadcast "
         "of this call: the collectives differ, so none of them can complete"]),
    "a subgroup of the default group's ranks is another group": (
        {0: coll("all_reduce", SAME_RANKS), 1: coll("all_reduce", WORLD2)}, set(), {},
        {0: traffic(collectives=[(SAME_RANKS, 1)]), 1: traffic(collectives=[(WORLD2, 1)])},
        ["rank 0 waits in the 1st all_reduce of this call on the group of ranks [0, 1], which rank 1 has "
         "not joined: it waits in the 1st all_reduce of this call",
         "rank 1 waits in the 1st all_reduce of this call on the default group, which rank 0 has not "
         "joined: it waits in the 1st all_reduce of this call"]),
    "a chain ending in a rank that returned": (
        {0: recv(1, group=WORLD3), 1: recv(2, group=WORLD3)}, {2}, {},
        {0: traffic(received=[((WORLD3, 1), 1)]), 1: traffic(received=[((WORLD3, 2), 1)]), 2: traffic()},
        ["rank 0 waits in recv from rank 1 (the 1st recv of this call), which itself waits in recv from "
         "rank 2 (the 1st recv of this call)",
         "rank 1 waits in recv from rank 2 (the 1st recv of this call), which has returned from this call"]),
    # a rank that computes cannot help a recv from another rank that returned
    "stuck beside a rank that computes": (
        {0: recv(1, group=WORLD3), 2: None}, {1}, {},
        {0: traffic(received=[((WORLD3, 1), 1)]), 1: traffic(), 2: traffic()},
        ["rank 0 waits in recv from rank 1 (the 1st recv of this call), which has returned from this call"]),
    # a message received in an earlier call counts there: this call's recv needs a new one
    "a recv after an earlier call's message": (
        {1: recv(0)}, {0}, {0: traffic(sent=[((WORLD2, 1), 1)]), 1: traffic(received=[((WORLD2, 0), 1)])},
        {0: traffic(), 1: traffic(received=[((WORLD2, 0), 1)])},
        ["rank 1 waits in recv from rank 0 (the 1st recv of this call), which has returned from this call"]),
}


@pytest.mark.parametrize("name", FINISH)
def test_a_program_that_may_finish_gets_no_verdict(name):
    assert verdict(*FINISH[name]) is None


@pytest.mark.parametrize("name", CERTAIN)
def test_a_certain_deadlock_is_said_for_each_stuck_rank(name):
    *case, lines = CERTAIN[name]
    found = verdict(*case)
    assert found is not None and found.lines == lines
    waits = case[0]
    kinds = {"collective" if w.kind == "collective" else "p2p" for w in waits.values() if w is not None}
    assert set(found.kinds) <= kinds and found.kinds


def test_the_whole_table_is_judged_in_milliseconds():
    start = time.perf_counter()
    for _ in range(20):
        for case in FINISH.values():
            verdict(*case)
        for *case, _ in CERTAIN.values():
            verdict(*case)
    assert (time.perf_counter() - start) / 20 < 0.05  # one pass over the table


def test_what_is_left_in_flight_names_the_group_it_is_on():
    on_two = {0: traffic(collectives=[(SAME_RANKS, 2)]), 1: traffic(collectives=[(SAME_RANKS, 1)])}
    assert in_flight(on_two) == ["on the group of ranks [0, 1] the ranks issued different numbers of "
                                 "collectives (rank 0 2, rank 1 1)"]
    on_world = {0: traffic(collectives=[(WORLD2, 1)]), 1: traffic()}
    assert in_flight(on_world) == ["on the default group the ranks issued different numbers of "
                                   "collectives (rank 0 1, rank 1 0)"]
