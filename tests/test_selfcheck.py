"""The chapters' self-checks accept the right answers, derived here from first principles,
and name what is wrong in a wrong one."""
from __future__ import annotations

import pytest

import dpcourse as dpc
from dpcourse.exercises.selfcheck import QUESTIONS

GB, GiB = 1e9, 2**30
PSI = 7e9  # parameters

RIGHT = {
    ("4.1a", 3): {"global_batch": 4 * 8 * 32, "accumulation_on_64": 4},
    ("4.1b", 1): {"ring_sent_gib": 2 * 7 / 8, "naive_root_sent_gib": 7, "naive_root_received_gib": 7},
    # the ZeRO paper's table 1 (K = 12 for mixed-precision Adam), N = 8
    ("4.1b", 2): {"ddp": 16 * PSI / GB, "zero1": (4 + 12 / 8) * PSI / GB,
                 "zero2": (2 + 14 / 8) * PSI / GB, "zero3": 16 * PSI / 8 / GB},
    ("4.1b", 3): {"because": "B", "pays": "x"},
    ("4.2a", 1): {"after_max": 2, "after_broadcast_from_1": 2},
    ("4.2a", 2): {"all_reduce": 10, "all_gather": [1, 2, 3, 4]},
    ("4.2a", 5): {"RANK": 6, "LOCAL_RANK": 2, "WORLD_SIZE": 8},
    ("4.2b", 2): "c",
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
    report = dpc.exercises.check_answer("4.1b", 2, {"ddp": 112, "zero1": 112, "zero2": 26.25, "zero3": 14})
    assert not report.passed
    assert [i.name for i in report.items if i.status == "fail"] == ["zero1"]
    assert "you wrote 112" in str(report) and "divided by 8" in str(report)
    partial = dpc.exercises.check_answer("4.1b", 1, {"ring_sent_gib": 2.0})
    assert [i.status for i in partial.items] == ["fail", "skip", "skip"]
    with pytest.raises(ValueError, match="there are: 4.1a #3"):
        dpc.exercises.check_answer("4.1a", 99, 1)


def test_each_notebook_checks_its_questions_under_its_own_name_and_numbers():
    """A self-check cell names its notebook ("4.2b") and a number its exercises list shows."""
    import json
    import re
    from pathlib import Path

    seen = set()
    for path in sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("4*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        prose = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        for cell in cells:
            source = "".join(cell["source"]) if cell["cell_type"] == "code" else ""
            keys = {(c, int(n)) for c, n in re.findall(r'check_answer\("([0-9.a-z]+)", (\d+)', source)}
            for chapter in re.findall(r'check_answer\("([0-9.a-z]+)", question', source):
                keys |= {(chapter, int(n)) for n in re.findall(r"\((\d+), answer_\d+\)", source)}
            for chapter, number in keys:
                assert path.name.startswith(chapter), f"{path.name} checks question {number} as {chapter}'s"
                assert re.search(rf"^{number}\. ", prose, re.M), f"{path.name} shows no exercise {number}"
                seen.add((chapter, number))
    assert seen == set(QUESTIONS), f"asked by no notebook: {set(QUESTIONS) - seen}; unknown: {seen - set(QUESTIONS)}"
