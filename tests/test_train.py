"""The training runner on real ranks: every wrapper and sharding strategy equals single-process
training; DCP resumes."""
from __future__ import annotations

import os

import pytest
import torch

import dpcourse as dpc
from dpcourse import RankError
from dpcourse.memory.activations import activation_bytes
from dpcourse.memory.ledger import AT_REST
from dpcourse.train import TrainConfig, checkpoint, train
from dpcourse.train.config import ConfigError
from dpcourse.train.runner import train_single_process

pytestmark = pytest.mark.timeout(240)

SETUPS = [
    dict(wrapper="ddp"),
    dict(wrapper="ddp", gradient_as_bucket_view=True, optimizer="sgd"),
    dict(wrapper="fsdp", sharding_strategy="FULL_SHARD"),
    dict(wrapper="fsdp", sharding_strategy="SHARD_GRAD_OP", auto_wrap="size"),
    dict(wrapper="fsdp", sharding_strategy="NO_SHARD"),
    dict(wrapper="fully_shard", reshard_after_forward=True),
    dict(wrapper="fully_shard", reshard_after_forward=False, auto_wrap="none"),
    dict(wrapper="fully_shard", auto_wrap="size", min_num_params=5000),  # units above a ModuleList
    dict(wrapper="fsdp", model="transformer"),
    # a tied weight and a frozen one; every optimizer of the vocabulary once
    dict(wrapper="fsdp", model="tied_transformer", optimizer="sgd_momentum"),
    dict(wrapper="fully_shard", model="tied_transformer", optimizer="adam"),
]


def _same_losses(cluster, world_size, **options):
    cfg = TrainConfig(steps=4, batch_size=4, progress=False, **options)
    metrics = cluster.run(train, cfg)
    reference = train_single_process(cfg, world_size)["losses"]
    for m in metrics:
        assert m["world_size"] == world_size and len(m["losses"]) == cfg.steps
        torch.testing.assert_close(m["losses"], reference, rtol=1e-5, atol=1e-6)
    return metrics


@pytest.mark.parametrize("options", SETUPS, ids=lambda o: "-".join(map(str, o.values())))
def test_world_size_2_equals_single_process(cluster2, options):
    _same_losses(cluster2, 2, **options)


@pytest.mark.parametrize("options", SETUPS[:1] + SETUPS[2:3] + SETUPS[5:6] + [
    dict(wrapper="fsdp", sharding_strategy="HYBRID_SHARD", shard_group_size=2)],
    ids=lambda o: "-".join(map(str, o.values())))
def test_world_size_4_equals_single_process(cluster4, options):
    metrics = _same_losses(cluster4, 4, **options)
    if options.get("sharding_strategy") == "HYBRID_SHARD":  # really hybrid, not FULL_SHARD renamed
        assert "HYBRID_SHARD on a 2 x 2 mesh" in metrics[0]["applied"]


def test_final_parameters_equal_single_process(cluster2):
    cfg = TrainConfig(wrapper="fsdp", steps=3, batch_size=4, progress=False, optimizer="sgd")
    state = cluster2.run(train, cfg, full_state=True)[0]["state"]
    reference = train_single_process(cfg, 2)["state"]
    assert state.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(state[name], reference[name], rtol=1e-5, atol=1e-6)


def test_dcp_save_at_4_resume_at_2_equals_an_uninterrupted_run(cluster4, cluster2, tmp_path):
    common = dict(wrapper="fsdp", num_samples=128, progress=False)
    whole = cluster4.run(train, TrainConfig(steps=6, batch_size=4, **common))[0]["losses"]
    ckpt = str(tmp_path / "ckpt")
    first = cluster4.run(train, TrainConfig(steps=3, batch_size=4, checkpoint_dir=ckpt, **common))
    # Same global batch (2 x 8 = 4 x 4), so the same samples per step at the new world size.
    rest = cluster2.run(train, TrainConfig(steps=6, batch_size=8, checkpoint_dir=ckpt, resume=True, **common))
    assert rest[0]["first_step"] == 3
    torch.testing.assert_close(first[0]["losses"] + rest[0]["losses"], whole, rtol=1e-5, atol=1e-6)
    # Another global batch would continue with other samples: refused, with the fix named.
    with pytest.raises(RankError, match="global batch of 16 samples .* use batch_size=8"):
        cluster2.run(train, TrainConfig(steps=6, batch_size=4, checkpoint_dir=ckpt, resume="auto", **common))


def test_periodic_checkpoints_keep_the_newest_and_resume_exactly(cluster2, tmp_path):
    """Every 3 steps, 2 kept; a resume at step 7 (not an epoch start) continues the sampler
    where it stood, across the epoch boundary at step 8, equal to one uninterrupted run."""
    common = dict(wrapper="fully_shard", num_samples=64, batch_size=4, progress=False)  # 8 steps per epoch
    whole = cluster2.run(train, TrainConfig(steps=12, **common))[0]["losses"]
    root = str(tmp_path / "ckpt")
    saving = dict(checkpoint_dir=root, checkpoint_every=3, keep_checkpoints=2, resume="auto")
    first = cluster2.run(train, TrainConfig(steps=7, **common, **saving))[0]
    assert first["first_step"] == 0 and first["resumed_from"] is None  # auto: nothing to resume
    assert sorted(os.listdir(root)) == ["step-000006", "step-000007"]  # 3 was pruned; 7 is the end
    assert checkpoint.read_progress(checkpoint.latest(root)) == checkpoint.Progress(
        step=7, epoch=0, batch=7, global_batch=8, world_size=2)
    rest = cluster2.run(train, TrainConfig(steps=12, **common, **saving))[0]
    assert rest["resumed_from"] == checkpoint.step_dir(root, 7)
    assert checkpoint.read_progress(checkpoint.latest(root)).epoch == 1  # 12 = 8 + 4
    torch.testing.assert_close(first["losses"] + rest["losses"], whole, rtol=0, atol=0)


def test_checkpoint_progress_and_folder_rules(tmp_path):
    """Pure parts of checkpoint.py: data position arithmetic, which folders count as complete."""
    p = checkpoint.Progress(step=6, epoch=0, batch=6, global_batch=8, world_size=2)
    assert p.advanced(3, per_epoch=8) == checkpoint.Progress(9, 1, 1, 8, 2)
    root = str(tmp_path)
    assert checkpoint.latest(root) is None and checkpoint.resolve("auto", root) is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.resolve("latest", root)
    for name, marked in [("step-000003", True), ("step-000010", False), (".partial-step-000012", True),
                         ("step-000004", True), ("notes", True)]:
        os.makedirs(os.path.join(root, name))
        if marked:
            open(os.path.join(root, name, checkpoint.MARK), "w").close()
    assert checkpoint.complete_checkpoints(root) == [checkpoint.step_dir(root, 3), checkpoint.step_dir(root, 4)]
    assert checkpoint.resolve(True, root) == checkpoint.resolve(root, None) == checkpoint.step_dir(root, 4)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpoint.read_progress(checkpoint.step_dir(root, 10))


@pytest.mark.parametrize("options, message", [
    (dict(wrapper="zero"), "unknown wrapper 'zero'; choose one of ddp, fsdp, fully_shard"),
    (dict(wrapper="fsdp", sharding_strategy="FULL"), "unknown sharding_strategy"),
    (dict(wrapper="fsdp", sharding_strategy="HYBRID_SHARD", shard_group_size=3), "divides world_size=4"),
    (dict(wrapper="fsdp", sharding_strategy="HYBRID_SHARD"), "HYBRID_SHARD needs shard_group_size"),
    (dict(wrapper="fsdp", sharding_strategy="HYBRID_SHARD", shard_group_size=4), "silently be\nFULL_SHARD|silently be FULL_SHARD"),
    (dict(mixed_precision="fp8"), "unknown mixed_precision"),
    (dict(batch_size=200, num_samples=512), "fewer than batch_size=200"),
    (dict(resume=True), "resume=True needs checkpoint_dir"),
    (dict(resume="auto"), "resume='auto' needs checkpoint_dir"),
    (dict(checkpoint_every=5), "checkpoint_every needs checkpoint_dir"),
    (dict(checkpoint_dir="ckpt", keep_checkpoints=0), "keep_checkpoints >= 1"),
])
def test_bad_options_fail_before_any_work(options, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**options).validate(world_size=4, device_type="cpu")


def test_the_wrapper_keeps_its_old_flag_and_names_its_new_field():
    """``wrapper`` was ``strategy``: the old flag still parses into it, the old field says where it went."""
    from dpcourse.train.config import parse_args

    assert parse_args(["--strategy", "fully_shard"]).wrapper == "fully_shard"
    assert parse_args(["--wrapper", "fsdp"]) == TrainConfig(wrapper="fsdp")
    with pytest.raises(TypeError, match=r"TrainConfig\(strategy=\.\.\.\): TrainConfig.strategy is now "
                                        r"TrainConfig.wrapper: how the model is wrapped \(ddp, fsdp, fully_shard\)"):
        TrainConfig(strategy="fsdp")
    with pytest.raises(AttributeError, match="TrainConfig.strategy is now TrainConfig.wrapper"):
        TrainConfig().strategy
    with pytest.raises(AttributeError, match="object has no attribute 'stratgy'"):
        TrainConfig().stratgy


def test_a_bad_option_on_the_ranks_raises_before_training(cluster2):
    import dpcourse as dpc

    with pytest.raises(dpc.RankError, match="unknown wrapper"):
        cluster2.run(train, TrainConfig(wrapper="zero"))


def _ledger_strategy(cfg: TrainConfig) -> tuple[str, dict]:
    """The vocabulary's strategy name and options of a runner configuration."""
    if cfg.wrapper == "ddp":
        return "ddp", {"gradient_as_bucket_view": cfg.gradient_as_bucket_view}
    if cfg.wrapper == "fully_shard":
        return "fully_shard", {"reshard_after_forward": cfg.reshard_after_forward}
    return cfg.sharding_strategy, ({"shard_group_size": cfg.shard_group_size}
                                   if cfg.sharding_strategy == "HYBRID_SHARD" else {})


RUNNER_CONFIGS = [
    dict(wrapper="ddp"), dict(wrapper="ddp", gradient_as_bucket_view=True),
    dict(wrapper="fsdp"), dict(wrapper="fsdp", sharding_strategy="SHARD_GRAD_OP"),
    dict(wrapper="fsdp", sharding_strategy="NO_SHARD"),
    dict(wrapper="fsdp", sharding_strategy="HYBRID_SHARD", shard_group_size=2),
    dict(wrapper="fully_shard"), dict(wrapper="fully_shard", reshard_after_forward=False),
]


@pytest.mark.parametrize("options", RUNNER_CONFIGS, ids=lambda o: "-".join(map(str, o.values())))
def test_bytes_per_step_measured_from_pytorch_equal_the_theory(cluster4, options):
    """The logical bytes of the c10d ops DDP/FSDP really call, unit by unit, equal step_bytes;
    on Gloo's wire the reduce-scatter counts twice (it sends what an all-reduce sends)."""
    cfg = TrainConfig(steps=4, batch_size=4, progress=False, **options)
    comm = dpc.observe.Comm()
    cluster4.run(train, cfg, observe=[comm])
    strategy, extra = _ledger_strategy(cfg)
    extra.pop("gradient_as_bucket_view", None)
    theory = dpc.collectives.step_bytes(strategy, 4, dpc.models.build_model(cfg.model), **extra)
    for rank in range(4):  # the runner also all-reduces each step's loss (4 bytes): left out
        sent: dict[str, int] = {}
        for r in comm.records(rank, step=-1):
            if r.nbytes > 4 and r.logical_sent:
                sent[r.collective] = sent.get(r.collective, 0) + r.logical_sent
        assert sent == pytest.approx(theory, abs=1), rank
        gloo = sum(v * (2 if c == "reduce_scatter" else 1) for c, v in theory.items())
        assert comm.wire(rank, step=-1) >= 0.98 * gloo  # Gloo's own bytes, plus headers


def test_step_volume_formulas():
    from dpcourse.collectives import step_bytes

    psi, n = 1000 * 4, 4
    units = [1000, 0]  # one block of 1000 parameters, an empty root
    # DDP: 2(N-1)/N Ψ; FULL_SHARD: 3(N-1)/N Ψ when everything sits in wrapped units.
    assert step_bytes("ddp", n, units) == {"all_reduce": 2 * 3 / 4 * psi}
    full = step_bytes("FULL_SHARD", n, units)
    assert sum(full.values()) == pytest.approx(3 * 3 / 4 * psi)
    assert sum(full.values()) / sum(step_bytes("ddp", n, units).values()) == pytest.approx(1.5)
    # The root unit is gathered once: its bytes count 2x, a block's 3x.
    assert sum(step_bytes("FULL_SHARD", 2, [1000]).values()) == pytest.approx(2 * psi / 2)
    assert step_bytes("SHARD_GRAD_OP", n, units) == step_bytes("fully_shard", n, units, reshard_after_forward=False)
    hybrid = step_bytes("HYBRID_SHARD", n, units, shard_group_size=2)
    assert hybrid == pytest.approx({"all_gather": 2 * psi / 2, "reduce_scatter": psi / 2,
                                    "all_reduce": 2 * (1 / 2) * psi / 2})
    assert step_bytes("ddp", 1, units) == {"all_reduce": 0.0}
    phases = step_bytes("FULL_SHARD", n, units, by_phase=True)
    assert phases["forward"] == {"all_gather": psi * 3 / 4}
    assert phases["backward"] == {"all_gather": psi * 3 / 4, "reduce_scatter": psi * 3 / 4}
    mixed = step_bytes("fully_shard", n, units, param_bytes=2, reduce_bytes=4)
    assert mixed == {"all_gather": full["all_gather"] / 2, "reduce_scatter": full["reduce_scatter"]}
    with pytest.raises(ValueError, match="no step_bytes for strategy 'zero3'"):
        step_bytes("zero3", n, units)
    with pytest.raises(ValueError, match="shard_group_size=3 must be a whole number that divides world_size=4"):
        step_bytes("HYBRID_SHARD", n, units, shard_group_size=3)


@pytest.mark.parametrize("options", [c for c in RUNNER_CONFIGS if c.get("sharding_strategy") != "NO_SHARD"],
                         ids=lambda o: "-".join(map(str, o.values())))
def test_runner_memory_at_rest_equals_the_ledger_on_every_rank(cluster4, options):
    cfg = TrainConfig(steps=4, batch_size=4, progress=False, **options)
    memory, timeline = dpc.observe.Memory(), dpc.observe.Timeline()
    cluster4.run(train, cfg, observe=[memory, timeline])
    strategy, extra = _ledger_strategy(cfg)
    model = dpc.models.build_model(cfg.model)
    acts = activation_bytes(cfg.model, cfg.batch_size)
    for rank in range(4):
        book = dpc.memory.ledger(model, 4, strategy, optimizer=cfg.optimizer, rank=rank, activation_bytes=acts, **extra)
        held = memory.at_rest(rank)
        assert {c: held.get(c, 0) for c in AT_REST} == {c: book.bytes[c] for c in AT_REST}, rank
        assert 0.85 * book.peak <= memory.peak(rank)[0] <= 1.1 * book.peak, (rank, memory.peak(rank), book.peak)
        assert len(timeline.step_seconds(rank)) == cfg.steps and len(timeline.step_seconds(rank, cpu=True)) == cfg.steps
