"""A learner's formulas, run where the course cannot be reached.

Exercises B and C ask for formulas, and the course's calculators (``dpc.memory``,
``dpc.collectives``), its training code and its references compute every number asked. Reading
a formula's names cannot tell whether it reaches them (``importlib``, ``getattr``, ``exec`` of
a string, a copy in a module of the learner's find a way round any list of names). So the
formulas run in a process of their own (``evaluate``), started for the check, in which

* the course is not on the path (``python -I -S``: no ``site``, so no ``.pth`` file of an
  editable install), and importing ``dpcourse`` raises even where it is, so a function that
  holds the course's code -- a module, a calculator, a Ledger -- cannot even be unpickled;
* opening any file of the course (its package, tests and git history) raises, told by device
  and inode, so no path, link, ``/proc`` route or folder descriptor reaches one, nor
  ``exec(open(...).read())``, ``runpy`` or ``spec_from_file_location``; nor does starting a
  process, or loading native code of its own (``ctypes``'s ``fopen`` would read past the hook);
* every text compiled while the formulas run goes to the kernel at once, and is compared with
  the course's calculators and references (``copied_from``): a copy is told as one.

All of it is one audit hook, which Python cannot remove: it holds what it needs in its code's
constants and default arguments, refuses any change to them, and nothing references it once
installed. The sandbox answers in lines of JSON, never a pickle, so nothing it sends can run
code in the kernel.

The formulas go there by value (cloudpickle), as the pool sends a cell's functions to the
ranks, a formula in a module of the learner's too (with only what it uses of it); the
learner's modules it imports are found on the kernel's paths, never the course's folder.
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

# Runs as ``python -I -S -c``: no site, so no ``.pth`` puts the course on ``sys.path``. The
# guard is an audit hook that cannot be removed, holds no state a formula can reach (what it
# needs is in its code's constants and default arguments, the hook forbids changing those and
# walking the interpreter's objects, and runs only built-in code, so no function a formula
# replaced runs inside it), and is referenced by nothing once installed. It refuses importing
# ``dpcourse``, opening any file of the course (told by device and inode: no spelling of a path,
# link or /proc route gets round it), starting a process and loading native code; it sends
# every text compiled while the formulas run straight to the kernel, as a framed record
# (nothing the sandbox sends is unpickled).
_BOOT = r"""
import os, sys
def hook(event, args, _stat=os.stat, _fstat=os.fstat, _write=os.write, _len=len, _str=str, _bytes=bytes,
         _int=int, _function=type(lambda: 0), _forbidden=FORBIDDEN, _fd=FD, _installed=INSTALLED, _judging=[False]):
    # only built-in functions and methods run here: no code a formula could have replaced
    if event == "sandbox.judging":
        _judging[0] = True
    elif event == "import" and args and type(args[0]) is _str and args[0].split(".")[0] == "dpcourse":
        raise ImportError("CourseUnreachable: the course's package cannot be imported where formulas run")
    elif event == "open" and args and args[0] is not None:
        path = args[0]
        if type(path) not in (_str, _bytes, _int):   # a path object would run its own code in here
            if _judging[0]:
                raise PermissionError("CourseUnreachable: only str, bytes or int paths are opened where formulas run")
            return
        try:
            st = _fstat(path) if type(path) is _int else _stat(path)
        except (OSError, ValueError):
            return
        if (st.st_dev, st.st_ino) in _forbidden:
            raise PermissionError("CourseUnreachable: the course's files cannot be read where formulas run")
    elif event == "object.__setattr__" and type(args[0]) is _function and args[0].__code__.co_filename == "<sandbox>":
        raise PermissionError("CourseUnreachable: the guard of this process cannot be changed")
    elif _judging[0] and (event in SPAWNS or event in ("ctypes.dlsym", "gc.get_objects", "gc.get_referrers",
                                                         "gc.get_referents") or event == "ctypes.dlopen" and not (
            type(args[0]) is _str and args[0].startswith(_installed))):
        raise PermissionError("CourseUnreachable: no process, native code of its own or walk of the interpreter's "
                              "objects where formulas run")
    elif _judging[0] and event == "compile" and args and type(args[0]) in (_str, _bytes):
        data = args[0].encode("utf-8", "replace") if type(args[0]) is _str else args[0]
        _write(_fd, b"C" + _len(data).to_bytes(8, "big") + data)
sys.addaudithook(hook)
del hook
sys.path[:] = [p for p in sys.path if p] + PATHS
"""
SPAWNS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
          "pty.spawn", "os.startfile", "_posixsubprocess.fork_exec")
# then: the formulas, each answer a line of JSON
_RUN = r"""
import json, os, pickle, sys
import cloudpickle
for name in ("math", "fractions", "statistics", "ctypes", "numpy"):   # loaded before judging, as a kernel has them
    try:
        __import__(name)
    except ImportError:
        pass
def plain(v):
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if v is None or v is Ellipsis or isinstance(v, (bool, int, float, str)):
        return "..." if v is Ellipsis else v
    item = getattr(v, "item", None)
    if callable(item) and getattr(v, "ndim", None) == 0:
        return plain(item())
    try:
        return float(v)
    except Exception:
        return "<" + type(v).__name__ + ">"
def said(err):
    chain = err
    while chain is not None:   # the course is not even on this process's path
        if isinstance(chain, ModuleNotFoundError) and (chain.name or "").split(".")[0] == "dpcourse":
            return "CourseUnreachable: the course's package cannot be imported where formulas run"
        chain = chain.__cause__ or chain.__context__
    text = str(err).splitlines()[0] if str(err) else ""
    if "CourseUnreachable" in text:
        return text[text.index("CourseUnreachable"):]
    cause = err.__cause__ or err.__context__
    while cause is not None:
        if "CourseUnreachable" in str(cause):
            return str(cause)[str(cause).index("CourseUnreachable"):]
        cause = cause.__cause__ or cause.__context__
    return type(err).__name__ + (": " + text if text else "")
def send(record, _write=os.write, _fd=FD):
    data = json.dumps(record).encode()
    _write(_fd, b"J" + len(data).to_bytes(8, "big") + data)
job = pickle.loads(sys.stdin.buffer.read())
sys.audit("sandbox.judging")
fns = {}
for part, blob in job["fns"].items():
    try:
        fns[part] = cloudpickle.loads(blob)
    except BaseException as err:
        fns[part] = said(err)
for i, (part, args) in enumerate(job["calls"]):
    fn = fns[part]
    try:
        value, error = (None, fn) if isinstance(fn, str) else (plain(fn(*args)), "")
    except BaseException as err:
        value, error = None, said(err)
    send({"kind": "result", "i": i, "value": value, "error": error})
send({"kind": "done"})
"""


# the program is compiled under its own name, which the guard knows its own code by
_START = "import sys; exec(compile(sys.argv.pop(1), '<sandbox>', 'exec'))"


def _boot(fd: int, paths: list[str]) -> str:
    """The sandbox's program: the guard with this machine's facts as constants, then the run."""
    import json

    forbidden = _course_files()
    installed = tuple(sorted({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
                             | {p + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}))
    text = (_BOOT.replace("FORBIDDEN", repr(frozenset(forbidden))).replace("FD", str(fd))
            .replace("INSTALLED", repr(installed))
            .replace("PATHS", json.dumps(paths)).replace("SPAWNS", repr(SPAWNS)))
    return text + _RUN.replace("FD", str(fd))


def _course_files() -> set:
    """(device, inode) of every file and folder of the course that a formula may not read: the
    package (its calculators, training code, references), its tests and its history."""
    found = set()
    for top in (PACKAGE, os.path.join(PACKAGE_ROOT, "tests"), os.path.join(PACKAGE_ROOT, ".git")):
        for folder, _, files in os.walk(top):
            for name in [None, *files]:
                try:
                    st = os.stat(os.path.join(folder, name) if name else folder)
                except OSError:
                    continue
                found.add((st.st_dev, st.st_ino))
    return found


def evaluate(fns: dict, calls: list, timeout: float = TIMEOUT) -> dict:
    """Call ``fns[part](*args)`` for each ``(part, args)`` of ``calls`` in a process where the
    course cannot be reached: {"results": [(value, error)], "problem": why nothing ran, or "",
    "compiled": [texts compiled while they ran]}. An
    error or problem that starts with ``UNREACHABLE`` is the formula reaching for the course."""
    import pickle

    blobs = _by_value(fns)
    if isinstance(blobs, str):
        return {"results": [], "problem": blobs, "compiled": []}
    job = pickle.dumps({"fns": blobs, "calls": [(part, tuple(args)) for part, args in calls]})
    # (kernel to sandbox: pickled; sandbox to kernel: text and JSON only, as nothing from there is trusted)
    read, write = os.pipe()
    import site

    # Python's own library comes with -I -S; what is installed, and the learner's folders, are
    # added by name (never the course's own folder), and no .pth file is read
    installed = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    learners = [p for p in [os.getcwd(), *sys.path] if p and os.path.isdir(p)
                and os.path.realpath(p) != os.path.realpath(PACKAGE_ROOT) and p not in installed]
    program = _boot(write, installed + learners)
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _START, program], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(write,), cwd=os.getcwd())
    finally:
        os.close(write)
    try:
        proc.stdin.write(job)
        proc.stdin.close()
    except BrokenPipeError:   # it ended at once: said below, from what it wrote
        pass
    out = {"results": [None] * len(calls), "problem": "", "compiled": []}
    done = _read(proc, read, timeout, out)
    err = proc.stderr.read() if proc.stderr else b""
    if proc.stderr:
        proc.stderr.close()
    if not done:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no answer"]
        return {"results": [], "problem": f"the formulas did not finish within {timeout:g} s ({tail[0]})",
                "compiled": out["compiled"]}
    missing = [i for i, r in enumerate(out["results"]) if r is None]
    if missing:
        return {"results": [], "problem": "the formulas' process did not say all it computed", "compiled": out["compiled"],
}
    return out


def _read(proc, read: int, timeout: float, out: dict) -> bool:
    """Read the sandbox's records into ``out`` until it says it is done (True), or it ends or
    runs past ``timeout`` first (False; it is killed). A record is a kind (C: a text compiled,
    J: JSON of a result or of the end), 8 bytes of length, then that many bytes."""
    import select
    import time

    buffer, done, deadline = b"", False, time.monotonic() + timeout
    try:
        while not done and select.select([read], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(read, 1 << 16)
            if not chunk:
                break
            buffer += chunk
            while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[1:9], "big"):
                size = int.from_bytes(buffer[1:9], "big")
                kind, data, buffer = buffer[:1], buffer[9:9 + size], buffer[9 + size:]
                done = _record(kind, data, out) or done
    finally:
        os.close(read)
        if proc.poll() is None and not done:
            proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return done


def _record(kind: bytes, data: bytes, out: dict) -> bool:
    """Take one record into ``out``; True when it says the sandbox is done."""
    import json

    if kind == b"C":
        out["compiled"].append(data.decode("utf-8", "replace"))
        return False
    try:
        record = json.loads(data)
    except ValueError:
        return False
    what = record.get("kind") if isinstance(record, dict) else None
    if what == "result" and isinstance(record.get("i"), int) and 0 <= record["i"] < len(out["results"]):
        out["results"][record["i"]] = (_ellipsis(record.get("value")), str(record.get("error") or ""))
    return what == "done"


def _ellipsis(value):
    """A value as it came over JSON, with its blanks (``...``, sent as "...") back."""
    if isinstance(value, dict):
        return {k: _ellipsis(v) for k, v in value.items()}
    return Ellipsis if value == "..." else value


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
_course: dict[str, set] = {}   # a file or folder of the course -> its shingles


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


def _course_shingles(path: str) -> set:
    if path not in _course:
        from . import provenance

        with provenance.quiet():   # the course reading its own files: not the learner's
            files = ([os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py")]
                     if os.path.isdir(path) else [path])
            _course[path] = set().union(*(_shingles(open(f).read()) for f in files))
    return _course[path]


def copied_from(texts, course_code: dict[str, str]) -> str | None:
    """The course code (a name in ``course_code``, which maps names to the files or folders a
    formula must not copy) that ``texts`` copy, or None: ``COPIED`` or more runs of ``SHINGLE``
    tokens in common. A formula written apart shares short idioms with the calculators, never
    dozens of long runs."""
    mine = set().union(*(_shingles(t) for t in texts if t)) if texts else set()
    if not mine:
        return None
    best = max(((len(mine & _course_shingles(path)), name) for name, path in course_code.items()), default=(0, None))
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
        todo += [c.cell_contents for c in (obj.__closure__ or ()) if filled(c)]
        todo += list(obj.__defaults__ or ())
    return texts


def filled(cell) -> bool:
    """Is a closure cell assigned yet (reading an empty one raises)?"""
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
