"""The parameter server's settings travel from a fit to the server's command line and back
without loss, and the command line's options are the settings' fields."""

import argparse
import dataclasses

import pytest

from sparkdl_avg import ConfigError
from sparkdl_avg.ps.rules import ALGORITHMS
from sparkdl_avg.ps.settings import ServerSettings


def parse(argv: list[str]) -> ServerSettings:
    parser = argparse.ArgumentParser()
    ServerSettings.add_arguments(parser)
    return ServerSettings.from_args(parser.parse_args(argv))


def test_argv_is_only_a_serialisation():
    settings = ServerSettings(algorithm="dcasgd-adaptive", lr=3e-4, dc_lambda=1.5,
                              update_scale=1 / 3, staleness_bound=0, timeout=12.5,
                              max_message_mb=64, checkpoint_every=20)
    assert parse(settings.to_argv()) == settings  # 1/3 survives exactly
    assert parse([]) == ServerSettings()


def test_every_field_is_an_option_and_the_rules_are_the_choices():
    parser = argparse.ArgumentParser()
    ServerSettings.add_arguments(parser)
    options = {a.dest: a for a in parser._actions}
    assert {f.name for f in dataclasses.fields(ServerSettings)} <= set(options)
    assert tuple(options["algorithm"].choices) == ALGORITHMS


@pytest.mark.parametrize(("change", "match"), [
    ({"algorithm": "hogwild"}, "algorithm='hogwild' is not supported"),
    ({"lr": 0}, "lr must be a positive number"),
    ({"dc_lambda": 0.1}, "dc_lambda applies to the DC-ASGD rules"),
    ({"staleness_bound": -1}, "staleness_bound must be a non-negative integer"),
])
def test_bad_settings_are_refused_naming_the_field(change, match):
    with pytest.raises(ConfigError, match=match):
        ServerSettings(**change)


def test_differences_name_both_values_of_what_a_fit_and_its_server_share():
    server = ServerSettings(algorithm="dcasgd", lr=0.1, staleness_bound=2, timeout=5)
    assert server.differences({"algorithm": "dcasgd", "lr": 0.1, "staleness_bound": 2}) == []
    assert server.differences({"algorithm": "downpour", "lr": 0.2, "staleness_bound": 2}) == [
        "algorithm: the fit has 'downpour', the server 'dcasgd'",
        "lr: the fit has 0.2, the server 0.1"]
