"""PyTorch errors a learner's code often meets on the ranks, each with the course's sentence
naming its likely cause.

A failed "runs on every rank" (or "runs to completion") item keeps PyTorch's own message,
which says what went wrong inside PyTorch, and adds the one sentence here that says which
habit of the learner's code usually leads there:

    detail = with_hint(message)      # the message, then the course's sentence when one is known

The patterns are searched in the error's text (its exception line, or the excerpt of a
traceback), first match wins: a more specific pattern comes before a general one, and a
rank's own error before the echo of a peer that failed (the last entry).
"""
from __future__ import annotations

import re

# (pattern in PyTorch's message, the course's sentence on its likely cause)
KNOWN: list[tuple[re.Pattern, str]] = [
    (re.compile(r"Invariant encountered"),
     "Likely cause: fully_shard met parameters that an earlier fully_shard call had already "
     "taken -- e.g. the root was sharded before its blocks. Shard the blocks first and the root "
     "last: the root's unit takes the parameters no inner unit took."),
    (re.compile(r"shared with a parameter already managed by another FSDP group"),
     "Likely cause: one Parameter used by two modules (a tied embedding and head, say) was put in "
     "two FSDP units; a shared parameter belongs to one unit -- which unit can hold both of its users?"),
    (re.compile(r"Expected to have finished reduction in the prior iteration"),
     "Likely cause: some parameters DDP holds took no part in the loss, so their gradients never "
     "came and DDP still waited for them when the next iteration began: every parameter must "
     "reach the loss, or DDP must be told to look for unused ones (find_unused_parameters)."),
    (re.compile(r"invalid tensor size|[Mm]ismatch(?:ed)? (?:between )?collectives?|collective.{0,40}mismatch|"
                r"[Mm]ismatched (?:tensor )?(?:shapes?|sizes?)|Received data size doesn't match", re.DOTALL),
     "Likely cause: the ranks met in the same collective with tensors of different shapes -- "
     "their code took different paths (a rank ran a collective the others did not, or another "
     "one at that point), or they hold differently sized data."),
    (re.compile(r"Connection (?:reset|closed) by peer|Broken pipe"),
     "Likely cause: another rank failed or left first, and this rank only lost its connection to "
     "it: look for the first rank's own error (a rank that raised, exited or skipped a collective "
     "the others ran)."),
]


_PEER_LOST = KNOWN[-1][0]


def lost_a_peer(text: str) -> bool:
    """Whether ``text`` is a rank's error that only says it lost its connection to a peer."""
    return bool(_PEER_LOST.search(text or ""))


def first_cause(output: str, width: int = 240) -> str | None:
    """The first line of a run's ``output`` that holds a known error of a rank's own (not one
    that only lost a peer), prefixes such as ``[rank1]:`` and ``what():`` left out; None: none."""
    for line in (output or "").splitlines():
        if any(pattern.search(line) for pattern, _ in KNOWN[:-1]):
            line = re.sub(r"^\s*(\[(default)?rank\d+\]:\s*)?(what\(\):\s*)?(\[enforce fail at [^\]]*\]\s*)?", "",
                          line).strip()
            return line if len(line) <= width else line[:width - 3] + "..."
    return None


def hint(text: str) -> str | None:
    """The course's sentence for the first known pattern in ``text``; None when none is known."""
    for pattern, sentence in KNOWN:
        if pattern.search(text or ""):
            return sentence
    return None


def with_hint(text: str, sep: str = "\n") -> str:
    """``text`` as it is, followed (after ``sep``) by the course's sentence when one is known."""
    sentence = hint(text)
    return text if sentence is None or sentence in text else f"{text}{sep}{sentence}"
