"""The pool's process group on a rank: start it, keep it, and give way to torchrun-style scripts.

Runs on the ranks. A rank starts with the pool's default group initialised, so notebook
functions can call ``dist.all_reduce`` at once. Two kinds of learner code disagree with that:

* torchrun-style scripts (``cluster.run_script``) call ``init_process_group`` and
  ``destroy_process_group`` themselves. The rank steps aside: it destroys its group, runs
  the script as ``__main__`` with torchrun's environment on a fresh port, then restores
  its environment and initialises its own group again.
* a function that calls ``init_process_group`` while the pool's group exists gets an error
  that says what to do instead of PyTorch's "initialize the default process group twice";
  one that destroys the group is reported to the kernel, which re-initialises it on every
  rank before the next call.

A group destroyed during a call or a script is kept alive until it has returned. PyTorch
2.13 can deadlock otherwise: when a script ends, DDP's C++ Reducer may drop the last
reference to a Gloo group while holding the GIL, and the group's destructor then waits for a
Gloo worker thread that is itself waiting for the GIL to free a finished collective's
tensors (seen in about one of six ``train_ddp`` runs back to back on 2 cores). Dropped here,
afterwards, a group is freed through its Python object, whose destructor releases the GIL
first.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys

from ...backends import uses_cuda
from ...patching import patched
from ...torch_private import process_groups

# The process group's own timeout. The pool enforces the learner's timeout itself and
# kills stuck ranks; Gloo's default (30 min) would only get in the way.
PG_TIMEOUT = datetime.timedelta(days=1)

ALREADY_INITIALISED = (
    "init_process_group() was called, but this rank already belongs to the cluster's "
    "process group (backend {backend}, world size {world_size}): `dist` is ready to use. "
    "Drop the init_process_group/destroy_process_group calls from code you run with "
    "cluster.run or %%ranks -- or run torchrun-style code unchanged, as a script that "
    "initialises its own group: cluster.run_script('train.py') or a %%ranks --script cell.")


class PoolGroup:
    """The rank's default process group, as the pool manages it."""

    def __init__(self, backend: str, rank: int, world_size: int):
        self.backend, self.rank, self.world_size = backend, rank, world_size
        self.scripts_running = 0  # > 0 while a script owns init/destroy
        self.retired = []  # groups destroyed during the current call: freed after it (release)

    def init(self, port: int) -> None:
        """Join the pool's group (collective: every rank calls it with the same port)."""
        import torch
        import torch.distributed as dist

        device_id = None
        if uses_cuda(self.backend):
            local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
            torch.cuda.set_device(local_rank)
            device_id = torch.device("cuda", local_rank)
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(self.backend, init_method="env://", rank=self.rank,
                                world_size=self.world_size, timeout=PG_TIMEOUT,
                                device_id=device_id)

    @contextlib.contextmanager
    def guarded(self):
        """For one call: ``init_process_group`` explains itself when the pool's group already
        exists, and the groups the call destroys stay alive until it has returned. The real
        functions are back afterwards (PyTorch has no hook for either; nested: a no-op)."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        original, original_destroy = c10d.init_process_group, c10d.destroy_process_group
        if getattr(original, "_dpcourse_guard", False):
            yield
            return

        def init_process_group(*args, **kwargs):
            if self.scripts_running == 0 and dist.is_initialized():
                raise RuntimeError(ALREADY_INITIALISED.format(
                    backend=dist.get_backend(), world_size=dist.get_world_size()))
            return original(*args, **kwargs)

        def destroy_process_group(group=None):
            if dist.is_initialized():
                if group is None or group == c10d.GroupMember.WORLD:
                    self.retired.extend(process_groups())  # the default group and every subgroup
                else:
                    self.retired.append(group)
            return original_destroy(group)

        for guard, fn in ((init_process_group, original), (destroy_process_group, original_destroy)):
            guard.__doc__, guard.__wrapped__ = fn.__doc__, fn
            guard._dpcourse_guard = True
        guards = {"init_process_group": init_process_group, "destroy_process_group": destroy_process_group}
        with patched(c10d, **guards), patched(dist, **guards):  # both names a learner may call
            yield

    def release(self) -> None:
        """Free the groups destroyed since the last release (see the module's docstring)."""
        self.retired.clear()

    @staticmethod
    def intact() -> bool:
        import torch.distributed as dist

        return dist.is_initialized()

    @contextlib.contextmanager
    def script(self, path: str, argv: list[str], port: int, env: dict | None = None):
        """Run the body as torchrun would run ``path``: no group, the environment ``env`` (a process
        started from the kernel now would have it) with torchrun's variables, ``sys.argv``.

        Afterwards the script's group (if it left one) is destroyed and the environment and
        ``sys.argv`` are restored; the rank joins the pool's group again with ``rejoin``.
        """
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        saved_env = dict(os.environ)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.environ.update(torchrun_env(self.rank, self.world_size, port))
        self.scripts_running += 1
        try:
            with patched(sys, argv=[path, *argv]):
                yield
        finally:
            self.scripts_running -= 1
            os.environ.clear()
            os.environ.update(saved_env)
            if dist.is_initialized():  # the script did not destroy its group
                dist.destroy_process_group()

    def rejoin(self, port: int) -> None:
        """After a script: join the pool's group again on ``port`` (every rank, together)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.release()
        self.init(port)


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables ``torchrun --standalone --nproc_per_node=world_size`` gives each worker."""
    n = str(world_size)
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n, "ROLE_WORLD_SIZE": n,
            "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": f"dpcourse-{port}", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
