"""``python -m dpcourse.grade``: exercise notebooks as learners filled them, run headless on
fresh ranks, one row per notebook and item; a notebook that raises or hangs is reported and
the others are still graded. The exit status says whether all passed; --json writes JSON
Lines; a check that saw a reference read is marked, row by row and notebook by notebook."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import dpcourse as dpc
from dpcourse import grade as grader
from dpcourse.grading.report import Report

pytestmark = pytest.mark.timeout(600)
EXERCISES = Path(__file__).resolve().parent.parent / "notebooks" / "exercises"


def grade(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpcourse.grade", *map(str, args)], capture_output=True,
                          text=True, timeout=560)


@pytest.mark.slow
def test_the_six_exercises_as_shipped_are_not_attempted():
    done = grade(EXERCISES, "--json")
    assert done.returncode == grader.INCOMPLETE, done.stderr[-2000:]   # nothing failed, nothing attempted
    results = [json.loads(line) for line in done.stdout.splitlines()]
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
    assert done.returncode == grader.FAILED, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["notebook", "check", "item", "reference", "status"]
    raised = [line for line in lines if line.startswith("0-raises")]
    assert raised and "RuntimeError: a learner broke this" in raised[0], done.stdout
    hung = [line for line in lines if line.startswith("2-hangs")]
    assert hung and "ran past 40 s" in hung[0], done.stdout
    filled = [line for line in lines if line.startswith("1-filled")]
    assert len(filled) >= 4 and all(line.rstrip().endswith("passed") for line in filled), done.stdout


def test_a_path_that_is_no_notebook_is_refused(tmp_path):
    done = grade("README.md")
    assert done.returncode == grader.USAGE and "neither a notebook" in done.stderr
    done = grade(tmp_path)   # a folder without a notebook: nothing ran, so nothing passed
    assert done.returncode == grader.USAGE and "no notebook" in done.stderr


def test_the_help_says_the_exit_status_and_json_lines():
    done = grade("--help")
    said = " ".join(done.stdout.split())
    assert done.returncode == 0 and "Exit status:" in said, done.stdout
    for status in ("0 every notebook ran and every check in it passed", "1 a judged item failed",
                   "3 nothing failed, but not all was judged", "JSON Lines"):
        assert status in said, status


# --- without kernels: reports as the checks give them (Report.to_dict) ------------------------------

def toy(*items, attempted=True, references=()) -> dict:
    report = Report("Toy check", attempted=attempted, references=list(references))
    for name, ok in items:
        report.add(name, ok)
    return report.to_dict()


def result(name: str, *reports, error=None) -> dict:
    return {"notebook": f"submissions/{name}.ipynb", "seconds": 1.0, "error": error, "reports": list(reports)}


def test_the_table_marks_every_row_of_a_check_that_used_a_reference():
    used = result("used", toy(("one", True), ("two", False), references=["no_sync"]))
    own = result("own", toy(("one", True)))
    lines = grader.render([used, own])
    assert lines[0].split() == ["notebook", "check", "item", "reference", "status"]
    at = lines[0].index("reference")
    assert [line[at:at + len("reference")].strip() for line in lines[1:]] == ["used", "used", ""], lines
    assert [line.split()[-1] for line in lines[1:]] == ["passed", "failed", "passed"], lines
    assert grader.rows(own) == [("own.ipynb", "Toy check", "one", "", "passed")]
    broken = result("broken", error="a cell raised RuntimeError: no")
    assert grader.rows(broken) == [("broken.ipynb", "-", "-", "", "no check ran (a cell raised RuntimeError: no)")]


def test_a_json_record_says_per_notebook_whether_any_check_used_a_reference():
    two = result("two", toy(("one", True)), toy(("one", True), references=["no_sync"]))
    record = json.loads(json.dumps(grader.record(two), separators=(",", ":")))
    assert record["used_reference"] is True and record["notebook"] == "submissions/two.ipynb"
    assert [(r["used_reference"], r["references"]) for r in record["reports"]] == [(False, []), (True, ["no_sync"])]
    assert grader.record(result("own", toy(("one", True))))["used_reference"] is False
    assert grader.record(result("none", error="the kernel died"))["used_reference"] is False


def test_the_exit_status_is_passed_only_when_every_notebook_ran_and_every_check_passed():
    passing, failing = toy(("one", True), ("two", True)), toy(("one", True), ("two", False), ("three", None))
    status = grader.exit_status
    assert status([result("a", passing), result("b", toy(("one", True), references=["A"]))]) == grader.PASSED == 0
    assert status([result("a", passing), result("b", failing)]) == grader.FAILED == 1
    assert status([result("a", passing, error="a cell raised RuntimeError: no")]) == grader.FAILED
    assert status([result("a", error="a cell ran past 40 s; the kernel and its ranks were stopped")]) == grader.FAILED
    assert status([result("a")]) == grader.FAILED                       # no check cell at all
    assert status([result("a", passing), result("b", toy(attempted=False))]) == grader.INCOMPLETE == 3
    assert status([result("a", toy(("one", True), ("two", None)))]) == grader.INCOMPLETE   # not judged, not failed
    assert status([result("a", toy(attempted=False)), result("b", failing)]) == grader.FAILED


# --- end to end: small notebooks, a kernel each (seconds) -------------------------------------------

def notebook(path: Path, *cells: str) -> Path:
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), path)
    return path


TOY_CHECK = """
from dpcourse.grading import provenance
from dpcourse.grading.report import Report

@provenance.judged("no_sync")
def check(ok):                    # a check as the checkers are: it lists the references read
    report = Report("Toy check")
    report.add("the toy item", ok)
    return report
"""


@pytest.mark.slow
def test_the_exit_status_json_lines_and_the_reference_column_end_to_end(tmp_path):
    read = "import dpcourse as dpc\n_ = dpc.exercises.solution('no_sync')   # the reference, read before the check"
    (tmp_path / "toy.py").write_text(TOY_CHECK)   # beside the notebooks, as a submission's files are
    toy = "from toy import check"
    passes = notebook(tmp_path / "passes.ipynb", toy, "check(True)")
    used = notebook(tmp_path / "used.ipynb", toy, read, "check(True)")
    fails = notebook(tmp_path / "fails.ipynb", toy, read, "check(False)")
    raises = notebook(tmp_path / "raises.ipynb", toy, "check(True)", "raise RuntimeError('after the check')")

    done = grade(passes, used, "--json")
    assert done.returncode == grader.PASSED, done.stdout + done.stderr[-2000:]
    records = [json.loads(line) for line in done.stdout.splitlines()]   # JSON Lines: a record per line
    assert [Path(r["notebook"]).name for r in records] == ["passes.ipynb", "used.ipynb"]
    assert [r["used_reference"] for r in records] == [False, True]
    assert [r["reports"][0]["references"] for r in records] == [[], ["no_sync"]]

    done = grade(fails)
    assert done.returncode == grader.FAILED, done.stdout + done.stderr[-2000:]
    header, row = done.stdout.splitlines()
    at = header.index("reference")
    assert row[at:at + len("reference")].strip() == "used" and row.split()[-1] == "failed", done.stdout

    done = grade(raises)
    assert done.returncode == grader.FAILED and "RuntimeError: after the check" in done.stdout, done.stdout


def test_a_notebook_that_changes_the_course_or_reaches_its_references_is_flagged():
    import nbformat

    from dpcourse import grade

    cells = ["import dpcourse as dpc\nfrom dpcourse.exercises import tryits, provenance",
             "dpc.exercises.tryits.other_world_size = lambda n: n",
             "setattr(tryits, 'check', print)\nprovenance.forget()",
             "text = open('/x/dpcourse/exercises/solutions/tryits/no_sync.py').read()",
             "%load_ext dpcourse\nimport json\nref = json.load(open('4.2a.ipynb'))['cells'][0]['metadata']['dpcourse']['solution']",
             "x = dpc.Cluster(2)\nx.timeout = 3\nmodel.weight = None"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    said = grade.flags(nb)
    assert said == ["it reaches the course's record of the references read",
                    "it changes the course's code in its kernel (dpc.exercises.tryits.other_world_size)",
                    "it changes the course's code in its kernel (tryits)",
                    "it names the references' files", "it reads a reference stored in a notebook"], said
    result = {"notebook": "a.ipynb", "seconds": 1.0, "error": None, "flags": said[:1],
              "reports": [{"title": "t", "attempted": True, "passed": True, "used_reference": False,
                           "references": [], "items": [{"name": "i", "status": "pass"}]}]}
    assert grade.exit_status([result]) == grade.FAILED
    assert any("flag" in line and "not to be trusted" in line for line in grade.render([result]))
    clean = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cells[0].splitlines()[0]),
                                            nbformat.v4.new_code_cell("report = dpc.exercises.check_a('x.py')")])
    assert grade.flags(clean) == []
