"""What the notebooks put in front of a learner, counted from their sources: the PyTorch APIs
written in code cells, the few names of this package they use (every form: ``dpc.x.y``,
``from dpcourse... import``, aliases), no private PyTorch name in any code cell, how much of
the visible code is ``assert``s, that each chapter notebook can be finished in a sitting (its
cells, its words, its minutes in the README's course map), that a script a notebook
writes with ``%%writefile`` is the package's script, line for line, and that a helper is
defined once per notebook, under one name and with the same arguments in every notebook."""
from __future__ import annotations

import ast
import json
import re
import types
from pathlib import Path

import pytest
from _sittings import course_map_minutes, reading_minutes

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
    # optimize_ddp, DDP's switch under torch.compile, is a Dynamo config entry: no public home in 2.13
    ("4.2g-compile-meshes-and-choosing.ipynb", "import torch._dynamo.config"),
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
    minutes = course_map_minutes(path.name)
    assert minutes <= MAX_MINUTES, f"{path.name}: {minutes} minutes in the course map"
    first = "".join(json.loads(path.read_text())["cells"][0]["source"])
    said = re.search(r"about (\d+) minutes", first)
    assert said and int(said.group(1)) == minutes, \
        f"{path.name}: its first cell says {said and said.group(0)!r}, the course map {minutes} min"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_a_chapter_s_minutes_cover_reading_it_and_doing_its_try_its(path):
    """The course map's minutes are no fewer than reading the prose and the visible code and
    doing the try-its take (tests/_sittings.py); the browser test adds the time Run All took."""
    floor = reading_minutes(path)
    assert course_map_minutes(path.name) >= sum(floor.values()), \
        f"{path.name}: the course map says {course_map_minutes(path.name)} min, but " + \
        ", ".join(f"{k} {v:.0f}" for k, v in floor.items()) + " minutes add up to more"


def test_a_script_written_by_a_notebook_is_the_packages_script():
    for path, cell, source in cells(CHAPTERS):
        first = source.splitlines()[0] if source else ""
        found = re.match(r"%%writefile \{workdir\}/(train_\w+)\.py$", first)
        if found:
            body = source.split("\n", 1)[1]
            assert body.rstrip("\n") == Path(dpc.scripts.path(found.group(1))).read_text().rstrip("\n"), \
                f"{path.name} {cell['id']}: its {found.group(1)}.py differs from dpcourse/scripts/"


def top_level_functions(paths):
    """(notebook, cell, function) for each function a code cell defines at its top level; a
    ``%%writefile`` cell writes a script, a file of its own, and is left out."""
    for path, cell, source in cells(paths):
        if cell["cell_type"] == "code" and not source.startswith("%%writefile"):
            for node in ast.parse(python_of(source)).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield path, cell, node


def _calls(node, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _body(function) -> list:
    """A function's statements, its docstring left out."""
    first = function.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return function.body[1:] if docstring else function.body


def is_largest_difference(function) -> bool:
    """It only returns the max of ``(a - b).abs().max()``: assignments and asserts may come first,
    nothing else (a function that trains and then measures is another idea)."""
    body = _body(function)
    before, last = body[:-1], body[-1] if body else None
    if not (isinstance(last, ast.Return) and _calls(last.value, "max")
            and all(isinstance(s, (ast.Assign, ast.Assert)) for s in before)):
        return False
    return any(isinstance(n, ast.Attribute) and n.attr == "max" and isinstance(n.value, ast.Call)
               and isinstance(n.value.func, ast.Attribute) and n.value.func.attr == "abs"
               and isinstance(n.value.func.value, ast.BinOp) and isinstance(n.value.func.value.op, ast.Sub)
               for n in ast.walk(last.value))


def is_shard_blocks(function) -> bool:
    """It only calls ``fully_shard`` on each item of a loop, then on the root: assignments and a
    ``return`` of a name may come with it, nothing else (a function that then trains is another idea)."""
    body = _body(function)
    loops = [i for i, s in enumerate(body) if isinstance(s, ast.For)
             and any(_calls(n, "fully_shard") for n in ast.walk(s))]
    roots = [i for i, s in enumerate(body) if isinstance(s, (ast.Expr, ast.Return)) and _calls(s.value, "fully_shard")]
    rest = [s for i, s in enumerate(body) if i not in loops + roots]
    return (bool(loops) and bool(roots) and min(loops) < max(roots)
            and all(isinstance(s, ast.Assign) or (isinstance(s, ast.Return) and isinstance(s.value, ast.Name))
                    for s in rest))


# One idea, one name: a function that does what the left side says is called as the right side says.
IDEAS = {"largest_difference": is_largest_difference, "shard_blocks": is_shard_blocks}
# Names that mean different things in different notebooks, each for a reason; any other helper
# defined in several notebooks has the same arguments in each (an exception that no longer differs fails).
SIGNATURES_DIFFER = {
    # try-it scaffolds: the argument names the model the checker hands in (DDP in 4.2a, FSDP2 in 4.2f)
    "accumulate": {"4.2a-communication-and-ddp.ipynb", "4.2f-long-runs.ipynb"},
    # 4.2f's takes `api` to accumulate under FSDP1's no_sync() or FSDP2's set_requires_gradient_sync()
    "train_accumulating": {"4.1a-data-parallelism-in-depth.ipynb", "4.2f-long-runs.ipynb"},
    # 4.2b's wraps and trains a fresh MLP; 4.2d's is the Join try-it's loop over a rank's own batches
    "train": {"4.2b-fsdp.ipynb", "4.2d-launching-faults-and-pitfalls.ipynb"},
    # 4.2c's measures a model's bytes on a rank; exercise B's is the learner's ledger of a setup
    "held": {"4.2c-large-models.ipynb", "B-ddp-vs-fsdp.ipynb"},
}


def _arguments(function) -> tuple:
    a = function.args
    return (tuple(x.arg for x in a.posonlyargs + a.args), a.vararg and a.vararg.arg,
            tuple(x.arg for x in a.kwonlyargs), a.kwarg and a.kwarg.arg)


def test_a_notebook_defines_each_function_once():
    where: dict = {}
    for path, cell, function in top_level_functions(CHAPTERS + EXERCISES):
        where.setdefault((path.name, function.name), []).append(cell["id"])
    twice = [f"{book}: {name} in cells {ids}" for (book, name), ids in where.items() if len(ids) > 1]
    assert not twice, "defined more than once in a notebook (define it once, use it after):\n" + "\n".join(twice)


def test_a_helper_has_the_same_arguments_in_every_notebook_that_defines_it():
    signatures: dict = {}
    for path, _, function in top_level_functions(CHAPTERS + EXERCISES):
        signatures.setdefault(function.name, {})[path.name] = _arguments(function)
    differ = {name: books for name, books in signatures.items() if len(set(books.values())) > 1}
    unexplained = [f"{name}: {books}" for name, books in differ.items() if set(books) != SIGNATURES_DIFFER.get(name)]
    assert not unexplained, "one helper, different arguments (make them agree):\n" + "\n".join(unexplained)
    stale = sorted(set(SIGNATURES_DIFFER) - set(differ))
    assert not stale, f"these no longer differ: take them out of SIGNATURES_DIFFER: {stale}"


def test_an_idea_has_one_name_in_every_notebook():
    misnamed = [f"{path.name} {cell['id']}: {function.name} is {name}"
                for path, cell, function in top_level_functions(CHAPTERS + EXERCISES)
                for name, is_it in IDEAS.items() if is_it(function) and function.name != name]
    assert not misnamed, "one idea under another name (call it by the course's name):\n" + "\n".join(misnamed)


def test_the_idea_scan_sees_each_spelling():
    def function(source):
        return ast.parse(source).body[0]
    assert is_largest_difference(function(
        "def worst_difference(ranks, reference):\n"
        "    return max((r[n] - w).abs().max().item() for r in ranks for n, w in reference.items())"))
    assert is_largest_difference(function(
        'def max_difference(path_a, path_b):\n    """Doc."""\n    a, b = torch.load(path_a), torch.load(path_b)\n'
        "    assert list(a) == list(b)\n    return max((a[k] - b[k]).abs().max().item() for k in a)"))
    assert not is_largest_difference(function(  # trains, then measures: 4.2e's gradient_gap
        "def gradient_gap():\n    one(x).backward()\n"
        "    return max((a.grad - b.grad).abs().max().item() for a, b in zip(p, q))"))
    assert is_shard_blocks(function(
        "def wrap(model):\n    for block in model.blocks:\n        fully_shard(block)\n    return fully_shard(model)"))
    assert is_shard_blocks(function(
        "def wrap(m):\n    mesh = make()\n    for b in m.layers:\n        fully_shard(b, mesh=mesh)\n"
        "    fully_shard(m, mesh=mesh)\n    return m"))
    assert not is_shard_blocks(function(  # shards, then trains: 4.2e's step_resharded
        "def step(r):\n    model = build()\n    for block in model.blocks:\n        fully_shard(block)\n"
        "    fully_shard(model)\n    model(x).sum().backward()"))
