"""Write each try-it cell's metadata from its reference: ``python -m dpcourse.exercises.cells``.

A try-it cell (tag ``try-it``) names its try-it in ``metadata["dpcourse"]["try_it"]`` and
carries the hash of the reference (``solution_sha256``), never its text: the grader and the
tests tell an edited reference from the one the notebook was written against. This writes
every hash from ``solutions/tryits/<name>.py`` and says which notebooks it changed;
``tests/test_tryits.py`` fails while any cell's hash and its reference differ.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from ..grading import provenance

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def digest(name: str) -> str:
    """The hash a try-it cell carries: sha256 of its reference's text."""
    return hashlib.sha256(provenance.reference_text(name).encode()).hexdigest()


def sync(path: Path) -> bool:
    """Write the hash of every try-it cell of notebook ``path``; True when one changed."""
    notebook = json.loads(path.read_text())
    changed = False
    for cell in notebook["cells"]:
        meta = cell.get("metadata", {})
        if "try-it" in meta.get("tags", []):
            want = digest(meta["dpcourse"]["try_it"])
            changed |= meta["dpcourse"].get("solution_sha256") != want
            meta["dpcourse"]["solution_sha256"] = want
    if changed:
        path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    return changed


def main(folder: Path = NOTEBOOKS) -> int:
    changed = [p.name for p in sorted(folder.glob("*.ipynb")) if sync(p)]
    print("updated: " + ", ".join(changed) if changed else "every try-it cell's hash matches its reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
