"""``MemoryProbe``: what one training step of ``dpc.train.train`` holds, next to the ledger.

    cluster.run(dpc.train.train, cfg, hooks=[dpc.memory.MemoryProbe()])   # metrics["memory"]
"""
from __future__ import annotations

import torch.distributed as dist

from .. import models
from ..train.hooks import Run, StepHook
from . import report
from .layout import unit_shapes
from .measure import capture_buckets, held_bytes
from .record import record_step


class MemoryProbe(StepHook):
    """``metrics["memory"]``: bytes held at rest (after the optimizer step, before zero_grad)
    and at the measured step's peak, per rank, with ``report.compare`` against the ledger."""

    def start(self, run: Run) -> None:
        self.at_rest_bytes, self.record, self.measuring = None, None, False
        # DDP's buckets live in C++; its comm hook shows them
        self.buckets = capture_buckets(run.model) if run.cfg.strategy == "ddp" else {}

    def around_step(self, run: Run, step: int, batch, do_step):
        if step != run.measured_step:
            return do_step()
        loss = {}
        self.measuring = True
        try:
            self.record = record_step(run.model, run.optimizer, lambda _: loss.setdefault("v", do_step()),
                                      buckets=self.buckets, inputs=batch)
        finally:
            self.measuring = False
        return loss["v"]

    def at_rest(self, run: Run, step: int) -> None:
        if self.measuring:  # every model state is alive here: the ledger's "at rest"
            self.at_rest_bytes = held_bytes(run.model, run.optimizer, self.buckets)

    def finish(self, run: Run, metrics: dict) -> None:
        metrics["memory"] = None if self.record is None else self._report(run)

    def _report(self, run: Run) -> dict:
        """The record ``report.compare`` reads, so the runner and the memory lessons compare
        theory and measurement with the same code. Exact for one unit per block and fp32."""
        cfg = run.cfg
        plain = models.build_model(cfg.model, seed=cfg.seed, **cfg.model_sizes)
        if cfg.strategy == "ddp":
            strategy, options = "ddp", {"gradient_as_bucket_view": cfg.gradient_as_bucket_view}
        elif cfg.strategy == "fully_shard":
            strategy, options = "fully_shard", {"reshard_after_forward": cfg.reshard_after_forward}
        else:
            strategy = cfg.sharding_strategy
            options = {"shard_group_size": cfg.shard_group_size} if strategy == "HYBRID_SHARD" else {}
        result = {"strategy": strategy, "options": options, "rank": dist.get_rank(),
                  "world_size": dist.get_world_size(), "model": cfg.model, "sizes": dict(cfg.model_sizes),
                  "batch_size": cfg.batch_size,
                  "optimizer": cfg.optimizer,
                  "num_params": sum(p.numel() for p in plain.parameters()),
                  "units": unit_shapes(plain, models.wrap_classes(cfg.model)),
                  "at_rest": self.at_rest_bytes, "frames": self.record["frames"]}
        exact = (cfg.auto_wrap == "block" or cfg.strategy == "ddp") and cfg.mixed_precision == "fp32"
        return {"at_rest": self.at_rest_bytes, "peak_bytes": self.record["peak_bytes"],
                "tool": self.record["tool"], "compare": report.compare(result) if exact else None}
