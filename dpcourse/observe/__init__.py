"""Observers: measurement that attaches to a rank's code from outside.

    comm, mem = dpc.observe.Comm(), dpc.observe.Memory(step=2)
    cluster.run(train, observe=[comm, mem])      # train() is what torchrun would run
    comm.bytes(rank=0, step=-1)                   # {"all_reduce": ...}: bytes of the last step
    mem.at_rest(rank=0)                           # {"parameters": ..., "gradients": ..., ...}

| observer | what it sees | through |
|---|---|---|
| ``Comm`` | every collective and point-to-point call: bytes (logical and on the wire), group, time | the c10d operators (``dpcourse.tracking``) |
| ``Memory`` | bytes held by category, at rest and phase by phase over one step | ``MemTracker`` / ``FSDPMemTracker``, a walk of model and optimizer |
| ``Timeline`` | compute spans per layer and communication spans per collective | global module and optimizer hooks, tensor hooks, futures |
| ``Activations`` | bytes autograd saves for backward, and their peak | ``saved_tensors_hooks`` |

Each is a context manager the pool enters on every rank around the call
(``cluster.run(fn, observe=[...])``, ``cluster.run_script(path, observe=[...])``), so the
function itself has no measuring line in it; the ranks' results come back to the kernel's
observer. The same observers run around ``python -m dpcourse.train --measure ...``. Steps
are counted at ``optimizer.step()`` by one clock per process that every observer of a call
shares (``watch.StepClock``, entered through ``watch.LoopWatch``), so "step 2" is one step
for all of them; bytes of a collective are its payload S as nccl-tests defines it, one
convention for every observer (``payload.payload_bytes``). Each is an ``observer.Observer``:
``collect`` keeps the ranks' results in the kernel, ``of_rank`` reads one.
"""
from .comm import Comm
from .memory import Memory
from .saved import Activations
from .timeline import Timeline

__all__ = ["Activations", "Comm", "Memory", "Timeline"]
