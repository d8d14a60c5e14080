"""Activation checkpointing: keep only each block's input in forward, recompute the rest in backward.

Without it, autograd keeps every tensor a backward formula needs (a Linear's input, GELU's
input, ...) from forward until backward reaches that layer: activation memory grows with
depth x batch. ``checkpoint_wrapper`` runs a block's forward without saving its insides and
keeps only the block's input; when backward reaches the block, it runs the block's forward
again (with saving on) and backpropagates through that. The cost is one more forward per
block; the gradients are the same.

It composes with FSDP2 in this order: wrap the blocks first, then ``fully_shard`` them (the
wrapper becomes the unit). During the recomputation the block's parameters are gathered
anyway, for its backward.
"""
from __future__ import annotations

from torch import nn

from .. import models
from .common import loss_of, rank_batch, shard


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Replace every block by ``checkpoint_wrapper(block)`` (non-reentrant checkpointing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    return model


def train_checkpointed(checkpoint: bool, batch_size: int = 64, depth: int = 8, observe=None) -> dict:
    """On every rank: FSDP2 forward + backward of a ``depth``-block MLP, blocks checkpointed or not.

    ``observe`` is a context manager entered around forward only (e.g. ``measure.SavedTensors()``:
    what autograd holds when backward begins); returned under "observed" with this rank's
    gradient shards.
    """
    import contextlib

    model = models.build_model("mlp", depth=depth)
    if checkpoint:
        checkpoint_blocks(model)
    shard(model)
    observer = observe if observe is not None else contextlib.nullcontext()
    inputs, targets = rank_batch(batch_size)
    with observer:
        loss = loss_of(model, inputs, targets)
    loss.backward()
    return {"observed": observe, "grads": local_shards_of_grads(model), "loss": loss.item()}


def local_shards_of_grads(model: nn.Module) -> dict:
    """This rank's rows of every gradient, by the plain model's parameter names."""
    from torch.distributed.tensor import DTensor

    clean = lambda name: name.replace("._checkpoint_wrapped_module", "")  # noqa: E731
    return {clean(name): (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
            for name, p in model.named_parameters()}


def whole_gradients(batch_size: int = 64, depth: int = 8) -> dict:
    """The reference in one process: gradients of the whole model on the whole batch, no checkpointing."""
    from .common import global_batch

    model = models.build_model("mlp", depth=depth)
    loss_of(model, *global_batch(batch_size)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}
