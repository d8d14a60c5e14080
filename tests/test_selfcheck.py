"""The chapters' self-checks accept the right answers, derived here from first principles,
and name what is wrong in a wrong one."""
from __future__ import annotations

import pytest

import dpcourse as dpc
from dpcourse.exercises.selfcheck import QUESTIONS

GB, GiB = 1e9, 2**30
PSI = 7e9  # parameters

RIGHT = {
    ("4.1", 3): {"global_batch": 4 * 8 * 32, "accumulation_on_64": 4},
    ("4.1", 4): {"ring_sent_gib": 2 * 7 / 8, "naive_root_sent_gib": 7, "naive_root_received_gib": 7},
    # the ZeRO paper's table 1 (K = 12 for mixed-precision Adam), N = 8
    ("4.1", 5): {"ddp": 16 * PSI / GB, "zero1": (4 + 12 / 8) * PSI / GB,
                 "zero2": (2 + 14 / 8) * PSI / GB, "zero3": 16 * PSI / 8 / GB},
    ("4.1", 6): {"because": "B", "pays": "x"},
    ("4.2", 1): {"after_max": 2, "after_broadcast_from_1": 2},
    ("4.2", 2): {"all_reduce": 10, "all_gather": [1, 2, 3, 4]},
    ("4.2", 5): {"RANK": 6, "LOCAL_RANK": 2, "WORLD_SIZE": 8},
    ("4.2", 6): "c",
}


@pytest.mark.parametrize("key", sorted(QUESTIONS))
def test_right_answers_pass(key):
    report = dpc.exercises.check_answer(*key, RIGHT[key])
    assert report.passed, str(report)


@pytest.mark.parametrize("key", sorted(QUESTIONS))
def test_untouched_answer_cells_are_not_attempted(key):
    report = dpc.exercises.check_answer(*key, ...)
    assert not report.attempted and "not attempted yet" in str(report)


def test_wrong_answers_name_the_field_and_why():
    report = dpc.exercises.check_answer("4.1", 5, {"ddp": 112, "zero1": 112, "zero2": 26.25, "zero3": 14})
    assert not report.passed
    assert [i.name for i in report.items if i.status == "fail"] == ["zero1"]
    assert "you wrote 112" in str(report) and "divided by 8" in str(report)
    partial = dpc.exercises.check_answer("4.1", 4, {"ring_sent_gib": 2.0})
    assert [i.status for i in partial.items] == ["fail", "skip", "skip"]
    with pytest.raises(ValueError, match="there are: 4.1 #3"):
        dpc.exercises.check_answer("4.1", 99, 1)
