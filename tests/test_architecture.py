"""The package's rooms depend on each other in one direction: no import cycle, lazy or not."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dpcourse"


def room_of(module: str) -> str:
    """dpcourse.train.runner -> "train"; dpcourse.backends -> "backends"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(path: Path, module: str) -> set[str]:
    """Every dpcourse module ``path`` imports, at top level or inside a function."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("dpcourse.")}


def room_graph() -> dict[str, set[str]]:
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    graph = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for target in imported_modules(path, module):
            if room_of(target) in rooms and room_of(target) != room_of(module):
                graph[room_of(module)].add(room_of(target))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of rooms that import each other in a circle, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_between_rooms():
    graph = room_graph()
    assert graph["train"] and "memory" not in graph["train"], "train measures through observers, not memory"
    assert "train" not in graph["scratch"], "the from-scratch algorithms import nothing from the runner"
    cycle = find_cycle(graph)
    assert cycle is None, "rooms import each other: " + " -> ".join(cycle)


def module_graph() -> dict[str, set[str]]:
    """module -> the modules of its own room it imports (``from . import x`` counts as module
    ``x``, not its package), at top level or inside a function."""
    paths = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PACKAGE.rglob("*.py")}
    graph = defaultdict(set)
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = (".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                        if node.level else node.module or "")
                found = {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names}
            else:
                continue
            graph[module] |= {m for m in found if m in paths and m != module and room_of(m) == room_of(module)}
    return graph


def test_no_import_cycle_between_the_modules_of_a_room():
    cycle = find_cycle(module_graph())
    assert cycle is None, "modules of one room import each other: " + " -> ".join(cycle)


def test_the_grading_framework_knows_nothing_of_the_content():
    graph = room_graph()
    assert graph["grading"] <= {"pool", "processes", "patching", "tracking"}, graph["grading"]
    assert "grading" in graph["exercises"] and "grading" in graph["grade"]


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_leaf_rooms_import_no_other_room():
    graph = room_graph()
    # the pool runs anything, knows nothing of the lessons
    assert graph["pool"] <= {"backends", "processes", "torch_private", "tracking", "patching"}
    assert graph["tracking"] <= {"torch_private", "patching"}, "what ranks record knows nothing of the pool or the lessons"
    readers = {room for room, targets in graph.items() if "tracking" in targets}
    assert readers <= {"pool", "observe", "grading", "exercises"}, \
        f"only the pool, the observers and the checks read the tracker: {readers}"
    assert not graph["processes"], "the process toolbox (pool, train, exercises, tests use it) imports no room"
    assert "pool" not in graph["train"], "the runner runs under torchrun: it never needs the notebook's ranks"
    assert graph["torch_private"] <= {"patching"}, "the one home of PyTorch's private names imports no room but patching"
    assert "collectives" not in graph or graph["collectives"] <= {"pool", "backends", "vocab", "models"}
    assert graph["observe"] <= {"tracking", "collectives", "memory", "vocab", "models", "backends", "torch_private"}


# --------------------------------------------------------------- short functions, no copies
MAX_FUNCTION_LINES = 60
# The scripts a learner reads whole (each one stands alone, so they repeat each other on purpose).
TEACHING = ("scripts/", "exercises/starters/", "exercises/solutions/")


def package_sources() -> dict[str, str]:
    """relative path -> source, for every module of dpcourse/ outside the teaching scripts."""
    paths = sorted(PACKAGE.rglob("*.py"))
    rels = {p.relative_to(PACKAGE).as_posix(): p for p in paths}
    return {rel: p.read_text() for rel, p in rels.items() if not rel.startswith(TEACHING)}


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """name -> lines (``end_lineno - lineno + 1``) of every function longer than ``limit``;
    a nested function counts in its own right, and inside the one around it."""
    return {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit}


def repeated_windows(sources: dict[str, str], size: int = 6) -> list[list[tuple[str, int]]]:
    """Places (path, first line) where the same ``size`` lines of code stand more than once,
    white space folded; blank lines, comments, imports and lone brackets are passed over."""
    places = defaultdict(list)
    for rel, source in sources.items():
        lines = [(n, " ".join(line.split())) for n, line in enumerate(source.splitlines(), 1)]
        code = [(n, t) for n, t in lines
                if len(t) > 2 and not t.startswith(("#", "import ", "from "))]
        for i in range(len(code) - size + 1):
            places[tuple(t for _, t in code[i:i + size])].append((rel, code[i][0]))
    return [where for where in places.values() if len(where) > 1]


def test_no_function_is_over_60_lines():
    too_long = [f"{rel}::{name} ({lines} lines)" for rel, source in package_sources().items()
                for name, lines in long_functions(source).items()]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: split them into named steps: {too_long}"


def test_no_six_lines_stand_twice_in_the_package():
    repeated = repeated_windows(package_sources())
    assert not repeated, f"the same six lines stand in several places, make them one function: {repeated[:5]}"


def test_the_scans_find_what_they_look_for():
    nested = "def outer():\n    def inner():\n" + "        x = 1\n" * 61 + "    return inner\n"
    assert long_functions(nested) == {"outer": 64, "inner": 62}
    assert long_functions(nested, limit=62) == {"outer": 64}
    body = "".join(f"    total += step({i})\n" for i in range(6))
    copied = {"a.py": f"def f():\n{body}", "b.py": f"import os\n\ndef g():\n    # why\n{body}"}
    assert repeated_windows(copied) == [[("a.py", 2), ("b.py", 5)]]
    assert repeated_windows({"a.py": copied["a.py"]}) == []


# --------------------------------------------------------------- one way to patch
PATCHING = "patching.py"   # the one module that sets another module's attributes


def _imported_names(tree: ast.AST) -> set[str]:
    """Names an ``import`` binds anywhere in ``tree`` (modules, or what was taken from them)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def patch_sites(source: str) -> list[int]:
    """Lines that set an attribute of something imported (``torch.save = f``,
    ``dist.Work.wait = f``, ``setattr(c10d, name, f)``): patches not made by ``patched``."""
    tree = ast.parse(source)
    imported = _imported_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            targets = [t for t in targets if isinstance(t, ast.Attribute)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            targets = node.args[:1]
        found += [node.lineno for t in targets if _root(t) in imported]
    return sorted(set(found))


def test_attributes_of_imported_modules_are_set_only_through_patched():
    sites = {rel: lines for rel, source in package_sources().items()
             if rel != PATCHING and (lines := patch_sites(source))}
    assert not sites, f"use dpcourse.patching.patched (it restores what it set) instead of assigning: {sites}"


def test_the_patch_scan_finds_what_it_looks_for():
    source = ("import torch\nimport torch.distributed as dist\nfrom os import path\n"
              "torch.save = 1\ndist.Work.wait = 2\nsetattr(path, 'x', 3)\n"
              "class K:\n    pass\nK.y = 4\nobj = object()\nobj.z = 5\n")
    assert patch_sites(source) == [4, 5, 6]
