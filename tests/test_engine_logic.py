"""The engine's decisions are pure functions of plain data, judged here from tables in
milliseconds, without a process: the deadlock verdict (``deadlock.verdict``: programs that
finish get none, whatever their waits look like; a certain deadlock is said for each stuck
rank), what the ranks' traffic leaves in flight (``traffic.in_flight``), and how the ranks'
replies end a call (``call.replied``, ``call.failure``, ``call.ending``). ``test_deadlock``,
``test_kernel`` and ``test_pool`` run the same patterns on real ranks."""
from __future__ import annotations

import time

import pytest

from dpcourse.pool import wire
from dpcourse.pool.errors import RankDied, RankError, RankReport, RankTimeout
from dpcourse.pool.kernel.call import ending, failure, replied
from dpcourse.pool.kernel.deadlock import verdict
from dpcourse.pool.kernel.traffic import add_traffic, in_flight
from dpcourse.tracking.records import Group, Peer, Traffic, Wait

WORLD2, WORLD3 = Group((0, 1), True, "0"), Group((0, 1, 2), True, "0")
SAME_RANKS = Group((0, 1), False, "1")  # a subgroup of the same ranks as the default group
PAIR12 = Group((1, 2), False, "2")      # a subgroup of two of three ranks


def coll(name, group=WORLD2, seq=1, number=None):
    return Wait("collective", name, number or seq, group, None, seq)


def recv(peer, seq=1, group=WORLD2, name="recv"):
    return Wait("recv", name, seq, group, peer, seq)


def send(peer, seq=1, group=WORLD2, name="send"):
    return Wait("send", name, seq, group, peer, seq)


def traffic(sent=(), received=(), collectives=()):
    """A rank's traffic: ``sent``/``received``: ((group, peer), n) pairs; ``collectives``: (group, n)."""
    return Traffic({Peer(*key): n for key, n in sent}, {Peer(*key): n for key, n in received}, dict(collectives))


# --------------------------------------------------------------- the deadlock verdict
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


# more programs that finish, or may
FINISH.update({
    "no rank says anything certain": (
        {0: None, 1: None, 2: None}, set(), {}, {r: traffic() for r in range(3)}),
    "a send whose receive is posted": (
        {0: send(1)}, set(), {}, {0: traffic(sent=[((WORLD2, 1), 1)]), 1: traffic(received=[((WORLD2, 0), 1)])}),
    "the 2nd collective of a group, every member there": (
        {r: coll("all_reduce", WORLD3, seq=2) for r in range(3)}, set(), {},
        {r: traffic(collectives=[(WORLD3, 2)]) for r in range(3)}),
    # a subgroup's collective needs its own members only: rank 0 returning decides nothing
    "a subgroup's collective beside a rank that returned": (
        {1: coll("all_reduce", PAIR12), 2: coll("all_reduce", PAIR12)}, {0}, {},
        {0: traffic(), 1: traffic(collectives=[(PAIR12, 1)]), 2: traffic(collectives=[(PAIR12, 1)])}),
})

# more certain deadlocks
CERTAIN.update({
    # rank 0 calls all_reduce then broadcast, rank 1 broadcast then all_reduce
    "the same collectives in another order": (
        {0: coll("all_reduce"), 1: coll("broadcast", number=1)}, set(), {},
        {0: traffic(collectives=[(WORLD2, 1)]), 1: traffic(collectives=[(WORLD2, 1)])},
        ["on the default group rank 0 waits in the 1st all_reduce of this call, rank 1 in the 1st broadcast "
         "of this call: the collectives differ, so none of them can complete"]),
    "three ranks, one in another collective": (
        {0: coll("all_reduce", WORLD3), 1: coll("all_reduce", WORLD3), 2: coll("barrier", WORLD3)}, set(), {},
        {r: traffic(collectives=[(WORLD3, 1)]) for r in range(3)},
        ["on the default group rank 0 waits in the 1st all_reduce of this call, rank 1 in the 1st all_reduce "
         "of this call, rank 2 in the 1st barrier of this call: the collectives differ, so none of them can "
         "complete"]),
    "each sends to the other, neither receives": (
        {0: send(1), 1: send(0)}, set(), {}, {r: traffic(sent=[((WORLD2, 1 - r), 1)]) for r in (0, 1)},
        ["rank 0 waits in send to rank 1 (the 1st send of this call), which itself waits in send to rank 0 "
         "(the 1st send of this call)",
         "rank 1 waits in send to rank 0 (the 1st send of this call), which itself waits in send to rank 1 "
         "(the 1st send of this call)"]),
    # an earlier call's collective counts: this call's 1st all_reduce is the 2nd on the group
    "a collective after an earlier call's": (
        {0: coll("all_reduce")}, {1}, {0: traffic(collectives=[(WORLD2, 1)]), 1: traffic(collectives=[(WORLD2, 1)])},
        {0: traffic(collectives=[(WORLD2, 1)]), 1: traffic()},
        ["rank 0 waits in the 1st all_reduce of this call on the default group, which rank 1 has not "
         "joined: it has returned from this call"]),
})


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


# --------------------------------------------------------------- what is left in flight
# name -> (rank -> traffic, the lines said)
IN_FLIGHT = {
    "nothing happened": ({0: traffic(), 1: traffic()}, []),
    "a message sent and received": (
        {0: traffic(sent=[((WORLD2, 1), 1)]), 1: traffic(received=[((WORLD2, 0), 1)])}, []),
    "a message nobody received": (
        {0: traffic(sent=[((WORLD2, 1), 1)]), 1: traffic()},
        ["rank 0 sent 1 message to rank 1 that rank 1 did not receive"]),
    "receives nothing sent to": (
        {0: traffic(), 1: traffic(received=[((WORLD2, 0), 2)])},
        ["rank 1 waits for 2 messages from rank 0 that rank 0 did not send"]),
    "a message a receive from any rank met": (
        {0: traffic(sent=[((WORLD2, 1), 1)]), 1: traffic(received=[((WORLD2, None), 1)])}, []),
    "a receive from any rank that nothing sent to": (
        {0: traffic(), 1: traffic(received=[((WORLD2, None), 1)])},
        ["rank 1 waits for 1 message from any rank that no rank sent"]),
    "the same collectives on every rank": ({r: traffic(collectives=[(WORLD3, 4)]) for r in range(3)}, []),
    "a collective on the default group one rank skipped": (
        {0: traffic(collectives=[(WORLD2, 1)]), 1: traffic()},
        ["on the default group the ranks issued different numbers of collectives (rank 0 1, rank 1 0)"]),
    "different numbers on a subgroup of the same ranks": (
        {0: traffic(collectives=[(SAME_RANKS, 2)]), 1: traffic(collectives=[(SAME_RANKS, 1)])},
        ["on the group of ranks [0, 1] the ranks issued different numbers of collectives (rank 0 2, rank 1 1)"]),
    "a rank whose traffic is unknown is not counted": (
        {1: traffic(collectives=[(PAIR12, 1)]), 2: traffic(collectives=[(PAIR12, 1)]), 0: traffic()}, []),
    "several problems, messages first": (
        {0: traffic(sent=[((WORLD3, 2), 3)], collectives=[(WORLD3, 1)]), 1: traffic(received=[((WORLD3, 0), 1)]),
         2: traffic()},
        ["rank 1 waits for 1 message from rank 0 that rank 0 did not send",
         "rank 0 sent 3 messages to rank 2 that rank 2 did not receive",
         "on the default group the ranks issued different numbers of collectives (rank 0 1, rank 1 0, rank 2 0)"]),
}


@pytest.mark.parametrize("name", IN_FLIGHT)
def test_what_is_left_in_flight_is_said_one_line_a_problem(name):
    by_rank, lines = IN_FLIGHT[name]
    assert in_flight(by_rank) == lines


def test_a_send_in_one_call_balances_its_receive_in_the_next():
    first = {0: traffic(sent=[((WORLD2, 1), 1)]), 1: traffic()}
    second = {0: traffic(), 1: traffic(received=[((WORLD2, 0), 1)]), 2: traffic(collectives=[(WORLD3, 1)])}
    assert in_flight(first) == ["rank 0 sent 1 message to rank 1 that rank 1 did not receive"]
    total = add_traffic(first, second)
    assert total[0] == traffic(sent=[((WORLD2, 1), 1)]) and total[2] == traffic(collectives=[(WORLD3, 1)])
    assert in_flight({r: total[r] for r in (0, 1)}) == []


# --------------------------------------------------------------- how the replies end a call
AFTER = wire.After(True, traffic(), [])


def finished(value):
    return wire.Finished(1, AFTER, value, [])


def exited(code):
    return wire.Exited(1, AFTER, code, [])


def raised(summary):
    return wire.Raised(1, AFTER, summary, "Traceback (most recent call last):\n  ...\n", None)


def running(rank, where="waiting in the 1st all_reduce of this call"):
    return RankReport(rank, "running", where, "  File \"train.py\", line 3, in <module>\n")


def conclude(replies, inside=(), timed_out=False, left=(), first_failed=None):
    """The call's end from the ranks' replies (None: the rank died) and the reports of the ranks
    still ``inside`` it: (error or None, restart, results by rank)."""
    reports, results = {}, {}
    for rank, reply in replies.items():
        if reply is None:
            reports[rank] = RankReport(rank, "died", "died (killed by signal 9: SIGKILL)")
            continue
        said = replied(rank, reply)
        reports[rank] = said.report
        if said.returned:
            results[rank] = said.value
    error, restarted = failure(reports, {r.rank for r in inside}, timed_out)
    if error is None:
        return None, restarted, results
    reports.update({r.rank: r for r in inside})
    end = ending(error, reports, restarted, list(left), first_failed, 30.0)
    return end.error, end.restart, results


# name -> (replies, ranks inside, timed out, left in flight, first failed) -> (error, restart, results, said)
OUTCOMES = {
    "every rank returned": (({0: finished("a"), 1: finished("b")}, (), False, (), None),
                            (None, False, {0: "a", 1: "b"}, [])),
    "a script exited with a code on one rank": (
        ({0: finished(0), 1: exited(3)}, (), False, (), 1),
        (RankError, False, {0: 0, 1: 3},
         ["1 of 2 rank(s) failed: 1", "rank 1 exited with code 3", "so the ranks were kept"])),
    "one rank raised while the other still waits": (
        ({0: raised("ValueError: bad shape")}, (running(1),), False, (), 0),
        (RankError, True, {},
         ["1 of 2 rank(s) failed: 0", "rank 0 raised ValueError: bad shape",
          "rank 1 was stopped while waiting in the 1st all_reduce of this call", "The ranks were restarted"])),
    "one rank died": (
        ({0: finished(None), 1: None}, (), False, (), 1),
        (RankDied, True, {0: None}, ["1 of 2 rank(s) failed: 1", "rank 1 died (killed by signal 9: SIGKILL)"])),
    "the timeout": (
        ({0: finished(1)}, (running(1),), True, (), None),
        (RankTimeout, True, {0: 1},
         ["ranks did not finish within 30 s", "rank 1 waiting in the 1st all_reduce of this call"])),
    "a failure that left a message in flight": (
        ({0: raised("RuntimeError: oops"), 1: finished(None)}, (), False,
         ("rank 1 sent 1 message to rank 0 that rank 0 did not receive",), 0),
        (RankError, True, {1: None},
         ["left messages or collectives in flight (rank 1 sent 1 message to rank 0", "were restarted"])),
    "the rank that only lost its peer comes second": (
        ({0: raised("RuntimeError: Connection closed by peer"), 1: raised("ValueError: bad")}, (), False, (), 1),
        (RankError, False, {},
         ["2 of 2 rank(s) failed: 0, 1 (rank 0 only lost rank 1: the connection to it closed when it failed)\n"
          "rank 1 raised ValueError: bad"])),
    "a rank still running outside a collective": (
        ({0: raised("KeyError: 'x'")}, (running(1, "not blocked in a communication"),), False, (), 0),
        (RankError, True, {}, ["rank 1 was stopped while running"])),
}


@pytest.mark.parametrize("name", OUTCOMES)
def test_the_replies_end_a_call_as_the_table_says(name):
    given, (error, restart, results, said) = OUTCOMES[name]
    got_error, got_restart, got_results = conclude(*given)
    assert type(got_error) is (error or type(None)) and got_restart == restart and got_results == results
    for words in said:
        assert words in str(got_error), (words, str(got_error))


def test_a_reply_reads_as_its_report():
    assert replied(2, wire.Interrupted(1, AFTER)).report == RankReport(2, "interrupted", "was interrupted")
    said = replied(0, raised("ValueError: x"))
    assert (said.report.state, said.report.summary, said.returned) == ("raised", "raised ValueError: x", False)
    assert replied(1, exited(4)).value == 4 and replied(1, finished([1])).observed == []
