"""The rank process: one persistent worker that runs the kernel's calls under torch.distributed.

Forked from the launcher (never from the kernel), it sets up what torchrun would (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), initialises the process group once, and then
loops: receive a call on the task socket, run it, send back the result or the traceback.
A control thread answers "where are you?" (Python stack + collective in progress) while the
main thread is busy or blocked, and an output thread forwards everything written to file
descriptors 1 and 2 -- Python prints, C++ warnings, progress bars -- to the kernel live.
"""
from __future__ import annotations

import contextlib
import faulthandler
import linecache
import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection

from ...backends import rank_device
from ...patching import patched
from ...processes import set_death_signal
from .. import wire
from . import fresh
from .forwarder import OutputForwarder
from .group import PoolGroup, torchrun_env
from .isolation import learner_threads, script_imports
from ..reaper import own_group, stop_descendants
from ...tracking.tracker import TRACKER

_exit = os._exit  # the process's own exit: a script's os._exit is caught while it runs (_exec_script)

# Out-of-memory killer preference, -1000 (never) .. 1000 (first). A rank that allocates too
# much should be the one Linux kills, not the learner's kernel or JupyterLab.
OOM_SCORE_ADJ = 1000


class Rank:
    def __init__(self, spec: dict, rank: int, task: Connection, control: Connection,
                 output_fds: tuple[int, int] | None = None):
        self.spec, self.rank = spec, rank
        self.output_fds = output_fds  # the read ends of the pipes fds 1 and 2 write to
        self.task, self.control = task, control
        self._send_lock = threading.Lock()
        self.tracker = TRACKER
        self.running = False
        self.namespace: dict = {}  # where %%ranks cells run; persists between cells
        self.left: list = []  # (pid, name) of processes the last script left running, now stopped
        self.main_ident = threading.get_ident()
        self.phase = ""  # what the rank does between the learner's code and its reply, if it takes time
        self.kernel_cwd, self.kernel_env = spec["cwd"], dict(spec["env"])  # the kernel's, as last seen

    # --- set-up -------------------------------------------------------------------
    def setup(self) -> None:
        spec, rank = self.spec, self.rank
        os.environ.update(spec["env"])
        os.environ.update(torchrun_env(rank, spec["world_size"], spec["port"]))
        self.oom_first = prefer_oom_kill()
        try:
            os.chdir(spec["cwd"])
        except OSError:
            pass
        sys.path[:] = spec["sys_path"]
        self.output = OutputForwarder(self.send_control, self.output_fds)
        # A segfault kills the output thread with the process; faulthandler's file survives,
        # and the kernel shows it in the RankDied report.
        self._crash_file = open(spec["crash_log"].format(rank=rank), "w")
        faulthandler.enable(self._crash_file, all_threads=False)
        signal.signal(signal.SIGINT, self._on_sigint)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's own handler is not the rank's
        import torch
        import torch.distributed as dist

        fresh.remember_start()
        fresh.seed_streams(spec.get("seed"), rank)  # each rank its own stream, as separate processes
        torch.set_num_threads(spec["num_threads"])
        self.group = PoolGroup(spec["backend"], rank, spec["world_size"])
        self.group.init(spec["port"])
        self.tracker.install()
        self.tracker.keep_point_to_point()
        device = rank_device()
        # __name__ == "__main__": a cell's `if __name__ == "__main__":` block runs, as in a script.
        self.namespace.update(__name__="__main__", torch=torch, dist=dist, rank=rank,
                              world_size=spec["world_size"], device=device)
        threading.Thread(target=self._serve_control, name="dpcourse-control", daemon=True).start()

    def _on_sigint(self, signum, frame):
        if self.running:
            raise KeyboardInterrupt

    # --- messages ------------------------------------------------------------------
    def send_control(self, msg) -> None:
        data = wire.dumps(msg)
        with self._send_lock:
            try:
                self.control.send_bytes(data)
            except OSError:
                _exit(0)  # the kernel is gone

    def _serve_control(self) -> None:
        while True:
            try:
                msg = self.control.recv()
            except (EOFError, OSError):
                _exit(0)  # the kernel died: never outlive it
            match msg:
                case wire.AskStatus():
                    self.send_control(self.status())
                case wire.AskWait():
                    self.send_control(self.wait_state())
                case other:  # the kernel and the rank disagree: said, and the thread serves on
                    print(f"dpcourse: rank {self.rank} ignores {other!r} on its control socket, "
                          "which carries AskStatus and AskWait only.", file=sys.stderr, flush=True)

    def status(self) -> wire.Status:
        frame = sys._current_frames().get(self.main_ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        return wire.Status(self.running, self.phase or self.tracker.describe(), _user_stack(stack))

    def wait_state(self) -> wire.Waiting:
        """What the kernel's deadlock check needs (see ``deadlock``): the communication this rank's
        main thread is blocked in, as the tracker recorded it (None when it is not blocked in one
        the tracker can follow, or when threads of the learner's run besides: they may still
        communicate), why not, and the call's traffic so far."""
        wait, why, traffic = self.tracker.waiting()
        threads = learner_threads()
        if wait is not None and threads:
            wait, why = None, f"runs threads of its own ({', '.join(threads[:3])}), which may still communicate"
        elif wait is not None and self.phase:
            wait, why = None, self.phase
        return wire.Waiting(self.running, wait, why, traffic)

    def say(self, text: str) -> None:
        """Tell the kernel (and a timeout's report) what the rank waits for between the learner's
        code and its reply ('' when it no longer does)."""
        self.phase = text
        if text:
            print(f"dpcourse: {text}.", file=sys.stderr, flush=True)

    # --- the loop --------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            try:
                data = self.task.recv_bytes()
            except (EOFError, OSError):
                _exit(0)
            task = wire.loads(data)
            reply = self.execute(task)
            self.output.drain()
            try:
                out = wire.dumps(reply)
            except Exception as err:
                value = getattr(reply, "value", getattr(reply, "code", None))
                out = wire.dumps(wire.Raised(
                    task.run_id, reply.after,
                    f"could not send the result back: {type(err).__name__}: {err}",
                    f"the value returned on rank {self.rank} cannot be pickled "
                    f"({type(value).__name__}); return plain Python objects or tensors instead.\n",
                    None))
            self.task.send_bytes(out)

    def execute(self, task: wire.Task) -> wire.Reply:
        """Run one task; the reply ends with what the call left behind (``wire.After``: whether
        the pool's process group is intact, the call's traffic, what a script left running)."""
        run_id = task.run_id
        try:
            linecache.cache.update(task.sources)
            self._follow_kernel(task)
            body = wire.loads(task.body)
            self.tracker.reset()
            self.running = True
            try:
                with self.group.guarded(), self.tracker.calls():  # undone after the call
                    value, observed = self._dispatch(body, run_id)
            finally:
                self.running, self.phase = False, ""
                self.group.release()
            if isinstance(body, wire.RunScript) and value != 0:
                return wire.Exited(run_id, self._after(), value, observed)
            return wire.Finished(run_id, self._after(), value, observed)
        except KeyboardInterrupt:
            return wire.Interrupted(run_id, self._after())
        except BaseException as exc:  # noqa: BLE001 -- everything goes back to the kernel
            return _raised(run_id, self._after(), exc)

    def _after(self, destroyed: bool = False) -> wire.After:
        """What the call left (``wire.After``); ``destroyed``: count the groups the call destroyed
        too (a script's, while its peers may still wait in them), and keep ``left`` for the reply."""
        try:
            traffic = self.tracker.traffic(destroyed)
        except Exception:  # noqa: BLE001 -- a torch without get_process_group_ranks: unchecked
            traffic = None
        left = self.left
        if not destroyed:
            self.left = []
        return wire.After(self.group.intact(), traffic, left, tuple(learner_threads()))

    def _follow_kernel(self, task: wire.Task) -> None:
        """Work in the kernel's folder and environment as they are now (a ``%cd`` or an
        ``os.environ`` change in the kernel is seen by the next call); torchrun's variables stay
        the pool's."""
        if task.cwd and task.cwd != self.kernel_cwd:
            self.kernel_cwd = task.cwd
            try:
                os.chdir(task.cwd)
            except OSError as err:
                print(f"dpcourse: rank {self.rank} cannot work in the kernel's folder {task.cwd!r} "
                      f"({err.strerror}); it stays in {os.getcwd()!r}.", file=sys.stderr)
        if task.env is not None and task.env != self.kernel_env:
            ours = set(torchrun_env(self.rank, 1, 0))
            for name in set(self.kernel_env) - set(task.env) - ours:
                os.environ.pop(name, None)
            for name, value in task.env.items():
                if name not in ours and self.kernel_env.get(name) != value:
                    os.environ[name] = value
            self.kernel_env = dict(task.env)

    def _dispatch(self, body, run_id: int) -> tuple:
        """Run a task's body; (its value, what its observers saw: ``[]`` without observers)."""
        match body:
            case wire.RunCell(source=source, filename=filename):
                return self._run_cell(source, filename), []
            case wire.RunScript():
                return self._run_script(body, run_id)
            case wire.Reinit(port=port):
                import torch.distributed as dist

                if dist.is_initialized():  # only some ranks lost it: start from a clean slate
                    dist.destroy_process_group()
                return self.group.init(port), []
            case wire.RunFunction(fn=fn, args=args, kwargs=kwargs, observers=observers):
                with observing(observers) as observed:
                    value = fn(*args, **kwargs)
                return value, observed
            case other:  # goes back to the kernel as the call's error
                raise TypeError(f"a rank runs RunFunction, RunCell, RunScript or Reinit, not {other!r}")

    def _run_cell(self, source: str, filename: str):
        """Run a %%ranks cell; return the value of its last line if that is an expression."""
        import ast

        tree = ast.parse(source, filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), self.namespace)
        if last is not None:
            return eval(compile(last, filename, "eval"), self.namespace)
        return None

    def _run_script(self, script: wire.RunScript, run_id: int) -> tuple[int, list]:
        """Run ``script.source`` as the ``__main__`` module ``script.path``, as torchrun would;
        its exit code and what the observers saw. Once the script has ended, the kernel hears
        how (``wire.ScriptEnded``) before the rank joins the pool's group again: that waits for
        every rank, and a peer still inside its script may wait for this one in vain."""
        with observing(script.observers) as observed:
            try:
                code = self._exec_script(script)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 -- told now, raised again for the reply
                self._script_ended(_raised(run_id, self._after(destroyed=True), exc))
                raise
            else:
                ended = wire.Finished if code == 0 else wire.Exited
                args = (0, []) if code == 0 else (code, [])
                self._script_ended(ended(run_id, self._after(destroyed=True), *args))
            finally:
                self.group.rejoin(script.reinit_port)
        return code, observed

    def _script_ended(self, reply: wire.Reply) -> None:
        try:
            self.send_control(wire.ScriptEnded(reply.run_id, reply))
        except Exception:  # noqa: BLE001 -- what cannot travel is said by the final reply
            pass

    def _exec_script(self, script: wire.RunScript) -> int:
        """The script's code, run as a new process runs it (see ``fresh``), to its end: its exit
        code; an exception it raised is raised."""
        import types

        path = script.path
        code = compile(script.source, path, "exec")
        main = types.ModuleType("__main__")  # what `python path` makes: pickle finds its classes
        main.__file__, main.__builtins__ = path, __builtins__
        saved_main, sys.modules["__main__"] = sys.modules["__main__"], main
        global _script_pid
        _script_pid = os.getpid()
        try:  # os._exit: under torchrun it ends the process; here it ends the script
            with patched(os, _exit=_script_exit), script_imports(path), \
                    self.group.script(path, script.argv, script.port, script.env), \
                    fresh.fresh_process(self.kernel_cwd, self.spec.get("seed"), self.rank, self.say):
                try:
                    _exec_main(code, main.__dict__)
                except SystemExit as exc:
                    return _exit_code(exc)
        finally:
            sys.modules["__main__"] = saved_main
            self.say("")
            _tear_down(main)
            self._stop_what_the_script_left()
            self.output.drain()
        return 0

    def _stop_what_the_script_left(self) -> None:
        """A script's process ends what it started (or leaves it to init); this rank lives on,
        so it stops the script's processes itself, and the kernel says so (see ``reaper``)."""
        try:
            self.left = stop_descendants()
        except Exception:  # noqa: BLE001 -- the launcher's sweep still finds them
            self.left = []


@contextlib.contextmanager
def observing(observers: list):
    """Run the body inside every observer (the first outermost); the list yielded is filled,
    after the body, with each observer's ``result()``."""
    observed: list = []
    with contextlib.ExitStack() as stack:
        for observer in observers:
            stack.enter_context(observer)
        yield observed
    observed.extend(observer.result() for observer in observers)


_script_pid = None  # the rank running a script: its os._exit ends the script, not the process


def _script_exit(code: int) -> None:
    """``os._exit`` while a script runs on a rank: the script ends with ``code``, as its process
    would under torchrun, and the rank lives on for the next call. In a process the script
    forked (a ``multiprocessing`` child ends with ``os._exit``) it is the real one."""
    if os.getpid() != _script_pid:
        _exit(code)
    raise SystemExit(int(code))


def _exec_main(code, namespace: dict) -> None:
    """Run a script's code. A process the script forked (``os.fork()``) that returns from it or
    calls ``sys.exit`` ends here, as it would under ``python``; it must not go on as a rank."""
    try:
        exec(code, namespace)
    except SystemExit as exc:
        if os.getpid() != _script_pid:
            _leave_forked_child(_exit_code(exc))
        raise
    except BaseException:
        if os.getpid() != _script_pid:
            traceback.print_exc()
            _leave_forked_child(1)
        raise
    if os.getpid() != _script_pid:
        _leave_forked_child(0)


def _leave_forked_child(status: int) -> None:
    """End a process the script forked (``os.fork()``) that returned from the script or called
    ``sys.exit``: under ``python`` it would exit there; here it must not go on as a rank."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    _exit(status)


def _exit_code(exc: SystemExit) -> int:
    """What the process's exit status would be for ``sys.exit(exc.code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # sys.exit("message") prints it and exits with 1
    return 1


OOM_SCORE_FILE = "/proc/self/oom_score_adj"


def prefer_oom_kill() -> bool:
    """Ask Linux's out-of-memory killer to pick this rank before anything else; False where
    the platform has no such preference (macOS, Windows): a kill hint then says so."""
    try:
        with open(OOM_SCORE_FILE, "w") as f:
            f.write(str(OOM_SCORE_ADJ))
        return True
    except OSError:
        return False


_POOL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # all of pool/


def _is_pool_code(filename: str) -> bool:
    return filename.startswith(_POOL_DIR) or filename == "<string>"


def _learner_traceback(exc: BaseException) -> str:
    """The exception's traceback without the pool's frames (above and below the learner's)."""
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    seen, todo = set(), [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        t.stack = traceback.StackSummary.from_list(
            [f for f in t.stack if not _is_pool_code(f.filename)])
        todo += [c for c in (t.__cause__, t.__context__) if c is not None]
    return "".join(te.format())


def _tear_down(module) -> None:
    """What a process's end does to its ``__main__``: the script's objects are let go of, and
    what they own ends as they are freed (a DataLoader's persistent workers, say), not as
    leftovers the rank must stop."""
    import gc

    module.__dict__.clear()
    gc.collect()


def _raised(run_id: int, after: wire.After, exc: BaseException) -> wire.Raised:
    """The reply for an exception: one line, the learner's traceback, the exception if it travels."""
    tb = _learner_traceback(exc)
    summary = traceback.format_exception_only(type(exc), exc)[-1].strip()
    try:
        wire.dumps(exc)
    except Exception:
        exc = None
    return wire.Raised(run_id, after, summary, tb, exc)


def _user_stack(stack: str) -> str:
    """Drop the pool's own frames from a formatted stack, keeping the learner's code."""
    blocks = stack.split('  File "')
    keep = [b for b in blocks[1:] if not _is_pool_code(b.split('"', 1)[0])]
    return "".join('  File "' + b for b in keep)


def spawned_main() -> None:
    """Entry point of a spawned rank (``start_method="spawn"``). Its stdin is a socket to the
    launcher, which sends ``wire.ImportNow`` -- a spare's turn to import torch, in a thread of its
    nice value so that the cluster's calls come first -- or ``wire.Spec`` when the rank is needed
    (it then imports at once, if it has not yet). Either way it says ``Imported`` to the kernel
    and ``SpareImported`` to the launcher when torch is in."""
    rank, task_fd, control_fd, launcher_pid, out_r, err_r, out_w, err_w = map(int, sys.argv[1:9])
    set_death_signal(launcher_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until it runs calls (setup installs its own)
    launcher = Connection(0)
    task = Connection(task_fd)
    msg = _from_launcher(launcher)
    _import_torch(msg.nice if isinstance(msg, wire.ImportNow) else None)  # errors show on stderr
    try:
        task.send(wire.Imported(rank=rank))  # for the kernel: a warm spare, a restart takes no import
        launcher.send(wire.SpareImported())  # for the launcher: the next spare may start importing
    except OSError:
        _exit(0)  # the kernel or the launcher is gone
    if isinstance(msg, wire.ImportNow):
        msg = _from_launcher(launcher)
    launcher.close()
    null = os.open(os.devnull, os.O_RDONLY)  # stdin reads as empty, as for a forked rank
    if null != 0:
        os.dup2(null, 0)
        os.close(null)
    _output_to(out_w, err_w)
    main(wire.loads(msg.spec), rank, task, control_fd, launcher_pid, (out_r, err_r))


def _output_to(out_w: int, err_w: int) -> None:
    """fds 1 and 2 write into the pipes the launcher made (see ``forwarder``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.close(out_w)
    os.close(err_w)


def _from_launcher(launcher: Connection):
    try:
        return launcher.recv()
    except (EOFError, OSError):  # the launcher is gone, or the spare was never needed
        _exit(0)


def _import_torch(nice: int | None) -> None:
    """Import what every rank needs; with ``nice``, in a thread of that nice value (Linux: a nice
    value belongs to one thread, so the rank keeps its own priority; elsewhere it is ignored)."""
    def load():
        if nice is not None and sys.platform.startswith("linux"):
            try:
                os.setpriority(os.PRIO_PROCESS, 0, nice)  # 0: this thread
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # see launcher.LOW_PRIORITY
            except OSError:
                pass
        import cloudpickle  # noqa: F401
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401

    if nice is None:
        return load()
    # numpy first, at normal priority: OpenBLAS starts its worker threads as numpy loads, and a
    # thread inherits its creator's nice value -- BLAS workers left at low priority stall every
    # numpy matmul of the rank once other work competes for the cores
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    failed = []

    def run():
        try:
            load()
        except BaseException as exc:  # noqa: BLE001 -- raised again in the main thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="dpcourse-import", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def main(spec: dict, rank: int, task, control_fd: int, launcher_pid: int,
         output_fds: tuple[int, int] | None = None) -> None:
    """Entry point in the forked (or spawned) child; never returns. ``task``: the task
    socket's descriptor, or its Connection; ``output_fds``: the read ends of the pipes fds 1
    and 2 write to (see ``forwarder``)."""
    code = 0
    try:
        own_group()  # what the rank starts joins its process group (see reaper)
        set_death_signal(launcher_pid)
        task = task if isinstance(task, Connection) else Connection(task)
        control = Connection(control_fd)
        worker = Rank(spec, rank, task, control, output_fds)
        try:
            worker.setup()
        except BaseException as exc:  # noqa: BLE001
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            try:
                worker.output.drain(0.5)
            except Exception:
                pass
            task.send(wire.InitError(rank, text))
            _exit(3)
        task.send(wire.Ready(rank, os.getpid(), worker.oom_first))
        worker.serve()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 4
    _exit(code)

