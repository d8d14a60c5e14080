"""What a rank issued and what it waits in, so a hang reads "waiting in the 3rd all_reduce of this
call" and a deadlock is decided from recorded waits, never guessed.

Runs on the ranks. Every collective -- ``dist.all_reduce`` from the learner's code, DDP's C++
reducer, FSDP's all-gathers, DTensor's functional collectives -- ends in a ``torch.ops.c10d``
operator. The tracker registers a thin kernel for those operators at the ``BackendSelect``
dispatch key, which every call passes just above the backend's own kernel, whatever its
tensors (one made under ``torch.inference_mode()`` has no autograd key) and whoever calls it
(C++ included): it notes the call and its ``Work``, then hands the operator on to the backend.
Only collectives pass through Python; other operators never see it (a ``TorchDispatchMode``
would see them all and made a small training step ~3x slower here), and a collective traced
under a fake mode (``torch.compile``) never reaches it.

Point-to-point calls (``send``, ``recv``, ``isend``, ``irecv``) are counted at the Python
functions instead: a ring calls them by the hundred, and a Python kernel in the dispatcher
tripled the time of a small isend/irecv pair here (1.0 ms against 0.4 ms), while a plain
wrapper costs microseconds.

**What the rank waits in is recorded, not inferred.** The main thread is *blocked in* an
operation while it is inside a blocking ``send``/``recv`` call, after a synchronous collective
it issued (``async_op=False`` is an operator argument: the caller waits for it) until that one
completes, or inside ``Work.wait()`` on the ``Work`` of an asynchronous operation the learner's
own code issued (the tracker holds that ``Work`` until it completes, so ``wait()`` is told which
one it is by identity; PyTorch's own asynchronous ones, DDP's and FSDP's, are not held, so no
tensor of theirs lives a moment longer). A wait on anything else -- a ``Work`` of an earlier
call or of PyTorch's, a ``torch.futures.Future``, ``time.sleep`` -- is no communication the
tracker can follow, and decides nothing.

The point-to-point wrappers are rebound for a rank's life (what a thread of the learner's sends
between two calls counts too; elsewhere, for one ``calls()``), and ``Work.wait`` for the rest of
a call once the learner's code issued an asynchronous operation in it (so a stack dump of a
rank waiting in a plain ``dist.all_reduce`` shows PyTorch's frames only); nothing public sees
either before it reaches the backend. Both are rebound through ``patching.patched``, which puts
back what it found. A wrapper is recognised by a marker attribute, so a nested install is a
no-op. (The pool's rank guards ``init_process_group``/``destroy_process_group`` besides, and the
exercise checkers patch more, each for one check.)

Every call also keeps its *traffic*: the messages each rank sent and received, by group and
peer, and the collectives it issued, by group (``traffic()``, a ``records.Traffic``), each group
named by a ``records.Group`` (its ranks, whether it is the default group, its name). The pool's
kernel adds them up over the ranks and over the calls since the ranks started: a message no
rank received, a receive nothing matched, or a group whose members issued different numbers
of collectives is still in flight and would be matched by the next call's code. After a
failed call the pool then starts fresh ranks instead of keeping them; after a call that
returned it says so.

Whoever wants to see every collective a rank issues -- the course's observers -- listens
(``TRACKER.listen(fn)``): ``fn(Issued(...))`` is called on the issuing thread right after
each operator returns, with its arguments and ``Work``.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
import warnings
from dataclasses import replace

from ..patching import patched
from ..torch_private import argument_index, boxed_type_name, keys_below_backend_select
from .learners import is_learners_file
from .records import Group, Issued, Op, Peer, Traffic, Wait, ordinal

# c10d operator -> the collective's name in torch.distributed (one table for the package: the
# observers read the name from it, as ``Issued.collective``).
C10D_OPS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast", "reduce_": "reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
    "gather_": "gather", "scatter_": "scatter",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "barrier": "barrier", "monitored_barrier_": "barrier",
}
POINT_TO_POINT = ("send", "recv", "isend", "irecv")  # counted at the Python functions
BLOCKING_P2P = ("send", "recv")  # the rank is blocked in these until they return
_DISPATCH_KEY = "BackendSelect"
_KEEP = 256  # operations remembered per call (older completed ones are dropped)
_C10D_FILES = ("distributed_c10d.py", "c10d_logger.py")  # torch.distributed's own frames above a call


UNKNOWN = "unknown"  # blocked in a wait() on a Work the tracker did not see issued in this call


class CollectiveTracker:
    """Per-rank record of the communications issued in the current call, and of the one the
    main thread is blocked in."""

    def __init__(self):
        self._lock = threading.Lock()
        self._library = None
        self._listeners: list = []
        self._wrap_wait = None  # inside calls(): wraps Work.wait for the rest of the call
        self._in_call = False  # inside calls() (its nested uses change nothing)
        self._for_life = contextlib.ExitStack()  # patches kept for the process's life (never closed)
        self.main = threading.main_thread().ident
        self._clear_traffic()
        self.reset()

    def reset(self) -> None:
        """Number afresh (the pool calls this at the start of every call): "the 3rd all_reduce of
        this call". The traffic is not reset here: what a thread of the learner's sends between
        two calls counts in the next one's (``traffic()`` hands it over and starts again)."""
        with self._lock:
            self.counts: dict[str, int] = {}
            self.seqs: dict[tuple, int] = {}  # (group, kind, peer) -> operations of that kind there
            self.ops: list[Op] = []
            self.blocked: Op | str | None = None  # what the main thread waits in now (UNKNOWN: can't say)
            self.sync: Op | None = None  # the main thread's last synchronous collective: it waits for it

    def _clear_traffic(self) -> None:
        """Traffic since the last ``traffic()``; the groups it used are held until then."""
        self._groups: dict[int, tuple[object, Group]] = {}  # id(group) -> (group, its name)
        self._sent: dict[Peer, int] = {}      # messages sent to each peer
        self._received: dict[Peer, int] = {}  # messages received from each peer (a known sender)
        self._any_source: list[Op] = []       # receives posted from any rank: irecv(src=None)
        self._collectives: dict[Group, int] = {}  # collectives issued on each group

    def _counted(self) -> tuple[Traffic, list[Op]]:
        """A copy of the counts so far, and of the receives from any rank (lock held)."""
        return Traffic(dict(self._sent), dict(self._received), dict(self._collectives)), list(self._any_source)

    # --- what the kernel asks -------------------------------------------------------------
    def traffic(self, destroyed: bool = False) -> Traffic:
        """The messages and collectives since the last reading (this call's), as a ``Traffic``
        (a receive from any rank still unmatched counts under ``Peer(group, None)``). Then
        counting starts again. With ``destroyed`` -- what a script's end tells, while the call
        goes on -- the groups destroyed meanwhile count too and nothing is reset; without, they
        do not count (what they held can never reach another call)."""
        with self._lock:
            groups = list(self._groups.values())
            counted, any_source = self._counted()
            if not destroyed:
                self._clear_traffic()
        gone = set() if destroyed else {name for group, name in groups if not _alive(group)}
        return _summarise(gone, counted, any_source)

    def waiting(self) -> tuple[Wait | None, str, Traffic]:
        """While a call runs (asked from another thread): the communication the main thread is
        blocked in (a ``Wait``; None: none the tracker can follow, and then a few words on
        why), and the call's traffic so far, every group counted, left in place."""
        with self._lock:
            counted, any_source = self._counted()
            blocked = self._blocked()
        traffic = _summarise(set(), counted, any_source)
        if blocked is None:
            return None, "is not blocked in a communication (computing, or waiting elsewhere)", traffic
        if blocked == UNKNOWN:
            return None, "waits in a wait() on a Work the pool did not see issued in this call", traffic
        if blocked.completed():
            return None, "is returning from a completed communication", traffic
        return blocked.what, "", traffic

    def describe(self) -> str:
        """One line: the communication this rank waits in, else what it has in flight, else its last."""
        with self._lock:
            blocked, ops = self._blocked(), list(self.ops)
        now = time.perf_counter()
        if isinstance(blocked, Op) and not blocked.completed():
            what = blocked.what
            return f"waiting in the {ordinal(what.number)} {what.name} of this call for {now - blocked.start:.1f} s"
        pending = [op for op in ops if not op.completed()]
        where = ("waiting in a wait() on a Work the pool did not see issued in this call"
                 if blocked == UNKNOWN else "not blocked in a communication")
        if pending:
            op = pending[0]
            return (f"{where}; in flight: the {ordinal(op.what.number)} {op.what.name} of this call "
                    f"(issued {now - op.start:.1f} s ago)")
        if blocked == UNKNOWN:
            return where
        if ops:
            last = ops[-1].what
            return f"not in a collective; its last, the {ordinal(last.number)} {last.name} of this call, completed"
        return "not in a collective; none issued in this call"

    def _blocked(self):
        """What the main thread waits in: the call it is inside, else its last synchronous
        collective until that completes (lock held)."""
        if self.blocked is not None:
            return self.blocked
        if self.sync is not None and not self.sync.completed():
            return self.sync
        return None

    # --- installing ------------------------------------------------------------------------
    def install(self) -> None:
        """Route the c10d collective operators through the tracker (once per process:
        ``torch.library`` kernels, PyTorch's public way to add one)."""
        import torch

        if self._library is not None:
            return
        self._library = torch.library.Library("c10d", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            for op, collective in C10D_OPS.items():
                packet = getattr(torch.ops.c10d, op, None)
                if packet is None or collective in POINT_TO_POINT:
                    continue
                self._library.impl(op, self._kernel(op, collective, packet.default), _DISPATCH_KEY,
                                   with_keyset=True)

    @contextlib.contextmanager
    def calls(self):
        """Inside: the c10d operators are tracked, ``dist.send``/``recv``/``isend``/``irecv`` go
        through the tracker, and ``Work.wait()`` says which operation the main thread waits in;
        afterwards the real functions are back (nested: a no-op). On a rank the point-to-point
        wrappers stay for its life (``keep_point_to_point``)."""
        import torch.distributed as dist

        self.install()
        if self._in_call:
            yield
            return
        self._in_call = True
        with contextlib.ExitStack() as patches:  # undone last patch first: Work.wait, then p2p
            patches.enter_context(self._point_to_point())
            wait = self._wait(dist.Work.wait)
            self._wrap_wait = lambda: patches.enter_context(patched(dist.Work, wait=wait))
            try:
                yield
            finally:
                self._in_call, self._wrap_wait = False, None

    def keep_point_to_point(self) -> None:
        """Track ``send``/``recv``/``isend``/``irecv`` for the life of this process (a rank: what a
        thread of the learner's sends between two calls counts in the next one's traffic)."""
        self._for_life.enter_context(self._point_to_point())

    def _point_to_point(self) -> contextlib.AbstractContextManager:
        """Rebind the point-to-point functions of ``c10d``, and those ``dist`` takes from it, to the
        tracker's now; returns what puts them back once it is left (nothing, when they already are)."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if getattr(c10d.isend, "_dpcourse_wrapped", False):
            return contextlib.nullcontext()
        saved = {name: getattr(c10d, name) for name in POINT_TO_POINT}
        wrapped = {name: self._p2p(name, original) for name, original in saved.items()}
        for fn in wrapped.values():
            fn._dpcourse_wrapped = True
        patches = contextlib.ExitStack()
        patches.enter_context(patched(c10d, **wrapped))
        patches.enter_context(patched(dist, **{name: fn for name, fn in wrapped.items()
                                               if getattr(dist, name, None) is saved[name]}))
        return patches

    @contextlib.contextmanager
    def listen(self, fn):
        """Inside: ``fn(Issued(...))`` after every collective and point-to-point call."""
        with self.calls():
            self._listeners.append(fn)
            try:
                yield
            finally:
                self._listeners.remove(fn)

    def _tell(self, issued: Issued) -> None:
        for fn in list(self._listeners):
            fn(issued)

    # --- recording --------------------------------------------------------------------------
    def _group(self, group) -> Group:
        """The ``Group`` of a process group (None: the default one), noted for traffic()."""
        import torch.distributed as dist

        if group is None:
            group = dist.group.WORLD
        known = self._groups.get(id(group))
        if known is None:
            name = Group(tuple(dist.get_process_group_ranks(group)), group is dist.group.WORLD,
                         str(getattr(group, "group_name", "")))
            known = self._groups[id(group)] = (group, name)
        return known[1]

    def _issue(self, kind: str, name: str, group, peer) -> Op:
        """Note an operation as it is called (lock held): its number, place and traffic."""
        g = self._group(group)
        number = self.counts[name] = self.counts.get(name, 0) + 1
        key = (g, kind, peer)
        seq = self.seqs[key] = self.seqs.get(key, 0) + 1
        op = Op(Wait(kind, name, number, g, peer, seq), time.perf_counter())
        if kind == "collective":
            self._collectives[g] = self._collectives.get(g, 0) + 1
        elif kind == "send":
            self._sent[Peer(g, peer)] = self._sent.get(Peer(g, peer), 0) + 1
        elif peer is None:
            self._any_source.append(op)
        else:
            self._received[Peer(g, peer)] = self._received.get(Peer(g, peer), 0) + 1
        self.ops.append(op)
        if len(self.ops) > _KEEP:
            self.ops = [o for o in self.ops if not o.completed()][-_KEEP:] or self.ops[-1:]
        return op

    def _withdraw(self, op: Op) -> None:
        """An operation whose call raised: nothing was sent or posted (lock held)."""
        what = op.what
        counter = {"collective": self._collectives, "send": self._sent, "recv": self._received}[what.kind]
        key = what.group if what.kind == "collective" else Peer(what.group, what.peer)
        if what.kind == "recv" and what.peer is None:
            self._any_source = [o for o in self._any_source if o is not op]
        elif counter.get(key):
            counter[key] -= 1
        op.done, op.work = True, None

    @contextlib.contextmanager
    def _blocking(self, op):
        """The main thread is blocked in ``op`` (an ``Op`` or UNKNOWN) inside; other threads and a
        wait inside a wait (``dist.send`` waits on its own Work) change nothing."""
        if threading.get_ident() != self.main or self.blocked is not None:
            yield
            return
        self.blocked = op
        try:
            yield
        finally:
            self.blocked = None

    def _wait(self, original):
        @functools.wraps(original)
        def wait(work, *args, **kwargs):
            if threading.get_ident() != self.main:
                return original(work, *args, **kwargs)
            with self._lock:
                op = next((o for o in self.ops if o.work is work), None)
            with self._blocking(op if op is not None else UNKNOWN):
                return original(work, *args, **kwargs)

        wait._dpcourse_wrapped = True
        return wait

    def _p2p(self, name: str, fn):
        @functools.wraps(fn)
        def tracked(*args, **kwargs):
            if getattr(_inside, "p2p", False):  # dist.send calls dist.isend: count it once
                return fn(*args, **kwargs)
            _inside.p2p = True
            try:
                return outermost(*args, **kwargs)
            finally:
                _inside.p2p = False

        def outermost(*args, **kwargs):
            tensor, peer, group = _p2p_args(name, args, kwargs)
            kind = "send" if "send" in name else "recv"
            with self._lock:
                op = self._issue(kind, name, group, peer)
            if name not in BLOCKING_P2P:
                self._waits_need_telling()
            try:
                with self._blocking(op if name in BLOCKING_P2P else None):
                    work = fn(*args, **kwargs)  # send/recv block; isend/irecv return a Work
            except BaseException:
                with self._lock:
                    self._withdraw(op)
                raise
            with self._lock:
                if peer is None and isinstance(work, int):  # recv(src=None) returns the sender
                    self._any_source = [o for o in self._any_source if o is not op]
                    op.what = replace(op.what, peer=work)
                    sender = Peer(op.what.group, work)
                    self._received[sender] = self._received.get(sender, 0) + 1
                if hasattr(work, "is_completed"):  # isend/irecv: a Work, held until it completes
                    op.work = work
                else:  # send returns None and recv the sender's rank: both have completed
                    op.done = True
            if self._listeners:
                self._tell(Issued(name, kind, (tensor, peer, group), op.start, work))
            return work

        return tracked

    def _waits_need_telling(self) -> None:
        """The learner's code issued an asynchronous operation: from now on in this call,
        ``Work.wait()`` says which operation the main thread waits in."""
        if threading.get_ident() != self.main:
            return
        wrap, self._wrap_wait = self._wrap_wait, None
        if wrap is not None:
            wrap()

    def _kernel(self, op_name: str, collective: str, op):
        below = keys_below_backend_select()
        asynchronous = argument_index(op, "async_op")

        def tracked(keyset, *args, **kwargs):
            group = next((g for g in map(process_group, args) if g is not None), None)
            is_async = kwargs.get("async_op", args[asynchronous] if asynchronous is not None
                                  and asynchronous < len(args) else True)
            with self._lock:
                issued = self._issue("collective", collective, group, None)
            try:
                with self._blocking(issued):  # a collective that blocks in the call (monitored_barrier)
                    result = op.redispatch(keyset & below, *args, **kwargs)
            except BaseException:
                with self._lock:
                    self._withdraw(issued)
                raise
            work = result[-1] if isinstance(result, tuple) else result
            if threading.get_ident() != self.main:
                when_complete(work, lambda _future: _complete(issued))
            elif not is_async:
                self.sync = issued  # its caller waits for it now
                when_complete(work, lambda _future: _complete(issued))
            elif _from_learners_code():
                self._hold(issued, work)
                self._waits_need_telling()
            else:  # PyTorch's own (DDP's, FSDP's): their Works are not held
                when_complete(work, lambda _future: _complete(issued))
            if self._listeners:
                self._tell(Issued(op_name, collective, args, issued.start, work))
            return result

        return tracked

    def _hold(self, issued: Op, work) -> None:
        """Keep the collective's Work until it completes (its future says when), then let go of it
        with its tensors; ``wait()`` on it is then recognised."""
        import torch.distributed as dist

        try:
            held = work if isinstance(work, dist.Work) else dist.Work.unbox(work)
        except Exception:  # noqa: BLE001 -- an operator without a Work
            held = None
        issued.work = held
        when_complete(held, lambda _future: _complete(issued))


def _from_learners_code() -> bool:
    """Whether the collective being issued was called by the learner's code (the first frame
    above torch.distributed's own functions), not by PyTorch's (DDP, FSDP, DTensor)."""
    frame = inspect.currentframe()
    while frame is not None and (frame.f_code.co_filename.endswith(_C10D_FILES)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame is not None and is_learners_file(frame.f_code.co_filename)


def _complete(op: Op) -> None:
    op.done, op.work = True, None


def _alive(group) -> bool:
    """Whether a process group still exists (not destroyed in the call)."""
    import torch.distributed as dist

    try:
        dist.get_process_group_ranks(group)
        return True
    except Exception:  # noqa: BLE001 -- destroyed (a script's group): its traffic went with it
        return False


def _summarise(gone: set, counted: Traffic, any_source: list[Op]) -> Traffic:
    """The traffic to hand over (see ``traffic``): each receive from any rank counted under its
    sender once it completed (under ``Peer(group, None)`` before), no group in ``gone``, no zero."""
    received = dict(counted.received)
    for op in any_source:
        peer = Peer(op.what.group, op.what.peer if op.completed() else None)
        received[peer] = received.get(peer, 0) + 1
    return Traffic({p: n for p, n in counted.sent.items() if n and p.group not in gone},
                   {p: n for p, n in received.items() if n and p.group not in gone},
                   {g: n for g, n in counted.collectives.items() if n and g not in gone})


def _p2p_args(name: str, args: tuple, kwargs: dict) -> tuple:
    """(tensor, peer as a global rank, group) of a ``dist.send``/``recv``/``isend``/``irecv`` call."""
    import torch.distributed as dist

    names = ("tensor", "dst" if "send" in name else "src", "group", "tag")
    given = {**dict(zip(names, args)), **kwargs}
    group, peer = given.get("group"), given.get(names[1])
    if peer is None:  # group_dst / group_src: a rank within ``group``
        local = given.get("group_dst" if "send" in name else "group_src")
        peer = None if local is None else dist.get_global_rank(group, local)
    return given.get("tensor"), peer, group


def process_group(arg):
    """The ProcessGroup a c10d operator was called with (boxed as a ScriptObject), else None."""
    import torch.distributed as dist

    if isinstance(arg, dist.ProcessGroup):
        return arg
    if "ProcessGroup" in boxed_type_name(arg):
        return dist.ProcessGroup.unbox(arg)
    return None


_inside = threading.local()  # .p2p: a tracked point-to-point call is running on this thread
TRACKER = CollectiveTracker()  # one per process: the pool's rank and every observer share it


def when_complete(work, callback) -> None:
    """Call ``callback`` once ``work`` has completed (at once if it has, or cannot say)."""
    try:
        import torch.distributed as dist

        if not isinstance(work, dist.Work):  # the dispatcher hands over a boxed (script) Work
            work = dist.Work.unbox(work)
        work.get_future().add_done_callback(callback)
    except Exception:  # not a Work (an operator without one), or a backend without futures
        callback(None)
