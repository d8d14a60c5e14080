"""``nn.DataParallel`` emulated on CPU threads: one process, one thread per "device".

    dp = ThreadedDataParallel(model, num_devices=2)
    loss_fn(dp(x), y).backward()       # gradients summed onto the primary replica (device 0)
    dp.memory                          # bytes per device, by category, of the last step

What ``nn.DataParallel`` does on every forward (torch/nn/parallel/data_parallel.py), done
here with plain tensors and threads because on a CPU-only machine DataParallel just calls
the module:

1. replicate: copy the primary module's parameters and buffers to every other device;
2. scatter: split the batch along dim 0 (``Tensor.chunk``), one piece per device;
3. parallel apply: run each replica on its piece in its own thread;
4. gather: concatenate the outputs on the primary device, where the loss is computed.

In backward, DataParallel's autograd engine runs one thread per GPU, and the replicas'
gradients are summed onto the primary device (``Broadcast``'s backward, a reduce-add).
The CPU engine runs all CPU work on the thread that called ``backward``, so the gather's
backward starts one thread per replica itself, then copies each replica's gradients to
the primary device and adds them there.

Threads share one interpreter: while a thread runs Python (module calls, hooks) it holds
the global interpreter lock (GIL) and the others wait; only inside long C++ kernels do they
really run side by side. ``measure_speedup`` shows what that leaves of N devices.
"""
from __future__ import annotations

import copy
import threading
import time

import torch
from torch import nn

# What DataParallel puts on each device in one step (bytes by role; not the ledger's categories).
DP_DEVICE_BYTES = ("parameters", "inputs", "activations", "outputs", "gathered_outputs",
                   "gradients", "incoming_gradients")


def _nbytes(tensors) -> int:
    """Bytes of the unique storages behind ``tensors``."""
    seen = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _run_threads(fns) -> list:
    """Run the callables in one thread each; return their results; re-raise the first error."""
    results, errors = [None] * len(fns), [None] * len(fns)

    def worker(i):
        try:
            results[i] = fns[i]()
        except BaseException as err:  # noqa: BLE001 -- re-raised in the caller's thread
            errors[i] = err

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, err in enumerate(errors):
        if err is not None:
            raise RuntimeError(f"in replica {i} (device {i})") from err
    return results


class _Gather(torch.autograd.Function):
    """Concatenate the replicas' outputs; in backward, run each replica's backward in its own
    thread and reduce the replicas' gradients onto the primary device."""

    @staticmethod
    def forward(ctx, dp, anchor, *outputs):
        ctx.dp = dp
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, grad):
        dp = ctx.dp
        outputs, dp._outputs = dp._outputs, None
        grads = grad.split([o.shape[0] for o in outputs])
        jobs = [lambda o=o, g=g: torch.autograd.backward(o, g) for o, g in zip(outputs, grads)]
        _run_threads(jobs) if dp.threads else [job() for job in jobs]
        dp._reduce_gradients()
        return (None, None) + (None,) * len(outputs)


class ThreadedDataParallel(nn.Module):
    """DataParallel's scatter / replicate / parallel-apply / gather on ``num_devices`` threads.

    ``threads=False`` runs the same replicas one after another on the calling thread (the
    baseline for the speed-up). ``memory``: after each backward, one dict per device of
    bytes by category (``DP_DEVICE_BYTES``); the primary device (0) alone holds the gathered
    outputs and receives the other replicas' gradients.
    """

    def __init__(self, module: nn.Module, num_devices: int = 2, threads: bool = True):
        super().__init__()
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
            raise ValueError(f"num_devices must be a whole number >= 1, not {num_devices!r}")
        self.module = module
        self.num_devices, self.threads = num_devices, threads
        # plain list: the replicas are copies, not parameters of this module
        self._replicas = [module] + [copy.deepcopy(module) for _ in range(num_devices - 1)]
        self._outputs = None
        self._anchor = torch.zeros((), requires_grad=True)
        self.memory = [dict.fromkeys(DP_DEVICE_BYTES, 0) for _ in range(num_devices)]

    def _replicate(self) -> None:
        """Copy the primary's parameters and buffers into every replica (DataParallel's
        broadcast; it happens at every forward because the primary was just updated)."""
        with torch.no_grad():
            for replica in self._replicas[1:]:
                for dst, src in zip(replica.parameters(), self.module.parameters()):
                    dst.copy_(src)
                    dst.grad = None
                for dst, src in zip(replica.buffers(), self.module.buffers()):
                    dst.copy_(src)

    def _apply_one(self, d: int, chunk: torch.Tensor) -> torch.Tensor:
        """Device d's forward; counts the storages autograd saves for backward (activations)."""
        saved = []

        def pack(t):
            saved.append(t)
            return t

        replica = self._replicas[d]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = replica(chunk)
        known = {p.untyped_storage().data_ptr() for p in replica.parameters()}
        known.add(chunk.untyped_storage().data_ptr())
        mem = self.memory[d]
        mem.update(dict.fromkeys(DP_DEVICE_BYTES, 0), parameters=_nbytes(replica.parameters()),
                   inputs=_nbytes([chunk]), outputs=_nbytes([out]),
                   activations=_nbytes(t for t in saved if t.untyped_storage().data_ptr() not in known))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.num_devices:
            raise ValueError(f"a batch of {x.shape[0]} samples cannot be split over "
                             f"{self.num_devices} devices; use a batch of at least {self.num_devices}")
        self._replicate()
        chunks = [c.clone() for c in x.chunk(self.num_devices)]  # each device gets its own copy
        jobs = [lambda d=d, c=c: self._apply_one(d, c) for d, c in enumerate(chunks)]
        outputs = _run_threads(jobs) if self.threads else [job() for job in jobs]
        if not torch.is_grad_enabled():
            return torch.cat(outputs)
        self._outputs = outputs
        gathered = _Gather.apply(self, self._anchor, *[o.detach() for o in outputs])
        self.memory[0]["gathered_outputs"] = _nbytes([gathered])
        return gathered

    def _reduce_gradients(self) -> None:
        """Copy every replica's gradients to the primary device and add them there."""
        primary = [p for p in self.module.parameters()]
        self.memory[0]["gradients"] = _nbytes(p.grad for p in primary)
        for d, replica in enumerate(self._replicas[1:], start=1):
            grads = [p.grad for p in replica.parameters()]
            self.memory[d]["gradients"] = _nbytes(grads)
            incoming = [g.clone() if g is not None else None for g in grads]  # the transfer
            self.memory[0]["incoming_gradients"] = max(self.memory[0]["incoming_gradients"], _nbytes(incoming))
            with torch.no_grad():
                for p, g in zip(primary, incoming):
                    if g is None:
                        continue
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)
            for p in replica.parameters():
                p.grad = None  # the replica (and its gradients) are dropped after backward
        self.memory[0]["gradients"] = _nbytes(p.grad for p in primary)


def measure_speedup(module_fn, x, y, loss_fn, num_devices: int = 2, steps: int = 5,
                    rounds: int = 3) -> dict:
    """Seconds per forward+backward with replicas in threads vs one after another.

    module_fn() builds the model; x, y: the global batch. Each "device" gets one CPU core
    (``torch.set_num_threads(1)`` while measuring), as a GPU would be one device. Medians
    over ``rounds`` interleaved rounds of ``steps`` steps. Returns seconds per step
    (``threads``, ``sequential``), and ``speedup`` = sequential / threads.
    """
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {"threads": [], "sequential": []}
        models = {k: ThreadedDataParallel(module_fn(), num_devices, threads=(k == "threads")) for k in times}
        for _ in range(rounds):
            for kind, dp in models.items():
                loss_fn(dp(x), y).backward()  # warm-up
                start = time.perf_counter()
                for _ in range(steps):
                    loss_fn(dp(x), y).backward()
                times[kind].append((time.perf_counter() - start) / steps)
    finally:
        torch.set_num_threads(threads_before)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"threads": med["threads"], "sequential": med["sequential"],
            "speedup": med["sequential"] / med["threads"], "num_devices": num_devices}
