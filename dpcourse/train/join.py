"""Joining the process group under torchrun: restarts that never meet a dead attempt, bounded waits.

``dist.init_process_group(backend)`` under torchrun reads ``MASTER_ADDR``/``MASTER_PORT``.
In PyTorch 2.13 the c10d rendezvous (``--standalone``, ``--rdzv-backend c10d``) points them
at a TCP store that the elastic agent keeps for the whole job (``TORCHELASTIC_USE_AGENT_STORE``):
every attempt after a restart joins the *same* store, with the same keys. ``rendezvous.py``
says "We create a new TCPStore for every retry so no need to add prefix for each attempt",
but with the shared store it is the same one, so a restarted worker can read the dead
attempt's addresses: Gloo fails at once ("connectFullMesh failed ... Connection refused") or
waits for a peer that no longer exists (pytorch/pytorch#135712). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
on the *agent* avoids it; a plain torchrun command does not set it.

``join`` gives each attempt its own keys instead, under any torchrun command line. The
attempt's name must be the same on every worker of every node, and ``TORCHELASTIC_RESTART_COUNT``
is not: an agent restarted by another node's failure does not count a restart. So global
rank 0 draws the name from the store (an atomic counter) and hands it to each rank, and each
side first deletes what a dead attempt could have left for it:

* rank r > 0 deletes ``answer/r``, then writes ``ask/r`` until ``answer/r`` appears;
* rank 0 deletes every ``ask/r``, draws the attempt number, and answers each ``ask/r`` that
  appears after that (so it was written by this attempt's rank r).

Then ``init_process_group`` runs on ``PrefixStore(attempt, store)``. Every wait is bounded by
``timeout`` (``--pg-timeout``; Gloo's default is 30 minutes), and a rank that cannot join
says what it waited for, so torchrun's agent can restart it instead of it hanging.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist


class JoinError(RuntimeError):
    """A rank could not join the process group within the timeout (the message says why)."""


def join(backend: str, timeout_s: float) -> None:
    """``dist.init_process_group(backend, timeout=...)``, safe across torchrun's restarts."""
    timeout = timedelta(seconds=timeout_s)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    where = (f"MASTER_ADDR={os.environ.get('MASTER_ADDR')} MASTER_PORT={os.environ.get('MASTER_PORT')}, "
             f"WORLD_SIZE={world}")
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            dist.init_process_group(backend, timeout=timeout)
            return
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        attempt = _attempt(agent, f"dpcourse/{run}/join/", rank, world, timeout_s)
        store = dist.PrefixStore(f"dpcourse/{run}/attempt{attempt}/", agent)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    except JoinError as err:
        raise JoinError(f"{err} ({where}; --pg-timeout {timeout_s:g} s)") from None
    except (dist.DistError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise JoinError(f"rank {rank} could not join the process group within --pg-timeout "
                        f"{timeout_s:g} s ({where}): {first}. Is every rank started, and can it reach "
                        "MASTER_ADDR:MASTER_PORT?") from err


def _attempt(store, ns: str, rank: int, world: int, timeout_s: float) -> int:
    """This attempt's number, the same on every rank (see the module's docstring)."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        for r in range(1, world):
            store.delete_key(f"{ns}ask/{r}")
        attempt = store.add(f"{ns}attempts", 1)
        waiting = set(range(1, world))
        while waiting:
            for r in sorted(waiting):
                if store.check([f"{ns}ask/{r}"]):
                    store.set(f"{ns}answer/{r}", str(attempt))
                    waiting.discard(r)
            if waiting and time.monotonic() > deadline:
                raise JoinError(f"rank 0 waited {timeout_s:g} s for rank(s) "
                                f"{', '.join(map(str, sorted(waiting)))} to join; is every rank started?")
            time.sleep(0.005)
        return attempt
    store.delete_key(f"{ns}answer/{rank}")
    while True:
        store.set(f"{ns}ask/{rank}", "1")  # again and again: rank 0 deletes asks it did not see
        until = min(deadline, time.monotonic() + 0.25)
        while time.monotonic() < until:
            if store.check([f"{ns}answer/{rank}"]):
                return int(store.get(f"{ns}answer/{rank}"))
            time.sleep(0.005)
        if time.monotonic() >= deadline:
            raise JoinError(f"rank {rank} waited {timeout_s:g} s for rank 0 to admit it to the process "
                            "group; is rank 0 started?")
