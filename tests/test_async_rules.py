"""The asynchronous update rules against values computed by hand."""

import numpy as np
import pytest

from sparkdl_avg.ps.rules import CHUNK, RULES, make_rule
from sparkdl_avg.ps.staleness import may_apply, may_read, pushes_between_fetches


def test_downpour_subtracts_the_pushed_update():
    s = make_rule("downpour", np.array([1.0, 2.0]))
    s.pull(0)
    s.apply(0, np.array([0.5, -1.0]))
    assert s.params.tolist() == [0.5, 3.0]


@pytest.mark.exact
def test_dcasgd_constant_lambda_by_hand():
    # lr 0.1, lambda 0.04. Worker 0 pulls w=[1, 2]; meanwhile the server moved to [1.5, 1.0].
    s = make_rule("dcasgd", np.array([1.0, 2.0]), lr=0.1, dc_lambda=0.04)
    s.pull(0)
    s.params[:] = [1.5, 1.0]
    s.apply(0, np.array([0.2, -0.1]))  # g = update / lr = [2, -1]
    # w - lr*(g + lam*g*g*(w - backup)) = [1.5 - 0.1*(2 + 0.04*4*0.5), 1 - 0.1*(-1 + 0.04*1*-1)]
    np.testing.assert_allclose(s.params, [1.5 - 0.1 * 2.08, 1.0 - 0.1 * -1.04], rtol=1e-15)


@pytest.mark.exact
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


@pytest.mark.exact
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


def by_hand(algorithm: str, w0: np.ndarray, events: list, *, lr: float, scale: float,
            lam: float) -> np.ndarray:
    """The server's parameters after `events`, by DC-ASGD's formula written out: each push
    ("push", update, point) carries the point its worker computed the update from (its own
    parameters then), and the compensation is lambda*g*g*(w - point). Pulls need no
    bookkeeping here: the point comes from the worker."""
    w, meansquare = w0.copy(), np.zeros_like(w0)
    for _, update, point in (e for e in events if e[0] == "push"):
        g = scale * update / lr
        if algorithm == "downpour":
            w = w - lr * g
            continue
        if algorithm == "dcasgd":
            lam_t = lam
        else:  # adaptive: meansquare (momentum 0.95) updated first, then lambda0/sqrt(.+eps)
            meansquare = 0.95 * meansquare + 0.05 * g * g
            lam_t = lam / np.sqrt(meansquare + 1e-7)
        w = w - lr * (g + lam_t * g * g * (w - point))
    return w


# Two workers that fetch less often than they push (worker 0 every 3 pushes, worker 1 every
# 2), interleaved so that both pull before either pushes and each pushes again from its own
# parameters: which point each update is computed from is what the rule must track.
SCHEDULE = [(0, "pull"), (1, "pull"), (0, "push"), (1, "push"), (0, "push"), (1, "push"),
            (1, "pull"), (0, "push"), (0, "pull"), (1, "push"), (0, "push"), (1, "push"),
            (0, "push"), (1, "pull"), (1, "push"), (0, "push")]


def simulate(rule, schedule=SCHEDULE, lr: float = 0.1) -> list:
    """Workers doing plain SGD on quadratics of their own (gradient a*(w - c)) from their own
    parameters, pulling and pushing to `rule` in the order of `schedule`. Returns the
    events, each push with the point its update was computed from."""
    a = {0: np.array([1.0, 3.0, 0.5]), 1: np.array([2.0, 0.7, 4.0])}
    c = {0: np.array([1.0, -1.0, 2.0]), 1: np.array([-2.0, 0.5, 1.0])}
    own, events = {}, []
    for worker, what in schedule:
        if what == "pull":
            own[worker] = rule.pull(worker).copy()
            events.append(("pull", None, None))
            continue
        update = lr * a[worker] * (own[worker] - c[worker])  # one local SGD step
        events.append(("push", update, own[worker].copy()))
        own[worker] = own[worker] - update  # the worker goes on from its own parameters
        rule.apply(worker, update.copy())
    return events


@pytest.mark.parametrize(("algorithm", "lam"), [("dcasgd", 0.5), ("dcasgd-adaptive", 2.0)])
@pytest.mark.exact
def test_dcasgd_compensates_from_where_each_worker_computed_its_update(algorithm, lam):
    """With fetch_every > push_every a worker's second update is computed at its backup
    moved by its own first update (whole: update_scale 0.5 scales only the server's step),
    not at the parameters it pulled; its own pushes are no delay to compensate."""
    w0 = np.array([0.5, -1.0, 2.0])
    rule = make_rule(algorithm, w0.copy(), lr=0.1, update_scale=0.5, dc_lambda=lam)
    events = simulate(rule)
    expected = by_hand(algorithm, w0, events, lr=0.1, scale=0.5, lam=lam)
    np.testing.assert_allclose(rule.params, expected, rtol=1e-13, atol=1e-15)
    plain = by_hand("downpour", w0, events, lr=0.1, scale=0.5, lam=lam)
    assert np.abs(expected - plain).max() > 1e-3  # the compensation is there, and counts


@pytest.mark.exact
def test_dcasgd_with_one_worker_is_downpour_whatever_it_fetches():
    """One worker has no delay: it computes every update at the server's own parameters,
    whether it fetched them or not (before, its own pushes counted as staleness)."""
    w0 = np.array([0.5, -1.0, 2.0])
    schedule = [(0, "pull")] + [(0, "push")] * 5 + [(0, "pull")] + [(0, "push")] * 3
    dc = make_rule("dcasgd", w0.copy(), lr=0.1, update_scale=1.0, dc_lambda=1.0)
    events = simulate(dc, schedule)
    np.testing.assert_allclose(dc.params, by_hand("downpour", w0, events, lr=0.1, scale=1.0,
                                                  lam=0.0), rtol=1e-14)
    np.testing.assert_allclose(dc.backups[0], dc.params, rtol=1e-14)


def test_a_staleness_bound_caps_the_pushes_between_fetches():
    assert pushes_between_fetches(4, None, None) == 1  # fetch_every None: every push
    assert pushes_between_fetches(4, 32, None) == 8
    assert pushes_between_fetches(4, 32, 2) == 3  # bound 2: at least every 3 pushes
    assert pushes_between_fetches(4, 32, 0) == 1  # lockstep: after every push
    assert pushes_between_fetches(1, 4, 7) == 4  # a loose bound changes nothing


@pytest.mark.parametrize("algorithm", sorted(RULES))
@pytest.mark.parametrize("size", [1, 4])
def test_an_update_of_another_size_is_refused_whole(algorithm, size):
    """Not broadcast (numpy would spread a 1-element update over every parameter), not
    applied in part: the server's buffers are sized when a frame arrives, and a re-INIT with
    another model may come between."""
    rule = make_rule(algorithm, np.zeros(3))
    rule.pull(0)
    with pytest.raises(ValueError, match=f"an update of {size} values for 3 parameters"):
        rule.apply(0, np.ones(size))
    assert rule.params.tolist() == [0.0] * 3


def test_clocks_a_new_set_replaces_the_old_and_a_newcomer_starts_level_with_the_slowest():
    from sparkdl_avg.ps.staleness import Clocks

    clocks = Clocks()
    clocks.reset(range(3))
    for w in (0, 1):
        clocks.has_read(w)
        clocks.has_pushed(w)
    assert not clocks.may_read(0, bound=0)  # worker 2 is still at clock 0
    clocks.reset(range(2))  # a re-INIT for fewer workers: no phantom worker 2
    assert clocks.pushed == {0: 0, 1: 0} and clocks.read == {0: -1, 1: -1}
    clocks.has_read(0)
    clocks.has_pushed(0)
    clocks.join(5)  # a connected worker none announced: level with the slowest
    assert clocks.pushed[5] == 0 and clocks.read[5] == -1
    clocks.leave(1)
    clocks.leave(5)
    assert clocks.may_read(0, bound=0) and clocks.may_apply(0, bound=0)


@pytest.mark.parametrize("algorithm", sorted(RULES))
def test_an_overflow_in_the_last_chunk_changes_nothing(algorithm):
    """The rules compute chunk by chunk: an update that overflows only in the last chunk,
    after every earlier chunk computed finite values, leaves the parameters, the worker's
    backup and the mean square as they were (nothing half-applied)."""
    rng = np.random.default_rng(0)
    n = 2 * CHUNK + 17
    s = make_rule(algorithm, rng.standard_normal(n).astype(np.float32), lr=0.1,
                  update_scale=0.5)
    s.pull(0)
    assert s.apply(0, (rng.standard_normal(n) * 1e-2).astype(np.float32), lr=0.05)
    s.params[-1] = -3.4e38
    params, backups = s.params.copy(), {w: b.copy() for w, b in getattr(s, "backups", {}).items()}
    meansquare = getattr(s, "meansquare", None)
    meansquare = None if meansquare is None else meansquare.copy()
    update = (rng.standard_normal(n) * 1e-2).astype(np.float32)  # every chunk moves
    update[-1] = 3.4e38  # only the last element overflows (DC-ASGD: g = update / lr too)
    assert not s.apply(0, update, lr=0.05)
    np.testing.assert_array_equal(s.params, params)
    for w, backup in backups.items():
        np.testing.assert_array_equal(s.backups[w], backup)
    if meansquare is not None:
        np.testing.assert_array_equal(s.meansquare, meansquare)


@pytest.mark.parametrize("algorithm", sorted(RULES))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_an_update_holding_nan_or_inf_is_refused_by_every_rule(algorithm, bad):
    """The server makes no NaN/Inf pass of its own over an update: each rule's check of what
    it computed refuses one, in any chunk, at update_scale 0 and at lr 0 too (DC-ASGD then
    takes no step, but the backup still takes the update)."""
    n = 2 * CHUNK + 5
    for scale, lr, where in ((1.0, 0.05, 3), (0.0, 0.05, CHUNK + 1), (0.5, 0.0, n - 1)):
        s = make_rule(algorithm, np.ones(n), lr=0.1, update_scale=scale)
        s.pull(0)
        update = np.full(n, 1e-3)
        update[where] = bad
        assert not s.apply(0, update, lr=lr)
        assert np.all(s.params == 1.0)
        assert all(np.all(b == 1.0) for b in getattr(s, "backups", {}).values())


@pytest.mark.parametrize("algorithm", ["dcasgd", "dcasgd-adaptive"])
@pytest.mark.parametrize("lr", [0.1, 0.0])
def test_dcasgd_applies_the_statistics_after_the_gradients_as_downpour_does(algorithm, lr):
    """BatchNorm's running statistics follow the trainable parameters on the wire; their
    change is no lr x gradient. Read as one, DC-ASGD's g and its compensation grow as 1/lr
    and drove a running variance negative. Here the parameters step as DC-ASGD (against the
    rule without statistics, an independent run) and the statistics as Downpour, at lr 0
    too. Two chunks, so that the boundary falls inside one of them."""
    rng = np.random.default_rng(5)
    gradients, size = CHUNK + 3, 2 * CHUNK
    start = rng.standard_normal(size)
    moved = start + rng.standard_normal(size)  # where the server is when worker 0 pushes
    update = rng.standard_normal(size) * 1e-2
    rule = make_rule(algorithm, start.copy(), lr=0.1, update_scale=0.25, gradients=gradients)
    alone = make_rule(algorithm, start[:gradients].copy(), lr=0.1, update_scale=0.25)
    for r in (rule, alone):
        r.pull(0)
        r.params[:] = moved[:r.params.size]
        assert r.apply(0, update[:r.params.size].copy(), lr=lr)
    # the same elementwise operations on the same values (each rounded once, by IEEE): equal
    np.testing.assert_array_equal(rule.params[:gradients], alone.params)
    np.testing.assert_allclose(rule.params[gradients:],
                               moved[gradients:] - 0.25 * update[gradients:], rtol=1e-15)


def test_a_workers_staleness_summary_comes_from_counts_not_a_list_an_update():
    import collections

    from sparkdl_avg.ps.staleness import summary

    got = summary(collections.Counter({0: 2, 3: 1}))  # staleness 0, 0, 3
    assert got == {"count": 3, "mean": 1.0, "max": 3, "histogram": {"0": 2, "3": 1}}
    assert summary(collections.Counter())["count"] == 0


def test_adaptive_dcasgd_keeps_no_mean_square_where_no_gradient_is():
    """Statistics get none (zeros, checkpointed as such), also after a restore, and a shard
    holding only statistics keeps none at all."""
    rng = np.random.default_rng(2)
    rule = make_rule("dcasgd-adaptive", rng.standard_normal(8), lr=0.1, gradients=5)
    rule.pull(0)
    assert rule.apply(0, rng.standard_normal(8) * 1e-2)
    restored = make_rule("dcasgd-adaptive", rule.params.copy(), lr=0.1, gradients=5)
    restored.load_state(rule.state())
    restored.pull(0)
    assert restored.apply(0, rng.standard_normal(8) * 1e-2)
    assert (restored.state()["meansquare"][5:] == 0).all()
    assert (restored.state()["meansquare"][:5] > 0).all()
    stats_only = make_rule("dcasgd-adaptive", np.zeros(4), lr=0.1, gradients=0)
    stats_only.pull(0)
    assert stats_only.apply(0, np.ones(4)) and stats_only.state() == {}
