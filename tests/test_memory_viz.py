"""Drawing the memory ledger from real measurements: bars, timeline, player, calculator."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dpcourse as dpc  # noqa: E402
from dpcourse.memory.activations import activation_bytes  # noqa: E402
from dpcourse.memory.ledger import AT_REST  # noqa: E402
from dpcourse.viz import calculator, memory  # noqa: E402

pytestmark = pytest.mark.timeout(180)
SVG = b"<svg"


def _train(strategy):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = dpc.models.build_model("mlp")
    model = DDP(model) if strategy == "ddp" else \
        FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = dpc.models.make_dataset("mlp", 4, seed=dist.get_rank()).tensors
    for _ in range(4):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def measure(cluster, strategies=("ddp", "FULL_SHARD")):
    """({name: Memory}, {name: [Ledger per rank]}) as the notebooks build them."""
    measured, theory = {}, {}
    mlp, acts = dpc.models.build_model("mlp"), activation_bytes("mlp", 4)
    for name in strategies:
        measured[name] = dpc.observe.Memory()
        cluster.run(_train, name, observe=[measured[name]])
        theory[name] = [dpc.memory.ledger(mlp, cluster.world_size, name, optimizer="adam", rank=r,
                                          activation_bytes=acts) for r in range(cluster.world_size)]
    return measured, theory


@pytest.fixture(scope="module")
def measured(cluster2):
    return measure(cluster2)


def test_bars_stack_theory_beside_measurement(measured):
    fig = dpc.viz.plot_memory(*measured, unit="KiB")
    ax = fig.axes[0]
    bars = [p for p in ax.patches if p.get_height() > 0]
    ddp_cats, fsdp_cats = 4, 3  # ddp: params, grads, optimizer, buckets; FSDP: no buckets
    assert len(bars) == 2 * ddp_cats + 2 * fsdp_cats
    tops = {}
    for bar in bars:  # stacks end at the at-rest totals, in KiB
        x = round(bar.get_x() + bar.get_width() / 2, 2)
        tops[x] = max(tops.get(x, 0), bar.get_y() + bar.get_height())
    mem, books = measured
    expected = [(books[n][0].total, sum(mem[n].at_rest(0).get(c, 0) for c in AT_REST)) for n in mem]
    assert sorted(tops) == [-0.2, 0.2, 0.8, 1.2]
    assert [tops[x] for x in sorted(tops)] == pytest.approx(
        [expected[0][0] / 1024, expected[0][1] / 1024, expected[1][0] / 1024, expected[1][1] / 1024])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ddp", "FULL_SHARD"]


def test_timeline_has_one_panel_per_strategy_with_the_theory_outline(measured):
    mem, books = measured
    fig = dpc.viz.plot_memory(mem, books, over="step")
    assert len(fig.axes) == 2
    for ax, name in zip(fig.axes, mem):
        theory_line = [line for line in ax.get_lines() if line.get_linestyle() == "--"][0]
        assert max(theory_line.get_ydata()) == pytest.approx(books[name][0].peak / 1024)
        assert len(ax.get_xticklabels()) == len(mem[name].frames(0))
    with pytest.raises(ValueError, match="over must be 'strategy', 'step' or 'player'"):
        dpc.viz.plot_memory(mem, books, over="rank")


def test_player_walks_the_recorded_step(measured):
    player = dpc.viz.plot_memory(*measured, over="player")
    frames = len(measured[0]["ddp"].frames(0))
    assert player.slider.max == player.play.max == frames - 1
    first = bytes(player.image.value)
    assert first.startswith(SVG)
    player.slider.value = frames // 2
    assert bytes(player.image.value).startswith(SVG) and bytes(player.image.value) != first
    assert set(player._drawn) == {0, frames // 2}
    assert memory.phase_kind("forward blocks.2") == "forward" and memory.phase_kind("zero_grad") == "at rest"


def test_calculator_flags_what_does_not_fit():
    calc = calculator.MemoryCalculator(**calculator.ZERO_PRESET)
    rows = {r["strategy"]: r for r in calc.rows}
    # 120 GB of model states + 15 GB of buckets (+ 4-byte step counters of the 32 units)
    assert rows["ddp"]["ledger"].total == 135 * 10**9 + 4 * 32
    assert rows["zero3"]["at_rest"] == 1_875_000_000
    assert "does not fit: ddp" in calc.verdict and "fits with" in calc.verdict
    # 64 ranks are 8 nodes of 8: ZeRO-2 inside a node holds the 2-byte parameters whole (15 GB)
    # and 14 bytes x 7.5e9 / 8 = 13.1 GB of sharded gradients and Adam states: under 32 GB
    assert "The rule picks HSDP, ZeRO-2 in a node of 8: sharding gradients and optimizer state" in calc.verdict
    assert "◀ the rule" in calc.table.value and calc.plans[1]["name"] == "HSDP, ZeRO-2 in a node of 8"
    assert "<svg" in calc.chart.value
    calc.apply(world_size=1)
    assert "does not fit with any strategy" in calc.verdict
    calc.apply(mode="transformer shape", n_layers=2, d_model=32, vocab_size=64, seq_len=16, world_size=2,
               device_gb=80)
    assert calc.num_params() == 30144 and "does not fit" not in calc.verdict
    calc.apply(world_size=0)
    assert calc.verdict.startswith("cannot compute: world_size must be a whole number >= 1")
