"""Grade exercise notebooks as learners filled them: each runs headless in a fresh kernel, on
fresh ranks, and every checker's verdict is read back item by item.

    python -m dpcourse.grade submissions/             # every .ipynb below the folder
    python -m dpcourse.grade A.ipynb B.ipynb --json   # one record per notebook, for a gradebook

Each notebook runs in a temporary copy of its folder (a submission's ``%%writefile`` and the
files beside it, e.g. ``train_single.py``, stay its own), each cell with a time limit; a
notebook that raises, hangs or kills its kernel is reported as such (its kernel and ranks
stopped) and the others still run.
A check cell's report carries its verdict as data (``Report.to_dict``, under ``report.MIME``),
so nothing is parsed from printed text. Needs nbclient and ipykernel (the course's ``dev``
extra).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .exercises.report import MIME

TIMEOUT = 600.0  # seconds one cell may run


def notebooks_in(paths: list[str]) -> list[Path]:
    """The notebooks named, and those below the folders named, in order; checkpoints skipped."""
    found = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        elif path.suffix == ".ipynb" and path.is_file():
            found.append(path)
        else:
            raise SystemExit(f"error: {name} is neither a notebook (.ipynb) nor a folder")
    return found


def grade(path: Path, timeout: float = TIMEOUT) -> dict:
    """Run one notebook headless (each cell at most ``timeout`` seconds) and return
    {"notebook", "seconds", "error", "reports": [Report.to_dict(), ...]}."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    start, error = time.monotonic(), None
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="dpcourse-grade-") as work:
        for sibling in path.parent.iterdir():   # the files a notebook reads beside it
            if sibling.is_file() and sibling.suffix != ".ipynb":
                shutil.copy2(sibling, work)
        client = NotebookClient(nb, timeout=timeout, allow_errors=True, kernel_name="python3",
                                resources={"metadata": {"path": work}})
        try:
            client.execute(stderr=subprocess.DEVNULL)   # the kernel's own log lines, not the learner's output
        except CellTimeoutError:
            error = f"a cell ran past {timeout:g} s; the kernel and its ranks were stopped"
        except DeadKernelError:
            error = "the kernel died"
        except CellExecutionError as err:  # not raised with allow_errors, kept for safety
            error = str(err).splitlines()[0]
    reports, raised = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if MIME in out.get("data", {}):
                reports.append(out["data"][MIME])
            elif out.get("output_type") == "error":
                raised.append(f"{out.get('ename')}: {out.get('evalue', '')}"[:200])
    if raised and error is None:
        error = f"a cell raised {raised[0]}"
    return {"notebook": str(path), "seconds": round(time.monotonic() - start, 1), "error": error,
            "reports": reports}


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    """(notebook, check, item, status) per item; status "passed", "failed", "not judged" or
    "not attempted"; one row for a notebook without any report."""
    name, out = Path(result["notebook"]).name, []
    words = {"pass": "passed", "fail": "failed", "skip": "not judged"}
    for report in result["reports"]:
        if not report["attempted"]:
            out.append((name, report["title"], "-", "not attempted"))
        for item in report["items"]:
            out.append((name, report["title"], item["name"], words[item["status"]]))
    if not result["reports"]:
        out.append((name, "-", "-", f"no check ran ({result['error'] or 'no check cell'})"))
    elif result["error"]:
        out.append((name, "-", "-", f"error: {result['error']}"))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.grade", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="exercise notebooks, or folders of them")
    parser.add_argument("--json", action="store_true", help="one JSON record per notebook, on stdout")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds one cell may run (default %(default)s)")
    args = parser.parse_args(argv)
    results = []
    for path in notebooks_in(args.paths):
        print(f"grading {path} ...", file=sys.stderr, flush=True)
        results.append(grade(path, args.timeout))
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
        return 0
    table = [row for result in results for row in rows(result)]
    widths = [max(len(r[i]) for r in table + [("notebook", "check", "item", "status")]) for i in range(3)]
    widths = [min(w, limit) for w, limit in zip(widths, (34, 28, 70))]
    for row in [("notebook", "check", "item", "status")] + table:
        print("  ".join(cell[:w].ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiet kernels
    sys.exit(main())
