"""What the notebooks put in front of a learner, counted from their sources: the PyTorch APIs
written in code cells, the few names of this package they use (every form: ``dpc.x.y``,
``from dpcourse... import``, aliases), how much of the visible code is ``assert``s, that
each chapter notebook can be finished in a sitting, and that a script a notebook writes
with ``%%writefile`` is the package's script, line for line."""
from __future__ import annotations

import ast
import json
import re
import types
from pathlib import Path

import pytest

import dpcourse as dpc

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("4*.ipynb"))
EXERCISES = sorted((ROOT / "notebooks" / "exercises").glob("*.ipynb"))
# the 26 APIs a data-parallel practitioner must have typed once (all are written out)
APIS = {
    "DistributedSampler": r"\bDistributedSampler\(", "set_epoch": r"\.set_epoch\(",
    "DDP(...)": r"\b(DDP|DistributedDataParallel)\(", "no_sync": r"\.no_sync\(",
    "register_comm_hook": r"\.register_comm_hook\(", "init_device_mesh": r"\binit_device_mesh\(",
    "fully_shard": r"\bfully_shard\(", "reshard_after_forward=": r"reshard_after_forward\s*=",
    "MixedPrecisionPolicy": r"\bMixedPrecisionPolicy\(", "FullyShardedDataParallel(...)": r"\b(FSDP|FullyShardedDataParallel)\(",
    "ShardingStrategy.*": r"\bShardingStrategy\.\w", "an auto-wrap policy": r"\b(ModuleWrapPolicy|size_based_auto_wrap_policy)\b",
    "FSDP1 MixedPrecision": r"\bMixedPrecision\(", "meta-device construction": r"torch\.device\(\s*[\"']meta[\"']\s*\)",
    "to_empty": r"\.to_empty\(", "activation checkpointing": r"\b(checkpoint_wrapper|apply_activation_checkpointing)\(",
    "CPU offload": r"\bCPUOffloadPolicy\(", "clip_grad_norm_": r"\bclip_grad_norm_\(",
    "explicit prefetch": r"\.set_modules_to_(forward|backward)_prefetch\(", "dcp.save/dcp.load": r"\bdcp\.(save|load)\(",
    "the state-dict API": r"\b(get|set)_(model_)?state_dict\(", "set_requires_gradient_sync": r"\.set_requires_gradient_sync\(",
    "SyncBatchNorm": r"\bSyncBatchNorm\b", "Join": r"\bJoin\(", "init_process_group": r"\binit_process_group\(",
    "model.module": r"\bmodel\.module\b",
}
MAX_NAMES, MAX_ASSERT_SHARE, MAX_CELLS, MAX_WORDS = 40, 0.10, 90, 5000


def cells(paths):
    for path in paths:
        for cell in json.loads(path.read_text())["cells"]:
            yield path, cell, "".join(cell["source"])


def python_of(source: str) -> str:
    """A code cell as Python: IPython magics and shell lines dropped, a %%writefile body kept."""
    lines = source.splitlines()
    if lines and lines[0].startswith("%%writefile"):
        return "\n".join(lines[1:])
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)


def names_in(source: str) -> set[str]:
    """Every ``dpcourse`` name a cell uses, as ``dpcourse.a.b``, whatever the spelling: the
    dotted chain from an alias of the package or of one of its modules, up to the first name
    that is no module (a function's or a class's own attributes are not more names)."""
    tree = ast.parse(python_of(source))
    aliases, found = {"dpc": "dpcourse"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "dpcourse":
                    aliases[a.asname or "dpcourse"] = a.name if a.asname else "dpcourse"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dpcourse":
            for a in node.names:
                found.add(f"{node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        parts, base = [], node
        while isinstance(base, ast.Attribute):
            parts.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in aliases:
            continue
        name = aliases[base.id]
        obj = _resolve(name)
        for part in reversed(parts):
            if not isinstance(obj, types.ModuleType):
                break
            name, obj = f"{name}.{part}", getattr(obj, part, None)
        found.add(name)
    return found


def _resolve(dotted_name: str):
    obj = dpc
    for part in dotted_name.split(".")[1:]:
        obj = getattr(obj, part, None)
    return obj


def used_names(paths) -> dict[str, set]:
    used: dict[str, set] = {}
    for path, cell, source in cells(paths):
        if cell["cell_type"] == "code":
            for name in names_in(source):
                used.setdefault(name, set()).add(path.name)
    return used


def test_every_api_is_written_in_a_code_cell():
    code = "\n".join(s for _, c, s in cells(CHAPTERS + EXERCISES) if c["cell_type"] == "code")
    missing = [api for api, pattern in APIS.items() if not re.search(pattern, code)]
    assert not missing, f"written in no code cell: {missing}"


def test_the_notebooks_use_at_most_40_names_of_the_package_each_in_the_readme():
    used = used_names(CHAPTERS + EXERCISES)
    for name in used:
        assert _resolve(name) is not None, f"{name} does not exist in the package"
    assert len(used) <= MAX_NAMES, f"{len(used)} names: {sorted(used)}"
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## The package, name by name", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(dpc\.[\w.]+)", table))
    short = {n.replace("dpcourse", "dpc", 1) for n in used}
    assert short <= listed, f"used but not in the README's table: {sorted(short - listed)}"
    assert listed <= short, f"in the README's table but used by no notebook: {sorted(listed - short)}"


def test_the_name_counter_sees_every_spelling():
    source = ("import dpcourse as d\nfrom dpcourse.observe import Comm as C, Memory\nimport dpcourse.models\n"
              "d.viz.plot_memory(x).savefig(1)\nC(); Memory().at_rest(0)\ndpcourse.models.build_model('mlp').blocks\n"
              "dpc.memory.ledger(1, 2, 'ddp').bytes")
    assert names_in(source) == {"dpcourse.viz.plot_memory", "dpcourse.observe.Comm", "dpcourse.observe.Memory",
                                "dpcourse.models.build_model", "dpcourse.memory.ledger"}


def test_asserts_are_at_most_a_tenth_of_the_visible_code():
    visible = asserts = 0
    for _, cell, source in cells(CHAPTERS + EXERCISES):
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] != "code" or "check" in tags:
            continue
        lines = [line for line in source.splitlines() if line.strip() and not line.strip().startswith("#")]
        visible += len(lines)
        asserts += sum(line.strip().startswith("assert") for line in lines)
    assert asserts / visible <= MAX_ASSERT_SHARE, f"{asserts} of {visible} visible code lines are asserts"


def test_check_cells_are_hidden_from_the_reader():
    for path, cell, _ in cells(CHAPTERS + EXERCISES):
        if "check" in cell.get("metadata", {}).get("tags", []):
            assert cell["metadata"].get("jupyter", {}).get("source_hidden"), f"{path.name} {cell['id']}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_a_chapter_notebook_is_finished_in_a_sitting(path):
    nb = json.loads(path.read_text())
    words = sum(len(re.findall(r"\S+", "".join(c["source"]))) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert len(nb["cells"]) <= MAX_CELLS and words <= MAX_WORDS, (len(nb["cells"]), words)
    first = "".join(nb["cells"][0]["source"])
    assert re.search(r"notebook \d of \d", first) and "minutes" in first, "the first cell says where it sits"


def test_every_notebook_is_in_the_readme_course_map_with_its_time():
    readme = (ROOT / "README.md").read_text()
    course_map = readme.split("## Course map", 1)[1].split("\n## ", 1)[0]
    for path in CHAPTERS + EXERCISES:
        row = next((line for line in course_map.splitlines() if path.name in line), None)
        assert row and re.search(r"\d+ min", row), f"{path.name} is not in the course map with its minutes"


def test_a_script_written_by_a_notebook_is_the_packages_script():
    for path, cell, source in cells(CHAPTERS):
        first = source.splitlines()[0] if source else ""
        found = re.match(r"%%writefile \{workdir\}/(train_\w+)\.py$", first)
        if found:
            body = source.split("\n", 1)[1]
            assert body.rstrip("\n") == Path(dpc.scripts.path(found.group(1))).read_text().rstrip("\n"), \
                f"{path.name} {cell['id']}: its {found.group(1)}.py differs from dpcourse/scripts/"
