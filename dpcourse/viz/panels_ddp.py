"""Experiment panels for DDP: the world size of a training run, and the bucket size.

Each panel is a widget over a plain function that runs the real experiment on the ranks with
the library's own functions and draws it with the course's drawing functions:

    run_ddp_experiment(cluster, batch_size=8)            ddp_panel(cluster)
    run_bucket_experiment(cluster, bucket_cap_mb=0.5)    bucket_panel(cluster, cfg)
    run_bucket_sweep(cluster, caps_mb=(0.05, 1))         bucket_sweep_panel(cluster, cfg)

The plain functions return an ``Experiment`` (data, figure) and work without widgets.
"""
from __future__ import annotations

import statistics

from .colors import rank_color
from .panel import Experiment, Panel, new_figure

# the small transformer of 4.1's bucket section: a step takes well under a second here
BUCKET_MODEL = dict(model="transformer", model_sizes=dict(d_model=128, n_layers=4), batch_size=8,
                    steps=6, progress=False)
CAPS_MB = (0.01, 0.02, 0.05, 0.2, 1, 5, 25)
KIND_NAMES = {"bucketed": "BucketedDDP (from scratch)", "ddp": "torch DDP"}


def _say(progress, fraction: float, text: str) -> None:
    if progress is not None:
        progress(fraction, text)


def run_ddp_experiment(cluster, batch_size: int = 8, steps: int = 6, progress=None) -> Experiment:
    """DDP training of the course's MLP on every rank of ``cluster`` (``batch_size`` samples per
    rank and step) next to one process on the global batch; losses per step, seconds per step."""
    from ..train import StepTimer, TrainConfig, train, train_single_process

    world = cluster.world_size
    cfg = TrainConfig(strategy="ddp", steps=steps, batch_size=batch_size,
                      num_samples=max(512, 2 * batch_size * world), progress=False)
    _say(progress, 0.1, f"training with DDP on {world} ranks...")
    metrics = cluster.run(train, cfg, [StepTimer()], timeout=180)
    _say(progress, 0.7, "training one process on the global batch...")
    single = train_single_process(cfg, world_size=world)["losses"]
    losses = metrics[0]["losses"]
    step_ms = [1e3 * statistics.median(m["step_time_s"]) for m in metrics]
    data = {"world_size": world, "global_batch": batch_size * world, "losses": losses,
            "single_losses": single, "max_difference": max(abs(a - b) for a, b in zip(losses, single)),
            "step_ms": step_ms, "samples_per_s": metrics[0]["samples_per_s"]}
    data["summary"] = (f"global batch {data['global_batch']}, {data['samples_per_s']:.0f} samples/s, "
                       f"largest loss difference from one process {data['max_difference']:.1e}")
    fig = new_figure(9, 3.2)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    left.plot(range(1, steps + 1), losses, "o-", color=rank_color(0), label=f"DDP, {world} ranks")
    left.plot(range(1, steps + 1), single, "x", color="black", ms=9, label="one process, global batch")
    left.set(xlabel="step", ylabel="loss", title=f"global batch {batch_size} x {world} = {batch_size * world}")
    left.legend(fontsize=8)
    right.bar([f"rank {r}" for r in range(world)], step_ms, color=[rank_color(r) for r in range(world)])
    right.set(ylabel="ms per step (median)", title=f"{data['samples_per_s']:.0f} samples/s in all")
    for ax in (left, right):
        ax.title.set_fontsize(9)
    fig.tight_layout()
    return Experiment(data, fig)


def ddp_panel(cluster, world_sizes=(1, 2, 3, 4), batch_sizes=(4, 8, 16, 32, 64)) -> Panel:
    """A panel for ``run_ddp_experiment``: world size (a panel-owned cluster when it differs
    from ``cluster``'s) and samples per rank."""
    import ipywidgets as w

    controls = {"world_size": w.Dropdown(options=list(world_sizes), value=cluster.world_size,
                                         description="world_size"),
                "batch_size": w.Dropdown(options=list(batch_sizes), value=8, description="batch/rank")}
    return Panel("DDP on N ranks vs one process on the global batch", run_ddp_experiment, controls, cluster)


def _bucket_cfg(cfg):
    from ..train import TrainConfig

    return cfg if cfg is not None else TrainConfig(**BUCKET_MODEL)


def planned_buckets(cfg, bucket_cap_mb: float) -> list[int]:
    """Bytes of each bucket ``cfg``'s model gets with this cap (the rule both DDPs follow)."""
    from .. import models
    from ..scratch import sweep

    numels = [p.numel() for p in models.build_model(cfg.model, **cfg.model_sizes).parameters()]
    return sweep.bucket_bytes(numels, bucket_cap_mb)


def run_bucket_experiment(cluster, bucket_cap_mb: float = 0.5, kind: str = "bucketed", cfg=None,
                          progress=None) -> Experiment:
    """One recorded training step of ``kind`` ("bucketed" or "ddp") with buckets of at most
    ``bucket_cap_mb`` MiB, drawn as every rank's timeline; data: buckets, hidden share."""
    from ..scratch import hidden_fraction, timeline, train_steps
    from .timeline import draw_timeline

    cfg = _bucket_cfg(cfg)
    _say(progress, 0.1, f"training {cfg.steps} steps with {KIND_NAMES.get(kind, kind)}, recording the last...")
    ranks = cluster.run(train_steps, cfg, kind, record=True, bucket_cap_mb=bucket_cap_mb, timeout=180)
    events = timeline.from_lists([r["timeline"] for r in ranks])
    planned = planned_buckets(cfg, bucket_cap_mb)
    buckets = {e.name for e in events if e.kind == "all_reduce"}
    data = {"kind": kind, "bucket_cap_mb": bucket_cap_mb, "num_buckets": len(buckets),
            "planned_bucket_bytes": planned, "hidden_fraction": hidden_fraction(events), "events": events}
    count = f"{len(buckets)} bucket" + ("" if len(buckets) == 1 else "s")
    data["summary"] = (f"{count} (the rule plans {len(planned)}), "
                       f"{data['hidden_fraction']:.0%} of communication hidden behind backward")
    _say(progress, 0.8, "drawing the timeline...")
    fig = new_figure(9.6, 1.6 + 1.3 * cluster.world_size)  # ~860 px: fits a notebook's width
    draw_timeline(events, ax=fig.add_subplot(),
                  title=f"{KIND_NAMES.get(kind, kind)}, bucket_cap_mb={bucket_cap_mb:g}: {count}, "
                        f"{data['hidden_fraction']:.0%} of communication hidden")
    fig.tight_layout()
    return Experiment(data, fig)


def bucket_panel(cluster, cfg=None, caps_mb=CAPS_MB) -> Panel:
    """A panel for ``run_bucket_experiment``: the wrapper and ``bucket_cap_mb``."""
    import ipywidgets as w

    controls = {"kind": w.Dropdown(options=[(v, k) for k, v in KIND_NAMES.items()], value="bucketed",
                                   description="wrapper"),
                "bucket_cap_mb": w.SelectionSlider(options=list(caps_mb), value=0.2,
                                                   description="bucket_cap_mb")}
    return Panel("Buckets: one training step's timeline", run_bucket_experiment, controls, cluster,
                 fixed={"cfg": cfg})


def run_bucket_sweep(cluster, caps_mb=(0.01, 0.05, 0.2, 1, 25), kinds=("bucketed", "ddp"), cfg=None,
                     alpha_beta: bool = True, progress=None) -> Experiment:
    """Seconds per step and exposed communication per ``bucket_cap_mb`` (MiB) for each wrapper
    in ``kinds``, next to the alpha-beta model fitted to all-reduces timed on the same ranks."""
    from ..collectives import alpha_beta as ab
    from ..scratch import sweep
    from .timeline import draw_bucket_sweep

    cfg, caps = _bucket_cfg(cfg), sorted(caps_mb)
    alpha = beta = predicted = None
    if alpha_beta and cluster.world_size >= 2:
        _say(progress, 0.05, "timing all-reduces of 4 KiB ... 4 MiB for the alpha-beta fit...")
        times = cluster.run(ab.time_all_reduce, [2**k for k in range(12, 23, 2)], timeout=120)[0]
        try:
            alpha, beta = ab.fit_alpha_beta(times, cluster.world_size)
            predicted = {c: sweep.predict_comm_seconds(planned_buckets(cfg, c), cluster.world_size, alpha, beta)
                         for c in caps}
        except ValueError:  # the timings were dominated by noise: draw without the model
            pass
    rows = []
    for i, cap in enumerate(caps):
        _say(progress, 0.15 + 0.8 * i / len(caps), f"bucket_cap_mb={cap:g}: training and recording...")
        rows += cluster.run(sweep.bucket_sweep, cfg, [cap], list(kinds), timeout=180)[0]
    data = {"rows": rows, "alpha": alpha, "beta": beta, "predicted": predicted,
            "planned": {c: len(planned_buckets(cfg, c)) for c in caps}}
    fit = "no alpha-beta fit (noisy timings)" if alpha is None else \
        f"alpha {alpha * 1e6:.0f} us per message, beta {beta / 1e9:.2f} GB/s"
    data["summary"] = f"{len(caps)} caps x {len(kinds)} wrappers; {fit}"
    fig = new_figure(9.5, 3.8)
    draw_bucket_sweep(rows, predicted, ax=fig.add_subplot(),
                      title=f"bucket-size sweep on {cluster.world_size} ranks; {fit}")
    return Experiment(data, fig)


def bucket_sweep_panel(cluster, cfg=None, caps_mb=CAPS_MB) -> Panel:
    """A panel for ``run_bucket_sweep``: the range of caps and the wrappers."""
    import ipywidgets as w

    controls = {"cap_range": w.SelectionRangeSlider(options=list(caps_mb), index=(0, len(caps_mb) - 1),
                                                   description="caps (MiB)"),
                "kinds": w.Dropdown(options=[("both", ("bucketed", "ddp")), ("BucketedDDP", ("bucketed",)),
                                             ("torch DDP", ("ddp",))], value=("bucketed", "ddp"),
                                    description="wrappers")}

    def run(cluster, cap_range, kinds, progress=None, cfg=None):
        lo, hi = cap_range
        return run_bucket_sweep(cluster, [c for c in caps_mb if lo <= c <= hi], kinds, cfg, progress=progress)

    return Panel("Bucket-size sweep with the alpha-beta model", run, controls, cluster, fixed={"cfg": cfg})
