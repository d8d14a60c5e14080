"""``Cluster``: persistent torch.distributed ranks that run the notebook's functions.

    cluster = dpc.Cluster(world_size=4)            # gloo on CPU, nccl with >= 4 GPUs
    dpc.Cluster(4, start_method="spawn")           # fresh interpreters (the default off Linux)
    cluster.run(fn, *args, timeout=60, **kwargs)   # -> [result of rank 0, rank 1, ...]
    cluster.run(fn, observe=[meter])               # fn runs inside the observers, on every rank
    cluster.shutdown()                             # or: with dpc.Cluster(4) as cluster: ...

What the kernel can rely on: results ordered by rank; every rank's output shown live,
labelled; an exception on any rank raised here as RankError within a second, even while
the others wait in a collective (they are killed and restarted, not left to Gloo's
timeout); a hang reported as RankTimeout with where each rank is stuck; the stop button
stops the ranks; and no rank outlives the kernel.

Runs in the kernel, as does everything the cluster's calls go through (``call``, ``link``,
``health``); the launcher and the ranks are other processes (see the package's docstring).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import weakref

from ...backends import BackendError, choose_backend
from . import health
from .. import wire
from .call import Call, Outcome
from ..errors import ClusterError, ClusterShutDown, interrupted
from .link import RankLink
from .printer import RankPrinter, StartProgress
from ...processes import free_ports
from .procs import Generation, LauncherProcess, MemoryWatch, check_port, readable
from .traffic import in_flight

_DEFAULT = object()
_current: weakref.ref | None = None


def current_cluster(closed: bool = False) -> "Cluster | None":
    """The most recently started cluster that is still open (used by %%ranks); ``closed=True``:
    also one that was shut down since (so %%ranks can say how to start it again)."""
    cluster = _current() if _current else None
    return cluster if cluster is not None and (closed or not cluster.closed) else None


def _kernel_cwd() -> str:
    """The kernel's working folder ('' when it was deleted: the ranks stay where they are)."""
    try:
        return os.getcwd()
    except OSError:
        return ""


def _close(launcher: LauncherProcess, crash_dir: str) -> None:
    launcher.close()
    shutil.rmtree(crash_dir, ignore_errors=True)


def _observers(observe) -> list:
    """``observe`` as a list, each item checked for the observer protocol (see ``Cluster.run``)."""
    observers = [observe] if hasattr(observe, "collect") else list(observe or ())
    for observer in observers:
        missing = [m for m in ("__enter__", "__exit__", "result", "collect") if not hasattr(observer, m)]
        if missing:
            raise TypeError(f"observe= takes observers such as dpc.observe.Comm(); {observer!r} has no "
                            + ", ".join(missing))
    return observers


START_METHODS = ("fork", "spawn")
# Spawned ranks: generations kept ready for restarts. Two, so that a second failure right after
# a first finds one that has imported torch (an import takes seconds); each costs world_size
# idle interpreters (~150 MiB each with torch imported).
SPARE_GENERATIONS = 2


def choose_start_method(start_method: str | None) -> str:
    """``start_method``, else ``$DPCOURSE_START_METHOD``, else fork where it is safe (Linux)."""
    import socket

    chosen = start_method or os.environ.get("DPCOURSE_START_METHOD") or (
        "fork" if sys.platform.startswith("linux") else "spawn")
    if chosen not in START_METHODS:
        where = "start_method" if start_method else "DPCOURSE_START_METHOD"
        raise ClusterError(f"{where}={chosen!r}: choose 'fork' (Linux) or 'spawn' (a fresh interpreter "
                           "per rank; the default elsewhere)")
    if not hasattr(socket, "send_fds"):
        raise ClusterError("the ranks need socket.send_fds to receive their sockets, which this platform "
                           "lacks (native Windows): run the course in WSL, which is Linux")
    if chosen == "fork" and not hasattr(os, "fork"):
        raise ClusterError("this platform cannot fork; use start_method='spawn'")
    return chosen


def resolve_backend(backend: str, world_size: int) -> str:
    """The backend for this machine (``backends.choose_backend``); ClusterError if it cannot serve."""
    try:
        return choose_backend(backend, world_size)
    except BackendError as err:
        raise ClusterError(str(err)) from None


class Cluster:
    """A pool of ``world_size`` persistent ranks with an initialised process group."""

    def __init__(self, world_size: int = 2, backend: str = "auto", *, timeout: float | None = 300.0,
                 num_threads: int | None = None, master_port: int | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 120.0,
                 start_method: str | None = None, find_deadlocks: bool = True, seed: int | None = None,
                 current: bool = True):
        global _current
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ClusterError(f"world_size must be a whole number >= 1, not {world_size!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ClusterError(f"seed must be None (each rank draws its own random numbers) or a whole "
                               f"number >= 0 (rank r starts from seed + r), not {seed!r}")
        self.world_size = world_size
        # each rank's random streams: None, from fresh entropy (as separate processes); else seed + rank
        self.seed = seed
        self.start_method = choose_start_method(start_method)
        self.backend = resolve_backend(backend, world_size)
        if master_port is not None:
            check_port(master_port)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.num_threads = num_threads or max(1, (cores or 1) // world_size)
        self.default_timeout = timeout
        # certain deadlocks raise RankDeadlock in seconds (see deadlock); False: only the timeout,
        # e.g. to look at hung ranks from outside (py-spy) while a call waits
        self.find_deadlocks = find_deadlocks
        self._master_port, self._env = master_port, dict(env or {})
        self._start_timeout = start_timeout
        self._printer = RankPrinter(world_size)
        self._sent_sources: set[str] = set()
        self._sent_env: dict = {}  # the environment the ranks last saw from the kernel
        self._run_id = 0
        self._gen: Generation | None = None
        self._group_lost: set[int] = set()  # ranks whose process group rank code destroyed
        self._carried: dict = {}  # traffic of earlier calls still in flight (see traffic)
        self._health = health.Record()  # what cluster.status() says of the calls
        self._memory = MemoryWatch()
        self._shows_start = current  # a checker's own cluster starts without a progress line
        self._open()
        if current:  # a checker's own cluster (current=False) never becomes the one %%ranks uses
            _current = weakref.ref(self)

    def _open(self) -> None:
        """Start the launcher and the ranks (at creation, and again after ``shutdown``)."""
        self.closed = False
        self._gen = None
        self._crash_dir = tempfile.mkdtemp(prefix="dpcourse-")
        self._spares: list[Generation] = []  # spawn: the next generations, oldest (warmest) first
        self._progress = StartProgress(self.world_size, self.backend, self._shows_start)
        try:
            self._launcher = LauncherProcess(self._start_timeout, self.start_method)
        except BaseException:
            self._progress.done(False)
            raise
        self._progress.launcher_ready()
        self._link = RankLink(self._launcher, self._printer, self._memory, self._crash_dir)
        self._finalizer = weakref.finalize(self, _close, self._launcher, self._crash_dir)
        try:
            self._start_ranks()
        except BaseException:
            self._progress.done(False)
            self.shutdown()
            raise
        self._progress.done(True)
        self._progress = None  # restarts after a failure take ~0.3 s: they show no progress

    # --- public surface ------------------------------------------------------------
    def status(self) -> health.ClusterStatus:
        """A snapshot of the ranks (pid, device, idle/busy/dead) and the calls, without a call
        to the ranks: it answers while they are busy, after a failure and after ``shutdown``."""
        return health.status(self._health, self.backend, self.world_size, self._gen,
                             self._launcher, self.closed)

    @property
    def pids(self) -> list[int]:
        """Process IDs of the current ranks, by rank."""
        return list(self._gen.pids) if self._gen else []

    @property
    def launcher_pid(self) -> int:
        return self._launcher.pid

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pids={self.pids}"
        return (f"Cluster(world_size={self.world_size}, backend={self.backend!r}, "
                f"start_method={self.start_method!r}, {state})")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def run(self, fn, *args, timeout=_DEFAULT, observe=(), **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank.

        timeout: seconds (None: no limit; default: the cluster's ``timeout``).
        observe: observers (``dpc.observe``) that watch the call from outside, so ``fn`` stays
        what it would be under torchrun. On each rank ``fn`` runs inside ``with observer:``
        (the first one outermost); each rank's ``observer.result()`` comes back, and the
        kernel's observer receives them all, ordered by rank, in ``observer.collect(results)``.
        """
        __tracebackhide__ = True  # IPython: show the ranks' error, not the pool's frames
        if not callable(fn):
            raise TypeError(f"run() needs a function to call on the ranks, got {type(fn).__name__}")
        self._check_open()
        observers = _observers(observe)
        return self._call(wire.dumps_call(fn, args, kwargs, observers), timeout, observers)

    def run_cell(self, source: str, timeout=_DEFAULT) -> list:
        """Run Python source on every rank in a namespace kept per rank (what %%ranks does).

        Returns the value of the cell's last line on each rank, if it is an expression.
        """
        __tracebackhide__ = True  # IPython: show the ranks' error, not the pool's frames
        self._check_open()
        filename = f"<ranks-cell-{self._run_id + 1}>"
        import linecache

        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        return self._call(wire.dumps(wire.RunCell(source, filename)), timeout)

    def run_script(self, path, *argv, timeout=_DEFAULT, observe=()) -> list[int]:
        """Run the Python file ``path`` on every rank as ``torchrun`` would; exit codes by rank.

        The file runs as ``__main__`` with ``sys.argv == [path, *argv]``, torchrun's
        environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
        MASTER_PORT on a fresh port, TORCHELASTIC_RUN_ID, ...) and *no* process group: the
        script calls ``init_process_group`` and ``destroy_process_group`` itself, so the
        same file runs unchanged under torchrun. Afterwards the cluster's own group is back.
        A rank that raises, or exits with a non-zero code (``sys.exit(3)``, ``os._exit(3)``: the
        script ends, the rank stays), raises RankError.
        observe: observers around the whole script, as in ``run``.
        """
        __tracebackhide__ = True
        path = os.path.abspath(os.fspath(path))
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError as err:
            raise ClusterError(f"cannot read the script {path!r}: {err.strerror}") from None
        return self._script(path, source, argv, timeout, observe)

    def run_script_source(self, source: str, *argv, timeout=_DEFAULT, observe=()) -> list[int]:
        """``run_script`` for source text (what ``%%ranks --script`` does with a cell)."""
        __tracebackhide__ = True
        filename = f"<ranks-script-{self._run_id + 1}>"
        import linecache

        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        return self._script(filename, source, argv, timeout, observe)

    def _script(self, path: str, source: str, argv: tuple, timeout, observe) -> list[int]:
        __tracebackhide__ = True
        self._check_open()
        observers = _observers(observe)
        port, reinit_port = free_ports(2)
        self._drop_in_flight("the script replaces the cluster's process group")
        script = wire.RunScript(path, source, [str(a) for a in argv], port, reinit_port, observers,
                                self._kernel_env())
        try:
            return self._call(wire.dumps(script), timeout, observers)
        finally:
            if self._gen is not None and self._gen.ready and not self.closed:
                # the ranks stopped their scripts' processes; the launcher stops any that left
                # the ranks' process groups (a daemon's double fork): see reaper
                try:
                    self._launcher.sweep(self._gen)
                except ClusterError:
                    pass

    def restart(self) -> None:
        """Kill the ranks and start fresh ones (new process group, empty rank namespaces); after
        ``shutdown``, start the cluster again, as ``Cluster(...)`` with the same settings would."""
        if self.closed:
            self._open()
            return
        self._restart()
        self._wait_ready()

    def shutdown(self) -> None:
        """Stop the ranks and the launcher. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self._printer.flush()
        for gen in [self._gen, *self._spares]:
            if gen is not None:
                gen.close()
        self._gen, self._spares = None, []
        self._finalizer()  # tells the launcher to kill its ranks and exit; waits for it

    # --- starting ranks ------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise ClusterShutDown(f"this cluster was shut down (a notebook's last cell does that): "
                                  f"cluster.restart() starts its {self.world_size} ranks again")

    def _spec(self, port: int, number: int) -> dict:
        return {"world_size": self.world_size, "backend": self.backend, "port": port,
                "cwd": _kernel_cwd(), "sys_path": list(sys.path), "seed": self.seed,
                "env": self._kernel_env(), "num_threads": self.num_threads,
                "crash_log": os.path.join(self._crash_dir, f"generation{number}-rank{{rank}}.log")}

    def _kernel_env(self) -> dict:
        """The environment a process started from the kernel now would have (with ``env=``)."""
        return {**os.environ, **self._env}

    def _start_ranks(self, attempts: int = 3) -> None:
        for attempt in range(attempts):
            self._restart(kill=False)
            try:
                return self._wait_ready()
            except ClusterError as err:
                port_taken = "address already in use" in str(err).lower()
                if not port_taken or self._master_port is not None or attempt == attempts - 1:
                    raise

    def _restart(self, kill: bool = True) -> None:
        """Kill the current generation (if any) and ask for a new one; do not wait for it."""
        if kill and self._gen is not None:
            self._launcher.kill(self._gen)
        number = self._gen.number + 1 if self._gen else 0
        self._gen = None
        self._sent_sources.clear()
        self._group_lost.clear()
        self._carried = {}
        self._sent_env = {}
        self._link.oom_first = True
        port = self._master_port or free_ports(1)[0]
        spec = self._spec(port, number)
        self._sent_env = spec["env"]
        if self.start_method == "fork":
            self._gen = self._launcher.spawn(spec, number)
            return
        spare = None
        while self._spares and spare is None:  # the oldest spare is the furthest along
            spare = self._spares.pop(0)
            if not self._launcher.alive(spare):
                self._launcher.kill(spare)
                spare = None
        if spare is None:
            spare = self._launcher.spawn(spec, number)
        self._gen = self._launcher.activate(spare, spec, number)

    def _wait_ready(self) -> None:
        gen = self._gen
        waiting, errors = set(range(self.world_size)), {}
        deadline = time.monotonic() + self._start_timeout
        while waiting and time.monotonic() < deadline:
            for rank, msg in self._link.poll(gen, waiting, 0.1):
                match msg:
                    case wire.Imported():  # a spawned rank, on its way
                        continue
                    case None:
                        errors[rank] = f"rank {rank} {self._link.exit_text(gen, rank)} while starting"
                    case wire.InitError(text=text):
                        errors[rank] = f"rank {rank} failed to start:\n{text}"
                    case wire.Ready(oom_first=oom_first):
                        self._link.oom_first = self._link.oom_first and oom_first
                        if self._progress is not None:
                            self._progress.rank_ready(rank)
                    case other:  # the rank and the kernel disagree on how a rank starts
                        errors[rank] = f"rank {rank} said {other!r} while starting, not Ready or InitError"
                waiting.discard(rank)
        self._printer.flush()
        if waiting or errors:
            self._launcher.kill(gen)
            self._gen = None
            late = [f"rank {r} did not start within {self._start_timeout:g} s" for r in sorted(waiting)]
            raise ClusterError("the ranks could not be started:\n" + "\n".join(late + list(errors.values())))
        gen.ready = True
        while self.start_method == "spawn" and len(self._spares) < SPARE_GENERATIONS:
            # the next generations import torch now (one after the other, at low priority), so
            # neither a restart nor the one right after it waits for an import
            self._spares.append(self._launcher.spawn(self._spec(0, -1), -1, spare=True))

    def _ensure_ready(self) -> None:
        """Before a call: notice ranks that died while idle, restart them, finish a restart."""
        if self._gen is None:
            self._restart(kill=False)
        elif self._gen.ready:
            while self._launcher.conn.poll(0):
                self._launcher.poll_one()
            dead = [r for r, c in enumerate(self._gen.task)
                    if readable([c], 0) or self._gen.pids[r] in self._launcher.exited]
            if dead:
                texts = [f"rank {r} {self._link.exit_text(self._gen, r)}" for r in dead]
                print(f"dpcourse: {'; '.join(texts)} since the last call; restarting the ranks.",
                      file=sys.stderr)
                self._restart()
        if not self._gen.ready:
            self._wait_ready()
        if self._group_lost:
            self._restore_group()

    def _restore_group(self) -> None:
        """Rank code destroyed the default process group: every rank joins a fresh one."""
        lost = sorted(self._group_lost)
        self._group_lost.clear()
        self._drop_in_flight("the process group they were in is gone")
        which = "every rank" if len(lost) == self.world_size else "rank " + ", ".join(map(str, lost))
        try:
            self._call(wire.dumps(wire.Reinit(free_ports(1)[0])), 60.0)
        except ClusterError as err:
            print(f"dpcourse: rank code destroyed the process group on {which}, and joining a new "
                  f"one failed ({type(err).__name__}); restarting the ranks.", file=sys.stderr)
            self._restart()
            self._wait_ready()
            return
        print(f"dpcourse: rank code destroyed the process group on {which}; the cluster "
              "re-initialised it (destroy_process_group belongs in scripts: cluster.run_script).",
              file=sys.stderr)

    def _drop_in_flight(self, why: str) -> None:
        """Forget what earlier calls left in flight, which can no longer reach anything (``why``)."""
        if self._carried:
            left = in_flight(self._carried)
            if left:
                print(f"dpcourse: {why}, so what earlier calls left in flight is dropped: {'; '.join(left)}.",
                      file=sys.stderr)
            self._carried = {}

    def _call(self, body: bytes, timeout, observers=()):
        """Run the pickled task ``body`` (a ``wire.RunFunction``, ``RunCell``, ...) on every rank:
        the results by rank, after each observer has collected what the ranks saw."""
        __tracebackhide__ = True
        timeout = self.default_timeout if timeout is _DEFAULT else timeout
        try:
            self._ensure_ready()
        except KeyboardInterrupt:
            raise interrupted("interrupted while the ranks were starting; the next call waits "
                              "for them.") from None
        self._run_id += 1
        sources = wire.notebook_sources(self._sent_sources)
        env = self._kernel_env()
        changed = env if env != self._sent_env else None
        message = wire.dumps(wire.Task(self._run_id, sources, body, _kernel_cwd(), changed))
        self._sent_sources.update(sources)
        self._sent_env = env
        self._health.start()
        error = None
        try:
            call = Call(self._gen, self._link, timeout, self._carried, self.find_deadlocks)
            outcome = call.run(message)
            error = self._apply(outcome)
        except BaseException as err:  # noqa: BLE001 -- noted for status(), raised again
            error = err
        self._health.end(error)
        if error is not None:
            raise error
        for i, observer in enumerate(observers):
            observer.collect([seen[i] for seen in outcome.observed])
        return outcome.results

    def _apply(self, outcome: Outcome) -> BaseException | None:
        """Take in what a call changed (see ``call.Outcome``); the error to raise, if any."""
        self._group_lost |= outcome.group_lost
        self._carried = outcome.carried
        if outcome.restart:
            try:
                self._restart()
            except KeyboardInterrupt:
                return interrupted("interrupted while the ranks were restarting; the next call "
                                   "waits for them.")
        for note in outcome.notes:
            print(note, file=sys.stderr)
        return outcome.error
