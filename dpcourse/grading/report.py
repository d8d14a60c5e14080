"""What a checker says: a verdict and, item by item, what passed, what failed and what it saw."""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from . import provenance

MARKS = {"pass": "✓", "fail": "✗", "skip": "–"}
# the MIME type under which a notebook output carries a report as data (read by dpcourse.grade)
MIME = "application/vnd.dpcourse.report+json"


@dataclass
class Item:
    """One thing the checker judged: ``status`` is "pass", "fail" or "skip" (could not be judged)."""

    name: str
    status: str
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "pass"


@dataclass(repr=False)
class Report:
    """A checker's verdict. ``attempted`` is False for an untouched starter (nothing is judged).

    title: what was checked, e.g. "Exercise A" or "Self-check 4.1a, question 3". key: the name
    ``dpc.exercises.solution`` knows its reference by ("A", "no_sync", ...), if it has one."""

    title: str
    items: list[Item] = field(default_factory=list)
    attempted: bool = True
    note: str = ""
    key: str = ""
    # the references this check saw used: keys ("A", "no_sync", ...) whose reference text was
    # read before or during the check, by the learner's code or on request (``provenance``)
    references: list[str] = field(default_factory=list)

    @property
    def used_reference(self) -> bool:
        """True when a reference was read before or while the judged code ran: the verdict
        stands, and an instructor sees it (the report's last line, the grader's column)."""
        return bool(self.references)

    @property
    def passed(self) -> bool:
        return self.attempted and bool(self.items) and all(i.passed for i in self.items)

    def add(self, name: str, ok: bool | None, detail: str = "") -> Item:
        """Record one item: ok True/False, or None when an earlier failure kept it from being judged."""
        status = "skip" if ok is None else ("pass" if ok else "fail")
        item = Item(name, status, detail)
        self.items.append(item)
        return item

    def fail(self, name: str, detail: str, later, why: str = "judged once it runs") -> "Report":
        """The one way to fail item ``name`` (``detail`` says how) and leave each item of
        ``later`` not judged, ``why`` saying what it waits for; returns the report."""
        self.add(name, False, detail)
        for other in later:
            self.add(other, None, why)
        return self

    def fix(self) -> "Reference":
        """The reference solution, on request: the first report names the behaviour, not the line."""
        if not self.key:
            raise ValueError(f"{self.title} has no reference solution to show")
        provenance.shown(self.key)   # an instructor sees it in the reports that follow
        return Reference(provenance.reference_text(self.key))

    def verdict(self) -> str:
        if not self.attempted:
            return f"{self.title}: not attempted yet. {self.note}".rstrip()
        if self.passed:
            return f"{self.title}: passed ({len(self.items)} of {len(self.items)} checks)."
        failed = sum(1 for i in self.items if i.status == "fail")
        return f"{self.title}: {failed} of {len(self.items)} checks failed."

    def __str__(self) -> str:
        lines = [self.verdict()]
        for i in self.items:
            lines.append(f"  {MARKS[i.status]} {i.name}" + (f": {i.detail}" if i.detail else ""))
        if self.note and self.attempted:
            lines.append(self.note)
        if self.used_reference:
            lines.append(self.reference_line())
        return "\n".join(lines)

    def reference_line(self) -> str:
        return f"Used the reference: {provenance.describe(self.references)}."

    __repr__ = __str__  # what a notebook shows as text, and what a terminal prints

    def to_dict(self) -> dict:
        """The verdict as data: title, attempted, passed, and each item's name and status."""
        return {"title": self.title, "attempted": self.attempted, "passed": self.passed,
                "used_reference": self.used_reference, "references": list(self.references),
                "items": [{"name": i.name, "status": i.status} for i in self.items]}

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        # a notebook keeps this beside the text and HTML, so a grader can read the verdict
        return {MIME: self.to_dict()}

    def _repr_html_(self) -> str:
        colour = {"pass": "#1a7f37", "fail": "#cf222e", "skip": "#6e7781"}
        rows = "".join(
            f"<tr><td style='color:{colour[i.status]};font-weight:bold'>{MARKS[i.status]}</td>"
            f"<td style='text-align:left'>{html.escape(i.name)}</td>"
            f"<td style='text-align:left'>{html.escape(i.detail)}</td></tr>" for i in self.items)
        table = f"<table>{rows}</table>" if rows else ""
        note = f"<p>{html.escape(self.note)}</p>" if self.note and self.attempted else ""
        used = f"<p><b>{html.escape(self.reference_line())}</b></p>" if self.used_reference else ""
        return f"<p><b>{html.escape(self.verdict())}</b></p>{table}{note}{used}"


class Reference(str):
    """Source text that a notebook shows as code, not as a quoted string."""

    def __repr__(self) -> str:
        return str(self)
