"""What exercises B and C share: a learner's wrapping trained on the ranks by the course's one
training loop (``dpc.train.train`` with ``wrap=``) under the course's observers, the same
training in one process, and a prediction judged without printing the value it is judged
against; the learner's formulas called safely, and refused when they use the course's own
calculators (``calculator_in``); ``Answers`` runs them where the course cannot be reached.

The learner writes ``wrap(model) -> model`` functions (DDP, FSDP1 or FSDP2 lines); the runner
calls them on every rank on a fresh MLP that already sits on the rank's device. Nothing of
the learner's runs in the kernel.
"""
from __future__ import annotations

import os

from ..observe.observer import Observer
from ..train import TrainConfig, train
from ..train.runner import train_single_process
from ..grading.sandbox import filled

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COURSE_CODE = {     # what a formula must not copy: the calculators and the references' formulas
    "dpc.memory": os.path.join(_PACKAGE, "memory"),
    "dpc.collectives": os.path.join(_PACKAGE, "collectives"),
    "the reference of exercise B": os.path.join(_PACKAGE, "exercises", "solutions", "setups_b.py"),
    "the reference of exercise C": os.path.join(_PACKAGE, "exercises", "solutions", "configs_c.py"),
}
STEPS, BATCH, LR = 3, 8, 1e-3   # Adam steps, samples per rank per step, learning rate
WEIGHTS_ATOL = 1e-5            # fp32 data parallelism reproduces one process to float rounding


def config(sizes: dict, world_size: int, steps: int = STEPS) -> TrainConfig:
    return TrainConfig(model="mlp", model_sizes=dict(sizes), batch_size=BATCH, steps=steps, optimizer="adam",
                       lr=LR, num_samples=BATCH * steps * world_size, progress=False)


def train_wrapped(wrap, sizes: dict, steps: int = STEPS, weights: bool = True):
    """On each rank: the runner's training of the MLP, wrapped by the learner's ``wrap``.
    Returns the full weights (on rank 0, None elsewhere; not gathered at all when
    ``weights`` is False) and the API the wrapping used: "fsdp2", "fsdp1" or "other"."""
    import torch.distributed as dist

    def checked(model):
        with course_code_called() as called:
            wrapped = wrap(model)
        if called:
            raise TypeError(f"refused: the wrap function calls the course's own code ({called[0]}) -- write the "
                            "wrapping yourself, with PyTorch's API")
        if not hasattr(wrapped, "parameters"):
            raise TypeError(f"the wrap function returned a {type(wrapped).__name__}, not the wrapped model: "
                            "end it with `return model` (or the wrapper it built)")
        return wrapped

    metrics = train(config(sizes, dist.get_world_size(), steps), full_state=weights, wrap=checked)
    applied = metrics["applied"]
    api = ("fsdp1" if applied.startswith("FullyShardedDataParallel") else
           "fsdp2" if applied.startswith("FSDP") else "other")
    return {"weights": metrics.get("state"), "api": api}


# the course's own code that a learner's set-up may not call: its training code, the from-scratch
# wrappers, the calculators, the references
COURSE_ROOMS = ("train", "scratch", "memory", "collectives", os.path.join("exercises", "solutions"))


class course_code_called:
    """Within: every Python function of ``COURSE_ROOMS`` that the learner's code calls, in this
    thread or a thread it starts, directly or through what is installed (``functools``,
    ``threading``, torch), as a notebook spells it (``dpc.train.parallel.apply_fsdp``), in the
    list it yields -- what a set-up does, not what its names say. A call whose nearest caller
    outside the installed libraries is the course's own (an observer counting bytes when torch
    calls it) is the course watching, not the set-up reaching for it."""

    def __enter__(self) -> list:
        import sys
        import threading

        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
        rooms = tuple(os.path.join(package, room) + os.sep for room in COURSE_ROOMS)
        installed = tuple({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
                          | {p + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
        self.called, self._before, self._threads = [], sys.getprofile(), threading.getprofile()

        def learners(frame) -> bool:
            while frame is not None and (frame.f_code.co_filename.startswith(installed)
                                         or frame.f_code.co_filename.startswith("<frozen")):
                frame = frame.f_back
            return frame is not None and not frame.f_code.co_filename.startswith(package)

        def profile(frame, event, arg):
            if (event == "call" and frame.f_code.co_filename.startswith(rooms) and len(self.called) < 8
                    and learners(frame.f_back)):
                name = f"{frame.f_globals.get('__name__', '').replace('dpcourse', 'dpc', 1)}.{frame.f_code.co_name}"
                if name not in self.called:
                    self.called.append(name)

        sys.setprofile(profile)
        threading.setprofile(profile)
        return self.called

    def __exit__(self, *exc):
        import sys
        import threading

        sys.setprofile(self._before)
        threading.setprofile(self._threads)
        # in the order called, public functions first: what the learner's code named, not a dunder
        self.called.sort(key=lambda name: name.split(".")[-1].startswith("_"))


def one_process(sizes: dict, world_size: int, steps: int = STEPS) -> dict:
    """The same training in this process, on the whole global batches."""
    return train_single_process(config(sizes, world_size, steps), world_size)["state"]


def weights_verdict(results: list[dict], reference: dict) -> tuple[bool, str]:
    """Do rank 0's full weights equal one process's? (keys must be the plain model's)"""
    weights = results[0]["weights"]
    missing = sorted(set(reference) - set(weights))
    if missing:
        return False, f"the trained model has no {missing[0]!r}: did the wrap function return the model it wrapped?"
    diff = max((weights[k].float().cpu() - reference[k]).abs().max().item() for k in reference)
    if diff <= WEIGHTS_ATOL:
        return True, f"largest difference {diff:.1e}"
    return False, (f"largest difference from one process {diff:.1e}: does the wrapping keep every rank's "
                   "weights equal, and average (not sum) the gradients?")


def miss(predicted, measured: float, tolerance: float) -> tuple[bool | None, str]:
    """A numeric prediction against a measurement, said without the measured value: within
    ``tolerance`` (relative), or too high / too low and roughly by how much."""
    if predicted is ... or predicted is None:
        return None, "no prediction yet"
    if isinstance(predicted, bool) or not isinstance(predicted, (int, float)):
        return False, f"a number of bytes, please, not {predicted!r}"
    if measured == 0:
        return predicted == 0, "" if predicted == 0 else "too high: nothing of it was measured"
    ratio = predicted / measured
    if abs(ratio - 1) <= tolerance:
        return True, f"within {tolerance:.0%}"
    way = "too high" if ratio > 1 else "too low"
    factor = ratio if ratio > 1 else 1 / ratio
    if factor < 1.2:
        size = "by less than 20 %"
    elif factor < 1.75:
        size = "by 20 % to 75 %"
    else:
        size = f"by a factor of about {round(factor)}"
    return False, f"{way} {size}"


class AtRest(Observer):
    """Observer: what each rank holds right after every ``optimizer.step()``, by the memory
    ledger's categories, and when each step ended.

    The same walk as ``dpc.observe.Memory``'s at-rest bytes (``observe.held.held_bytes``:
    unique storages by role, DTensor shards and FSDP1's flat shards included), without
    Memory's change-by-change recorder, which costs seconds per run: the checkers only need
    the bytes between steps. Step ends come from the same step clock the course's observers
    share (``observe.watch.LoopWatch``).

        held = AtRest(); cluster.run(train_wrapped, wrap, sizes, observe=[held])
        held.at_rest(rank=0)   # {"parameters": ..., "gradients": ..., "optimizer_state": ..., ...}
        held.steps_per_second(rank=0)   # the median step's rate after the first
    """

    NAME = "held"   # in the message when nothing was observed yet

    def __init__(self):
        self.per_rank: list[dict] | None = None

    def __enter__(self):
        from ..observe.watch import LoopWatch

        self._held, self._ends = None, []
        self._watch = self.watch(LoopWatch(on_step_end=self._on_step_end))
        return self

    def _on_step_end(self, watch) -> None:
        import time

        from ..observe.held import held_bytes

        self._ends.append(time.perf_counter())
        self._held = held_bytes(watch.root, watch.optimizer)

    def __exit__(self, *exc):
        self.unwatch(*exc)  # the clock drops the model and optimizer it saw: they are the run's

    def result(self) -> dict:
        return {"held": self._held, "ends": self._ends}

    def at_rest(self, rank: int = 0) -> dict:
        held = self.of_rank(rank)["held"]
        if held is None:
            raise RuntimeError(f"rank {rank} ran no optimizer step")
        return dict(held)

    def step_seconds(self, rank: int = 0) -> list[float]:
        """How long each step after the first took on ``rank``, in seconds, from one step's
        end to the next's (the first step, which builds Adam's state, is the warm-up)."""
        ends = self.of_rank(rank)["ends"]
        return [b - a for a, b in zip(ends, ends[1:])]

    def steps_per_second(self, rank: int = 0) -> float | None:
        """The median step's rate after the first (``throughput`` of ``step_seconds``, which
        gives the spread too); None with fewer than two steps."""
        rate = throughput(self.step_seconds(rank))
        return rate["median"] if rate else None


def throughput(seconds) -> dict | None:
    """Steps per second from timed steps (``seconds``, one per step): {"median": the median
    step's rate, "low"/"high": the slowest and the fastest step's, "steps": how many}; None
    without a timed step.

    The median, not the fastest step: on a loaded machine other work takes time from some
    steps and not from others, so one lucky step says little; the range says how much it swung."""
    import statistics

    seconds = [s for s in seconds if s > 0]
    if not seconds:
        return None
    return {"median": 1 / statistics.median(seconds), "low": 1 / max(seconds), "high": 1 / min(seconds),
            "steps": len(seconds)}


def figure(x: float) -> str:
    """A rate or a ratio to two or three significant figures: 114, 7.7, 0.42."""
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def said_rate(rate: dict) -> str:
    """"median 77 steps/s, range 60–90 over 7 steps"."""
    steps = f"{rate['steps']} step" + ("s" if rate["steps"] != 1 else "")
    return (f"median {figure(rate['median'])} steps/s, range {figure(rate['low'])}–{figure(rate['high'])} "
            f"over {steps}")


# --- the learner's formulas ----------------------------------------------------------------------

# What a formula may not call: the course's own calculators, which return every number asked.
CALCULATOR_MODULES = ("dpcourse.memory", "dpcourse.collectives", "dpcourse.exercises")
CALCULATOR_NAMES = {"ledger", "step_bytes", "recommend", "fit_table", "MemoryCalculator", "solution"}


def _public_name(obj) -> str:
    """How a notebook spells a course object: dpc.memory.ledger, not dpcourse.memory.ledger.ledger."""
    import types

    if isinstance(obj, types.ModuleType):
        name = obj.__name__
    else:
        module = getattr(obj, "__module__", "") or ""
        room = ".".join(module.split(".")[:2])
        name = f"{room}.{getattr(obj, '__qualname__', getattr(obj, '__name__', type(obj).__name__))}"
    return name.replace("dpcourse", "dpc", 1)


def _calculator(obj, attributes: set, depth: int = 0) -> str | None:
    """The course calculator ``obj`` is or leads to through ``attributes`` (a module's
    attribute names the code reads), as a notebook spells it; None when it is none."""
    import types

    if isinstance(obj, types.ModuleType):
        name = obj.__name__
        if name != "dpcourse" and not name.startswith("dpcourse."):
            return None
        hit = name.startswith(CALCULATOR_MODULES)
        if depth < 3:
            for attribute in sorted(attributes):
                child = getattr(obj, attribute, None)
                if child is not None and child is not obj:
                    found = _calculator(child, attributes, depth + 1)
                    if found:
                        return found
        return _public_name(obj) if hit else None
    module = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", "") or ""
    if not isinstance(module, str) or not module.startswith("dpcourse"):
        return None
    if module.startswith(CALCULATOR_MODULES) or getattr(obj, "__name__", None) in CALCULATOR_NAMES:
        if not callable(obj):  # a Ledger or another result of a calculator
            return f"a {type(obj).__name__} made by the course's calculators ({type(obj).__module__.replace('dpcourse', 'dpc', 1)})"
        return _public_name(obj)
    return None


def _code_names(code) -> set:
    import types

    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def calculator_in(fn, _seen: set | None = None) -> str | None:
    """The course calculator a learner's formula uses -- ``dpc.memory.ledger``,
    ``dpc.collectives.step_bytes``, anything of ``dpcourse.memory``/``dpcourse.collectives``,
    ``recommend`` -- named as a notebook spells it, or None.

    Read from the function, never by running it: the names its code reads (``co_names``, of
    nested functions and comprehensions too) looked up in its globals and builtins, what its
    closure and defaults hold, and, the same way, the functions of the learner's own it calls.
    """
    import builtins
    import functools
    import inspect

    seen = set() if _seen is None else _seen
    if id(fn) in seen:
        return None
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        return calculator_in(fn.func, seen) or next(
            (found for a in (*fn.args, *fn.keywords.values()) if (found := _calculator(a, set()))), None)
    if inspect.ismethod(fn):
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:
        return _calculator(fn, set())
    names = _code_names(code)
    space = getattr(fn, "__globals__", {})
    held = [space[n] if n in space else getattr(builtins, n, None) for n in sorted(names)]
    held += [cell.cell_contents for cell in (fn.__closure__ or ()) if filled(cell)]
    held += list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
    for obj in held:
        if obj is None:
            continue
        found = _calculator(obj, names)
        if found:
            return found
        if inspect.isfunction(obj) and not (obj.__module__ or "").startswith(("dpcourse", "torch")):
            found = calculator_in(obj, seen)  # a helper of the learner's: read it too
            if found:
                return found
    return None


class Answers:
    """A learner's formulas' values, computed where the course cannot be reached
    (``sandbox.evaluate``): ``answers(part, *args)`` is (value, "") or (None, what it raised);
    ``refusal(part)`` is "" or why that formula is refused -- it reached for the course's code
    there, or its code is a copy of the course's calculators (``sandbox.copied_from``)."""

    def __init__(self, fns: dict, calls: list, what: str):
        from ..grading import provenance, sandbox

        self.fns = fns
        out = sandbox.evaluate(fns, calls)
        self.problem = out["problem"]
        self.values = {(part, repr(args)): r for (part, args), r in zip(calls, out["results"])}
        texts = list(out["compiled"])
        texts += [t for fn in fns.values() for t in sandbox.learner_sources(fn)]
        self.copied = sandbox.copied_from(texts, COURSE_CODE)
        self.used_reference = bool(self.copied and self.copied.startswith("the reference"))
        if self.used_reference:
            provenance.shown(self.copied.split()[-1])
        self.what = what

    def __call__(self, part: str, *args) -> tuple[object, str]:
        if self.problem:
            return None, self.problem
        value, error = self.values.get((part, repr(args)), (None, "not computed"))
        return value, error

    def refusal(self, part: str) -> str:
        from ..grading.sandbox import UNREACHABLE

        name = getattr(self.fns.get(part), "__name__", part)
        reached = next((e for (p, _), (_, e) in self.values.items() if p == part and e.startswith(UNREACHABLE)),
                       self.problem if self.problem.startswith(UNREACHABLE) else "")
        if reached:
            return (f"refused: {name}() reaches for the course's code, which formulas are judged without "
                    f"({reached.split(': ', 1)[-1]}) -- write the formula yourself, {self.what}")
        if self.copied and not self.used_reference:
            return (f"refused: {name}()'s code is a copy of {self.copied}, the course's own calculator -- "
                    f"write the formula yourself, {self.what}")
        return ""


def as_bytes(value):
    """A formula's value as a float (numpy and torch scalars too); ``...``, None and other
    things as they are, for ``miss`` to say what they are."""
    import numbers

    if value is ... or value is None or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return as_bytes(item())
    return value


def many(names) -> str:
    """"a", "a and b", "a, b and c"."""
    names = [str(n) for n in names]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
