import dataclasses
import inspect
import pickle
import re
from pathlib import Path

import pytest

from sparkdl_avg import ConfigError, TrainConfig
from sparkdl_avg._config import ASYNC_ONLY, SYNC_ONLY, Waits


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_workers", 0, "num_workers must be at least 1"),
        ("num_workers", 1.5, "num_workers must be an integer"),
        ("averaging_frequency", 0, "averaging_frequency must be at least 1"),
        ("batch_size", -1, "batch_size must be at least 1"),
        ("epochs", True, "epochs must be an integer"),
        ("lr", 0.0, "lr must be positive"),
        ("lr", float("nan"), "lr must be a finite number"),
        ("momentum", 1.0, "momentum must be in"),
        ("weight_decay", -0.01, "weight_decay must not be negative"),
        ("weight_decay", float("inf"), "weight_decay must be a finite number"),
        ("weight_decay", "0.1", "weight_decay must be a finite number"),
        ("optimizer", "rmsprop", "optimizer='rmsprop' is not supported"),
        ("optimizer", 3, "optimizer must be a name or a callable"),
        ("device", "tpu", "device='tpu' is not supported"),
        ("round_timeout", 0, "round_timeout must be positive"),
        ("shuffle", "yes", "shuffle must be True or False"),
        ("data_cache", "ssd", "data_cache='ssd' is not supported"),
        ("eval_batch_size", 0, "eval_batch_size must be at least 1"),
        ("cache_budget_mb", 0, "cache_budget_mb must be at least 1"),
        ("shuffle_buffer_mb", 2.5, "shuffle_buffer_mb must be an integer"),
        ("shuffle_buffer_mb", 600, "shuffle_buffer_mb=600 is more than cache_budget_mb=512"),
    ],
)
def test_invalid_fields_name_themselves(field, value, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{field: value})


def test_a_memory_cache_ignores_the_budget_so_its_shuffle_window_may_exceed_it():
    TrainConfig(data_cache="memory", shuffle_buffer_mb=600)
    with pytest.raises(ConfigError, match="holds one shuffle window in memory"):
        TrainConfig(data_cache="disk", shuffle_buffer_mb=4, cache_budget_mb=2)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        TrainConfig(num_workers=0)


def test_to_dict_has_every_field_as_a_string():
    import torch

    cfg = TrainConfig(optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    params = cfg.to_dict()
    assert set(params) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert all(isinstance(v, str) for v in params.values())
    assert "lambda" in params["optimizer"]


def test_frozen():
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_workers = 3


def _non_default(name: str):
    """A valid value other than the field's default."""
    return {"averaging_frequency": 3, "average_optimizer_state": True, "eval_every": 2,
            "checkpoint_every": 4, "algorithm": "dcasgd", "push_every": 4, "fetch_every": 16,
            "staleness_bound": 2, "dc_lambda": 0.1, "ps_address": "h:1",
            "ps_secret_file": "s", "ps_tls_ca": "ca.pem", "eval_interval_s": 1.0,
            "ps_checkpoint_every": 3, "reconnect_timeout": 5.0, "tls_cert": "c.pem",
            "ps_shards": 2,
            "tls_key": "k.pem", "tls_ca": "ca.pem", "transport": "collective",
            "overlap_averaging": True, "outer_optimizer": "nesterov", "outer_lr": 0.5,
            "outer_momentum": 0.5, "averaging_warmup_steps": 10, "delta_compression": "int8",
            "min_workers": 1, "shared_memory": False,
            }[name]


@pytest.mark.parametrize("name", ASYNC_ONLY)
def test_an_async_field_set_in_sync_mode_is_refused_naming_field_and_mode(name):
    with pytest.raises(ConfigError, match=rf"{name}=.* applies to mode='async' only.*"
                                          r"mode='sync'"):
        TrainConfig(**{name: _non_default(name)})


@pytest.mark.parametrize("name", SYNC_ONLY)
def test_a_sync_field_set_in_async_mode_is_refused_naming_field_and_mode(name):
    with pytest.raises(ConfigError, match=rf"{name}=.* applies to mode='sync' only.*"
                                          r"mode='async'"):
        TrainConfig(mode="async", **{name: _non_default(name)})


def test_fields_left_at_their_defaults_never_fail_so_replace_is_safe():
    sync = TrainConfig(num_workers=3, lr=0.1)
    assert dataclasses.replace(sync, mode="async").mode == "async"
    both = {f.name for f in dataclasses.fields(TrainConfig)} - set(SYNC_ONLY) - set(ASYNC_ONLY)
    assert "round_timeout" in both and "checkpoint_dir" in both and "mode" in both


def test_with_ps_address_the_servers_own_settings_are_refused_not_ignored():
    for name, option in (("dc_lambda", "--dc-lambda"), ("ps_checkpoint_every",
                                                        "--checkpoint-every")):
        with pytest.raises(ConfigError, match=f"start the server with {option}"):
            TrainConfig(mode="async", algorithm="dcasgd", ps_address="h:1",
                        ps_secret_file="s", **{name: _non_default(name)})


def test_dc_lambda_belongs_to_the_rules_that_read_it():
    with pytest.raises(ConfigError, match="not to algorithm='downpour'"):
        TrainConfig(mode="async", dc_lambda=0.1)
    with pytest.raises(ConfigError, match="algorithm='hogwild' is not supported"):
        TrainConfig(mode="async", algorithm="hogwild")


def test_waits_derive_from_round_timeout_unless_set():
    assert TrainConfig(round_timeout=10).waits() == Waits(
        round=10, connect=300, reply=50, finish=10, reconnect=10)
    assert TrainConfig(mode="async", round_timeout=400).waits() == Waits(
        round=400, connect=400, reply=400, finish=400, reconnect=400)
    assert TrainConfig(round_timeout=10, connect_timeout=5, reply_timeout=7,
                       finish_timeout=8).waits() == Waits(
        round=10, connect=5, reply=7, finish=8, reconnect=10)
    # elastic: a retried task still loading its partition gets to connect and be told the
    # fit has ended, rather than the finished fit failing while it loads
    assert TrainConfig(num_workers=2, min_workers=1, round_timeout=10).waits().finish == 300
    assert TrainConfig(num_workers=2, min_workers=1, round_timeout=10,
                       finish_timeout=8).waits().finish == 8
    with pytest.raises(ConfigError, match="reply_timeout must be positive"):
        TrainConfig(reply_timeout=0)


def test_the_docs_table_lists_every_field_with_its_mode():
    page = (Path(__file__).parents[1] / "docs" / "guide" / "trainconfig.md").read_text()
    table = page.split("| field | mode | default | meaning |", 1)[1].split("\n\n", 1)[0]
    table = "| field | mode | default | meaning |" + table
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`(\w+)`", cells[0]):
            rows[name] = cells[1]
    assert set(rows) == {f.name for f in dataclasses.fields(TrainConfig)}
    for name, mode in rows.items():
        expected = "sync" if name in SYNC_ONLY else "async" if name in ASYNC_ONLY else "both"
        assert mode == expected, name


@pytest.mark.parametrize("value", ["", ":5", "h:", "h:x", "h:0", "h:70000", 5])
def test_a_driver_address_is_a_host_or_host_and_port(value):
    with pytest.raises(ConfigError, match="driver_address=.* must be 'host' or 'host:port'"):
        TrainConfig(driver_address=value)
    assert TrainConfig(driver_address="10.0.0.7").driver_host_port() == ("10.0.0.7", 0)
    assert TrainConfig(driver_address="node-1:7100").driver_host_port() == ("node-1", 7100)
    assert TrainConfig().driver_host_port() == (None, 0)


def test_overlap_needs_checkpoints_counted_in_rounds():
    # checkpoint rounds are waited for, not overlapped: placed by the clock, they would make
    # the trajectory depend on timing
    with pytest.raises(ConfigError, match="overlap_averaging with checkpoint_every=None"):
        TrainConfig(overlap_averaging=True)
    TrainConfig(overlap_averaging=True, checkpoint_every=0)
    TrainConfig(overlap_averaging=True, checkpoint_every=10)


def test_a_misspelt_field_is_a_config_error_naming_the_nearest():
    with pytest.raises(ConfigError, match=r"TrainConfig has no field 'num_worker'; did you "
                                          r"mean 'num_workers'\?"):
        TrainConfig(num_worker=2)
    with pytest.raises(ConfigError, match=r"no field 'zzz'; its fields are .*num_workers"):
        TrainConfig(zzz=1)
    config = TrainConfig(num_workers=2)  # what the check must not change: copies, pickles
    assert dataclasses.replace(config, epochs=3).epochs == 3
    assert pickle.loads(pickle.dumps(config)) == config
    assert "num_workers" in inspect.signature(TrainConfig).parameters
