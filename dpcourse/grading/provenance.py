"""Which references a judged answer was near: read on request, read by the learner's code.

A check judges behaviour; where the answer came from is another question, which an instructor
must be able to ask. So every route to a reference's text leaves a record in the process that
took it:

* ``dpc.exercises.solution(key)`` and ``report.fix()`` (``shown``);
* opening a reference's file in ``solutions/`` -- ``open``, ``import``, ``runpy``, reading it
  with ``inspect`` or ``importlib.resources`` -- seen by an audit hook (``install``), which
  every process a check runs code in installs: the kernel, the pool's ranks (``take`` on
  them), and torchrun's workers (the checker's ``sitecustomize`` writes them to ``LOG``).

A report lists the references read in its kernel before or while it judged: its own key when
it was read at any time before, any key read while its code ran, in any of those processes.
The verdict stands; ``Report.used_reference`` and the grader's column say it. What no process
can see -- text pasted from another machine -- is not flagged, except for exercises A and F,
whose scripts are compared with the reference line by line (``embeds``).
"""
from __future__ import annotations

import functools
import os
import sys
import time

LOG = "references.rank{rank}"   # in a torchrun worker's observe folder: one key per line
# Where the references are, as the course's content registers them (``install``): the folder,
# and the keys of the files at its top ("A" -> "train_lm_ddp.py"); a file in its ``tryits/``
# is known by its name. A rank and a torchrun worker are told the same by ``install``.
_where: dict = {"folder": None, "files": {}}

_read: dict[str, float] = {}      # key -> the last time a reference was read in this process
_taken: set[str] = set()          # keys read since the last ``take`` (on a rank)
_installed = False


def shown(key: str) -> None:
    """Record that reference ``key`` was read in this process (now)."""
    _read[key] = time.monotonic()
    _taken.add(key)
    log = os.environ.get("DPCOURSE_OBSERVE_DIR")
    rank = os.environ.get("RANK")
    if log and rank is not None:  # a torchrun worker of a check: the checker reads this file
        try:
            with open(os.path.join(log, LOG.format(rank=rank)), "a") as f:
                f.write(key + "\n")
        except OSError:
            pass


_files: dict[tuple[int, int], str] = {}


def _key_by_name(path: str) -> str | None:
    """The reference a file below ``solutions/`` is, from its name (``__pycache__`` too)."""
    folder = _where["folder"]
    path = os.path.realpath(path)
    if folder is None or not path.startswith(folder + os.sep):
        return None
    stem, parts = os.path.basename(path).split(".")[0], path[len(folder) + 1:].split(os.sep)
    if stem == "__init__":
        return None
    if parts[0] == "tryits":
        return stem
    return next((k for k, name in _where["files"].items() if name.split(".")[0] == stem), None)


def _references() -> dict[tuple[int, int], str]:
    """{(device, inode): key} of every reference's file: a file is known by what it is,
    whatever path, link or /proc route names it."""
    if not _files and _where["folder"]:
        for folder, _, names in os.walk(_where["folder"]):
            for name in names:
                key = _key_by_name(os.path.join(folder, name))
                if key:
                    st = os.stat(os.path.join(folder, name))
                    _files[st.st_dev, st.st_ino] = key
    return _files


def key_of(path) -> str | None:
    """The reference a file is (its compiled cache too), or None; ``path`` may be a name or
    an open file descriptor."""
    try:
        st = os.fstat(path) if isinstance(path, int) else os.stat(os.fsdecode(path))
    except (OSError, TypeError, ValueError):
        return None
    key = _references().get((st.st_dev, st.st_ino))
    if key is None and not isinstance(path, int):   # a cache written since: known by its name
        key = _key_by_name(os.fsdecode(path))
        if key:
            _files[st.st_dev, st.st_ino] = key
    return key


def _hook(event: str, args) -> None:
    # never raises: an audit hook that raises would refuse the open itself (a rank that
    # imports this package again, for a script's fresh start, still runs this module's hook)
    if event == "open" and args and args[0] is not None:
        try:
            key = key_of(args[0])
        except Exception:  # noqa: BLE001 -- see above
            return
        if key:
            shown(key)


def install(where: tuple[str, dict] | None = None) -> None:
    """Record every read of a reference's file in this process from now on (once per process;
    an audit hook cannot be removed, and costs a string test per event). ``where``: the
    references' folder and its top files' keys, as ``where()`` gives them (the content
    registers them in the kernel; a rank or worker is passed the kernel's)."""
    global _installed
    if where is not None and where[0] != _where["folder"]:
        _where["folder"], _where["files"] = os.path.realpath(where[0]), dict(where[1])
        _files.clear()
    if not _installed:
        _installed = True
        sys.addaudithook(_hook)


def where() -> tuple[str | None, dict]:
    """The references' folder and the keys of its top files, as registered (``install``)."""
    return _where["folder"], dict(_where["files"])


def keys() -> list[str]:
    """Every reference's key: the top files' ("A", ...) and the try-its' (their file names)."""
    folder = _where["folder"]
    tryits = os.path.join(folder, "tryits") if folder else ""
    names = sorted(n[:-3] for n in os.listdir(tryits) if n.endswith(".py")) if os.path.isdir(tryits) else []
    return sorted(_where["files"]) + [n for n in names if n != "__init__"]


def reference_text(key: str) -> str:
    """Reference ``key``'s source text, read without recording (the caller says ``shown``)."""
    folder = _where["folder"]
    name = _where["files"].get(key)
    path = os.path.join(folder, name) if name else os.path.join(folder, "tryits", f"{key}.py")
    with quiet(), open(path) as f:
        return f.read()


def take(where: tuple[str, dict] | None = None) -> list[str]:
    """On a rank: install the hook (``where``: the kernel's references), and hand over (and
    forget) the keys read since last time."""
    install(where)
    keys = sorted(_taken)
    _taken.clear()
    return keys


def mark() -> float:
    """Now, to ask later what was read since."""
    install()
    return time.monotonic()


def add(keys, earlier: bool = False) -> None:
    """Keys another process of the check read (a rank, a torchrun worker), as read now, or
    (``earlier``) before the check began: then they count only for their own exercise."""
    for key in keys:
        _read[key] = max(_read.get(key, 0.0), 0.0 if earlier else time.monotonic())


def from_cluster(cluster, earlier: bool = False) -> None:
    """Take what ``cluster``'s ranks read since their last ``take`` (``earlier``: before the
    check that asks); a cluster that cannot answer (its ranks just failed, and fresh ones read
    nothing yet) reads nothing."""
    try:
        got = cluster.run(take, where(), timeout=60)
    except Exception:  # noqa: BLE001 -- see above
        return
    add((key for keys in got for key in keys), earlier)


def from_log(folder: str) -> None:
    """Take what a torchrun launch's workers read (their ``LOG`` files in ``folder``)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if name.startswith(LOG.split("{")[0]):
            with open(os.path.join(folder, name), errors="replace") as f:
                add(line.strip() for line in f if line.strip())


def used(key: str, since: float) -> list[str]:
    """The references a report of ``key`` judged near: ``key`` when read at any time before
    now, any key read since ``since``."""
    return sorted(k for k, t in _read.items() if k == key or t >= since)


def judged(key: str):
    """Make the decorated ``check(...) -> Report`` list the references read before or while it
    judged (``used``), its report known by ``key`` where it names none."""
    def wrap(check):
        @functools.wraps(check)
        def run(*args, **kwargs):
            since = mark()
            report = check(*args, **kwargs)
            report.key = report.key or key
            report.references = used(report.key, since)
            return report
        return run
    return wrap


def forget() -> None:
    """Forget every record of this process (a new learner, e.g. a test)."""
    _read.clear()
    _taken.clear()


def describe(keys) -> str:
    keys = list(keys)
    said = ", ".join(f"solution({k!r})" for k in keys)
    return (f"{said} was read before or while this was judged (by dpc.exercises.solution, report.fix() "
            "or the learner's code); the verdict stands, and an instructor sees it")


def embeds(text: str, key: str, starter: str = "", share: float = 0.6) -> bool:
    """Does ``text`` (a learner's script) carry reference ``key``'s own lines -- those the
    starter does not have, comments included? True when at least ``share`` of them are there;
    a conversion written apart shares its code with the reference, never its wording."""
    def lines(source: str) -> set[str]:
        return {line.strip() for line in source.splitlines() if len(line.strip()) >= 20}

    own = lines(reference_text(key)) - lines(starter)
    if len(own) < 5:
        return False
    return len(own & lines(text)) >= share * len(own)


class quiet:
    """Reads of a reference by the course itself (a checker comparing, ``embeds``): not the
    learner's, so not recorded."""

    def __enter__(self):
        self._read, self._taken = dict(_read), set(_taken)
        return self

    def __exit__(self, *exc):
        _read.clear()
        _read.update(self._read)
        _taken.clear()
        _taken.update(self._taken)
