"""What a saved notebook keeps: no widget that cannot come back, and no outputs in git.

A widget's output is a reference to a model that lives in the kernel; a notebook reopened
later has no such model, and JupyterLab's widget renderer then shows "Error displaying
widget: model not found" (it has no fallback to the output's text). So this module is also a
Jupyter server extension, enabled by the ``jupyter_server_config.d/dpcourse.json`` that ``pip
install`` puts under the environment's ``etc/jupyter``: on every save, ``pre_save_hook`` writes
such an output as the sentence ``WIDGET_FALLBACK`` instead. The open notebook keeps its live
widgets; a reopened one says what to run.

Outputs in git (runs anywhere):

git runs this as the clean filter that ``.gitattributes`` names for ``*.ipynb``, once a clone
has said where to find it (the README's one line)::

    git config filter.dpcourse-outputs.clean ".venv/bin/python -m dpcourse.strip_outputs"

It reads a notebook on stdin and writes on stdout what git stores: every code cell without
outputs or execution count, and without the metadata a run adds (the kernel's Python version,
the widgets' saved state, execution timings). The working copy keeps its outputs; ``git
status`` and ``git diff`` see only changes to the cells themselves. Without that line git
ignores the attribute (a filter with no command is skipped), so a fresh clone behaves as
any other. ``python -m dpcourse.strip_outputs NOTEBOOK...`` strips files in place instead.
The output is written as the repository writes notebooks (``json.dumps(..., indent=1,
ensure_ascii=False)`` and a final newline), so a stored notebook passes through unchanged.
"""
from __future__ import annotations

import json
import sys

# What running a notebook adds to its metadata, dropped: the notebook's and each cell's.
RUN_METADATA = ("widgets",)
CELL_RUN_METADATA = ("execution", "scrolled", "collapsed")


def strip(text: str) -> str:
    """The notebook ``text`` (JSON) without what a run added; text that is not a notebook is
    returned unchanged, so a filter never corrupts a file it does not understand."""
    try:
        notebook = json.loads(text)
    except ValueError:
        return text
    if not isinstance(notebook, dict) or not isinstance(notebook.get("cells"), list):
        return text
    metadata = notebook.get("metadata", {})
    for key in RUN_METADATA:
        metadata.pop(key, None)
    if isinstance(metadata.get("language_info"), dict):  # the kernel writes its Python version here
        metadata["language_info"] = {"name": metadata["language_info"].get("name", "python")}
    for cell in notebook["cells"]:
        for key in CELL_RUN_METADATA:
            cell.get("metadata", {}).pop(key, None)
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_FALLBACK = ("Run this cell to see its widget: a widget lives in the kernel that drew it, "
                   "and is not saved with the notebook.")


def replace_widgets(notebook: dict) -> int:
    """Replace every widget output of ``notebook`` (a dict, nbformat 4) by ``WIDGET_FALLBACK``
    as plain text, where the widget would render as "model not found"; the number replaced."""
    replaced = 0
    for cell in notebook.get("cells", []):
        for output in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = output.get("data")
            if isinstance(data, dict) and WIDGET_VIEW in data:
                output["data"] = {"text/plain": WIDGET_FALLBACK}
                output.get("metadata", {}).pop(WIDGET_VIEW, None)
                replaced += 1
    return replaced


def pre_save_hook(model: dict, **kwargs) -> None:
    """The Jupyter server's ``ContentsManager.pre_save_hook``: a notebook is saved with its
    widgets as ``WIDGET_FALLBACK`` (``replace_widgets``); other files as they are."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
        replace_widgets(model["content"])


def _jupyter_server_extension_points() -> list[dict]:
    """This module is a Jupyter server extension (enabled by ``jupyter_server_config.d/dpcourse.json``)."""
    return [{"module": "dpcourse.strip_outputs"}]


def _load_jupyter_server_extension(serverapp) -> None:
    """Run ``pre_save_hook`` on every save (beside any hook of the learner's own)."""
    serverapp.contents_manager.register_pre_save_hook(pre_save_hook)


def main(argv: list[str]) -> int:
    if not argv:  # git's clean filter: stdin to stdout
        sys.stdout.buffer.write(strip(sys.stdin.buffer.read().decode("utf-8")).encode("utf-8"))
        return 0
    for path in argv:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        stripped = strip(text)
        if stripped != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(stripped)
            print(f"stripped {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
