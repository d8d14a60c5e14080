"""Exercise D: ring reduce-scatter and all-gather from ``isend``/``irecv``; the checker runs them.

    report = dpc.exercises.check_d(ring_reduce_scatter, ring_all_gather)
    dpc.viz.plot_ring_trace(report.trace)     # your own sends, replayed step by step

The learner's two functions (same contract as ``dpc.collectives.ring.ring_reduce_scatter`` /
``ring_all_gather``: in place on a contiguous tensor, chunk r as ``tensor_split`` cuts it)
run on real ranks for N = 2, 3, 4, 5 on awkward sizes (empty, fewer elements than ranks,
not divisible by N). Inputs are integers stored as float32, so sums are exact and results
are compared bit for bit with ``dist.all_reduce``. ``SendRecorder`` sees every message the
ranks send, below ``dist.isend`` (``send``, ``isend``, ``batch_isend_irecv`` all pass): bytes
per rank, destination, and which chunk it was -- enough to replay the learner's own sends in
the course's ring drawing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..collectives.schedule import chunk_bounds, ring_all_gather_steps, ring_reduce_scatter_steps
from ..collectives.trace import Trace, Transfer
from ..collectives.traced import rank_input
from ..tracking.tracker import TRACKER
from ..grading import provenance
from ..grading.report import Report
from ..grading.judging import RankFailure, blanks_in, clusters_for, run_or_failure

WORLD_SIZES = (2, 3, 4, 5)
NUMELS = (0, 1, 8, 11, 60)  # empty; fewer than N; the player's size; divisible by no N; by all
TIMEOUT = 10.0              # seconds per call: a correct call takes milliseconds
TRACE_CASE = (4, 8)         # (N, numel) whose sends become report.trace
PHASES = ("reduce-scatter", "all-gather", "all-reduce")
ITEMS = {"reduce-scatter": "reduce-scatter: rank r ends with chunk r summed over all ranks",
         "all-gather": "all-gather: every rank ends with every rank's chunk",
         "all-reduce": "reduce-scatter then all-gather equals dist.all_reduce, bit for bit",
         "bytes": "each rank sends 2(N-1)/N·Ψ bytes ((N-1)/N·Ψ per phase)",
         "neighbour": "each rank sends only to its right neighbour, rank (r+1) mod N"}


@dataclass(repr=False)
class RingReport(Report):
    """A ``Report`` that also carries the learner's ring as a ``Trace`` (None if not recorded):
    ``dpc.viz.plot_ring_trace(report.trace)`` draws it."""
    trace: Trace | None = None


@dataclass(frozen=True)
class Sent:
    """One ``c10d::send`` on a rank: ``phase``, destination rank, the chunk it was (None:
    not a chunk of the tensor), elements, bytes, the values sent."""
    phase: str
    dst: int
    chunk: int | None
    numel: int
    nbytes: int
    values: torch.Tensor


class SendRecorder:
    """Inside ``with SendRecorder(tensor) as seen:`` every message a rank sends lands in
    ``seen.sent``; set ``seen.phase`` between calls to label them.

    It listens to the process's collective tracker (``dpcourse.tracking``, the one the
    course's observers use), which sees ``send``/``isend`` -- however they are reached:
    directly, through ``dist.batch_isend_irecv``'s ``P2POp``s, or ``send`` calling ``isend`` --
    and hands the real functions on. So any correct use of them passes.
    """

    def __init__(self, tensor: torch.Tensor):
        self.flat, self.phase, self.sent = tensor.view(-1), "", []
        self.bounds = chunk_bounds(self.flat.numel(), dist.get_world_size())

    def __enter__(self):
        self._listening = TRACKER.listen(self._issued)
        self._listening.__enter__()
        return self

    def __exit__(self, *exc):
        self._listening.__exit__(*exc)

    def _issued(self, issued) -> None:
        if issued.collective != "send":
            return
        tensor, to, _group = issued.args
        self.sent.append(Sent(self.phase, int(to), self._chunk(tensor), tensor.numel(),
                              tensor.numel() * tensor.element_size(), tensor.detach().clone()))

    def _chunk(self, t: torch.Tensor) -> int | None:
        """Index of the chunk of the observed tensor that ``t`` is a view of, else None."""
        if t.numel() == 0 or t.untyped_storage().data_ptr() != self.flat.untyped_storage().data_ptr():
            return None
        start = (t.data_ptr() - self.flat.data_ptr()) // max(1, t.element_size())
        span = (start, start + t.numel())
        return next((c for c, bounds in enumerate(self.bounds) if bounds == span), None)


def _on_rank(phase: str, reduce_scatter, all_gather, numel: int, seed: int):
    """One case on this rank: (input, result, dist.all_reduce's result, sends)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = rank_input(rank, numel, seed).float()  # integers 0..9: every sum is exact in float32
    expected = x.clone()
    dist.all_reduce(expected)
    t = x.clone()
    if phase == "all-gather":  # start from what a reduce-scatter leaves: my chunk, reduced
        lo, hi = chunk_bounds(numel, n)[rank]
        t = torch.full_like(x, -1.0)
        t[lo:hi] = expected[lo:hi]
    with SendRecorder(t) as seen:
        if phase != "all-gather":
            seen.phase = "reduce-scatter"
            reduce_scatter(t)
        if phase != "reduce-scatter":
            seen.phase = "all-gather"
            all_gather(t)
    return x, t, expected, seen.sent


@provenance.judged("D")
def check_d(reduce_scatter, all_gather, cluster=None, world_sizes=WORLD_SIZES,
            timeout: float = TIMEOUT) -> RingReport:
    """Run the learner's ring on real ranks and say, item by item, what is right.

    reduce_scatter(tensor), all_gather(tensor): in place, like ``dpc.collectives``' ring.
    cluster: a ``dpc.Cluster`` or a list of them to use for their world sizes; clusters for
    the other ``world_sizes`` are started for the check and shut down after it (~5 s each).
    timeout: seconds per call before a hang is reported (the cluster stays usable).
    """
    report = RingReport("Exercise D")
    blanks = {name: blanks_in(fn) for name, fn in
              (("ring_reduce_scatter", reduce_scatter), ("ring_all_gather", all_gather))}
    if all(blanks.values()):
        report.attempted = False
        report.note = ("Fill in the `...` in ring_reduce_scatter and ring_all_gather, then run "
                       "this cell again.")
        return report
    runs = {p: {} for p in PHASES}     # phase -> {(N, numel): per-rank results}
    failed: dict[str, str] = {}        # phase -> what went wrong first
    for p, name in (("reduce-scatter", "ring_reduce_scatter"), ("all-gather", "ring_all_gather")):
        if blanks[name]:
            failed[p] = f"fill in the `...` in {name} first"
    with clusters_for(cluster, world_sizes) as clusters:
        for n in sorted(world_sizes):
            for phase in PHASES:
                if phase == "all-reduce" and failed:
                    continue
                for numel in NUMELS:
                    if phase in failed:
                        break
                    out = run_or_failure(clusters[n], _on_rank, phase, reduce_scatter, all_gather,
                                         numel, n, timeout=timeout)
                    case = f"N={n}, {numel} element{'s' * (numel != 1)}"
                    if isinstance(out, RankFailure):
                        failed[phase] = f"{case}: {out.describe(timeout)}"
                    else:
                        runs[phase][n, numel] = out
                        wrong = _first_difference(phase, out, n, numel)
                        if wrong:
                            failed[phase] = f"{wrong} ({case})"
    _judge(report, runs, failed, world_sizes)
    report.trace = _trace(runs["all-reduce"].get(TRACE_CASE))
    if report.trace is None and TRACE_CASE in runs["all-reduce"]:
        report.note = ("Your sends could not be replayed (a send was not a chunk of the tensor, "
                       "e.g. a copy): the drawing needs chunk views.")
    return report


def _first_difference(phase: str, out, n: int, numel: int) -> str:
    """'' if every rank's result is right, else where the first one differs."""
    for rank, (_, result, expected, _) in enumerate(out):
        lo, hi = chunk_bounds(numel, n)[rank] if phase == "reduce-scatter" else (0, numel)
        bad = (result[lo:hi] != expected[lo:hi]).nonzero()
        if len(bad):
            i = lo + int(bad[0])
            what = f"rank {rank}'s " + (f"chunk {rank}" if phase == "reduce-scatter" else "result")
            return (f"{what} differs from dist.all_reduce at element {i}: "
                    f"{result[i].item():g} vs {expected[i].item():g}")
    return ""


def _judge(report: Report, runs: dict, failed: dict, world_sizes) -> None:
    sizes = ", ".join(map(str, sorted(world_sizes)))
    cases = f"N = {sizes}; {', '.join(map(str, NUMELS))} elements"
    for phase in PHASES:
        if phase == "all-reduce" and any(p in failed for p in PHASES[:2]):
            report.add(ITEMS[phase], None, "judged once both phases pass")
        else:
            report.add(ITEMS[phase], phase not in failed, failed.get(phase, cases))
    done = [(phase, key, out) for phase in PHASES[:2] for key, out in runs[phase].items()]
    if not done:
        report.add(ITEMS["bytes"], None, "judged once a phase runs to the end")
        report.add(ITEMS["neighbour"], None, "judged once a phase runs to the end")
        return
    report.add(ITEMS["bytes"], *_judge_bytes(done))
    strays = [(n, r, s.dst) for _, (n, _), out in done for r, (*_, sent) in enumerate(out)
              for s in sent if s.dst != (r + 1) % n]
    report.add(ITEMS["neighbour"], not strays,
               f"rank {strays[0][1]} sent to rank {strays[0][2]} (N={strays[0][0]})" if strays else "")


def _judge_bytes(done) -> tuple[bool, str]:
    """Bytes each rank sent per phase vs the ring's: every chunk but one (the schedule's)."""
    for phase, (n, numel), out in done:
        steps = ring_reduce_scatter_steps(n) if phase == "reduce-scatter" else ring_all_gather_steps(n)
        bounds = chunk_bounds(numel, n)
        for rank, (*_, sent) in enumerate(out):
            got = sum(s.nbytes for s in sent)
            want = 4 * sum(bounds[s.chunk][1] - bounds[s.chunk][0] for step in steps for s in step
                           if s.src == rank)
            if got != want:
                rule = f"(N-1)/N·Ψ = {want}" if numel % n == 0 else f"every chunk but one = {want}"
                return False, (f"rank {rank} sent {got} bytes in the {phase}; a ring sends {rule} "
                               f"(N={n}, {numel} float32 element{'s' * (numel != 1)}, "
                               f"Ψ = {4 * numel} bytes)")
    divisible = [(n, numel) for _, (n, numel), _ in done if numel and numel % n == 0 and n > 2]
    if not divisible:
        return True, ""
    n, numel = max(divisible)
    return True, (f"e.g. N={n}, Ψ = {4 * numel} bytes: {2 * (n - 1) * 4 * numel // n} bytes per rank "
                  f"= 2(N-1)/N·Ψ")


def _trace(out) -> Trace | None:
    """The learner's all-reduce as a ``Trace`` (steps: each rank's k-th send of a phase is
    step k of it), or None if not recorded or a send was not a chunk of the tensor."""
    if out is None:
        return None
    n = len(out)
    trace = Trace("your ring (reduce-scatter + all-gather)", n, out[0][0].numel(), 4, True)
    for rank, (x, result, _, sent) in enumerate(out):
        trace.inputs[rank], trace.outputs[rank] = x, result
        counts = {p: 0 for p in PHASES[:2]}
        for s in sent:
            if s.chunk is None:
                return None
            step = counts[s.phase] + (n - 1 if s.phase == "all-gather" else 0)
            counts[s.phase] += 1
            trace.transfers.append(Transfer(s.phase, step, rank, s.dst, s.chunk, s.numel, s.nbytes,
                                            s.values))
    trace.transfers.sort(key=lambda t: (t.step, t.src, t.dst))
    return trace
