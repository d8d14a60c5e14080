"""One vocabulary: every room accepts the names of ``dpcourse.vocab``, and means the same by them."""
from __future__ import annotations

import importlib
import inspect
import pathlib
import re

import pytest
import torch

import dpcourse
from dpcourse import models, vocab
from dpcourse.collectives import step_bytes
from dpcourse.collectives.alpha_beta import step_comm_seconds
from dpcourse.memory import ledger, recommend
from dpcourse.memory.fit import fit_table
from dpcourse.memory.ledger import LedgerError
from dpcourse.train import TrainConfig, config
from dpcourse.train.config import ConfigError, parse_args

PACKAGE = pathlib.Path(dpcourse.__file__).parent
ledger_module = importlib.import_module("dpcourse.memory.ledger")  # the package exports the function


def test_training_runner_and_its_command_line_accept_every_name():
    cases = ([("wrapper", s) for s in vocab.WRAPPERS] + [("model", m) for m in vocab.MODELS]
             + [("optimizer", o) for o in vocab.OPTIMIZERS]
             + [("mixed_precision", p) for p in vocab.MIXED_PRECISION]
             + [("sharding_strategy", s) for s in vocab.SHARDING_STRATEGIES if s != "HYBRID_SHARD"]
             + [("auto_wrap", a) for a in vocab.AUTO_WRAP])
    for field, name in cases:
        cfg = TrainConfig(**{field: name})
        cfg.validate(world_size=2, device_type="cpu")
        flag = "--" + field.replace("_", "-")
        assert getattr(parse_args([flag, name]), field) == name
    TrainConfig(wrapper="fsdp", sharding_strategy="HYBRID_SHARD", shard_group_size=2).validate(4, "cpu")
    with pytest.raises(ConfigError, match="unknown optimizer 'momentum'; choose one of sgd, sgd_momentum"):
        TrainConfig(optimizer="momentum").validate(2, "cpu")


def test_every_table_of_names_lives_in_the_vocabulary():
    """No room keeps its own list of strategy, optimizer, precision or model names."""
    own = re.compile(r"^(STRATEGIES|SHARDING_STRATEGIES|OPTIMIZERS|PRECISIONS|MODELS|AUTO_WRAP)\s*=\s*[(\[{]",
                     re.M)
    found = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if p.name != "vocab.py" and own.search(p.read_text())]
    # models.py maps the vocabulary's model names to their classes (checked below).
    assert found == ["models.py"], found
    assert tuple(models.MODELS) == vocab.MODELS
    assert config.CHOICES["wrapper"] == tuple(vocab.WRAPPERS)


def test_one_name_for_the_shard_group_size_everywhere():
    for fn in (ledger, fit_table, recommend, step_bytes, step_comm_seconds):
        assert "shard_group_size" in inspect.signature(fn).parameters, fn.__qualname__
    assert "shard_group_size" in {f.name for f in config.dataclasses.fields(TrainConfig)}
    for old in ("hybrid_shard_size", "gpus_per_node"):
        users = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if old in p.read_text()]
        assert not users, f"{old} is still used in {users}"


def test_ledger_accepts_every_strategy_precision_and_optimizer():
    for strategy in vocab.LEDGER_STRATEGIES:
        group = 2 if strategy == "HYBRID_SHARD" else None
        for optimizer in vocab.OPTIMIZERS:
            book = ledger(1000, 4, strategy, "mixed", optimizer, shard_group_size=group)
            assert book.strategy == strategy
    with pytest.raises(LedgerError, match="choose one of dp, ddp, zero1"):
        ledger(1000, 4, "fsdp2")


@pytest.mark.parametrize("name", list(vocab.OPTIMIZERS))
def test_an_optimizer_keeps_the_state_the_vocabulary_and_the_ledger_count(name):
    """Measured on torch.optim after one step: parameter-sized state tensors per parameter."""
    layer = torch.nn.Linear(7, 5)
    optimizer = vocab.make_optimizer(name, layer.parameters(), lr=0.1)
    layer(torch.randn(3, 7)).sum().backward()
    optimizer.step()
    for p in layer.parameters():
        same_size = [t for t in optimizer.state[p].values() if torch.is_tensor(t) and t.shape == p.shape]
        assert len(same_size) == vocab.OPTIMIZERS[name]
        assert ledger_module.OPTIMIZER_STATE_BYTES[name] == 4 * len(same_size)


def test_one_check_of_the_shard_group_size_with_the_arithmetic_in_its_message():
    """The ledger, the step formulas and the runner refuse a bad shard group alike."""
    message = "shard_group_size=3 must be a whole number that divides world_size=4"
    with pytest.raises(LedgerError, match=message):
        ledger(1000, 4, "HYBRID_SHARD", shard_group_size=3)
    with pytest.raises(ValueError, match=message):
        step_bytes("HYBRID_SHARD", 4, [10, 0], shard_group_size=3)
    with pytest.raises(ConfigError, match=message):
        TrainConfig(wrapper="fsdp", sharding_strategy="HYBRID_SHARD", shard_group_size=3).validate(4, "cpu")
    with pytest.raises(ValueError, match="only applies to HYBRID_SHARD"):
        vocab.shard_group("FULL_SHARD", 4, 2)
    assert [vocab.shard_group(s, 8, None) for s in ("ddp", "NO_SHARD", "FULL_SHARD")] == [1, 1, 8]
    assert vocab.shard_group("fully_shard", 8, 4) == 4  # FSDP2 on a (replicate, shard) mesh


def test_from_scratch_and_pytorch_wrappers_share_the_names():
    from dpcourse.bench import scratch, strategies

    assert {kind for kind, _ in scratch.VARIANTS.values()} <= set(vocab.SCRATCH_WRAPPERS) | {"ddp", "fsdp"}
    for options in strategies.ROWS.values():
        TrainConfig(**options).validate(world_size=4, device_type="cpu")


def test_the_calculator_offers_the_ledgers_names():
    pytest.importorskip("ipywidgets")
    from dpcourse.viz.calculator import MemoryCalculator

    calc = MemoryCalculator()
    assert tuple(calc.optimizer.options) == tuple(vocab.OPTIMIZERS)
    assert set(calc.precision.options) <= set(vocab.PRECISIONS)
    assert calc.shard_group_size.description == "shard_group_size"


def test_every_trained_strategy_is_a_ledger_strategy_the_runner_accepts():
    assert set(vocab.TRAIN_OPTIONS) <= set(vocab.LEDGER_STRATEGIES)
    for name, options in vocab.TRAIN_OPTIONS.items():
        group = {"shard_group_size": 2} if name == "HYBRID_SHARD" else {}
        TrainConfig(**options, **group).validate(world_size=4, device_type="cpu")


def test_the_ledger_reads_what_each_strategy_shards_from_the_vocabulary(monkeypatch):
    """The ledger keeps no strategy names of its own: a row of ``vocab.SHARDING`` decides."""
    quoted = re.compile(r"""["'](%s)["']""" % "|".join(vocab.SHARDING))
    files = [PACKAGE / "memory" / f"{name}.py" for name in ("ledger", "layout", "transients")]
    named = [f"{p.name}:{m.group(1)}" for p in files for m in quoted.finditer(p.read_text())]
    assert not named, named
    zero2 = ledger(1000, 4, "zero2", "mixed").at_rest()
    assert ledger(1000, 4, "zero1", "mixed").at_rest() != zero2
    monkeypatch.setitem(vocab.SHARDING, "zero1", vocab.SHARDING["zero2"])
    assert ledger(1000, 4, "zero1", "mixed").at_rest() == zero2


def test_the_rooms_leave_the_shard_group_check_to_the_vocabulary(monkeypatch):
    """The runner, the step formulas, the ledger and the fit table ask ``vocab.shard_group``;
    none keeps a check of its own (a refusal there reaches every room)."""
    from dpcourse.collectives.alpha_beta import LINKS

    asked, check = [], vocab.shard_group

    def refuse(strategy, world_size, shard_group_size, error=ValueError):
        asked.append(strategy)
        if shard_group_size is None:
            return check(strategy, world_size, shard_group_size, error)
        raise error("refused by the vocabulary")

    monkeypatch.setattr(vocab, "shard_group", refuse)
    for attempt in (lambda: TrainConfig(wrapper="fully_shard", shard_group_size=2).validate(4, "cpu"),
                    lambda: step_comm_seconds("ddp", 4, [10, 0], LINKS["nvlink4"], shard_group_size=2),
                    lambda: step_bytes("HYBRID_SHARD", 4, [10, 0], shard_group_size=2),
                    lambda: ledger(1000, 4, "HYBRID_SHARD", shard_group_size=2)):
        with pytest.raises(ValueError, match="refused by the vocabulary"):
            attempt()
    rows = fit_table(1000, 4, 10**12, shard_group_size=2)
    assert "HYBRID_SHARD" not in [row["strategy"] for row in rows]
    asked.clear()
    recommend(1000, 16, 1, shard_group_size=8)
    assert "HYBRID_SHARD" in asked
