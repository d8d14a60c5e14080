"""Activation estimates for the course's models: bytes one rank holds at the end of forward.

Counted the way autograd keeps them (fp32, CPU kernels), per micro-batch of ``batch_size``
samples on one rank: every tensor a backward formula saves, the model's output, the loss,
and the input batch itself (inputs and targets). Sizes not given take the model's defaults
(``dpcourse.models``). Checked against PyTorch's ``MemTracker`` in the tests.
"""
from __future__ import annotations

import inspect

from .. import models


def _sizes(model: str, sizes: dict) -> dict:
    if model not in models.MODELS:
        raise ValueError(f"no activation estimate for model {model!r}; choose one of {sorted(models.MODELS)}")
    defaults = {}
    for cls in reversed(models.MODELS[model].__mro__):  # a subclass may take **sizes only
        if "__init__" in vars(cls):
            defaults.update({k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                             if p.default is not inspect.Parameter.empty})
    unknown = set(sizes) - set(defaults)
    if unknown:
        raise ValueError(f"unknown sizes for {model}: {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **sizes}


def activation_bytes(model: str, batch_size: int, **sizes) -> int:
    """Bytes of activations (incl. the input batch) one rank holds at the end of forward."""
    s = _sizes(model, sizes)
    b = batch_size
    if models.BLOCKS[model] is models.MLPBlock:
        # Per block: the Linear's output (GELU saves it) and the block's output (the next
        # Linear saves it; with a residual that is the sum, and GELU's own output is freed).
        # Then the head's output, MSE's squared-difference buffer, and the batch (x, y).
        floats = b * (2 * s["depth"] * s["d_hidden"] + 2 * s["d_out"] + s["d_in"] + s["d_out"])
        return 4 * floats
    t, d, h, n, v = s["seq_len"], s["d_model"], s["n_heads"], s["n_layers"], s["vocab_size"]
    # Per block, in units of one (b, t, d) tensor: LayerNorm outputs (2), the qkv projection
    # (3, attention keeps views of it), attention's output (1), the residual sums (2), the
    # MLP's fc1 output and GELU output (4 + 4); plus LayerNorm mean/rstd (4 per token) and
    # attention's logsumexp (one per head and token).
    per_block = 16 * b * t * d + 4 * b * t + h * b * t
    floats = (b * t * d  # token + position embeddings
              + n * per_block
              + b * t * d + 2 * b * t  # final LayerNorm output, mean, rstd
              + 2 * b * t * v  # logits and log_softmax
              + 2)  # the loss and cross-entropy's total weight
    return 4 * floats + 8 * (2 * b * t + t)  # int64 tokens, targets, positions


def model_sizes(model) -> tuple[str, dict]:
    """The course model's name and constructor sizes, read off an instance."""
    kind = next((name for name, cls in models.MODELS.items() if type(model) is cls), None)
    if kind is None:
        raise ValueError(f"no activation estimate for a {type(model).__name__}: batch_size= works for "
                         f"the course's models ({sorted(models.MODELS)}); pass activation_bytes= instead")
    first = model.blocks[0]
    if kind == "mlp":
        return kind, {"d_in": first.linear.in_features, "d_hidden": first.linear.out_features,
                      "depth": len(model.blocks), "d_out": model.head.out_features}
    return kind, {"vocab_size": model.tok.num_embeddings, "d_model": model.tok.embedding_dim,
                  "n_heads": first.n_heads, "n_layers": len(model.blocks), "seq_len": model.pos.num_embeddings}
