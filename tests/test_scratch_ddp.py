"""From-scratch DDP wrappers and ZeRO-1 on real ranks: single-process training is the truth."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dpcourse as dpc
from _training import parameters_around_backward, reference_steps, train_steps
from dpcourse.scratch.bucketed import assign_buckets
from dpcourse.scratch.ddp import OverlapDDP
from dpcourse.scratch.zero import ShardedOptimizer
from dpcourse.train import TrainConfig

pytestmark = pytest.mark.timeout(180)

SCRATCH = ["naive", "overlap", "bucketed"]
# (model, optimizer, micro-batches per step): tied_transformer has a tied head and a frozen
# position table; accumulation > 1 runs all micro-batches but the last under no_sync().
# AdamW trains the MLP only: attention's key bias has a gradient that is zero in exact
# arithmetic (softmax ignores a shift shared by all keys), and AdamW's normalisation turns
# the rounding noise left in it into lr-sized steps that no two summation orders share.
CASES = [("tied_transformer", "sgd", 1), ("tied_transformer", "sgd", 2), ("mlp", "adamw", 3)]
MODEL_FOR = {"sgd": "tied_transformer", "adamw": "mlp"}


def _cfg(model, optimizer, **kw):
    sizes = {"d_hidden": 30, "depth": 3} if model == "mlp" else {}  # 30: odd-sized buckets
    return TrainConfig(**{"model": model, "model_sizes": sizes, "optimizer": optimizer, "steps": 3,
                          "batch_size": 4, "num_samples": 96, "progress": False, **kw})


def _tolerance(cfg) -> float:
    """Absolute tolerance on parameters after training: fp32 rounding for SGD. Adam(W) divides
    each gradient by its running RMS, so an element whose gradient is tiny moves by up to lr
    whatever its rounding: allow 2 % of lr (a missing or doubled average moves ~lr)."""
    return 1e-5 if cfg.optimizer == "sgd" else 0.02 * cfg.lr


def _assert_matches(results, reference, atol=1e-6):
    for r in results:
        assert r["params"].keys() == reference["params"].keys()
        for name, want in reference["params"].items():
            torch.testing.assert_close(r["params"][name], want, rtol=1e-5, atol=atol, msg=name)
        torch.testing.assert_close(r["params"], results[0]["params"], rtol=0, atol=0)  # ranks agree


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind, options", [("naive", {}), ("overlap", {}), ("bucketed", {}),
                                           ("bucketed", {"bucket_cap_mb": 1e-6}),
                                           ("bucketed", {"bucket_cap_mb": 0.01})],
                         ids=["naive", "overlap", "bucketed", "bucket-smaller-than-a-parameter",
                              "bucket-10KiB"])
def test_wrappers_equal_single_process_training(request, world, kind, options):
    cluster = request.getfixturevalue(f"cluster{world}")
    for model, optimizer, accumulation in CASES:
        cfg = _cfg(model, optimizer)
        results = cluster.run(train_steps, cfg, kind, accumulation=accumulation, seed_per_rank=True,
                              **options)
        _assert_matches(results, reference_steps(cfg, world, accumulation), _tolerance(cfg))
        if model == "tied_transformer":
            assert "head.weight" not in results[0]["params"]  # one tensor, one name
    if kind == "bucketed" and options.get("bucket_cap_mb") == 1e-6:
        assert all(len(b["params"]) == 1 for b in results[0]["buckets"])


def test_at_two_ranks_every_wrapper_is_bitwise_torch_ddp(cluster2):
    """(g0 + g1) / 2 is one rounding whatever the bucketing: all four agree to the bit."""
    cfg = _cfg("mlp", "sgd")
    results = {k: cluster2.run(train_steps, cfg, k)[0]["params"] for k in SCRATCH + ["ddp"]}
    for kind in SCRATCH:
        torch.testing.assert_close(results[kind], results["ddp"], rtol=0, atol=0)


class HookTakesGradDDP(OverlapDDP):
    """The classic mistake, made through the public API only: treating the argument of
    ``grad_ready`` as the gradient. The post-accumulate-grad hook behind it passes the
    *parameter*, so this averages the weights and never the gradients."""

    def grad_ready(self, grad):
        self.works.append(self.comm_hook(grad, "a parameter"))


def test_a_hook_that_reduces_the_parameter_instead_of_its_grad_is_caught(cluster2):
    cfg = _cfg("mlp", "sgd")
    results = cluster2.run(train_steps, cfg, HookTakesGradDDP)
    with pytest.raises(AssertionError):
        _assert_matches(results, reference_steps(cfg, 2))
    assert not torch.equal(results[0]["params"]["head.weight"], results[1]["params"]["head.weight"])
    _assert_matches(cluster2.run(train_steps, cfg, OverlapDDP), reference_steps(cfg, 2))


def test_the_buggy_hook_averages_the_weights_from_the_second_step_on(cluster2):
    """Step 1: equal weights, local gradients, so the ranks step apart. From then on every
    backward replaces each rank's weights with the ranks' average: parameter averaging."""
    cfg = _cfg("tied_transformer", "sgd")
    ranks = cluster2.run(parameters_around_backward, cfg, HookTakesGradDDP, steps=3)
    first, later = [r[0] for r in ranks], [r[1:] for r in ranks]
    assert torch.equal(first[0]["after_backward"], first[1]["after_backward"])
    for step in zip(*later):
        before = [s["before_backward"] for s in step]
        assert not torch.equal(*before)  # the ranks stepped with their own gradients
        for s in step:
            torch.testing.assert_close(s["after_backward"], (before[0] + before[1]) / 2)
    correct = cluster2.run(parameters_around_backward, cfg, OverlapDDP, steps=3)
    for r in correct:  # a correct DDP never touches the weights during backward
        assert all(torch.equal(s["before_backward"], s["after_backward"]) for s in r)
    assert torch.equal(correct[0][-1]["after_backward"], correct[1][-1]["after_backward"])


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_optimizer_is_the_unsharded_optimizer(request, world):
    cluster = request.getfixturevalue(f"cluster{world}")
    for optimizer in ("adamw", "sgd"):
        cfg = _cfg(MODEL_FOR[optimizer], optimizer)
        plain = cluster.run(train_steps, cfg, "bucketed")
        sharded = cluster.run(train_steps, cfg, "bucketed", sharded_optimizer=True)
        for a, b in zip(plain, sharded):  # element-wise optimizers: bitwise equal
            torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)
        _assert_matches(sharded, reference_steps(cfg, world), _tolerance(cfg))
        pytorch = cluster.run(train_steps, cfg, "ddp", sharded_optimizer="torch")
        _assert_matches(pytorch, reference_steps(cfg, world), _tolerance(cfg))


def _sharded_state(optimizer_name):
    from dpcourse.scratch import BucketedDDP

    model = BucketedDDP(dpc.models.build_model("mlp", d_hidden=30, depth=3))
    cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer_name]
    opt = ShardedOptimizer(model.parameters(), cls, lr=0.01, **({"momentum": 0.9} if optimizer_name == "sgd" else {}))
    x, y = dpc.models.make_dataset("mlp", 4).tensors
    dpc.models.loss_fn("mlp", model(x), y).backward()
    opt.step()
    numel = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    return numel, state, [p.numel() for p in opt.param_groups[0]["params"]]


def test_sharded_optimizer_keeps_one_nth_of_the_state(cluster4):
    for name, per_element in (("adamw", 2), ("sgd", 1)):
        for numel, state, shard in cluster4.run(_sharded_state, name):
            assert shard == [-(-numel // 4)]  # ceil(numel / N) elements per rank
            assert state == per_element * shard[0]


def _ddp_buckets(cap):
    """Our buckets and the buckets torch DDP rebuilt after its first iteration, by name."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse.scratch import BucketedDDP

    model = dpc.models.build_model("tied_transformer")
    names = {p: n for n, p in model.named_parameters()}
    seen = {}

    def hook(state, bucket):
        seen[bucket.index()] = [names[p] for p in bucket.parameters()]
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    ddp = DDP(model, bucket_cap_mb=cap)
    ddp.register_comm_hook(None, hook)
    x, y = dpc.models.make_dataset("tied_transformer", 4).tensors
    for _ in range(2):
        seen.clear()
        dpc.models.loss_fn("tied_transformer", ddp(x), y).backward()
    ours = BucketedDDP(dpc.models.build_model("tied_transformer"), bucket_cap_mb=cap)
    return [seen[i] for i in sorted(seen)], [b["params"] for b in ours.buckets.describe()]


@pytest.mark.parametrize("cap", [0.002, 0.02, 25])
def test_buckets_equal_the_ones_torch_ddp_rebuilds(cluster2, cap):
    """Same buckets; inside one, torch lists parameters in the order they became ready
    (a LayerNorm's weight before its bias), we in reverse registration order."""
    theirs, ours = cluster2.run(_ddp_buckets, cap)[0]
    assert [set(b) for b in ours] == [set(b) for b in theirs]
    assert len(ours) > 1 or cap == 25


def _finish_twice():
    from dpcourse.scratch import BucketedDDP, NaiveDDP

    out = []
    for cls in (NaiveDDP, OverlapDDP, BucketedDDP):
        model = cls(dpc.models.build_model("mlp"))
        model.finish_gradient_synchronization()  # nothing in flight yet
        x, y = dpc.models.make_dataset("mlp", 4, seed=dist.get_rank()).tensors
        dpc.models.loss_fn("mlp", model(x), y).backward()
        before = [p.grad.clone() for p in model.parameters()]
        model.finish_gradient_synchronization()
        model.finish_gradient_synchronization()
        out.append(all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters())))
    return out


def test_finish_gradient_synchronization_is_harmless_when_done(cluster2):
    assert cluster2.run(_finish_twice) == [[True] * 3] * 2


def _unused_parameter(kind):
    from dpcourse.scratch import BucketedDDP, NaiveDDP

    model = dpc.models.build_model("mlp")
    model.unused = torch.nn.Linear(2, 2)
    wrapped = {"naive": NaiveDDP, "bucketed": BucketedDDP}[kind](model)
    x, y = dpc.models.make_dataset("mlp", 4).tensors
    dpc.models.loss_fn("mlp", wrapped(x), y).backward()


@pytest.mark.parametrize("kind", ["naive", "bucketed"])
def test_an_unused_parameter_is_named_in_a_clear_error(cluster2, kind):
    with pytest.raises(dpc.RankError, match="unused"):
        cluster2.run(_unused_parameter, kind)


def test_timelines_show_when_each_wrapper_communicates(cluster2):
    """Observed from outside (dpc.observe.Timeline): naive all-reduces after backward, one per
    parameter; the bucketed wrappers launch the first bucket while backward still computes."""
    cfg = _cfg("mlp", "sgd")
    by_kind = {}
    small = {"bucket_cap_mb": 0.004}
    for kind, options in (("naive", {}), ("bucketed", small), ("ddp", small)):
        timeline = dpc.observe.Timeline()
        result = cluster2.run(train_steps, cfg, kind, observe=[timeline], **options)[0]
        by_kind[kind] = [e for e in timeline.events() if e.rank == 0]
        if kind == "bucketed":
            sizes = sorted(e.nbytes for e in by_kind[kind] if e.kind == "all_reduce")
            assert sizes == sorted(b["nbytes"] for b in result["buckets"])
    for kind, events in by_kind.items():
        backward_end = max(e.end for e in events if e.kind == "backward")
        launches = sorted(e.start for e in events if e.lane == "comm")
        assert any(e.kind == "wait" for e in events)
        if kind == "naive":  # after backward, one per parameter
            assert launches[0] >= backward_end and len(launches) == 8
        else:  # the first bucket leaves while backward is still computing
            assert launches[0] < backward_end and len(launches) >= 2
    assert len([e for e in by_kind["bucketed"] if e.lane == "comm"]) == \
        len([e for e in by_kind["ddp"] if e.lane == "comm"])


def test_the_timeline_sees_every_bucket_with_its_bytes_and_the_wait(cluster2):
    """What the Timeline observer records of BucketedDDP equals the wrapper's own plan: one
    all-reduce per bucket, of the bucket's bytes, launched in bucket order."""
    cfg = _cfg("mlp", "sgd")
    timeline = dpc.observe.Timeline()
    result = cluster2.run(train_steps, cfg, "bucketed", bucket_cap_mb=0.004, observe=[timeline])[0]
    comm = sorted((e for e in timeline.events() if e.lane == "comm" and e.rank == 0), key=lambda e: e.start)
    assert [e.nbytes for e in comm] == [b["nbytes"] for b in result["buckets"]]
    assert all(e.kind == "all_reduce" and e.end >= e.start for e in comm)
    summary = timeline.summary(rank=0)
    assert 0 <= summary["exposed_s"] <= summary["comm_s"] <= summary["step_s"]
    assert summary["collectives"] == len(result["buckets"])


def test_torch_ddp_starts_with_one_bucket_then_rebuilds_with_a_small_first_one(cluster2):
    """torch 2.13, default caps: iteration 0 all-reduces one bucket; afterwards the buckets
    are rebuilt in gradient-ready order, the first closed at 1 MiB, the others at 25 MiB --
    what assign_buckets gives over reverse registration order with first_bucket_cap_mb=1."""
    cfg = _cfg("transformer", "sgd", model_sizes={"d_model": 128, "n_layers": 4})
    first, second, third = cluster2.run(_torch_ddp_buckets, cfg, 3)[0]
    params = list(dpc.models.build_model("transformer", d_model=128, n_layers=4).named_parameters())[::-1]
    assert len(first) == 1 and set(first[0]) == {n for n, _ in params}
    plan = assign_buckets([p.numel() for _, p in params], [4] * len(params), 25,
                                      first_bucket_cap_mb=1)
    assert len(plan) == 2 and sum(params[i][1].numel() for i in plan[0]) * 4 >= 2**20
    assert [set(b) for b in second] == [{params[i][0] for i in b} for b in plan] == [set(b) for b in third]


def _torch_ddp_buckets(cfg, iterations):
    """The buckets torch DDP all-reduces in each backward pass, as parameter names (default caps)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = dpc.models.build_model(cfg.model, **cfg.model_sizes)
    names = {p: n for n, p in model.named_parameters()}
    seen: dict[int, list[str]] = {}

    def hook(state, bucket):
        seen[bucket.index()] = [names[p] for p in bucket.parameters()]
        return allreduce_hook(state, bucket)

    ddp = DDP(model)
    ddp.register_comm_hook(None, hook)
    x, y = dpc.models.make_dataset(cfg.model, cfg.batch_size, **cfg.model_sizes).tensors
    out = []
    for _ in range(iterations):
        seen.clear()
        dpc.models.loss_fn(cfg.model, ddp(x), y).backward()
        out.append([seen[i] for i in sorted(seen)])
    return out
