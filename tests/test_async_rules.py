"""The asynchronous update rules against values computed by hand."""

import numpy as np
import pytest

from sparkdl_avg.ps.rules import RULES, make_rule
from sparkdl_avg.ps.staleness import may_apply, may_read


def test_downpour_subtracts_the_pushed_update():
    s = make_rule("downpour", np.array([1.0, 2.0]))
    s.pull(0)
    s.apply(0, np.array([0.5, -1.0]))
    assert s.params.tolist() == [0.5, 3.0]


def test_dcasgd_constant_lambda_by_hand():
    # lr 0.1, lambda 0.04. Worker 0 pulls w=[1, 2]; meanwhile the server moved to [1.5, 1.0].
    s = make_rule("dcasgd", np.array([1.0, 2.0]), lr=0.1, dc_lambda=0.04)
    s.pull(0)
    s.params[:] = [1.5, 1.0]
    s.apply(0, np.array([0.2, -0.1]))  # g = update / lr = [2, -1]
    # w - lr*(g + lam*g*g*(w - backup)) = [1.5 - 0.1*(2 + 0.04*4*0.5), 1 - 0.1*(-1 + 0.04*1*-1)]
    np.testing.assert_allclose(s.params, [1.5 - 0.1 * 2.08, 1.0 - 0.1 * -1.04], rtol=1e-15)


def test_dcasgd_takes_the_learning_rate_the_push_was_computed_with():
    # A schedule's push at lr 0.05 (the server's is 0.1): g = [0.2, -0.1] / 0.05 = [4, -2]
    s = make_rule("dcasgd", np.array([1.0, 2.0]), lr=0.1, dc_lambda=0.04)
    s.pull(0)
    s.params[:] = [1.5, 1.0]
    s.apply(0, np.array([0.2, -0.1]), lr=0.05)
    # w - lr*(g + lam*g*g*(w - backup)) = [1.5 - 0.05*(4 + 0.04*16*0.5), 1 - 0.05*(-2 - 0.04*4)]
    np.testing.assert_allclose(s.params, [1.5 - 0.05 * 4.32, 1.0 - 0.05 * -2.16], rtol=1e-15)


def test_dcasgd_skips_an_update_at_learning_rate_zero():
    s = make_rule("dcasgd", np.array([1.0]), lr=0.1, dc_lambda=0.04)
    s.pull(0)
    s.apply(0, np.array([0.0]), lr=0.0)  # a schedule at zero: no step, and no 0/0
    assert s.params.tolist() == [1.0]


def test_dcasgd_keeps_one_backup_per_worker():
    s = make_rule("dcasgd", np.array([0.0]), lr=1.0, dc_lambda=1.0)
    s.pull(0)                 # worker 0's backup: 0
    s.params[:] = [1.0]
    s.pull(1)                 # worker 1's backup: 1 (worker 0's stays 0)
    s.apply(0, np.array([1.0]))  # g=1: w = 1 - (1 + 1*1*(1 - 0)) = -1
    assert s.params.tolist() == [-1.0]
    s.apply(1, np.array([1.0]))  # g=1: w = -1 - (1 + 1*1*(-1 - 1)) = 0
    assert s.params.tolist() == [0.0]


def test_dcasgd_adaptive_scales_lambda_by_the_mean_square():
    s = make_rule("dcasgd-adaptive", np.array([1.0]), lr=0.5, dc_lambda=2.0)
    assert (s.MOMENTUM, s.EPS) == (0.95, 1e-7)  # the paper's defaults, owned by the rule
    s.pull(0)
    s.params[:] = [2.0]
    s.apply(0, np.array([1.0]))  # g = 2; ms = 0.05*4 = 0.2; lam = 2/sqrt(0.2 + 1e-7)
    lam = 2.0 / np.sqrt(0.2 + 1e-7)
    assert s.params[0] == pytest.approx(2.0 - 0.5 * (2 + lam * 4 * (2.0 - 1.0)), rel=1e-12)
    assert s.meansquare[0] == pytest.approx(0.2)


def test_push_before_pull_is_refused_for_dcasgd():
    s = make_rule("dcasgd", np.zeros(1))
    with pytest.raises(ValueError, match="pushed before it pulled"):
        s.apply(3, np.ones(1))


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="algorithm='hogwild'"):
        make_rule("hogwild", np.zeros(1))


def test_each_rule_owns_its_defaults():
    assert make_rule("dcasgd", np.zeros(1)).settings() == {"dc_lambda": 0.04}
    assert make_rule("dcasgd-adaptive", np.zeros(1)).settings() == {"dc_lambda": 2.0}
    assert make_rule("downpour", np.zeros(1)).settings() == {}
    assert list(RULES) == ["downpour", "dcasgd", "dcasgd-adaptive"]


def test_ssp_read_rule():
    clocks = {0: 5, 1: 3}
    assert may_read(clocks, 0, bound=2)
    assert not may_read(clocks, 0, bound=1)
    assert may_read(clocks, 1, bound=0)
    assert may_read(clocks, 0, bound=None)
    assert not may_read({0: 1, 1: 0}, 0, bound=0)  # s=0 is bulk synchronous


def test_ssp_apply_rule_ignores_the_pusher_itself():
    reads = {0: 0, 1: 2}
    assert may_apply(reads, 1, clock=2, bound=0) is False  # worker 0 has not read round 2
    assert may_apply(reads, 0, clock=2, bound=0)  # worker 1 has; worker 0's own read is moot
    assert may_apply(reads, 1, clock=2, bound=2)
    assert may_apply(reads, 1, clock=9, bound=None)
