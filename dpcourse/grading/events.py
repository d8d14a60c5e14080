"""What a process a check started did, as a typed event log: one JSON object per line,
written as it happens (line-buffered, so a run that hangs can be read while it hangs) and
read back as the dataclasses that wrote it.

The harness's own events say where a rank is: its process (``Pid``), each collective it
issued (``Comm``), waited in (``Wait``, for one whose wait starts apart from its issue) and
completed (``Done``), and its leaving the process group (``Destroy``). A checker's recorder
adds events of its own with ``@event``; ``read_events`` knows every registered kind.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading

_KINDS: dict[str, type] = {}


def event(cls: type) -> type:
    """Make ``cls`` a frozen dataclass that an ``EventLog`` writes and ``read_events`` reads
    back, known by its class name (which must be unique among events)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    known = _KINDS.get(cls.__name__)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"two events are called {cls.__name__}: {known.__module__} and {cls.__module__}")
    _KINDS[cls.__name__] = cls
    return cls


@event
class Pid:
    """The rank's process, logged first, so a watcher can tell a rank that ended from one that waits."""
    pid: int


@event
class Comm:
    """A collective issued in optimizer step ``step``, numbered ``number``: its ``collective``
    ("all_gather"), ``dtype``, payload ``nbytes``, ``group`` size (0: not recorded) and
    ``kind``: "c10d" (through the collective tracker: waited in until ``Done``) or
    "functional" (DTensor's: waited in from its ``Wait``)."""
    step: int
    collective: str
    dtype: str
    nbytes: int
    group: int
    number: int
    kind: str


@event
class Wait:
    """Collective ``number`` (a functional one) starts to be waited for."""
    number: int


@event
class Done:
    """Collective ``number`` has completed on this rank."""
    number: int


@event
class Destroy:
    """``destroy_process_group`` has returned: this rank's distributed work is over."""


def log_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.jsonl")


class EventLog:
    """Appends events to ``path``, one JSON line each, from any thread; ``close`` ends it (an
    event written after that, by a late callback, is dropped)."""

    def __init__(self, path: str):
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1)

    def write(self, record) -> None:
        line = json.dumps({"event": type(record).__name__, **dataclasses.asdict(record)})
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            log, self._file = self._file, None
        if log is not None:
            log.close()


def read_events(directory: str, rank: int) -> list:
    """One rank's events so far, in order (a line still being written is left out)."""
    try:
        with open(log_path(directory, rank)) as f:
            lines = f.read().splitlines(keepends=True)
    except OSError:
        return []
    found = []
    for line in lines:
        if not line.endswith("\n"):
            break
        fields = json.loads(line)
        found.append(_KINDS[fields.pop("event")](**fields))
    return found
