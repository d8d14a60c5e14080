"""Exercise B: the learner writes a DDP and an FSDP ``FULL_SHARD`` set-up and predicts, before
running, what each rank holds and sends; the checker runs both and judges.

    report = dpc.exercises.check_b(wrap_ddp, wrap_fsdp, predicted, faster)

Both set-ups train the course's MLP (``SIZES``) for a few Adam steps on 2 ranks, under the
course's observers: ``Memory`` (what each rank holds right after the last
``optimizer.step()``), ``Comm`` (the bytes each collective makes a rank send, as a
bandwidth-optimal ring sends them) and ``Timeline`` (step time, and communication nobody
hid). Judged: each set-up trains like one process and is what it says (DDP replicates and
all-reduces; FULL_SHARD holds 1/N and gathers every unit again for backward); each of the
eight predictions holds within ``TOLERANCE``, said as too high / too low and roughly by how
much, never as the measured value; and which set-up is faster here. The explanation of the
speed, from the measured split of a step, comes with the report once ``faster`` is given.

Speed is judged on each set-up's fastest step after the first (the first builds FSDP's units
and Adam's state; interference from other processes only ever adds time), and only where one
set-up's is at least ``CLEAR`` times the other's. A closer call is timed once more; still
close, either answer holds: the two are a tie on these ranks.
"""
from __future__ import annotations

from .. import models
from ..observe import Comm, Memory, Timeline
from . import setups
from .ranks import RankFailure, blanks_in, clusters_for, run_or_failure
from .report import Report

WORLD_SIZE = 2
SIZES = {"d_hidden": 128, "depth": 4}
STEPS = 8        # Adam steps: the first warms up, the rest are timed
TOLERANCE = 0.05
CLEAR = 1.25     # a speed verdict needs one set-up's fastest step this many times the other's
CATEGORIES = ("parameters", "gradients", "optimizer_state")
NAMES = {"ddp": "DDP", "fsdp": "FULL_SHARD"}


def check_b(wrap_ddp, wrap_fsdp, predicted: dict, faster=..., cluster=None, timeout: float = 120.0) -> Report:
    """Run the learner's two set-ups on 2 ranks and judge them and the predictions.

    predicted: {"ddp": {...}, "fsdp": {...}}, each with "parameters", "gradients",
    "optimizer_state" (bytes one rank holds right after optimizer.step()) and
    "sent_per_step" (bytes one rank sends per training step). faster: "ddp" or "fsdp".
    """
    report = Report("Exercise B")
    blanks = [fn.__name__ for fn in (wrap_ddp, wrap_fsdp) if blanks_in(fn)]
    if blanks:
        report.attempted = False
        report.note = f"Write the wrapping lines in {' and '.join(blanks)} (replace the `...`), then run this cell again."
        return report
    reference = setups.one_process(SIZES, WORLD_SIZE, STEPS)
    wraps = {"ddp": wrap_ddp, "fsdp": wrap_fsdp}
    measured, fastest = {}, {}
    with clusters_for(cluster, [WORLD_SIZE]) as clusters:
        for key, wrap in wraps.items():
            memory, comm, timeline = Memory(), Comm(), Timeline()
            out = run_or_failure(clusters[WORLD_SIZE], setups.train_wrapped, wrap, SIZES, STEPS, timeout=timeout,
                                 observe=[memory, comm, timeline])
            measured[key] = None if isinstance(out, RankFailure) else (out, memory, comm, timeline)
            name = f"your {NAMES[key]} set-up trains like one process"
            if isinstance(out, RankFailure):
                report.add(name, False, out.describe(timeout))
            else:
                report.add(name, *setups.weights_verdict(out, reference))
                fastest[key] = _fastest_step(timeline)
        if faster in NAMES and len(fastest) == len(NAMES) and not _clear(fastest):
            for key, wrap in wraps.items():  # a close call: time both once more
                timeline = Timeline()
                out = run_or_failure(clusters[WORLD_SIZE], setups.train_wrapped, wrap, SIZES, STEPS,
                                     timeout=timeout, observe=[Memory(), Comm(), timeline])
                if not isinstance(out, RankFailure):
                    fastest[key] = min(fastest[key], _fastest_step(timeline))
    model = models.build_model("mlp", **SIZES)
    kinds = {"ddp": report.add("your DDP set-up replicates: every rank holds all parameters and all-reduces "
                               "the gradients", *_judge_ddp(measured["ddp"], model)),
             "fsdp": report.add("your FSDP set-up is FULL_SHARD: 1/2 of the parameters per rank, every unit "
                                "gathered again for backward", *_judge_full_shard(measured["fsdp"], model))}
    judged = {}   # (set-up, what) -> the prediction passed
    for key in ("ddp", "fsdp"):
        guesses = predicted.get(key, {}) if isinstance(predicted, dict) else {}
        for what in CATEGORIES + ("sent_per_step",):
            name = f"prediction: {NAMES[key]} {what.replace('_', ' ')}" + ("" if what == "sent_per_step" else " per rank")
            if measured[key] is None:
                report.add(name, None, "judged once the set-up runs")
                continue
            if not kinds[key].passed:  # its measurement is of another set-up than the one predicted
                report.add(name, None, f"not judged: the set-up is not {NAMES[key]}")
                continue
            _, memory, comm, _ = measured[key]
            value = sum(comm.bytes(rank=0, step=-1).values()) if what == "sent_per_step" else memory.at_rest(0)[what]
            ok, detail = setups.miss(guesses.get(what, ...), value, TOLERANCE)
            judged[key, what] = ok is True
            report.add(name, ok, detail + (_why(key, what, guesses.get(what), value) if ok is False else ""))
    report.add("prediction: the faster set-up on these ranks", *_judge_faster(faster, fastest))
    if faster is not ... and all(measured.values()):
        # the ratio of bytes sent would give one prediction away from the other: said once both passed
        report.note = _explain(measured, fastest, judged.get(("ddp", "sent_per_step"), False)
                               and judged.get(("fsdp", "sent_per_step"), False))
    return report


def _judge_ddp(run, model) -> tuple[bool | None, str]:
    if run is None:
        return None, "judged once it runs"
    _, memory, comm, _ = run
    full = 4 * sum(p.numel() for p in model.parameters())
    held = [memory.at_rest(r)["parameters"] for r in range(WORLD_SIZE)]
    calls = comm.calls(rank=0, step=-1)
    if any(h < full for h in held):
        return False, "a rank holds only part of the parameters: that is sharding, not DDP"
    if "all_reduce" not in calls or "all_gather" in calls:
        return False, (f"a step's collectives were {dict(calls)}: a replica's gradients are averaged by "
                       "all-reduce, and nothing is gathered, in a DDP step")
    return True, "a full replica on every rank; the gradients all-reduced"


def _judge_full_shard(run, model) -> tuple[bool | None, str]:
    if run is None:
        return None, "judged once it runs"
    _, memory, comm, _ = run
    full = 4 * sum(p.numel() for p in model.parameters())
    held = [memory.at_rest(r)["parameters"] / full for r in range(WORLD_SIZE)]
    calls = comm.calls(rank=0, step=-1)
    if any(abs(h - 1 / WORLD_SIZE) > 0.05 for h in held):
        return False, (f"the ranks hold {', '.join(f'{h:.0%}' for h in held)} of the parameters between steps: "
                       "FULL_SHARD shards them over all ranks")
    gathers, scatters = calls.get("all_gather", 0), calls.get("reduce_scatter", 0)
    if not scatters:
        return False, f"a step's collectives were {dict(calls)}: FSDP reduce-scatters the gradients"
    if gathers <= scatters:
        return False, (f"{gathers} all-gather(s) for {scatters} unit(s) per step: every unit was gathered "
                       "only once, so the parameters stayed gathered from forward to backward -- that is "
                       "SHARD_GRAD_OP (reshard_after_forward=False), or a single unit for the whole model, "
                       "which FSDP keeps gathered: make each block a unit of its own")
    return True, "sharded over both ranks; every unit gathered again for backward"


def _why(key: str, what: str, guess, value: float) -> str:
    """A hint for a prediction off by a telling factor (from the factor alone, not the value)."""
    if not isinstance(guess, (int, float)) or isinstance(guess, bool) or not guess or not value:
        return ""
    ratio = guess / value
    near = lambda x: abs(ratio - x) < 0.1 * x  # noqa: E731
    if what == "optimizer_state" and any(near(x) for x in (0.5, 2, 0.25, 4)):
        keeps = "a full replica" if key == "ddp" else "1/N of it"
        return (f" -- {NAMES[key]} keeps {keeps} per rank; and how many tensors the size of the parameters "
                "does Adam keep per parameter?")
    if key == "fsdp" and what in CATEGORIES and near(WORLD_SIZE):
        return " -- FULL_SHARD keeps 1/N of it per rank, between steps too"
    if key == "ddp" and what in CATEGORIES and near(1 / WORLD_SIZE):
        return " -- DDP keeps a full replica on every rank"
    if what == "sent_per_step" and (near(WORLD_SIZE / (WORLD_SIZE - 1)) or near(2 * WORLD_SIZE / (WORLD_SIZE - 1))):
        return " -- in a ring, a rank sends (N-1)/N of the data per phase, not all of it"
    if what == "sent_per_step" and key == "fsdp" and (near(2 / 3) or near(1.5)):
        return " -- count FULL_SHARD's collectives: how often is each unit gathered in a step?"
    if what in CATEGORIES and (near(0.5) or near(2)):
        return " -- bytes, for float32 elements"
    return ""


def _fastest_step(timeline: Timeline) -> float:
    seconds = timeline.step_seconds(rank=0)
    return min(seconds[1:] or seconds)


def _clear(fastest: dict) -> bool:
    return max(fastest.values()) >= CLEAR * min(fastest.values())


def _judge_faster(faster, fastest: dict) -> tuple[bool | None, str]:
    """The answer against each set-up's fastest step on rank 0 (seconds, by "ddp"/"fsdp")."""
    if faster is ... or faster is None:
        return None, "no prediction yet"
    if faster not in NAMES:
        return False, f"answer 'ddp' or 'fsdp', not {faster!r}"
    if len(fastest) < len(NAMES):
        return None, "judged once both set-ups run"
    if not _clear(fastest):
        return True, (f"too close to call on these ranks (the fastest steps within {CLEAR - 1:.0%} of each "
                      "other, timed twice), so either answer holds; the note below gives the split")
    won = min(fastest, key=fastest.get)
    if faster == won:
        return True, "as measured; the note below says why"
    return False, f"on these ranks {NAMES[won]}'s steps took less time; the note below says why"


def _explain(measured, fastest: dict, ratio_known: bool) -> str:
    """Why one set-up is faster here, from the measured split of a step; the ratio of the bytes
    the two send only when ``ratio_known`` (both predictions of it passed)."""
    parts, sent = [], {}
    for key, (_, _, comm, timeline) in measured.items():
        summary = timeline.summary(rank=0)
        calls = sum(comm.calls(rank=0, step=-1).values())
        sent[key] = sum(comm.bytes(rank=0, step=-1).values())
        parts.append(f"{NAMES[key]}'s fastest step took {fastest[key] * 1e3:.1f} ms; its last one issued {calls} "
                     f"collective(s), with {summary['exposed_s'] * 1e3:.1f} ms of communication no compute hid")
    more = (f"{sent['fsdp'] / sent['ddp']:.1f} times DDP's bytes" if sent["ddp"] and ratio_known
            else "more bytes than DDP")
    head = "Measured on rank 0, after the first step: " + "; ".join(parts) + ". "
    tail = (" On GPUs with large layers, FSDP prefetches the next unit's gather while the current one "
            "computes, and most of its communication hides.")
    if not _clear(fastest):
        return head + (f"This run does not separate them (fastest steps within {CLEAR - 1:.0%}). FULL_SHARD issues "
                       f"more collectives and sends {more}: each collective pays a fixed cost whatever its size, "
                       "which shows wherever compute cannot hide it.") + tail
    if min(fastest, key=fastest.get) == "ddp":
        return head + ("Every collective pays a fixed cost whatever its size, and this small model has little "
                       "compute to hide it behind, so FULL_SHARD's many small gathers and reduce-scatters cost "
                       f"more than DDP's one or two all-reduces, although it sends only {more}.") + tail
    return head + ("FULL_SHARD's steps were the shorter here: its collectives hid under compute or cost little "
                   f"on this backend, and each rank updates only 1/{WORLD_SIZE} of Adam's state, although it sends "
                   f"{more}.") + tail
