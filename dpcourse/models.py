"""The course's demo models and their synthetic data, sized for 2 CPU cores.

Both models are stacks of ``Block`` modules, so "one FSDP unit per block" is the natural
wrap policy (``wrap_classes(model)``). Sizes are keyword arguments: tiny by default, bigger
on GPUs. Data is synthetic and seeded, so every rank and the single-process reference can
rebuild exactly the same dataset without files.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# the names the notebooks use; the rest (``loss_fn``, ``wrap_classes``, ...) are the package's own
__all__ = ["MLP", "build_model", "make_dataset"]


class MLPBlock(nn.Module):
    """Linear -> GELU, with a residual connection when the widths agree."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.residual = d_in == d_out

    def forward(self, x):
        y = F.gelu(self.linear(x))
        return x + y if self.residual else y


class MLP(nn.Module):
    """A regression MLP: ``depth`` blocks of width ``d_hidden``, then a linear head."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64, depth: int = 4, d_out: int = 8):
        super().__init__()
        widths = [d_in] + [d_hidden] * depth
        self.blocks = nn.ModuleList(MLPBlock(a, b) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TransformerBlock(nn.Module):
    """Pre-norm causal self-attention + MLP (GPT-style)."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    """A small GPT-style language model over ``vocab_size`` tokens (untied head)."""

    def __init__(self, vocab_size: int = 64, d_model: int = 32, n_heads: int = 4,
                 n_layers: int = 2, seq_len: int = 16):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TiedTransformer(TinyTransformer):
    """TinyTransformer whose head shares the token embedding's weight (one Parameter used
    twice, GPT-2 style) and whose position table is frozen: the two cases a data-parallel
    wrapper must handle (one gradient from two uses; a parameter with no gradient)."""

    def __init__(self, **sizes):
        super().__init__(**sizes)
        self.head.weight = self.tok.weight  # both (vocab_size, d_model)
        with torch.no_grad():  # GPT-2's small init: N(0, 1) embeddings would make huge logits
            self.tok.weight.normal_(0.0, 0.02)
        self.pos.weight.requires_grad_(False)


MODELS = {"mlp": MLP, "transformer": TinyTransformer, "tied_transformer": TiedTransformer}
BLOCKS = {"mlp": MLPBlock, "transformer": TransformerBlock, "tied_transformer": TransformerBlock}
_SAME_DATA = {"tied_transformer": "transformer"}  # models trained on another model's data


def build_model(name: str, seed: int = 0, **sizes) -> nn.Module:
    """A freshly initialised model; the same ``seed`` gives the same weights everywhere."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](**sizes)


def wrap_classes(name: str) -> set[type[nn.Module]]:
    """The module classes that make one FSDP unit each (one per block)."""
    return {BLOCKS[name]}


def unit_shapes(model: nn.Module, unit_classes=None) -> list[list[tuple]]:
    """Parameter shapes per FSDP unit: one unit per module of ``unit_classes``, the rest root.

    unit_classes: default, the classes of the modules in the model's ``nn.ModuleList``s (its
    blocks). Matches FSDP1's ``ModuleWrapPolicy`` and FSDP2 ``fully_shard`` applied to each
    such module and then to the root. Units come children first, the root last; empty units
    are left out.
    """
    if unit_classes is None:
        unit_classes = {type(m) for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst}
    unit_classes = tuple(unit_classes)
    units, claimed = [], set()
    for module in model.modules():
        if module is not model and isinstance(module, unit_classes):
            params = [p for p in module.parameters() if id(p) not in claimed]
            claimed.update(id(p) for p in params)
            units.append([tuple(p.shape) for p in params])
    root = [tuple(p.shape) for p in model.parameters() if id(p) not in claimed]
    return [u for u in units + [root] if u]


def unit_numels(model: nn.Module) -> list[int]:
    """Parameters per FSDP unit (``unit_shapes``'s units), the root last even when it is empty."""
    shapes = unit_shapes(model)
    numels = [sum(math.prod(s) for s in unit) for unit in shapes]
    claimed = {id(p) for lst in model.modules() if isinstance(lst, nn.ModuleList) for p in lst.parameters()}
    root_empty = all(id(p) in claimed for p in model.parameters())
    return numels + [0] if root_empty else numels


def make_dataset(name: str, num_samples: int, seed: int = 1, **sizes) -> torch.utils.data.TensorDataset:
    """Synthetic, learnable data for ``name``: (inputs, targets), identical for a given seed."""
    name = _SAME_DATA.get(name, name)
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        d_in, d_out = sizes.get("d_in", 32), sizes.get("d_out", 8)
        x = torch.randn(num_samples, d_in, generator=g)
        teacher = torch.randn(d_in, d_out, generator=g) / d_in ** 0.5
        return torch.utils.data.TensorDataset(x, torch.tanh(x @ teacher))
    if name == "transformer":
        vocab, seq = sizes.get("vocab_size", 64), sizes.get("seq_len", 16)
        start = torch.randint(0, vocab, (num_samples, 1), generator=g)
        step = torch.randint(1, 4, (num_samples, 1), generator=g)
        tokens = (start + step * torch.arange(seq + 1)) % vocab  # arithmetic sequences
        return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")


def loss_fn(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean loss over the batch (mean reduction, so averaging over ranks is exact)."""
    name = _SAME_DATA.get(name, name)
    if name == "transformer":
        return F.cross_entropy(output.flatten(0, 1), target.flatten())
    return F.mse_loss(output, target)
