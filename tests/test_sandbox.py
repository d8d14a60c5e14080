"""Where a learner's formulas run (``grading.sandbox``) and what says a reference was used
(``grading.provenance``): each route to the course's code, tried for real in the process
the formulas run in; no ranks, a fraction of a second each."""
from __future__ import annotations

import importlib
import os
import textwrap

import pytest

import dpcourse as dpc
from dpcourse.exercises.setups import COURSE_CODE
from dpcourse.grading import provenance, sandbox
from dpcourse.grading.sandbox import UNREACHABLE

LEDGER = os.path.join(os.path.dirname(dpc.__file__), "memory", "ledger.py")


def held(units, world_size, setup):
    share = sum(units) / world_size if setup == "fsdp" else sum(units)
    return {"parameters": 4 * share, "gradients": 4 * share, "optimizer_state": 8 * share}


def through_importlib(units, world_size, setup):
    return getattr(importlib.import_module("dp" + "course.memory"), "led" + "ger")


def through_the_module():
    return dpc.memory.ledger


def through_the_file(units, world_size, setup):
    return open(LEDGER).read()[:10]


SOURCE = open(LEDGER).read()


def through_a_new_interpreter(units, world_size, setup):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", "import dpcourse"], check=True).returncode


def through_exec(units, world_size, setup):
    exec(SOURCE, {"__name__": "copied"})


def test_a_formula_written_by_hand_runs_there_and_gives_its_numbers():
    out = sandbox.evaluate({"held": held}, [("held", ([10, 20], 2, "fsdp")), ("held", ([10, 20], 2, "ddp"))])
    assert out["problem"] == "" and out["results"] == [
        ({"parameters": 60.0, "gradients": 60.0, "optimizer_state": 120.0}, ""),
        ({"parameters": 120.0, "gradients": 120.0, "optimizer_state": 240.0}, "")]


@pytest.mark.parametrize("fn", [through_importlib, through_the_module, through_the_file, through_a_new_interpreter],
                         ids=["importlib", "a global", "reading the file", "a new interpreter"])
def test_every_route_to_the_course_is_closed_where_formulas_run(fn):
    out = sandbox.evaluate({"f": fn}, [("f", ([1], 2, "ddp"))])
    (value, error), = out["results"]
    assert value is None and error.startswith(UNREACHABLE), error


def test_a_copy_of_the_calculator_run_by_exec_is_told_as_a_copy():
    out = sandbox.evaluate({"f": through_exec}, [("f", ([1], 2, "ddp"))])
    assert sandbox.copied_from(out["compiled"], COURSE_CODE) == "dpc.memory"
    assert sandbox.copied_from(sandbox.learner_sources(held), COURSE_CODE) is None   # short idioms are no copy
    assert sandbox.copied_from(sandbox.learner_sources(through_exec), COURSE_CODE) is None


def test_a_formula_may_use_torch_and_numpy_there():
    def with_torch(units, world_size, setup):
        import numpy
        import torch
        return float(torch.tensor(units).sum()) + float(numpy.float64(world_size))

    out = sandbox.evaluate({"t": with_torch}, [("t", ([1, 2], 3, "ddp"))])
    assert out["results"] == [(6.0, "")], out


def test_a_formula_that_raises_or_hangs_is_said_and_the_kernel_goes_on():
    def raises(units, world_size, setup):
        return {}["missing"]

    out = sandbox.evaluate({"r": raises}, [("r", ([1], 2, "ddp"))])
    assert out["results"] == [(None, "KeyError: 'missing'")]
    space = {}
    exec(textwrap.dedent('''
        def spins(units, world_size, setup):
            while True:
                pass
    '''), space)
    out = sandbox.evaluate({"s": space["spins"]}, [("s", ([1], 2, "ddp"))], timeout=2)
    assert out["results"] == [] and "did not finish within 2 s" in out["problem"]


def test_a_reference_read_by_any_route_is_recorded_and_its_own_check_says_so():
    provenance.forget()
    since = provenance.mark()
    assert provenance.used("A", since) == []
    with open(os.path.join(provenance.where()[0], "tryits", "no_sync.py")) as f:   # a route round solution()
        f.read()
    assert provenance.used("A", since) == ["no_sync"]
    later = provenance.mark()
    assert provenance.used("no_sync", later) == ["no_sync"] and provenance.used("A", later) == []
    dpc.exercises.solution("A")
    assert provenance.used("A", provenance.mark()) == ["A"]   # read before: A's later reports say it
    provenance.forget()
    with provenance.quiet():
        dpc.exercises.solution("F")
    assert provenance.used("F", since) == []


def test_a_script_that_carries_the_reference_text_is_told_from_one_written_apart():
    from dpcourse.exercises import starters

    with provenance.quiet():
        reference, starter = dpc.exercises.solution("A"), open(starters.path("train_lm")).read()
    assert provenance.embeds(reference, "A", starter)
    assert not provenance.embeds(starter, "A", starter)
    assert provenance.key_of(os.path.join(provenance.where()[0], "train_lm_fsdp.py")) == "F"
    assert provenance.key_of(os.path.join(provenance.where()[0], "__init__.py")) is None


ROOT = os.path.dirname(os.path.dirname(dpc.__file__))


def by_path_entry(units, world_size, setup):
    import sys
    sys.path.append(ROOT)
    import dpcourse  # noqa: F401
    return dpcourse


def by_a_doubled_slash(units, world_size, setup):
    return open("/" + LEDGER).read()


def by_proc_root(units, world_size, setup):
    return open("/proc/self/root" + LEDGER).read()


def by_a_link(units, world_size, setup):
    import tempfile
    link = os.path.join(tempfile.mkdtemp(), "course")
    os.symlink(os.path.dirname(LEDGER), link)
    return open(os.path.join(link, "ledger.py")).read()


def by_a_folder_fd(units, world_size, setup):
    folder = os.open(os.path.dirname(LEDGER), os.O_RDONLY)
    return os.read(os.open("ledger.py", os.O_RDONLY, dir_fd=folder), 10)


def by_git(units, world_size, setup):
    import subprocess
    return subprocess.run(["git", "-C", ROOT, "show", "HEAD:dpcourse/memory/ledger.py"], capture_output=True).stdout


def by_ctypes(units, world_size, setup):
    import ctypes
    libc = ctypes.CDLL(None)
    return libc.fopen(LEDGER.encode(), b"r")


def by_ctypes_pythonapi(units, world_size, setup):
    import ctypes
    return ctypes.pythonapi.fopen(LEDGER.encode(), b"r")


def by_changing_the_guard(units, world_size, setup):
    import gc
    hook = next(f for f in gc.get_objects() if getattr(getattr(f, "__code__", None), "co_filename", "") == "<sandbox>"
                and any(isinstance(d, frozenset) for d in f.__defaults__ or ()))
    hook.__defaults__ = tuple(frozenset() if isinstance(d, frozenset) else d for d in hook.__defaults__)
    return open(LEDGER).read()


def by_the_tests(units, world_size, setup):
    return open(os.path.join(ROOT, "tests", "test_exercises_bc.py")).read()


def by_switching_the_guard_off(units, world_size, setup):
    import gc
    hook = next(f for f in gc.get_objects() if getattr(getattr(f, "__code__", None), "co_filename", "") == "<sandbox>"
                and any(isinstance(d, list) for d in f.__defaults__ or ()))
    next(d for d in hook.__defaults__ if isinstance(d, list))[0] = False
    import subprocess, sys
    return subprocess.run([sys.executable, "-c", "import dpcourse"], check=True).returncode


def by_a_path_object(units, world_size, setup):
    class Sneaky:
        def __fspath__(self):
            return LEDGER
    return open(Sneaky()).read()


ATTACKS = [by_switching_the_guard_off, by_a_path_object, by_path_entry, by_a_doubled_slash, by_proc_root, by_a_link, by_a_folder_fd, by_git, by_ctypes,
           by_ctypes_pythonapi,
           by_changing_the_guard, by_the_tests]


@pytest.mark.parametrize("fn", ATTACKS, ids=[f.__name__ for f in ATTACKS])
def test_a_formula_that_attacks_the_guard_still_cannot_reach_the_course(fn):
    out = sandbox.evaluate({"f": fn}, [("f", ([1], 2, "ddp"))])
    (value, error), = out["results"]
    assert value is None and error.startswith(UNREACHABLE), (fn.__name__, value, error)
