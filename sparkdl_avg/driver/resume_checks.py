"""What a fit must match to continue a checkpoint (`fit(resume_from=)`, or a restart after a
failure): the settings that decide the trajectory, the data's description, the frozen
weights' fingerprint, and (with `deterministic=True`) the devices."""

from __future__ import annotations

from sparkdl_avg._controls import FINGERPRINT_DEFAULTS
from sparkdl_avg._controls import fingerprint as controls_fingerprint
from sparkdl_avg._errors import ClusterError, ConfigError
from sparkdl_avg.averaging.outer import outer_settings
from sparkdl_avg.data.order import padded_rows
from sparkdl_avg.driver.checkpoints import Checkpoint


def fingerprint(config, *, train_rows: list[int], data: dict, model_numel: int,
                dtype: str, total_steps: int, frozen: dict | None = None) -> dict:
    """The settings that decide the trajectory; epochs may grow (to train further), and the
    data cache may change (it never changes the trajectory). `data`: each field's dtype and
    row shape (`plan.describe_params`); a checkpoint of one vector written before typed
    inputs recorded its `num_features` alone, which this holds too. `frozen`: the frozen
    tensors' fingerprint (`Fingerprint.to_dict`), for a model with any."""
    frozen_part = {"frozen": frozen} if frozen and frozen["tensors"] else {}
    optimizer = config.optimizer if isinstance(config.optimizer, str) else \
        getattr(config.optimizer, "__qualname__", "callable")
    return {"num_workers": config.num_workers, "batch_size": config.batch_size,
            "averaging_frequency": config.averaging_frequency, "seed": config.seed,
            "shuffle": config.shuffle, "shuffle_buffer_mb": config.shuffle_buffer_mb,
            "optimizer": optimizer, "lr": config.lr,
            "momentum": config.momentum, "weight_decay": config.weight_decay,
            "average_optimizer_state": config.average_optimizer_state,
            "train_rows": list(train_rows), "padded_rows": padded_rows(train_rows),
            "num_features": data.get("num_features"), "data": data,
            "model_numel": model_numel, "dtype": dtype, **frozen_part,
            **controls_fingerprint(config, total_steps), **outer_settings(config),
            "averaging_warmup_steps": config.averaging_warmup_steps,
            "delta_compression": config.delta_compression}


OUTER_KEYS = ("outer_optimizer", "outer_lr", "outer_momentum")
AVERAGING_DEFAULTS = {"outer_optimizer": "average", "outer_lr": None, "outer_momentum": None,
                      "averaging_warmup_steps": 0, "delta_compression": "none"}
"""What a checkpoint written before outer optimizers and compressed deltas trained with."""


def check_resumable(checkpoint: Checkpoint, expected: dict, *, schedule,
                    source: str) -> None:
    """Raise ConfigError, naming each difference, if this fit cannot continue `checkpoint`."""
    # older checkpoints; before padding, an epoch left a longer partition's extra row out
    recorded = {**FINGERPRINT_DEFAULTS, **AVERAGING_DEFAULTS, "padded_rows": 0,
                **checkpoint.fingerprint}
    if "data" not in checkpoint.fingerprint:  # before typed inputs: one vector, its width
        recorded["data"] = expected.get("data")
    name = str(recorded.get("outer_optimizer"))
    if ": " not in name and str(expected.get("outer_optimizer")).startswith(name + ": "):
        # a callable recorded by its name alone (before it was described by what it builds)
        recorded.update({k: expected.get(k) for k in OUTER_KEYS})
    diffs = [f"{k}: checkpoint {recorded.get(k)!r}, this fit {v!r}"
             for k, v in expected.items() if recorded.get(k) != v and k != "frozen"]
    if (recorded.get("frozen") or {}).get("digest") != (expected.get("frozen") or {}).get(
            "digest"):
        diffs.append(_frozen_difference(recorded.get("frozen"), expected.get("frozen")))
    if diffs:
        raise ConfigError(f"cannot resume from {source}: the fit differs from the one that "
                          f"wrote the checkpoint ({'; '.join(diffs)})")
    total_steps = schedule.total_steps
    if checkpoint.steps >= total_steps:
        raise ConfigError(f"cannot resume from {source}: it has all {checkpoint.steps} steps "
                          f"of this fit's {total_steps}; raise epochs to train further")
    if checkpoint.steps != schedule.round_start(checkpoint.round):
        raise ConfigError(f"cannot resume from {source}: it was taken after a partial last "
                          "round, so more epochs would not line up with the original rounds")


def _frozen_difference(recorded: dict | None, expected: dict | None) -> str:
    """The frozen weights' difference between a checkpoint and this fit, in words."""
    from sparkdl_avg.averaging.frozen import Fingerprint

    if not recorded or not expected:
        return (f"frozen weights: the checkpoint's model has "
                f"{len((recorded or {}).get('tensors', []))} frozen tensors, this fit's "
                f"{len((expected or {}).get('tensors', []))}")
    where = Fingerprint.from_dict(recorded).difference(Fingerprint.from_dict(expected))
    return f"frozen weights: model_fn built other frozen weights than the checkpoint's ({where})"


def check_devices(point: Checkpoint, devices: list[str], *, deterministic: bool) -> None:
    """With `deterministic=True`, refuse (ClusterError, naming each partition that moved) to
    take up `point` on devices other than those it recorded: another GPU model, or the CPU,
    rounds differently, so the result would not be the one the checkpoint leads to."""
    recorded = point.fingerprint.get("devices")
    if not deterministic or recorded is None or recorded == devices:
        return
    moved = [f"partition {rank}: {before} then, {now} now"
             for rank, (before, now) in enumerate(zip(recorded, devices, strict=True))
             if before != now]
    raise ClusterError(
        f"deterministic=True, but the replicas would continue round {point.round} on other "
        f"devices than those that trained it ({'; '.join(moved)}), so the result could not be "
        f"bit-identical: run on the same devices, or set deterministic=False to continue anyway")
