"""A script run on a rank starts from the state a new process would have, and leaves none behind.

Runs on the ranks. Under torchrun every run of a script is a new process, started from the
folder and environment the command was typed in; a persistent rank lives on between scripts.
So for the length of one script (``fresh_process``), besides its imports (``isolation``) and
its environment, ``sys.argv`` and process group (``group``):

* the working folder is the kernel's at the call;
* torch's process-wide settings are a new process's: default dtype float32, gradients on,
  no deterministic algorithms, "highest" float32 matmul precision, no anomaly detection;
* the random streams (torch, ``random``, NumPy) are seeded as a new process's are: from the
  operating system's entropy, each rank its own, or from ``seed + rank`` when the cluster was
  given a seed;
* logging is unconfigured (no handlers on the root logger, level WARNING), and the warning
  filters are those the rank started with (a warning shown by one script shows again in the
  next);
* when the script's code has ended -- returned, raised or exited -- the rank waits for the
  threads it started that are not daemons, and then runs the ``atexit`` handlers the script's
  own code registered, as Python does at exit, before the script counts as finished.

Afterwards every one of these is back as the rank had it, so the next call -- a script or not
-- meets nothing of this one.
"""
from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import os
import random
import sys
import threading
import time
import traceback
import warnings

from .isolation import is_learners_file

# torch's process-wide settings: (getter, setter, a new process's value)
_TORCH_SETTINGS = (
    ("get_default_dtype", "set_default_dtype", "float32"),
    ("is_grad_enabled", "set_grad_enabled", True),
    ("are_deterministic_algorithms_enabled", "use_deterministic_algorithms", False),
    ("get_float32_matmul_precision", "set_float32_matmul_precision", "highest"),
    ("is_anomaly_enabled", "set_anomaly_enabled", False),
)
THREAD_NOTICE_S = 5.0  # a script's non-daemon thread still running after this long is said
_START_FILTERS: list = []  # the warning filters the rank started with (``remember_start``)


def remember_start() -> None:
    """Note what a new process looks like here (the warning filters), once, at the rank's start;
    and find where the learner's code is not, before any thread asks (``isolation``)."""
    _START_FILTERS[:] = list(warnings.filters)
    is_learners_file(__file__)


def seed_streams(seed: int | None, rank: int) -> None:
    """Seed torch's, ``random``'s and NumPy's global streams: from fresh entropy (``seed`` None:
    every rank draws its own numbers, as separate processes do) or from ``seed + rank``."""
    import torch

    if seed is None:
        torch.seed()
        random.seed()
    else:
        torch.manual_seed(seed + rank)
        random.seed(seed + rank)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(None if seed is None else (seed + rank) % 2**32)


@contextlib.contextmanager
def fresh_process(cwd: str, seed: int | None, rank: int, say):
    """Inside: a new process's state (the module's docstring); ``say(text)`` tells the kernel
    what a script's end is waiting for. Afterwards the rank's own state is back."""
    saved_cwd = os.getcwd()
    settings, streams, logs = _torch_settings(), _streams(), _logging_state()
    before = set(threading.enumerate())
    handlers: list = []
    try:
        if cwd:
            os.chdir(cwd)
        _set_torch_settings({getter: fresh for getter, _, fresh in _TORCH_SETTINGS})
        seed_streams(seed, rank)
        _unconfigure_logging()
        with warnings.catch_warnings(), _atexit_captured(handlers):
            warnings.filters[:] = _START_FILTERS
            try:
                yield
            finally:
                _join_threads(before, say)
                _run_atexit(handlers)
    finally:
        _restore_logging(logs)
        _set_streams(streams)
        _set_torch_settings(settings)
        with contextlib.suppress(OSError):
            os.chdir(saved_cwd)


# --- torch's settings and the random streams --------------------------------------------------

def _torch_settings() -> dict:
    import torch

    return {getter: getattr(torch, getter)() for getter, _, _ in _TORCH_SETTINGS}


def _set_torch_settings(values: dict) -> None:
    import torch

    for getter, setter, _ in _TORCH_SETTINGS:
        value = values[getter]
        if getter == "get_default_dtype" and isinstance(value, str):
            value = getattr(torch, value)
        if getattr(torch, getter)() != value:
            getattr(torch, setter)(value)


def _streams() -> dict:
    import torch

    state = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_streams(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


# --- logging ------------------------------------------------------------------------------------

def _loggers() -> dict:
    loggers = dict(logging.root.manager.loggerDict)  # a copy: another thread may add a logger meanwhile
    return {name: lg for name, lg in loggers.items() if isinstance(lg, logging.Logger)}


def _logging_state() -> dict:
    def of(lg):
        return lg.level, list(lg.handlers), list(lg.filters), lg.propagate, lg.disabled

    return {"root": of(logging.root), "disable": logging.root.manager.disable,
            "loggers": {name: of(lg) for name, lg in _loggers().items()}}


def _unconfigure_logging() -> None:
    """The root logger as a new process has it: no handlers, no filters, level WARNING."""
    logging.root.handlers[:] = []
    logging.root.filters[:] = []
    logging.root.setLevel(logging.WARNING)
    logging.disable(logging.NOTSET)


def _restore_logging(state: dict) -> None:
    """Put the rank's logging back; close what the script added (as ``logging.shutdown`` would at
    its process's exit); loggers it created are left as a new logger is."""
    kept = {id(h) for _, handlers, *_ in [state["root"], *state["loggers"].values()] for h in handlers}

    def put(lg, level, handlers, filters, propagate, disabled):
        if (lg.level, lg.handlers, lg.filters, lg.propagate, lg.disabled) == (level, handlers, filters,
                                                                               propagate, disabled):
            return  # as it was (setLevel would clear every logger's cache: hundreds of them)
        for handler in lg.handlers:
            if id(handler) not in kept:
                with contextlib.suppress(Exception):
                    handler.flush()
                    handler.close()
        lg.handlers[:], lg.filters[:] = handlers, filters
        lg.propagate, lg.disabled = propagate, disabled
        lg.setLevel(level)

    put(logging.root, *state["root"])
    for name, lg in _loggers().items():
        put(lg, *state["loggers"].get(name, (logging.NOTSET, [], [], True, False)))
    logging.disable(state["disable"])


# --- the end of a script: its threads, then its atexit handlers ---------------------------------

@contextlib.contextmanager
def _atexit_captured(handlers: list):
    """Inside: ``atexit.register`` called from the learner's code keeps the handler in ``handlers``
    (run when the script ends); a library's registration goes to the rank's own exit."""
    real_register, real_unregister = atexit.register, atexit.unregister

    def register(func, *args, **kwargs):
        caller = inspect.currentframe().f_back
        if caller is not None and is_learners_file(caller.f_code.co_filename):
            handlers.append((func, args, kwargs))
            return func
        return real_register(func, *args, **kwargs)

    def unregister(func):
        handlers[:] = [h for h in handlers if h[0] != func]
        return real_unregister(func)

    register.__doc__, unregister.__doc__ = real_register.__doc__, real_unregister.__doc__
    atexit.register, atexit.unregister = register, unregister
    try:
        yield
    finally:
        atexit.register, atexit.unregister = real_register, real_unregister


def _run_atexit(handlers: list) -> None:
    """The script's handlers, last registered first; an error is printed, as Python prints it."""
    while handlers:
        func, args, kwargs = handlers.pop()
        try:
            func(*args, **kwargs)
        except BaseException:  # noqa: BLE001 -- Python ignores it, after printing it
            print(f"Exception ignored in atexit callback: {func!r}", file=sys.stderr)
            traceback.print_exc()


def _join_threads(before: set, say) -> None:
    """Wait, as Python does at exit, for the threads the script started that are not daemons;
    after ``THREAD_NOTICE_S`` say which (the call's timeout bounds the wait)."""
    me = threading.current_thread()
    started = [t for t in threading.enumerate() if t not in before and t is not me and not t.daemon]
    said, notice = False, time.monotonic() + THREAD_NOTICE_S
    for thread in started:
        while thread.is_alive():
            thread.join(0.1)
            running = [t.name for t in started if t.is_alive()]
            if running and not said and time.monotonic() > notice:
                said = True
                say(f"the script has ended, and python waits at exit for its thread"
                    f"{'s' if len(running) > 1 else ''} {', '.join(map(repr, running))} (not a daemon): "
                    "waiting for it as python would, within the call's timeout")
    if said:
        say("")
