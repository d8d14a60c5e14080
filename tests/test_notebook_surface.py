"""What the notebooks put in front of a learner, counted from their sources: the PyTorch APIs
written in code cells, the few names of this package they use (every form: ``dpc.x.y``,
``from dpcourse... import``, aliases), no private PyTorch name in any code cell, how much of
the visible code is ``assert``s, that each chapter notebook can be finished in a sitting (its
cells, its words, its minutes in the README's course map), and that a script a notebook
writes with ``%%writefile`` is the package's script, line for line."""
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
MAX_NAMES, MAX_ASSERT_SHARE, MAX_CELLS, MAX_WORDS, MAX_MINUTES = 40, 0.10, 75, 5000, 75


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


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root(node) -> str | None:
    """The name an expression is reached from: ``a.b(c)[d].e`` -> ``a``."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_torch_names(source: str) -> list[str]:
    """Every private PyTorch name a code cell writes: an attribute with a leading underscore
    (dunders aside) reached from ``torch``, ``dist`` (both predefined in ``%%ranks`` cells), a
    name imported from torch, or a name assigned from any of these; and a private module or
    name in an import from torch."""
    tree = ast.parse(python_of(source))
    rooted, found = {"torch", "dist"}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    rooted.add(a.asname or "torch")
                    found += [f"import {a.name}"] if any(map(_is_private, a.name.split("."))) else []
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                rooted.add(a.asname or a.name)
                if any(map(_is_private, node.module.split("."))) or _is_private(a.name):
                    found.append(f"from {node.module} import {a.name}")
    bindings = []  # (targets, value): assignments, `with ... as`, `for ... in`, `:=`
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            bindings += [(t, node.value) for t in node.targets]
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            bindings.append((node.target, node.value))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            bindings += [(i.optional_vars, i.context_expr) for i in node.items if i.optional_vars]
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            bindings.append((node.target, node.iter))
    grown = True
    while grown:  # a name assigned from a torch-rooted value is torch-rooted, in any order
        grown = False
        for target, value in bindings:
            if _root(value) in rooted:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name) and name.id not in rooted:
                        rooted.add(name.id)
                        grown = True
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and _root(node.value) in rooted:
            found.append(f"{_root(node.value)}...{node.attr}")
    return found


# The two private names a learner may meet in a code cell, each for a reason; any other fails.
ALLOWED_PRIVATE = {
    # apply_activation_checkpointing and checkpoint_wrapper have no other home in PyTorch 2.13;
    # PyTorch's own FSDP tutorials import them from here
    (None, "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing"),
    # exercise E's scaffold runs code when backward ends as DDP's own Python does (no public API)
    ("E-bucketed-ddp.ipynb", "torch..._execution_engine"),
}


def test_no_code_cell_writes_a_private_pytorch_name():
    found = [f"{path.name} {cell['id']}: {name}" for path, cell, source in cells(CHAPTERS + EXERCISES)
             if cell["cell_type"] == "code" for name in private_torch_names(source)
             if (None, name) not in ALLOWED_PRIVATE and (path.name, name) not in ALLOWED_PRIVATE]
    assert not found, ("private PyTorch names in code cells (put them behind a course name; the "
                       "private call itself belongs in dpcourse/torch_private.py):\n" + "\n".join(found))


def test_the_private_name_scan_sees_every_spelling():
    assert sorted(private_torch_names(
        "recorded = json.loads(torch._C._distributed_c10d._dump_fr_trace_json())")) == [
        "torch..._C", "torch..._distributed_c10d", "torch..._dump_fr_trace_json"]
    assert private_torch_names("%%ranks\nstore = dist.distributed_c10d._get_default_store()") == [
        "dist..._get_default_store"]
    source = ("import torch.distributed as d\nfrom torch.nn.parallel import DistributedDataParallel as W\n"
              "from torch.utils._pytree import tree_map\nimport torch._dynamo\n"
              "m = W(net)\nm._get_ddp_logging_data()\nt = d.group.WORLD\nt._x\n"
              "with torch.no_grad() as g:\n    g._y\n")
    assert sorted(private_torch_names(source)) == sorted([
        "from torch.utils._pytree import tree_map", "import torch._dynamo",
        "m..._get_ddp_logging_data", "t..._x", "g..._y"])
    public = ("import torch\nprint(torch.__version__)\nmodel._private = 1\nself._x\n"
              "x = make()\nx._y\ndpc.Cluster._pool")
    assert private_torch_names(public) == []


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


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_a_chapter_s_minutes_fit_a_sitting_and_its_first_cell_says_the_course_map_s(path):
    readme = (ROOT / "README.md").read_text()
    course_map = readme.split("## Course map", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in course_map.splitlines() if path.name in line)
    minutes = [int(m) for m in re.findall(r"(\d+)(?:–\d+)? min\b", row)]
    assert minutes and max(minutes) <= MAX_MINUTES, f"{path.name}: {minutes} minutes in the course map"
    first = "".join(json.loads(path.read_text())["cells"][0]["source"])
    said = re.search(r"about (\d+) minutes", first)
    assert said and int(said.group(1)) == max(minutes), \
        f"{path.name}: its first cell says {said and said.group(0)!r}, the course map {max(minutes)} min"


def test_a_script_written_by_a_notebook_is_the_packages_script():
    for path, cell, source in cells(CHAPTERS):
        first = source.splitlines()[0] if source else ""
        found = re.match(r"%%writefile \{workdir\}/(train_\w+)\.py$", first)
        if found:
            body = source.split("\n", 1)[1]
            assert body.rstrip("\n") == Path(dpc.scripts.path(found.group(1))).read_text().rstrip("\n"), \
                f"{path.name} {cell['id']}: its {found.group(1)}.py differs from dpcourse/scripts/"
