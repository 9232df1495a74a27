import dataclasses

import pytest

from sparkdl_avg import ConfigError, TrainConfig


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
        ("optimizer", "rmsprop", "optimizer='rmsprop' is not supported"),
        ("optimizer", 3, "optimizer must be a name or a callable"),
        ("device", "tpu", "device='tpu' is not supported"),
        ("round_timeout", 0, "round_timeout must be positive"),
        ("shuffle", "yes", "shuffle must be True or False"),
    ],
)
def test_invalid_fields_name_themselves(field, value, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{field: value})


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
