"""Grade exercise notebooks as learners filled them: each runs headless in a fresh kernel, on
fresh ranks, and every checker's verdict is read back item by item.

    python -m dpcourse.grade submissions/             # every .ipynb below the folder
    python -m dpcourse.grade A.ipynb B.ipynb --json   # JSON Lines: one record per notebook, for a gradebook

Each notebook runs in a temporary copy of its folder (a submission's ``%%writefile`` and the
files beside it, e.g. ``train_single.py``, stay its own), each cell with a time limit; a
notebook that raises, hangs or kills its kernel is reported as such (its kernel and ranks
stopped) and the others still run.
A check cell's report carries its verdict as data (``Report.to_dict``, under ``report.MIME``),
so nothing is parsed from printed text. Needs nbclient and ipykernel (the course's ``dev``
extra).

Exit status:
  0  every notebook ran and every check in it passed
  1  a judged item failed, or a notebook raised, hung, killed its kernel or ran no check at
     all, or its code does what its checks cannot see (a flag, below)
  2  the command line was wrong: a path that is neither a notebook nor a folder, or no
     notebook at all
  3  nothing failed, but not all was judged: a check not attempted (an untouched starter), or
     an item not judged (e.g. a prediction not written yet)

The table has a row per item; its "reference" column says "used" on the rows of a check that
saw a reference solution read before or while it judged (by dpc.exercises.solution,
report.fix() or the learner's own code), blank otherwise: the verdict stands, for an
instructor to weigh. A row "flag" says what the notebook's own code does that no check can
see: it changes the course's code in its kernel, reaches the course's record of references
read, or names the references' files. --json writes JSON Lines instead: one compact JSON
object per notebook, on a line of its own as soon as that notebook is graded:
  {"notebook", "seconds", "error", "flags", "used_reference", "reports": [...]}
with "used_reference" true when any of its reports used one, and each report as the check
gave it: {"title", "attempted", "passed", "used_reference", "references", "items": [...]}.
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

from .grading.report import MIME

TIMEOUT = 600.0  # seconds one cell may run
PASSED, FAILED, USAGE, INCOMPLETE = 0, 1, 2, 3  # exit statuses (the module's docstring)


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
            "flags": flags(nb), "reports": reports}


def flags(nb) -> list[str]:
    """What the notebook's own code does that its checks cannot see, read from its cells: it
    changes the course's code in its kernel (an assignment to, ``setattr`` on or ``del`` of an
    attribute of ``dpcourse`` or of something imported from it), reaches the course's record
    of references, or names the references' files or a notebook's stored reference. A check's
    verdict in such a notebook is not to be trusted as it stands."""
    import ast

    trees = []
    for cell in nb.cells:
        try:
            trees.append(ast.parse(_python(cell.source)) if cell.cell_type == "code" else None)
        except SyntaxError:
            continue
    nodes = [n for tree in trees if tree is not None for n in ast.walk(tree)]
    # the names the course goes by in this notebook's kernel, whichever cell bound them
    course = {a.asname or a.name.split(".")[0] for n in nodes if isinstance(n, ast.Import)
              for a in n.names if a.name.split(".")[0] == "dpcourse"}
    course |= {a.asname or a.name for n in nodes if isinstance(n, ast.ImportFrom)
               and (n.module or "").split(".")[0] == "dpcourse" for a in n.names}
    found = [flag for tree in trees if tree is not None for n in ast.walk(tree) for flag in _flag(n, course)]
    return list(dict.fromkeys(found))


def _python(source: str) -> str:
    """A cell's code, its IPython magics and shell lines left out."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def _flag(node, course: set) -> list[str]:
    import ast

    def root(expr):
        while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Call)):
            expr = expr.value if not isinstance(expr, ast.Call) else expr.func
        return expr.id if isinstance(expr, ast.Name) else None

    targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    changed = [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and root(t) in course]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
            and node.args and root(node.args[0]) in course:
        changed.append(ast.unparse(node.args[0]))
    out = [f"it changes the course's code in its kernel ({c})" for c in changed]
    if isinstance(node, (ast.Attribute, ast.alias)) and "provenance" in (getattr(node, "attr", None) or
                                                                         getattr(node, "name", "")):
        out.append("it reaches the course's record of the references read")
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if "solutions" in node.value and ("dpcourse" in node.value or "/" in node.value):
            out.append("it names the references' files")
        if node.value == "solution":
            out.append("it reads a reference stored in a notebook")
        if "git" in node.value and "show" in node.value:
            out.append("it reads the course's history")
    return out


HEADER = ("notebook", "check", "item", "reference", "status")


def rows(result: dict) -> list[tuple[str, str, str, str, str]]:
    """(notebook, check, item, reference, status) per item; reference "used" when the check
    saw a reference read (``Report.used_reference``), else ""; status "passed", "failed", "not
    judged" or "not attempted"; one row for a notebook without any report."""
    name, out = Path(result["notebook"]).name, []
    words = {"pass": "passed", "fail": "failed", "skip": "not judged"}
    for report in result["reports"]:
        used = "used" if report.get("used_reference") else ""
        if not report["attempted"]:
            out.append((name, report["title"], "-", used, "not attempted"))
        for item in report["items"]:
            out.append((name, report["title"], item["name"], used, words[item["status"]]))
    for flag in result.get("flags", []):
        out.append((name, "-", "-", "flag", f"not to be trusted: {flag}"))
    if not result["reports"]:
        out.append((name, "-", "-", "", f"no check ran ({result['error'] or 'no check cell'})"))
    elif result["error"]:
        out.append((name, "-", "-", "", f"error: {result['error']}"))
    return out


def render(results: list[dict]) -> list[str]:
    """The table: a header line, then ``rows`` of every result, in columns (status last, whole)."""
    table = [row for result in results for row in rows(result)]
    widths = [max(len(r[i]) for r in table + [HEADER]) for i in range(4)]
    widths = [min(w, limit) for w, limit in zip(widths, (34, 28, 70, 9))]
    return ["  ".join(cell[:w].ljust(w) for cell, w in zip(row, widths)) + "  " + row[4]
            for row in [HEADER] + table]


def record(result: dict) -> dict:
    """A notebook's JSON record: ``grade``'s result, with "used_reference" true when any of
    its reports used a reference (each report keeps its own "used_reference" and "references")."""
    used = any(report.get("used_reference") for report in result["reports"])
    return {**{k: v for k, v in result.items() if k != "reports"}, "used_reference": used,
            "reports": result["reports"]}


def exit_status(results: list[dict]) -> int:
    """FAILED when an item failed or a notebook raised, hung, killed its kernel or ran no
    check; else INCOMPLETE when a check was not attempted, judged no item or left one not
    judged; else PASSED."""
    incomplete = False
    for result in results:
        if result["error"] or not result["reports"] or result.get("flags"):
            return FAILED
        for report in result["reports"]:
            if any(item["status"] == "fail" for item in report["items"]):
                return FAILED
            if not report["attempted"] or not report["items"] or any(
                    item["status"] != "pass" for item in report["items"]):
                incomplete = True
    return INCOMPLETE if incomplete else PASSED


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.grade", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__[__doc__.index("Exit status:"):],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="exercise notebooks, or folders of them")
    parser.add_argument("--json", action="store_true",
                        help="JSON Lines on stdout: one JSON object per notebook per line, as each finishes")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds one cell may run (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        paths = notebooks_in(args.paths)
    except SystemExit as refused:
        parser.error(str(refused).removeprefix("error: "))   # exits with USAGE
    if not paths:
        parser.error(f"no notebook (.ipynb) in {', '.join(args.paths)}")
    results = []
    for path in paths:
        print(f"grading {path} ...", file=sys.stderr, flush=True)
        results.append(grade(path, args.timeout))
        if args.json:
            print(json.dumps(record(results[-1]), separators=(",", ":")), flush=True)
    if not args.json:
        print("\n".join(render(results)), flush=True)
    return exit_status(results)


if __name__ == "__main__":
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiet kernels
    sys.exit(main())
