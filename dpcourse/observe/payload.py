"""The bytes of one collective: its payload S, as nccl-tests defines it, said once for the package.

nccl-tests (NVIDIA/nccl-tests, ``doc/PERFORMANCE.md``) sizes every collective by one number S:
the buffer all ranks hold in full -- all_reduce's and broadcast's tensor, **all_gather's
output** (every rank's share), **reduce_scatter's input** (the whole tensor each rank
reduces), all_to_all's input -- so that busbw = S / time x a factor of N alone
(``dpcourse.collectives.cost.bus_factor``). ``Comm``'s records, ``Timeline``'s spans and
the exercise checkers' logs all count S through ``payload_bytes``: a reduce-scatter of a
4-rank group is the same number of bytes in each, not its 1/4 output in one of them.

For ``gather`` and ``scatter`` S here is one rank's share (gather's input, scatter's output);
a barrier carries nothing. A send or receive: its message.
"""
from __future__ import annotations

import torch

# collectives whose S is the input: the c10d operators take (output, input, ...) and hand
# their output back, so everything else reads its first argument
FROM_INPUT = ("reduce_scatter", "all_to_all", "gather")
NO_PAYLOAD = ("barrier",)


def tensor_bytes(arg) -> int:
    """Bytes of every tensor in ``arg`` (a tensor, or nested lists and tuples of them); 0 else."""
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(tensor_bytes(a) for a in arg)
    return 0


def first_tensor(arg) -> torch.Tensor | None:
    """The first tensor in a c10d op's argument (a tensor or nested lists of them)."""
    if isinstance(arg, torch.Tensor):
        return arg
    if isinstance(arg, (list, tuple)):
        return next((t for t in map(first_tensor, arg) if t is not None), None)
    return None


def payload_bytes(collective: str, output, input=None) -> int:
    """S in bytes for ``collective`` ("all_reduce", "reduce_scatter", "send", ... as in
    ``torch.distributed``) given its ``output`` and ``input`` tensors (or lists of them; an
    in-place one: the tensor as ``output``)."""
    if collective in NO_PAYLOAD:
        return 0
    return tensor_bytes(input if collective in FROM_INPUT else output)


def issued_bytes(issued) -> int:
    """S of one call the collective tracker saw (``tracking.records.Issued``): a c10d operator's
    arguments are (output, input, ...), a point-to-point call's (tensor, peer, group)."""
    args = issued.args
    if not args:
        return 0
    return payload_bytes(issued.collective, args[0], args[1] if len(args) > 1 else None)
