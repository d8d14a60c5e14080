"""Exercise E, reference solution: the bucket logic of a bucketed DDP, written out.

The starter of ``E-bucketed-ddp.ipynb`` with every ``...`` filled in. The course's own
``dpc.scratch.BucketedDDP`` does the same through ``Bucket.add_grad``, ``Bucket.launch``
and ``BucketManager.wait``; this version spells each step out on the bucket's fields.
"""
import torch.distributed as dist

from dpcourse.scratch import BucketedDDP


class MyBucketedDDP(BucketedDDP):
    """BucketedDDP's buckets (``self.buckets``, packed for you) with the logic written out."""

    def grad_ready(self, param):
        """Backward just finished ``param.grad``: copy it into its slot; launch a full bucket."""
        bucket, i = self.buckets.where[param]   # its Bucket, and its position in the bucket
        bucket.view(i).copy_(param.grad)         # the hook gets the parameter: use its .grad
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params):   # the last gradient of the bucket
            bucket.buffer.div_(self.world_size)      # sum of (g / N) over N ranks = the mean
            bucket.work = dist.all_reduce(bucket.buffer, async_op=True)  # returns at once

    def finish_gradient_synchronization(self):
        """End of backward: wait for every bucket; each param.grad becomes its averaged slot."""
        for bucket in self.buckets.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            for i, p in enumerate(bucket.params):
                p.grad = bucket.view(i)          # no copy: the gradient *is* the slot
            bucket.ready.clear()
            bucket.work = None
