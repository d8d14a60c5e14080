"""The course as a learner sees it: JupyterLab in headless Chromium, every notebook Run All.

A real JupyterLab server (our own child process, on 127.0.0.1, fresh config/data/runtime
folders) serves a copy of the course, so that autosave never writes outputs into the
repository. Playwright drives Debian's Chromium (never a downloaded browser): each notebook
is opened, run with Run All, and checked for error outputs, widgets that did not render,
browser console errors and requests that leave this machine. The players are moved after
Run All, when the notebook's own cluster is already shut down. Then JupyterLab is switched to
its dark theme (the outputs Run All drew, not a second run), and the widgets' text is checked
for contrast in both themes. Screenshots of each notebook and of every widget, in both themes
(``-dark``), go to out/browser/.

    .venv/bin/python -m pytest -m browser      # just this test
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest
from _browser_page import DARK, LIGHT, NotebookPage  # tests/_browser_page.py: the notebook-page helpers
from _sittings import course_map_minutes, reading_minutes

from dpcourse.pool.kernel.procs import free_port

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "out" / "browser"
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("4*.ipynb")) + \
    sorted(f"exercises/{p.name}" for p in (ROOT / "notebooks" / "exercises").glob("*.ipynb"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LOCAL_HOSTS = {"127.0.0.1", "localhost"}
FIGURES = ["draw_bucket_sweep(", "plot_memory(", "draw_collectives(", "broken_barh("]  # figures whose screenshots are kept for a look
# the interactive widgets each notebook must have, so their checks below can never be skipped
MOVED = {"4.1a-data-parallelism-in-depth.ipynb": ["Panel("],
         "4.1b-ring-fsdp-and-memory.ipynb": ["RingPlayer(", 'over="player"', "MemoryCalculator("],
         "4.2a-communication-and-ddp.ipynb": ["cluster_status("], "4.2b-fsdp.ipynb": ["Panel("]}
TOKEN = "browser-test"
# no news, no update checks: nothing in JupyterLab itself may reach out of this machine
SETTINGS = {"@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"fetchNews": "false", "checkForUpdates": False}}


def _need_browser():
    """Skip outside CI when Chromium or Playwright is missing; in CI that is a failure."""
    missing = []
    if not os.path.exists(CHROMIUM):
        missing.append(f"{CHROMIUM} is missing (apt-get install -y chromium; .ci/run does this)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append('playwright is not installed (pip install -e ".[dev]")')
    if missing:
        reason = "the browser test cannot run: " + "; ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


def _wait_for_server(server, port: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={TOKEN}", timeout=5):
                return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start: {server.communicate(timeout=10)[1][-3000:]}")
            time.sleep(0.3)


def _copy_course(dest: Path) -> None:
    """notebooks/ and launch/ (4.2 runs ../launch/*.sh) as a fresh clone has them: without
    what git ignores, e.g. files a learner wrote while doing the exercises."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z",
                             "notebooks", "launch"], cwd=ROOT, capture_output=True, text=True)
    files = [f for f in listed.stdout.split("\0") if f] if listed.returncode == 0 else []
    if not files:  # not a git checkout: the folders as they are
        files = [str(p.relative_to(ROOT)) for d in ("notebooks", "launch")
                 for p in (ROOT / d).rglob("*") if p.is_file() and ".ipynb_checkpoints" not in p.parts]
    for name in files:
        if (ROOT / name).is_file():  # a deleted but still tracked file is skipped
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(port, log path) of a JupyterLab server on a copy of the course; stopped by its handle."""
    _need_browser()
    tmp = tmp_path_factory.mktemp("lab")
    course = tmp / "course"
    _copy_course(course)
    config = tmp / "config"
    for name, values in SETTINGS.items():
        path = config / "lab" / "user-settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_DATA_DIR": str(tmp / "data"),
           "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), "JUPYTER_PLATFORM_DIRS": "1"}
    port = free_port()
    args = [str(Path(sys.executable).with_name("jupyter")), "lab", "--allow-root", "--no-browser",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", f"--IdentityProvider.token={TOKEN}",
            f"--ServerApp.root_dir={course / 'notebooks'}", "--LabApp.expose_app_in_browser=True"]
    log = tmp / "server.log"
    server = subprocess.Popen(args, cwd=course / "notebooks", env=env, stdout=subprocess.DEVNULL,
                              stderr=open(log, "w"), text=True)
    try:
        _wait_for_server(server, port)
        yield port, log
    finally:
        server.terminate()  # our own child, by its handle: it shuts its kernels down
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="module")
def browser(lab, tmp_path_factory):
    """A Chromium context with a new empty profile; records console errors and every request
    that leaves 127.0.0.1."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    record = {"console": [], "remote": []}
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 1800})
        context.on("request", lambda r: _record_request(record, r.url))

        def console(msg):
            if msg.type == "error":
                record["console"].append(msg.text)

        context.on("page", lambda page: page.on("console", console))
        try:
            yield context, record
        finally:
            context.close()


def _record_request(record: dict, url: str) -> None:
    parsed = urlparse(url)
    if parsed.scheme in ("data", "blob", "about") or parsed.hostname in LOCAL_HOSTS:
        return
    record["remote"].append(url)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_the_browser(lab, browser, name):
    port, log = lab
    context, record = browser
    record["console"].clear()
    page = context.new_page()
    page.on("pageerror", lambda err: record["console"].append(f"page error: {err}"))
    nb = NotebookPage(page, port, TOKEN, name)
    try:
        started = time.monotonic()
        nb.open()
        nb.run_all()
        ran = time.monotonic() - started
        stem = Path(name).stem
        nb.screenshot_widgets(ARTIFACTS / stem)
        page.screenshot(path=str(ARTIFACTS / f"{stem}.png"))
        errors = nb.error_outputs()
        assert not errors, f"{name}: error outputs after Run All:\n" + "\n\n".join(errors)
        assert nb.unexecuted_code_cells() == 0, f"{name}: Run All stopped before the last cell"
        warned = nb.warning_outputs()
        assert not warned, (f"{name}: warnings in the learner's view (silence the course's own; tag a "
                            "cell that shows one on purpose 'shows-warning'):\n" + "\n".join(warned))
        broken = nb.broken_widgets()
        assert not broken, f"{name}: widgets that did not render: {broken}"
        missing = [m for m in MOVED.get(name, []) if m not in nb.sources()]
        assert not missing, f"{name}: no cell creates {missing}; update MOVED in this test"
        if "RingPlayer(" in nb.sources():
            _check_ring_player(nb)
        if 'over="player"' in nb.sources():
            _check_slider_redraws(nb, 'over="player"')
        if "MemoryCalculator(" in nb.sources():
            _check_calculator(nb)
        if "Panel(" in nb.sources():
            _check_panel(nb, "Panel(")
        if "cluster_status(" in nb.sources():
            _check_status(nb)
        for marker in MOVED.get(name, []):  # only the widgets the checks moved have a new picture
            slug = re.sub(r"\W+", "", marker)
            nb.screenshot(nb.cell(marker), ARTIFACTS / f"{stem}-moved-{slug}.png")
        for marker in FIGURES:
            if marker in nb.sources():
                nb.screenshot(nb.cell(marker), ARTIFACTS / f"{stem}-{marker.strip('(')}.png")
        _check_dark_theme(nb, page, stem)
        assert not record["console"], f"{name}: browser console errors: {record['console']}"
        assert not record["remote"], f"{name}: requests that left 127.0.0.1: {record['remote']}"
        if name.startswith("4."):  # the course map's time covers reading, the try-its and this run
            floor = {**reading_minutes(ROOT / "notebooks" / name), "Run All here": ran / 60}
            assert course_map_minutes(name) >= sum(floor.values()), \
                f"{name}: the course map says {course_map_minutes(name)} min, but " + \
                ", ".join(f"{k} {v:.0f}" for k, v in floor.items()) + " minutes add up to more"
        print(f"{name}: opened and ran in {ran:.1f} s; lines of stderr by code cell: {nb.stderr_lines()}")
    except Exception:
        page.screenshot(path=str(ARTIFACTS / f"{Path(name).stem}-failed.png"))
        print(Path(log).read_text()[-3000:])
        raise
    finally:
        nb.shutdown_kernel()
        _light_again(nb)  # the theme is a setting of the server: the next notebook opens light
        page.close()


def _check_dark_theme(nb, page, stem: str) -> None:
    """What Run All drew, readable in both themes: the widgets' text has contrast in the light
    theme; then, switched to JupyterLab Dark as a learner would (no second Run All), the same
    outputs are photographed again (``-dark``) and checked the same way."""
    low = nb.low_contrast_text()
    assert not low, f"{nb.name}: widget text hard to read in the light theme: {low}"
    nb.set_theme(DARK)
    nb.screenshot_widgets(ARTIFACTS / f"{stem}-dark")
    page.screenshot(path=str(ARTIFACTS / f"{stem}-dark.png"))
    for marker in FIGURES:
        if marker in nb.sources():
            nb.screenshot(nb.cell(marker), ARTIFACTS / f"{stem}-{marker.strip('(')}-dark.png")
    low = nb.low_contrast_text()
    assert not low, f"{nb.name}: widget text hard to read in the dark theme: {low}"


def _light_again(nb) -> None:
    try:
        nb.set_theme(LIGHT)
    except Exception:  # noqa: BLE001 -- a page that broke already failed the test
        pass


def _image_digest(nb, cell_marker: str) -> str:
    data = nb.image_bytes(cell_marker)
    return hashlib.sha256(data).hexdigest() if data else ""


def _check_slider_redraws(nb, marker: str) -> None:
    before = _image_digest(nb, marker)
    assert before, f"no image under the cell with {marker}"
    nb.move_slider(marker)
    nb.wait_until(lambda: _image_digest(nb, marker) not in ("", before), 30,
                  f"moving the slider of {marker} did not change its picture")


def _check_ring_player(nb) -> None:
    """After Run All the notebook's cluster is shut down: moving the slider redraws, and a new
    numel records a new trace on a fresh cluster instead of freezing (finding 1)."""
    marker = "RingPlayer("
    _check_slider_redraws(nb, marker)
    before = _image_digest(nb, marker)
    nb.select_option(marker, "numel", "4")
    nb.wait_until(lambda: "4 elements" in nb.widget_text(marker) or "Error" in nb.widget_text(marker),
                  120, "the ring player never finished re-running after numel changed")
    text = nb.widget_text(marker)
    assert "2 ranks, 4 elements" in text and "Error" not in text, text
    assert _image_digest(nb, marker) != before


def _check_calculator(nb) -> None:
    marker = "MemoryCalculator("
    before = nb.widget_text(marker)
    nb.fill_number(marker, "world_size", "1")
    nb.wait_until(lambda: nb.widget_text(marker) != before, 30, "the calculator did not react")
    assert "does not fit with any strategy" in nb.widget_text(marker)


def _check_panel(nb, marker: str) -> None:
    """After Run All the notebook's cluster is shut down: Run says so instead of freezing, the
    recover button starts a fresh cluster and draws; moving a control and Run redraws, at the
    picture's natural size."""
    def text():
        return nb.widget_text(marker)

    nb.click_button(marker, "Run")
    nb.wait_until(lambda: "was shut down" in text(), 60, "Run on the shut-down cluster said nothing")
    nb.click_button(marker, "start a fresh cluster")
    nb.wait_until(lambda: "done on 2 ranks" in text() or "Error" in text(), 180,
                  "the panel never finished its run on a fresh cluster")
    assert "Error" not in text(), text()
    first = _image_digest(nb, marker)
    assert first, f"no picture under {marker} after its run"
    natural, shown, room = nb.image_widths(marker)  # its own width where it fits, else the output area's
    assert natural > 0 and abs(shown - min(natural, room)) <= 4, \
        f"{marker}: picture {natural} px wide shown at {shown} px in {room} px of output area"
    nb.move_slider(marker)
    nb.click_button(marker, "Run")
    nb.wait_until(lambda: _image_digest(nb, marker) not in ("", first) and "done on 2 ranks" in text(),
                  180, f"Run of {marker} did not redraw its picture")
    assert "Error" not in text(), text()


def _check_status(nb) -> None:
    marker = "cluster_status("
    nb.wait_until(lambda: "alive" in nb.widget_text(marker), 30, "the status widget shows no ranks")
    nb.click_button(marker, "Refresh")  # after Run All: the notebook's cluster is shut down
    nb.wait_until(lambda: "shut down" in nb.widget_text(marker), 30, "the status widget did not refresh")
