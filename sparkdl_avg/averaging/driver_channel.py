"""A task's side of the "driver" transport: one authenticated TCP connection to the driver's
`coordinator`, every wait bounded. On the driver's host (`TrainConfig.shared_memory`), the
parameters go through shared memory instead (`net.shared_memory`): the task names a region
of its own in its hello; if the driver maps it, each push is copied there, and if the
driver names its own, each average is read from there."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import numpy as np

from sparkdl_avg.averaging.compression import RESIDUAL, ErrorFeedback, apply_update
from sparkdl_avg.averaging.coordinator import MAX_STATE_FACTOR
from sparkdl_avg.averaging.flat_buffer import WireBuffer
from sparkdl_avg.averaging.transport import RoundReply, RoundReport, StartPoint, Transport
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import HANDSHAKE_S, Credential, authenticate_to_server
from sparkdl_avg.net.dial import dial
from sparkdl_avg.net.frames import Connection, connect
from sparkdl_avg.net.shared_memory import SharedRegion
from sparkdl_avg.net.tls import client_context

log = logging.getLogger("sparkdl_avg")


class DriverChannel(Transport):
    def __init__(self, address: tuple[str, int], key: Credential, *, connect_timeout: float,
                 reply_timeout: float, tls_ca_pem: str | None = None) -> None:
        """`key`: this worker's own, claimed at the load monitor (`task.enrolment`).
        `connect_timeout`: for connecting (retried while the driver is busy) and, or
        `reply_timeout` if longer, for the first parameters, which come once every worker has
        loaded its partition (or at a round boundary). `reply_timeout`: for each later
        average."""
        self._address, self._key = address, key
        self._connect_timeout, self._reply_timeout = connect_timeout, reply_timeout
        self._tls = client_context(tls_ca_pem) if tls_ca_pem else None
        self._conn: Connection | None = None
        self._compression = "none"
        self._deltas: WorkerDeltas | None = None
        self._region: SharedRegion | None = None
        """Ours, for our pushes, until the driver says whether it mapped it."""
        self._params_shared = False
        self._shared_nbytes = 0

    def configure(self, config, trainable: list[tuple[int, ...]], warmup_rounds: int,
                  wire_nbytes: int = 0) -> None:
        self._compression = config.delta_compression
        self._shared_nbytes = wire_nbytes if config.shared_memory else 0
        # what is pushed is the replica itself, not a copy (overlap's) or a delta
        self._params_shared = config.delta_compression == "none" and \
            not config.overlap_averaging

    def host_buffer(self, dtype: np.dtype, numel: int) -> np.ndarray | None:
        """After `open`: our region, if the driver looks local, for the replica to live in
        when its pushes are itself: each push is then only named, and no copy made."""
        if self._region is None or not self._params_shared:
            return None
        return self._region.array(dtype, numel)

    def open(self, hello: msg.WorkerHello) -> None:
        def attempt(connect_s: float, until: float, tries: int) -> Connection:
            conn = connect(self._address, timeout=connect_s, max_payload=1 << 20,
                           tls=self._tls, tries=tries, until=until)
            try:
                authenticate_to_server(conn, self._key, self._hello(hello, conn))
            except BaseException:
                conn.close()
                raise
            return conn

        # the handshake gets what the driver gives it (HANDSHAKE_S): a client that gave up
        # sooner would leave the driver holding its rank for a dead connection
        self._conn = dial(attempt, self._connect_timeout, HANDSHAKE_S)
        self._conn.deadline = None
        # the start comes once the others have loaded, or (a late task of an elastic fit)
        # at the next round boundary: a round and its evaluation may take reply_timeout
        self._conn.set_timeout(max(self._connect_timeout, self._reply_timeout))

    def receive_start(self, params: np.ndarray) -> StartPoint:
        start, _ = msg.expect(self._conn, msg.Average, into=msg.into_checked(params, "the driver"))
        self._share(start, params.nbytes)
        # The driver times out a hung worker after round_timeout and names it; the others,
        # waiting on that worker's average, must not time out first and take the blame.
        self._conn.set_timeout(self._reply_timeout)
        # optimizer state (at checkpoints, and on restart) may be up to 3x the parameters
        self._conn.max_payload = MAX_STATE_FACTOR * params.nbytes + (1 << 20)
        state = global_state = None
        if start.state_follows:
            frame, payload = msg.expect(self._conn, msg.State)
            state = (frame.layout, payload)
        if start.global_follows:
            frame, payload = msg.expect(self._conn, msg.State)
            global_state = (frame.layout, payload)
        if self._compression != "none":
            self._deltas = WorkerDeltas(self._compression, params, state)
        return StartPoint(round=start.round + 1, state=state, wait_next=start.wait_next,
                          evaluate=start.evaluate, global_state=global_state)

    def _hello(self, hello: msg.WorkerHello, conn: Connection) -> msg.WorkerHello:
        """`hello`, naming a region of ours where the driver looks local (the connection's
        two ends have one address; the token, not this, proves it)."""
        if self._shared_nbytes and self._region is None and \
                conn.sock.getsockname()[0] == conn.sock.getpeername()[0]:
            self._region = SharedRegion.create(self._shared_nbytes)
        if self._region is None:
            return hello
        return dataclasses.replace(hello, shared=self._region.name)

    def _share(self, start: msg.Average, nbytes: int) -> None:
        """After the start: keep our region if the driver mapped it (its name can go now),
        and map the driver's if it named one."""
        region, self._region = self._region, None
        if region is not None:
            region.unlink()
            if start.shared_up:
                self._conn.shared_out = region
            else:
                region.close()
        if start.shared:
            self._conn.shared_in = SharedRegion.attach(start.shared, nbytes)
        if self._conn.shared_out is not None or self._conn.shared_in is not None:
            log.info("on the driver's host: pushes %s shared memory, averages %s",
                     *("through" if r is not None else "not through"
                       for r in (self._conn.shared_out, self._conn.shared_in)))

    def _payload(self, values: np.ndarray, params: np.ndarray) -> np.ndarray:
        """`values`, or their copy at the start of our region (then the frame only names
        it), if the driver mapped it and they fit. Where the replica (`params`) lives in
        the region, that is what is sent, as it is; nothing else may overwrite it."""
        region = self._conn.shared_out
        if region is None or region.holds(memoryview(values)) or \
                region.holds(memoryview(params)):
            return values  # over TCP, or where it is
        shared = region.array(values.dtype, values.size)
        if shared is None:
            return values  # too large: over TCP
        np.copyto(shared, values)
        return shared

    def exchange(self, report: RoundReport, flat: WireBuffer) -> RoundReply:
        params = flat.gather()
        push = msg.Push(**dataclasses.asdict(report), **msg.tensor(params),
                        encoding=self._compression,
                        shared_down=self._conn.shared_in is not None)
        if self._deltas is None:
            msg.send(self._conn, push, self._payload(params, params))
            reply, _ = msg.expect(self._conn, msg.Average,
                                  into=msg.into_checked(params, "the driver"))
        else:
            msg.send(self._conn, push, self._payload(self._deltas.encode(params), params))
            reply, _ = msg.expect(self._conn, msg.Average, into=self._deltas.receiving(params))
            self._deltas.apply(params)
        flat.scatter()
        return RoundReply(evaluate=reply.evaluate, checkpoint=reply.checkpoint,
                          stop=reply.stop, wait_next=reply.wait_next)

    def state(self) -> list[tuple[int, dict]]:
        return self._deltas.state() if self._deltas is not None else []

    def send(self, message: msg.Message, payload=None) -> None:
        msg.send(self._conn, message, payload)

    def expect(self, cls: type[msg.M]) -> msg.M:
        return msg.expect(self._conn, cls)[0]

    @property
    def local_address(self) -> str:
        """The address this task reaches the driver from: its cluster address."""
        return self._conn.sock.getsockname()[0]

    def send_state(self, layout: list, payload: np.ndarray) -> None:
        msg.send(self._conn, msg.State(layout=layout), payload)

    def send_eval(self, result: msg.Eval, payload: np.ndarray | None = None) -> None:
        msg.send(self._conn, result, payload)

    def done(self, layout: list, payload: np.ndarray) -> None:
        msg.send(self._conn, msg.Done(layout=layout), payload)

    def fail(self, message: str, final: bool) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                msg.send(self._conn, msg.WorkerFailed(message=message[:4000], final=final))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            if self._conn.shared_out is not None:
                self._conn.shared_out.close()
        if self._region is not None:  # never offered, or no start came
            self._region.close()


class WorkerDeltas:
    """A worker's side of compressed deltas: the global parameters G the workers share, the
    error feedback of what it sends (G minus its replica), and (from the driver) the update
    it receives."""

    def __init__(self, compression: str, start: np.ndarray,
                 state: tuple[list, memoryview | None] | None) -> None:
        from sparkdl_avg.task.worker_state import unpack

        self.compression = compression
        self.global_ = start.copy()
        self.feedback = ErrorFeedback(compression, start.size, start.dtype)
        saved = unpack(*state).get(RESIDUAL) if state is not None else None
        if saved is not None:  # a restart: the residual the checkpoint kept
            self.feedback.residual[:] = saved["residual"].numpy()
        self._delta = np.empty_like(start)
        self.finite = True
        """Whether the last delta encoded was finite."""
        self._push = np.empty(self.feedback.nbytes, np.uint8)
        self._update = np.empty(self.feedback.nbytes, np.uint8)

    def encode(self, params: np.ndarray) -> np.ndarray:
        """The payload of this round's push: G - params, plus the residual, compressed."""
        np.subtract(self.global_, params, out=self._delta)
        self.finite = bool(np.isfinite(self._delta).all())
        self.feedback.encode(self._delta, self._push)
        return self._push

    def receiving(self, params: np.ndarray):
        return msg.into_encoded(self._update, params, self.compression, "the driver")

    def apply(self, params: np.ndarray) -> None:
        """G minus the update received, as the driver applies it; the replica becomes G."""
        apply_update(self.global_, self._update, self.compression)
        params[:] = self.global_

    def state(self) -> list[tuple[int, dict]]:
        import torch

        return [(RESIDUAL, {"residual": torch.from_numpy(self.feedback.residual)})]
