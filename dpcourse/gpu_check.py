"""``python -m dpcourse.gpu_check``: the course's GPU path end to end, in a few minutes.

On a machine with CUDA devices it starts one rank per GPU (at most 8) with ``backend="auto"``
and checks, printing one line each:

1. the backend is ``"cpu:gloo,cuda:nccl"`` and each rank computes on its own GPU;
2. NCCL collectives on CUDA tensors (all_reduce, broadcast, all_gather_into_tensor,
   reduce_scatter_tensor, all_to_all_single, send/recv around a ring) give the values a
   formula gives, and a CPU tensor's all_reduce (Gloo) on the same group does too;
3. one DDP step and one FSDP2 (``fully_shard``) step on CUDA equal one process's step;
4. ``dpc.observe.Memory`` at rest against ``torch.cuda.memory_allocated`` at that moment;
5. exercises A's and F's checkers on their reference solutions (torchrun, 2 ranks: needs 2 GPUs).

Where there is no CUDA device it prints one line and exits 0. ``--cpu`` runs items 1-4 on
Gloo and CPU tensors instead (a dry run of this script on any machine); the exit code is 1
when a check failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist


# --- run on the ranks -------------------------------------------------------------------------
def _device():
    from dpcourse.backends import rank_device

    return rank_device()


def placement():
    return dist.get_backend(), str(_device()), torch.cuda.is_available() and torch.cuda.current_device()


def collectives():
    """Each collective's result on this rank, next to what it must be."""
    rank, n, dev = dist.get_rank(), dist.get_world_size(), _device()
    checks = {}
    t = torch.full((4,), rank + 1.0, device=dev)
    dist.all_reduce(t)
    checks["all_reduce"] = (t.cpu(), torch.full((4,), n * (n + 1) / 2))
    t = torch.full((3,), float(rank), device=dev) if rank else torch.arange(3.0, device=dev)
    dist.broadcast(t, src=0)
    checks["broadcast"] = (t.cpu(), torch.arange(3.0))
    out = torch.empty(2 * n, device=dev)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=dev))
    checks["all_gather_into_tensor"] = (out.cpu(), torch.arange(n).repeat_interleave(2).float())
    out = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * n, device=dev) + rank)
    base = torch.arange(2.0 * n)[2 * rank: 2 * rank + 2]
    checks["reduce_scatter_tensor"] = (out.cpu(), n * base + n * (n - 1) / 2)
    out = torch.empty(n, device=dev)
    dist.all_to_all_single(out, torch.arange(n, device=dev, dtype=torch.float32) + 10 * rank)
    checks["all_to_all_single"] = (out.cpu(), torch.arange(n).float() * 10 + rank)
    if n > 1:
        got = torch.empty(2, device=dev)
        ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank), device=dev), (rank + 1) % n),
               dist.P2POp(dist.irecv, got, (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        checks["send/recv ring"] = (got.cpu(), torch.full((2,), float((rank - 1) % n)))
    cpu = torch.full((2,), rank + 1.0)
    dist.all_reduce(cpu)  # a CPU tensor on the same group: Gloo's half of "cpu:gloo,cuda:nccl"
    checks["all_reduce of a CPU tensor"] = (cpu, torch.full((2,), n * (n + 1) / 2))
    return {name: bool(torch.allclose(got, want)) for name, (got, want) in checks.items()}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8 * 4, 16, generator=g), torch.randn(8 * 4, 4, generator=g)


def single_process_step() -> dict:
    model = _model().double()
    x, y = (t.double() for t in _batch())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return {k: v.float() for k, v in model.state_dict().items()}


def ddp_step() -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev, rank, n = _device(), dist.get_rank(), dist.get_world_size()
    model = DDP(_model().to(dev), device_ids=[dev] if dev.type == "cuda" else None)
    x, y = (t.chunk(n)[rank].to(dev) for t in _batch())
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {k: v.cpu() for k, v in model.module.state_dict().items()}


def fsdp2_step() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dev, rank, n = _device(), dist.get_rank(), dist.get_world_size()
    model = _model().to(dev)
    mesh = init_device_mesh(dev.type, (n,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = (t.chunk(n)[rank].to(dev) for t in _batch())
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}


def memory_loop(steps: int = 5) -> int:
    """A plain Adam loop on this rank's device; the bytes allocated right after the last step."""
    dev = _device()
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(dev)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 256, device=dev)
    allocated = 0
    for _ in range(steps):
        model(x).sum().backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated(dev)
        opt.zero_grad()
    return allocated


# --- the kernel's side -------------------------------------------------------------------------
class Checks:
    def __init__(self):
        self.failed = 0

    def line(self, name: str, ok: bool, detail: str = "") -> None:
        self.failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)


def _same(got: dict, want: dict, atol: float = 1e-5) -> tuple[bool, str]:
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    return worst <= atol, f"largest difference {worst:.2e}"


def run(cpu: bool = False, world_size: int | None = None) -> int:
    import dpcourse as dpc
    from dpcourse.backends import GPU_BACKEND

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and not cpu:
        print(f"gpu_check: skipped, no CUDA device here (torch {torch.__version__}); "
              "--cpu runs the same checks on CPU ranks", flush=True)
        return 0
    n = world_size or (2 if cpu else min(gpus, 8))
    checks, start = Checks(), time.monotonic()
    with dpc.Cluster(n, backend="gloo" if cpu else "auto", timeout=240) as cluster:
        want = "gloo" if cpu else GPU_BACKEND
        where = cluster.run(placement)
        devices = [d for _, d, _ in where]
        expected = ["cpu"] * n if cpu else [f"cuda:{r}" for r in range(n)]
        checks.line(f"{n} ranks, backend {cluster.backend!r}, devices {devices}",
                    cluster.backend == want and devices == expected)
        results = cluster.run(collectives)
        for name in results[0]:
            checks.line(f"collective {name}", all(r[name] for r in results))
        reference = single_process_step()
        for name, fn in (("DDP", ddp_step), ("FSDP2", fsdp2_step)):
            out = cluster.run(fn)
            ok, detail = _same(out[0], reference)
            checks.line(f"{name} step equals one process's", ok and all(_same(o, reference)[0] for o in out),
                        detail)
        mem = dpc.observe.Memory()
        allocated = cluster.run(memory_loop, observe=[mem])
        for rank in range(n):
            held = sum(mem.at_rest(rank).values())
            if cpu:
                checks.line(f"Memory observer on rank {rank} (CPU: nothing to compare)", held > 0,
                            f"{held} bytes at rest")
            else:
                gap = abs(held - allocated[rank])
                checks.line(f"Memory observer on rank {rank} against torch.cuda.memory_allocated",
                            gap <= max(2**20, 0.05 * allocated[rank]),
                            f"{held} bytes at rest, {allocated[rank]} allocated")
    if not cpu and gpus < 2:
        print("skip exercises A and F: their checkers run 2 ranks under torchrun, one GPU each; "
              f"this machine has {gpus}", flush=True)
    elif not cpu:
        with tempfile.TemporaryDirectory() as work:
            for key, check in (("A", dpc.exercises.check_a), ("F", dpc.exercises.check_f)):
                path = os.path.join(work, f"solution_{key}.py")
                with open(path, "w") as f:
                    f.write(dpc.exercises.solution(key))
                report = check(path)
                checks.line(f"exercise {key}'s checker on its reference, with CUDA", report.passed,
                            "" if report.passed else str(report))
    took = time.monotonic() - start
    print(f"gpu_check: {'all passed' if not checks.failed else f'{checks.failed} failed'} in {took:.0f} s",
          flush=True)
    return 1 if checks.failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU ranks (Gloo): a dry run")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: one per GPU, at most 8)")
    args = parser.parse_args(argv)
    return run(cpu=args.cpu, world_size=args.world_size)


if __name__ == "__main__":
    sys.exit(main())
