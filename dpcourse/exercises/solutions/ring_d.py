"""Exercise D, reference solution: ring reduce-scatter and all-gather from ``isend``/``irecv``.

The starter of ``D-ring-all-reduce.ipynb`` with every ``...`` filled in. It walks the same
schedule as the course's ``dpc.collectives.ring`` (``schedule.ring_reduce_scatter_steps``
and ``ring_all_gather_steps``): at step s, rank r sends chunk (r - s - 1) mod N in the
reduce-scatter and chunk (r - s) mod N in the all-gather, always to rank r + 1.
"""
import torch
import torch.distributed as dist


def ring_reduce_scatter(tensor):
    """In place: afterwards chunk `rank` of `tensor` holds the sum over all ranks."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)  # views: writing a chunk writes the tensor
    incoming = torch.empty_like(chunks[0])    # chunk 0 is the largest
    for step in range(n - 1):
        send_c = (rank - step - 1) % n        # the chunk I pass to the right at this step
        recv_c = (rank - step - 2) % n        # the chunk my left neighbour passes to me
        buf = incoming[:chunks[recv_c].numel()]
        send = dist.isend(chunks[send_c], dst=right)
        recv = dist.irecv(buf, src=left)
        send.wait(); recv.wait()
        chunks[recv_c].add_(buf)              # my partial sum + everyone's before me


def ring_all_gather(tensor):
    """In place: rank r's chunk r of `tensor` ends up on every rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)
    for step in range(n - 1):
        send_c = (rank - step) % n            # my own chunk first, then what just arrived
        recv_c = (rank - step - 1) % n
        send = dist.isend(chunks[send_c], dst=right)
        recv = dist.irecv(chunks[recv_c], src=left)  # straight into place
        send.wait(); recv.wait()
