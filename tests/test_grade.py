"""``python -m dpcourse.grade``: exercise notebooks as learners filled them, run headless on
fresh ranks, one row per notebook and item; a notebook that raises or hangs is reported and
the others are still graded."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import dpcourse as dpc

pytestmark = pytest.mark.timeout(600)
EXERCISES = Path(__file__).resolve().parent.parent / "notebooks" / "exercises"


def grade(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpcourse.grade", *map(str, args)], capture_output=True,
                          text=True, timeout=560)


@pytest.mark.slow
def test_the_six_exercises_as_shipped_are_not_attempted():
    done = grade(EXERCISES, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    assert sorted(Path(r["notebook"]).name[0] for r in results) == list("ABCDEF")
    for result in results:
        assert result["error"] is None, result
        assert [r["attempted"] for r in result["reports"]] == [False], result


@pytest.mark.slow
def test_a_filled_notebook_passes_and_a_broken_or_hanging_one_does_not_stop_the_others(tmp_path):
    nb = nbformat.read(EXERCISES / "E-bucketed-ddp.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "class MyBucketedDDP" in c.source)
    cell.source = "import dpcourse as dpc\n" + dpc.exercises.solution("E")   # the quickest check: seconds
    nbformat.write(nb, tmp_path / "1-filled.ipynb")
    for name, source in (("0-raises", "raise RuntimeError('a learner broke this')"),
                         ("2-hangs", "import time\ntime.sleep(600)")):
        broken = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
        nbformat.write(broken, tmp_path / f"{name}.ipynb")
    done = grade(tmp_path, "--timeout", "40")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["notebook", "check", "item", "status"]
    raised = [line for line in lines if line.startswith("0-raises")]
    assert raised and "RuntimeError: a learner broke this" in raised[0], done.stdout
    hung = [line for line in lines if line.startswith("2-hangs")]
    assert hung and "ran past 40 s" in hung[0], done.stdout
    filled = [line for line in lines if line.startswith("1-filled")]
    assert len(filled) >= 4 and all(line.rstrip().endswith("passed") for line in filled), done.stdout


def test_a_path_that_is_no_notebook_is_refused():
    done = grade("README.md")
    assert done.returncode != 0 and "neither a notebook" in done.stderr
