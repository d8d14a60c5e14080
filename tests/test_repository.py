"""The repository keeps its promises: README commands, CI, environment.yml, stripped notebooks."""
from __future__ import annotations

import glob
import importlib
import json
import re
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml

from dpcourse.pool.kernel.procs import free_port

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_quick_start_is_two_commands_that_install_the_cpu_torch_first():
    open_course, run_tests = _readme_commands()[:2]
    for cmd in (open_course, run_tests):
        assert cmd.index("pip install torch==2.13.0") < cmd.index('pip install -e ".[dev]"')
    assert open_course.endswith("jupyter lab --allow-root notebooks/")
    assert run_tests.endswith("python -m pytest -n 2")  # everything, two workers (pyproject: --dist loadfile)


def test_ci_runs_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    spelled_out = re.search(r"^cmd='(.+)'$", script, re.M).group(1)
    assert spelled_out == _readme_commands()[1]
    extracted = subprocess.run(
        ["bash", "-c", re.search(r"readme=\$\((.+?)\)\n", script).group(1)],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert extracted == spelled_out  # what .ci/run compares against at run time


def test_environment_yml_matches_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = env["dependencies"]
    assert "python=3.11" in deps and "pip" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    assert pip == ["-e .[dev]"]
    assert "dev" in project["optional-dependencies"]
    low = re.search(r">=\s*([\d.]+)", project["requires-python"]).group(1)
    assert tuple(map(int, low.split("."))) <= (3, 11)


def test_top_level_layout():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:  # not a git checkout: look at the tree instead
        tracked = [str(p.relative_to(ROOT)) for p in ROOT.iterdir()]
    top = {p.split("/")[0] for p in tracked}
    expected = {"README.md", "environment.yml", "pyproject.toml", "notebooks", "dpcourse",
                "launch", "tests", ".ci", ".gitignore", ".gitattributes"}
    assert top <= expected, f"unexpected top-level entries: {top - expected}"


def test_notebooks_are_stored_without_outputs():
    books = glob.glob(str(ROOT / "notebooks" / "**" / "*.ipynb"), recursive=True)
    assert len(books) >= 2
    for book in books:
        cells = json.loads(Path(book).read_text())["cells"]
        for cell in cells:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, book


def test_notebooks_are_valid_nbformat():
    """JupyterLab refuses cells whose ids break the schema (e.g. a dot in an id)."""
    import nbformat

    books = glob.glob(str(ROOT / "notebooks" / "**" / "*.ipynb"), recursive=True)
    for book in books:
        nbformat.validate(nbformat.read(book, as_version=4))


def _readme_table() -> set[str]:
    """The names of the README's table "The package, name by name", as written: ``dpc.viz.Panel``."""
    table = (ROOT / "README.md").read_text().split("## The package, name by name", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(dpc\.[\w.]+)`", table, re.M))


def test_the_rooms_export_the_readme_table_and_nothing_else():
    """Each room of the table (``dpc``, ``dpc.viz``, ...) lists in ``__all__`` exactly its names
    of the table, and re-exports no other name of the package: the rest is imported from its
    module (``from dpcourse.collectives.cost import num_steps``)."""
    listed = _readme_table()
    assert len(listed) >= 30, sorted(listed)  # the table was found and read
    rooms = {name.rsplit(".", 1)[0] for name in listed}
    exported, hidden = set(), []
    for room in sorted(rooms):
        module = importlib.import_module(room.replace("dpc", "dpcourse", 1))
        names = getattr(module, "__all__", None)
        assert names is not None, f"{module.__name__} has no __all__"
        exported |= {f"{room}.{name}" for name in names}
        assert all(hasattr(module, name) for name in names), f"{module.__name__}.__all__ names a missing name"
        for name, value in vars(module).items():  # a class or function of another module, not listed
            home = getattr(value, "__module__", None)
            if (not name.startswith("_") and name not in names and not isinstance(value, type(module))
                    and isinstance(home, str) and home.startswith("dpcourse.") and home != module.__name__):
                hidden.append(f"{module.__name__}.{name} (from {home})")
    assert exported == listed, (f"exported but not in the README's table: {sorted(exported - listed)}; "
                                f"in the table but not exported: {sorted(listed - exported)}")
    assert not hidden, f"re-exported without being in __all__: {hidden}"


def test_readme_course_command_serves_the_notebooks():
    """The part of the first command that opens the course really starts JupyterLab on notebooks/."""
    launch = _readme_commands()[0].split(" && ")[-1].split()  # .venv/bin/jupyter lab ... notebooks/
    jupyter = Path(sys.executable).with_name("jupyter")
    port = free_port()
    args = [str(jupyter)] + launch[1:] + ["--no-browser", f"--ServerApp.port={port}",
                                          "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=t"]
    server = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token=t", timeout=5) as r:
                    names = {item["name"] for item in json.load(r)["content"]}
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start: {server.communicate(timeout=10)[1][-2000:]}")
                time.sleep(0.3)
        chapters = {p.name for p in (ROOT / "notebooks").glob("4*.ipynb")}
        assert len(chapters) == 9 and chapters <= names   # 4.1a-b, 4.2a-g
    finally:
        server.terminate()  # our own child, by its Popen handle
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_the_fast_tier_covers_every_room():
    """Every room of the package and every module beside them is used by a test file of the
    fast tier (`pytest -m "not slow"`), so that tier says something about each."""
    from conftest import is_slow

    package = ROOT / "dpcourse"
    rooms = {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    rooms |= {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    covered = set()
    for test in (ROOT / "tests").glob("test_*.py"):
        if is_slow(test):
            continue
        text = test.read_text()
        covered |= {room for room in rooms
                    if re.search(rf"\b(dpcourse|dpc)\.{room}\b|from dpcourse import [^\n]*\b{room}\b", text)}
    assert rooms <= covered, f"rooms no fast test file uses: {sorted(rooms - covered)}"
