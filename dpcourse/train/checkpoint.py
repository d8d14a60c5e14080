"""Save and resume with torch.distributed.checkpoint (DCP), at any world size.

``get_state_dict`` / ``set_state_dict`` give the same view of a model and its optimizer for
DDP, FSDP1 and FSDP2, and DCP writes each rank's shards in parallel; loading reshards, so a
run saved by 4 ranks resumes on 2 with its optimizer state.
"""
from __future__ import annotations

import json
import os

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_PROGRESS = "progress.json"


def save(path: str, model, optimizer, step: int) -> None:
    """Write model + optimizer state (every rank its own shards) and the step count (rank 0)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    if dist.get_rank() == 0:
        with open(os.path.join(path, _PROGRESS), "w") as f:
            json.dump({"step": step, "world_size": dist.get_world_size()}, f)
    dist.barrier()  # nobody reads the checkpoint before it is complete


def load(path: str, model, optimizer) -> int:
    """Restore model + optimizer state in place (resharding as needed); return the saved step."""
    if not os.path.exists(os.path.join(path, _PROGRESS)):
        raise FileNotFoundError(f"no checkpoint in {path!r}: run once with checkpoint_dir={path!r} "
                                "and without resume first")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    with open(os.path.join(path, _PROGRESS)) as f:
        return json.load(f)["step"]
