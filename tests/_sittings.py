"""How long a chapter takes a learner, derived from the notebook itself: the floor that the
course map's minutes must not go below (tests/test_notebook_surface.py without running it,
tests/test_browser.py with the time Run All took there).

The rates are a careful reader's: technical prose at 150 words a minute, code at 15 visible
lines a minute (hidden check cells are not read), and 10 minutes for each try-it (reading its
task, writing the API, running its check and reading a failure once): an expert who worked
through 4.2b and 4.2c took 80-90 and 85-95 minutes, which these rates meet only at 10."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE, CODE_LINES_PER_MINUTE, MINUTES_PER_TRY_IT = 150, 15, 10


def course_map_minutes(name: str) -> int:
    """The most minutes the README's course map gives the notebook (a range counts its top)."""
    readme = (ROOT / "README.md").read_text()
    course_map = readme.split("## Course map", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in course_map.splitlines() if Path(name).name in line)
    return max(int(m) for m in re.findall(r"(\d+)(?:–\d+)? min\b", row))


def reading_minutes(path: Path) -> dict[str, float]:
    """Minutes to read the prose, read the visible code and do the try-its."""
    cells = json.loads(path.read_text())["cells"]
    words = sum(len(re.findall(r"\S+", "".join(c["source"]))) for c in cells if c["cell_type"] == "markdown")
    code = sum(1 for c in cells if c["cell_type"] == "code" and "check" not in c["metadata"].get("tags", [])
               for line in "".join(c["source"]).splitlines() if line.strip())
    try_its = sum("try-it" in c["metadata"].get("tags", []) for c in cells)
    return {"prose": words / WORDS_PER_MINUTE, "code": code / CODE_LINES_PER_MINUTE,
            "try-its": try_its * MINUTES_PER_TRY_IT}
