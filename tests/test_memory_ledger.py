"""The memory ledger in theory: the ZeRO paper's worked examples, FSDP's layouts, bad input."""
from __future__ import annotations

import math

import pytest

import dpcourse as dpc
from dpcourse import models
from dpcourse.memory import layout, ledger
from dpcourse.memory.activations import activation_bytes
from dpcourse.memory.fit import equal_units, fit_table
from dpcourse.memory.ledger import AT_REST, LedgerError
from dpcourse.memory.sizes import format_bytes, in_unit

GB = 10**9
ZERO = {"zero1": "P_os", "zero2": "P_os+g", "zero3": "P_os+g+p"}


def zero_gb(num_params, world_size, strategy):
    # The paper's baseline is data parallelism without a separate bucket copy of the gradients.
    extra = {"gradient_as_bucket_view": True} if strategy == "ddp" else {}
    return ledger(num_params, world_size, strategy, "mixed", "adam", **extra).total / GB


def agrees_to_printed_digits(value: float, printed: str) -> bool:
    """True when ``value`` matches a number as printed in a paper (to its last digit)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(value - float(printed)) < 10 ** -decimals


def test_zero_paper_figure_1():
    """ZeRO (Rajbhandari et al. 2020), Figure 1: Psi = 7.5B, N_d = 64, K = 12 (mixed-precision
    Adam): baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB per device."""
    psi = 7_500_000_000
    assert zero_gb(psi, 64, "ddp") == 120.0  # (2 + 2 + K) * Psi
    assert agrees_to_printed_digits(zero_gb(psi, 64, "zero1"), "31.4")  # 2Psi + 2Psi + K Psi/N
    assert agrees_to_printed_digits(zero_gb(psi, 64, "zero2"), "16.6")  # 2Psi + (2 + K) Psi/N
    assert agrees_to_printed_digits(zero_gb(psi, 64, "zero3"), "1.9")  # (2 + 2 + K) Psi/N
    assert zero_gb(psi, 64, "zero3") == 16 * psi / 64 / GB


# ZeRO (Rajbhandari et al. 2020), Table 1: per-device memory (GB) of model states with
# mixed-precision Adam (K = 12) by DP degree, for P_os, P_os+g and P_os+g+p.
TABLE_1 = {
    7_500_000_000: {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
                    64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"),
                    1024: ("30.1", "15.1", "0.12")},
    128_000_000_000: {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
                      64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513", "257", "2")},
    1_000_000_000_000: {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"),
                        16: ("4750", "2875", "1000"), 64: ("4187", "2218", "250"),
                        256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6")},
}


@pytest.mark.parametrize("num_params", list(TABLE_1))
def test_zero_paper_table_1(num_params):
    """ZeRO (Rajbhandari et al. 2020), Table 1, every printed entry (7.5B, 128B, 1T models)."""
    for world_size, printed in TABLE_1[num_params].items():
        for strategy, text in zip(("zero1", "zero2", "zero3"), printed):
            value = zero_gb(num_params, world_size, strategy)
            assert agrees_to_printed_digits(value, text), (num_params, world_size, strategy, value, text)


@pytest.mark.parametrize("optimizer,k_mixed,k_fp32", [("sgd", 4, 0), ("sgd_momentum", 8, 4),
                                                      ("adam", 12, 8), ("adamw", 12, 8)])
def test_bytes_per_parameter_by_optimizer_and_precision(optimizer, k_mixed, k_fp32):
    psi = 1000
    mixed = ledger(psi, 1, "ddp", "mixed", optimizer, gradient_as_bucket_view=True)
    assert mixed.bytes["optimizer_state"] + mixed.bytes["master_weights"] == k_mixed * psi
    assert mixed.total == (2 + 2 + k_mixed) * psi
    fp32 = ledger(psi, 1, "ddp", "fp32", optimizer, gradient_as_bucket_view=True)
    assert fp32.total == (4 + 4 + k_fp32) * psi and fp32.bytes["master_weights"] == 0


def test_ddp_under_autocast_beside_zero_fp16_layout():
    """Both hold 16 bytes per parameter with Adam, split differently: ZeRO's fp16 layout
    2 + 2 + 12 (fp32 master copy in the optimizer state), DDP + torch.autocast 4 + 4 + 8 (the
    fp32 parameters are the master copy) and 2 more bytes per parameter only during forward."""
    psi = 7_500_000_000
    zero = ledger(psi, 64, "ddp", "mixed", gradient_as_bucket_view=True)
    amp = ledger(psi, 64, "ddp", "autocast", gradient_as_bucket_view=True)
    assert [zero.bytes[c] // psi for c in AT_REST] == [2, 2, 8, 4, 0]
    assert [amp.bytes[c] // psi for c in AT_REST] == [4, 4, 8, 0, 0]
    assert zero.total == amp.total == 16 * psi
    assert amp.phases["forward"]["temporaries"] == 2 * psi and zero.phases["forward"]["temporaries"] == 0
    assert amp.phases["at rest"] == amp.at_rest()  # the copies are gone between steps
    assert ledger(psi, 64, "ddp", "autocast").bytes["bucket_buffers"] == 4 * psi  # fp32 buckets
    with pytest.raises(LedgerError, match="use precision='mixed'"):
        ledger(psi, 64, "FULL_SHARD", "autocast")


def test_ddp_buckets_double_the_gradients_unless_they_are_views():
    psi = 12_345
    plain, view = ledger(psi, 4, "ddp"), ledger(psi, 4, "ddp", gradient_as_bucket_view=True)
    assert plain.bytes["bucket_buffers"] == plain.bytes["gradients"] == 4 * psi
    assert view.bytes["bucket_buffers"] == 0 and plain.total - view.total == 4 * psi


def test_fsdp_strategies_against_zero_stages():
    psi, n = 8_000_000, 8
    assert ledger(psi, n, "FULL_SHARD", "mixed").total == ledger(psi, n, "zero3", "mixed").total
    assert ledger(psi, n, "NO_SHARD").total == ledger(psi, n, "ddp", gradient_as_bucket_view=True).total
    shard_grad_op, full = ledger(psi, n, "SHARD_GRAD_OP"), ledger(psi, n, "FULL_SHARD")
    assert shard_grad_op.at_rest() == full.at_rest()  # both reshard after backward
    assert shard_grad_op.bytes["unsharded_parameters"] == 4 * psi  # but keep all gathered in between
    hybrid = ledger(psi, 16, "HYBRID_SHARD", shard_group_size=4)
    assert hybrid.at_rest() == ledger(psi, 4, "FULL_SHARD").at_rest()


def test_fsdp_mixed_precision_keeps_fp32_shards_and_gathers_in_two_bytes():
    psi, n = 1_000_000, 4
    book = ledger(psi, n, "FULL_SHARD", "mixed")
    assert book.bytes["parameters"] == 4 * psi // n and book.bytes["master_weights"] == 0
    assert book.bytes["unsharded_parameters"] == 2 * psi  # one unit = the whole model here


def test_dp_primary_device_holds_everything():
    psi = 1000
    primary, other = ledger(psi, 4, "dp", rank=0), ledger(psi, 4, "dp", rank=1)
    assert primary.total == (4 + 4 + 8) * psi
    assert other.total == 0 and other.bytes["unsharded_parameters"] == 4 * psi
    assert any("primary" in note for note in other.notes)


def test_flat_and_per_parameter_padding_per_rank():
    units = [[(5, 3), (5,)], [(2, 3)]]  # 20 and 6 parameters
    flat = [ledger(26, 4, "FULL_SHARD", "fp32", "sgd", units=units, rank=r) for r in range(4)]
    assert {b.bytes["parameters"] for b in flat} == {4 * (math.ceil(20 / 4) + math.ceil(6 / 4))}
    per_param = [ledger(26, 4, "fully_shard", "fp32", "adam", units=units, rank=r) for r in range(4)]
    padded = 4 * (2 * 3 + 2 + 1 * 3)  # ceil(5/4)=2 rows of 3, 2 of the bias, ceil(2/4)=1 row of 3
    assert {b.bytes["parameters"] for b in per_param} == {padded}
    # torch.chunk rows: 5 -> 2,2,1,0 ; 2 -> 1,1,0,0. Adam: 8 bytes each + a 4-byte step per tensor.
    rows = [(2, 2, 1), (2, 2, 1), (1, 1, 0), (0, 0, 0)]
    for book, (w, b, w2) in zip(per_param, rows):
        assert book.bytes["optimizer_state"] == 8 * (3 * w + b + 3 * w2) + 4 * 3


def test_unit_shapes_follow_the_wrap_policy():
    model = models.build_model("transformer", n_layers=3)
    units = layout.unit_shapes(model, models.wrap_classes("transformer"))
    assert len(units) == 4  # three blocks, then the root (embeddings, final norm, head)
    assert sum(layout.numel(u) for u in units) == sum(p.numel() for p in model.parameters())
    assert units[-1] == [(64, 32), (16, 32), (32,), (32,), (64, 32), (64,)]


@pytest.mark.parametrize("shape", [dict(), dict(n_layers=3, d_model=16, n_heads=2),
                                   dict(vocab_size=50, seq_len=7, d_model=24, n_heads=3)])
def test_transformer_num_params_counts_the_real_module(shape):
    model = models.TinyTransformer(**shape)
    s = {**dict(vocab_size=64, d_model=32, n_layers=2, seq_len=16), **shape}
    expected = sum(p.numel() for p in model.parameters())
    assert layout.transformer_num_params(s["n_layers"], s["d_model"], s["vocab_size"], s["seq_len"]) == expected


def test_transformer_num_params_gpt2_small():
    """nanoGPT prints 'number of parameters: 123.65M' for GPT-2 small (12 layers, d 768,
    vocab 50257, context 1024, tied embeddings), a count that leaves out the 1024 x 768
    position embeddings."""
    total = layout.transformer_num_params(12, 768, 50257, 1024, tied_embeddings=True)
    assert round((total - 1024 * 768) / 1e6, 2) == 123.65


@pytest.mark.parametrize("name,batch,sizes", [("mlp", 2, {}), ("mlp", 8, dict(depth=2, d_in=64)),
                                              ("transformer", 2, {}),
                                              ("transformer", 3, dict(n_layers=3, d_model=16, n_heads=2))])
def test_activation_estimate_equals_memtracker(name, batch, sizes):
    """What PyTorch's MemTracker sees alive at the end of forward (+ the batch) = the formula."""
    from torch.distributed._tools.mem_tracker import MemTracker

    net = models.build_model(name, **sizes)
    x, y = (t.clone() for t in models.make_dataset(name, batch, **sizes).tensors)
    tracker = MemTracker()
    tracker.track_external(net, x, y)
    with tracker:
        out = net(x)
        loss = models.loss_fn(name, out, y)
        snapshot = tracker.get_tracker_snapshot()
    held = sum(v for dev in snapshot.values() for k, v in dev.items() if getattr(k, "value", "") in ("Activation", "Other"))
    assert held == activation_bytes(name, batch, **sizes)
    del out, loss


def test_units_and_display():
    assert format_bytes(31_406_250_000, "GB") == "31.4 GB"
    assert format_bytes(2**30, "GiB") == "1 GiB"
    assert format_bytes(10**9, "GiB") == "0.931 GiB"
    assert in_unit(1.5 * 2**20, "MiB") == 1.5
    with pytest.raises(ValueError, match="GB = 10\\^9"):
        in_unit(1, "gigs")


@pytest.mark.parametrize("call,message", [
    (lambda: ledger(10, 2, "zero4"), "unknown strategy 'zero4'; choose one of dp, ddp, zero1"),
    (lambda: ledger(10, 2, "ddp", "bf8"), "unknown precision"),
    (lambda: ledger(10, 2, "ddp", optimizer="lion"), "choose one of sgd, sgd_momentum, adam, adamw"),
    (lambda: ledger(10, 8, "HYBRID_SHARD"), "HYBRID_SHARD needs shard_group_size"),
    (lambda: ledger(10, 8, "HYBRID_SHARD", shard_group_size=3), "divides world_size=8"),
    (lambda: ledger(10, 8, "FULL_SHARD", shard_group_size=4), "only applies to HYBRID_SHARD"),
    (lambda: ledger(0, 8, "ddp"), "num_params must be a whole number >= 1"),
    (lambda: ledger(10, 8, "ddp", rank=8), "rank=8 is not a rank of world_size=8"),
    (lambda: ledger(10, 2, "FULL_SHARD", units=[4, 5]), "units hold 9 parameters but num_params=10"),
])
def test_bad_input_is_named_with_its_fix(call, message):
    with pytest.raises(LedgerError, match=message.replace("(", r"\(").replace("^", r"\^")):
        call()


def test_fit_table():
    psi, device = 7_500_000_000, 32 * GB
    rows = {r["strategy"]: r for r in fit_table(psi, 64, device, units=equal_units(psi, 32))}
    assert not rows["ddp"]["fits"] and rows["zero3"]["fits"] and rows["FULL_SHARD"]["fits"]
