"""The checks every setting shares: a typed ConfigError naming the setting and the value."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import math

from sparkdl_avg._errors import ConfigError
from sparkdl_avg.ps.settings import check_rule
from sparkdl_avg.ps.shards import MAX_SHARDS, parse_addresses


def require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")


def require_float(name: str, value: object, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    if not positive and value < 0:
        raise ConfigError(f"{name} must not be negative, got {value}")


def check_async(config) -> None:
    """The async fields' own checks (a TrainConfig calls this when built)."""
    check_rule(config.algorithm, config.dc_lambda)
    if config.fetch_every is not None:
        require_int("fetch_every", config.fetch_every, minimum=1)
        if config.fetch_every % config.push_every:
            raise ConfigError(f"fetch_every={config.fetch_every} must be a multiple of "
                              f"push_every={config.push_every} (a fetch would drop steps "
                              "not yet pushed)")
    if config.staleness_bound is not None:
        require_int("staleness_bound", config.staleness_bound, minimum=0)
    if config.dc_lambda is not None:
        require_float("dc_lambda", config.dc_lambda)
    require_float("eval_interval_s", config.eval_interval_s, positive=True)
    require_int("ps_shards", config.ps_shards, minimum=1)
    if config.ps_shards > MAX_SHARDS:
        raise ConfigError(f"ps_shards={config.ps_shards}: at most {MAX_SHARDS}")
    if config.ps_address is not None:
        addresses = parse_addresses(config.ps_address)
        if len(addresses) != config.ps_shards:
            raise ConfigError(f"ps_address names {len(addresses)} server(s) and ps_shards="
                              f"{config.ps_shards}: give one 'host:port' per shard, in shard "
                              "order, comma-separated (as `sparkdl-avg ps serve --shards` "
                              "prints them)")
        if config.ps_secret_file is None:
            raise ConfigError("ps_address needs ps_secret_file: the server's secret")
        # The server's own settings: silently ignoring them would mislead.
        for name, option in (("dc_lambda", "--dc-lambda"),
                             ("ps_checkpoint_every", "--checkpoint-every")):
            default = type(config).__dataclass_fields__[name].default
            if getattr(config, name) != default:
                raise ConfigError(f"{name} is the parameter server's own setting when "
                                  f"ps_address is given: start the server with {option}")


def check_sync_transport(config) -> None:
    """The sync channel's TLS files, TLS with the transport, and overlap's checkpoints (a
    TrainConfig calls this when built)."""
    for name in ("tls_cert", "tls_key", "tls_ca"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{name} must be a file path, got {value!r}")
    if (config.tls_cert is None) != (config.tls_key is None) or \
            (config.tls_ca is not None and config.tls_cert is None):
        raise ConfigError("TLS needs tls_cert and tls_key together (tls_ca only with them)")
    if config.overlap_averaging and config.checkpoint_every is None:
        raise ConfigError("overlap_averaging with checkpoint_every=None: rounds that "
                          "checkpoint are not overlapped, so checkpoints timed by the clock "
                          "would change the trajectory; set checkpoint_every to a number of "
                          "rounds (0: none)")
    if config.transport == "collective" and config.tls_cert is not None:
        raise ConfigError("tls_cert with transport='collective': the parameters would travel "
                          "between the tasks unencrypted (gloo and NCCL have no TLS); use "
                          "transport='driver' for TLS")


def check_registered_model(config) -> None:
    """A registered model needs a name and a logged model (its version is that model)."""
    name = config.registered_model_name
    if name is not None and (not isinstance(name, str) or not name.strip()
                             or config.log_model is not True):
        raise ConfigError(f"registered_model_name={name!r} must be a model name, with "
                          "log_model=True (the version is the logged model; 'adapters' "
                          "logs files)")


def check_cache(config, caches: tuple[str, ...]) -> None:
    """The data cache's choice (one of `caches`), budget and shuffle window."""
    if config.data_cache not in caches:
        raise ConfigError(f"data_cache={config.data_cache!r} is not supported; use one of "
                          f"{caches}")
    require_int("cache_budget_mb", config.cache_budget_mb, minimum=1)
    require_int("shuffle_buffer_mb", config.shuffle_buffer_mb, minimum=1)
    require_int("preprocess_threads", config.preprocess_threads, minimum=1)
    require_int("prefetch_batches", config.prefetch_batches, minimum=1)
    if config.data_cache != "memory" and config.shuffle_buffer_mb > config.cache_budget_mb:
        raise ConfigError(
            f"shuffle_buffer_mb={config.shuffle_buffer_mb} is more than cache_budget_mb="
            f"{config.cache_budget_mb}: a task reading its partition from disk holds one "
            "shuffle window in memory; lower shuffle_buffer_mb or raise cache_budget_mb")


def check_flags(config, names: tuple[str, ...]) -> None:
    """Booleans that must be booleans (`eval_before_training` may be None too), `log_model`
    (True, False or "adapters") and `driver_model` ("full" or "meta")."""
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(f"{name} must be True or False, got {getattr(config, name)!r}")
    if not isinstance(config.eval_before_training, (bool, type(None))):
        raise ConfigError(f"eval_before_training must be True, False or None (when eval_df "
                          f"is given), got {config.eval_before_training!r}")
    if not isinstance(config.log_model, bool) and config.log_model != "adapters":
        raise ConfigError(f"log_model must be True, False or 'adapters', got "
                          f"{config.log_model!r}")
    if config.log_model == "adapters" and importlib.util.find_spec("safetensors") is None:
        raise ConfigError("log_model='adapters' writes safetensors files: pip install "
                          "'sparkdl-avg[hf]' (or safetensors)")
    if config.driver_model not in ("full", "meta"):
        raise ConfigError(f"driver_model must be 'full' or 'meta', got "
                          f"{config.driver_model!r}")


def check_mode(config, modes: tuple[str, ...], *, sync_only: tuple[str, ...],
               async_only: tuple[str, ...]) -> None:
    """A known mode, and no field of the other mode set to anything but its default."""
    if config.mode not in modes:
        raise ConfigError(f"mode={config.mode!r} is not supported; use one of {modes}")
    other = async_only if config.mode == "sync" else sync_only
    for f in dataclasses.fields(config):
        if f.name in other and getattr(config, f.name) != f.default:
            raise ConfigError(
                f"{f.name}={getattr(config, f.name)!r} applies to "
                f"mode={'async' if config.mode == 'sync' else 'sync'!r} only, and this "
                f"config has mode={config.mode!r}; leave {f.name} at its default "
                f"({f.default!r})")


def check_averaging(config) -> None:
    """The outer optimizer, the warm-up and delta compression (a TrainConfig calls this when
    built): names, ranges, and the combinations that cannot be honoured."""
    from sparkdl_avg.averaging.compression import COMPRESSIONS

    outer = config.outer_optimizer
    if not callable(outer) and outer not in ("average", "nesterov", "momentum"):
        raise ConfigError(f"outer_optimizer={outer!r} is not supported; use 'average', "
                          "'nesterov', 'momentum' or a callable params -> "
                          "torch.optim.Optimizer")
    if config.outer_lr is not None:
        require_float("outer_lr", config.outer_lr, positive=True)
    if config.outer_momentum is not None:
        require_float("outer_momentum", config.outer_momentum)
        if config.outer_momentum >= 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {config.outer_momentum}")
        if config.outer_momentum == 0 and outer == "nesterov":
            raise ConfigError("outer_momentum=0 with outer_optimizer='nesterov': Nesterov "
                              "needs a momentum; for no momentum use outer_optimizer="
                              "'momentum' with outer_momentum=0 (plain SGD on the "
                              "pseudo-gradient)")
    for name in ("outer_lr", "outer_momentum"):
        if getattr(config, name) is not None and (outer == "average" or callable(outer)):
            raise ConfigError(f"{name} applies to outer_optimizer='nesterov' or 'momentum'; "
                              f"with {'a callable' if callable(outer) else repr(outer)} it "
                              "would be ignored" + (" (the callable sets its own)"
                                                    if callable(outer) else ""))
    require_int("averaging_warmup_steps", config.averaging_warmup_steps, minimum=0)
    if config.delta_compression not in COMPRESSIONS:
        raise ConfigError(f"delta_compression={config.delta_compression!r} is not supported; "
                          f"use one of {COMPRESSIONS}")
    if config.delta_compression != "none" and config.average_optimizer_state:
        raise ConfigError(f"delta_compression={config.delta_compression!r} with "
                          "average_optimizer_state=True: optimizer state is averaged as it "
                          "is, not as a delta from a global copy, and it appears lazily "
                          "after the first steps; use one or the other")


def check_choices(config, *, optimizers: tuple[str, ...], devices: tuple[str, ...],
                  transports: tuple[str, ...]) -> None:
    """The optimizer and its numbers, the timeouts, the device and the transport (a
    TrainConfig calls this when built)."""
    if isinstance(config.optimizer, str):
        if config.optimizer not in optimizers:
            raise ConfigError(
                f"optimizer={config.optimizer!r} is not supported; use one of {optimizers} "
                "or a callable params -> torch.optim.Optimizer"
            )
    elif not callable(config.optimizer):
        raise ConfigError(f"optimizer must be a name or a callable, got {config.optimizer!r}")
    require_float("lr", config.lr, positive=True)
    require_float("momentum", config.momentum)
    require_float("weight_decay", config.weight_decay)
    if config.momentum >= 1:
        raise ConfigError(f"momentum must be in [0, 1), got {config.momentum}")
    require_float("round_timeout", config.round_timeout, positive=True)
    for name in ("connect_timeout", "reply_timeout", "finish_timeout", "reconnect_timeout"):
        if getattr(config, name) is not None:
            require_float(name, getattr(config, name), positive=True)
    if config.device not in devices:
        raise ConfigError(f"device={config.device!r} is not supported; use one of {devices}")
    if config.transport not in transports:
        raise ConfigError(f"transport={config.transport!r} is not supported; use one of "
                          f"{transports}")


def parse_driver_address(value) -> tuple[str | None, int]:
    """`TrainConfig.driver_address` as (host or None, port or 0)."""
    if value is None:
        return None, 0
    text = value if isinstance(value, str) else ""
    host, colon, port = text.rpartition(":") if text.count(":") == 1 else ("", "", "")
    host = host if colon else text
    if not host or (colon and not (port.isdigit() and 0 < int(port) < 65536)):
        raise ConfigError(f"driver_address={value!r} must be 'host' or 'host:port' (a port "
                          "from 1 to 65535)")
    return host, int(port) if colon else 0


def check_elastic(config) -> None:
    """`min_workers`: between 1 and num_workers, and only with what a fit whose workers come
    and go can honour."""
    m = config.min_workers
    if m is None:
        return
    require_int("min_workers", m, minimum=1)
    if m > config.num_workers:
        raise ConfigError(f"min_workers={m} is above num_workers={config.num_workers}: a fit "
                          "cannot need more workers than it has")
    refused = (
        (config.transport == "collective", "transport='collective': a gloo or NCCL group "
         "cannot lose a member and go on; use transport='driver'"),
        (config.overlap_averaging, "overlap_averaging=True: a returning worker would take up "
         "a round whose average is still in flight"),
        (config.average_optimizer_state, "average_optimizer_state=True: a returning worker "
         "rebuilds its optimizer state, which it cannot average with the others' until its "
         "first step"),
    )
    for bad, why in refused:
        if bad:
            raise ConfigError(f"min_workers={m} (an elastic fit) with {why}")


def refuse_unknown_fields(cls):
    """A dataclass whose constructor refuses a name it lacks with a ConfigError naming it and
    the nearest field, rather than Python's TypeError."""
    init, names = cls.__init__, sorted(f.name for f in dataclasses.fields(cls))

    @functools.wraps(init)
    def checked(self, *args, **fields) -> None:
        unknown = sorted(set(fields) - set(names))
        if unknown:
            hint = difflib.get_close_matches(unknown[0], names, n=1)
            raise ConfigError(f"{cls.__name__} has no field {unknown[0]!r}"
                              + (f"; did you mean {hint[0]!r}?" if hint else
                                 f"; its fields are {', '.join(names)}"))
        init(self, *args, **fields)

    cls.__init__ = checked
    return cls
