"""Which collective a rank is waiting in, so a hang reads "waiting in the 3rd all_reduce of this call".

Runs on the ranks. Every collective -- ``dist.all_reduce`` from the learner's code, DDP's
C++ reducer, FSDP's all-gathers -- ends in a ``torch.ops.c10d`` operator. The tracker
registers a thin kernel for those operators at the autograd dispatch key: it notes the
call and its ``Work``, then hands the operator on to the real kernel below autograd. Only
collectives pass through Python; other operators never see it (a ``TorchDispatchMode``
would see them all and made a small training step ~3x slower here).

Point-to-point calls (``send``, ``recv``, ``isend``, ``irecv``) are counted at the Python
functions instead: a ring calls them by the hundred, and a Python kernel in the dispatcher
tripled the time of a small isend/irecv pair here (1.0 ms against 0.4 ms), while a plain
wrapper costs microseconds.

The point-to-point wrappers rebind ``torch.distributed``'s functions, because nothing public
sees a ``dist.isend`` before it reaches the backend. They are one of the pool's two runtime
patches of ``torch.distributed``; the other is ``group.py``'s guard on
``init_process_group``/``destroy_process_group`` (no hook there either). Both are installed
for one call and the real functions restored after it, so nothing stacks; a wrapper is
recognised by a marker attribute, so a nested install is a no-op. (The exercise checkers
patch more, each for one check: ``exercises/observe.py`` in the torchrun workers a checker
starts, a few try-it checks around one run.)

A collective is *issued* when its operator returns and *in progress* until its ``Work``
completes: Gloo and NCCL run collectives in the background, and a rank blocks later, in
``wait()``. So "waiting in" names the oldest collective issued in this call whose work has
not completed (a collective's future says when; a point-to-point ``Work``, which has no
future on Gloo, is asked). Counts start again at every call.

Every call also keeps its *traffic*: the messages each rank sent and received, by peer, and
the collectives it issued, by process group (``traffic()``). The kernel adds them up over
the ranks and over the calls since the ranks started (``traffic``, in the kernel's process):
a message no rank received, a receive nothing matched, or a group whose members issued
different numbers of collectives is still in flight and would be matched by the next call's
code. After a failed call the pool then starts fresh ranks instead of keeping them; after a
call that returned it says so.

Whoever wants to see every collective a rank issues -- the course's observers -- listens
(``TRACKER.listen(fn)``): ``fn(Issued(...))`` is called on the issuing thread right after
each operator returns, with its arguments and ``Work``.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from dataclasses import dataclass

from ...torch_private import below_autograd, boxed_type_name, source_rank
from ..errors import ordinal

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
_DISPATCH_KEYS = ("AutogradCPU", "AutogradCUDA")
_KEEP = 256  # issued collectives remembered per call (older completed ones are dropped)


@dataclass(frozen=True)
class Issued:
    """One collective or point-to-point call a rank issued.

    ``op``: the c10d operator (``"allreduce_"``, ``"_allgather_base_"``) or, for point-to-point,
    the ``torch.distributed`` function (``"isend"``); ``collective``: its name in
    ``torch.distributed`` (``"all_reduce"``, ``"send"``); ``args``: the operator's arguments
    (point-to-point: ``(tensor, peer, group)``, ``peer`` a global rank); ``start``:
    ``time.perf_counter()`` when it was called; ``work``: what it returned (None: it blocked).
    """
    op: str
    collective: str
    args: tuple
    start: float
    work: object


class CollectiveTracker:
    """Per-rank record of the collectives issued in the current call."""

    def __init__(self):
        self._lock = threading.Lock()
        self._library = None
        self._listeners: list = []
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (the pool calls this at the start of every call)."""
        with self._lock:
            self.counts: dict[str, int] = {}
            self.issued: list[list] = []  # [name, number, start, completed, p2p Work or None]
            self.entering: tuple[str, int, float, dict] | None = None  # a call blocking now
            # this call's traffic; groups are held only until traffic() reads them
            self._groups: dict[int, object] = {}
            self._sent: dict[tuple, int] = {}      # (id(group), peer) -> messages
            self._received: dict[tuple, int] = {}  # (id(group), peer or None: any source) -> messages
            self._any_source: list = []            # (id(group), Work) of irecv(src=None)
            self._collectives: dict[int, int] = {}  # id(group) -> collectives issued

    def _note_group(self, group) -> int:
        if group is None:
            import torch.distributed as dist

            group = dist.group.WORLD
        self._groups.setdefault(id(group), group)
        return id(group)

    def traffic(self) -> dict:
        """This call's messages and collectives on the groups that still exist, keyed by the
        group's ranks (global): ``{"sent": {(ranks, dst): n}, "received": {(ranks, src): n},
        "collectives": {ranks: n}}``; ``src`` None: a receive from any rank still unmatched."""
        with self._lock:
            groups, self._groups = self._groups, {}
            sent, received = dict(self._sent), dict(self._received)
            collectives, any_source = dict(self._collectives), list(self._any_source)
        return _summarise(groups, sent, received, collectives, any_source)

    def waiting(self) -> tuple[dict | None, dict]:
        """While a call runs (asked from another thread): what this rank waits in -- the call
        blocking now, else the oldest issued one not completed -- as ``{"kind": "send", "recv"
        or "collective", "name", "number", "group": its ranks, "peer"}`` (None: nothing), and
        the call's traffic so far (``traffic()``, the blocking call counted), left in place."""
        with self._lock:
            groups = dict(self._groups)
            sent, received = dict(self._sent), dict(self._received)
            collectives, any_source = dict(self._collectives), list(self._any_source)
            entering, issued = self.entering, list(self.issued)
        detail = entering[3] if entering else None
        if detail is None:
            detail = next((c[5] for c in issued if len(c) > 5 and not _done(c)), None)
        if entering:  # counted once it returns; it is this rank's, so count it now
            d = entering[3]
            if d["kind"] == "collective":
                collectives[d["gid"]] = collectives.get(d["gid"], 0) + 1
            elif d["kind"] == "send":
                sent[(d["gid"], d["peer"])] = sent.get((d["gid"], d["peer"]), 0) + 1
            elif d["peer"] is not None:
                received[(d["gid"], d["peer"])] = received.get((d["gid"], d["peer"]), 0) + 1
        traffic = _summarise(groups, sent, received, collectives, any_source)
        if detail is None:
            return None, traffic
        ranks = _group_ranks(groups.get(detail["gid"]))
        if ranks is None:
            return None, traffic
        return {**{k: v for k, v in detail.items() if k != "gid"}, "group": ranks}, traffic

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
                for key in _DISPATCH_KEYS:
                    self._library.impl(op, self._kernel(op, collective, packet.default), key)

    @contextlib.contextmanager
    def calls(self):
        """Inside: the c10d operators are tracked and ``dist.send``/``recv``/``isend``/``irecv``
        go through the tracker; afterwards the real functions are back (nested: a no-op)."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.install()
        if getattr(c10d.isend, "_dpcourse_wrapped", False):
            yield
            return
        saved = {name: getattr(c10d, name) for name in POINT_TO_POINT}
        for name, original in saved.items():
            wrapped = self._p2p(name, original)
            wrapped._dpcourse_wrapped = True
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)
        try:
            yield
        finally:
            for name, original in saved.items():
                if getattr(dist, name, None) is getattr(c10d, name):
                    setattr(dist, name, original)
                setattr(c10d, name, original)

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

    def _enter(self, name: str, detail: dict) -> tuple[int, float]:
        """Note that ``name`` starts; ``detail``: what it waits for (see ``waiting``)."""
        with self._lock:
            number, start = self.counts.get(name, 0) + 1, time.perf_counter()
            self.counts[name] = number
            detail["number"] = number
            self.entering = (name, number, start, detail)
        return number, start

    def _leave(self) -> None:
        with self._lock:
            self.entering = None

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
                gid = self._note_group(group)
            detail = {"kind": kind, "name": name, "gid": gid, "peer": peer}
            number, start = self._enter(name, detail)
            try:
                work = fn(*args, **kwargs)  # send/recv block; isend/irecv return a Work
            finally:
                self._leave()
            if peer is None and isinstance(work, int):  # recv(src=None) returns the sender
                peer = detail["peer"] = work
            with self._lock:
                for entry in self.issued:  # let go of the Works that have completed
                    if entry[4] is not None and entry[4].is_completed():
                        entry[3], entry[4] = True, None
                # send returns None and recv the sender's rank (an int): both have completed
                pending = work if hasattr(work, "is_completed") else None
                self.issued.append([name, number, start, pending is None, pending, detail])
                if kind == "send":
                    self._sent[(gid, peer)] = self._sent.get((gid, peer), 0) + 1
                elif peer is None and pending is not None:
                    self._any_source.append((gid, pending))
                else:
                    self._received[(gid, peer)] = self._received.get((gid, peer), 0) + 1
                if len(self.issued) > _KEEP:
                    self.issued = [e for e in self.issued if not e[3]][-_KEEP:] or self.issued[-1:]
            if self._listeners:
                self._tell(Issued(name, kind, (tensor, peer, group), start, work))
            return work

        return tracked

    def _kernel(self, op_name: str, collective: str, op):
        def tracked(*args, **kwargs):
            group = next((g for g in map(process_group, args) if g is not None), None)
            with self._lock:
                gid = self._note_group(group)
            detail = {"kind": "collective", "name": collective, "gid": gid, "peer": None}
            number, start = self._enter(collective, detail)
            try:
                with below_autograd():
                    result = op(*args, **kwargs)
            finally:
                self._leave()
            work = result[-1] if isinstance(result, tuple) else result
            with self._lock:
                self._collectives[gid] = self._collectives.get(gid, 0) + 1
            self._issued(collective, number, start, work, detail)
            if self._listeners:
                self._tell(Issued(op_name, collective, args, start, work))
            return result

        return tracked

    def _issued(self, collective: str, number: int, start: float, work, detail: dict) -> None:
        # Only a completion flag is kept, set by the work's future: holding the Work itself
        # would keep its tensors alive (FSDP's freed gradients, say) for the rest of the call.
        entry = [collective, number, start, False, None, detail]
        with self._lock:
            self.issued.append(entry)
            if len(self.issued) > _KEEP:
                self.issued = [e for e in self.issued if not e[3]][-_KEEP:] or self.issued[-1:]
        when_complete(work, lambda _future: entry.__setitem__(3, True))

    def describe(self) -> str:
        """One line: the collective this rank waits in, or the last one it issued."""
        with self._lock:
            entering, issued = self.entering, list(self.issued)
        now = time.perf_counter()
        waiting = entering[:3] if entering else None
        if waiting is None:
            waiting = next((tuple(c[:3]) for c in issued if not _done(c)), None)
        if waiting is not None:
            name, number, start = waiting
            return f"waiting in the {ordinal(number)} {name} of this call for {now - start:.1f} s"
        if issued:
            name, number = issued[-1][:2]
            return f"not in a collective; its last, the {ordinal(number)} {name} of this call, completed"
        return "not in a collective; none issued in this call"


def _group_ranks(group) -> tuple | None:
    """A group's ranks (global), or None for a group destroyed meanwhile."""
    import torch.distributed as dist

    if group is None:
        return None
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # destroyed in the call (a script's group): its traffic went with it
        return None


def _summarise(groups: dict, sent: dict, received: dict, collectives: dict, any_source: list) -> dict:
    """Counts by group id turned into counts by the groups' ranks (see ``traffic``)."""
    for gid, work in any_source:
        try:
            peer = source_rank(work) if work.is_completed() else None
        except Exception:
            peer = None
        received[(gid, peer)] = received.get((gid, peer), 0) + 1
    alive = {gid: ranks for gid, ranks in ((g, _group_ranks(grp)) for g, grp in groups.items())
             if ranks is not None}
    out: dict = {"sent": {}, "received": {}, "collectives": {}}
    for name, table in (("sent", sent), ("received", received)):
        for (gid, peer), n in table.items():
            if gid in alive:
                key = (alive[gid], peer)
                out[name][key] = out[name].get(key, 0) + n
    for gid, n in collectives.items():
        if gid in alive:
            out["collectives"][alive[gid]] = out["collectives"].get(alive[gid], 0) + n
    return out


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


def _done(entry: list) -> bool:
    if not entry[3] and entry[4] is not None:
        try:
            entry[3] = bool(entry[4].is_completed())
        except Exception:  # a Work of a destroyed group
            entry[3] = True
    return entry[3]


def when_complete(work, callback) -> None:
    """Call ``callback`` once ``work`` has completed (at once if it has, or cannot say)."""
    try:
        import torch.distributed as dist

        if not isinstance(work, dist.Work):  # the dispatcher hands over a boxed (script) Work
            work = dist.Work.unbox(work)
        work.get_future().add_done_callback(callback)
    except Exception:  # not a Work (an operator without one), or a backend without futures
        callback(None)
