"""One optimizer step of a replica with the training controls on: the learning rate of the
step (`_controls.lr_factor` of each group's own rate, or the user's scheduler), autocast in
bf16 or fp16 (with a gradient scaler), gradients accumulated over the step's micro-batches
and averaged by sample count, and clipping of their global norm.

Without controls, a step is exactly what it always was (the loss's own gradient, one
optimizer step), so earlier trajectories stay bit-identical."""

from __future__ import annotations

import warnings

from sparkdl_avg._controls import lr_factor
from sparkdl_avg._errors import ConfigError


def check_schedule(config, model) -> None:
    """A callable lr_schedule, tried on a throwaway optimizer over `model` (on the driver,
    before any job): it must give a scheduler driven by its step count."""
    if not callable(config.lr_schedule):
        return
    from sparkdl_avg._model import make_optimizer

    _scheduler(config, make_optimizer(config, [p for p in model.parameters() if p.requires_grad]))


def _scheduler(config, optimizer):
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    try:
        scheduler = config.lr_schedule(optimizer)
    except Exception as exc:
        raise ConfigError(f"lr_schedule(optimizer) failed: {exc!r}") from exc
    if not isinstance(scheduler, LRScheduler) or isinstance(scheduler, ReduceLROnPlateau):
        raise ConfigError(f"lr_schedule returned {type(scheduler).__name__}, not a "
                          "torch.optim.lr_scheduler.LRScheduler driven by its step count "
                          "(ReduceLROnPlateau is not one: use early_stopping)")
    return scheduler


class OptimizerSteps:
    def __init__(self, config, schedule, optimizer, model, device) -> None:
        import torch

        self.config, self.schedule, self.optimizer = config, schedule, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.scheduler = None
        self.autocast = None
        self.scaler = None
        if config.precision is not None:
            if config.precision == "fp16" and device.type != "cuda":
                raise ConfigError(f"precision='fp16' needs CUDA, and this task trains on "
                                  f"{device}: use precision='bf16', or give the tasks GPUs")
            dtype = torch.bfloat16 if config.precision == "bf16" else torch.float16
            self.autocast = (device.type, dtype)
            if config.precision == "fp16":
                self.scaler = torch.amp.GradScaler("cuda")

    def at(self, step: int) -> None:
        """Take up the schedule at optimizer step `step` (a start, or a restart there): a
        callable schedule is built anew and stepped `step` times, which reproduces any
        scheduler driven by its step count bit for bit."""
        if not callable(self.config.lr_schedule):
            return
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base
            group.pop("initial_lr", None)
        self.scheduler = _scheduler(self.config, self.optimizer)
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step):
                self.scheduler.step()

    def run(self, step: int, next_batch, forward_loss, weigh=None) -> tuple[object, int, float]:
        """Optimizer step `step`: its micro-batches (`schema.Batch`) from `next_batch()`, each
        one's loss from `forward_loss(batch)`, each weighing `weigh(batch)` among several (by
        default its rows). Returns (summed loss x rows as a device tensor, rows, lr)."""
        import torch

        optimizer = self.optimizer
        if not callable(self.config.lr_schedule) and \
                (self.config.lr_schedule is not None or self.config.warmup_steps):
            factor = lr_factor(self.config, step, self.schedule.total_steps)
            for group, base in zip(optimizer.param_groups, self.base_lrs, strict=True):
                group["lr"] = base * factor
        lr = float(optimizer.param_groups[0]["lr"])
        optimizer.zero_grad(set_to_none=True)
        micro = self.schedule.micro_batches(step)
        loss_sum, rows, first, total = None, 0, None, None
        for _ in range(micro):
            batch = next_batch()
            with self._autocast():
                loss = forward_loss(batch)
            scaled = loss
            if micro > 1:
                # one micro-batch: its mean loss's gradient (as always); several: each
                # weighted by its weight (rows, or the elements its loss kept, with their rows'
                # weights) over the first one's (near 1, for fp16's range), the gradients
                # divided by the step's total of those below. On the device: no host sync.
                weight = torch.as_tensor(weigh(batch) if weigh is not None else batch.rows,
                                         dtype=torch.float64, device=loss.device)
                # the first micro-batch that keeps anything sets the unit (before it, 1: those
                # keep nothing, so their share is 0 whatever the unit)
                first = weight if first is None else torch.where(first > 0, first, weight)
                share = weight / torch.where(first > 0, first, torch.ones_like(first))
                total = share if total is None else total + share
                scaled = loss * share.to(loss.dtype)
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            part = loss.detach().double() * batch.rows
            loss_sum = part if loss_sum is None else loss_sum + part
            rows += batch.rows
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        if micro > 1:
            total = torch.where(total > 0, total, torch.ones_like(total))
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(total.to(p.grad.dtype))
        if self.config.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return loss_sum, rows, lr

    def _autocast(self):
        import contextlib

        import torch

        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.autocast[0], dtype=self.autocast[1])
