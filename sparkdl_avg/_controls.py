"""The training controls every trainer has, as pure rules: the learning-rate schedule with its
warmup (a factor of the optimizer's own learning rate at each optimizer step, in closed form so
a restart at any step computes what the uninterrupted run did), early stopping
(`EarlyStopping`, public, and the decision over the evaluations so far), and their checks.
The task follows the schedule (`task/optimizer_step`); the drivers decide stopping."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from sparkdl_avg._checks import require_float, require_int
from sparkdl_avg._errors import ConfigError

SCHEDULES = ("cosine", "linear")
PRECISIONS = ("bf16", "fp16")
METRICS = {"eval_loss": "min", "eval_accuracy": "max"}
"""What early stopping can watch: the metrics a fit logs at each evaluation, with the
direction in which each gets better."""


@dataclass(frozen=True, slots=True)
class EarlyStopping:
    """Stop a fit once `metric` has not improved by more than `min_delta` for `patience`
    evaluations in a row (evaluations, not rounds: sync evaluates every `eval_every` rounds,
    by default once an epoch; async every `eval_interval_s`). Needs `eval_df`.
    `restore_best`: the returned (and logged) model holds the parameters of the best
    evaluation, not the last."""

    metric: str = "eval_loss"
    """One the fit logs at each evaluation: "eval_loss" or "eval_accuracy" (classifiers)."""
    mode: Literal["min", "max"] = "min"
    patience: int = 3
    min_delta: float = 0.0
    restore_best: bool = True

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ConfigError(f"EarlyStopping(metric={self.metric!r}) is not a metric the fit "
                              f"logs at each evaluation; use one of {sorted(METRICS)}")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"EarlyStopping(mode={self.mode!r}) must be 'min' or 'max'")
        if self.mode != METRICS[self.metric]:
            raise ConfigError(f"EarlyStopping(metric={self.metric!r}, mode={self.mode!r}): "
                              f"{self.metric} gets better as it goes "
                              f"{'down' if METRICS[self.metric] == 'min' else 'up'}; use "
                              f"mode={METRICS[self.metric]!r}")
        require_int("EarlyStopping.patience", self.patience, minimum=1)
        require_float("EarlyStopping.min_delta", self.min_delta)
        if not isinstance(self.restore_best, bool):
            raise ConfigError(f"EarlyStopping.restore_best must be True or False, got "
                              f"{self.restore_best!r}")


@dataclass(frozen=True, slots=True)
class StopDecision:
    stop: bool
    best: int | None
    """The index of the best evaluation so far (None before any)."""
    reason: str = ""


def decide(values: Sequence[float], rule: EarlyStopping) -> StopDecision:
    """Over the watched metric at each evaluation so far, in order: where the best is, and
    whether `patience` evaluations since it brought no improvement of more than min_delta.
    A NaN never improves."""
    best, since = None, 0
    for i, value in enumerate(values):
        if best is None and not math.isnan(value) or \
                best is not None and _better(value, values[best], rule):
            best, since = i, 0
        else:
            since += 1
    if since >= rule.patience:
        at = "no evaluation" if best is None else f"evaluation {best + 1}"
        return StopDecision(True, best, f"{rule.metric} did not improve by more than "
                            f"{rule.min_delta:g} in {since} evaluations since the best "
                            f"({at})")
    return StopDecision(False, best)


def _better(value: float, best: float, rule: EarlyStopping) -> bool:
    if math.isnan(value):
        return False
    return value < best - rule.min_delta if rule.mode == "min" else value > best + rule.min_delta


def lr_factor(config, step: int, total_steps: int) -> float:
    """What the built-in schedule multiplies the optimizer's learning rate by at optimizer
    step `step` (0-based) of `total_steps`: (step + 1) / warmup_steps during warmup, then, at
    t = step - warmup_steps of T = total_steps - warmup_steps, (1 + cos(pi t / T)) / 2 for
    "cosine", 1 - t / T for "linear", 1 without a schedule. A callable schedule: 1 (it sets
    the learning rate itself)."""
    warmup = config.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if config.lr_schedule not in SCHEDULES:
        return 1.0
    t, span = step - warmup, max(1, total_steps - warmup)
    if config.lr_schedule == "cosine":
        return (1.0 + math.cos(math.pi * t / span)) / 2.0
    return 1.0 - t / span


def check_controls(config) -> None:
    """The controls' settings on their own (TrainConfig calls this when built)."""
    schedule = config.lr_schedule
    if schedule is not None and not callable(schedule) and schedule not in SCHEDULES:
        raise ConfigError(f"lr_schedule={schedule!r} is not supported; use one of "
                          f"{SCHEDULES}, None, or a callable optimizer -> LRScheduler")
    require_int("warmup_steps", config.warmup_steps, minimum=0)
    if callable(schedule) and config.warmup_steps:
        raise ConfigError("warmup_steps works with the built-in schedules only; a callable "
                          "lr_schedule warms up itself (torch's LinearLR + SequentialLR)")
    if config.grad_clip_norm is not None:
        require_float("grad_clip_norm", config.grad_clip_norm, positive=True)
    require_int("grad_accumulation", config.grad_accumulation, minimum=1)
    if config.precision is not None and config.precision not in PRECISIONS:
        raise ConfigError(f"precision={config.precision!r} is not supported; use None (the "
                          f"model's own dtype) or one of {PRECISIONS}")
    if config.precision == "fp16" and config.device == "cpu":
        raise ConfigError("precision='fp16' needs CUDA (a gradient scaler on the GPU), and "
                          "device='cpu'; use precision='bf16' on the CPU")
    if config.early_stopping is not None and \
            not isinstance(config.early_stopping, EarlyStopping):
        raise ConfigError(f"early_stopping must be an EarlyStopping, got "
                          f"{type(config.early_stopping).__name__}")


def check_warmup(config, total_steps: int) -> None:
    """Warmup within training, once the row counts give the optimizer steps."""
    if config.warmup_steps > total_steps:
        raise ConfigError(f"warmup_steps={config.warmup_steps} is longer than training "
                          f"({total_steps} optimizer steps); lower it or train longer")
    if config.mode == "sync" and config.averaging_warmup_steps > total_steps:
        raise ConfigError(f"averaging_warmup_steps={config.averaging_warmup_steps} is longer "
                          f"than training ({total_steps} optimizer steps): every round would "
                          "be one step; lower it, or for that set averaging_frequency=1")


def check_early_stopping(config, *, has_eval: bool, classify: bool) -> None:
    """What early stopping needs from the fit's arguments: evaluations, and for
    eval_accuracy a classifier."""
    rule = config.early_stopping
    if rule is not None and not has_eval:
        raise ConfigError("early_stopping needs eval_df: it stops on the evaluations"
                          f"{' and restore_best keeps the best one' if rule.restore_best else ''}")
    if rule is not None and rule.metric == "eval_accuracy" and not classify:
        raise ConfigError("EarlyStopping(metric='eval_accuracy') needs a classifier "
                          "(a 'cross_entropy' or 'bce_with_logits' loss); use 'eval_loss'")


def fingerprint(config, total_steps: int) -> dict:
    """The controls that decide a trajectory, for checkpoints: a callable schedule by the
    SHA-256 of its pickled bytes, and for a built-in decaying one the steps it decays over
    (more epochs would change every step's rate). Early stopping is not one: a resumed fit
    may wait longer."""
    schedule = config.lr_schedule
    decays_over = total_steps if schedule in SCHEDULES else None
    if callable(schedule):
        import cloudpickle

        schedule = "sha256:" + hashlib.sha256(cloudpickle.dumps(schedule)).hexdigest()
    return {"lr_schedule": schedule, "warmup_steps": config.warmup_steps,
            "schedule_steps": decays_over, "grad_clip_norm": config.grad_clip_norm,
            "grad_accumulation": config.grad_accumulation, "precision": config.precision}


FINGERPRINT_DEFAULTS = {"lr_schedule": None, "warmup_steps": 0, "schedule_steps": None,
                        "grad_clip_norm": None, "grad_accumulation": 1, "precision": None}
"""What a checkpoint written before these controls existed trained with."""
