"""The grading framework's own parts, without ranks: the event log and where it says a rank
waits, numeric comparisons, failing one item and skipping the rest. Milliseconds each."""
from __future__ import annotations

import pytest
import torch

from dpcourse.grading.compare import close, scale_of
from dpcourse.grading.events import Comm, Destroy, Done, EventLog, Pid, Wait, event, log_path, read_events
from dpcourse.grading.hang_watch import Waiting, _where
from dpcourse.grading.report import Report


@event
class Noted:
    """A checker's own event, registered as a recorder registers its events."""
    step: int
    value: float


def test_an_event_log_reads_back_the_dataclasses_it_wrote_and_leaves_out_a_line_being_written(tmp_path):
    log = EventLog(log_path(str(tmp_path), 3))
    written = [Pid(12), Comm(0, "all_reduce", "float32", 32, 2, 1, "c10d"), Noted(1, 0.1 + 0.2), Done(1), Destroy()]
    for record in written:
        log.write(record)
    log.close()
    log.write(Done(2))   # after close (a late callback): dropped
    with open(log_path(str(tmp_path), 3), "a") as f:
        f.write('{"event": "Done", "numb')   # a line still being written
    assert read_events(str(tmp_path), 3) == written
    assert read_events(str(tmp_path), 4) == []   # no log yet


def test_two_events_of_one_name_are_refused():
    with pytest.raises(ValueError, match="two events are called Pid"):
        event(type("Pid", (), {"__annotations__": {"x": int}}))


C10D = lambda step, name, number: Comm(step, name, "float32", 4, 2, number, "c10d")    # noqa: E731
FUNCTIONAL = lambda step, name, number: Comm(step, name, "float32", 4, 0, number, "functional")  # noqa: E731


@pytest.mark.parametrize("events, want", [
    ([], Waiting(None, False, None)),
    ([Pid(7)], Waiting(7, False, None)),
    ([Pid(7), C10D(0, "all_reduce", 1)], Waiting(7, False, (1, "all_reduce", 1, 0))),
    ([Pid(7), C10D(0, "all_reduce", 1), Done(1)], Waiting(7, False, None)),
    # the oldest open one is waited in; its ordinal counts that collective since the step
    ([C10D(2, "all_gather", 1), Done(1), C10D(2, "all_gather", 2), C10D(2, "reduce_scatter", 3)],
     Waiting(None, False, (2, "all_gather", 2, 2))),
    ([C10D(1, "all_gather", 1), Done(1), C10D(2, "all_gather", 2)], Waiting(None, False, (2, "all_gather", 1, 2))),
    # a functional collective is waited in only from its Wait
    ([FUNCTIONAL(0, "all_reduce", 1)], Waiting(None, False, None)),
    ([FUNCTIONAL(0, "all_reduce", 1), Wait(1)], Waiting(None, False, (1, "all_reduce", 1, 0))),
    ([FUNCTIONAL(0, "all_reduce", 1), Wait(1), Done(1)], Waiting(None, False, None)),
    ([Wait(5)], Waiting(None, False, None)),   # a wait on nothing issued decides nothing
    ([Pid(7), C10D(0, "barrier", 1), Done(1), Destroy()], Waiting(7, True, None)),
])
def test_where_a_rank_waits_is_read_from_its_events(events, want):
    assert _where(events) == want


def test_waiting_in_words():
    assert Waiting(7, False, (3, "all_gather", 3, 4)).describe(0, ended=False, seconds=15.4) == \
        "rank 0 waits in its 3rd all_gather since optimizer step 4 (for 15 s)"
    assert Waiting(7, False, (1, "all_reduce", 1, 0)).describe(1, ended=False) == \
        "rank 1 waits in its 1st all_reduce before its first optimizer step"
    assert Waiting(7, True, None).describe(1, ended=True) == "rank 1 has left the process group and ended"
    assert Waiting(7, False, None).describe(1, ended=True) == "rank 1 has ended without leaving the process group"
    assert Waiting(7, False, None).describe(1, ended=False) == "rank 1 is in no collective (running its own code)"


@pytest.mark.parametrize("got, want, same", [
    (torch.ones(3), torch.ones(3) * (1 + 1e-6), True),
    (torch.ones(3), torch.ones(3) * 1.01, False),
    ([torch.ones(2), torch.zeros(2)], [torch.ones(2), torch.zeros(2)], True),
    ([torch.ones(2)], [torch.ones(2), torch.zeros(2)], False),          # a tensor missing
    ({"w": torch.ones(2)}, {"w": torch.ones(2)}, True),
    ({"w": torch.ones(2)}, {"w": torch.ones(2), "b": torch.ones(1)}, False),   # a key missing
    ({"w": torch.ones(2)}, {"v": torch.ones(2)}, False),
])
def test_close_compares_tensors_lists_and_dicts(got, want, same):
    assert close(got, want) is same


def test_close_takes_its_tolerances_and_scale_of_fits_a_factor():
    assert close(torch.ones(2), torch.ones(2) * 1.001, rtol=1e-2) and not close(torch.ones(2), torch.ones(2) * 1.001)
    assert scale_of([torch.ones(2) * 3, torch.ones(1) * 3], [torch.ones(2), torch.ones(1)]) == pytest.approx(3.0)
    assert scale_of([torch.zeros(2)], [torch.zeros(2)]) == 0.0


def test_one_failed_item_leaves_the_rest_not_judged():
    report = Report("t").fail("runs on every rank", "rank 1 raised", ["a", "b"], "judged once it runs")
    assert [(i.name, i.status, i.detail) for i in report.items] == [
        ("runs on every rank", "fail", "rank 1 raised"), ("a", "skip", "judged once it runs"),
        ("b", "skip", "judged once it runs")]
    assert str(report) == ("t: 1 of 3 checks failed.\n  ✗ runs on every rank: rank 1 raised\n"
                           "  – a: judged once it runs\n  – b: judged once it runs")
