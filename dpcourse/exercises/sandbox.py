"""A learner's formulas, run where the course cannot be reached.

Exercises B and C ask for formulas, and the course's calculators (``dpc.memory``,
``dpc.collectives``), its training code and its references compute every number asked. Reading
a formula's names cannot tell whether it reaches them (``importlib``, ``getattr``, ``exec`` of
a string, a copy in a module of the learner's find a way round any list of names). So the
formulas run in a process of their own (``evaluate``), started for the check, in which

* importing ``dpcourse`` raises, however it is spelled (a finder first on ``sys.meta_path``),
  so a function that holds the course's code -- a module, a calculator, a Ledger -- cannot
  even be unpickled there;
* opening any file of the package raises (an audit hook), so ``exec(open(...).read())``,
  ``runpy`` or a ``spec_from_file_location`` of the course's files fail, and so does starting
  a process (a new interpreter would have no such guard);
* every text compiled and every module of the learner's imported is handed back, and compared
  with the course's calculators and references (``copied_from``): a copy is told as one.

The formulas go there by value (cloudpickle), as the pool sends a cell's functions to the
ranks; the learner's own modules are imported there by name, from the kernel's folder.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tokenize
from io import StringIO

import cloudpickle

from ..processes import PACKAGE_ROOT

PACKAGE = os.path.join(PACKAGE_ROOT, "dpcourse")
UNREACHABLE = "CourseUnreachable"
TIMEOUT = 120.0

# Runs as ``python -c``: guards first, then the formulas; nothing of dpcourse is imported.
_BOOT = r'''
import importlib.abc, io, os, pickle, sys, traceback
PACKAGE = os.path.realpath(sys.argv[1])
class CourseUnreachable(ImportError):
    pass
class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "dpcourse" or name.startswith("dpcourse."):
            raise CourseUnreachable(f"the course's package cannot be imported where formulas run ({name})")
        return None
sys.meta_path.insert(0, _Refuse())
compiled, inside = [], [False]
SPAWNS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile", "pty.spawn"}
def _hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes)):
        path = os.fsdecode(args[0])
        if os.path.realpath(path).startswith(PACKAGE + os.sep) or os.path.realpath(path) == PACKAGE:
            raise CourseUnreachable(f"the course's files cannot be read where formulas run ({os.path.basename(path)})")
    elif event in SPAWNS and inside[0]:
        raise CourseUnreachable("no process can be started where formulas run (a new interpreter would reach the course)")
    elif event == "compile" and inside[0] and args and isinstance(args[0], (str, bytes)):
        compiled.append(args[0] if isinstance(args[0], str) else args[0].decode("utf-8", "replace"))
sys.addaudithook(_hook)
import cloudpickle
def plain(v):
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if v is None or v is Ellipsis or isinstance(v, (bool, int, float, str)):
        return v
    item = getattr(v, "item", None)
    if callable(item) and getattr(v, "ndim", None) == 0:
        return plain(item())
    try:
        return float(v)
    except Exception:
        return f"<{type(v).__name__}>"
def said(err):
    text = str(err).splitlines()[0] if str(err) else ""
    return type(err).__name__ + (": " + text if text else "")
out = {"results": [], "problem": "", "compiled": compiled, "modules": {}}
before = set(sys.modules)
def problem(err):
    cause = err
    while cause is not None and not isinstance(cause, CourseUnreachable):
        cause = cause.__cause__ or cause.__context__
    return "CourseUnreachable: " + str(cause) if cause is not None else said(err)
inside[0] = True
try:
    job = pickle.loads(sys.stdin.buffer.read())
    fns = {}
    for part, blob in job["fns"].items():
        try:
            fns[part] = cloudpickle.loads(blob)
        except BaseException as err:
            fns[part] = problem(err)
    for part, args in job["calls"]:
        fn = fns[part]
        if isinstance(fn, str):
            out["results"].append((None, fn))
            continue
        try:
            out["results"].append((plain(fn(*args)), ""))
        except BaseException as err:
            out["results"].append((None, problem(err)))
except BaseException as err:
    out["problem"] = problem(err)
inside[0] = False
stdlib = tuple(os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
for name in set(sys.modules) - before:
    path = getattr(sys.modules[name], "__file__", None) or ""
    if path.endswith(".py") and not os.path.realpath(path).startswith(stdlib):
        try:
            with open(path, errors="replace") as f:
                out["modules"][name] = f.read()
        except OSError:
            pass
sys.stdout.flush()
with os.fdopen(int(sys.argv[2]), "wb") as answer:
    answer.write(pickle.dumps(out))
'''


def evaluate(fns: dict, calls: list, timeout: float = TIMEOUT) -> dict:
    """Call ``fns[part](*args)`` for each ``(part, args)`` of ``calls`` in a process where the
    course cannot be reached: {"results": [(value, error)], "problem": why nothing ran, or "",
    "compiled": [texts compiled while they ran], "modules": {learner module: its text}}. An
    error or problem that starts with ``UNREACHABLE`` is the formula reaching for the course."""
    import pickle

    blobs = _by_value(fns)
    if isinstance(blobs, str):
        return {"results": [], "problem": blobs, "compiled": [], "modules": {}}
    job = pickle.dumps({"fns": blobs, "calls": [(part, tuple(args)) for part, args in calls]})
    read, write = os.pipe()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSTARTUP",)}
    # the learner's modules are found where the kernel finds them; the course's folder is not searched
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p and os.path.isdir(p)
                                        and os.path.realpath(p) != os.path.realpath(PACKAGE_ROOT))
    try:
        proc = subprocess.Popen([sys.executable, "-c", _BOOT, PACKAGE, str(write)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(write,), env=env,
                                cwd=os.getcwd())
    finally:
        os.close(write)
    chunks = []
    try:
        proc.stdin.write(job)
        proc.stdin.close()
        import select

        while select.select([read], [], [], timeout)[0]:
            chunk = os.read(read, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            proc.kill()
    finally:
        os.close(read)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err = proc.stderr.read() if proc.stderr else b""
        if proc.stderr:
            proc.stderr.close()
    if not chunks:
        tail = (err or b"").decode(errors="replace").strip().splitlines()[-1:] or ["no answer"]
        return {"results": [], "problem": f"the formulas did not finish within {timeout:g} s ({tail[0]})",
                "compiled": [], "modules": {}}
    return pickle.loads(b"".join(chunks))


def _by_value(fns: dict) -> dict | str:
    """{part: the pickled function}, or why one cannot leave the kernel. A formula in a module
    of the learner's goes by value too, with only what it uses of it (by name, the whole module
    would be imported there: a formula is judged, not its file)."""
    blobs = {}
    for part, fn in fns.items():
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        own = module is not None and _learners(module)
        if own:
            cloudpickle.register_pickle_by_value(module)
        try:
            blobs[part] = cloudpickle.dumps(fn)
        except Exception as err:  # noqa: BLE001 -- what the function holds cannot leave the kernel
            return f"{getattr(fn, '__name__', part)}() cannot be sent where formulas run: {type(err).__name__}: {err}"
        finally:
            if own:
                cloudpickle.unregister_pickle_by_value(module)
    return blobs


def _learners(module) -> bool:
    """Is ``module`` a file of the learner's: neither the course's, nor installed, nor Python's?"""
    path = getattr(module, "__file__", None)
    if not path or module.__name__ == "__main__":
        return False
    path = os.path.realpath(path)
    installed = tuple(os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    return not path.startswith(installed) and not path.startswith(os.path.realpath(PACKAGE) + os.sep)


# --- copies ------------------------------------------------------------------------------------

SHINGLE = 12        # tokens in a row that a copy shares with the course's code
COPIED = 25         # shared runs of SHINGLE tokens that make a text a copy
COURSE_CODE = {     # what a formula must not copy: the calculators and the references' formulas
    "dpc.memory": os.path.join(PACKAGE, "memory"),
    "dpc.collectives": os.path.join(PACKAGE, "collectives"),
    "the reference of exercise B": os.path.join(PACKAGE, "exercises", "solutions", "setups_b.py"),
    "the reference of exercise C": os.path.join(PACKAGE, "exercises", "solutions", "configs_c.py"),
}
_course: dict[str, set] = {}


def _tokens(text: str) -> list[str]:
    """The code's tokens, comments and layout left out (a copy re-indented is the same copy)."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    try:
        return [t.string for t in tokenize.generate_tokens(StringIO(text).readline) if t.type not in skip]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return text.split()


def _shingles(text: str) -> set:
    tokens = _tokens(text)
    return {tuple(tokens[i:i + SHINGLE]) for i in range(len(tokens) - SHINGLE + 1)}


def _course_shingles() -> dict[str, set]:
    if not _course:
        from . import provenance

        with provenance.quiet():   # the course reading its own files: not the learner's
            for name, path in COURSE_CODE.items():
                files = ([os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py")]
                         if os.path.isdir(path) else [path])
                _course[name] = set().union(*(_shingles(open(f).read()) for f in files))
    return _course


def copied_from(texts) -> str | None:
    """The course code (a name from ``COURSE_CODE``) that ``texts`` copy, or None: ``COPIED``
    or more runs of ``SHINGLE`` tokens in common. A formula written apart shares short idioms
    with the calculators, never dozens of long runs."""
    mine = set().union(*(_shingles(t) for t in texts if t)) if texts else set()
    if not mine:
        return None
    best = max(((len(mine & theirs), name) for name, theirs in _course_shingles().items()), default=(0, None))
    return best[1] if best[0] >= COPIED else None


def learner_sources(fn) -> list[str]:
    """The source of ``fn`` and of the learner's functions it reaches (globals, closures,
    defaults), and the files of the learner's modules they live in -- never the course's,
    torch's or the standard library's."""
    import inspect
    import types

    texts, seen, todo = [], set(), [fn]
    while todo:
        obj = todo.pop()
        obj = getattr(obj, "func", obj)   # functools.partial
        obj = getattr(obj, "__func__", obj)
        if id(obj) in seen or not inspect.isfunction(obj):
            continue
        seen.add(id(obj))
        module = obj.__module__ or ""
        if module.split(".")[0] in ("dpcourse", "torch", "numpy") or module in sys.stdlib_module_names:
            continue
        try:
            texts.append(inspect.getsource(obj))
        except (OSError, TypeError):
            pass
        file = getattr(sys.modules.get(module), "__file__", None)
        if module != "__main__" and file and file.endswith(".py") and file not in seen:
            seen.add(file)
            try:
                texts.append(open(file, errors="replace").read())
            except OSError:
                pass
        space = obj.__globals__
        names = set(obj.__code__.co_names)
        for const in obj.__code__.co_consts:
            if isinstance(const, types.CodeType):
                names |= set(const.co_names)
        todo += [space[n] for n in names if n in space]
        todo += [c.cell_contents for c in (obj.__closure__ or ()) if _filled(c)]
        todo += list(obj.__defaults__ or ())
    return texts


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
