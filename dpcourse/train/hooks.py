"""Measurement attaches to the training loop from outside, through step hooks.

``train(cfg, hooks=[...])`` runs a plain loop; whoever wants a figure passes a hook, and a
``torchrun`` run measures nothing it was not asked to. For each hook, in list order (the
first one outermost):

    hook.start(run)                      once, when model, optimizer and data exist
    hook.around_step(run, step, batch, do_step) -> loss
                                         wraps one whole step: call ``do_step()`` once
    hook.at_rest(run, step)              inside a step, after ``optimizer.step()`` and before
                                         ``zero_grad``: every model state is alive
    hook.finish(run, metrics)            once, after the last step: add what it measured

The hooks here: ``StepTimer`` (wall and CPU time per step) and ``FullState`` (the full
model state dict on rank 0). ``dpcourse.train.measure.CommMeter`` counts bytes per step;
``dpcourse.memory.probe.MemoryProbe`` records memory.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class Run:
    """What a hook may look at: the rank's configuration, wrapped model, optimizer, device."""

    cfg: object  # TrainConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    first_step: int  # 0, or the step a resumed run starts at
    world_size: int

    @property
    def measured_step(self) -> int | None:
        """The step measuring hooks record: the last, if steady (DDP's first step uses one
        bucket and its second broadcasts the rebuilt order), else None."""
        last = self.cfg.steps - 1
        return last if last >= self.first_step + 2 else None


class StepHook:
    """Does nothing; subclasses override what they need."""

    def start(self, run: Run) -> None:
        pass

    def around_step(self, run: Run, step: int, batch, do_step):
        return do_step()

    def at_rest(self, run: Run, step: int) -> None:
        pass

    def finish(self, run: Run, metrics: dict) -> None:
        pass


class StepTimer(StepHook):
    """Seconds per step, wall (``step_time_s``) and CPU (``step_cpu_s``), and ``samples_per_s``
    (global, at the median step). The measured step is left out: other hooks slow it."""

    def start(self, run: Run) -> None:
        self.wall, self.cpu = [], []

    def around_step(self, run: Run, step: int, batch, do_step):
        if step == run.measured_step:
            return do_step()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = do_step()
        self.wall.append(time.perf_counter() - t0)
        self.cpu.append(time.process_time() - c0)
        return loss

    def finish(self, run: Run, metrics: dict) -> None:
        median = sorted(self.wall)[len(self.wall) // 2] if self.wall else None
        metrics.update(step_time_s=self.wall, step_cpu_s=self.cpu,
                       samples_per_s=run.cfg.batch_size * run.world_size / median if median else 0.0)


class FullState(StepHook):
    """Rank 0's ``metrics["state"]``: the full (unsharded) model state dict, CPU tensors."""

    def finish(self, run: Run, metrics: dict) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload=True segfaults for FSDP1 when the parameters already live on the CPU
        # (torch 2.13, Gloo); gather in place and copy to the CPU ourselves.
        full = get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True))
        metrics["state"] = {k: v.detach().cpu() for k, v in full.items()} if dist.get_rank() == 0 else None
