"""Outer optimizers, the averaging warm-up and compressed deltas, without Spark: the pure
pieces against independent computations, and the driver transport's exchange over loopback
(the driver and every worker end each round with the same bits)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkdl_avg import ConfigError, TrainConfig
from sparkdl_avg.averaging import compression
from sparkdl_avg.averaging.coordinator import Coordinator
from sparkdl_avg.averaging.driver_channel import DriverChannel
from sparkdl_avg.averaging.flat_buffer import FlatBuffer
from sparkdl_avg.averaging.global_step import GlobalStep
from sparkdl_avg.averaging.outer import OuterOptimizer, outer_factory, outer_settings
from sparkdl_avg.averaging.transport import RoundReport
from sparkdl_avg.driver.checkpoints import Checkpoint
from sparkdl_avg.driver.resume_checks import check_resumable
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import Credential, new_secret
from sparkdl_avg.task.schedule import Schedule
from sparkdl_avg.task.worker_state import pack_entries, unpack

ENCODINGS = ("bf16", "int8", "int4")


# --- block quantization and error feedback ------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 3000), scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e6, 1e30]),
       encoding=st.sampled_from(ENCODINGS), seed=st.integers(0, 2 ** 32 - 1),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_each_value_comes_back_within_half_a_step(numel, scale, encoding, seed, dtype):
    """int8/int4: within half its block's step (largest magnitude / 127 or 7); bf16: within
    half a bfloat16 ulp (8 bits of mantissa) of the value as float32."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(numel) * scale * rng.choice([1e-3, 1, 30], numel)
              ).astype(dtype)
    values[rng.random(numel) < 0.05] = 0
    payload = np.empty(compression.encoded_nbytes(encoding, numel), np.uint8)
    compression.encode(values, encoding, payload)
    back = np.empty(numel, dtype)
    compression.decode(payload, encoding, back)
    error = np.abs(back.astype(np.float64) - values.astype(np.float64))
    if encoding == "bf16":
        as32 = np.abs(values.astype(np.float32).astype(np.float64))
        half_step = np.ldexp(1.0, np.frexp(as32)[1] - 9)  # half of 2^(e-8)
        # float64 inputs round to float32 first: up to half a float32 ulp more
        allowed = half_step + np.abs(values.astype(np.float64) - as32 * np.sign(values))
    else:
        blocks = -(-numel // compression.BLOCK)
        scales = payload[:4 * blocks].view(np.float32).astype(np.float64)
        step = np.repeat(scales, compression.BLOCK)[:numel]
        # decode multiplies code by scale in the values' dtype: one rounding of that product
        allowed = step / 2 + np.spacing(np.abs(back).astype(dtype)).astype(np.float64)
    assert (error <= allowed).all(), (error - allowed).max()


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_error_feedback_loses_nothing_over_the_rounds(encoding):
    """What was sent over all rounds, plus the final residual, is the sum of the true deltas
    (float64): quantization error is delayed, never dropped."""
    rng = np.random.default_rng(3)
    numel = 5000
    feedback = compression.ErrorFeedback(encoding, numel, np.float64)
    true_sum, sent_sum = np.zeros(numel), np.zeros(numel)
    decoded = np.empty(numel)
    for _ in range(40):
        delta = rng.standard_normal(numel) * rng.choice([1e-4, 1e-2, 1.0])
        true_sum += delta
        payload = np.empty(feedback.nbytes, np.uint8)
        feedback.encode(delta.copy(), payload)
        compression.decode(payload, encoding, decoded)
        sent_sum += decoded
    np.testing.assert_allclose(sent_sum + feedback.residual, true_sum, rtol=0, atol=1e-12)
    # and the residual is what one round's quantization may leave, not an accumulation
    assert np.abs(feedback.residual).max() < 0.5 * np.abs(true_sum).max()


def test_int4_and_int8_payloads_are_the_sizes_they_claim():
    assert compression.encoded_nbytes("int8", 512) == 512 + 8
    assert compression.encoded_nbytes("int4", 513) == 257 + 12
    assert compression.encoded_nbytes("bf16", 7) == 14
    # int4 is under a sixth of float32's bytes, block scales included
    assert compression.encoded_nbytes("int4", 10 ** 6) < 4 * 10 ** 6 / 6


# --- the outer optimizer ---------------------------------------------------------------

def test_sgd_with_lr_one_as_outer_optimizer_lands_exactly_on_the_average():
    """G - (G - A) is A to the bit: G and A are float32 values, the step runs in float64."""
    rng = np.random.default_rng(0)
    initial = rng.standard_normal(600).astype(np.float32)
    outer = OuterOptimizer(lambda p: torch.optim.SGD(p, lr=1.0), [(20, 25), (100,)], initial)
    for _ in range(30):
        average = (outer.theta.numpy() + rng.standard_normal(600)
                   * rng.choice([1e-6, 1e-2, 10.0], 600)).astype(np.float32)
        expected = average.copy()
        norm = outer.step(average)
        assert np.array_equal(average, expected)
        assert norm > 0


def test_nesterov_outer_steps_are_torchs_sgd_on_the_pseudo_gradient():
    """`outer_factory("nesterov")`'s steps, fed G - A, equal a hand-driven
    torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True) with that gradient."""
    rng = np.random.default_rng(1)
    g0 = rng.standard_normal(50)
    outer = OuterOptimizer(outer_factory("nesterov", None, None), [(50,)], g0)
    reference = torch.nn.Parameter(torch.from_numpy(g0.copy()))
    ref_opt = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(10):
        average = outer.theta.numpy() - rng.standard_normal(50) * 0.01
        reference.grad = reference.detach() - torch.from_numpy(average)
        ref_opt.step()
        outer.step(average)
        np.testing.assert_allclose(average, reference.detach().numpy(), rtol=0, atol=1e-15)


def test_a_callable_that_does_not_return_an_optimizer_is_a_config_error():
    with pytest.raises(ConfigError, match="outer_optimizer must return a torch.optim"):
        OuterOptimizer(lambda p: "sgd", [(3,)], np.zeros(3))
    with pytest.raises(ConfigError, match=r"outer_optimizer\(1 parameters\) failed"):
        OuterOptimizer(lambda p: torch.optim.SGD(p, lr=-1.0), [(3,)], np.zeros(3))


@pytest.mark.parametrize(("fields", "match"), [
    ({"outer_optimizer": "adam"}, "outer_optimizer='adam' is not supported"),
    ({"outer_optimizer": "nesterov", "outer_lr": 0.0}, "outer_lr must be positive"),
    ({"outer_optimizer": "nesterov", "outer_lr": float("nan")}, "outer_lr must be a finite"),
    ({"outer_optimizer": "momentum", "outer_momentum": 1.0}, r"outer_momentum must be in"),
    ({"outer_optimizer": "momentum", "outer_momentum": -0.1}, "outer_momentum must not be"),
    ({"outer_optimizer": "nesterov", "outer_momentum": 0.0}, "outer_momentum=0 with outer_"),
    ({"outer_lr": 0.5}, "outer_lr applies to outer_optimizer='nesterov'"),
    ({"outer_optimizer": lambda p: None, "outer_momentum": 0.5}, "the callable sets its own"),
    ({"averaging_warmup_steps": -1}, "averaging_warmup_steps must be at least 0"),
    ({"averaging_warmup_steps": 2.5}, "averaging_warmup_steps must be an integer"),
    ({"delta_compression": "fp8"}, "delta_compression='fp8' is not supported"),
    ({"delta_compression": "int4", "average_optimizer_state": True},
     "optimizer state is averaged as it is"),
    ({"mode": "async", "outer_optimizer": "nesterov"}, "outer_optimizer=.*mode='sync' only"),
    ({"mode": "async", "delta_compression": "int8"}, "delta_compression=.*mode='sync' only"),
    ({"mode": "async", "averaging_warmup_steps": 4}, "averaging_warmup_steps=.*'sync' only"),
])
def test_bad_averaging_settings_are_config_errors_naming_the_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**fields)


def test_the_warm_up_averages_every_step_then_every_k():
    schedule = Schedule(micro_batches_per_epoch=10, epochs=2, averaging_frequency=8,
                        warmup_steps=5)
    assert [schedule.steps_in_round(r) for r in range(schedule.num_rounds)] == \
        [1, 1, 1, 1, 1, 8, 7]
    assert schedule.round_start(6) == 13 and schedule.round_start(7) == 20
    # a warm-up longer than the fit: every step its own round
    short = Schedule(micro_batches_per_epoch=3, epochs=1, averaging_frequency=8,
                     warmup_steps=50)
    assert [short.steps_in_round(r) for r in range(short.num_rounds)] == [1, 1, 1]
    # epochs end inside the rounds they end in, warm-up or not
    assert [schedule.evaluates_after(r, None) for r in range(7)] == \
        [False, False, False, False, False, True, True]


# --- the driver transport over loopback: compressed deltas and outer steps -------------

def _exchange_rounds(step: GlobalStep | None, compress: str, rounds: int, numel: int = 700,
                     workers: int = 2):
    """`rounds` rounds between a loopback coordinator (with `step`) and `workers` driver
    channels in threads, each replica moving by its own random steps between rounds.
    Returns the driver's final global parameters, each worker's final replica, and each
    round's wire bytes."""
    secret = new_secret()
    rng = np.random.default_rng(11)
    start = rng.standard_normal(numel).astype(np.float32)
    config = TrainConfig(delta_compression=compress)
    replicas: list[np.ndarray] = [None] * workers
    failures: list[BaseException] = []
    wire: list[int] = []

    def worker(rank: int, address) -> None:
        try:
            moves = np.random.default_rng(100 + rank)
            channel = DriverChannel(address, Credential.of(secret, rank),
                                    connect_timeout=10, reply_timeout=10)
            buffer = FlatBuffer([torch.from_numpy(start.copy())], torch.float32)
            channel.configure(config, [(numel,)], 0)
            channel.open(msg.WorkerHello(rank=rank, host="h"))
            channel.receive_start(buffer.array)
            for r in range(rounds):
                buffer.array[:] -= (moves.standard_normal(numel) * 0.01).astype(np.float32)
                channel.exchange(RoundReport(round=r, samples=10 + rank, loss_sum=1.0,
                                             compute_s=0.0, setup_s=0.0, lr=None), buffer)
            channel.done([], np.zeros(0, np.uint8))
            replicas[rank] = buffer.array.copy()
            channel.close()
        except BaseException as exc:  # reported by the test, not lost in the thread
            failures.append(exc)

    with Coordinator(host="127.0.0.1", advertise="127.0.0.1", num_workers=workers,
                     secret=secret, timeout=10, dtype=np.float32, model_numel=numel,
                     check_job=lambda wait: None, step=step) as coord:
        threads = [threading.Thread(target=worker, args=(rank, coord.address))
                   for rank in range(workers)]
        for t in threads:
            t.start()
        coord.accept_workers(start, deadline_s=10)
        for r in range(rounds):
            wire.append(coord.run_round(r, model_numel=numel, allow_state=False,
                                        evaluate=False).wire_bytes)
        coord.finish()
        for t in threads:
            t.join(10)
        final = coord.average.copy()
    assert not failures, failures
    return final, replicas, wire


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("outer", [None, "nesterov"])
def test_the_driver_and_every_worker_apply_the_same_compressed_update(encoding, outer):
    numel = 700
    make = outer_factory(outer, None, None) if outer else None
    step = GlobalStep(numel=numel, dtype=np.float32, compression=encoding, warmup_rounds=2,
                      outer=OuterOptimizer(make, [(numel,)], np.zeros(0)) if make else None)
    final, replicas, wire = _exchange_rounds(step, encoding, rounds=6)
    for replica in replicas:
        assert np.array_equal(replica, final)  # bit for bit
    # every push up and the update down to each worker, compressed
    size = compression.encoded_nbytes(encoding, numel)
    assert wire == [4 * size] * 6


def test_uncompressed_rounds_move_the_whole_model_each_way():
    final, replicas, wire = _exchange_rounds(None, "none", rounds=3)
    assert all(np.array_equal(r, final) for r in replicas)
    assert wire == [2 * 2 * 700 * 4] * 3


def test_compressed_averaging_tracks_the_exact_average():
    """int8 deltas with error feedback, 20 rounds: the global parameters stay within a few
    quantization steps of the uncompressed fit's; without feedback they would drift."""
    exact, _, _ = _exchange_rounds(None, "none", rounds=20)
    step = GlobalStep(numel=700, dtype=np.float32, compression="int8", warmup_rounds=0,
                      outer=None)
    compressed, _, _ = _exchange_rounds(step, "int8", rounds=20)
    # a round's moves are ~0.01 a value: one int8 step of a block is ~3e-4
    assert np.abs(compressed - exact).max() < 2e-3


def test_global_state_round_trips_through_its_packed_form():
    numel = 300
    outer = OuterOptimizer(outer_factory("nesterov", None, None), [(numel,)], np.zeros(0))
    step = GlobalStep(numel=numel, dtype=np.float32, outer=outer, compression="int4",
                      warmup_rounds=0)
    rng = np.random.default_rng(5)
    global_ = rng.standard_normal(numel).astype(np.float32)
    outer.reset(global_)
    payloads = []
    for _ in range(2):
        feedback = compression.ErrorFeedback("int4", numel, np.float32)
        payload = np.empty(feedback.nbytes, np.uint8)
        feedback.encode((rng.standard_normal(numel) * 0.01).astype(np.float32), payload)
        payloads.append(payload)
    step.from_deltas(0, payloads, [1.0, 3.0], global_)
    layout, payload = pack_entries(step.state())
    twin = GlobalStep(numel=numel, dtype=np.float32, compression="int4", warmup_rounds=0,
                      outer=OuterOptimizer(outer_factory("nesterov", None, None), [(numel,)],
                                           np.zeros(0)))
    twin.restore(unpack(layout, payload), global_)
    assert np.array_equal(twin.ef.residual, step.ef.residual)
    assert torch.equal(twin.outer.state_dict()["state"][0]["momentum_buffer"],
                       step.outer.state_dict()["state"][0]["momentum_buffer"])
    # and both take the next round to the same bits
    a, b = global_.copy(), global_.copy()
    step.from_deltas(1, payloads, [1.0, 3.0], a)
    twin.from_deltas(1, payloads, [1.0, 3.0], b)
    assert np.array_equal(a, b)


def test_a_resume_tells_two_callable_outer_optimizers_apart_by_what_they_build():
    """Every lambda is "<lambda>": a checkpoint records what the callable builds, so a resume
    with Adam where SGD stepped, or another lr, is refused naming outer_optimizer."""
    def settings(make) -> dict:
        return outer_settings(TrainConfig(num_workers=2, outer_optimizer=make))

    sgd = settings(lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True))
    saved = Checkpoint(round=1, steps=2, params=np.zeros(3, np.float32), states=None,
                       fingerprint=sgd)
    schedule = Schedule(micro_batches_per_epoch=20, epochs=1, averaging_frequency=2)
    again = settings(lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True))
    check_resumable(saved, again, schedule=schedule, source="x")  # the same optimizer
    assert sgd["outer_lr"] == 0.7 and sgd["outer_momentum"] == 0.9  # logged as params too
    for other in (lambda p: torch.optim.Adam(p, lr=0.7),
                  lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9, nesterov=True)):
        with pytest.raises(ConfigError, match=r"outer_optimizer: checkpoint '\S*<lambda>: "
                                              r"torch\.optim\.sgd\.SGD\(.*lr=0\.7"):
            check_resumable(saved, settings(other), schedule=schedule, source="x")
    # a checkpoint from before, which recorded the callable by its name alone, resumes
    named = {"outer_optimizer": sgd["outer_optimizer"].split(": ")[0], "outer_lr": None,
             "outer_momentum": None}
    check_resumable(Checkpoint(round=1, steps=2, params=np.zeros(3, np.float32), states=None,
                               fingerprint=named), sgd, schedule=schedule, source="x")


def test_bf16_keeps_every_nan_a_nan_and_rounds_as_torch_does():
    """Rounding adds to the bits: a NaN whose mantissa is high would carry into ±0 or ±inf,
    and a diverged replica's delta would pass as finite. Finite values against torch's own
    bfloat16 conversion (round to nearest even), an independent computation."""
    nans = np.array([0xFFFFFFFF, 0x7FFFFFFF, 0xFFFF8001, 0x7F800001, 0x7FC00000],
                    np.uint32).view(np.float32)
    finite = np.random.default_rng(3).standard_normal(1000).astype(np.float32) * 1e3
    values = np.concatenate([nans, finite, np.float32([3.39e38, -3.4e38, 0.0, -0.0])])
    payload = np.empty(compression.encoded_nbytes("bf16", values.size), np.uint8)
    compression.encode(values, "bf16", payload)
    back = np.empty(values.size, np.float32)
    compression.decode(payload, "bf16", back)
    assert np.isnan(back[:nans.size]).all()
    expected = torch.from_numpy(values[nans.size:]).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(back[nans.size:], expected)
    assert np.signbit(back[-1]) and not np.signbit(back[-2])
