"""The pool's protocol is explicit: one typed message per kind, read by name; a call returns an
outcome the cluster applies; each module of the pool runs in one process, as its table says."""
from __future__ import annotations

import ast
import dataclasses
import pickle
import re
from pathlib import Path

import dpcourse.pool
from dpcourse.pool import wire
from test_architecture import imported_modules

POOL = Path(dpcourse.pool.__file__).resolve().parent

# A message read by position: msg[0], message[2], reply[-1], conn.recv()[0].
POSITIONAL = re.compile(r"\b(msg|message|reply|request|answer)\[|\.recv\(\)\[")
# Files that may still read messages by position, each waiting for a change elsewhere (none
# now); the test fails on an entry that no longer does, so that it is taken off the list.
WAITING: set[str] = set()


def positional_reads() -> dict[str, list[int]]:
    """file -> lines of ``pool/`` that index a message."""
    found = {}
    for path in sorted(POOL.rglob("*.py")):
        lines = [n for n, line in enumerate(path.read_text().splitlines(), 1) if POSITIONAL.search(line)]
        if lines:
            found[path.name] = lines
    return found


def test_no_message_is_read_by_position():
    found = positional_reads()
    unexpected = {name: lines for name, lines in found.items() if name not in WAITING}
    assert not unexpected, f"read the message's fields by name (see wire): {unexpected}"
    assert set(found) == WAITING, f"reads by name now, take off WAITING: {WAITING - set(found)}"


def test_the_scan_finds_positional_reads():
    for line in ("kind = msg[0]", "x = reply[-1]", "if conn.recv()[0] == 'imported':"):
        assert POSITIONAL.search(line), line
    for line in ("kind = msg.kind", "messages[0]", "self.results[rank]"):
        assert not POSITIONAL.search(line), line


def private_reads_of_others(source: str) -> list[str]:
    """``x._name`` where ``x`` is not ``self``: a private attribute of another object."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(ast.unparse(node))
    return found


def test_a_call_touches_no_private_attribute_of_the_cluster():
    source = (POOL / "kernel" / "call.py").read_text()
    assert private_reads_of_others(source) == []
    assert "cluster" not in {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    assert private_reads_of_others("def f(cluster):\n    return cluster._link, self._own") == ["cluster._link"]


def test_no_module_of_the_pool_keeps_a_registry_of_clusters():
    weak = ("WeakKeyDictionary", "WeakValueDictionary", "WeakSet")
    for path in POOL.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                text = ast.unparse(node.value)
                assert not any(w in text for w in weak), f"{path.name}: {ast.unparse(node)}"


def message_classes() -> list[type]:
    return [c for c in vars(wire).values() if isinstance(c, type) and c.__module__ == wire.__name__
            and (dataclasses.is_dataclass(c) or issubclass(c, tuple)) and not c.__name__.startswith("_")]


def sample(cls: type):
    """An instance of a message class with placeholder fields."""
    if issubclass(cls, tuple):
        return cls()
    return cls(*[None] * len(dataclasses.fields(cls)))


def test_every_message_says_what_it_is_and_travels_whole():
    classes = message_classes()
    assert len(classes) >= 30
    for cls in classes:
        assert cls.__doc__ and "(" not in cls.__doc__.split()[0], f"{cls.__name__} needs its spec"
        message = sample(cls)
        assert pickle.loads(pickle.dumps(message)) == message
        assert wire.loads(wire.dumps(message)) == message
        if dataclasses.is_dataclass(cls):
            assert cls.__dataclass_params__.frozen, f"{cls.__name__}: a message does not change"


def test_the_launchers_messages_keep_their_kind_first():
    """The kernel's handle on the launcher builds and reads them as plain tuples."""
    assert wire.to_launcher(("kill", [11, 12])) == wire.Kill(pids=[11, 12])
    assert isinstance(wire.to_launcher(("sweep",)), wire.Sweep)
    assert isinstance(wire.to_launcher(wire.Spawn(spec={}, spare=True)), wire.Spawn)
    kind, pids = wire.Spawned(pids=[3, 4])
    assert (kind, pids) == ("spawned", [3, 4])
    kinds = [cls().kind for cls in message_classes() if issubclass(cls, tuple)]
    assert len(kinds) == len(set(kinds)), f"two of the launcher's messages share a kind: {sorted(kinds)}"
    assert not issubclass(wire.Imported, tuple), "a rank's note on its task socket has no kind (see Ready)"


def test_a_launcher_answer_is_checked_against_what_was_asked():
    from multiprocessing import Pipe

    import pytest

    from dpcourse.pool.errors import ClusterError
    from dpcourse.pool.kernel.procs import LauncherProcess

    ours, theirs = Pipe()
    launcher = object.__new__(LauncherProcess)  # its channel only: no launcher process behind it
    launcher.conn, launcher.exited, launcher.peaks, launcher.last_words = ours, {}, {}, {}
    theirs.send(wire.Reaped(exits=[(5, 9, 0, "", "")]))  # recorded on the way, never an answer
    theirs.send(wire.Swept(left=[]))
    with pytest.raises(ClusterError, match=r"answered Kill with Swept\(.*\), where a Killed was due"):
        launcher.request(wire.Kill(pids=[5]), wire.Killed, timeout=5)
    assert launcher.exited == {5: 9} and theirs.recv() == wire.Kill(pids=[5])
    theirs.send(wire.Swept(left=[]))
    assert launcher.request(wire.Sweep(), wire.Swept, timeout=5) == wire.Swept(left=[])
    with pytest.raises(ClusterError, match=r"did not answer Sweep within 0.1 s \(a Swept was due\)"):
        launcher.request(wire.Sweep(), wire.Swept, timeout=0.1)
    ours.close()
    theirs.close()


def test_replies_end_with_what_the_call_left():
    after = wire.After(True, None, [])
    for cls in (wire.Finished, wire.Exited, wire.Raised, wire.Interrupted):
        assert issubclass(cls, wire.Reply)
        assert [f.name for f in dataclasses.fields(cls)][:2] == ["run_id", "after"]
    assert wire.Interrupted(7, after).after.intact


# --------------------------------------------------------------- which process runs what
def process_of(path: Path) -> str:
    """Which process runs a module of ``pool/``: its folder says."""
    rel = path.relative_to(POOL)
    if len(rel.parts) > 1:
        return {"kernel": "kernel", "ranks": "rank"}[rel.parts[0]]
    return "launcher" if rel.stem == "launcher" else "all three"


def process_table() -> dict[str, str]:
    """module under ``dpcourse.pool`` (dotted, e.g. ``kernel.call``) -> the process that runs it."""
    return {".".join(p.relative_to(POOL).with_suffix("").parts): process_of(p)
            for p in POOL.rglob("*.py") if p.stem != "__init__"}


def test_the_pool_folders_say_which_process_runs_a_module():
    table = process_table()
    assert set(table.values()) == {"kernel", "launcher", "rank", "all three"}
    everywhere = {module for module, process in table.items() if process == "all three"}
    assert everywhere == {"wire", "errors", "reaper"}, \
        "a module at the top of pool/ runs in every process: one that runs in one goes in kernel/ or ranks/"
    for module in table:  # the package's docstring tells a newcomer the same
        assert f"``{module.split('.')[-1]}``" in dpcourse.pool.__doc__, f"pool's docstring does not name {module}"


def test_no_process_imports_another_ones_modules():
    table = process_table()
    allowed = {"kernel": {"kernel"}, "rank": {"rank"}, "launcher": {"launcher", "rank"},
               "all three": set()}
    for module, process in table.items():
        path = POOL / (module.replace(".", "/") + ".py")
        for target in imported_modules(path, f"dpcourse.pool.{module}"):
            name = target.removeprefix("dpcourse.pool.")
            if target.startswith("dpcourse.pool.") and name in table:
                other = table[name]
                assert other == "all three" or other in allowed[process], \
                    f"{module} ({process}) imports {name} ({other})"
