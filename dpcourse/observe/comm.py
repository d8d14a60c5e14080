"""``Comm``: the bytes each rank sends, collective by collective, split by training step.

Every collective -- ``dist.all_reduce`` in the learner's code, DDP's C++ reducer, FSDP's
all-gathers and reduce-scatters -- ends in a ``torch.ops.c10d`` operator, and every
point-to-point call in ``dist.send``/``recv``/``isend``/``irecv``; the process's collective
tracker (``dpcourse.tracking``, the one the hang diagnosis uses) sees each with its
tensors and its ``Work``. For each, ``Comm`` records the payload S as nccl-tests defines it
(``payload.payload_bytes``: the all_gather output, the reduce_scatter input, a send's
message) and what a bandwidth-optimal algorithm makes this rank send (``logical_sent``: S
times ``dpcourse.collectives.cost.bus_factor``), the process group's ranks, and when it was
issued and completed (``Completions``). A record's ``step`` is the number of
``optimizer.step()`` calls that had completed when it was issued (the call's shared step
clock, ``watch.LoopWatch``), so step 2's records are the third step's.

Wire bytes: ``/proc/self/io``'s ``wchar`` counts every byte the process hands to write
calls, socket writes included -- what Gloo's TCP transport really sends, plus a few header
bytes, and anything else the rank writes meanwhile (its printed lines). Linux only.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import asdict, dataclass

import torch

from ..collectives.cost import bus_factor
from ..torch_private import flight_recorder_entries, tensor_version
from ..tracking.tracker import process_group
from .observer import Observer
from .payload import first_tensor, issued_bytes
from .watch import LoopWatch


@dataclass
class CommRecord:
    """One collective or point-to-point call on a rank (bytes; seconds of ``perf_counter``).

    ``nbytes``: S; ``logical_sent``: bytes a bandwidth-optimal algorithm sends from this rank
    (None where that depends on more than S: gather, scatter); ``world_size`` and
    ``group_ranks``: its process group (HYBRID_SHARD uses two); ``peer``: a send's
    destination or a receive's source; ``end``: when its ``Work`` completed (None: the
    backend could not say, e.g. Gloo's point-to-point); ``payload``: a copy of what a send
    sent, when ``Comm(payloads=True)``."""
    op: str
    collective: str
    nbytes: int
    world_size: int
    logical_sent: int | None
    group_ranks: tuple | None
    step: int
    start: float
    end: float | None = None
    peer: int | None = None
    payload: torch.Tensor | None = None


class Completions:
    """Calls ``fn()`` when a collective completes, for one observed call.

    From the ``Work``'s future where the backend gives one (it runs the callback when the
    operation is done). Gloo's reduce-scatter gives none, nor an ``is_completed()`` that ever
    turns true: its result is copied into the output inside the caller's ``wait()``. So for
    such a work one helper thread watches the output tensor's version counter (through a weak
    reference, so no tensor lives longer) every half millisecond, and the copy marks the end.
    It never calls ``wait()`` itself: a second ``wait()`` on such a work runs its reduction
    again, which corrupted the gradients under HYBRID_SHARD. Point-to-point works are not for
    this: Gloo completes them only inside the caller's ``wait()``, and their end stays unknown.
    """

    def __init__(self):
        self._pending: list = []  # (weak reference to the output, its version at issue, fn)
        self._outstanding = 0     # future callbacks not yet run
        self._wake = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def add(self, work, fn, output: torch.Tensor | None = None) -> None:
        import torch.distributed as dist

        if work is None or isinstance(work, int):  # it blocked: done now
            fn()
            return
        if not isinstance(work, dist.Work):  # the dispatcher hands over a boxed (script) Work
            work = dist.Work.unbox(work)
        try:
            future = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented"
            future = None
        if future is not None:
            with self._wake:
                self._outstanding += 1
            future.add_done_callback(lambda _future: self._done(fn))
            return
        if output is None:
            return  # nothing to watch: the end stays unknown
        with self._wake:
            self._pending.append((weakref.ref(output), tensor_version(output), fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._poll, daemon=True, name="dpcourse-completions")
                self._thread.start()
            self._wake.notify()

    def _done(self, fn) -> None:
        """A future's callback: the backend runs it on its own thread, maybe just after the
        caller's wait() has returned -- close() waits for it."""
        try:
            fn()
        finally:
            with self._wake:
                self._outstanding -= 1
                self._wake.notify_all()

    def _poll(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closing:
                    self._wake.wait()
                last = self._closing
                done, waiting = [], []
                for entry in self._pending:
                    tensor = entry[0]()
                    (done if tensor is None or tensor_version(tensor) != entry[1] else waiting).append(entry)
                    del tensor
                self._pending = waiting
            for entry in done:
                entry[2]()
            if last:
                return
            time.sleep(0.0005)

    def close(self, timeout: float = 10.0) -> None:
        """Let every future's callback run, take one last look, then stop the helper thread; a
        work still pending keeps an unknown end."""
        deadline = time.monotonic() + timeout
        with self._wake:
            self._closing = True
            self._wake.notify_all()
            while self._outstanding and time.monotonic() < deadline:  # completions still to report
                self._wake.wait(0.05)
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))


def logical_sent(collective: str, nbytes: int, world_size: int) -> int | None:
    """Bytes a bandwidth-optimal algorithm makes one rank send for ``collective`` on S bytes."""
    if collective == "send":
        return nbytes
    if collective in ("recv", "barrier"):
        return 0
    try:
        return round(nbytes * bus_factor(collective, world_size))
    except ValueError:
        return None


class NotMeasured:
    """What ``Comm.wire`` gives where the wire cannot be read (no ``/proc/self/io``: macOS,
    Windows): it prints as a sentence, whatever the format, and is false in a test."""

    def __format__(self, spec: str) -> str:
        text = "not measured on this platform"
        return format(text, spec.rstrip(",_") if spec and spec[-1] in ",_" else spec) if spec else text

    __repr__ = __str__ = lambda self: "not measured on this platform"  # noqa: E731

    def __bool__(self) -> bool:
        return False


NOT_MEASURED = NotMeasured()
IO_COUNTERS = "/proc/self/io"  # where a rank reads the bytes it wrote (Linux)


def wire_bytes_written() -> int | None:
    """Bytes this process has handed to write calls so far (``wchar``); None off Linux."""
    try:
        with open(IO_COUNTERS) as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Comm(Observer):
    """Observer: every collective a rank issues, with its bytes, by training step.

        comm = dpc.observe.Comm()
        cluster.run(train, observe=[comm])
        comm.bytes(rank=0, step=-1)     # {"all_reduce": 1_234, ...}: the last step's logical bytes
        comm.calls(rank=0, step=-1)     # {"all_gather": 5, ...}
        comm.wire(rank=0, step=-1)      # bytes on Gloo's wire in that step
        comm.records(rank=0)            # every CommRecord of the call

    ``step``: None (default) for the whole call; 0, 1, ... for the step that many
    ``optimizer.step()`` calls in; negative from the end (-1: the last complete step).
    """

    NAME = "comm"   # in the message when nothing was observed yet

    def __init__(self, payloads: bool = False):
        self.payloads = payloads
        self.per_rank: list[dict] | None = None  # filled in the kernel by collect()

    def __repr__(self) -> str:
        return f"Comm(payloads={self.payloads})" if self.per_rank is None else \
            f"Comm(observed on {len(self.per_rank)} ranks)"

    @staticmethod
    def read_flight_recorder() -> list[dict]:
        """PyTorch's own record of this process's last collectives (its flight recorder: on by
        default in 2.13, the last 2000 entries, c10d's ``FlightRecorder.hpp``;
        ``TORCH_FR_BUFFER_SIZE``, or its older name ``TORCH_NCCL_TRACE_BUFFER_SIZE``, set before
        the process group exists, changes the count, and 0 turns it off), oldest first:
        one dict per collective, with ``profiling_name`` (e.g. "gloo:all_reduce"),
        ``collective_seq_id`` and ``state`` ("scheduled", "started", "completed"). Works in
        any process, a torchrun script included, with no observer attached."""
        return flight_recorder_entries()

    # --- on the rank -----------------------------------------------------------------
    def __enter__(self):
        import torch.distributed as dist

        self._dist = dist
        self._records: list[CommRecord] = []
        self._completions = Completions()
        self._wire = [wire_bytes_written()]  # at the call's start and at every step's end
        self._watch = self.watch(LoopWatch(on_step_end=lambda w: self._wire.append(wire_bytes_written())),
                                 listen=self._issued)
        return self

    def __exit__(self, *exc):
        self.unwatch(*exc)
        self._wire.append(wire_bytes_written())
        self._completions.close()

    def _issued(self, issued) -> None:
        name, args = issued.op, issued.args
        nbytes = issued_bytes(issued)
        if issued.collective in ("send", "recv") and name in ("send", "recv", "isend", "irecv"):
            tensor, peer, group = args
            payload = tensor.detach().clone() if self.payloads and issued.collective == "send" else None
        else:
            group = next((g for g in map(process_group, args) if g is not None), None)
            peer, payload = None, None
        n = group.size() if group is not None else self._dist.get_world_size()
        ranks = tuple(self._dist.get_process_group_ranks(group)) if group is not None else None
        record = CommRecord(name, issued.collective, nbytes, n, logical_sent(issued.collective, nbytes, n),
                            ranks, self._watch.steps, issued.start, peer=peer, payload=payload)
        self._records.append(record)
        if record.peer is None or issued.work is None or isinstance(issued.work, int):
            self._completions.add(issued.work, lambda: setattr(record, "end", time.perf_counter()),
                                  first_tensor(args[0]) if args else None)  # c10d ops: the output first
        # a point-to-point Work on Gloo has no future and completes only inside the caller's
        # wait(): its end stays unknown (None)

    def result(self) -> dict:
        wire = self._wire
        known = all(w is not None for w in wire)
        return {"records": [asdict(r) for r in self._records], "steps": self._watch.steps,
                "wire": [b - a for a, b in zip(wire, wire[1:])] if known else None}

    # --- in the kernel -----------------------------------------------------------------
    def _step(self, rank: int, step: int | None) -> int | None:
        """``step`` as an index from the start (None: the whole call)."""
        if step is None:
            return None
        steps = self.of_rank(rank)["steps"]
        index = steps + step if step < 0 else step
        if not 0 <= index <= steps:
            raise IndexError(f"rank {rank} ran {steps} optimizer step(s); step={step} is not one of them")
        return index

    def records(self, rank: int = 0, step: int | None = None) -> list[CommRecord]:
        """The ``CommRecord``s of ``rank`` (in the order issued), of one step or all."""
        index = self._step(rank, step)
        return [CommRecord(**r) for r in self.of_rank(rank)["records"] if index is None or r["step"] == index]

    def bytes(self, rank: int = 0, step: int | None = None, group: tuple | None = None) -> dict[str, int]:
        """{collective: logical bytes ``rank`` sent} (one step or the whole call; one process
        group's, given by its ranks, or all)."""
        out: dict[str, int] = {}
        for r in self.records(rank, step):
            if r.logical_sent and (group is None or r.group_ranks == tuple(group)):
                out[r.collective] = out.get(r.collective, 0) + r.logical_sent
        return out

    def calls(self, rank: int = 0, step: int | None = None) -> dict[str, int]:
        """{collective: how many ``rank`` issued} (barriers and zero-byte calls included)."""
        out: dict[str, int] = {}
        for r in self.records(rank, step):
            out[r.collective] = out.get(r.collective, 0) + 1
        return out

    def groups(self, rank: int = 0, step: int | None = None) -> dict[tuple, dict[str, int]]:
        """{ranks of a process group: {collective: logical bytes}} for ``rank``."""
        out: dict[tuple, dict[str, int]] = {}
        for r in self.records(rank, step):
            if r.logical_sent:
                group = out.setdefault(r.group_ranks, {})
                group[r.collective] = group.get(r.collective, 0) + r.logical_sent
        return out

    def wire(self, rank: int = 0, step: int | None = None) -> "int | NotMeasured":
        """Bytes ``rank`` wrote to its sockets (and any file) in one step or the whole call;
        ``NOT_MEASURED`` (prints as "not measured on this platform", false) off Linux, where the
        logical bytes are still counted."""
        wire = self.of_rank(rank)["wire"]
        if wire is None:
            return NOT_MEASURED
        index = self._step(rank, step)
        return sum(wire) if index is None else wire[index]
