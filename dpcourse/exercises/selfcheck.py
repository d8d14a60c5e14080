"""Self-checks for the end-of-chapter questions: the learner writes an answer, a checker marks it.

    answer = {"global_batch": 1024, "accumulation_on_64": 4}
    dpc.exercises.check_answer("4.1a", 3, answer)

Numbers are compared with a relative tolerance and each expected value is derived in
front of the learner's eyes from the course's own formulas (the ring's byte count, the
memory ledger), not typed in; multiple-choice answers are letters. An answer still ``...``
is "not attempted yet".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..grading.report import Report

GiB = 2**30
REL_TOL = 0.02


@dataclass
class Question:
    """``expected()`` -> {field: value}; numbers compared with REL_TOL, strings as choices."""

    text: str
    expected: Callable[[], dict]
    why: dict  # field -> one sentence shown when the answer differs


def _ring_sent(n: int, nbytes: int) -> float:
    from ..collectives.cost import bus_factor

    return bus_factor("all_reduce", n) * nbytes  # 2(N-1)/N * S


def _model_states(strategy: str) -> float:
    from ..memory import ledger

    # DDP with gradient_as_bucket_view=True: gradients live in the buckets, no second copy
    return ledger(7_000_000_000, 8, strategy, "mixed", "adam",
                  gradient_as_bucket_view=True).total / 1e9  # GB per rank


QUESTIONS: dict[tuple[str, int], Question] = {
    ("4.1a", 3): Question(
        "micro-batch 4, 8 accumulation steps, 32 GPUs: the global batch; on 64 GPUs with the "
        "same global batch and micro-batch: the accumulation steps",
        lambda: {"global_batch": 4 * 8 * 32, "accumulation_on_64": 4 * 8 * 32 // (4 * 64)},
        {"global_batch": "global batch = micro-batch x accumulation steps x world size",
         "accumulation_on_64": "twice the ranks: half the accumulation steps"}),
    ("4.1b", 1): Question(
        "bytes each rank sends in a ring all-reduce of 1 GiB on 8 ranks (in GiB); bytes the root "
        "sends and receives in a naive reduce-then-broadcast (in GiB)",
        lambda: {"ring_sent_gib": _ring_sent(8, GiB) / GiB, "naive_root_sent_gib": (8 - 1) * 1.0,
                 "naive_root_received_gib": (8 - 1) * 1.0},
        {"ring_sent_gib": "a ring sends 2(N-1)/N x the buffer: (N-1)/N in reduce-scatter, as much in all-gather",
         "naive_root_sent_gib": "the root broadcasts the whole result to each of the N-1 others",
         "naive_root_received_gib": "the root receives a whole buffer from each of the N-1 others"}),
    ("4.1b", 2): Question(
        "model-state memory per rank (GB, 1e9 bytes) for 7B parameters, mixed-precision Adam, "
        "8 ranks, under DDP, ZeRO-1, ZeRO-2, ZeRO-3",
        lambda: {s: _model_states(s) for s in ("ddp", "zero1", "zero2", "zero3")},
        {"ddp": "16 bytes per parameter (2 + 2 + 12), nothing sharded",
         "zero1": "2 + 2 bytes kept, the 12 bytes of optimizer state divided by 8",
         "zero2": "2 bytes kept, gradients and optimizer state (14 bytes) divided by 8",
         "zero3": "all 16 bytes divided by 8"}),
    ("4.1b", 3): Question(
        "SHARD_GRAD_OP sends less than FULL_SHARD because (a) it compresses gradients, "
        "(b) it keeps the gathered parameters from forward to backward, so it does not gather "
        "them twice, (c) it does not shard the optimizer state; and it pays with (x) more "
        "memory for parameters between forward and backward, (y) a slower optimizer step",
        lambda: {"because": "b", "pays": "x"},
        {"because": "FULL_SHARD re-gathers each unit in backward; SHARD_GRAD_OP kept it",
         "pays": "the unsharded parameters stay in memory through the whole forward and backward"}),
    ("4.2a", 1): Question(
        "2 ranks holding rank + 1.0: every rank's value after all_reduce with ReduceOp.MAX; "
        "after broadcast from src=1",
        lambda: {"after_max": 2.0, "after_broadcast_from_1": 2.0},
        {"after_max": "the largest of 1.0 and 2.0, on every rank",
         "after_broadcast_from_1": "rank 1's value, copied to every rank"}),
    ("4.2a", 2): Question(
        "world_size=4, each rank holding rank + 1.0: the all_reduce (sum) result; the list "
        "all_gather gives every rank",
        lambda: {"all_reduce": float(sum(r + 1 for r in range(4))),
                 "all_gather": [float(r + 1) for r in range(4)]},
        {"all_reduce": "1 + 2 + 3 + 4", "all_gather": "every rank's value, in rank order, on every rank"}),
    ("4.2a", 5): Question(
        "2 nodes x 4 GPUs, the third process on the second node: RANK, LOCAL_RANK, WORLD_SIZE",
        lambda: {"RANK": 1 * 4 + 2, "LOCAL_RANK": 2, "WORLD_SIZE": 2 * 4},
        {"RANK": "node index x processes per node + local rank (both count from 0)",
         "LOCAL_RANK": "the third process of its node counts from 0: 2",
         "WORLD_SIZE": "every process of every node"}),
    ("4.2b", 2): Question(
        "HYBRID_SHARD on 2 nodes x 4 GPUs: which collectives cross the link between the nodes? "
        "(a) the parameter all-gathers, (b) the gradient reduce-scatter, (c) the all-reduce of "
        "gradient shards across the replicas, (d) all of them",
        lambda: {"crosses": "c"},
        {"crosses": "all-gather and reduce-scatter run inside a node (the shard group); only the "
                    "replicas' all-reduce of each shard crosses nodes"}),
}


def check_answer(chapter: str, number: int | str, answer, cluster=None) -> Report:
    """Mark the answer to question ``number`` of notebook ``chapter`` ("4.1a", "4.2b", ...) as the
    notebook numbers it, field by field.

    A try-it cell's check passes the try-it's name as ``number`` ("no_sync"), what the cell
    defines as ``answer`` and the notebook's ``cluster``: the answer runs on its ranks
    (``dpcourse.exercises.tryits``)."""
    if isinstance(number, str):
        from . import tryits

        return tryits.check(chapter, number, answer, cluster)
    key = (str(chapter), int(number))
    if key not in QUESTIONS:
        known = ", ".join(f"{c} #{n}" for c, n in sorted(QUESTIONS))
        raise ValueError(f"no self-check for chapter {chapter} question {number}; there are: {known}")
    question = QUESTIONS[key]
    report = Report(f"Self-check {chapter}, question {number}")
    expected = question.expected()
    if answer is ... or answer is None or (isinstance(answer, dict)
                                           and all(v is ... for v in answer.values())):
        report.attempted = False
        report.note = f"Fill in a dict with the keys {sorted(expected)}."
        return report
    if not isinstance(answer, dict):
        answer = {next(iter(expected)): answer} if len(expected) == 1 else {}
    for name, want in expected.items():
        got = answer.get(name, ...)
        if got is ...:
            report.add(name, None, "no answer yet")
        else:
            ok = _matches(got, want)
            report.add(name, ok, "" if ok else f"you wrote {got!r}: {question.why[name]}")
    return report


def _matches(got, want) -> bool:
    if isinstance(want, str):
        return isinstance(got, str) and got.strip().lower() == want
    if isinstance(want, list):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(
            _matches(g, w) for g, w in zip(got, want))
    try:
        got = float(got)
    except (TypeError, ValueError):
        return False
    return abs(got - want) <= REL_TOL * max(abs(want), 1e-12)
