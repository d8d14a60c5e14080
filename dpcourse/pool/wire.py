"""What travels between the pool's processes (one class per message), and how it is pickled.

The messages in the order they go, kernel K, launcher L, rank R (task socket unless said):

    K -> L  Spawn (the ranks' sockets follow)         L -> K  Spawned; Reaped whenever ranks end
    L -> R  ImportNow, Spec (spawned spares only)     R -> L  SpareImported
    R -> K  Imported (spawned only), then Ready or InitError
    K -> R  Task: RunFunction, RunCell, RunScript or Reinit, pickled in its body
    R -> K  (control socket, while it runs) Output; Status or Waiting when asked (AskStatus,
            AskWait on the control socket); ScriptEnded once a script has ended, before the
            rank joins the pool's group again
    R -> K  a Reply: Finished, Exited, Raised or Interrupted, each ending with After
    K -> L  Signal, Kill (-> Killed), Sweep (-> Swept), Exit

Functions go by value (cloudpickle), so a function defined in a notebook cell, and
the notebook globals it uses, reach the ranks even though the ranks cannot import the
notebook's ``__main__``. Results come back the same way, with tensors moved to the CPU.
"""
from __future__ import annotations

import io
import linecache
import types
from dataclasses import dataclass
from typing import NamedTuple

import cloudpickle

from ..torch_private import cloudpickle_code_reduce
from ..tracking.records import Traffic, Wait   # the rank's records that Waiting and After carry
from .errors import SerializationError

# --------------------------------------------------------------- the messages
# Three processes talk (see the package's docstring): the kernel, the launcher and the ranks.
# Each message is one class here, named for what it says; a receiver tells them apart by
# type, and reads fields by name. The kernel and a rank talk over two sockets per rank: the
# *task* socket carries one request and its reply at a time, the *control* socket carries
# what the rank says meanwhile (its output, and answers to questions asked while it is busy).


@dataclass(frozen=True)
class Task:
    """kernel -> rank, task socket: run ``body`` now, then reply with a ``Reply`` of ``run_id``.

    ``sources``: linecache entries of notebook cells the rank has not seen (see
    ``notebook_sources``), so its tracebacks show their lines. ``body``: a pickled
    ``RunFunction``, ``RunCell``, ``RunScript`` or ``Reinit``, unpickled on the rank inside
    the call, so that a body that cannot be unpickled there (a missing module) is reported
    like any other error of the call.
    """

    run_id: int
    sources: dict
    body: bytes
    cwd: str = ""  # the kernel's working folder now: the ranks follow it (a ``%cd`` is seen)
    env: dict | None = None  # the kernel's environment, when it changed since the last task


@dataclass(frozen=True)
class RunFunction:
    """What ``cluster.run`` asks: ``fn(*args, **kwargs)`` inside every observer (first outermost)."""

    fn: object
    args: tuple
    kwargs: dict
    observers: list


@dataclass(frozen=True)
class RunCell:
    """What ``%%ranks`` asks: run ``source`` in the rank's namespace, as the file ``filename``."""

    source: str
    filename: str


@dataclass(frozen=True)
class RunScript:
    """What ``cluster.run_script`` asks: run ``source`` as ``__main__`` ``path`` with ``argv``, as
    torchrun would, its process group on ``port``; the pool's group is joined again on
    ``reinit_port`` afterwards (two ports: the script's group may linger in TIME_WAIT)."""

    path: str
    source: str
    argv: list
    port: int
    reinit_port: int
    observers: list
    env: dict = None  # the environment a process started from the kernel now would have


@dataclass(frozen=True)
class Reinit:
    """Join a fresh default process group on ``port`` (rank code destroyed the pool's)."""

    port: int


@dataclass(frozen=True)
class Ready:
    """rank -> kernel, task socket, once: the rank joined the process group and waits for tasks.
    ``oom_first``: whether it could volunteer to Linux's out-of-memory killer."""

    rank: int
    pid: int
    oom_first: bool


@dataclass(frozen=True)
class InitError:
    """rank -> kernel, task socket, instead of ``Ready``: set-up failed; ``text`` is the traceback."""

    rank: int
    text: str


@dataclass(frozen=True)
class Imported:
    """rank -> kernel, task socket, spawned ranks only, before ``Ready``: torch is imported (a
    spare is warm: a restart onto it waits for no import). What the spare tells the launcher
    at the same moment is another message, ``SpareImported``."""

    rank: int


@dataclass(frozen=True)
class After:
    """What every reply ends with: the state a call left behind on the rank.

    ``intact``: whether the pool's default process group still exists (rank code may destroy
    it). ``traffic``: the call's messages and collectives (a ``tracking.records.Traffic``;
    None if this torch cannot say), from which the kernel finds what is still in flight.
    ``left``: (pid, name) of the processes a script left running, which the rank stopped.
    ``threads``: names of the learner's threads still running on the rank (they may still
    communicate, so the rank's having returned decides nothing).
    """

    intact: bool
    traffic: Traffic | None
    left: list
    threads: tuple = ()


@dataclass(frozen=True)
class Reply:
    """rank -> kernel, task socket: how the task ``run_id`` ended (one of the subclasses)."""

    run_id: int
    after: After


@dataclass(frozen=True)
class Finished(Reply):
    """It returned ``value``; ``observed``: each observer's ``result()`` (empty for a cell)."""

    value: object
    observed: list


@dataclass(frozen=True)
class Exited(Reply):
    """A script ended with a non-zero exit ``code`` (``sys.exit(3)``, ``os._exit(3)``)."""

    code: int
    observed: list


@dataclass(frozen=True)
class Raised(Reply):
    """It raised: ``summary`` (one line), the learner's ``traceback`` (pool frames dropped) and
    the exception itself, or None where it cannot be pickled."""

    summary: str
    traceback: str
    exception: BaseException | None


@dataclass(frozen=True)
class Interrupted(Reply):
    """The stop button's SIGINT reached the call, which unwound."""


@dataclass(frozen=True)
class AskStatus:
    """kernel -> rank, control socket: where are you? (answered with ``Status``)"""


@dataclass(frozen=True)
class AskWait:
    """kernel -> rank, control socket: the deadlock check's probe (answered with ``Waiting``)."""


@dataclass(frozen=True)
class Output:
    """rank -> kernel, control socket: ``text`` written to the rank's ``stream`` ("stdout" or
    "stderr"), forwarded as it is written."""

    stream: str
    text: str


@dataclass(frozen=True)
class Status:
    """rank -> kernel, control socket: the answer to ``AskStatus``. ``collective``: one line, the
    collective it waits in or its last; ``stack``: the main thread's Python stack, pool frames
    dropped."""

    running: bool
    collective: str
    stack: str


@dataclass(frozen=True)
class Waiting:
    """rank -> kernel, control socket: the answer to ``AskWait`` (see ``deadlock``). ``wait``: the
    communication the main thread is blocked in (a ``tracking.records.Wait``), None when the
    rank's state decides nothing, and then ``why`` says so in a few words ("computing or waiting
    elsewhere", "runs threads of its own: ..."); ``traffic``: the call's traffic so far (a
    ``tracking.records.Traffic``), every group it used counted (also one a script destroyed)."""

    running: bool
    wait: Wait | None
    why: str
    traffic: Traffic


@dataclass(frozen=True)
class ScriptEnded:
    """rank -> kernel, control socket: the script of task ``run_id`` has ended, as ``reply`` says
    (``Finished`` with 0, ``Exited`` or ``Raised``; its ``after.traffic`` counts the script's
    groups too). Sent before the rank joins the pool's group again, which waits for every rank:
    the kernel learns at once that a script failed, or that a rank will issue nothing more."""

    run_id: int
    reply: Reply


# The launcher's channel. Named tuples whose first item is their kind (``to_launcher`` types a
# request from it); both ends write them by keyword and read them by name. Every field has a
# default so that a message is written by keyword: ``Spawned(pids=pids)``.


class Spawn(NamedTuple):
    """kernel -> launcher: start a generation for ``spec`` (its sockets follow, by SCM_RIGHTS).
    ``spare``: spawned ranks kept for a later restart, importing torch at low priority."""

    kind: str = "spawn"
    spec: dict = None
    spare: bool = False


class Activate(NamedTuple):
    """kernel -> launcher: hand the spawned spares ``pids`` their ``spec`` (a pickled dict)."""

    kind: str = "activate"
    pids: list = ()
    spec: bytes = b""


class Signal(NamedTuple):
    """kernel -> launcher: send ``signum`` to the ranks ``pids`` (the stop button: SIGINT)."""

    kind: str = "signal"
    signum: int = 0
    pids: list = ()


class Kill(NamedTuple):
    """kernel -> launcher: SIGKILL and reap the ranks ``pids`` and what they started (``Killed``)."""

    kind: str = "kill"
    pids: list = ()


class Sweep(NamedTuple):
    """kernel -> launcher: stop what the ranks' scripts left running (answered with ``Swept``)."""

    kind: str = "sweep"


class Exit(NamedTuple):
    """kernel -> launcher: kill every rank and exit."""

    kind: str = "exit"


class LauncherReady(NamedTuple):
    """launcher -> kernel, once: the launcher (process ``pid``) serves."""

    kind: str = "launcher_ready"
    pid: int = 0


class Spawned(NamedTuple):
    """launcher -> kernel: the ranks of a ``Spawn``, their ``pids`` by rank."""

    kind: str = "spawned"
    pids: list = ()


class Reaped(NamedTuple):
    """launcher -> kernel, unasked, whenever it has reaped ranks that ended: ``exits`` holds
    (pid, wait status, peak resident bytes, stdout, stderr) of each, the last two what it wrote
    that its output thread had not sent before it died. Not a reply (``Exited`` is a rank's)."""

    kind: str = "reaped"
    exits: list = ()


class Killed(NamedTuple):
    """launcher -> kernel: the answer to ``Kill``: ``exits`` as in ``Reaped``, and ``left``:
    (pid, the rank's pid or process group, name) of what the ranks had started, now stopped."""

    kind: str = "killed"
    exits: list = ()
    left: list = ()


class Swept(NamedTuple):
    """launcher -> kernel: the answer to ``Sweep``; ``left`` as in ``Killed``."""

    kind: str = "swept"
    left: list = ()


class ImportNow(NamedTuple):
    """launcher -> spawned spare (its stdin socket): import torch now, in a thread of ``nice``."""

    kind: str = "import"
    nice: int = 0


class Spec(NamedTuple):
    """launcher -> spawned spare: you are needed; ``spec`` (a pickled dict) says for what."""

    kind: str = "spec"
    spec: bytes = b""


class SpareImported(NamedTuple):
    """spawned spare -> launcher: torch is imported (the next spare may start importing). The
    kernel hears the same from the rank as ``Imported``, on the rank's task socket."""

    kind: str = "spare_imported"


_TO_LAUNCHER = {cls().kind: cls for cls in (Spawn, Activate, Signal, Kill, Sweep, Exit)}


def to_launcher(raw: tuple):
    """A request the launcher received, typed (a plain tuple of the same items is typed too)."""
    kind, *fields = raw
    return _TO_LAUNCHER[kind](kind, *fields)


def _reduce_tensor_to_cpu(obj):
    """Pickle a device tensor as its CPU copy, so results never need a GPU to unpickle."""
    import torch

    if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta") and type(obj) is torch.Tensor:
        return _identity, (obj.detach().cpu(),)
    return NotImplemented


def _identity(x):
    return x


def _reduce_code_keeping_filename(code):
    """cloudpickle renames every code object's file to "<dynamic-code>"; keep the real name
    so a rank's traceback points at the notebook cell (whose source we ship, see below)."""
    reduce = cloudpickle_code_reduce()
    if reduce is None:
        return NotImplemented
    rebuild, args = reduce(code)
    args = tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)
    return rebuild, args


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            reduced = _reduce_code_keeping_filename(obj)
            if reduced is not NotImplemented:
                return reduced
        if type(obj).__module__.startswith("torch"):
            reduced = _reduce_tensor_to_cpu(obj)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


loads = cloudpickle.loads


def _describe(obj) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."


def dumps_call(fn, args: tuple, kwargs: dict, observers: list = ()) -> bytes:
    """Pickle a call; on failure, name the function or argument that cannot be pickled."""
    try:
        return dumps(RunFunction(fn, args, kwargs, list(observers)))
    except Exception as whole:
        parts = [("the function " + getattr(fn, "__qualname__", _describe(fn)), fn)]
        parts += [(f"the observer {_describe(o)}", o) for o in observers]
        parts += [(f"positional argument {i} ({_describe(a)})", a) for i, a in enumerate(args)]
        parts += [(f"keyword argument {k!r} ({_describe(v)})", v) for k, v in kwargs.items()]
        for label, value in parts:
            try:
                dumps(value)
            except Exception as err:
                raise SerializationError(
                    f"cannot send {label} to the ranks: {type(err).__name__}: {err}. "
                    "Objects such as open files, locks, sockets, generators and live process "
                    "groups cannot be pickled; create them inside the function instead."
                ) from err
        raise SerializationError(f"cannot send the call to the ranks: {whole}") from whole


def notebook_sources(already_sent: set[str]) -> dict[str, tuple]:
    """linecache entries of code that exists only in memory (notebook cells), not yet sent.

    Shipped to the ranks so remote tracebacks show the lines of the cell that failed.
    """
    new = {}
    for name, entry in list(linecache.cache.items()):
        if name in already_sent or len(entry) != 4 or entry[1] is not None:
            continue  # real files have an mtime; the ranks read those from disk
        if name.startswith("<frozen"):
            continue
        new[name] = entry
    return new
