from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sparkdl_avg.averaging.arithmetic import (
    _CHUNK,
    average_and_diverge,
    non_finite_replicas,
    weighted_average,
)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.exact
def test_weighted_average_matches_numpy(dtype):
    rng = np.random.default_rng(0)
    bufs = [rng.normal(size=1000).astype(dtype) for _ in range(3)]
    weights = [10, 30, 60]
    out = np.empty(1000, dtype)
    weighted_average(bufs, weights, out)
    expected = sum(w * b.astype(np.float64) for w, b in zip(weights, bufs, strict=True)) / 100
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)


def test_equal_weights_give_the_plain_mean():
    a, b = np.array([1.0, 2.0]), np.array([3.0, 6.0])
    out = np.empty(2)
    weighted_average([a, b], [5, 5], out)
    assert out.tolist() == [2.0, 4.0]


def test_bad_weights_are_refused():
    with pytest.raises(ValueError):
        weighted_average([np.zeros(2)], [0], np.empty(2))
    with pytest.raises(ValueError):
        weighted_average([np.zeros(2)], [1, 2], np.empty(2))


def test_the_divergence_is_the_mean_l2_norm_from_the_average():
    # the average is (0, 0); the replicas are 5, 5 and 0 away
    buffers = [np.array([3.0, 4.0]), np.array([-3.0, -4.0]), np.array([0.0, 0.0])]
    _, divergence = average_and_diverge(buffers, [1, 1, 4], np.empty(2), diverge_numel=2)
    assert divergence == (5.0 + 5.0 + 0.0) / 3


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.exact
def test_the_one_pass_round_matches_an_independent_float64_computation(dtype):
    # several chunks and a ragged last one; the divergence stops inside a chunk
    rng = np.random.default_rng(1)
    size, numel = 3 * _CHUNK + 17, 2 * _CHUNK + 5
    bufs = [rng.normal(size=size).astype(dtype) for _ in range(3)]
    weights = [7, 1, 2]
    out = np.empty(size, dtype)
    finite, divergence = average_and_diverge(bufs, weights, out, diverge_numel=numel)
    wide = [b.astype(np.float64) for b in bufs]
    expected = sum(w * b for w, b in zip(weights, wide, strict=True)) / 10
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)
    distances = [np.sqrt(((b[:numel] - expected[:numel]) ** 2).sum()) for b in wide]
    assert finite
    assert divergence == pytest.approx(np.mean(distances), rel=1e-5 if tol > 1e-10 else 1e-12)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_the_one_pass_round_tells_a_non_finite_average(bad):
    bufs = [np.ones(2 * _CHUNK, np.float32) for _ in range(2)]
    bufs[1][_CHUNK + 3] = bad
    finite, _ = average_and_diverge(bufs, [1, 1], np.empty(2 * _CHUNK, np.float32),
                                    diverge_numel=0)
    assert not finite


def test_finite_values_whose_sum_overflows_are_still_finite():
    big = np.full(4, np.finfo(np.float32).max / 2, np.float32)
    finite, _ = average_and_diverge([big, big], [1, 1], np.empty(4, np.float32),
                                    diverge_numel=4)
    assert finite


def test_non_finite_replicas_are_found():
    assert non_finite_replicas([np.ones(3), np.array([1.0, np.nan]), np.array([np.inf])]) == [1, 2]


def test_the_flat_buffer_keeps_a_channels_last_model_channels_last():
    import torch

    from sparkdl_avg.averaging.flat_buffer import FlatBuffer, averaged_tensors

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)).to(
        memory_format=torch.channels_last)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    before = model(x).detach().clone()
    values = [t.detach().clone() for t in averaged_tensors(model)]
    flat = FlatBuffer(averaged_tensors(model), torch.float32)
    weight = model[0].weight
    assert weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(values, averaged_tensors(model), strict=True))
    assert torch.equal(model(x), before)
    # the wire buffer is the tensors' storage: a value written there is the model's
    flat.array[:] = 0.5
    flat.scatter()
    assert bool((weight == 0.5).all()) and weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [5, 2 * _CHUNK + 1])  # among the distances, or past them
def test_a_non_finite_value_is_told_where_distances_are_taken_and_past_them(bad, where):
    bufs = [np.ones(3 * _CHUNK, np.float32) for _ in range(2)]
    bufs[0][where] = bad
    finite, _ = average_and_diverge(bufs, [1, 3], np.empty(3 * _CHUNK, np.float32),
                                    diverge_numel=_CHUNK + 7)
    assert not finite


def test_finite_replicas_whose_distance_overflows_are_still_finite():
    # averaged to 0, each 3e38 away: the squared distance overflows, the average does not
    top = np.finfo(np.float32).max * 0.9
    bufs = [np.full(8, top, np.float32), np.full(8, -top, np.float32)]
    finite, divergence = average_and_diverge(bufs, [1, 1], np.empty(8, np.float32),
                                             diverge_numel=8)
    assert finite and divergence == np.inf


@pytest.mark.parametrize("bad", [None, np.nan])
def test_threads_give_one_thread_s_results_bit_for_bit(bad):
    # spans of whole chunks on a pool; the divergence adds each chunk's in chunk order
    rng = np.random.default_rng(2)
    size, numel = 40 * _CHUNK + 123, 33 * _CHUNK + 9
    bufs = [rng.normal(size=size).astype(np.float32) for _ in range(3)]
    if bad is not None:
        bufs[2][37 * _CHUNK] = bad
    one, many = np.empty(size, np.float32), np.empty(size, np.float32)
    alone = average_and_diverge(bufs, [5, 2, 9], one, diverge_numel=numel)
    with ThreadPoolExecutor(3) as pool:
        split = average_and_diverge(bufs, [5, 2, 9], many, diverge_numel=numel, pool=pool,
                                    threads=3)
    assert alone == split and alone[0] is (bad is None)
    assert one.tobytes() == many.tobytes()
