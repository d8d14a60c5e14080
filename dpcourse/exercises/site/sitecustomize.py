# Loaded by Python at start-up in the processes a checker starts (it puts this folder first on
# PYTHONPATH): in torchrun's workers it records what the learner's script does, for the checker
# (dpcourse/exercises/recorder.py), from start-up until the worker exits.
#
# Python imports only the first `sitecustomize` on sys.path, so this one would hide any other
# (a virtual environment's, a distribution's, one the learner's PYTHONPATH names). After its
# own work it runs the next one on sys.path, as Python would have without this folder.
import os
import sys


def _record_until_exit() -> None:
    import atexit

    from dpcourse.exercises.recorder import ScriptRecorder

    recorder = ScriptRecorder(os.environ["DPCOURSE_OBSERVE_DIR"], int(os.environ["RANK"]))
    recorder.__enter__()
    atexit.register(recorder.__exit__, None, None, None)  # registered first: left last


def _run_the_next_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.realpath(os.path.dirname(__file__))
    found = [os.path.realpath(p or os.curdir) == here for p in sys.path]
    rest = sys.path[found.index(True) + 1:] if True in found else sys.path  # only those after it: no loop
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # what `import sitecustomize` finds from now on
    spec.loader.exec_module(module)


if os.environ.get("DPCOURSE_OBSERVE_DIR") and "RANK" in os.environ:
    _record_until_exit()
_run_the_next_sitecustomize()
