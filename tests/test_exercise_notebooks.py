"""Exercise notebooks D and F run whole in a real kernel with the reference solution filled
in, and their checker cell says "passed" (A, B, C and E: in their own test files); A and F
start from the starter train_lm.py beside them."""
from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import dpcourse as dpc

pytestmark = pytest.mark.timeout(400)
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks" / "exercises"


def run_with(name: str, replace: dict[str, str], checker: str) -> str:
    """Execute notebook ``name`` with the code cells containing each key replaced; the text
    the cell that calls ``checker`` shows."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for marker, source in replace.items():
        cell = next(c for c in nb.cells if c.cell_type == "code" and marker in c.source)
        cell.source = source
    NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    shown = [o["data"]["text/plain"] for c in nb.cells if c.cell_type == "code" and checker in c.source
             for o in c.get("outputs", []) if o.get("output_type") == "execute_result"]
    assert shown, f"{checker} showed nothing"
    return shown[0]


def test_d_notebook_with_the_solution_filled_in():
    # the notebook checks N = 2..5; 2 and 3 ranks keep this test short, with an uneven split
    text = run_with("D-ring-all-reduce.ipynb", {
        "def ring_all_gather": "pass",  # first: the solution's cell below defines both
        "def ring_reduce_scatter": dpc.exercises.solution("D"),
        "report = dpc.exercises.check_d(": "report = dpc.exercises.check_d(ring_reduce_scatter, "
                                           "ring_all_gather, world_sizes=(2, 3))\nreport",
    }, "check_d(")
    assert "Exercise D: passed" in text, text


def test_f_notebook_with_the_solution_filled_in(tmp_path):
    folder = tmp_path / "exercises"
    shutil.copytree(NOTEBOOKS, folder, symlinks=False)
    (folder / "train_lm_fsdp.py").write_text(dpc.exercises.solution("F"))
    nb = nbformat.read(folder / "F-single-device-to-fsdp2.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(folder)}}).execute()
    shown = [o["data"]["text/plain"] for c in nb.cells if c.cell_type == "code" and "check_f(" in c.source
             for o in c.get("outputs", []) if o.get("output_type") == "execute_result"]
    assert shown and "Exercise F: passed (16 of 16 checks)" in shown[0], shown


@pytest.mark.parametrize("name, minutes", [("A-single-device-to-ddp.ipynb", "30–45 minutes"),
                                           ("F-single-device-to-fsdp2.ipynb", "35–50 minutes")])
def test_a_and_f_start_from_the_starter_no_chapter_converts(name, minutes):
    """Both read train_lm.py beside them, say their honest time first, show hints one at a
    time and the reference only on request."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    first = nb.cells[0].source
    assert minutes in first
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert 'open("train_lm.py")' in code and 'shutil.copy("train_lm.py"' in code
    hints = [c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("<details>")]
    assert len(hints) >= 4
    assert f'dpc.exercises.solution("{name[0]}")' in code and "show = False" in code
