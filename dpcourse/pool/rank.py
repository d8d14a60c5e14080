"""The rank process: one persistent worker that runs the kernel's calls under torch.distributed.

Forked from the launcher (never from the kernel), it sets up what torchrun would (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), initialises the process group once, and then
loops: receive a call on the task socket, run it, send back the result or the traceback.
A control thread answers "where are you?" (Python stack + collective in progress) while the
main thread is busy or blocked, and an output thread forwards everything written to file
descriptors 1 and 2 -- Python prints, C++ warnings, progress bars -- to the kernel live.
"""
from __future__ import annotations

import codecs
import datetime
import faulthandler
import fcntl
import io
import linecache
import os
import selectors
import signal
import struct
import sys
import termios
import threading
import time
import traceback
from multiprocessing.connection import Connection

from . import wire
from .tracker import CollectiveTracker

# The process group's own timeout. The pool enforces the learner's timeout itself and
# kills stuck ranks; Gloo's default (30 min) would only get in the way.
PG_TIMEOUT = datetime.timedelta(days=1)


def set_death_signal(expected_parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != expected_parent:  # the parent died before the signal was armed
        os._exit(1)


class OutputForwarder:
    """Redirects fds 1 and 2 into pipes and forwards what arrives to the kernel."""

    def __init__(self, send):
        self._send = send
        self._busy = threading.Lock()  # held from reading a chunk until it is sent
        self._fds = {}
        for stream, fd in (("stdout", 1), ("stderr", 2)):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            self._fds[r] = (stream, codecs.getincrementaldecoder("utf-8")("replace"))
        # Unbuffered text streams: a print() or a "\r" progress update reaches the pipe at once.
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", write_through=True)
        threading.Thread(target=self._pump, name="dpcourse-output", daemon=True).start()

    def _pump(self):
        sel = selectors.DefaultSelector()
        for r in self._fds:
            sel.register(r, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                with self._busy:
                    data = os.read(key.fd, 65536)
                    stream, decoder = self._fds[key.fd]
                    text = decoder.decode(data)
                    if text:
                        self._send(("out", stream, text))

    def _pending(self) -> int:
        total = 0
        for r in self._fds:
            total += struct.unpack("i", fcntl.ioctl(r, termios.FIONREAD, b"\0\0\0\0"))[0]
        return total

    def drain(self, limit: float = 2.0) -> None:
        """Return once everything written so far has been sent to the kernel."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self._pending() == 0:
                with self._busy:  # a chunk already read is sent before we get the lock
                    pass
                if self._pending() == 0:
                    return
            time.sleep(0.0005)


class Rank:
    def __init__(self, spec: dict, rank: int, task: Connection, control: Connection):
        self.spec, self.rank = spec, rank
        self.task, self.control = task, control
        self._send_lock = threading.Lock()
        self.tracker = CollectiveTracker()
        self.running = False
        self.namespace: dict = {}  # where %%ranks cells run; persists between cells
        self.main_ident = threading.get_ident()

    # --- set-up -------------------------------------------------------------------
    def setup(self) -> None:
        spec, rank = self.spec, self.rank
        os.environ.update(spec["env"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                          WORLD_SIZE=str(spec["world_size"]),
                          LOCAL_WORLD_SIZE=str(spec["world_size"]),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
        try:
            os.chdir(spec["cwd"])
        except OSError:
            pass
        sys.path[:] = spec["sys_path"]
        self.output = OutputForwarder(self.send_control)
        # A segfault kills the output thread with the process; faulthandler's file survives,
        # and the kernel shows it in the RankDied report.
        self._crash_file = open(spec["crash_log"].format(rank=rank), "w")
        faulthandler.enable(self._crash_file, all_threads=False)
        signal.signal(signal.SIGINT, self._on_sigint)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec["num_threads"])
        if spec["backend"] == "nccl":
            torch.cuda.set_device(rank)
            device_id = torch.device("cuda", rank)
        else:
            device_id = None
        dist.init_process_group(spec["backend"], init_method="env://", rank=rank,
                                world_size=spec["world_size"], timeout=PG_TIMEOUT,
                                device_id=device_id)
        self.tracker.install()
        device = device_id if device_id is not None else torch.device("cpu")
        self.namespace.update(torch=torch, dist=dist, rank=rank,
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
                os._exit(0)  # the kernel is gone

    def _serve_control(self) -> None:
        while True:
            try:
                msg = self.control.recv()
            except (EOFError, OSError):
                os._exit(0)  # the kernel died: never outlive it
            if msg[0] == "status":
                self.send_control(("status", self.status()))

    def status(self) -> dict:
        frame = sys._current_frames().get(self.main_ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        return {"running": self.running, "collective": self.tracker.describe(),
                "stack": _user_stack(stack)}

    # --- the loop --------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            try:
                data = self.task.recv_bytes()
            except (EOFError, OSError):
                os._exit(0)
            kind, run_id, payload = wire.loads(data)
            reply = self.execute(kind, run_id, payload)
            self.output.drain()
            try:
                out = wire.dumps(reply)
            except Exception as err:
                out = wire.dumps(("raised", run_id,
                                  f"could not send the result back: {type(err).__name__}: {err}",
                                  f"the value returned on rank {self.rank} cannot be pickled "
                                  f"({type(reply[2]).__name__}); return plain Python objects "
                                  "or tensors instead.\n", None))
            self.task.send_bytes(out)

    def execute(self, kind: str, run_id: int, payload: bytes):
        try:
            sources, call = payload
            linecache.cache.update(sources)
            call = wire.loads(call)
            self.running = True
            try:
                if kind == "cell":
                    value = self._run_cell(*call)
                else:
                    fn, args, kwargs = call
                    value = fn(*args, **kwargs)
            finally:
                self.running = False
            return ("ok", run_id, value)
        except KeyboardInterrupt:
            return ("interrupted", run_id)
        except BaseException as exc:  # noqa: BLE001 -- everything goes back to the kernel
            tb = exc.__traceback__
            while tb is not None and _is_pool_code(tb.tb_frame.f_code.co_filename):
                tb = tb.tb_next  # the learner's code starts below the pool's frames
            tb = "".join(traceback.format_exception(type(exc), exc, tb))
            summary = traceback.format_exception_only(type(exc), exc)[-1].strip()
            try:
                wire.dumps(exc)
            except Exception:
                exc = None
            return ("raised", run_id, summary, tb, exc)

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


_POOL_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _is_pool_code(filename: str) -> bool:
    return filename.startswith(_POOL_DIR) or filename == "<string>"


def _user_stack(stack: str) -> str:
    """Drop the pool's own frames from a formatted stack, keeping the learner's code."""
    blocks = stack.split('  File "')
    keep = [b for b in blocks[1:] if not _is_pool_code(b.split('"', 1)[0])]
    return "".join('  File "' + b for b in keep)


def main(spec: dict, rank: int, task_fd: int, control_fd: int, launcher_pid: int) -> None:
    """Entry point in the forked child; never returns."""
    code = 0
    try:
        set_death_signal(launcher_pid)
        task, control = Connection(task_fd), Connection(control_fd)
        worker = Rank(spec, rank, task, control)
        try:
            worker.setup()
        except BaseException as exc:  # noqa: BLE001
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            try:
                worker.output.drain(0.5)
            except Exception:
                pass
            task.send(("init_error", rank, text))
            os._exit(3)
        task.send(("ready", rank, os.getpid()))
        worker.serve()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 4
    os._exit(code)

