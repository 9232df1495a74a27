"""Sync mode in a task: k local steps, push the parameters, take the average, repeat; send
optimizer state at checkpoints and evaluation results when the driver asks. With
overlap_averaging, the average is taken while the next round computes (`averaging.overlap`)."""

from __future__ import annotations

import time
import traceback

from sparkdl_avg._config import TrainConfig
from sparkdl_avg._errors import PeerRefused, is_final
from sparkdl_avg.averaging.transport import RoundReport, Transport
from sparkdl_avg.data.partition import Partition
from sparkdl_avg.net import messages as msg
from sparkdl_avg.task.spec import WorkerSpec


def train_sync(spec: WorkerSpec, config: TrainConfig, rank: int, data: Partition, device,
               transport: Transport, hello: msg.WorkerHello) -> dict:
    """Train to the end; returns `Replica.outcome()` for the task's report."""
    from sparkdl_avg.averaging.flat_buffer import (
        FlatBuffer,
        averaged_tensors,
        trainable_parameters,
    )
    from sparkdl_avg.averaging.optimizer_state import averaged_state_tensors
    from sparkdl_avg.averaging.overlap import OverlappedExchange
    from sparkdl_avg.task import worker_state
    from sparkdl_avg.task.device import final_on_device_errors
    from sparkdl_avg.task.replica import Replica

    schedule = spec.schedule
    # Build the replica before connecting, so the driver's first round starts once all are
    # ready; a failure here is reported once connected, like any other.
    setup_error, replica, overlap = None, None, None
    try:
        with final_on_device_errors("build its replica on", str(device)):
            replica = Replica(spec, config, rank, data, device)
            model = replica.model
            flat = FlatBuffer(averaged_tensors(model), replica.wire_dtype)
            transport.configure(config, [tuple(p.shape) for p in trainable_parameters(model)],
                                schedule.warmup_rounds, wire_nbytes=flat.array.nbytes)
    except Exception as exc:
        setup_error = exc
    try:
        transport.open(hello)
        if setup_error is not None:
            raise setup_error
        if (host := transport.host_buffer(flat.array.dtype, flat.array.size)) is not None:
            # where a push is only named: the replica moves into the region
            flat = FlatBuffer(averaged_tensors(model), replica.wire_dtype, host=host)
        try:
            start = transport.receive_start(flat.array)
        except PeerRefused as exc:
            if exc.reason != "ended":
                raise
            # an elastic fit's late task (no slot until a worker finished): nothing to train
            replica.warnings.append("the fit ended before this task could join it")
            transport.close()
            return replica.outcome()
        ready = time.perf_counter()  # from here to a round's first step: setup (the picture)
        flat.scatter()
        replica.start(step=schedule.round_start(start.round))
        if start.state is not None:
            worker_state.restore(replica.optimizer, model, *start.state,
                                 scaler=replica.steps.scaler)
        if start.evaluate:  # round 0: the parameters every replica starts from
            _send_eval(replica, transport)
            ready = time.perf_counter()
        state: list = []
        overlap = OverlappedExchange(transport) if config.overlap_averaging else None
        wait_next, buffers_pushed = start.wait_next, None
        for round_index in range(start.round, schedule.num_rounds):
            t0 = time.perf_counter()
            setup_s = t0 - ready
            loss_sum, samples, _ = replica.run_steps(schedule.steps_in_round(round_index))
            compute_s = time.perf_counter() - t0
            if overlap is not None and overlap.pending:  # the round before's average
                reply = overlap.finish(flat)
                if reply.stop:  # that average is the fit's: this round's steps are dropped
                    break
                wait_next = reply.wait_next
            if config.average_optimizer_state:
                # Optimizer state appears lazily (after a parameter's first step): re-home it
                # into the wire buffer whenever the set of state tensors changes.
                current = averaged_state_tensors(replica.optimizer, replica.dtype)
                if [id(t) for t in current] != [id(t) for t in state]:
                    state = current
                    with final_on_device_errors("build its averaging buffer on", str(device)):
                        flat = FlatBuffer(averaged_tensors(model) + state, replica.wire_dtype)
            report = RoundReport(round=round_index, samples=samples,
                                 loss_sum=msg.finite_or_none(loss_sum), compute_s=compute_s,
                                 setup_s=setup_s, lr=replica.last_lr)
            if overlap is not None and not wait_next \
                    and round_index < schedule.num_rounds - 1:
                overlap.begin(report, flat)
                # should this average stop the fit, DONE carries the buffers as pushed
                buffers_pushed = worker_state.pack(None, model)
                ready = time.perf_counter()
                continue
            buffers_pushed = None
            reply = transport.exchange(report, flat)
            wait_next = reply.wait_next
            if reply.stop:  # early stopping: this average is the fit's
                break
            if reply.checkpoint:
                transport.send_state(*worker_state.pack(replica.optimizer, model,
                                                        replica.steps.scaler,
                                                        extra=transport.state()))
            if reply.evaluate:
                _send_eval(replica, transport)
            ready = time.perf_counter()
        transport.done(*(buffers_pushed or worker_state.pack(None, model)))
        return replica.outcome()
    except BaseException as exc:
        # the exchange in flight ends before the failure is sent; if it stopped the fit, the
        # failed steps were past the end: the worker is done
        if overlap is not None and (reply := overlap.close()) is not None and reply.stop:
            transport.done(*buffers_pushed)
            return replica.outcome()
        message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        transport.fail(message, final=is_final(exc))
        raise
    finally:
        try:
            if overlap is not None:
                overlap.close()
            transport.close()
        finally:
            if replica is not None:
                replica.close()


def _send_eval(replica, transport: Transport) -> None:
    """Evaluate the replica's parameters on its evaluation rows; the sums to the driver."""
    from sparkdl_avg._eval_sums import eval_message

    t_eval = time.perf_counter()
    result = replica.evaluate()
    transport.send_eval(*eval_message(result, time.perf_counter() - t_eval))
