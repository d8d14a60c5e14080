"""What a new learner's first minutes rely on: the quick start installs the CPU build, and the
outputs a learner's run saves stay out of git (a real git repository, the README's line)."""
from __future__ import annotations

import glob
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dpcourse.strip_outputs import strip

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_the_learners_install_line_takes_torch_from_the_cpu_wheel_index():
    open_course = re.findall(r"```bash\n(.+?)\n```", _readme())[0]
    install = re.search(r"pip install (torch==[\d.]+[^&]*)&&", open_course).group(1).split()
    assert install[0] == "torch==2.13.0" and " ".join(install[1:]) == CPU_INDEX, open_course


def _git_config_line() -> str:
    """The README's one line that turns the filter on, as written there."""
    lines = re.findall(r"^(git config filter\.[^\n]+)$", _readme(), re.M)
    assert len(lines) == 1, lines
    return lines[0]


def test_every_stored_notebook_passes_the_filter_unchanged():
    books = glob.glob(str(ROOT / "notebooks" / "**" / "*.ipynb"), recursive=True)
    assert books
    for book in books:
        text = Path(book).read_text(encoding="utf-8")
        assert strip(text) == text, f"{book}: stored with something a run adds (run python -m dpcourse.strip_outputs)"


def _run(*args, cwd, **kw):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=True, timeout=60, **kw)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_run_notebook_shows_no_change_in_git_once_the_readme_line_is_run(tmp_path):
    """A clone with the README's ``git config`` line: outputs, counts, the kernel's version and
    widget state written by a run show no diff and are never stored; an edited cell is."""
    repo = tmp_path / "clone"
    (repo / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / ".gitattributes", repo / ".gitattributes")
    book = repo / "notebooks" / "4.1a.ipynb"
    shutil.copy(ROOT / "notebooks" / "4.1a-data-parallelism-in-depth.ipynb", book)
    venv = repo / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # the line names the clone's venv
    (venv / "python").chmod(0o755)
    (repo / ".gitignore").write_text(".venv/\n")
    _run("git", "init", "-q", cwd=repo)
    _run("git", "config", "user.email", "learner@example.com", cwd=repo)
    _run("git", "config", "user.name", "learner", cwd=repo)
    _run("bash", "-c", _git_config_line(), cwd=repo)
    _run("git", "add", ".gitattributes", ".gitignore", "notebooks", cwd=repo)
    _run("git", "commit", "-q", "-m", "course", cwd=repo)
    stored = book.read_text(encoding="utf-8")

    notebook = json.loads(stored)  # what JupyterLab saves after Run All
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    code[0]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["Cluster(...)\n"]}]
    code[0]["execution_count"] = 1
    code[0]["metadata"]["execution"] = {"iopub.status.idle": "2026-01-01T00:00:00Z"}
    notebook["metadata"]["language_info"] = {"name": "python", "version": "3.11.9", "mimetype": "text/x-python"}
    notebook["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    book.write_text(json.dumps(notebook, indent=1) + "\n", encoding="utf-8")
    # git notices the changed size before it asks the filter, so status may name the file until
    # it is added; the diff is empty and what a commit would store is the stored notebook
    assert _run("git", "diff", cwd=repo).stdout == ""
    _run("git", "add", "-A", cwd=repo)
    assert _run("git", "status", "--porcelain", cwd=repo).stdout == ""
    assert _run("git", "show", ":notebooks/4.1a.ipynb", cwd=repo).stdout == stored
    assert book.read_text(encoding="utf-8") != stored  # the learner's copy keeps its outputs

    code[0]["source"] = ["print('my change')\n"]
    book.write_text(json.dumps(notebook, indent=1) + "\n", encoding="utf-8")
    diff = _run("git", "diff", cwd=repo).stdout
    assert "my change" in diff and "Cluster(...)" not in diff and "3.11.9" not in diff


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_without_the_line_git_skips_the_filter(tmp_path):
    """A fresh clone that never ran the line: git neither fails nor strips (no surprise)."""
    repo = tmp_path / "clone"
    repo.mkdir()
    shutil.copy(ROOT / ".gitattributes", repo / ".gitattributes")
    (repo / "a.ipynb").write_text((ROOT / "notebooks" / "4.1a-data-parallelism-in-depth.ipynb").read_text())
    _run("git", "init", "-q", cwd=repo)
    _run("git", "add", ".", cwd=repo)
    assert _run("git", "status", "--porcelain", cwd=repo).stdout.count("A ") == 2


def test_text_that_is_not_a_notebook_passes_unchanged():
    assert strip("not json {") == "not json {"
    assert strip('{"a": 1}') == '{"a": 1}'


def _widget_output() -> dict:
    return {"output_type": "display_data", "metadata": {},
            "data": {"text/plain": "VBox(children=(...))",
                     "application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                                  "model_id": "0123abcd"}}}


@pytest.mark.timeout(120)
def test_a_jupyter_server_with_the_courses_config_saves_widgets_as_a_sentence(tmp_path):
    """A real Jupyter server, configured by the file ``pip install`` puts in the environment's
    ``etc/jupyter``, saves a notebook whose widget outputs would reopen as "model not found"
    with the sentence instead; other outputs are kept."""
    import os
    import socket
    import time
    import urllib.request

    from dpcourse.strip_outputs import WIDGET_FALLBACK
    from dpcourse.pool.kernel.procs import free_port

    config = ROOT / "dpcourse" / "jupyter_config"
    project = tomllib_load()["tool"]["setuptools"]["data-files"]
    assert project["etc/jupyter/jupyter_server_config.d"] == [
        str((config / "jupyter_server_config.d" / "dpcourse.json").relative_to(ROOT))]
    port, token = free_port(), "t0ken"
    env = {**os.environ, "JUPYTER_CONFIG_PATH": str(config), "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")}
    server = subprocess.Popen([sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={port}",
                               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
                               "--ServerApp.ip=127.0.0.1", "--allow-root"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
                time.sleep(0.3)
        notebook = json.loads((ROOT / "notebooks" / "4.1a-data-parallelism-in-depth.ipynb").read_text())
        code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
        printed = {"output_type": "stream", "name": "stdout", "text": ["Cluster(...)\n"]}
        code[0]["outputs"], code[1]["outputs"] = [printed, _widget_output()], [_widget_output()]
        body = json.dumps({"type": "notebook", "format": "json", "content": notebook}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/contents/saved.ipynb", data=body,
                                         method="PUT", headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status in (200, 201)
        saved = json.loads((tmp_path / "saved.ipynb").read_text())
        outputs = [c["outputs"] for c in saved["cells"] if c["cell_type"] == "code"][:2]
        assert outputs[0][0]["text"] == ["Cluster(...)\n"]
        for output in (outputs[0][1], outputs[1][0]):
            assert list(output["data"]) == ["text/plain"] and "".join(output["data"]["text/plain"]) == WIDGET_FALLBACK
    finally:
        server.terminate()
        server.wait(30)


def tomllib_load() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())
